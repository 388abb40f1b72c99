"""A burst of GPU jobs on one node: prolog wall/CPU p50 and p99, lost jobs and requeues.

    .venv/bin/colloc devcluster rootfs --release 26.05 -- \\
        /work/main/.venv-slurm-26.05/bin/python benchmarks/prolog_burst.py --jobs 150 --oom 30
    (as root, inside the release's root filesystem like the e2e tests; a few minutes)

Issue 28: a burst of 150 shard jobs (30 of them OOM once and are requeued on a whole
GPU) submitted within ~2.5 s on the one-node devcluster (4 simulated GPUs with
shards) put tens of prologs on the node at once, and a job starts only when its
prolog ends. This brings up a cluster of its own at :data:`ROOT` (ports
:data:`SPEC`), submits the burst (``--submitters`` sbatch at a time), waits until
every job is done, and reads every prolog's ``[took W s, cpu C s]`` from colloc's
node log (colloc.conf ``log_file``). It prints the lost jobs (not COMPLETED), the
lost requeues (an OOM job never requeued), prolog wall p50/p99 and CPU p50, then
``BENCH_JSON {...}``, and writes ``--out`` (markdown); the cluster is taken down
afterwards (also on error or Ctrl-C).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from slurm_colloc import config as cfgmod
from slurm_colloc.bench import burst
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.devcluster.layout import Layout, Spec
from slurm_colloc.slurm.adapter import SlurmCli, SlurmError

ROOT = Path("/var/lib/colloc-bench-burst")
SPEC = Spec(ctld_port=19517, slurmd_port=19518, dbd_port=19519, mysql_port=19506)
OK_JOB = "colloc-simjob --mem 2G --seconds 5"
OOM_JOB = "colloc-simjob --mem 3G --peak 9G --peak-at 0.3 --seconds 4"
FINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY",
                   "NODE_FAIL", "BOOT_FAIL", "DEADLINE", "PREEMPTED"})


def _script(d: Path, name: str, body: str) -> Path:
    path = d / name
    path.write_text("#!/bin/bash\n" + body + "\n")
    path.chmod(0o755)
    return path


AS_OTHER_HOST = 'echo "$0" > /proc/self/autogroup 2>/dev/null || :; exec "$@"'
"""``sh -c`` body: the command in a session of its own whose CPU group has the weight of
nice ``$0`` (:func:`slurm_colloc.priority.raise_session`), then exec'd."""


def _sbatch(c: Cluster, d: Path, script: Path, shards: int, nice: int = 0) -> int:
    """Submit one job; ``nice`` != 0: as from a login node (``--submitter-nice``)."""
    argv = ["sbatch", "--parsable", f"--chdir={d}", f"--output={d}/%j.out",
            f"--gres=shard:{shards}", str(script)]
    if nice:
        argv = ["sh", "-c", AS_OTHER_HOST, str(nice), *argv]
    cp = subprocess.run(argv, env=c.env(), capture_output=True, text=True, check=True,
                        start_new_session=bool(nice))
    return int(cp.stdout.strip().split(";")[0])


