"""Replay job traces through real Slurm under four GPU policies and compare them.

Usage (as root; each policy gets its own devcluster, brought up and down here)::

    .venv/bin/python benchmarks/replay.py --trace philly90            # trace (a)
    .venv/bin/python benchmarks/replay.py --trace heavy60 --time-scale 150
    .venv/bin/python benchmarks/replay.py --trace alibaba --time-scale 150
    .venv/bin/python benchmarks/replay.py --trace philly90 --limit 8 --results /tmp/r

Results go to ``benchmarks/results/<trace>.{csv,md}`` (+ per-job CSV, GPU time
series and plots). See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path

from slurm_colloc.bench import generators, policies, profiles
from slurm_colloc.bench.replayer import ReplayConfig
from slurm_colloc.bench.run import replay

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, replay, print the markdown table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", choices=sorted(generators.GENERATORS), default="philly90")
    p.add_argument("--policies", default=",".join(
        n for n in policies.POLICIES if n not in policies.DIAGNOSTIC))
    p.add_argument("--time-scale", type=float, default=120.0,
                   help="trace seconds per wall second (default 120)")
    p.add_argument("--limit", type=int, help="replay only the first N jobs (smoke runs)")
    p.add_argument("--seed", type=int, help="trace generator seed (default per trace)")
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--root-base", default="/var/lib/colloc-replay")
    p.add_argument("--port-base", type=int, default=21810)
    p.add_argument("--keep", action="store_true", help="leave the clusters running")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    pools = generators.ProfilePools(
        profiles.load_lucid(), profiles.load_timm_peaks(), profiles.load_summaries())
    gen = generators.GENERATORS[a.trace]
    trace = gen(pools) if a.seed is None else gen(pools, seed=a.seed)
    if a.limit:
        trace = replace(trace, jobs=trace.jobs[: a.limit])
    cfg = ReplayConfig(time_scale=a.time_scale, root_base=a.root_base, port_base=a.port_base,
                       keep_clusters=a.keep)
    summaries = profiles.load_summaries()
    _, _, wall = replay(trace, policies.get(a.policies.split(",")), cfg, summaries, a.results)
    sys.stdout.write((a.results / f"{trace.name}.md").read_text())
    sys.stdout.write(f"\ntotal wall time {wall:.0f} s\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
