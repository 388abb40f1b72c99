"""Start lag in trace time (issue 24, item 1): matching, debiasing, corrected figures."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from slurm_colloc.bench import lag as L
from slurm_colloc.bench import metrics, report
from slurm_colloc.bench.collect import GpuLedger, JobOutcome, with_ledger
from slurm_colloc.bench.sampler import GpuPoint
from slurm_colloc.bench.trace import TraceJob

SCALE = 120.0
H = SCALE / 3600.0  # trace hours per wall second


def _jt(name: str, submit: float, start: float, end: float, mib: int = 1000,
        work: float = math.nan, gpus: int = 1) -> L.JobTimes:
    return L.JobTimes(name, submit, start, end, mib, gpus, work)


def test_a_job_is_found_by_the_memory_it_adds_even_when_another_leaves_in_the_same_sample(
) -> None:
    # GPU 0: job a (1000 MiB) from sample 3 to 6; at sample 6 b (2500 MiB) replaces it:
    # the process count does not change, the memory step is +1500. GPU 1: c from 2.
    samples = []
    for i in range(10):
        mem0 = 512 + (1000 if 3 <= i < 6 else 0) + (2500 if i >= 6 else 0)
        samples.append((float(i), 0, mem0, int(i >= 3)))
        samples.append((float(i), 1, 512 + (700 if i >= 2 else 0), int(i >= 2)))
    jobs = [_jt("a", 0, 1.0, 6.0), _jt("b", 0, 5.0, 9.0, 2500), _jt("c", 0, 2.0, 9.0, 700)]
    lags = {lg.name: lg for lg in L.match_lags(jobs, L.steps(samples), horizon_h=5.0)}
    assert lags["a"].lag_h == 2.0 and lags["a"].gpu == 0
    assert lags["c"].lag_h == 0.0 and lags["c"].gpu == 1
    # b's step is +1500 (a left in the same interval): unrecognised, not misattributed
    assert lags["b"].lag_h is None
    assert L.filled(list(lags.values()))["b"] == 2.0  # the median of the matched ones


def test_a_two_gpu_job_needs_a_step_on_each_gpu_and_takes_the_slower() -> None:
    samples = [(float(i), g, 512 + (800 if i >= 2 + g else 0), 0) for i in range(6)
               for g in (0, 1)]
    (lag,) = L.match_lags([_jt("m", 0, 1.0, 5.0, 800, gpus=2)], L.steps(samples),
                          horizon_h=5.0)
    assert lag.lag_h == 2.0


def test_the_clocks_quantisation_is_removed_from_a_measured_lag() -> None:
    # sacct floors the start (0.5 s on average), a sample is 0.5 period late on average
    bias = L.quantisation_h(1.0, SCALE)
    assert bias == pytest.approx(1.0 * H)  # 2 trace minutes at x120
    out = L.debiased([L.Lag("a", 3 * H, 0), L.Lag("b", 0.5 * H, 0), L.Lag("c", None, None)],
                     bias)
    assert [lg.lag_h for lg in out] == [pytest.approx(2 * H), 0.0, None]
    pts = [(i * H, 0, 0, 0) for i in range(5)]
    assert L.sample_period_s(pts, SCALE) == pytest.approx(1.0)


def test_the_critical_chain_loses_only_the_compression_excess_of_its_lags() -> None:
    # b waits for a's GPU; c ran on arrival elsewhere and ends earlier
    jobs = [_jt("a", 0.0, 0.0, 1.0), _jt("b", 0.0, 1.0, 2.0), _jt("c", 0.5, 0.5, 1.5)]
    assert L.critical_chain(jobs) == ["b", "a"]
    lag = {"a": 0.2, "b": 0.1, "c": 0.4}
    span, span_c = L.corrected_makespan(jobs, lag, SCALE)
    assert span == 2.0
    assert span_c == pytest.approx(2.0 - 0.3 * (1 - 1 / SCALE))
    # at x1 nothing was compressed: nothing to remove
    assert L.corrected_makespan(jobs, lag, 1.0) == (2.0, 2.0)


def test_handover_gaps_on_the_chain_are_corrected_only_when_asked() -> None:
    jobs = [_jt("a", 0.0, 0.0, 1.0), _jt("b", 0.0, 1.1, 2.0)]
    assert L.handovers_h(jobs, L.critical_chain(jobs)) == [pytest.approx(0.1)]
    _, without = L.corrected_makespan(jobs, {}, SCALE)
    _, with_gaps = L.corrected_makespan(jobs, {}, SCALE, handovers=True)
    assert without == 2.0 and with_gaps == pytest.approx(2.0 - 0.1 * (1 - 1 / SCALE))


def test_stretch_by_slurm_time_and_by_gpu_time() -> None:
    jobs = [_jt("a", 0, 0.0, 2.0, work=1.0), _jt("b", 0, 0.0, 3.0, work=2.0)]
    slurm, gpu = L.stretch(jobs, {"a": 0.5, "b": 0.5})
    assert slurm == pytest.approx(5 / 3) and gpu == pytest.approx(4 / 3)


def test_corrected_energy_removes_idle_power_of_the_removed_time() -> None:
    assert L.corrected_energy_kwh(10.0, 2.0, 4, 55.0) == pytest.approx(10.0 - 0.44)


def _trace_job(name: str, steady: int, work_s: float) -> TraceJob:
    return TraceJob(name, 0.0, "light", "m", 8, steady, steady, 0.5, 50.0, work_s, steady)


def _policy(lag_wall_s: float) -> metrics.PolicyMetrics:
    # one GPU; job j runs from wall 0 to 40 in Slurm, its process is seen from
    # wall ``lag_wall_s``; samples every wall second; 100 W idle, 300 W busy
    outs = [JobOutcome("j", 1, "COMPLETED", 1, 0.0, 0.0, 40.0, 0, 0, "gpu=1", None, "")]
    pts, e = [], 0.0
    for t in range(46):
        busy = lag_wall_s <= t < 40
        w = 300.0 if busy else 100.0
        pts.append(GpuPoint(float(t), 0, 512 + (4000 if busy else 0), 50.0 * busy, w, e,
                            int(busy)))
        e += w * SCALE
    return metrics.policy_metrics(
        "t", "colloc", outs, pts, t0=0.0, scale=SCALE, n_jobs=1, fallbacks=0, wall_s=40.0,
        common_end=45.0, trace_jobs=[_trace_job("j", 4000, (40 - lag_wall_s) * SCALE)])


def test_policy_metrics_report_the_lag_at_real_duration() -> None:
    m = _policy(lag_wall_s=11.0)
    # seen at the sample of wall 11: 11 s less the clocks' mean 1 s
    assert m.start_lag_s == pytest.approx(10.0, abs=0.05)
    assert m.makespan_h == pytest.approx(40 * H)
    excess = 10.0 * H * (1 - 1 / SCALE)
    assert m.makespan_corrected_h == pytest.approx(40 * H - excess, abs=1e-3)
    assert m.stretch_slurm == pytest.approx(40 / 29) and m.stretch_gpu == pytest.approx(
        30 / 29, abs=1e-3)
    assert m.idle_power_w == 100.0
    assert m.energy_corrected_kwh == pytest.approx(m.energy_kwh - 100.0 * excess / 1000,
                                                   abs=1e-6)


def test_relative_to_fills_the_corrected_ratios_and_the_corrected_common_window() -> None:
    slow, fast = _policy(11.0), _policy(1.0)
    rows = metrics.relative_to([replace(fast, policy="whole-gpu"), slow])
    whole, colloc = rows
    assert colloc.makespan_corrected_vs_whole == pytest.approx(
        slow.makespan_corrected_h / fast.makespan_corrected_h)
    # the policy that ends first pays idle power up to the other's corrected end
    end = max(slow.makespan_corrected_h, fast.makespan_corrected_h)
    assert whole.energy_common_corrected_kwh == pytest.approx(
        fast.energy_corrected_kwh + 100.0 * (end - fast.makespan_corrected_h) / 1000)
    assert math.isfinite(colloc.energy_common_corrected_vs_whole)
    table = report.markdown_table(rows)
    assert "start lag s (real)" in table and "| 10.00 |" in table
    summary = report.summary_rows([rows])
    assert {"start_lag_s_median", "stretch_gpu_median"} <= set(summary[0])


def test_without_the_trace_the_lag_fields_stay_unknown() -> None:
    outs = [JobOutcome("j", 1, "COMPLETED", 1, 0.0, 0.0, 4.0, 0, 0, "gpu=1", None, "")]
    pts = [GpuPoint(float(t), 0, 512, 0.0, 100.0, 100.0 * t, 0) for t in range(5)]
    m = metrics.policy_metrics("t", "colloc", outs, pts, t0=0.0, scale=SCALE, n_jobs=1,
                               fallbacks=0, wall_s=4.0)
    assert math.isnan(m.start_lag_s) and math.isnan(m.makespan_corrected_h)


@dataclass(frozen=True)
class _Rec:
    gpu: int
    job_id: str
    started: float


def test_the_ledger_keeps_each_jobs_first_registration_across_gpus_and_rewrites() -> None:
    ledger = GpuLedger()
    ledger.observe([_Rec(0, "7", 100.2), _Rec(1, "", 99.0)], now=101.0)
    # the sim rewrites ``started`` when the process grows: the earliest one stays
    ledger.observe([_Rec(0, "7", 130.0), _Rec(2, "7", 100.5)], now=131.0)
    seen = ledger.seen["7"]
    assert seen.first == 100.2 and seen.gpus == {0, 2} and seen.last == 131.0
    assert "" not in ledger.seen and ledger.first_on_gpu(8) is None
    outs = with_ledger([_outcome(7, 98.0)], ledger)
    assert outs[0].first_on_gpu == 100.2
    csv_text = report.outcomes_csv({"colloc": outs}, t0=0.0, scale=SCALE)
    header, row = csv_text.splitlines()
    assert header.endswith(",first_gpu_h,recovery_wait_h")
    assert row.endswith(f",{100.2 * H:.3f},")  # one attempt: no recovery wait


def _outcome(job_id: int, start: float, end: float = 140.0) -> JobOutcome:
    return JobOutcome("j", job_id, "COMPLETED", 1, 0.0, start, end, 0, 0, "gpu=1", None, "")


def test_lag_fields_take_the_ledger_over_the_samples() -> None:
    # the samples would say "unrecognised" (no memory step): the ledger says 5 s
    pts = [GpuPoint(float(t), 0, 512, 0.0, 100.0, 100.0 * t, 0) for t in range(150)]
    out = replace(_outcome(7, 10.0), first_on_gpu=15.0)
    m = metrics.policy_metrics("t", "colloc", [out], pts, t0=0.0, scale=SCALE, n_jobs=1,
                               fallbacks=0, wall_s=140.0,
                               trace_jobs=[_trace_job("j", 4000, 100 * SCALE)])
    assert m.start_lag_s == pytest.approx(4.5)  # less sacct's half second only


def _start_lag_module() -> object:
    from tests.unit.bench_scripts import load

    return load("start_lag")


def test_committed_philly90h_x120_run_colloc_waits_seconds_whole_gpu_does_not() -> None:
    # the observation, read back from a committed run: the colloc lag is
    # seconds of wall time, whole-gpu's is below one once the clocks' second is removed
    mod = _start_lag_module()
    d = mod.RESULTS / "philly90h" / "x120" / "run1"  # type: ignore[attr-defined]
    out = mod.analyse_run(d, "philly90h", 120.0)  # type: ignore[attr-defined]
    whole, colloc = out["whole-gpu"]["lag"], out["colloc"]["lag"]
    assert whole["real_s_median"] < 1.0 < 4.0 < colloc["real_s_median"]
    assert out["colloc"]["makespan_corrected_h"] < out["colloc"]["makespan_h"]
    assert out["colloc"]["stretch_gpu"] < out["colloc"]["stretch_slurm"]


def test_a_requeued_jobs_late_first_sighting_is_not_a_start_lag() -> None:
    """heavy60h-041 (issue 24): its first attempt died of OOM at its first allocation,
    before registering on a GPU, so the ledger first saw the requeued attempt 5-8 trace
    hours after the job's Slurm start. Taken as a start lag, the critical-chain
    correction removed those hours from colloc's makespan (0.94x -> 0.55x)."""
    from slurm_colloc.bench import lag as L

    jobs = [L.JobTimes("a", 0.0, 0.0, 1.0, 1000, attempts=1),
            L.JobTimes("b", 0.0, 0.5, 9.0, 1000, attempts=2),
            L.JobTimes("c", 1.0, 1.0, 2.0, 1000, attempts=1)]
    first = {"a": 0.1, "b": 7.0, "c": 1.2}
    lags = {lg.name: lg.lag_h for lg in L.ledger_lags(jobs, first)}
    assert lags["b"] is None and lags["a"] == pytest.approx(0.1)
    assert lags["c"] == pytest.approx(0.2)
    assert L.filled(L.ledger_lags(jobs, first))["b"] == pytest.approx(0.2)  # the median
    span, span_c = L.corrected_makespan(jobs, L.filled(L.ledger_lags(jobs, first)), 120)
    assert span - span_c < 0.5  # never the 6.5 h a lag of "b" would have removed


