"""Every GPU OOM of a set of replays, split by whether the job's reservation held its peak.

    python benchmarks/oom_audit.py DIR [DIR ...] [--json FILE]

Each DIR is searched for run directories (any directory holding a ``<trace>_jobs.csv``
beside its ``<trace>_trace.csv``). For every policy of every run, each job that had a
GPU out-of-memory crash is put in one of three classes, from the committed CSVs only:

* **inside**: job_submit reserved at least the job's true peak (``need_mib`` >=
  ``peak_mib``). On a real site that OOM is ours (a cap, a budget, a co-tenant
  server), never the job's: issue 24 asks for none in three runs of each fair trace.
* **under-guessed**: the reservation was below the true peak (the user's
  ``--colloc-mem`` or the estimate was short); the epilog's requeue is the remedy.
* **unlimited**: a policy without colloc's node scripts (whole GPUs, plain shards):
  nothing limits a job there, so its OOM means the GPU was full (a neighbour took more
  than its shards), whatever it reserved.

Why a script: the criterion must be checked the same way on every run, and a reader
must be able to recheck it from the result files without the clusters.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from slurm_colloc.bench.policies import POLICIES

CLASSES = ("inside", "under-guessed", "unlimited")


def run_dirs(root: Path) -> list[tuple[Path, str]]:
    """(run directory, trace name) for every run under ``root``, sorted."""
    out = []
    for jobs in sorted(root.rglob("*_jobs.csv")):
        name = jobs.name[: -len("_jobs.csv")]
        if (jobs.parent / f"{name}_trace.csv").exists():
            out.append((jobs.parent, name))
    return out


def classify(policy: str, need_mib: float, peak_mib: float) -> str:
    """The class of one OOM crash (see the module docstring)."""
    known = POLICIES.get(policy)
    if pd.isna(need_mib) or (known is not None and not known.node_scripts):
        return "unlimited"
    return "inside" if need_mib >= peak_mib else "under-guessed"


def audit(run_dir: Path, name: str) -> list[dict[str, object]]:
    """One row per (policy, OOM job) of one run."""
    jobs = pd.read_csv(run_dir / f"{name}_jobs.csv")
    trace = pd.read_csv(run_dir / f"{name}_trace.csv").set_index("name")
    rows = []
    for _, j in jobs[jobs["oom_crashes"] > 0].iterrows():
        peak = float(trace.loc[j["job"], "peak_mib"])
        rows.append({
            "run": str(run_dir), "policy": j["policy"], "job": j["job"],
            "oom_crashes": int(j["oom_crashes"]), "state": j["state"],
            "need_mib": None if pd.isna(j["need_mib"]) else int(j["need_mib"]),
            "peak_mib": int(peak), "mode": "" if pd.isna(j["mode"]) else j["mode"],
            "class": classify(str(j["policy"]), j["need_mib"], peak),
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    """Print per run and policy the OOM jobs by class; exit 1 if any is ``inside``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", nargs="+", type=Path)
    p.add_argument("--json", type=Path, help="also write every OOM job here")
    a = p.parse_args(argv)
    runs = [r for d in a.dirs for r in run_dirs(d)]
    if not runs:
        sys.stderr.write(f"no run directories (<trace>_jobs.csv + _trace.csv) under "
                         f"{', '.join(map(str, a.dirs))}\n")
        return 2
    found: list[dict[str, object]] = []
    for run_dir, name in runs:
        rows = audit(run_dir, name)
        found += rows
        policies = sorted(pd.read_csv(run_dir / f"{name}_jobs.csv")["policy"].unique())
        sys.stdout.write(f"{run_dir}\n")
        for pol in policies:
            mine = [r for r in rows if r["policy"] == pol]
            counts = ", ".join(f"{c} {sum(1 for r in mine if r['class'] == c)}"
                               for c in CLASSES)
            jobs = ", ".join(f"{r['job']} ({r['class']}: {r['need_mib']} vs {r['peak_mib']})"
                             for r in mine)
            sys.stdout.write(f"  {pol:14s} {counts}{': ' + jobs if jobs else ''}\n")
    inside = [r for r in found if r["class"] == "inside"]
    sys.stdout.write(f"{len(runs)} runs; OOM jobs inside a reservation at or above the true peak: "
                     f"{len(inside)}\n")
    if a.json:
        a.json.write_text(json.dumps({"runs": [str(r) for r, _ in runs], "oom_jobs": found},
                                     indent=1, default=str) + "\n")
    return 1 if inside else 0


if __name__ == "__main__":
    sys.exit(main())
