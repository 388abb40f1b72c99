"""What the Prolog + TaskProlog add to a job start, and the Epilog's time on a 1 GB log.

Runs the real node-script wrappers (exactly what slurmd executes, with the
environment slurmd gives them) against a devcluster, for a held shard job:

* prolog cold: no MPS daemon for the (GPU, user) yet, so the prolog starts one;
* prolog warm: the daemon already serves another job of the user on that GPU;
* task prolog: reading the prepared settings as the user;
* epilog: no OOM (job exit 0), and a failed job whose 1 GB log ends in a GPU OOM
  (the scan reads only the tail; requeue disabled here so the job stays put).

Usage (root):  .venv/bin/python benchmarks/node_script_overhead.py [--runs 15]
Uses its own devcluster root and ports (always taken down, also on SIGTERM); takes
about a minute. The last line is the figures as JSON (``BENCH_JSON {...}``, read by
benchmarks/across_releases.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from types import FrameType

from bench_cleanup import end_leftovers

from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.devcluster.layout import Layout, Spec

ROOT = Path("/var/lib/colloc-bench-node")
SPEC = Spec(ctld_port=19117, slurmd_port=19118, dbd_port=19119, mysql_port=19106)
JSON_PREFIX = "BENCH_JSON "


def _terminate(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # run the ``finally`` that takes our cluster down


def _run(wrapper: Path, env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([str(wrapper)], env=env, check=True, capture_output=True)
    return time.perf_counter() - t0


def _held_job(cluster: Cluster, shards: int, out: str) -> int:
    cp = subprocess.run(
        ["sbatch", "--parsable", "--hold", f"--gres=shard:{shards}", f"--output={out}",
         "--wrap", "true"],
        env=cluster.env(), capture_output=True, text=True, check=True,
    )
    return int(cp.stdout.strip().split(";")[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, _terminate)
    cluster = Cluster(Layout(ROOT), SPEC)
    try:
        cluster.down()  # a leftover of an interrupted run
        cluster.up()
        bin_ = cluster.layout.bin
        base = {"SLURM_JOB_UID": "0", "SLURM_JOB_USER": "root", "SLURM_JOB_GPUS": "0",
                "SLURMD_NODENAME": cluster.spec.node_name, "SLURM_SCRIPT_CONTEXT": "prolog_slurmd"}
        cold, warm, task, epi = [], [], [], []
        anchor = _held_job(cluster, 2, "/dev/null")
        for _ in range(args.runs):
            job = _held_job(cluster, 4, "/dev/null")
            env = {**base, "SLURM_JOB_ID": str(job)}
            cold.append(_run(bin_ / "colloc-prolog", env))
            task.append(_run(bin_ / "colloc-taskprolog", env))
            epi.append(_run(bin_ / "colloc-epilog", env))
            # warm: keep an anchor job registered so the daemon stays up
            _run(bin_ / "colloc-prolog", {**base, "SLURM_JOB_ID": str(anchor)})
            job2 = _held_job(cluster, 4, "/dev/null")
            env2 = {**base, "SLURM_JOB_ID": str(job2)}
            warm.append(_run(bin_ / "colloc-prolog", env2))
            _run(bin_ / "colloc-epilog", env2)
            _run(bin_ / "colloc-epilog", {**base, "SLURM_JOB_ID": str(anchor)})
            subprocess.run(["scancel", str(job), str(job2)], env=cluster.env(), check=False)
        # epilog on a 1 GB log with an OOM at its end (the job "failed": exit 1)
        with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
            log = Path(d) / "big.out"
            with log.open("wb") as f:
                line = b"[epoch 1] step 123 loss 0.4567 lr 1e-3 throughput 812 img/s\n"
                block = line * (1 << 20 // len(line) + 1)
                while f.tell() < 1 << 30:
                    f.write(block)
                f.write(b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."
                        b" GPU 0 has a total capacity of 8.00 GiB of which 1.00 GiB is free.\n")
            size = log.stat().st_size
            conf = cluster.layout.colloc_conf
            original = conf.read_text()
            conf.write_text(original + "requeue_on_oom = false\n")
            big = []
            try:
                for _ in range(5):
                    job = _held_job(cluster, 4, str(log))
                    env = {**base, "SLURM_JOB_ID": str(job)}
                    _run(bin_ / "colloc-prolog", env)
                    failed = {**env, "SLURM_JOB_EXIT_CODE2": "1:0"}
                    big.append(_run(bin_ / "colloc-epilog", failed))
                    subprocess.run(["scancel", str(job)], env=cluster.env(), check=False)
            finally:
                conf.write_text(original)
        def ms(xs: list[float]) -> str:
            return f"median {statistics.median(xs) * 1000:6.0f} ms  max {max(xs) * 1000:6.0f} ms"

        print(f"runs: {args.runs} (each a real wrapper process, as slurmd starts it)")
        print(f"prolog, cold (starts the MPS daemon) : {ms(cold)}")
        print(f"prolog, warm (daemon already up)     : {ms(warm)}")
        print(f"task prolog (as the user)            : {ms(task)}")
        print(f"prolog + task prolog, cold           : "
              f"median {(statistics.median(cold) + statistics.median(task)) * 1000:.0f} ms")
        print(f"epilog, job without OOM              : {ms(epi)}")
        print(f"epilog, {size / 1e9:.2f} GB log ending in GPU OOM   : {ms(big)}")
        print("target: prolog + task prolog well under 1 s")
        series = {"prolog_cold": cold, "prolog_warm": warm, "task_prolog": task,
                  "epilog": epi, "epilog_big_log": big}
        figures = {
            "benchmark": "node_script_overhead", "runs": args.runs, "big_log_bytes": size,
            "median_ms": {k: statistics.median(v) * 1000 for k, v in series.items()},
            "max_ms": {k: max(v) * 1000 for k, v in series.items()},
        }
        print(JSON_PREFIX + json.dumps(figures), flush=True)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # no second signal mid-teardown
        cluster.down()
        end_leftovers(cluster.layout.slurm_conf)  # the epilogs' detached record writers
        os.sync()


if __name__ == "__main__":
    main()