def submit(c: Cluster, n_jobs: int, n_oom: int, submitters: int,
           nice: int = 0) -> tuple[list[int], list[int], float]:
    """The burst, ``submitters`` sbatch at a time; (all jobs, OOM jobs, seconds taken).

    The OOM jobs are spread through the burst (every ``n_jobs // n_oom``-th). ``nice``:
    the submitters' CPU weight (``--submitter-nice``)."""
    d = c.layout.root / "jobs" / "prolog-burst"
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o1777)
    ok, oom = _script(d, "ok.sh", OK_JOB), _script(d, "oom.sh", OOM_JOB)
    step = max(1, n_jobs // n_oom) if n_oom else 0
    is_oom = [bool(step) and i % step == 0 and i // step < n_oom for i in range(n_jobs)]
    t0 = time.monotonic()
    with ThreadPoolExecutor(submitters) as pool:
        ids = list(pool.map(lambda o: _sbatch(c, d, oom if o else ok, 6 if o else 4, nice),
                             is_oom))
    took = time.monotonic() - t0
    return ids, [j for j, o in zip(ids, is_oom, strict=True) if o], took


def wait_done(slurm: SlurmCli, ids: list[int], oom: list[int],
              timeout: float) -> dict[int, tuple[str, int]]:
    """Poll until every job is in a final state and every OOM job has been requeued
    (or 60 s have passed with all final); (state, restarts) per job."""
    deadline = time.monotonic() + timeout
    all_final_since = None
    seen: dict[int, tuple[str, int]] = {}
    while time.monotonic() < deadline:
        try:
            jobs = slurm.jobs()
        except SlurmError:
            time.sleep(2)
            continue
        seen = {j: (jobs[j].state, jobs[j].restarts) if j in jobs else ("MISSING", 0)
                for j in ids}
        if all(s in FINAL for s, _ in seen.values()):
            all_final_since = all_final_since or time.monotonic()
            if all(seen[j][1] >= 1 for j in oom) or time.monotonic() - all_final_since > 60:
                return seen
        else:
            all_final_since = None
        time.sleep(2)
    return seen


def _log_lines(path: Path, offset: int) -> list[str]:
    with open(path, errors="replace") as f:
        f.seek(offset)
        return f.read().splitlines()


def run(c: Cluster, n_jobs: int, n_oom: int, submitters: int, timeout: float,
        submitter_nice: int = 0) -> dict[str, object]:
    slurm = SlurmCli(env=c.env())
    log = Path(cfgmod.load(c.layout.colloc_conf).log_file or "")
    offset = log.stat().st_size if log.is_file() else 0
    t0 = time.monotonic()
    ids, oom, took = submit(c, n_jobs, n_oom, submitters, submitter_nice)
    final = wait_done(slurm, ids, oom, timeout)
    done = time.monotonic() - t0
    time.sleep(3)  # the last epilogs' lines
    runs = burst.prolog_runs(_log_lines(log, offset), ids)
    return {"jobs": n_jobs, "oom_jobs": n_oom, "submit_s": round(took, 1),
            "done_s": round(done, 1),
            "lost_jobs": burst.lost_jobs({j: s for j, (s, _) in final.items()}),
            "lost_requeues": burst.lost_requeues({j: r for j, (_, r) in final.items()}, oom),
            "prolog": burst.summarize(runs),
            "prolog_modes": {m: sum(r.mode == m for r in runs) for m in {r.mode for r in runs}},
            "slowest": [[r.job_id, r.wall_s, r.cpu_s, r.mode]
                        for r in sorted(runs, key=lambda r: -r.wall_s)[:5]],
            "first_job": min(ids)}


def server_off(c: Cluster) -> None:
    """colloc.conf ``script_server_idle_s = 0``: every script in its own process."""
    conf = c.layout.colloc_conf
    conf.write_text("script_server_idle_s = 0\n" + conf.read_text())  # before any [table]


def warm_up(c: Cluster, n: int) -> None:
    """``n`` small jobs run to the end before the burst, as on a node that has run a job
    within ``script_server_idle_s``: its script server and collector are up."""
    d = c.layout.root / "jobs" / "warm-up"
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o1777)
    job = _script(d, "warm.sh", "colloc-simjob --mem 1G --seconds 1")
    ids = [_sbatch(c, d, job, 4) for _ in range(n)]
    wait_done(SlurmCli(env=c.env()), ids, [], 300)


def controller_nice(c: Cluster, nice: int) -> None:
    """Renice slurmctld, slurmdbd and MariaDB (every thread): ``--controller-nice``.

    On a site these run on a controller host of their own; the one-node lab runs them
    on the same two cores as the burst's 30-odd starting jobs, so ``squeue`` from a
    prolog waits for a controller that the jobs starve. A negative value models the
    dedicated host (the lab's stand-in, not a recommendation for sites). Where the
    kernel shares the CPUs between sessions first (autogroup), each daemon is a session
    of its own and a nice value counts only inside it: its session's group is weighted
    too."""
    from slurm_colloc.devcluster.daemons import read_pid

    L = c.layout
    for pid_file in (L.run / "slurmctld.pid", L.run / "slurmdbd.pid", L.mysql / "mariadb.pid"):
        pid = read_pid(pid_file)
        if pid is None:
            raise SystemExit(f"--controller-nice: no {pid_file}")
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        if os.getsid(pid) == pid:  # its session's CPU group is its own (priority.py)
            with contextlib.suppress(OSError):  # a kernel without autogroup
                Path(f"/proc/{pid}/autogroup").write_text(f"{nice}\n")


def one_variant(a: argparse.Namespace, server: str) -> dict[str, object]:
    """A fresh cluster, the warm-up, the burst; the cluster goes down afterwards."""
    c = Cluster(Layout(ROOT), SPEC)
    c.down()
    keep = Path(f"{a.keep_logs}-{server}") if a.keep_logs else None
    try:
        c.up(timeout=120, fresh=True)
        if server == "off":
            server_off(c)
        if a.controller_nice:
            controller_nice(c, a.controller_nice)
        if a.warmup:
            warm_up(c, a.warmup)
        out = run(c, a.jobs, a.oom, a.submitters, a.timeout, a.submitter_nice)
    finally:
        c.down(keep_logs=keep)
    out["variant"] = f"{a.variant} script server {server}".strip()
    out["script_server"] = server
    out["warmup_jobs"] = a.warmup
    out["controller_nice"] = a.controller_nice
    out["submitter_nice"] = a.submitter_nice
    return out


def _summary(out: dict[str, object]) -> str:
    s = out["prolog"]
    assert isinstance(s, dict)
    lost_jobs, lost_rq = out["lost_jobs"], out["lost_requeues"]
    assert isinstance(lost_jobs, list) and isinstance(lost_rq, list)
    return (f"[{out['variant']}] {out['jobs']} jobs ({out['oom_jobs']} OOM once) submitted in "
            f"{out['submit_s']} s, all done after {out['done_s']} s; lost jobs "
            f"{len(lost_jobs)}, lost requeues {len(lost_rq)}; {s['prologs']} prologs: wall "
            f"p50 {s['wall_p50_s']} s, p99 {s['wall_p99_s']} s, max {s['wall_max_s']} s; "
            f"CPU p50 {s['cpu_p50_s']} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=150)
    ap.add_argument("--oom", type=int, default=30, help="how many of the jobs OOM once")
    ap.add_argument("--submitters", type=int, default=8, help="sbatch calls at a time")
    ap.add_argument("--timeout", type=float, default=1500.0, help="seconds to wait for the jobs")
    ap.add_argument("--variant", default="", help="a label for the result (e.g. baseline)")
    ap.add_argument("--script-server", default="on",
                    help="on, off, or both ('off,on': one cluster each, one after the "
                         "other, and their ratio)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="small jobs run before the burst (0: a cold node)")
    ap.add_argument("--controller-nice", type=int, default=0,
                    help="renice slurmctld, slurmdbd and MariaDB (a dedicated controller "
                         "host's CPU, modelled on the lab's shared cores; default 0: as is)")
    ap.add_argument("--submitter-nice", type=int, default=-10,
                    help="each sbatch in a session of its own at this CPU weight: the "
                         "burst's submissions as from login nodes, which a busy compute "
                         "node does not slow (issue 28's burst: 150 jobs within ~2.5 s); "
                         "0: plain sbatch processes on the lab's shared cores")
    ap.add_argument("--keep-logs", default=None, help="copy the cluster's logs here at the end")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "prolog-burst.md"),
                    help="the markdown result (empty: none)")
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root (it starts a devcluster)")
    servers = [v.strip() for v in a.script_server.split(",") if v.strip()]
    if not servers or any(v not in ("on", "off") for v in servers):
        raise SystemExit("--script-server: on, off or off,on")
    outs = [one_variant(a, v) for v in servers]
    for out in outs:
        print(_summary(out))
        print("BENCH_JSON " + json.dumps(out))
    if len(outs) == 2:
        p99 = [o["prolog"]["wall_p99_s"] for o in outs]  # type: ignore[index]
        if all(p99):
            print(f"prolog wall p99, {servers[1]} / {servers[0]}: {p99[1] / p99[0]:.2f}")
    if a.out:
        cmd = " ".join(["prolog_burst.py", *sys.argv[1:]])
        Path(a.out).write_text("\n".join(burst.markdown(o, cmd) for o in outs))


if __name__ == "__main__":
    main()
