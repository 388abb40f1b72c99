"""One replay end to end: clusters up, replay, collect, metrics, results files, down."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from slurm_colloc.bench import plots, report
from slurm_colloc.bench.collect import with_ledger
from slurm_colloc.bench.lag import LAG_SHARE_LIMIT, lag_share
from slurm_colloc.bench.metrics import PolicyMetrics, last_end, policy_metrics, relative_to
from slurm_colloc.bench.policies import Policy
from slurm_colloc.bench.replayer import ReplayConfig, Replayer
from slurm_colloc.bench.trace import Trace, jobs_to_csv

log = logging.getLogger("colloc.bench")


def estimator_command(root: Path) -> tuple[str, str]:
    """(command for COLLOC_ESTIMATOR_COMMAND, note): '' when ``colloc estimate`` works."""
    colloc = Path(sys.executable).parent / "colloc"
    cp = subprocess.run([str(colloc), "estimate", "--help"], capture_output=True, check=False)
    if cp.returncode == 0:
        return "", "estimates by `colloc estimate` (the cli_filter's configured estimator)"
    shim = root / "colloc-estimate-shim"
    shim.parent.mkdir(parents=True, exist_ok=True)
    shim.write_text(
        f'#!/bin/sh\nexec {sys.executable} -m slurm_colloc.bench.estimate_shim "$@"\n'
    )
    shim.chmod(0o755)
    return str(shim), (
        "`colloc estimate` was not installed yet: the cli_filter ran "
        "slurm_colloc.bench.estimate_shim (the estimator registry's default estimator) "
        "through COLLOC_ESTIMATOR_COMMAND"
    )


def replay(
    trace: Trace, policies: list[Policy], cfg: ReplayConfig, summaries: dict[str, str],
    results: Path | None,
) -> tuple[list[PolicyMetrics], Replayer, float]:
    """Replay ``trace`` under every policy at once; write results; return metrics."""
    t_start = time.time()
    if not cfg.estimator_command:
        cmd, note = estimator_command(Path(f"{cfg.root_base}-bin"))
        cfg = replace(cfg, estimator_command=cmd)
        log.info("%s", note)
    rp = Replayer(trace, policies, cfg, summaries)
    try:
        rp.up()
        log.info("%s: clusters up after %.0fs; replaying %d jobs at x%g", trace.name,
                 time.time() - t_start, len(trace.jobs), cfg.time_scale)
        rp.run()
    finally:
        if not cfg.keep_clusters:
            rp.down()
    rows = []
    # energy over a common window: until the last policy's last job ended
    common_end = max((last_end(r.outcomes, rp.t0) for r in rp.runs), default=rp.t0)
    work = {j.name: j.work_s * j.gpus for j in trace.jobs}
    for r in rp.runs:
        if r.error:
            log.error("%s: %s", r.policy.name, r.error)
        assert r.sampler is not None
        r.outcomes = with_ledger(r.outcomes, r.sampler.ledger)  # exact start lags
        wall = (r.finished_wall or time.time()) - rp.t0
        rows.append(policy_metrics(
            trace.name, r.policy.name, r.outcomes, r.sampler.points, t0=rp.t0,
            scale=cfg.time_scale, n_jobs=len(trace.jobs), fallbacks=len(r.fallbacks),
            wall_s=wall, common_end=common_end, work_gpu_s=work, trace_jobs=trace.jobs,
        ))
    rows = relative_to(rows)
    total = time.time() - t_start
    if results is not None:
        write_results(trace, rp, rows, cfg, results, total)
    return rows, rp, total


def write_results(trace: Trace, rp: Replayer, rows: list[PolicyMetrics], cfg: ReplayConfig,
                  results: Path, total_wall_s: float) -> None:
    """``<trace>.csv``, ``<trace>.md``, per-job and time-series CSVs, plots."""
    name = trace.name
    report.write_text(results / f"{name}.csv", report.metrics_csv(rows))
    report.write_text(results / f"{name}_jobs.csv", report.outcomes_csv(
        {r.policy.name: r.outcomes for r in rp.runs}, rp.t0, cfg.time_scale))
    report.write_text(results / f"{name}_trace.csv", jobs_to_csv(trace.jobs))
    series = {r.policy.name: r.sampler.points for r in rp.runs if r.sampler is not None}
    report.write_text(results / f"{name}_gpu_timeseries.csv",
                      report.timeseries_csv(series, rp.t0, cfg.time_scale))
    notes = []
    for r in rp.runs:
        if r.error:
            notes.append(f"- {r.policy.name}: replay error: {r.error}")
        if r.submit_errors:
            notes.append(f"- {r.policy.name}: {len(r.submit_errors)} sbatch failures, e.g. "
                         f"{next(iter(r.submit_errors.values()))[:200]}")
        if r.fallbacks:
            notes.append(f"- {r.policy.name}: {len(r.fallbacks)} jobs rejected as larger than "
                         f"a GPU, resubmitted for a whole GPU: {', '.join(r.fallbacks)}")
    works = [j.work_s / 3600.0 for j in trace.jobs]
    for m in rows:
        share = lag_share(m.start_lag_s, cfg.time_scale, works)
        if share > LAG_SHARE_LIMIT:
            note = (f"- {m.policy}: median start lag {m.start_lag_s:.1f} s real = "
                    f"{m.start_lag_s * cfg.time_scale / 60:.0f} trace minutes a job, "
                    f"{share:.0%} of the median job: above {LAG_SHARE_LIMIT:.0%}, the lag "
                    "keeps jobs off their GPUs (fewer co-tenants), which the lag correction "
                    "cannot undo; trust this policy's co-location figures only from a rerun "
                    "at a lower --time-scale")
            notes.append(note)
            log.warning("%s", note[2:])
    made_plots = []
    if plots.available():
        plots.bars(rows, results / f"{name}_bars.png")
        keep = {k: v for k, v in series.items() if k in ("whole-gpu", "colloc")} or dict(series)
        plots.gpu_timelines(keep, rp.t0, cfg.time_scale, results / f"{name}_gpus.png")
        made_plots = [f"{name}_bars.png", f"{name}_gpus.png"]
    counts = trace.class_counts()
    md = [
        f"# Replay: {name}",
        "",
        f"{trace.description}. {len(trace.jobs)} jobs "
        f"({counts['light']} light / {counts['medium']} medium / {counts['heavy']} heavy), "
        f"{sum(1 for j in trace.jobs if j.summary)} submitted with a model summary. "
        f"Whole-GPU lower bound on makespan {trace.total_work_s / trace.gpus / 3600:.2f} h.",
        "",
        (f"{cfg.nodes} compute hosts of {trace.gpus // cfg.nodes} GPUs each (one partition, "
         "the one-node run's capacity); GPUs numbered across hosts. " if cfg.nodes > 1
         else "One compute host. ")
        + f"Time scale x{cfg.time_scale:g} (trace seconds per wall second); all times below "
        "are trace hours. "
        + (f"Every job asks for --time of {cfg.time_limit_factor:g}x its solo run time "
           "(whole wall minutes, at least 1), so backfill can plan. "
           if cfg.time_limit_factor > 0 else "No job has a time limit. ")
        + "Every number is read from sacct, AdminComment records and the "
        "simulated GPUs' counters of this run.",
        "",
        report.markdown_table(rows),
        f"Replay wall time (clusters up, replay, collection): {total_wall_s:.0f} s; "
        f"replay alone {rp.wall_s:.0f} s.",
        "",
        *notes,
        "",
        *[f"![{p}]({p})" for p in made_plots],
        "",
    ]
    report.write_text(results / f"{name}.md", "\n".join(md))
