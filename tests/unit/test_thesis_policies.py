"""The thesis's RAD-RM policies, its thesis-like traces and the fast diagnostic simulator."""

from __future__ import annotations

import pytest

from slurm_colloc.bench import generators
from slurm_colloc.bench.fastsim import SimConfig, simulate
from slurm_colloc.bench.profiles import LucidProfile
from slurm_colloc.bench.thesis_policies import (
    GIB,
    Gated,
    GpuView,
    JobView,
    Policy,
    RoundRobin,
    thesis_policies,
)
from slurm_colloc.bench.thesis_trace import thesis_trace
from slurm_colloc.bench.trace import Trace, TraceJob
from slurm_colloc.gpu.sim.interference import MPS_FIT

CAP = 40 * GIB


def _gpu(i: int, tenants: int = 1, used: int = 0, smact: float = 0.0, peaks: int = 0) -> GpuView:
    return GpuView(i, tenants, used, CAP, smact, peaks)


JOB = JobView("j", true_mib=8 * GIB, estimate_mib=10 * GIB)


def test_exclusive_takes_an_idle_gpu_or_waits() -> None:
    p = Policy()
    assert p.choose(JOB, [_gpu(0), _gpu(1, tenants=0), _gpu(2, tenants=0)]) == 1
    assert p.choose(JOB, [_gpu(0), _gpu(1)]) is None


def test_round_robin_cycles_whatever_the_load() -> None:
    p = RoundRobin()
    gpus = [_gpu(i, used=39 * GIB, smact=99.0) for i in range(3)]
    assert [p.choose(JOB, gpus) for _ in range(4)] == [0, 1, 2, 0]


def test_magm_gates_on_smact_and_free_memory_then_picks_most_free() -> None:
    p = thesis_policies()["magm-80-5g"]
    gpus = [
        _gpu(0, used=2 * GIB, smact=85.0),   # most free but SMACT over 80 %
        _gpu(1, used=36 * GIB, smact=10.0),  # under 5 GB free
        _gpu(2, used=20 * GIB, smact=60.0),
        _gpu(3, used=10 * GIB, smact=80.0),  # exactly 80 %: allowed (<= 80)
    ]
    assert p.choose(JOB, gpus) == 3
    assert p.choose(JOB, gpus[:2]) is None


def test_lug_picks_the_lowest_smact_among_gated() -> None:
    p = thesis_policies()["lug-80-5g"]
    gpus = [_gpu(0, used=5 * GIB, smact=50.0), _gpu(1, used=30 * GIB, smact=20.0),
            _gpu(2, used=1 * GIB, smact=81.0)]
    assert p.choose(JOB, gpus) == 1


def test_oracle_counts_true_peaks_with_a_2gb_margin_and_strict_smact() -> None:
    p = thesis_policies()["owf"]
    # used memory is low (tenants not yet at peak) but their peaks leave 9 GiB < 8 + 2
    assert p.choose(JOB, [_gpu(0, used=1 * GIB, peaks=31 * GIB)]) is None
    assert p.choose(JOB, [_gpu(0, used=1 * GIB, peaks=30 * GIB)]) == 0
    assert p.choose(JOB, [_gpu(0, peaks=0, smact=80.0)]) is None  # SMACT < 80 %
    best = thesis_policies()["obf"]
    gpus = [_gpu(0, peaks=5 * GIB), _gpu(1, peaks=20 * GIB), _gpu(2, peaks=31 * GIB)]
    assert best.choose(JOB, gpus) == 1
    assert p.choose(JOB, gpus) == 0
    assert thesis_policies()["off"].choose(JOB, gpus[::-1]) == 1


def test_memory_only_first_fit_ignores_smact_like_the_replayers_oracle() -> None:
    p = thesis_policies()["off-mem"]
    gpus = [_gpu(0, peaks=33 * GIB, smact=10.0), _gpu(1, peaks=32 * GIB, smact=99.0)]
    assert p.choose(JOB, gpus) == 1  # 8 GiB fit exactly, no margin, SMACT ignored


def test_estimate_gate_needs_the_estimate_to_fit() -> None:
    p = thesis_policies()["magm-est"]
    assert p.choose(JOB, [_gpu(0, used=31 * GIB)]) is None  # 9 GiB free < 10 estimated
    assert p.choose(JOB, [_gpu(0, used=30 * GIB)]) == 0


def test_recovery_runs_alone_whatever_the_policy() -> None:
    for p in (RoundRobin(), Gated()):
        assert p.choose_recovery(JOB, [_gpu(0), _gpu(1, tenants=0)]) == 1
        assert p.choose_recovery(JOB, [_gpu(0), _gpu(1)]) is None


def test_unknown_order_is_refused() -> None:
    with pytest.raises(ValueError):
        Gated(order="random")


