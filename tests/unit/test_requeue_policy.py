"""Requeue decisions after an OOM: step-up policy, caps, whole-GPU jobs."""

from __future__ import annotations

from slurm_colloc.config import CollocConfig
from slurm_colloc.node.requeue_policy import decide

CFG = CollocConfig()


def _d(cause: str = "gpu-oom", shards: int = 8, restarts: int = 0, cfg: CollocConfig = CFG,
       estimate: int | None = 7000):
    return decide(cause=cause, shards=shards, shards_per_gpu=40, restarts=restarts,
                  estimate_mib=estimate, cfg=cfg)


def test_default_goes_straight_to_a_whole_gpu() -> None:
    d = _d()
    assert d.requeue and d.new_shards == 40 and "whole GPU" in d.reason


def test_step_policy_adds_max_5gib_or_half_first_then_whole() -> None:
    step = CollocConfig(step_up_policy="step")
    first = _d(cfg=step, estimate=7000)  # 7000 + max(5120, 3500) = 12120 MiB -> 12 shards
    assert first.requeue and first.new_shards == 12
    big = _d(cfg=step, estimate=20000, shards=20)  # 20000 + 10000 -> 30 shards
    assert big.new_shards == 30
    second = _d(cfg=step, restarts=1, shards=12)
    assert second.new_shards == 40


def test_whole_gpu_oom_is_the_jobs_own_problem() -> None:
    d = _d(shards=40)
    assert not d.requeue and "whole GPU" in d.reason and "not requeued" in d.reason


def test_attempt_cap_and_switch() -> None:
    assert not _d(restarts=2).requeue
    assert not _d(cfg=CollocConfig(requeue_on_oom=False)).requeue


def test_host_oom_and_nothing_are_not_requeued() -> None:
    assert not _d(cause="host-oom").requeue
    assert not _d(cause="none").requeue


def test_co_tenant_mps_fault_keeps_the_request() -> None:
    d = _d(cause="mps-fault", shards=8)
    assert d.requeue and d.new_shards == 8


def test_fatal_cuda_error_of_a_shared_job_goes_to_a_gpu_of_its_own() -> None:
    """Under MPS a co-tenant's fatal fault reaches every client: a victim cannot be
    told from the culprit, so each gets a whole GPU, where only a culprit fails again."""
    d = _d(cause="cuda-fatal", shards=8)
    assert d.requeue and d.new_shards == 40 and "GPU of its own" in d.reason


def test_fatal_cuda_error_on_a_whole_gpu_is_the_jobs_own() -> None:
    d = _d(cause="cuda-fatal", shards=40)
    assert not d.requeue and "not requeued" in d.reason
    assert not _d(cause="cuda-fatal", shards=8, restarts=2).requeue  # capped as well
    assert not _d(cause="cuda-fatal", cfg=CollocConfig(requeue_on_oom=False)).requeue


def test_m5_jobs_colloc_did_not_place_are_never_requeued() -> None:
    """M5 (issue 11): a plain gres:gpu job (not placed by colloc) is never requeued or
    converted to shards, whatever its log shows."""
    for cause in ("mps-fault", "gpu-oom", "cuda-fatal", "host-oom", "none"):
        d = decide(cause=cause, shards=0, shards_per_gpu=40, restarts=0, estimate_mib=None,
                   cfg=CFG, colloc_placed=False)
        assert not d.requeue and "not placed by colloc" in d.reason


def test_m5_placed_is_shard_jobs_only() -> None:
    """M5: only shard requests (shard jobs, mode=whole) count as placed by colloc."""
    from slurm_colloc.node.requeue_policy import colloc_placed

    assert colloc_placed(shards=8, gpu_count=0)
    assert colloc_placed(shards=40, gpu_count=0)
    assert not colloc_placed(shards=0, gpu_count=4)
    assert not colloc_placed(shards=0, gpu_count=1)
    assert not colloc_placed(shards=8, gpu_count=1)
    assert not colloc_placed(shards=8, gpu_count=0, foreign_shards=8)
