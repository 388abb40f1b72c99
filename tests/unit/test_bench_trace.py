"""Trace model, generators and metrics of the replay benchmark (no Slurm needed)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from slurm_colloc.accounting.codec import encode
from slurm_colloc.accounting.record import Attempt, JobRecord, OomInfo, Requeue
from slurm_colloc.bench import generators, metrics, policies, profiles
from slurm_colloc.bench.collect import JobOutcome, outcome
from slurm_colloc.bench.profiles import LucidProfile
from slurm_colloc.bench.sampler import GpuPoint
from slurm_colloc.bench.trace import TraceJob, jobs_from_csv, jobs_to_csv
from slurm_colloc.slurm.adapter import AccountingRecord


def _job(**kw: object) -> TraceJob:
    base: dict[str, object] = dict(
        name="j0", arrival_s=0.0, size_class="light", model="resnet18", batch_size=32,
        peak_mib=3000, steady_mib=2800, peak_at=0.1, sm_pct=60.0, work_s=900.0,
        guess_mib=4096, summary="resnet18", source="test",
    )
    base.update(kw)
    return TraceJob(**base)  # type: ignore[arg-type]


def _pools() -> generators.ProfilePools:
    lucid = [LucidProfile("ResNet18", "CIFAR-10", 32, False, 1.0, 58.0, 2360),
             LucidProfile("ResNet50", "ImageNet", 128, False, 1.0, 100.0, 13326),
             LucidProfile("BERT", "SQuAD", 32, False, 1.0, 99.7, 20162)]
    peaks = {("m_small", 8): 3000, ("m_mid", 32): 9000, ("m_big", 64): 24000}
    return generators.ProfilePools(lucid, peaks, {"m_small": "s", "m_mid": "s", "m_big": "s"})


def test_csv_round_trip() -> None:
    jobs = (_job(), _job(name="j1", summary="", arrival_s=12.5))
    assert jobs_from_csv(jobs_to_csv(jobs)) == jobs


def test_bad_job_rejected() -> None:
    with pytest.raises(ValueError):
        _job(steady_mib=5000)
    with pytest.raises(ValueError):
        _job(size_class="huge")


def test_philly90_shape_and_reproducible() -> None:
    a, b = generators.philly90(_pools()), generators.philly90(_pools())
    assert a == b
    assert len(a.jobs) == 90
    assert a.class_counts() == {"light": 58, "medium": 24, "heavy": 7} or (
        sum(a.class_counts().values()) == 90)
    arrivals = [j.arrival_s for j in a.jobs]
    assert arrivals == sorted(arrivals)
    assert all(j.peak_mib <= a.gpu_memory_mib for j in a.jobs)


def test_guess_rounded_to_gib() -> None:
    import random

    rng = random.Random(0)
    for _ in range(100):
        g = generators.user_guess(rng, 5000, 40960)
        assert g % 1024 == 0 and 1024 <= g <= 40960


def test_policy_args() -> None:
    job = _job()
    summ = Path("/x/resnet18.txt")
    assert policies.POLICIES["whole-gpu"].args(job, summ, 1024) == ["--gres=gpu:1"]
    assert policies.POLICIES["shards"].args(job, summ, 1024) == ["--gres=shard:4"]
    assert policies.POLICIES["colloc"].args(job, summ, 1024) == [
        "--colloc=/x/resnet18.txt", "--colloc-batch-size=32"]
    assert policies.POLICIES["colloc"].args(job, None, 1024) == ["--colloc-mem=4096M"]
    assert policies.POLICIES["colloc-oracle"].args(job, summ, 1024) == ["--colloc-mem=3000M"]
    with pytest.raises(ValueError):
        policies.get(["colloc", "magic"])


def _row(state: str, start: str, end: str, comment: str = "", exit_code: str = "0:0"
         ) -> AccountingRecord:
    return AccountingRecord("7", state, {
        "State": state, "ExitCode": exit_code, "Submit": "2026-01-01T00:00:00",
        "Start": start, "End": end, "AdminComment": comment, "AllocTRES": "gres/shard=5",
    })


def test_outcome_from_colloc_records() -> None:
    rec = JobRecord(attempts=(
        Attempt(0, oom=OomInfo("gpu-oom"), requeue=Requeue(True, "whole gpu")),
        Attempt(1),
    ))
    comment = "colloc1:mode=explicit,need_mib=5000,shards=5,shard_mib=1024,alloc_mib=5120 " \
        + encode(rec)
    rows = [_row("REQUEUED", "2026-01-01T00:00:10", "2026-01-01T00:00:20", comment, "1:0"),
            _row("COMPLETED", "2026-01-01T00:00:40", "2026-01-01T00:01:40", comment)]
    o = outcome("j", 7, rows, None)
    assert (o.state, o.attempts, o.oom_crashes, o.requeues, o.lost) == (
        "COMPLETED", 2, 1, 1, False)
    assert o.need_mib == 5000 and o.mode == "explicit" and o.gres == "shard=5"
    assert o.end is not None and o.start is not None and o.end - o.start == 90
    assert o.recovery_wait == 20  # the rerun started 20 s after the OOM'd attempt ended


def test_recovery_wait_is_unknown_for_one_attempt_or_no_times() -> None:
    one = [_row("COMPLETED", "2026-01-01T00:00:10", "2026-01-01T00:00:20")]
    assert outcome("j", 7, one, None).recovery_wait is None
    pending = [_row("REQUEUED", "2026-01-01T00:00:10", "2026-01-01T00:00:20", "", "1:0"),
               _row("PENDING", "Unknown", "Unknown")]
    assert outcome("j", 7, pending, None).recovery_wait is None


def test_policy_metrics_report_the_longest_recovery_and_p95_wait() -> None:
    def o(name: str, wait: float | None, start: float) -> JobOutcome:
        return JobOutcome(name, 1, "COMPLETED", 2 if wait else 1, 0.0, start, 100.0, 0,
                          1 if wait else 0, "", None, "", recovery_wait=wait)

    outs = [o("a", None, 1.0), o("b", 30.0, 2.0), o("c", 90.0, 40.0)]
    m = metrics.policy_metrics("t", "colloc", outs, [], t0=0.0, scale=3600.0, n_jobs=3,
                               fallbacks=0, wall_s=1.0)
    assert m.recovery_wait_max_h == 90.0 and m.p95_wait_h == 40.0
    none = metrics.policy_metrics("t", "colloc", outs[:1], [], t0=0.0, scale=3600.0, n_jobs=1,
                                  fallbacks=0, wall_s=1.0)
    assert math.isnan(none.recovery_wait_max_h)


def test_outcome_plain_slurm_oom_is_lost() -> None:
    rows = [_row("FAILED", "2026-01-01T00:00:10", "2026-01-01T00:00:20", "", "1:0")]
    o = outcome("j", 7, rows, "x\ntorch.OutOfMemoryError: CUDA out of memory.\n")
    assert o.lost and o.oom_crashes == 1 and o.requeues == 0


def test_metrics() -> None:
    pts = [GpuPoint(t, 0, 0, 0.0, 55.0, 55.0 * t, 1 if t < 5 else 0) for t in range(11)]
    assert metrics.energy_between(pts, 2.5, 7.5) == pytest.approx(55.0 * 5)
    assert metrics.busy_share(pts, 0, 9) == pytest.approx(0.5)
    assert metrics.percentile([1.0, 2.0, 3.0, 4.0], 95) == 4.0
    assert math.isnan(metrics.percentile([], 50))


def test_shared_data_profiles_load() -> None:
    if not profiles.SHARED_DATA.exists():
        pytest.skip("shared data not present")
    assert len(profiles.load_lucid()) > 50
    peaks = profiles.load_timm_peaks()
    assert all(v < profiles.MAX_PLAUSIBLE_PEAK_MIB for v in peaks.values())


def test_fallback_is_all_shards_on_colloc_clusters() -> None:
    from slurm_colloc.bench.replayer import whole_gpu_args

    assert whole_gpu_args(["--colloc=/s.txt", "--colloc-batch-size=8"], 39936) == [
        "--colloc-mem=39936M"]
    assert whole_gpu_args(["--gres=shard:50"], 39936) == ["--gres=gpu:1"]


def test_requests_above_what_a_gpu_has_for_jobs_become_the_whole_gpu() -> None:
    """A 40 GiB guess on a 40 GiB card: only 39 shards are for jobs (reserve, servers)."""
    from slurm_colloc.bench.replayer import fit_to_gpu

    assert fit_to_gpu(["--gres=shard:40"], 39, 1024) == ["--gres=shard:39"]
    assert fit_to_gpu(["--colloc-mem=40960M"], 39, 1024) == ["--colloc-mem=39936M"]
    assert fit_to_gpu(["--colloc-mem=2048M", "--gres=shard:3"], 39, 1024) == [
        "--colloc-mem=2048M", "--gres=shard:3"]
    assert fit_to_gpu(["--colloc=/s.txt"], 39, 1024) == ["--colloc=/s.txt"]
