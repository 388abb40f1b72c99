"""Fault-injection table (issue 28 item 6): each daemon killed at each moment of an OOM job.

    .venv/bin/colloc devcluster rootfs --release 26.05 -- \\
        .venv-slurm-26.05/bin/python benchmarks/faults.py --quick        (~20 min)
    ... benchmarks/faults.py --rows slurmctld@epilog,mariadb@running:60
    ... benchmarks/faults.py --outages                                   (~1.5 h)

Brings up a devcluster of its own at :data:`ROOT` (ports :data:`SPEC`), puts gate
lines ahead of colloc's Prolog and Epilog, runs every row of
:mod:`slurm_colloc.bench.faults` (two jobs per row: one that OOMs once and one
beside it), prints the table (jobs, records and requeues lost, nodes drained,
recovery and enforcement-back seconds, prolog p50/p99), a summary line and
``BENCH_JSON {...}``, writes the table to ``--out`` and takes the cluster down (its
logs kept under ``--logs``). Rows are independent: one that cannot run is reported
with its error and the next one runs.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

from slurm_colloc.bench import faults
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.devcluster.layout import Layout, Spec

ROOT = Path("/var/lib/colloc-bench-faults")
SPEC = Spec(ctld_port=19417, slurmd_port=19418, dbd_port=19419, mysql_port=19406)


def _rows(a: argparse.Namespace) -> list[faults.Row]:
    rows: list[faults.Row] = []
    if a.quick:
        rows += faults.quick_rows()
    if a.outages:
        rows += faults.outage_rows()
    for text in (a.rows or "").split(","):
        if text.strip():
            rows.append(faults.Row.parse(text))
    if not rows:
        raise SystemExit("nothing to run: --quick, --outages or --rows kind@moment[:s],...")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="every daemon at every moment, 5 s")
    ap.add_argument("--outages", action="store_true",
                    help="slurmctld and slurmdbd away 1, 5 and 15 minutes at the epilog")
    ap.add_argument("--rows", help="comma-separated kind@moment[:outage s]; kinds: "
                    + ", ".join(faults.KINDS) + "; moments: " + ", ".join(faults.MOMENTS))
    ap.add_argument("--out", type=Path, help="write the markdown table here")
    ap.add_argument("--root", type=Path, default=ROOT, help="the cluster's own root")
    ap.add_argument("--port-base", type=int, default=SPEC.ctld_port,
                    help="slurmctld's port; slurmd, slurmdbd and MariaDB use the next ones")
    ap.add_argument("--logs", type=Path, default=Path("/tmp/colloc-bench-faults-logs"),
                    help="where the cluster's logs are kept when it goes down")
    a = ap.parse_args()
    try:
        rows = _rows(a)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if os.geteuid() != 0:
        raise SystemExit("run as root inside the release's root filesystem (it starts a "
                         "devcluster): see the usage at the top of this file")
    p = a.port_base
    c = Cluster(Layout(a.root), Spec(ctld_port=p, slurmd_port=p + 1, dbd_port=p + 2,
                                     mysql_port=p - 11))
    c.down()
    outcomes: list[faults.Outcome] = []
    t0 = time.monotonic()
    try:
        c.up(timeout=120, fresh=True)
        workdir = a.root / "jobs" / "faults"
        workdir.mkdir(parents=True, exist_ok=True)
        workdir.chmod(0o1777)
        with faults.Suite(c, workdir).installed() as suite:
            for row in rows:
                print(f"-- {row.label}", flush=True)
                try:
                    o = suite.run_row(row)
                except (faults.FaultError, TimeoutError) as e:
                    o = faults.Outcome(row, notes=[f"suite error: {e}"])
                outcomes.append(o)
                print(faults.table([o]).splitlines()[-1], flush=True)
    finally:
        c.down(keep_logs=a.logs)
    text = faults.table(outcomes)
    print(f"\n{text}\n\n{faults.summary(outcomes)} ({time.monotonic() - t0:.0f} s)")
    if a.out:
        a.out.write_text(f"{text}\n\n{faults.summary(outcomes)}\n")
    print("BENCH_JSON " + json.dumps([{**asdict(o), "row": o.row.label, "ok": o.ok}
                                      for o in outcomes]))


if __name__ == "__main__":
    main()
