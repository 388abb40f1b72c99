"""Terminal rendering of a job report with rich, in jobstats' order.

Header (who, what, where, state), overall bars (memory peak against the limit and
the estimate, SM activity), details (one row per attempt), co-tenants over time, the
time series per attempt (its source, node-local or the accounting record's
downsampled one, the holes in its sampling, and ASCII sparklines of memory and
activity), OOM evidence (where it is and whether it is readable from this host), then
notes and recommendations. "What happened" (after the header) says who stopped each
attempt and why, with its exit code as sacct prints it.

Strings from Slurm, job records or the node (job name, user, node, co-tenants, notes
that quote them) reach rich only as :class:`Text` built by :func:`safe`: never parsed
as markup (``train[/]`` crashed the report, ``[link=...]`` made hyperlinks) and with
control characters shown escaped (no terminal escape sequences get through).
"""

from __future__ import annotations

import re

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from slurm_colloc.report import story
from slurm_colloc.report.fmt import gib, hms
from slurm_colloc.report.lost_work import lost_work_lines
from slurm_colloc.report.model import AttemptView, JobReport
from slurm_colloc.report.sampling import collector_stopped, sampling_line

BAR = 30
SPARK = " .:-=+*#%@"
"""ASCII ramp of the sparklines (a login host's terminal may not be UTF-8)."""
SPARK_WIDTH = 48
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def clean(value: object) -> str:
    """``value`` as text with control and bidi-override characters shown as escapes."""
    return _CONTROL.sub(lambda m: ascii(m.group())[1:-1], str(value))


def safe(value: object, style: str = "") -> Text:
    """A rich Text of untrusted ``value``: literal (no markup) and without controls."""
    return Text(clean(value), style=style)




def bar(label: str, frac: float | None, right: str, *, warn: float = 0.9,
        low: float | None = None) -> Text:
    """A jobstats-style bar: ``label [||||||      ] right``."""
    t = Text(f"  {label:<18}")
    if frac is None:
        t.append("[" + " " * BAR + "]", style="dim")
        t.append("  not measured", style="dim")
        return t
    filled = max(0, min(BAR, round(frac * BAR)))
    style = "red" if frac >= warn else ("yellow" if low is not None and frac < low else "green")
    t.append("[")
    t.append("|" * filled, style=style)
    t.append(" " * (BAR - filled) + "]")
    t.append(f"  {right}")
    return t


def _outcome_style(o: str) -> str:
    if "requeued" in o or "oom" in o or "fault" in o:
        return "yellow"
    return "green" if o == "COMPLETED" else ("cyan" if o in ("RUNNING",) else "red")


def _g(mib: float | None) -> str:
    return "-" if mib is None else f"{mib / 1024:.1f}"


def _detail_table(rep: JobReport) -> Table:
    t = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("#", "GPU", "limit", "est.", "peak", "mean", "SM", "Wh", "shared with",
                "outcome"):
        t.add_column(col, justify="left" if col in ("shared with", "outcome") else "right",
                     no_wrap=col != "shared with")
    for a in rep.attempts:
        sm = "-" if a.sm_activity is None else f"{a.sm_activity:.0%}" + (
            "*" if a.sm_source == "utilization" else "")
        t.add_row(
            str(a.attempt), "?" if a.gpu is None else str(a.gpu), _g(a.limit_mib),
            _g(a.estimate_mib), _g(a.peak_mib), _g(a.mean_mib), sm,
            f"{a.energy_j / 3.6e3:.2f}" if a.energy_j else "-",
            safe(", ".join(a.co_tenants) or "alone"),
            safe(a.outcome, style=_outcome_style(a.outcome)),
        )
    return t


