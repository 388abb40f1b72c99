"""Overhead of the node collector: 8 simulated GPUs, 16 jobs, 1 Hz.

Target (issue 6): at most 1 % of one core and 60 MB RSS. One command:

    .venv/bin/python benchmarks/sidecar_overhead.py [--seconds 60] [--gpus 8] [--jobs 16]

It creates a throwaway sim state dir, starts ``--jobs`` idle processes that carry
``SLURM_JOB_ID`` in their environment (as Slurm jobs do) and registers each on a GPU
(two per GPU) with changing memory, runs the real collector
(``python -m slurm_colloc.metrics.collector``) and reads its CPU time and peak RSS
(VmHWM) from /proc just before it stops. The prolog-side probe is timed too.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from slurm_colloc.gpu.sim.state import ProcRecord, init_state, process_start_ticks, write_record


def cpu_seconds(pid: int) -> float:
    rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def vm(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])  # kB
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--jobs", type=int, default=16)
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="colloc-bench-"))
    state, metrics = tmp / "sim", tmp / "metrics"
    init_state(state, gpu_count=a.gpus)
    conf = tmp / "colloc.conf"
    conf.write_text(f'gpu_backend = "sim"\nsim_state_dir = "{state}"\n'
                    f'metrics_dir = "{metrics}"\nlog_file = ""\nsample_interval_s = 1.0\n')
    jobs = []
    for j in range(a.jobs):
        env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": str(1000 + j)}
        jobs.append(subprocess.Popen(["sleep", str(a.seconds + 30)], env=env))
    time.sleep(0.2)

    def register(tick: int) -> None:
        for j, proc in enumerate(jobs):
            ticks = process_start_ticks(proc.pid)
            assert ticks is not None
            write_record(state, ProcRecord(pid=proc.pid, gpu=j % a.gpus, uid=os.getuid(),
                                           used_mib=2000 + 100 * ((tick + j) % 20), sm_pct=30.0,
                                           start_ticks=ticks, job_id=str(1000 + j)))

    register(0)
    env = {**os.environ, "COLLOC_CONF": str(conf)}
    # the sampling loop itself (the supervisor, which only waits on it, is left out)
    col = subprocess.Popen([sys.executable, "-m", "slurm_colloc.metrics.collector",
                            "--no-supervisor", "--seconds", str(a.seconds + 5)], env=env)
    time.sleep(3)  # start-up (imports) is not steady-state cost; measured separately
    startup_cpu = cpu_seconds(col.pid)
    t0, c0 = time.monotonic(), cpu_seconds(col.pid)
    tick = 0
    while time.monotonic() - t0 < a.seconds:
        time.sleep(1)
        tick += 1
        register(tick)
    wall, cpu = time.monotonic() - t0, cpu_seconds(col.pid) - c0
    hwm, rss = vm(col.pid, "VmHWM"), vm(col.pid, "VmRSS")
    col.terminate()
    col.wait(10)
    for proc in jobs:
        proc.kill()
        proc.wait()
    rows = sum(1 for f in (metrics / "jobs").glob("*/series-0.tsv")
               for line in f.read_text().splitlines() if not line.startswith("#"))

    from slurm_colloc.node.metrics_launch import collector_running

    n = 2000
    s = time.perf_counter()
    for _ in range(n):
        collector_running(str(metrics))
    probe_us = (time.perf_counter() - s) / n * 1e6

    cpu_pct = cpu / wall * 100
    print(f"collector, {a.gpus} GPUs x {a.jobs} jobs at 1 Hz for {wall:.0f}s "
          f"(sim backend, {rows} rows written)")
    print(f"  CPU   {cpu_pct:.3f}% of one core   target 1%     ratio {cpu_pct / 1.0:.3f}")
    print(f"  RSS   {hwm / 1024:.1f} MB peak ({rss / 1024:.1f} MB now)   target 60 MB  "
          f"ratio {hwm / 1024 / 60:.3f}")
    print(f"  start-up CPU (imports, once per collector life) {startup_cpu:.2f}s")
    print(f"  prolog probe (collector already running) {probe_us:.1f} us")
    ok = cpu_pct <= 1.0 and hwm / 1024 <= 60
    print("  PASS" if ok else "  FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
