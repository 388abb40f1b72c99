"""What node scripts read from Slurm: shard count, GPU index, paths, restarts."""

from __future__ import annotations

from slurm_colloc.node.job import context_from_record

ENV = {"SLURM_JOB_USER": "alice", "SLURMD_NODENAME": "n1", "SLURM_JOB_GPUS": "3"}


def test_shard_job_gpu_comes_from_gres_detail() -> None:
    rec = {"TresPerNode": "gres:shard:12", "GRES": "shard:12(IDX:2)", "StdOut": "/home/a/o.out",
           "StdErr": "/home/a/o.out", "Restarts": "1", "ExitCode": "1:0", "JobState": "COMPLETING"}
    ctx = context_from_record(7, 1001, ENV, rec)
    assert ctx.is_shared and ctx.shards == 12 and ctx.gpu == 2  # GRES beats the env
    assert ctx.restarts == 1 and ctx.stdout == "/home/a/o.out" and ctx.user == "alice"


def test_whole_gpu_job_is_not_shared() -> None:
    ctx = context_from_record(8, 0, ENV, {"TresPerNode": "gres:gpu:2", "GRES": "gpu:2(IDX:0-1)"})
    assert not ctx.is_shared and ctx.gpus == (0, 1) and ctx.gpu_count == 2


def test_typed_gres_and_env_fallback() -> None:
    ctx = context_from_record(9, 0, ENV, {"TresPerNode": "gres:shard:a100:5"})
    assert ctx.shards == 5 and ctx.gpus == (3,)


def test_relative_or_missing_paths_are_ignored() -> None:
    ctx = context_from_record(10, 0, {}, {"StdOut": "slurm-10.out", "Restarts": "x"})
    assert ctx.stdout is None and ctx.stderr is None and ctx.restarts == 0 and ctx.gpus == ()


def test_one_gpu_request_turned_into_shards_is_not_shared() -> None:
    rec = {"TresPerNode": "gres:shard:40", "GRES": "shard:40(IDX:1)",
           "AdminComment": "colloc1:mode=whole,need_mib=40960,shards=40,shard_mib=1024,"
                           "alloc_mib=40960"}
    ctx = context_from_record(11, 0, ENV, rec)
    assert ctx.whole_gpu and not ctx.is_shared and ctx.gpu == 1