def _timeline(a: AttemptView) -> list[Text]:
    if not a.tenants_timeline:
        return []
    out = [safe(f"  Co-tenants of attempt {a.attempt} on GPU {a.gpu} (seconds from its start)",
                style="bold")]
    end = max(x["to"] for x in a.tenants_timeline) or 1.0
    for x in a.tenants_timeline:
        lo = round(x["from"] / end * BAR) if end else 0
        hi = max(lo + 1, round(x["to"] / end * BAR))
        line = safe(f"  job {x['job_id']!s:<12}")
        line.append(" " * lo + "=" * (hi - lo), style="magenta")
        line.append(" " * (BAR - hi) + f"  {x['from']:.0f}s .. {x['to']:.0f}s")
        out.append(line)
    return out


def sparkline(values: list[float | None], vmax: float, width: int = SPARK_WIDTH) -> str:
    """``values`` in at most ``width`` columns (max per column), scaled to ``vmax``."""
    if not values:
        return ""
    cols = min(width, len(values))
    out = []
    for c in range(cols):
        chunk = [v for v in values[c * len(values) // cols:(c + 1) * len(values) // cols]
                 if v is not None]
        if not chunk or vmax <= 0:
            out.append("?" if not chunk else SPARK[0])
            continue
        frac = min(1.0, max(0.0, max(chunk) / vmax))
        out.append(SPARK[round(frac * (len(SPARK) - 1))])
    return "".join(out)


def _series_lines(a: AttemptView, gpu_mib: int | None) -> list[Text]:
    out = [safe(f"  Attempt {a.attempt}: {a.series_label}")]
    gaps = sampling_line(a.sampling)
    if gaps:
        out.append(Text(f"    {gaps}", style="red" if collector_stopped(a.sampling)
                        else "yellow"))
    pts = a.series_points
    if not pts:
        return out
    cap = float(a.limit_mib or gpu_mib or max(int(p[1] or 0) for p in pts) or 1)
    mem = [None if p[1] is None else float(p[1]) for p in pts]
    span = pts[-1][0] or 0
    line = Text(f"    {'memory':<10} [")
    line.append(sparkline(mem, cap), style="blue")
    line.append(f"]  0..{span:.0f} s, top = {gib(cap)}"
                + (" (limit)" if a.limit_mib else ""))
    out.append(line)
    act = [None if p[2] is None else float(p[2]) for p in pts]
    if any(v is not None for v in act):
        label = "SM" if a.sm_source != "utilization" else "util."
        line = Text(f"    {label:<10} [")
        line.append(sparkline(act, 100.0), style="yellow")
        line.append("]  top = 100%")
        out.append(line)
    return out


def _evidence_lines(a: AttemptView) -> list[Text]:
    oom = a.oom or {}
    if not oom.get("evidence"):
        return []
    where = oom.get("evidence_where") or str(oom["evidence"])
    style = "" if oom.get("evidence_readable") else "yellow"
    out = [safe(f"  Attempt {a.attempt}: {where}", style=style)]
    out += [safe(f"    | {ln}", style="dim") for ln in oom.get("evidence_tail") or []]
    return out


def _story_lines(rep: JobReport) -> list[RenderableType]:
    """"What happened": who stopped each attempt and why, its exit code, how much of
    it was measured (:mod:`slurm_colloc.report.story`)."""
    if not any(a.story for a in rep.attempts):
        return []
    out: list[RenderableType] = [Text(""), Text("What happened", style="bold")]
    for a in rep.attempts:
        if a.story:
            out.append(safe(f"  {story.line(a)}",
                            style="" if a.story["cause"] in ("completed", "running")
                            else "yellow"))
    return out


def render(rep: JobReport) -> RenderableType:
    """The whole report as one rich renderable (jobstats' order: header, bars,
    details, notes)."""
    rule = Text("=" * 78, style="dim")
    title = safe(f"colloc job report: job {rep.job_id}", style="bold")
    title.justify = "center"
    parts: list[RenderableType] = [rule, title, rule, _header(rep)]
    parts += [safe(f"  {rep.accounting}", style="bold yellow")] if rep.accounting else []
    if not rep.colloc:
        parts += [Text(""), *[safe(f"  * {n}") for n in rep.notes]]
        return Group(*parts)
    parts += _story_lines(rep)
    parts += [Text(""), Text("Overall (last measured attempt)", style="bold"), *_overall(rep)]
    parts += [Text(""), Text("Attempts (memory in GiB; * = utilization, not SM activity)",
                   style="bold"), _detail_table(rep)]
    for a in rep.attempts:
        tl = _timeline(a)
        if tl:
            parts += [Text(""), *tl]
    if rep.attempts:
        parts += [Text(""), Text("Time series (memory against the limit; activity %)",
                                 style="bold")]
        for a in rep.attempts:
            parts += _series_lines(a, rep.gpu_memory_mib)
    ev = [ln for a in rep.attempts for ln in _evidence_lines(a)]
    ev += [safe(f"  Attempt {a.attempt}: the job's output could not be scanned: {'; '.join(a.unscanned)}", style="yellow") for a in rep.attempts if a.unscanned]  # noqa: E501 - issue 28
    if ev:
        parts += [Text(""), Text("OOM evidence", style="bold"), *ev]
    parts += [safe(f"  {ln}", style="yellow") for ln in lost_work_lines(rep.attempts)]
    if rep.notes:
        parts += [Text(""), Text("Notes", style="bold")]
        parts += [safe(f"  * {n}") for n in rep.notes]
    if rep.recommendations:
        parts += [Text(""), Text("Recommendations", style="bold green")]
        parts += [safe(f"  * {r}") for r in rep.recommendations]
    if rep.next_estimate:  # issue 27: which runs size the next submission
        parts += [Text(""), safe(f"Next estimate for this model: {rep.next_estimate['summary']}")]
    return Group(*parts)


def _header(rep: JobReport) -> Table:
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("Job", safe(f"{rep.job_id}  {rep.name}"))
    head.add_row("User", safe(rep.user or "?"))
    state = safe(rep.state, style=_outcome_style(rep.state))
    if rep.exit_code and rep.exit_code != "0:0":
        state.append(clean(f"  (exit {rep.exit_code}: {story.exit_words(rep.exit_code)})"))
    head.add_row("State", state)
    head.add_row("Node", safe(rep.node or "?"))
    head.add_row("Elapsed", hms(rep.elapsed_s))
    head.add_row("Attempts", str(len(rep.attempts)))
    if rep.request:
        head.add_row("Request", safe(rep.request))
    if rep.submitted:
        s = rep.submitted
        head.add_row("Submitted", safe(f"{s['mode']}: {gib(s['estimate_mib'])} ({s['estimator']})"
                                       f" -> {s['shards']} shards x {s['shard_mib']} MiB"))
    return head


def _overall(rep: JobReport) -> list[RenderableType]:
    """Bars of the last measured attempt: peak against the limit, estimate, activity."""
    final = next((a for a in reversed(rep.attempts) if a.samples), None)
    if final is None:
        return [Text("  no GPU samples", style="dim")]
    cap = final.limit_mib or rep.gpu_memory_mib
    frac = final.peak_mib / cap if cap and final.peak_mib is not None else None
    of = "limit" if final.limit_mib else "the whole GPU; limit not known"
    parts: list[RenderableType] = [bar(
        "GPU memory peak", frac,
        f"{gib(final.peak_mib)} of {gib(cap)} ({of})" + (
            f" = {frac:.0%}" if frac is not None else ""))]
    if final.estimate_mib and cap:
        parts.append(bar("estimate", final.estimate_mib / cap, gib(final.estimate_mib),
                         warn=2.0))
    label = "SM activity" if final.sm_source != "utilization" else "GPU utilization"
    parts.append(bar(label, final.sm_activity,
                     f"{final.sm_activity:.0%}" if final.sm_activity is not None else "",
                     warn=2.0, low=0.5))
    if final.energy_j:
        parts.append(Text(f"  {'GPU energy':<18} {final.energy_j / 3.6e3:.2f} Wh "
                          f"({final.energy_j / 1000:.1f} kJ, share of the GPU's)"))
    return parts
