"""Replay job traces through real Slurm under four GPU policies and compare them.

Usage (as root; each policy gets its own devcluster, brought up and down here)::

    .venv/bin/python benchmarks/replay.py --trace philly90h --repeats 3   # fair trace
    .venv/bin/python benchmarks/replay.py --trace philly90h --time-scale 60
    .venv/bin/python benchmarks/replay.py --trace-file my_trace.csv --gpus 4
    .venv/bin/python benchmarks/replay.py --trace philly90 --limit 8 --results /tmp/r
    .venv/bin/python benchmarks/replay.py --trace philly90h --summary-only
    .venv/bin/python benchmarks/replay.py --trace philly90h --nodes 2 --repeats 3

With ``--repeats`` (or ``--runs-dir``) every run goes to
``<results>/<trace>/x<scale>/run<N>/`` and ``<results>/<trace>_summary.{csv,md}`` is
rebuilt from *all* runs on disk (median and range per policy and time scale).
Without it, results go to ``<results>/<trace>.{csv,md}`` as before. With ``--nodes N``
(the trace's GPUs split over N alike hosts) runs go to ``<results>/<trace>_n<N>/x<scale>/
run<k>/`` and the summary to ``<trace>_n<N>_summary.{csv,md}`` (without ``--repeats``:
``<results>/<trace>_n<N>/<trace>.*``), so one-node and multi-node runs stay apart. See
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import csv
import logging
import math
import sys
from dataclasses import fields, replace
from pathlib import Path

from slurm_colloc.bench import generators, policies, profiles, report
from slurm_colloc.bench.metrics import PolicyMetrics, idle_while_queued
from slurm_colloc.bench.replayer import ReplayConfig, gpus_per_node
from slurm_colloc.bench.run import replay
from slurm_colloc.bench.trace import Trace
from slurm_colloc.bench.trace_file import TraceFileError, load_trace_file

RESULTS = Path(__file__).resolve().parent / "results"


def read_metrics(path: Path) -> list[PolicyMetrics]:
    """Rows of a ``<trace>.csv`` written by :func:`report.metrics_csv`."""
    types = {f.name: f.type for f in fields(PolicyMetrics)}
    out = []
    with path.open() as f:
        for row in csv.DictReader(f):
            kw: dict[str, object] = {}
            for k, v in row.items():
                if k not in types:
                    continue
                t = str(types[k])
                kw[k] = v if t == "str" else int(v) if t == "int" else (
                    float(v) if v not in ("", "nan") else math.nan)
            out.append(PolicyMetrics(**kw))  # type: ignore[arg-type]
    return out


def idle_queued_by_policy(run_dir: Path, name: str) -> dict[str, float]:
    """:func:`metrics.idle_while_queued` per policy, from a run's committed CSVs."""
    jobs_f, ts_f = run_dir / f"{name}_jobs.csv", run_dir / f"{name}_gpu_timeseries.csv"
    if not jobs_f.exists() or not ts_f.exists():
        return {}
    waits: dict[str, list[tuple[float, float]]] = {}
    ends: dict[str, float] = {}
    with jobs_f.open() as f:
        for r in csv.DictReader(f):
            if r["submit_h"] and r["start_h"]:
                waits.setdefault(r["policy"], []).append(
                    (float(r["submit_h"]), float(r["start_h"])))
            if r["end_h"]:
                ends[r["policy"]] = max(ends.get(r["policy"], 0.0), float(r["end_h"]))
    samples: dict[str, list[tuple[float, int]]] = {}
    with ts_f.open() as f:
        for r in csv.DictReader(f):
            t = float(r["t_h"])
            if 0 <= t <= ends.get(r["policy"], -1.0):
                samples.setdefault(r["policy"], []).append((t, int(r["processes"])))
    return {p: idle_while_queued(samples.get(p, []), w) for p, w in waits.items()}


def write_summary(results: Path, name: str, label: str | None = None) -> str:
    """Summary over every run of trace ``name`` under ``results/<label>`` (default: the
    trace's name); writes ``<label>_summary.{csv,md}`` and returns the markdown."""
    label = label or name
    runs = []
    for p in sorted((results / label).glob(f"x*/run*/{name}.csv")):
        idle = idle_queued_by_policy(p.parent, name)
        runs.append([replace(m, idle_while_queued=idle.get(m.policy, math.nan))
                     for m in read_metrics(p)])
    rows = report.summary_rows(runs)
    rows.sort(key=lambda r: (float(r["time_scale"]), str(r["policy"])))  # type: ignore[arg-type]
    nodes = label[len(name) + 2:] if label.startswith(f"{name}_n") else ""
    how = f" --nodes {nodes}" if nodes else ""
    md = (f"# {label}: median [range] over runs\n\n"
          f"Built by `benchmarks/replay.py --trace {name}{how} --summary-only` from "
          f"`{label}/x*/run*/{name}.csv`. Energy over the common window (until the last "
          "policy of the same run finished); kWh per completed GPU-hour of work.\n\n"
          + report.summary_markdown(rows))
    report.write_text(results / f"{label}_summary.csv", report.summary_csv(rows))
    report.write_text(results / f"{label}_summary.md", md)
    return md


