"""Controller overhead of job_submit.lua: held submissions per second with and without it.

Runs against a running devcluster (default /var/lib/colloc-devcluster; run as root):
    .venv/bin/python benchmarks/submit_overhead.py [--root DIR] [--jobs 1000] [--workers 4]
Both modes run in one process, interleaved in blocks, against the same controller;
JobSubmitPlugins is toggled in slurm.conf + `scontrol reconfigure`. Clients use a copy
of slurm.conf without CliFilterPlugins so only the controller side differs. Every job
is `--hold --colloc-mem=2G`, cancelled at the end. Target: ratio >= 0.9.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from slurm_colloc.devcluster.cluster import Cluster


def set_job_submit(cluster: Cluster, on: bool) -> None:
    conf = cluster.layout.slurm_conf
    lines = [ln for ln in conf.read_text().splitlines() if not ln.startswith("JobSubmitPlugins")]
    if on:
        lines.append("JobSubmitPlugins=lua")
    conf.write_text("\n".join(lines) + "\n")
    subprocess.run(["scontrol", "reconfigure"], env=cluster.env(), check=True)
    time.sleep(2)


def submit_block(env: dict[str, str], n: int, workers: int) -> tuple[float, list[str]]:
    def one(_: int) -> str:
        cp = subprocess.run(
            ["sbatch", "--parsable", "--hold", "-o", "/dev/null", "--colloc-mem=2G",
             "--wrap", "true"], env=env, capture_output=True, text=True, check=True,
        )
        return cp.stdout.strip()

    t0 = time.monotonic()
    with ThreadPoolExecutor(workers) as ex:
        ids = list(ex.map(one, range(n)))
    return time.monotonic() - t0, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path("/var/lib/colloc-devcluster"))
    ap.add_argument("--jobs", type=int, default=1000, help="jobs per mode")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--workers", type=int, default=4)
    a = ap.parse_args()
    cluster = Cluster.at(a.root)
    env = cluster.env()
    client_conf = cluster.layout.root / "bench-slurm.conf"
    client_conf.write_text("\n".join(
        ln for ln in cluster.layout.slurm_conf.read_text().splitlines()
        if not ln.startswith("CliFilterPlugins")) + "\n")
    cenv = dict(env, SLURM_CONF=str(client_conf))
    per_block = a.jobs // a.blocks
    elapsed = {True: 0.0, False: 0.0}
    ids: list[str] = []
    try:
        for _ in range(a.blocks):
            for mode in (False, True):
                set_job_submit(cluster, mode)
                secs, got = submit_block(cenv, per_block, a.workers)
                elapsed[mode] += secs
                ids += got
    finally:
        set_job_submit(cluster, True)
        for i in range(0, len(ids), 500):
            subprocess.run(["scancel", *ids[i:i + 500]], env=env, check=False)
    n = per_block * a.blocks
    without, with_ = n / elapsed[False], n / elapsed[True]
    print(f"jobs per mode: {n} ({a.blocks} interleaved blocks, {a.workers} concurrent sbatch)")
    print(f"without job_submit.lua: {without:7.1f} submissions/s")
    print(f"with job_submit.lua:    {with_:7.1f} submissions/s")
    print(f"ratio: {with_ / without:.3f} (target >= 0.9)")


if __name__ == "__main__":
    main()
