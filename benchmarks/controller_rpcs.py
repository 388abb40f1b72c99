"""Controller RPCs our node scripts make per job, read from ``sdiag`` (issue 11, M3).

    .venv/bin/python benchmarks/controller_rpcs.py [--root DIR] [-n 20]
    .venv/bin/python benchmarks/controller_rpcs.py --own-cluster [-n 20]

On a running devcluster (``make devcluster-up``), or with ``--own-cluster`` on a
cluster of its own (root /var/lib/colloc-bench-rpcs, ports 19217-19219 and 19206,
brought up and always taken down, so a developer's cluster is never touched): resets
sdiag, submits N jobs as an unprivileged user (half 2-shard MPS jobs, half whole-GPU
jobs, one in five failing with a host error so the epilog scans logs), waits on
slurmdbd only (``sacct``, so the harness adds no controller RPCs), then reads sdiag's
per-message-type counts. The last line is the figures as JSON (``BENCH_JSON {...}``,
read by benchmarks/across_releases.py).
Job queries (``REQUEST_JOB_INFO*``) and job updates/requeues come only from our
node scripts; slurmd's own messages (``REQUEST_COMPLETE_BATCH_SCRIPT`` and the like)
are Slurm's and listed separately. Target: at most 1 controller call per job; the
issue measured about 12 before (3.7 scontrol show job + 1.2 squeue + the record
writer's 120 s polling).
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import time
from pathlib import Path
from types import FrameType

import pandas as pd
from bench_cleanup import end_leftovers

from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.devcluster.layout import Layout, Spec

OURS = re.compile(r"^(REQUEST_JOB_INFO|REQUEST_JOB_INFO_SINGLE|REQUEST_UPDATE_JOB|"
                  r"REQUEST_JOB_REQUEUE|REQUEST_JOB_USER_INFO|REQUEST_NODE_INFO|"
                  r"REQUEST_PARTITION_INFO|REQUEST_JOB_READY|REQUEST_RESOURCE_ALLOCATION|"
                  r"REQUEST_FED_INFO)$")
USER = "colloc-u1"
OWN_ROOT = Path("/var/lib/colloc-bench-rpcs")
OWN_SPEC = Spec(ctld_port=19217, slurmd_port=19218, dbd_port=19219, mysql_port=19206)
"""``--own-cluster``: a root and ports no other devcluster, test or benchmark uses."""
JSON_PREFIX = "BENCH_JSON "
"""The last line of the output: the figures as one JSON object (benchmarks/across_releases.py)."""


def sdiag_by_type(env: dict[str, str]) -> pd.DataFrame:
    """sdiag's 'Remote Procedure Call statistics by message type' as a table."""
    text = subprocess.run(["sdiag"], env=env, capture_output=True, text=True,
                          check=True).stdout
    rows = []
    section = text.split("by message type", 1)[-1].split("by user", 1)[0]
    for line in section.splitlines():
        m = re.match(r"\s*(\w+)\s*\(\s*\d+\)\s+count:(\d+)", line)
        if m:
            rows.append({"message": m.group(1), "count": int(m.group(2))})
    return pd.DataFrame(rows, columns=["message", "count"])


def _terminate(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # run the ``finally`` that takes our cluster down


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path("/var/lib/colloc-devcluster"))
    ap.add_argument("--own-cluster", action="store_true",
                    help=f"bring up a cluster of its own at {OWN_ROOT} (ports "
                         f"{OWN_SPEC.ctld_port}..), measure, take it down")
    ap.add_argument("-n", type=int, default=20)
    a = ap.parse_args()
    if not a.own_cluster:
        measure(Cluster.at(a.root), a.n)
        return
    signal.signal(signal.SIGTERM, _terminate)
    cluster = Cluster(Layout(OWN_ROOT), OWN_SPEC)
    try:
        cluster.down()  # a leftover of an interrupted run
        cluster.up()
        measure(cluster, a.n)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # no second signal mid-teardown
        cluster.down()
        end_leftovers(cluster.layout.slurm_conf)  # the epilogs' detached record writers


def measure(cluster: Cluster, n: int) -> None:
    """Submit ``n`` jobs on ``cluster`` and print the controller calls per job."""
    env = cluster.env()
    subprocess.run(["useradd", "--system", "--no-create-home", USER], check=False,
                   capture_output=True)
    cluster.add_user(USER)
    work = cluster.layout.root / "jobs" / "bench-rpcs"
    work.mkdir(parents=True, exist_ok=True)
    work.chmod(0o1777)
    subprocess.run(["sdiag", "-r"], env=env, check=True, capture_output=True)
    ids = []
    for i in range(n):
        gres = "--gres=shard:2" if i % 2 == 0 else "--gres=gpu:1"
        body = "colloc-simjob --mem 1G --seconds 1" + ("\nexit 3" if i % 5 == 4 else "")
        cp = subprocess.run(
            ["runuser", "-u", USER, "--", "sbatch", "--parsable", f"--chdir={work}",
             f"--output={work}/%j.out", gres, "--wrap", body],
            env=env, capture_output=True, text=True, check=True)
        ids.append(cp.stdout.strip().split(";")[0])
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "State", "-j", ",".join(ids)],
                             env=env, capture_output=True, text=True).stdout.split()
        if len(out) >= len(ids) and not any(s in ("PENDING", "RUNNING", "COMPLETING")
                                            for s in out):
            break
        time.sleep(2)
    time.sleep(15)  # epilogs and detached writers finish after the state turns final
    df = sdiag_by_type(env)
    ours = df[df.message.str.match(OURS)]
    total = int(ours["count"].sum())
    slurm = df[~df.message.str.match(OURS)]
    print(f"{n} jobs ({n // 2 + n % 2} shard, {n // 2} whole GPU)")
    print(ours.to_string(index=False) if len(ours) else "(no job queries or updates)")
    print(f"\nnode-script controller calls per job: {total / n:.2f} "
          f"(target <= 1.00; before issue 11: ~12)")
    print("Slurm's own messages (not ours):")
    print(slurm.to_string(index=False))
    figures = {
        "benchmark": "controller_rpcs", "jobs": n, "calls_per_job": total / n,
        "ours": dict(zip(ours.message, map(int, ours["count"]), strict=True)),
        "slurm": dict(zip(slurm.message, map(int, slurm["count"]), strict=True)),
    }
    print(JSON_PREFIX + json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
