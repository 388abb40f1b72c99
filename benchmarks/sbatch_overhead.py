"""Time cli_filter + estimate add to one `sbatch --colloc=SUMMARY` (median of N).

    .venv/bin/python benchmarks/sbatch_overhead.py [--root DIR] [--summary FILE] [-n 30]
Compares, on a running devcluster, `sbatch --hold --colloc=SUMMARY --colloc-batch-size=32`
through the site's cli_filter (which runs the estimator) with the same sbatch using a
copy of slurm.conf without CliFilterPlugins. Uses the real `colloc estimate` when it
is installed, else the stand-in tests/e2e/data/fake_colloc (reported).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from pathlib import Path

from slurm_colloc.devcluster.cluster import Cluster

REPO = Path(__file__).resolve().parents[1]


def time_sbatch(env: dict[str, str], args: list[str], n: int, ids: list[str]) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.monotonic()
        cp = subprocess.run(["sbatch", "--parsable", "--hold", "-o", "/dev/null", *args,
                             "--wrap", "true"], env=env, capture_output=True, text=True)
        out.append((time.monotonic() - t0) * 1000)
        if cp.returncode != 0:
            raise SystemExit(f"sbatch failed: {cp.stderr.strip()}")
        ids.append(cp.stdout.strip())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path("/var/lib/colloc-devcluster"))
    ap.add_argument("--summary", type=Path, default=None)
    ap.add_argument("-n", type=int, default=30)
    a = ap.parse_args()
    cluster = Cluster.at(a.root)
    env = cluster.env()
    real = subprocess.run([str(cluster.venv_bin / "colloc"), "estimate", "--help"],
                          capture_output=True, check=False).returncode == 0
    summary = a.summary or next(iter(sorted((REPO / "sbatch_templates" / "summaries")
                                            .glob("*.txt"))), None)
    if not real or summary is None:
        env["COLLOC_ESTIMATOR_COMMAND"] = str(REPO / "tests" / "e2e" / "data" / "fake_colloc")
        summary = cluster.layout.root / "bench-summary.txt"
        summary.write_text("mib=7000 margin=500\n")
        which = "stand-in estimator (tests/e2e/data/fake_colloc)"
    else:
        which = f"colloc estimate on {summary.name}"
    bypass = cluster.layout.root / "bench-slurm.conf"
    bypass.write_text("\n".join(
        ln for ln in cluster.layout.slurm_conf.read_text().splitlines()
        if not ln.startswith("CliFilterPlugins")) + "\n")
    args = [f"--colloc={summary}", "--colloc-batch-size=32"]
    ids: list[str] = []
    try:
        time_sbatch(env, args, 2, ids)  # warm caches
        base = time_sbatch(dict(env, SLURM_CONF=str(bypass)), args, a.n, ids)
        filt = time_sbatch(env, args, a.n, ids)
    finally:
        subprocess.run(["scancel", *ids], env=env, check=False)
    mb, mf = statistics.median(base), statistics.median(filt)
    print(f"estimator: {which}; n = {a.n} each")
    print(f"sbatch without cli_filter:           median {mb:7.1f} ms")
    print(f"sbatch with cli_filter + estimate:   median {mf:7.1f} ms")
    print(f"added per sbatch:                    median {mf - mb:7.1f} ms")


if __name__ == "__main__":
    main()
