"""The job table: ``colloc report --user U --since DATE`` (reportseff-like, one row a job).

Per job (an array task is a job of its own, shown as ``123_4``): state, elapsed,
attempts, what it asked for, its limit, estimate and measured peak, **memory
efficiency** (peak / limit of the last measured attempt), **estimate accuracy**
((estimate - peak) / peak of the first estimate: positive = over-asked), **OOMs**
(attempts that died of GPU OOM or an MPS fault), whether it **shared a GPU** with
another job, and its GPU-hours: allocated + saved = whole-GPU-equivalent, saved only
while it shared (rules in :mod:`.usage`). Jobs without colloc data are listed with
their Slurm facts only. ``--format`` picks the columns (:data:`COLUMNS`, as
reportseff's ``--format``).

Plain dataclasses and rich: no pandas (not a runtime dependency).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from slurm_colloc.config import CollocConfig, RecordField
from slurm_colloc.gpu.budget import config_budget
from slurm_colloc.report.fmt import hms
from slurm_colloc.report.inquirer import JobQuery, JobRow
from slurm_colloc.report.model import SCHEMA_VERSION
from slurm_colloc.report.usage import Usage, job_records, report_usage

DEFAULT_SHARDS_PER_GPU = 40
"""Assumed when ``gpu_memory_mib = 0`` (the table says so)."""


@dataclass
class JobLine:
    """One row of the job table (None = not known / not measured)."""

    job_id: str
    """As users know it: ``123`` or ``123_4`` for an array task."""
    raw_id: str
    user: str
    account: str
    name: str
    partition: str
    state: str
    elapsed_s: int | None
    attempts: int
    colloc: bool
    request: str
    limit_mib: int | None = None
    estimate_mib: int | None = None
    estimator: str | None = None
    peak_mib: int | None = None
    mem_efficiency: float | None = None
    """Peak / limit of the last measured attempt (0..1, may exceed 1 outside MPS)."""
    estimate_error_pct: float | None = None
    """(first estimate - peak) / peak in percent: positive = asked for more than used."""
    sm_activity: float | None = None
    ooms: int = 0
    gpu_hours: float = 0.0
    """Allocated GPU-hours: the GPU time the job held (a whole GPU while alone)."""
    gpu_hours_saved: float = 0.0
    """GPU time other jobs ran on while this one shared its GPU (0 when alone)."""
    whole_gpu_hours: float = 0.0
    """gpu_hours + gpu_hours_saved: a whole GPU per attempt."""
    shared: bool = False
    """It shared a GPU with another job during its run."""


@dataclass
class JobTable:
    """The table and its totals."""

    query: dict[str, Any]
    jobs: list[JobLine] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def totals(self) -> dict[str, Any]:
        """Sums and medians over the table's colloc jobs."""
        cj = [j for j in self.jobs if j.colloc]
        eff = sorted(j.mem_efficiency for j in cj if j.mem_efficiency is not None)
        acc = sorted(j.estimate_error_pct for j in cj if j.estimate_error_pct is not None)
        return {
            "jobs": len(self.jobs), "colloc_jobs": len(cj),
            "shared": sum(j.shared for j in cj),
            "ooms": sum(j.ooms for j in cj),
            "gpu_hours": round(sum(j.gpu_hours for j in cj), 3),
            "gpu_hours_saved": round(sum(j.gpu_hours_saved for j in cj), 3),
            "whole_gpu_hours": round(sum(j.whole_gpu_hours for j in cj), 3),
            "median_mem_efficiency": eff[len(eff) // 2] if eff else None,
            "median_estimate_error_pct": acc[len(acc) // 2] if acc else None,
        }

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` object of the table (``schema_version`` first)."""
        return {"schema_version": SCHEMA_VERSION, "query": self.query,
                "totals": self.totals, "jobs": [asdict(j) for j in self.jobs],
                "warnings": list(self.warnings)}


def _line(lines: list[JobRow], usage: Usage | None,
          prefer: RecordField = "admin_comment") -> JobLine:
    """One job's row from its accounting lines (oldest attempt first) and its usage
    (None: its records could not be read); ``prefer``: config ``record_field``."""
    last = lines[-1]
    rec, sub = job_records(lines, prefer)
    if usage is None:
        raise ValueError("records unreadable")
    out = JobLine(job_id=last.shown_id, raw_id=last.job_id, user=last.user,
                  account=last.account, name=last.name,
                  partition=",".join(dict.fromkeys(ln.partition for ln in lines
                                                   if ln.partition)), state=last.state,
                  elapsed_s=sum(ln.elapsed_s or 0 for ln in lines) if any(
                      ln.elapsed_s is not None for ln in lines) else None,
                  attempts=len(lines), colloc=bool(rec or sub), request=last.req_tres)
    if sub is not None:
        out.request = f"{sub.shards} shards ({sub.alloc_mib} MiB)" + (
            f", {sub.mode}" if sub.mode else "")
        out.limit_mib = sub.alloc_mib
        out.estimate_mib = sub.est_mib or sub.need_mib
        out.estimator = sub.estimator or sub.mode
    attempts = rec.attempts if rec else ()
    out.attempts = max(out.attempts, len(attempts))
    u = usage
    out.gpu_hours, out.gpu_hours_saved, out.ooms = u.gpu_hours, u.gpu_hours_saved, u.gpu_crashes
    out.whole_gpu_hours, out.shared = u.whole_gpu_hours, u.shared
    if attempts and attempts[0].estimate and attempts[0].estimate.mib:
        out.estimate_mib = attempts[0].estimate.mib
        out.estimator = attempts[0].estimate.estimator
    measured = [a for a in attempts if a.metrics and a.metrics.peak_mib]
    if measured:
        m = measured[-1]
        peak = m.metrics.peak_mib if m.metrics else None
        out.peak_mib = peak
        out.sm_activity = m.metrics.mean_sm_activity if m.metrics else None
        out.limit_mib = m.limit_mib or out.limit_mib
        if out.limit_mib and peak is not None:
            out.mem_efficiency = round(peak / out.limit_mib, 3)
        ok = [a for a in measured if not a.oom]
        if ok and out.estimate_mib and ok[-1].metrics and ok[-1].metrics.peak_mib:
            peak = ok[-1].metrics.peak_mib
            out.estimate_error_pct = round((out.estimate_mib - peak) / peak * 100, 1)
    elif attempts and attempts[-1].limit_mib:
        out.limit_mib = attempts[-1].limit_mib
    out.whole_gpu_hours = round(out.whole_gpu_hours, 4)
    out.gpu_hours = round(out.gpu_hours, 4)
    out.gpu_hours_saved = round(out.whole_gpu_hours - out.gpu_hours, 4)
    if not all(math.isfinite(x) for x in (out.gpu_hours, out.gpu_hours_saved)):
        raise OverflowError("elapsed time out of range")
    return out


def build_table(rows: list[JobRow], cfg: CollocConfig, query: JobQuery,
                now: float | None = None) -> JobTable:
    """The table of ``rows`` (a job's attempts grouped by raw id); pure.

    A job whose data cannot be folded is left out with a warning naming it.
    """
    budget = config_budget(cfg)
    spg = budget.shards_per_gpu if budget else DEFAULT_SHARDS_PER_GPU
    table = JobTable(query={k: v for k, v in asdict(query).items() if v not in (None, ())})
    if budget is None:
        table.warnings.append(f"gpu_memory_mib = 0 in colloc.conf: GPU-hours assume {spg} "
                              "shards per GPU")
    by_job: dict[str, list[JobRow]] = {}
    for r in rows:
        by_job.setdefault(r.job_id, []).append(r)
    for lines in by_job.values():
        lines.sort(key=lambda r: (r.start is None, r.start or 0))
    usage = report_usage(by_job, spg, cfg.record_field, now)
    for raw, lines in by_job.items():
        try:
            table.jobs.append(_line(lines, usage.get(raw), cfg.record_field))
        except Exception as e:  # noqa: BLE001 - one bad job never hides the others
            table.warnings.append(f"job {lines[-1].shown_id or raw}: skipped, its accounting "
                                  f"data is malformed ({type(e).__name__})")
    table.jobs.sort(key=lambda j: _sort_key(j.job_id))
    return table


def _sort_key(job_id: str) -> tuple[int, int]:
    head, _, task = job_id.partition("_")
    try:
        return int(head), int(task) if task else -1
    except ValueError:
        return (0, 0)




def _g(mib: int | None) -> str:
    return "-" if mib is None else f"{mib / 1024:.1f}"


def _eff_style(j: JobLine) -> str:
    e = j.mem_efficiency
    return "" if e is None else "red" if e < 0.5 else "yellow" if e < 0.75 else "green"


def _h(j: JobLine, v: float) -> str:
    return f"{v:.2f}" if j.colloc else "-"


@dataclass(frozen=True)
class Column:
    """One column of the text table: header, alignment, cell text, cell style."""

    header: str
    right: bool
    cell: Callable[[JobLine], str]
    style: Callable[[JobLine], str] = lambda j: ""
    wrap: bool = False


COLUMNS: dict[str, Column] = {
    # --format names (reportseff's where it has one), matched without case
    "JobID": Column("JobID", False, lambda j: j.job_id),
    # '?': a job without an association read without --user (its JSON names no user)
    "User": Column("User", False, lambda j: j.user or "?"),
    "Account": Column("Account", False, lambda j: j.account),
    "Partition": Column("Partition", False, lambda j: j.partition or "-"),
    "JobName": Column("Name", False, lambda j: j.name[:24], wrap=True),
    "State": Column("State", False, lambda j: j.state),
    "Elapsed": Column("Elapsed", True, lambda j: hms(j.elapsed_s, "-")),
    "Attempts": Column("Att.", True, lambda j: str(j.attempts)),
    "Request": Column("Request", False, lambda j: j.request or "-", wrap=True),
    "Limit": Column("Limit GiB", True, lambda j: _g(j.limit_mib)),
    "Estimate": Column("Est. GiB", True, lambda j: _g(j.estimate_mib)),
    "Peak": Column("Peak GiB", True, lambda j: _g(j.peak_mib)),
    "MemEff": Column("MemEff", True, lambda j: "-" if j.mem_efficiency is None
                     else f"{j.mem_efficiency:.0%}", _eff_style),
    "EstErr": Column("Est. err", True, lambda j: "-" if j.estimate_error_pct is None
                     else f"{j.estimate_error_pct:+.0f}%"),
    "SM": Column("SM", True, lambda j: "-" if j.sm_activity is None else f"{j.sm_activity:.0%}"),
    "OOMs": Column("OOMs", True, lambda j: str(j.ooms), lambda j: "red" if j.ooms else ""),
    "Shared": Column("Shared", False, lambda j: ("yes" if j.shared else "no") if j.colloc
                     else "-"),
    "GPUh": Column("GPU-h", True, lambda j: _h(j, j.gpu_hours)),
    "Saved": Column("Saved GPU-h", True, lambda j: _h(j, j.gpu_hours_saved)),
    "WholeGPUh": Column("Whole GPU-h", True, lambda j: _h(j, j.whole_gpu_hours)),
}
DEFAULT_FORMAT = ("JobID", "User", "JobName", "State", "Elapsed", "Attempts", "Limit",
                  "Estimate", "Peak", "MemEff", "EstErr", "SM", "OOMs", "Shared", "GPUh",
                  "Saved")
_ALIASES = {"name": "JobName", "jobid": "JobID", "att": "Attempts", "gpuhours": "GPUh",
            "savedgpuh": "Saved", "gpuhsaved": "Saved", "wholegpu": "WholeGPUh",
            "collocated": "Shared", "efficiency": "MemEff", "memeff": "MemEff",
            "timeeff": "Elapsed", "limitgib": "Limit", "peakgib": "Peak"}


class FormatError(ValueError):
    """An unknown ``--format`` column; the message lists the valid ones."""


def _norm(name: str) -> str:
    return "".join(c for c in name.lower() if c.isalnum())


def parse_format(text: str | None) -> tuple[str, ...]:
    """``--format JobID,State,MemEff`` -> column names; a leading ``+`` adds to the
    default columns (``+Partition``), as reportseff; None/'' -> the default."""
    if not text or not text.strip():
        return DEFAULT_FORMAT
    text = text.strip()
    add = text.startswith("+")
    names = {_norm(k): k for k in COLUMNS} | {k: v for k, v in _ALIASES.items()}
    out: list[str] = list(DEFAULT_FORMAT) if add else []
    for part in text.lstrip("+").split(","):
        if not part.strip():
            continue
        name = names.get(_norm(part))
        if name is None:
            raise FormatError(f"{part.strip()[:40]!r}: no such column; valid columns: "
                              + ",".join(COLUMNS))
        out.append(name)
    if not out:
        raise FormatError("no columns given; valid columns: " + ",".join(COLUMNS))
    return tuple(dict.fromkeys(out))


def render(t: JobTable, columns: tuple[str, ...] = DEFAULT_FORMAT) -> Any:
    """rich renderable: the table (``columns``, :data:`COLUMNS` names), totals and
    warnings (untrusted text as Text)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from slurm_colloc.report.text import _outcome_style, safe

    cols = [COLUMNS[c] for c in columns]
    tab = Table(header_style="bold", box=None, pad_edge=False)
    for c in cols:
        tab.add_column(c.header, justify="right" if c.right else "left", no_wrap=not c.wrap)
    for j in t.jobs:
        tab.add_row(*(safe(c.cell(j), style=_outcome_style(j.state) if c.header == "State"
                           else c.style(j)) for c in cols))
    tot = t.totals
    what = ", ".join(f"{k} {','.join(v) if isinstance(v, (list, tuple)) else v}"
                     for k, v in t.query.items()) or "all"
    title = safe(f"colloc jobs ({what})")
    title.stylize("bold")
    med_eff = tot["median_mem_efficiency"]
    med_err = tot["median_estimate_error_pct"]
    foot = Text(
        f"{tot['jobs']} jobs, {tot['colloc_jobs']} with colloc data, {tot['shared']} shared "
        f"a GPU; median memory efficiency {'-' if med_eff is None else f'{med_eff:.0%}'}, "
        f"median estimate error {'-' if med_err is None else f'{med_err:+.0f}%'}; "
        f"OOMs {tot['ooms']}; GPU-hours allocated {tot['gpu_hours']:.2f} + saved "
        f"{tot['gpu_hours_saved']:.2f} = {tot['whole_gpu_hours']:.2f} on whole GPUs")
    parts: list[Any] = [title, tab if t.jobs else Text("  no jobs", style="dim"), Text(""), foot,
                        Text("MemEff = peak / limit; Est. err = (estimate - peak) / peak "
                             "(+ = asked for more than used); saved = GPU time other jobs "
                             "ran on while the job shared its GPU", style="dim")]
    if t.warnings:
        parts += [Text(""), Text("Skipped", style="bold yellow")]
        parts += [safe(f"  * {w}") for w in t.warnings]
    return Group(*parts)