def _job(name: str, arrival: float = 0.0, **kw: object) -> TraceJob:
    base: dict[str, object] = dict(
        name=name, arrival_s=arrival, size_class="light", model="m", batch_size=32,
        peak_mib=3000, steady_mib=3000, peak_at=0.0, sm_pct=60.0, work_s=1000.0,
        guess_mib=4096,
    )
    base.update(kw)
    return TraceJob(**base)  # type: ignore[arg-type]


def _trace(*jobs: TraceJob, gpus: int = 1) -> Trace:
    return Trace("t", "test", gpus, CAP, jobs)


CFG = SimConfig(dt=5.0, decision_s=5.0, startup_s=30.0)


def test_a_job_alone_runs_its_solo_time() -> None:
    r = simulate(_trace(_job("a", work_s=1003.0)), Policy(), CFG)
    rec = r.jobs["a"]
    assert rec.last_start == 0.0
    assert rec.finish == pytest.approx(30.0 + 1003.0)
    assert r.makespan_s == pytest.approx(1033.0)
    assert r.ooms == 0


def test_exclusive_queues_the_second_job_until_the_gpu_is_free() -> None:
    r = simulate(_trace(_job("a"), _job("b", arrival=1.0)), Policy(), CFG)
    assert r.jobs["b"].last_start >= r.jobs["a"].finish
    assert r.jobs["b"].finish - r.jobs["b"].last_start == pytest.approx(1030.0)


def test_colocated_jobs_run_at_the_contention_models_rate() -> None:
    r = simulate(_trace(_job("a"), _job("b")), RoundRobin(), CFG)
    rate = MPS_FIT.rates([60.0, 60.0])[0]
    assert rate < 1.0
    # b starts one decision later; both overlap for nearly all their run
    ex_a = r.jobs["a"].finish - r.jobs["a"].last_start - 30.0
    assert ex_a == pytest.approx(1000.0 / rate, rel=0.02)
    assert ex_a > 1000.0


def test_the_job_that_grows_past_the_card_dies_and_recovers_alone() -> None:
    a = _job("a", peak_mib=30 * GIB, steady_mib=30 * GIB, work_s=600.0)
    b = _job("b", peak_mib=15 * GIB, steady_mib=15 * GIB, work_s=600.0)
    c = _job("c", arrival=20.0, work_s=100.0)
    r = simulate(_trace(a, b, c), RoundRobin(), CFG)
    assert r.jobs["a"].ooms == 0 and r.jobs["b"].ooms == 1
    # b went to the recovery queue: it runs again before c, on an idle GPU (after a)
    assert r.jobs["b"].last_start >= r.jobs["a"].finish
    assert r.jobs["b"].finish - r.jobs["b"].last_start == pytest.approx(630.0)
    assert r.ooms == 1


def test_seeded_traces_and_runs_are_deterministic() -> None:
    lucid = [LucidProfile("ResNet18", "CIFAR-10", 32, False, 1.0, 58.0, 2360),
             LucidProfile("ResNet50", "ImageNet", 128, False, 1.0, 100.0, 13326),
             LucidProfile("BERT", "SQuAD", 32, False, 1.0, 99.7, 20162)]
    pools = generators.ProfilePools(lucid, {}, {})
    t1, t2 = thesis_trace("thesis90", pools, 3), thesis_trace("thesis90", pools, 3)
    assert t1 == t2
    assert t1 != thesis_trace("thesis90", pools, 4)
    assert t1.class_counts() == {"light": 59, "medium": 24, "heavy": 7}
    assert thesis_trace("thesis60", pools, 1).class_counts() == {
        "light": 0, "medium": 50, "heavy": 10}
    r1 = simulate(t1, thesis_policies()["magm-80-5g"])
    r2 = simulate(t2, thesis_policies()["magm-80-5g"])
    assert r1 == r2


def test_energy_over_a_common_window_adds_idle_gpus() -> None:
    r = simulate(_trace(_job("a"), gpus=2), Policy(), CFG)
    assert r.energy_over(r.makespan_s + 100.0) == pytest.approx(
        r.energy_j + 100.0 * 2 * CFG.idle_w)
    assert r.energy_over(0.0) == r.energy_j


def test_the_monitor_lags_so_a_gated_policy_admits_a_job_it_would_refuse_later() -> None:
    busy = (_job("a", sm_pct=95.0), _job("b", arrival=40.0, sm_pct=95.0))
    lagged = simulate(_trace(*busy), thesis_policies()["magm-80-5g"], CFG)
    assert lagged.jobs["b"].last_start < lagged.jobs["a"].finish  # 90 s mean still low
    instant = SimConfig(dt=5.0, decision_s=5.0, startup_s=30.0, window_s=5.0)
    r = simulate(_trace(*busy), thesis_policies()["magm-80-5g"], instant)
    assert r.jobs["b"].last_start >= r.jobs["a"].finish  # sees 95 % and waits
