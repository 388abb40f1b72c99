"""Any trace: read a user's trace CSV (``replay.py --trace-file``), validated line by line.

Format (docs/benchmarks.md, "Your own trace"): a header row, then one row per job.

Required columns:

=============  ===================================================================
``arrival_s``  submission time, trace seconds after the trace starts (>= 0)
``gpus``       GPUs the job uses (1 .. the node's GPUs)
``batch_size`` batch size (>= 1; passed with the summary to the estimator)
``peak_mib``   measured peak GPU memory per GPU, MiB, CUDA context included
``work_s``     run time alone on whole GPUs, trace seconds (> 0)
``summary``    model summary for ``--colloc``: a name in ``benchmarks/summaries`` or
               a path to a summary file; empty = none (the user gives memory)
``guess_mib``  what the user would ask for without a tool, MiB (>= 1)
``sm_pct``     SM activity (DCGM SMACT) alone on the GPU, % (0 < x <= 100)
=============  ===================================================================

Optional: ``name`` (unique; default ``<stem>-NNN``), ``model``, ``steady_mib``
(memory from the start, <= peak; default the peak), ``peak_at`` (fraction of the
work where the peak is reached, 0..1; default 0), ``user`` (Unix user who submits;
default root), ``size_class`` (light/medium/heavy; default from the peak),
``source``, ``util_pct`` (nvidia-smi GPU utilisation alone, %, kept for reference; 0 =
unknown: the simulation runs the job at ``sm_pct``). Any other column is an error.

Every problem is one line ``FILE:LINE: column NAME: what is wrong``
(:class:`TraceFileError`); all problems of a file are reported, not just the first.
"""

from __future__ import annotations

import csv
import io
import math
import re
from collections.abc import Callable, Container
from pathlib import Path

from slurm_colloc.bench.trace import SIZE_CLASSES, Trace, TraceJob

REQUIRED = ("arrival_s", "gpus", "batch_size", "peak_mib", "work_s", "summary", "guess_mib",
            "sm_pct")
OPTIONAL = ("name", "model", "steady_mib", "peak_at", "user", "size_class", "source",
            "util_pct")
_USER = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
_NAME = re.compile(r"^[A-Za-z0-9_.+-]{1,64}$")
MAX_ERRORS = 20


class TraceFileError(ValueError):
    """A trace file that cannot be replayed; ``str()`` is one line per problem."""

    def __init__(self, problems: list[str]) -> None:
        """Keep every problem (the message shows the first :data:`MAX_ERRORS`)."""
        self.problems = problems
        more = len(problems) - MAX_ERRORS
        text = "\n".join(problems[:MAX_ERRORS]) + (f"\n... and {more} more" if more > 0 else "")
        super().__init__(text)


def _int(text: str) -> int:
    t = text.strip()
    if not re.fullmatch(r"[+-]?\d+", t):
        raise ValueError(f"{text!r} is not a whole number")
    return int(t)


