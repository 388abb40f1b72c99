"""A burst of GPU jobs on one node: what each prolog cost, and which jobs were lost.

Issue 28: 150 shard jobs (30 of them OOM once and are requeued on a whole GPU)
submitted within a few seconds put up to ~40 prologs on one node at once; Slurm
starts a job only when its prolog ends, so the prologs' wall time is the burst's
start lag. Every colloc Prolog/Epilog log line ends in ``[took W s, cpu C s]``
(:mod:`slurm_colloc.node.timing`); this module reads them back from colloc's node
log and sums them up (benchmarks/prolog_burst.py drives the cluster).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from slurm_colloc.node.timing import parse_timing

_PROLOG = re.compile(r"colloc: prolog: job (\d+): (\S+)")


@dataclass(frozen=True)
class ScriptRun:
    """One Prolog run as its log line tells it."""

    job_id: int
    mode: str
    """The decision's first word: ``shared``, ``exclusive``, ``refused``, ``internal``..."""
    wall_s: float
    cpu_s: float


def prolog_runs(lines: Iterable[str], jobs: Iterable[int] | None = None) -> list[ScriptRun]:
    """Every timed prolog line (of ``jobs`` only, when given), in log order.

    A requeued job runs its prolog once per attempt: one entry each. Lines without
    the timing suffix (another component's, or a prolog that stopped early and
    logged its own line) are skipped.
    """
    want = None if jobs is None else set(jobs)
    out = []
    for line in lines:
        m = _PROLOG.search(line)
        timing = parse_timing(line) if m else None
        if m is None or timing is None:
            continue
        job = int(m.group(1))
        if want is None or job in want:
            out.append(ScriptRun(job, m.group(2), timing[0], timing[1]))
    return out


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100): an observed value, never an
    interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def _r(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


def summarize(runs: Sequence[ScriptRun]) -> dict[str, float | int | None]:
    """p50/p99/max wall and p50/p99 CPU seconds over the prolog runs."""
    wall = [r.wall_s for r in runs]
    cpu = [r.cpu_s for r in runs]
    return {"prologs": len(runs),
            "wall_p50_s": _r(percentile(wall, 50)), "wall_p99_s": _r(percentile(wall, 99)),
            "wall_max_s": _r(max(wall) if wall else None),
            "cpu_p50_s": _r(percentile(cpu, 50)), "cpu_p99_s": _r(percentile(cpu, 99)),
            "cpu_total_s": _r(sum(cpu))}


def lost_jobs(states: Mapping[int, str]) -> list[int]:
    """Jobs whose final state is not COMPLETED (a missing state counts as lost)."""
    return sorted(j for j, s in states.items() if s != "COMPLETED")


def lost_requeues(restarts: Mapping[int, int], oom_jobs: Iterable[int]) -> list[int]:
    """OOM jobs that were not requeued (restart count 0: their second attempt is lost)."""
    return sorted(j for j in oom_jobs if restarts.get(j, 0) < 1)


def markdown(result: Mapping[str, object], command: str) -> str:
    """The result as benchmarks/results/prolog-burst.md."""
    s = result["prolog"]
    assert isinstance(s, Mapping)
    rows = [("jobs (OOM once)", f"{result['jobs']} ({result['oom_jobs']})"),
            ("submitted in", f"{result['submit_s']} s"),
            ("all done after", f"{result['done_s']} s"),
            ("lost jobs / lost requeues",
             f"{len(result['lost_jobs'])} / {len(result['lost_requeues'])}"),  # type: ignore[arg-type]
            ("prolog runs timed", str(s["prologs"])),
            ("prolog wall p50 / p99 / max",
             f"{s['wall_p50_s']} / {s['wall_p99_s']} / {s['wall_max_s']} s"),
            ("prolog CPU p50 / p99", f"{s['cpu_p50_s']} / {s['cpu_p99_s']} s")]
    if "submitter_nice" in result or "controller_nice" in result:  # how the lab modelled
        rows.append(("submitters' / controller's nice (0: as is)",  # the other hosts
                     f"{result.get('submitter_nice', 0)} / {result.get('controller_nice', 0)}"))
    body = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return (f"# Prolog burst ({result.get('variant', '')})\n\n"
            f"`{command}`\n\n| | |\n|---|---|\n{body}\n")
