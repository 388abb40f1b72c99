"""Results files: per-policy CSV, per-job CSV, GPU time series CSV, markdown table."""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping, Sequence
from dataclasses import asdict, fields
from pathlib import Path

from slurm_colloc.bench.collect import JobOutcome
from slurm_colloc.bench.metrics import PolicyMetrics
from slurm_colloc.bench.sampler import GpuPoint


def metrics_csv(rows: Sequence[PolicyMetrics]) -> str:
    """One line per policy."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=[f.name for f in fields(PolicyMetrics)],
                       lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: (round(v, 4) if isinstance(v, float) else v)
                    for k, v in asdict(r).items()})
    return buf.getvalue()


def outcomes_csv(policy_outcomes: Mapping[str, Sequence[JobOutcome]], t0: float,
                 scale: float) -> str:
    """One line per job and policy; times in trace hours after trace start."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["policy", "job", "job_id", "state", "attempts", "submit_h", "start_h", "end_h",
                "oom_crashes", "requeues", "gres", "need_mib", "mode", "first_gpu_h",
                "recovery_wait_h"])
    h = scale / 3600.0

    def rel(t: float | None) -> str:
        return "" if t is None else f"{(t - t0) * h:.3f}"

    for policy, outs in policy_outcomes.items():
        for o in outs:
            w.writerow([policy, o.name, o.job_id, o.state, o.attempts, rel(o.submit),
                        rel(o.start), rel(o.end), o.oom_crashes, o.requeues, o.gres,
                        o.need_mib if o.need_mib is not None else "", o.mode,
                        rel(o.first_on_gpu),
                        "" if o.recovery_wait is None else f"{o.recovery_wait * h:.3f}"])
    return buf.getvalue()


