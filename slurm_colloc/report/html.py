"""A self-contained HTML page of a job report: inline CSS and SVG, no script, no CDN.

Per attempt with a series, three plots that share one time axis (seconds, minutes or
hours since the attempt started, with ticks):

- ``memory``: the job's GPU memory (blue line) against its limit (red, dashed) and its
  estimate (green, dotted), GiB ticks on the y axis; the legend sits above the plot,
  so the limit and estimate never write over each other even when they are equal;
- ``activity``: SM activity (or GPU utilisation where SM activity is not measured)
  in percent, and below it the GPU's power in watts with the energy attributed to
  the job; the accounting record's downsampled series has no power, and the plot
  says so instead of drawing nothing;
- ``tenants``: one lane per job that shared the GPU, on the same time axis (from the
  node-local series; the accounting record names co-tenants without times).

Everything user-controlled (job name, user, paths, evidence lines) is escaped; the
page is one file that opens in any browser offline.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

from slurm_colloc.metrics.store import Series
from slurm_colloc.report import story
from slurm_colloc.report.fmt import gib, hms
from slurm_colloc.report.lost_work import lost_work_html
from slurm_colloc.report.model import SOURCE_ACCOUNTING, AttemptView, JobReport
from slurm_colloc.report.sampling import sampling_line

W = 640
"""Width of every plot (px)."""
PAD_L, PAD_R, PAD_T, PAD_B = 64, 16, 44, 40
"""Plot area margins: y tick labels left, legend on top, x ticks and title below."""
H = 220
"""Height of the memory plot."""
PANEL = 150
"""Height of one panel of the activity plot (two panels with power)."""

C_MEM, C_LIMIT, C_EST, C_SM, C_POWER, C_TENANT = (
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#8c564b", "#9467bd")

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:960px}
h1{font-size:1.4em;overflow-wrap:anywhere}h2{font-size:1.1em;margin-top:1.6em}
table{border-collapse:collapse;margin:4px 0;display:block;max-width:100%;overflow-x:auto;
font-size:.92em}
td,th{padding:2px 4px;text-align:left;vertical-align:top}
td{white-space:nowrap}td.wrap{white-space:normal;overflow-wrap:anywhere;min-width:6em}
th{background:#eee}.ok{color:#070}.warn{color:#a60}.bad{color:#b00}
.run{color:#06c;font-weight:bold}.pend{color:#666;font-style:italic}
svg{background:#fafafa;border:1px solid #ddd;margin:4px 0;display:block;max-width:100%;
box-sizing:border-box;height:auto}
svg text{font-family:system-ui,sans-serif}
pre{white-space:pre-wrap;overflow-wrap:anywhere;background:#f6f6f6;padding:4px}
p{overflow-wrap:anywhere}
.note{margin:2px 0}.rec{margin:2px 0;color:#064}.missing{color:#666;font-style:italic}
@media (max-width:600px){body{margin:.5em}td,th{padding:2px 3px}}
"""
"""Readable from a phone (~360 px) to a desktop: a table too wide for the window
scrolls inside its own box (``display:block``) rather than push the page wider; long
names, paths and evidence lines wrap; plots scale down (their viewBox keeps them
sharp) (issue 27)."""

_RUNNING = ("RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED")
_PENDING = ("PENDING", "REQUEUED")


def state_class(state: str) -> str:
    """CSS class of a job state or attempt outcome: running is blue, not an error."""
    s = state.split(" ")[0]
    if s in _RUNNING:
        return "run"
    if s in _PENDING:
        return "pend"
    if s == "COMPLETED":
        return "ok"
    if "requeued" in state:
        return "warn"
    return "bad"


# ------------------------------------------------------------------ axes and ticks ---

def nice_step(span: float, target: int = 5, steps: Sequence[float] = (1, 2, 2.5, 5)) -> float:
    """A round step that divides ``span`` into about ``target`` intervals."""
    if span <= 0 or not math.isfinite(span):
        return 1.0
    raw = span / target
    mag = float(10.0 ** math.floor(math.log10(raw)))
    for s in steps:
        if s * mag >= raw:
            return float(s * mag)
    return 10.0 * mag


_TIME_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600,
               43200, 86400)


def time_step(span: float, target: int = 6) -> float:
    """A step in seconds that gives at most about ``target`` time ticks."""
    for s in _TIME_STEPS:
        if span / s <= target:
            return float(s)
    return float(math.ceil(span / target / 86400) * 86400)


