"""The failed allocation read from OOM lines (issue 27), kept in the attempt record
with the collector's verdict; records written before decode as before."""

from __future__ import annotations

import pytest

from slurm_colloc.accounting.codec import decode, encode
from slurm_colloc.accounting.record import Attempt, Enforcement, JobRecord, OomInfo
from slurm_colloc.gpu.sim.oom import torch_oom_message
from slurm_colloc.oom import alloc
from slurm_colloc.oom.patterns import BY_ID


@pytest.mark.parametrize(("pattern", "alloc_mib", "in_use"), [
    ("torch-cuda-oom", 2048, 38708),
    ("torch-cuda-oom-legacy", 20, 14582),
    ("torch-hip-oom", 1536, None),
    ("cupy-oom", 1024, 14336),
    ("xla-oom", 7064, None),
    ("cuda-driver-oom", 3859, None),
])
def test_each_frameworks_example_gives_its_size(pattern: str, alloc_mib: int,
                                                in_use: int | None) -> None:
    found = alloc.failed_allocation(BY_ID[pattern].example)
    assert found == alloc.FailedAllocation(alloc_mib, in_use)


def test_the_sims_torch_message_and_other_words() -> None:
    line = torch_oom_message(10240, 0, 40960, 1000, 4096, [(77, 2048)])
    assert alloc.failed_allocation(line) == alloc.FailedAllocation(10240, 4096)
    assert alloc.failed_allocation("RESOURCE_EXHAUSTED: Failed to allocate request for "
                                   "2.99GiB") == alloc.FailedAllocation(3062)
    assert alloc.failed_allocation("NCCL WARN Failed to CUDA malloc 1048576 bytes") \
        == alloc.FailedAllocation(1)
    assert alloc.in_lines(["x", BY_ID["cupy-oom"].example, "Traceback"]) \
        == alloc.FailedAllocation(1024, 14336)


@pytest.mark.parametrize("line", [None, "", "CUDA error: out of memory",
                                  "Tried to allocate lots", "Tried to allocate 99999999 TiB",
                                  "Tried to allocate 1e400 GiB"])
def test_lines_without_a_believable_size_give_none(line: str | None) -> None:
    assert alloc.failed_allocation(line) is None


def test_record_keeps_size_culprit_and_verdict_and_old_records_decode() -> None:
    a = Attempt(0, oom=OomInfo("gpu-oom", "torch-cuda-oom", alloc_mib=10240, in_use_mib=4096,
                               culprit="12"),
                enforcement=Enforcement("over_limit", "killed", 30720, 2048, True))
    back = decode(encode(JobRecord((a,))).lower()).attempts[0]
    assert back == a
    old = decode(encode(JobRecord((Attempt(0, oom=OomInfo("gpu-oom")),))))
    assert old.attempts[0].enforcement is None and old.attempts[0].oom == OomInfo("gpu-oom")


def test_the_epilogs_story_reads_the_verdict_and_the_oom_line(tmp_path: object) -> None:
    from slurm_colloc.config import CollocConfig
    from slurm_colloc.metrics import enforce
    from slurm_colloc.node.attempt_record import story_of

    cfg = CollocConfig(metrics_dir=str(tmp_path))
    enforce.write_verdict(cfg.metrics_dir, enforce.Verdict(
        job_id="22", attempt=0, uid=1000, gpu=0, kind="over_limit", peak_mib=30720,
        limit_mib=2048, first_seen=1.0, last_seen=2.0, action="killed", outside_mps=True))
    s = story_of(cfg, 22, 0, BY_ID["torch-cuda-oom"].example, "12")
    assert (s.alloc_mib, s.in_use_mib, s.culprit) == (2048, 38708, "12")
    assert s.enforcement == Enforcement("over_limit", "killed", 30720, 2048, True)
    assert story_of(cfg, 23, 0, None, None).enforcement is None