def timeseries_csv(policy_points: Mapping[str, Sequence[GpuPoint]], t0: float,
                   scale: float) -> str:
    """GPU samples; ``t_h`` = trace hours after trace start."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["policy", "t_h", "gpu", "memory_mib", "sm_pct", "power_w", "energy_j",
                "processes"])
    for policy, pts in policy_points.items():
        for p in pts:
            w.writerow([policy, f"{(p.t - t0) * scale / 3600:.4f}", p.gpu, p.memory_mib,
                        f"{p.sm_pct:.1f}", f"{p.power_w:.1f}", f"{p.energy_j:.0f}", p.processes])
    return buf.getvalue()


def markdown_table(rows: Sequence[PolicyMetrics]) -> str:
    """The results table as GitHub markdown."""
    head = ("| policy | done/jobs | lost | makespan h | vs whole | mean JCT h | p95 JCT h "
            "| mean wait h | GPU busy | energy kWh (common window) | vs whole "
            "| kWh per done GPU-h | vs whole | energy kWh (own makespan) | OOM crashes "
            "| requeues | fallbacks | wall s | start lag s (real) "
            "| makespan vs whole, lag at real duration | stretch Slurm / GPU time "
            "| p95 wait h | longest OOM recovery wait h |")
    sep = "|" + "---|" * 23
    lines = [head, sep]
    for r in rows:
        lines.append(
            f"| {r.policy} | {r.completed}/{r.jobs} | {r.lost} | {r.makespan_h:.2f} "
            f"| {r.makespan_vs_whole:.2f}x | {r.mean_jct_h:.2f} | {r.p95_jct_h:.2f} "
            f"| {r.mean_wait_h:.2f} | {r.gpu_busy_share:.0%} | {r.energy_common_kwh:.1f} "
            f"| {r.energy_common_vs_whole:.2f}x | {r.kwh_per_gpu_h:.3f} "
            f"| {r.kwh_per_gpu_h_vs_whole:.2f}x | {r.energy_kwh:.1f} | {r.oom_crashes} "
            f"| {r.requeues} | {r.fallbacks} | {r.wall_s:.0f} | {r.start_lag_s:.2f} "
            f"| {r.makespan_corrected_vs_whole:.2f}x | {r.stretch_slurm:.2f} / "
            f"{r.stretch_gpu:.2f} | {r.p95_wait_h:.2f} | {r.recovery_wait_max_h:.2f} |"
        )
    return "\n".join(lines) + "\n"


SUMMARY_METRICS = (
    ("makespan_vs_whole", "makespan vs whole", "{:.2f}x"),
    ("energy_common_vs_whole", "energy (common window) vs whole", "{:.2f}x"),
    ("energy_vs_whole", "energy (own makespan) vs whole", "{:.2f}x"),
    ("kwh_per_gpu_h_vs_whole", "kWh per done GPU-h vs whole", "{:.2f}x"),
    ("makespan_h", "makespan h", "{:.2f}"),
    ("mean_jct_h", "mean JCT h", "{:.2f}"),
    ("completed", "done", "{:.0f}"),
    ("lost", "lost", "{:.0f}"),
    ("oom_crashes", "OOM crashes", "{:.0f}"),
    ("p95_wait_h", "p95 wait h", "{:.2f}"),
    ("recovery_wait_max_h", "longest OOM recovery wait h", "{:.2f}"),
    ("gpu_busy_share", "GPU busy", "{:.2f}"),
    ("idle_while_queued", "GPU idle while jobs wait", "{:.3f}"),
    ("start_lag_s", "start lag s (real)", "{:.2f}"),
    ("makespan_corrected_vs_whole", "makespan vs whole, lag at real duration", "{:.2f}x"),
    ("energy_common_corrected_vs_whole", "energy (common window) vs whole, lag at real "
     "duration", "{:.2f}x"),
    ("stretch_slurm", "stretch by Slurm time", "{:.2f}"),
    ("stretch_gpu", "stretch by GPU time", "{:.2f}"),
)


def _median(v: list[float]) -> float:
    s = sorted(v)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def summary_rows(runs: Sequence[Sequence[PolicyMetrics]]) -> list[dict[str, object]]:
    """Median, min and max of every summary metric per (time scale, policy) over runs."""
    groups: dict[tuple[float, str], list[PolicyMetrics]] = {}
    for rows in runs:
        for r in rows:
            groups.setdefault((r.time_scale, r.policy), []).append(r)
    out: list[dict[str, object]] = []
    for (scale, policy), rs in groups.items():
        row: dict[str, object] = {"trace": rs[0].trace, "time_scale": scale, "policy": policy,
                                  "runs": len(rs)}
        for key, _, _ in SUMMARY_METRICS:
            vals = [float(getattr(r, key)) for r in rs]
            row[f"{key}_median"] = round(_median(vals), 4)
            row[f"{key}_min"] = round(min(vals), 4)
            row[f"{key}_max"] = round(max(vals), 4)
        out.append(row)
    return out


def summary_csv(rows: Sequence[Mapping[str, object]]) -> str:
    """The summary rows as CSV."""
    buf = io.StringIO()
    if rows:
        w = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    return buf.getvalue()


def summary_markdown(rows: Sequence[Mapping[str, object]]) -> str:
    """Median [min-max] per policy and time scale."""
    head = "| time scale | policy | runs | " + " | ".join(t for _, t, _ in SUMMARY_METRICS) + " |"
    lines = [head, "|" + "---|" * (3 + len(SUMMARY_METRICS))]
    for r in rows:
        cells = []
        for key, _, fmt in SUMMARY_METRICS:
            med, lo, hi = (float(r[f"{key}_{x}"]) for x in ("median", "min", "max"))  # type: ignore[arg-type]
            cells.append(f"{fmt.format(med)} [{fmt.format(lo)}-{fmt.format(hi)}]")
        lines.append(f"| x{float(r['time_scale']):g} | {r['policy']} | {r['runs']} | "  # type: ignore[arg-type]
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_text(path: Path, text: str) -> None:
    """Write, creating the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