def time_label(t: float, span: float) -> str:
    """A tick label: seconds under 3 minutes, minutes under 3 hours, else hours."""
    if span < 180:
        return f"{t:.0f} s"
    if span < 3 * 3600:
        return f"{t / 60:.0f} min" if t % 60 == 0 else f"{t / 60:.1f} min"
    return f"{t / 3600:.0f} h" if t % 3600 == 0 else f"{t / 3600:.1f} h"


def mib_label(mib: float) -> str:
    """A memory tick label (GiB, or MiB under 1 GiB)."""
    if mib == 0:
        return "0"
    if mib < 1024:
        return f"{mib:.0f} MiB"
    g = mib / 1024
    return f"{g:.0f} GiB" if g == int(g) else f"{g:.1f} GiB"


def mib_step(vmax: float) -> float:
    """A memory tick step: a power-of-two-ish number of GiB (or MiB)."""
    for s in (64, 128, 256, 512, 1024, 2048, 4096, 5120, 10240, 20480, 40960, 81920,
              163840):
        if vmax / s <= 6:
            return float(s)
    return nice_step(vmax, 5)


class _Frame:
    """One plot area: data coordinates to pixels, and its axes."""

    def __init__(self, top: float, height: float, span: float, vmax: float) -> None:
        self.x0, self.x1 = float(PAD_L), float(W - PAD_R)
        self.y0, self.y1 = top + height, top  # y0: bottom (value 0)
        self.span = max(1.0, span)
        self.vmax = vmax if vmax > 0 else 1.0

    def x(self, t: float) -> float:
        return self.x0 + min(max(t, 0.0), self.span) / self.span * (self.x1 - self.x0)

    def y(self, v: float) -> float:
        return self.y0 - min(max(v, 0.0), self.vmax) / self.vmax * (self.y0 - self.y1)

    def axes(self, ystep: float, ylabel: object, x_title: bool = True) -> list[str]:
        """Grid, ticks and tick labels of both axes (y labels from ``ylabel(v)``)."""
        out = []
        n = int(self.vmax / ystep + 1e-9)
        for i in range(n + 1):
            v = i * ystep
            y = self.y(v)
            out.append(f'<line x1="{self.x0:.1f}" y1="{y:.1f}" x2="{self.x1:.1f}" '
                       f'y2="{y:.1f}" stroke="#e2e2e2"/>')
            out.append(f'<line x1="{self.x0 - 4:.1f}" y1="{y:.1f}" x2="{self.x0:.1f}" '
                       f'y2="{y:.1f}" stroke="#666"/>')
            label = ylabel(v) if callable(ylabel) else str(v)
            out.append(f'<text x="{self.x0 - 6:.1f}" y="{y + 3.5:.1f}" font-size="10" '
                       f'text-anchor="end">{escape(label)}</text>')
        tstep = time_step(self.span)
        k = 0
        while k * tstep <= self.span + 1e-9:
            t = k * tstep
            x = self.x(t)
            out.append(f'<line x1="{x:.1f}" y1="{self.y0:.1f}" x2="{x:.1f}" '
                       f'y2="{self.y0 + 4:.1f}" stroke="#666"/>')
            out.append(f'<text x="{x:.1f}" y="{self.y0 + 15:.1f}" font-size="10" '
                       f'text-anchor="middle">{escape(time_label(t, self.span))}</text>')
            k += 1
        out.append(f'<line x1="{self.x0:.1f}" y1="{self.y0:.1f}" x2="{self.x1:.1f}" '
                   f'y2="{self.y0:.1f}" stroke="#666"/>')
        out.append(f'<line x1="{self.x0:.1f}" y1="{self.y1:.1f}" x2="{self.x0:.1f}" '
                   f'y2="{self.y0:.1f}" stroke="#666"/>')
        if x_title:
            out.append(f'<text x="{(self.x0 + self.x1) / 2:.1f}" y="{self.y0 + 30:.1f}" '
                       'font-size="10" text-anchor="middle" fill="#555">time since the '
                       'attempt started</text>')
        return out


def _poly(points: list[tuple[float, float]], color: str, dash: str = "",
          width: float = 1.8) -> str:
    pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
    d = f' stroke-dasharray="{dash}"' if dash else ""
    return (f'<polyline fill="none" stroke="{color}" stroke-width="{width}"{d} '
            f'points="{pts}"/>')


def _markers(points: list[tuple[float, float]], color: str) -> list[str]:
    """Dots for a line too short to see (one or two points)."""
    if len(points) > 2:
        return []
    return [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}"/>' for x, y in points]


