"""Accounting away for minutes while jobs end: lost records, time to record.

    .venv/bin/python benchmarks/fault_accounting.py [--outage 240] [--jobs 4] [--oom 2]
    (as root, inside the release's root filesystem like the e2e tests; about
    outage + 3 min)

Issue 28's fault row: slurmdbd and MariaDB down for 243 s while four jobs end (two
of them OOM, requeued on a whole GPU) lost 4 of 6 records. This brings up a cluster
of its own at :data:`ROOT` (ports :data:`SPEC`), submits ``--jobs`` simulated jobs
(``--oom`` of them OOM once), stops slurmdbd and MariaDB as soon as all run, keeps
them down ``--outage`` seconds, starts them again and polls ``sacct`` until every
attempt's colloc record is in accounting or ``--wait`` seconds pass. It prints the
expected and recorded attempts, the lost records, and the time from the restart to
each job's complete record (median, max), then ``BENCH_JSON {...}``; the cluster is
taken down afterwards (also on error or Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time
from pathlib import Path

from slurm_colloc import config as cfgmod
from slurm_colloc.accounting.field import record_in
from slurm_colloc.accounting.newest import attempt_numbers
from slurm_colloc.devcluster import daemons
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.devcluster.layout import Layout, Spec
from slurm_colloc.slurm.adapter import SlurmCli, SlurmError, by_start

ROOT = Path("/var/lib/colloc-bench-fault-accounting")
SPEC = Spec(ctld_port=19317, slurmd_port=19318, dbd_port=19319, mysql_port=19306)
OK_JOB = "colloc-simjob --mem 2G --seconds 5"
OOM_JOB = "colloc-simjob --mem 3G --peak 9G --peak-at 0.3 --seconds 4"


def _submit(c: Cluster, d: Path, body: str, shards: int) -> int:
    import subprocess

    script = d / f"job-{len(list(d.iterdir()))}.sh"
    script.write_text("#!/bin/bash\n" + body + "\n")
    script.chmod(0o755)
    cp = subprocess.run(["sbatch", "--parsable", f"--chdir={d}", f"--output={d}/%j.out",
                         f"--gres=shard:{shards}", str(script)], env=c.env(),
                        capture_output=True, text=True, check=True)
    return int(cp.stdout.strip().split(";")[0])


def _stop(c: Cluster, name: str, exe: str) -> None:
    pid = c.status()[name]
    if pid is None:
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while daemons.pid_runs(pid, exe) and time.monotonic() < deadline:
        time.sleep(0.2)


def _recorded(slurm: SlurmCli, job: int, field: cfgmod.RecordField) -> frozenset[int]:
    try:
        rows = by_start(slurm.accounting([job]))
    except SlurmError:
        return frozenset()
    got: frozenset[int] = frozenset()
    for r in rows:
        got |= attempt_numbers(record_in(r.fields, field))
    return got


def run(c: Cluster, outage: float, n_jobs: int, n_oom: int, wait: float) -> dict[str, object]:
    slurm = SlurmCli(env=c.env())
    cfg = cfgmod.load(c.layout.colloc_conf)
    d = c.layout.root / "jobs" / "fault-accounting"
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o1777)
    want: dict[int, frozenset[int]] = {}
    for i in range(n_jobs):
        oom = i < n_oom
        j = _submit(c, d, OOM_JOB if oom else OK_JOB, 6 if oom else 4)
        want[j] = frozenset({0, 1}) if oom else frozenset({0})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all(
            (slurm.show_job(j) or {}).get("JobState") == "RUNNING" for j in want):
        time.sleep(0.5)
    _stop(c, "slurmdbd", "slurmdbd")
    _stop(c, "mariadb", "mariadbd")
    t_down = time.monotonic()
    time.sleep(outage)
    c.up(install=False, timeout=120)  # starts what is missing: MariaDB, then slurmdbd
    back = time.monotonic()
    reached: dict[int, float] = {}
    while time.monotonic() - back < wait and len(reached) < len(want):
        for j, need in want.items():
            if j not in reached and need <= _recorded(slurm, j, cfg.record_field):
                reached[j] = time.monotonic() - back
        time.sleep(2)
    got = {j: sorted(_recorded(slurm, j, cfg.record_field)) for j in want}
    expected = sum(len(v) for v in want.values())
    recorded = sum(len(set(got[j]) & want[j]) for j in want)
    times = sorted(reached.values())
    return {"outage_s": round(back - t_down), "jobs": n_jobs, "oom_jobs": n_oom,
            "attempts_expected": expected, "attempts_recorded": recorded,
            "records_lost": expected - recorded,
            "time_to_record_s": {"median": round(statistics.median(times), 1) if times else None,
                                 "max": round(times[-1], 1) if times else None},
            "per_job": {str(j): got[j] for j in want}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--outage", type=float, default=240.0, help="seconds accounting is down")
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--oom", type=int, default=2, help="how many of the jobs OOM once")
    ap.add_argument("--wait", type=float, default=600.0,
                    help="seconds after the restart to wait for the records")
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root (it starts a devcluster)")
    c = Cluster(Layout(ROOT), SPEC)
    c.down()
    try:
        c.up(timeout=120, fresh=True)
        out = run(c, a.outage, a.jobs, a.oom, a.wait)
    finally:
        c.down()
    print(f"accounting down {out['outage_s']} s, {a.jobs} jobs ({a.oom} OOM, requeued): "
          f"{out['attempts_recorded']}/{out['attempts_expected']} attempt records in "
          f"accounting, {out['records_lost']} lost; time from the restart to a job's "
          f"complete record: median {out['time_to_record_s']['median']} s, "  # type: ignore[index]
          f"max {out['time_to_record_s']['max']} s")  # type: ignore[index]
    print("BENCH_JSON " + json.dumps(out))


if __name__ == "__main__":
    main()
