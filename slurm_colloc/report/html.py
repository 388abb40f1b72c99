"""A self-contained HTML page of a job report: inline CSS and SVG, no script, no CDN.

Per attempt with a series: the job's GPU memory over time against its limit and
estimate, SM activity (or utilisation) over time, and the jobs that shared the GPU
(a timeline when the node-local series is readable here; from the accounting
record's downsampled series, on any other host, the plots have its few dozen points
and the co-tenants without times). Everything user-controlled (job name, user,
paths, evidence lines) is escaped.
"""

from __future__ import annotations

from html import escape

from slurm_colloc.metrics.store import Series
from slurm_colloc.report.model import SOURCE_ACCOUNTING, AttemptView, JobReport
from slurm_colloc.report.recommend import gib

W, H, PAD_L, PAD_B = 640, 180, 56, 24

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:900px}
h1{font-size:1.4em}h2{font-size:1.1em;margin-top:1.6em}
table{border-collapse:collapse}td,th{padding:2px 10px;text-align:left}
th{background:#eee}.ok{color:#070}.warn{color:#a60}.bad{color:#b00}
svg{background:#fafafa;border:1px solid #ddd;margin:4px 0}
.note{margin:2px 0}.rec{margin:2px 0;color:#064}
"""


def _poly(points: list[tuple[float, float]], color: str, dash: str = "") -> str:
    pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
    d = f' stroke-dasharray="{dash}"' if dash else ""
    return f'<polyline fill="none" stroke="{color}" stroke-width="1.5"{d} points="{pts}"/>'


def _axes(title: str, ymax_label: str, xmax: float) -> str:
    return (
        f'<text x="4" y="14" font-size="12">{escape(title)}</text>'
        f'<line x1="{PAD_L}" y1="{H - PAD_B}" x2="{W - 8}" y2="{H - PAD_B}" stroke="#999"/>'
        f'<line x1="{PAD_L}" y1="20" x2="{PAD_L}" y2="{H - PAD_B}" stroke="#999"/>'
        f'<text x="4" y="28" font-size="10">{escape(ymax_label)}</text>'
        f'<text x="4" y="{H - PAD_B}" font-size="10">0</text>'
        f'<text x="{W - 60}" y="{H - 6}" font-size="10">{xmax:.0f} s</text>'
    )


def _xy(t: float, v: float, t0: float, span: float, vmax: float) -> tuple[float, float]:
    x = PAD_L + (t - t0) / span * (W - 8 - PAD_L)
    y = (H - PAD_B) - min(v, vmax) / vmax * (H - PAD_B - 20)
    return x, y


def memory_svg(a: AttemptView, s: Series, gpu_mib: int | None) -> str:
    """Job memory over time, with its limit (red, dashed) and estimate (blue, dotted)."""
    rows = s.rows
    t0, span = rows[0].t, max(1.0, rows[-1].t - rows[0].t)
    vmax = float(max([r.mem_max_mib for r in rows] + [a.limit_mib or 0, a.estimate_mib or 0,
                                                     1]) * 1.1)
    if gpu_mib:
        vmax = min(vmax, float(gpu_mib))
    body = [_axes("GPU memory of this job", gib(vmax), span)]
    body.append(_poly([_xy(r.t, r.mem_max_mib, t0, span, vmax) for r in rows], "#1f77b4"))
    for val, color, dash, name in ((a.limit_mib, "#d62728", "6,3", "limit"),
                                   (a.estimate_mib, "#2ca02c", "2,3", "estimate")):
        if val:
            y = _xy(t0, val, t0, span, vmax)[1]
            body.append(_poly([(PAD_L, y), (W - 8, y)], color, dash))
            body.append(f'<text x="{W - 120}" y="{y - 3:.1f}" font-size="10" fill="{color}">'
                        f"{name} {gib(val)}</text>")
    return _svg(body, "memory")


def activity_svg(s: Series) -> str:
    """SM activity (or utilisation when SM activity is not measured) over time."""
    rows = s.rows
    t0, span = rows[0].t, max(1.0, rows[-1].t - rows[0].t)
    sm = [(r.t, r.sm_pct) for r in rows if r.sm_pct is not None]
    label = "SM activity of the GPU (%)"
    if not sm:
        sm = [(r.t, r.util_pct) for r in rows if r.util_pct is not None]
        label = "GPU utilization (%) - SM activity not measured"
    body = [_axes(label, "100%", span)]
    if sm:
        body.append(_poly([_xy(t, v or 0.0, t0, span, 100.0) for t, v in sm], "#ff7f0e"))
    return _svg(body, "activity")


def tenants_svg(a: AttemptView, s: Series) -> str:
    """One lane per co-tenant: when it shared the GPU."""
    rows = s.rows
    span = max(1.0, rows[-1].t - rows[0].t)
    lanes = a.tenants_timeline
    h = 28 + 18 * max(1, len(lanes))
    body = [f'<text x="4" y="14" font-size="12">Jobs sharing GPU {escape(str(a.gpu))}</text>']
    if not lanes and a.co_tenants and a.series_source == SOURCE_ACCOUNTING:
        body.append('<text x="60" y="34" font-size="11">'
                    f"job(s) {escape(', '.join(a.co_tenants))}: times are not in the "
                    "accounting record</text>")
    elif not lanes:
        body.append('<text x="60" y="34" font-size="11">none: the job had the GPU alone</text>')
    for i, x in enumerate(lanes):
        y = 22 + 18 * i
        x0 = PAD_L + x["from"] / span * (W - 8 - PAD_L)
        x1 = PAD_L + max(x["to"], x["from"] + 1) / span * (W - 8 - PAD_L)
        body.append(f'<text x="4" y="{y + 11}" font-size="10">job {escape(str(x["job_id"]))}'
                    "</text>")
        body.append(f'<rect x="{x0:.1f}" y="{y}" width="{max(1.0, x1 - x0):.1f}" height="12" '
                    'fill="#9467bd"/>')
    return _svg(body, "tenants", h)


def _svg(body: list[str], role: str, h: int = H) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h}" '
            f'viewBox="0 0 {W} {h}" data-plot="{role}">' + "".join(body) + "</svg>")


def render(rep: JobReport) -> str:
    """The page."""
    e = escape
    out = ["<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">",
           f"<title>colloc report: job {e(rep.job_id)}</title><style>{_CSS}</style></head><body>",
           f"<h1>colloc job report: job {e(rep.job_id)} {e(rep.name)}</h1><table>"]
    for k, v in (("User", rep.user), ("State", rep.state), ("Exit code", rep.exit_code),
                 ("Node", rep.node), ("Attempts", str(len(rep.attempts)))):
        out.append(f"<tr><th>{k}</th><td>{e(v or '?')}</td></tr>")
    out.append("</table><h2>Attempts</h2><table><tr>")
    cols = ("#", "GPU", "limit", "estimate", "peak", "mean", "SM activity", "energy",
            "shared with", "outcome", "OOM evidence")
    out.append("".join(f"<th>{c}</th>" for c in cols) + "</tr>")
    for a in rep.attempts:
        cls = "ok" if a.outcome == "COMPLETED" else ("warn" if "requeued" in a.outcome
                                                     else "bad")
        vals = (str(a.attempt), "?" if a.gpu is None else str(a.gpu), gib(a.limit_mib),
                gib(a.estimate_mib), gib(a.peak_mib), gib(a.mean_mib),
                "-" if a.sm_activity is None else f"{a.sm_activity:.0%}",
                f"{a.energy_j / 3.6e3:.2f} Wh" if a.energy_j else "-",
                ", ".join(a.co_tenants) or "alone", a.outcome,
                (a.oom or {}).get("evidence_where") or (a.oom or {}).get("evidence") or "-")
        out.append("<tr>" + "".join(
            f'<td class="{cls}">{e(v)}</td>' if i == 9 else f"<td>{e(v)}</td>"
            for i, v in enumerate(vals)) + "</tr>")
    out.append("</table>")
    for a in rep.attempts:
        s = rep.series.get(a.attempt)
        out.append(f"<h2>Attempt {a.attempt} over time</h2>")
        tail = (a.oom or {}).get("evidence_tail") or []
        if tail:
            out.append(f"<p>Last lines of the OOM evidence:</p><pre>{e(chr(10).join(tail))}</pre>")
        if s is None or not s.rows:
            out.append("<p>No time series: none readable on this host and none in the "
                       "accounting record.</p>")
            continue
        out.append(f'<p class="note">Series: {e(a.series_label)}</p>')
        out += [memory_svg(a, s, rep.gpu_memory_mib), "<br>", activity_svg(s), "<br>",
                tenants_svg(a, s)]
    if rep.notes:
        out.append("<h2>Notes</h2>" + "".join(f'<p class="note">{e(n)}</p>' for n in rep.notes))
    if rep.recommendations:
        out.append("<h2>Recommendations</h2>"
                   + "".join(f'<p class="rec">{e(r)}</p>' for r in rep.recommendations))
    out.append("</body></html>\n")
    return "".join(out)