def _legend(items: list[tuple[str, str, str]], y: float = 14, x: float = PAD_L) -> list[str]:
    """A row of (colour, dash, label) entries; labels are placed one after another."""
    out = []
    for color, dash, label in items:
        d = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<line x1="{x:.1f}" y1="{y - 4:.1f}" x2="{x + 22:.1f}" y2="{y - 4:.1f}" '
                   f'stroke="{color}" stroke-width="2"{d}/>')
        out.append(f'<text x="{x + 27:.1f}" y="{y:.1f}" font-size="11">{escape(label)}</text>')
        x += 27 + 6.2 * len(label) + 16
    return out


def _title(text: str, y: float) -> str:
    return f'<text x="4" y="{y:.1f}" font-size="12" font-weight="bold">{escape(text)}</text>'


def _span(s: Series) -> tuple[float, float]:
    rows = s.rows
    return rows[0].t, max(1.0, rows[-1].t - rows[0].t)


# ------------------------------------------------------------------------ the plots ---

def memory_svg(a: AttemptView, s: Series, gpu_mib: int | None) -> str:
    """Job memory over time (blue), its limit (red, dashed) and estimate (green, dotted)."""
    rows = s.rows
    t0, span = _span(s)
    top = float(max([r.mem_max_mib for r in rows] + [a.limit_mib or 0, a.estimate_mib or 0, 1]))
    if gpu_mib and not a.limit_mib:
        top = max(top, min(top * 1.1, gpu_mib))
    step = mib_step(top * 1.08)
    vmax = step * math.ceil(top * 1.08 / step)
    f = _Frame(PAD_T, H - PAD_T - PAD_B, span, vmax)
    body = [_title("GPU memory of this job", 15)]
    body += f.axes(step, mib_label)
    peak = max(r.mem_max_mib for r in rows)
    legend = [(C_MEM, "", f"job memory (peak {gib(peak)})")]
    lines = [_poly([(f.x(r.t - t0), f.y(r.mem_max_mib)) for r in rows], C_MEM)]
    lines += _markers([(f.x(r.t - t0), f.y(r.mem_max_mib)) for r in rows], C_MEM)
    same = a.limit_mib is not None and a.limit_mib == a.estimate_mib
    for val, color, dash, name in ((a.limit_mib, C_LIMIT, "7,4", "limit"),
                                   (a.estimate_mib, C_EST, "2,3", "estimate")):
        if val:
            y = f.y(val)
            lines.append(_poly([(f.x0, y), (f.x1, y)], color, dash, 1.5))
            label = f"{name} {gib(val)}" + (" (= limit)" if same and name == "estimate" else "")
            legend.append((color, dash, label))
        else:
            legend.append(("#bbb", "1,3", f"{name}: not known"))
    body += _legend(legend, 32)
    body += lines
    return _svg(body, "memory", H)


def activity_svg(s: Series, energy_j: float | None = None) -> str:
    """SM activity (or utilisation when SM activity is not measured) over time, and the
    GPU's power below it when the series has power (the accounting series has not)."""
    rows = s.rows
    t0, span = _span(s)
    act = [(r.t - t0, r.sm_pct) for r in rows if r.sm_pct is not None]
    label = "SM activity of the GPU (%)"
    if not act:
        act = [(r.t - t0, r.util_pct) for r in rows if r.util_pct is not None]
        label = "GPU utilization (%) - SM activity not measured"
    power = [(r.t - t0, r.power_w) for r in rows if r.power_w is not None]
    h1 = PANEL
    f = _Frame(PAD_T, h1 - PAD_T - 28, span, 100.0)
    body = [_title(label, 15)]
    body += f.axes(25.0, lambda v: f"{v:.0f}%", x_title=False)
    if act:
        pts = [(f.x(t), f.y(v or 0.0)) for t, v in act]
        body.append(_poly(pts, C_SM))
        body += _markers(pts, C_SM)
        mean = sum(v or 0.0 for _, v in act) / len(act)
        body += _legend([(C_SM, "", f"{label.split(' (')[0]} (mean {mean:.0f}%)")], 32)
    else:
        body.append(f'<text x="{PAD_L + 10}" y="{PAD_T + 30}" font-size="11" fill="#666">'
                    "activity not measured</text>")
    total = energy_j if energy_j else sum(r.energy_j for r in rows) or None
    wh = f"{total / 3.6e3:.2f} Wh attributed to the job" if total else "energy not measured"
    if power:
        h2 = PANEL
        pmax = max(v or 0.0 for _, v in power)
        pstep = nice_step(max(pmax, 1.0) * 1.1, 4)
        g = _Frame(h1 + 30, h2 - 30 - PAD_B, span, pstep * math.ceil(max(pmax, 1.0) * 1.1 / pstep))
        body.append(_title(f"GPU power (W); {wh}", h1 + 18))
        body += g.axes(pstep, lambda v: f"{v:.0f} W")
        pts = [(g.x(t), g.y(v or 0.0)) for t, v in power]
        body.append(_poly(pts, C_POWER))
        body += _markers(pts, C_POWER)
        return _svg(body, "activity", h1 + h2)
    body += [f'<text x="{PAD_L}" y="{h1 + 6}" font-size="11" fill="#666">'
             + escape(f"Power: not in this series ({_power_missing(s)}).") + "</text>",
             f'<text x="{PAD_L}" y="{h1 + 22}" font-size="11" fill="#666">'
             + escape(f"Energy: {wh}.") + "</text>"]
    return _svg(body, "activity", h1 + 30)