def test_committed_heavy60h_run_is_corrected_by_the_rule_it_states(tmp_path: Path) -> None:
    """benchmarks/recorrect_lags.py recomputes a committed run's lag-corrected figures from
    its own CSVs; on heavy60h run 2 (the run with heavy60h-041) it must give what is
    committed, and not the 0.55x the late first sighting of a requeued job gave."""
    import shutil

    from tests.unit.bench_scripts import BENCHMARKS, load

    run = BENCHMARKS / "results" / "issue24_final" / "heavy60h" / "x120" / "run2"
    mod = load("recorrect_lags")
    committed = {m.policy: m for m in mod.read_metrics(run / "heavy60h.csv")}
    copy = tmp_path / "run2"
    shutil.copytree(run, copy)
    rows = {m.policy: m for m in mod.recorrect(copy, "heavy60h")}
    colloc = rows["colloc"].makespan_corrected_vs_whole
    assert 0.85 < colloc <= rows["colloc"].makespan_vs_whole + 1e-9
    assert colloc == pytest.approx(committed["colloc"].makespan_corrected_vs_whole, abs=0.005)


def test_a_lag_long_next_to_the_jobs_is_flagged_and_a_short_one_is_not() -> None:
    """philly90h at x120 (colloc's median lag 12.9 s: 130 % of its median job) is above
    the limit; x60 (2.1 s: 11 %) and heavy60h at x120 (1.5 s, longer jobs: 6 %) are not."""
    from slurm_colloc.bench import generators, profiles
    from slurm_colloc.bench.lag import LAG_SHARE_LIMIT, lag_share

    pools = generators.ProfilePools(profiles.load_lucid(), profiles.load_timm_peaks(),
                                    profiles.load_summaries(), held_out_only=True)
    philly = [j.work_s / 3600 for j in generators.GENERATORS["philly90h"](pools).jobs]
    heavy = [j.work_s / 3600 for j in generators.GENERATORS["heavy60h"](pools).jobs]
    assert lag_share(12.9, 120, philly) > LAG_SHARE_LIMIT
    assert lag_share(2.1, 60, philly) < LAG_SHARE_LIMIT
    assert lag_share(1.5, 120, heavy) < LAG_SHARE_LIMIT
    assert math.isnan(lag_share(math.nan, 120, philly)) and math.isnan(lag_share(1.0, 120, []))