def _float(text: str) -> float:
    try:
        v = float(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
    if not math.isfinite(v):
        raise ValueError(f"{text!r} is not a finite number")
    return v


class _Cells:
    """Reads one row's cells, appending one-line problems to ``bad``."""

    def __init__(self, where: str, line: int, row: dict[str, str], bad: list[str]) -> None:
        self.where, self.line, self.row, self.bad = where, line, row, bad

    def num(self, col: str, conv: Callable[[str], float], ok: Callable[[float], bool],
            why: str, default: float | None = None) -> float | None:
        """The cell converted and checked; None (and a problem) when it is not valid."""
        text = self.row.get(col, "")
        if text == "":
            if default is not None:
                return default
            self.bad.append(f"{self.where}:{self.line}: column {col}: empty")
            return None
        try:
            v = conv(text)
        except ValueError as e:
            self.bad.append(f"{self.where}:{self.line}: column {col}: {e}")
            return None
        if not ok(v):
            self.bad.append(f"{self.where}:{self.line}: column {col}: {text} {why}")
            return None
        return v


def size_class_of(peak_mib: int) -> str:
    """light < 6 GiB <= medium < 16 GiB <= heavy (the generators' classes)."""
    return "light" if peak_mib < 6 * 1024 else "medium" if peak_mib < 16 * 1024 else "heavy"


def parse_trace_text(
    text: str, *, where: str, gpus: int, gpu_mib: int, summaries: Container[str],
    base_dir: Path | None = None,
) -> tuple[TraceJob, ...]:
    """Jobs of a trace CSV, or :class:`TraceFileError` listing every problem.

    ``where`` names the file in messages; ``gpus``/``gpu_mib`` are the node's;
    ``summaries`` the known summary names (a ``summary`` may also be a file path,
    relative to ``base_dir``).
    """
    problems: list[str] = []
    reader = csv.DictReader(io.StringIO(text))
    header = reader.fieldnames
    if not header:
        raise TraceFileError([f"{where}:1: empty file: expected a header row with "
                              f"{', '.join(REQUIRED)}"])
    cols = [h.strip() for h in header]
    missing = [c for c in REQUIRED if c not in cols]
    unknown = [c for c in cols if c not in REQUIRED and c not in OPTIONAL]
    dup = sorted({c for c in cols if cols.count(c) > 1})
    for c in missing:
        problems.append(f"{where}:1: column {c}: missing (required: {', '.join(REQUIRED)})")
    for c in unknown:
        problems.append(f"{where}:1: column {c}: unknown (optional columns: "
                        f"{', '.join(OPTIONAL)})")
    for c in dup:
        problems.append(f"{where}:1: column {c}: appears twice")
    if problems:
        raise TraceFileError(problems)
    stem = re.sub(r"[^A-Za-z0-9_.+-]", "_", Path(where).stem) or "trace"
    jobs: list[TraceJob] = []
    names: dict[str, int] = {}
    for i, raw in enumerate(reader):
        line = reader.line_num
        row = {k.strip(): (v or "").strip() for k, v in raw.items() if k is not None}
        if None in raw:
            problems.append(f"{where}:{line}: row has more fields than the header")
            continue
        bad: list[str] = []
        cell = _Cells(where, line, row, bad)
        arrival = cell.num("arrival_s", _float, lambda v: v >= 0, "must be >= 0")
        n_gpus = cell.num("gpus", _int, lambda v: 1 <= v <= gpus,
                          f"must be 1..{gpus} (GPUs of the node)")
        batch = cell.num("batch_size", _int, lambda v: v >= 1, "must be >= 1")
        peak = cell.num("peak_mib", _int, lambda v: 1 <= v <= gpu_mib,
                        f"must be 1..{gpu_mib} MiB (per GPU, at most the GPU's memory)")
        work = cell.num("work_s", _float, lambda v: v > 0, "must be > 0")
        guess = cell.num("guess_mib", _int, lambda v: v >= 1, "must be >= 1")
        sm = cell.num("sm_pct", _float, lambda v: 0 < v <= 100, "must be in (0, 100]")
        summary = row.get("summary", "")
        if summary and summary not in summaries:
            p = Path(summary)
            if base_dir is not None and not p.is_absolute():
                p = base_dir / p
            if not p.is_file():
                bad.append(f"{where}:{line}: column summary: {summary!r} is neither a known "
                           "model summary nor a readable file")
            else:
                summary = str(p)
        name = row.get("name") or f"{stem}-{i:03d}"
        if not _NAME.match(name):
            bad.append(f"{where}:{line}: column name: {name!r} must be 1-64 of [A-Za-z0-9_.+-]")
        elif name in names:
            bad.append(f"{where}:{line}: column name: {name!r} already used on line "
                       f"{names[name]}")
        else:
            names[name] = line
        user = row.get("user", "")
        if user and not _USER.match(user):
            bad.append(f"{where}:{line}: column user: {user!r} is not a Unix user name")
        peak_at = cell.num("peak_at", _float, lambda v: 0 <= v <= 1, "must be in [0, 1]",
                           default=0.0)
        util = cell.num("util_pct", _float, lambda v: 0 <= v <= 100, "must be in [0, 100]",
                        default=0.0)
        steady = cell.num("steady_mib", _int, lambda v: v >= 1, "must be >= 1",
                          default=peak if peak is not None else 1)
        cls = row.get("size_class", "")
        if cls and cls not in SIZE_CLASSES:
            bad.append(f"{where}:{line}: column size_class: {cls!r} must be one of "
                       f"{', '.join(SIZE_CLASSES)}")
        if peak is not None and steady is not None and steady > peak:
            bad.append(f"{where}:{line}: column steady_mib: {steady} is above peak_mib {peak}")
        if bad:
            problems.extend(bad)
            continue
        assert (arrival is not None and n_gpus is not None and batch is not None
                and peak is not None and work is not None and guess is not None
                and sm is not None and peak_at is not None and steady is not None
                and util is not None)
        jobs.append(TraceJob(
            name=name, arrival_s=float(arrival), size_class=cls or size_class_of(int(peak)),
            model=row.get("model") or Path(summary).stem or "job", batch_size=int(batch),
            peak_mib=int(peak), steady_mib=int(steady), peak_at=float(peak_at),
            sm_pct=float(sm), work_s=float(work), guess_mib=int(guess),
            summary=summary, source=row.get("source") or f"{where}:{line}",
            gpus=int(n_gpus), user=user, util_pct=float(util),
        ))
    if not jobs and not problems:
        problems.append(f"{where}:2: no jobs (only a header)")
    if problems:
        raise TraceFileError(problems)
    return tuple(sorted(jobs, key=lambda j: j.arrival_s))


def load_trace_file(
    path: Path, *, gpus: int = 4, gpu_mib: int = 40 * 1024, summaries: Container[str] = (),
) -> Trace:
    """A :class:`Trace` from a CSV file (see the module docstring for the format)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise TraceFileError([f"{path}:0: cannot read: {e}"]) from None
    jobs = parse_trace_text(text, where=str(path), gpus=gpus, gpu_mib=gpu_mib,
                            summaries=summaries, base_dir=path.parent)
    name = re.sub(r"[^A-Za-z0-9_.+-]", "_", path.stem) or "trace"
    return Trace(name, f"{len(jobs)} jobs from {path.name}, 1 node x {gpus} GPUs x "
                 f"{gpu_mib // 1024} GiB", gpus, gpu_mib, jobs)