def _power_missing(s: Series) -> str:
    if all(r.gpu_mem_mib == 0 for r in s.rows):  # rows rebuilt from the accounting record
        return "the accounting record keeps memory and SM activity only"
    return "the node did not report power"


def tenants_svg(a: AttemptView, s: Series) -> str:
    """One lane per co-tenant: when it shared the GPU, on the attempt's time axis."""
    rows = s.rows
    _, span = _span(s)
    lanes = a.tenants_timeline
    lane_h = 18
    h = PAD_T + lane_h * max(1, len(lanes)) + PAD_B
    body = [_title(f"Jobs sharing GPU {a.gpu if a.gpu is not None else '?'}", 16)]
    if not lanes and a.co_tenants and a.series_source == SOURCE_ACCOUNTING:
        body.append(f'<text x="{PAD_L}" y="{PAD_T + 12}" font-size="11">'
                    f"job(s) {escape(', '.join(a.co_tenants))}: times are not in the "
                    "accounting record</text>")
        return _svg(body, "tenants", PAD_T + 26)
    if not lanes:
        body.append(f'<text x="{PAD_L}" y="{PAD_T + 12}" font-size="11">none: the job had '
                    "the GPU alone</text>")
        return _svg(body, "tenants", PAD_T + 26)
    f = _Frame(PAD_T - 6, lane_h * len(lanes) + 6, span, 1.0)
    body += [ln for ln in f.axes(10.0, lambda v: "")
             if "stroke=\"#e2e2e2\"" not in ln and "text-anchor=\"end\"" not in ln]
    for i, x in enumerate(lanes):
        y = PAD_T + lane_h * i
        x0, x1 = f.x(x["from"]), f.x(max(x["to"], x["from"] + 1))
        body.append(f'<text x="{PAD_L - 6}" y="{y + 10}" font-size="10" text-anchor="end">'
                    f'job {escape(str(x["job_id"]))}</text>')
        body.append(f'<rect x="{x0:.1f}" y="{y}" width="{max(1.5, x1 - x0):.1f}" '
                    f'height="12" fill="{C_TENANT}"><title>job {escape(str(x["job_id"]))}: '
                    f'{x["from"]:.0f} s to {x["to"]:.0f} s</title></rect>')
    del rows
    return _svg(body, "tenants", h)


def _svg(body: list[str], role: str, h: int) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h}" '
            f'viewBox="0 0 {W} {h}" data-plot="{role}" role="img">' + "".join(body) + "</svg>")


# ------------------------------------------------------------------------- the page ---



def request_text(rep: JobReport) -> str:
    """What the job asked for, in words (the submit record, else Slurm's ReqTRES)."""
    s = rep.submitted
    parts = []
    if s:
        how = {"estimate": f"estimated {gib(s['estimate_mib'])} ({s['estimator']})",
               "explicit": f"--colloc-mem {gib(s['need_mib'])}",
               "default": f"site default {gib(s['need_mib'])}",
               "shards": f"--gres=shard:{s['shards']}",
               "whole": "a whole GPU"}.get(str(s["mode"]), str(s["mode"]))
        parts.append(f"{how} -> {s['shards']} shards x {s['shard_mib']} MiB = "
                     f"{gib(s['alloc_mib'])}")
    if rep.request:
        parts.append(f"Slurm: {rep.request}")
    return "; ".join(parts) or "?"


def _story_html(rep: JobReport) -> list[str]:
    """"What happened" per attempt (:mod:`slurm_colloc.report.story`)."""
    lines = [a for a in rep.attempts if a.story]
    if not lines:
        return []
    return ["<h2>What happened</h2>"] + [
        f'<p class="story" data-cause="{escape(str(a.story["cause"]))}">'
        f"{escape(story.line(a))}</p>" for a in lines if a.story]