def build_trace(a: argparse.Namespace) -> Trace:
    """The generated trace, or the user's trace file (exit 2 with one line per problem)."""
    summaries = profiles.load_summaries()
    if a.trace_file:
        return load_trace_file(a.trace_file, gpus=a.gpus, gpu_mib=a.gpu_mib,
                               summaries=summaries)
    pools = generators.ProfilePools(
        profiles.load_lucid(), profiles.load_timm_peaks(), summaries,
        held_out_only=a.trace in generators.HELD_OUT_TRACES)
    gen = generators.GENERATORS[a.trace]
    return gen(pools) if a.seed is None else gen(pools, seed=a.seed)


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, replay, print the markdown table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", choices=sorted(generators.GENERATORS), default="philly90")
    src.add_argument("--trace-file", type=Path, help="CSV trace (docs/benchmarks.md)")
    p.add_argument("--gpus", type=int, default=4, help="GPUs of the node (--trace-file)")
    p.add_argument("--gpu-mib", type=int, default=40 * 1024,
                   help="memory per GPU, MiB (--trace-file)")
    p.add_argument("--policies", default=",".join(
        n for n in policies.POLICIES if n not in policies.DIAGNOSTIC))
    p.add_argument("--time-scale", type=float, default=120.0,
                   help="trace seconds per wall second (default 120)")
    p.add_argument("--repeats", type=int, default=0,
                   help="run N times into <results>/<trace>/x<scale>/run<k>/ + summary")
    p.add_argument("--summary-only", action="store_true",
                   help="rebuild <trace>_summary.{csv,md} from the runs on disk")
    p.add_argument("--nodes", type=int, default=1,
                   help="split the trace's GPUs over N alike hosts (default 1)")
    p.add_argument("--time-limit-factor", type=float, default=0.0,
                   help="give every job --time = F x its solo run time (default 0: no "
                        "limits); keep such runs in their own --results directory")
    p.add_argument("--limit", type=int, help="replay only the first N jobs (smoke runs)")
    p.add_argument("--seed", type=int, help="trace generator seed (default per trace)")
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--root-base", default="/var/lib/colloc-replay")
    p.add_argument("--port-base", type=int, default=21810)
    p.add_argument("--keep", action="store_true", help="leave the clusters running")
    p.add_argument("--validate", action="store_true",
                   help="only read and check the trace (--trace-file), print the job count")
    a = p.parse_args(argv)
    try:
        trace = build_trace(a)
    except TraceFileError as e:
        sys.stderr.write(f"{e}\n")
        return 2
    if a.time_limit_factor < 0:
        sys.stderr.write(f"--time-limit-factor {a.time_limit_factor:g}: must be 0 (no limits) "
                         "or positive\n")
        return 2
    if a.validate:
        sys.stdout.write(f"{trace.name}: {len(trace.jobs)} jobs OK\n")
        return 0
    label = trace.name if a.nodes == 1 else f"{trace.name}_n{a.nodes}"
    if a.summary_only:
        sys.stdout.write(write_summary(a.results, trace.name, label))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if a.limit:
        trace = replace(trace, jobs=trace.jobs[: a.limit])
    cfg = ReplayConfig(time_scale=a.time_scale, root_base=a.root_base, port_base=a.port_base,
                       keep_clusters=a.keep, nodes=a.nodes,
                       time_limit_factor=a.time_limit_factor)
    try:
        gpus_per_node(trace, a.nodes)
    except ValueError as e:
        sys.stderr.write(f"{e}\n")
        return 2
    summaries = profiles.load_summaries()
    chosen = policies.get(a.policies.split(","))
    if not a.repeats:
        out = a.results if a.nodes == 1 else a.results / label  # never over the one-node files
        _, _, wall = replay(trace, chosen, cfg, summaries, out)
        sys.stdout.write((out / f"{trace.name}.md").read_text())
        sys.stdout.write(f"\ntotal wall time {wall:.0f} s\n")
        return 0
    base = a.results / label / f"x{a.time_scale:g}"
    for _ in range(a.repeats):
        k = 1
        while (base / f"run{k}").exists():
            k += 1
        out = base / f"run{k}"
        out.mkdir(parents=True)
        _, _, wall = replay(trace, chosen, cfg, summaries, out)
        sys.stdout.write((out / f"{trace.name}.md").read_text())
        sys.stdout.write(f"\n{out}: total wall time {wall:.0f} s\n")
        write_summary(a.results, trace.name, label)
    sys.stdout.write(write_summary(a.results, trace.name, label))
    return 0


if __name__ == "__main__":
    sys.exit(main())