def _head_rows(rep: JobReport) -> list[str]:
    """The header table's rows (the exit code as sacct prints it, and in words)."""
    state = rep.state + (" (so far)" if state_class(rep.state) == "run" else "")
    words = story.exit_words(rep.exit_code)
    code = f"{rep.exit_code} ({words})" if rep.exit_code and words else rep.exit_code
    out = []
    for k, v, cls in (("User", rep.user, ""), ("State", state, state_class(rep.state)),
                      ("Exit code", code, ""), ("Node", rep.node, ""),
                      ("Elapsed", hms(rep.elapsed_s), ""),
                      ("Request", request_text(rep), "wrap"),
                      ("Attempts", str(len(rep.attempts)), "")):
        c = f' class="{cls}"' if cls else ""
        out.append(f"<tr><th>{k}</th><td{c}>{escape(v or '?')}</td></tr>")
    return out


def render(rep: JobReport) -> str:
    """The page."""
    e = escape
    out = ["<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>colloc report: job {e(rep.job_id)}</title><style>{_CSS}</style></head><body>",
           f"<h1>colloc job report: job {e(rep.job_id)} {e(rep.name)}</h1><table>"]
    out += [*_head_rows(rep), "</table>", *_story_html(rep), "<h2>Attempts</h2><table><tr>"]
    cols = ("#", "GPU", "limit", "estimate", "peak", "peak / limit", "mean", "SM activity",
            "energy", "shared with", "outcome", "OOM evidence")
    out.append("".join(f"<th>{c}</th>" for c in cols) + "</tr>")
    for a in rep.attempts:
        frac = (f"{a.peak_mib / a.limit_mib:.0%}" if a.peak_mib is not None and a.limit_mib
                else "-")
        vals = (str(a.attempt), "?" if a.gpu is None else str(a.gpu), gib(a.limit_mib),
                gib(a.estimate_mib), gib(a.peak_mib), frac, gib(a.mean_mib),
                "-" if a.sm_activity is None else f"{a.sm_activity:.0%}"
                + (" (util.)" if a.sm_source == "utilization" else ""),
                f"{a.energy_j / 3.6e3:.2f} Wh" if a.energy_j else "-",
                ", ".join(a.co_tenants) or "alone", a.outcome,
                (a.oom or {}).get("evidence_where") or (a.oom or {}).get("evidence") or "-")
        out.append("<tr>" + "".join(
            f'<td class="{state_class(a.outcome)}">{e(v)}</td>' if i == 10 else
            f'<td class="wrap">{e(v)}</td>' if i in (9, 11) else f"<td>{e(v)}</td>"
            for i, v in enumerate(vals)) + "</tr>")
    out.append("</table>")
    out += [f'<p class="warn"><b>{e(rep.accounting)}</b></p>'] if rep.accounting else []
    for a in rep.attempts:
        s = rep.series.get(a.attempt)
        out.append(f"<h2>Attempt {a.attempt} over time</h2>" + lost_work_html(a))
        if (gaps := sampling_line(a.sampling)) is not None:
            out.append(f'<p class="missing">{e(gaps)}</p>')
        tail = (a.oom or {}).get("evidence_tail") or []
        if tail:
            out.append(f"<p>Last lines of the OOM evidence:</p><pre>{e(chr(10).join(tail))}</pre>")
        if s is None or not s.rows:
            out.append('<p class="missing">No time series: none readable on this host and '
                       "none in the accounting record.</p>")
            continue
        out.append(f'<p class="note">Series: {e(a.series_label)}</p>')
        if a.series_source == SOURCE_ACCOUNTING:
            out.append('<p class="missing">The accounting record keeps memory and SM '
                       "activity per interval; power and co-tenant times are only in the "
                       "node-local series (run the report on the compute node for them)."
                       "</p>")
        out += [memory_svg(a, s, rep.gpu_memory_mib), activity_svg(s, a.energy_j),
                tenants_svg(a, s)]
    if rep.notes:
        out.append("<h2>Notes</h2>" + "".join(f'<p class="note">{e(n)}</p>' for n in rep.notes))
    if rep.recommendations:
        out.append("<h2>Recommendations</h2>"
                   + "".join(f'<p class="rec">{e(r)}</p>' for r in rep.recommendations))
    out += [*_next_estimate(rep), "</body></html>\n"]
    return "".join(out)


def _next_estimate(rep: JobReport) -> list[str]:
    """Which runs size the next submission of this model (issue 27), if known."""
    if not rep.next_estimate:
        return []
    return [f'<p class="note">Next estimate for this model: '
            f'{escape(str(rep.next_estimate.get("summary", "")))}</p>']
