"""What a node script knows about its job: slurmd's environment plus one JSON record.

Prolog and Epilog get a small environment from slurmd (SLURM_JOB_ID, SLURM_JOB_UID,
SLURM_JOB_GPUS, SLURM_JOB_SLUID from 25.11, SPANK_* option values) and no PATH. The
rest (shard count, output paths, restarts, colloc's submit-time record) comes from the
controller's ``squeue --json`` record (:mod:`slurm_colloc.slurm.squeue_json`), never
from ``scontrol`` text, whose free-text fields a user can fill with forged ``Key=`` pairs.
Identity (job id, uid) and the GPUs come from slurmd and are cross-checked with the
record; on disagreement the node scripts refuse to act (docs/security.md).

The prolog keeps the context it built in root-owned state; the epilog reads it back
instead of asking the controller again (one controller call per job).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from slurm_colloc import procfs
from slurm_colloc.accounting.codec import find_token
from slurm_colloc.accounting.submit_record import CollocRecord, parse_record
from slurm_colloc.slurm.adapter import SlurmAdapter
from slurm_colloc.slurm.squeue_json import SlurmJob, parse_indices

_GRES_IDX = re.compile(r"\b(gpu|shard)(?::[^:(\s]+)?:(\d{1,9})\(IDX:([0-9,\-]{1,200})\)")
_TRES_SHARD = re.compile(r"gres[:/]shard(?::[^:,\s]+)?[:=](\d{1,9})([kKmMgG]?)\b")
_TRES_GPU = re.compile(r"gres[:/]gpu(?::[^:,\s]+)?[:=](\d{1,9})([kKmMgG]?)\b")
_COUNT_MULT = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


class JobInfoError(ValueError):
    """The job's environment or controller record is not what a node script needs."""


def _indices(text: str) -> list[int]:
    try:
        return parse_indices(text)
    except ValueError:
        return []


@dataclass(frozen=True)
class JobContext:
    """The facts about one job that the node scripts act on."""

    job_id: int
    uid: int
    user: str
    node: str
    gpus: tuple[int, ...]
    """GPU indices bound to the job on this node (whole GPUs, or the shards' GPU)."""
    shards: int
    """Shards per node requested (0: not a shard job)."""
    gpu_count: int
    """Whole GPUs requested per node (0: none)."""
    stdout: str | None
    stderr: str | None
    restarts: int
    admin_comment: str
    exit_code: str
    state: str
    foreign_shards: int = 0
    """Shards asked per job/task/socket instead of per node (job_submit refuses these)."""
    sluid: str | None = None
    """slurmd's ``SLURM_JOB_SLUID`` (25.11+), validated: the name of the job's cgroup on
    26.05 unless ``CgroupJobIdPaths=yes``. None before 25.11 or when malformed."""
    system_comment: str = ""
    """The job's SystemComment: where earlier attempts' ``cl1:`` record is when config
    ``record_field = "system_comment"`` (jobstats sites)."""

    def record_text(self, field: str) -> str:
        """The text this attempt's record is appended to: the field colloc's record is
        kept in (config ``record_field``), with the other field's ``cl1:`` token when
        only that one has it (an earlier attempt's record, carried to this one in
        AdminComment because Slurm refuses ``scontrol update SystemComment``)."""
        mine, other = ((self.system_comment, self.admin_comment) if field == "system_comment"
                       else (self.admin_comment, self.system_comment))
        if find_token(mine) is not None or (m := find_token(other)) is None:
            return mine
        return f"{mine} {m.group(0)}".strip()

    @functools.cached_property
    def submit(self) -> CollocRecord | None:
        """job_submit's decision (the ``colloc1:`` record in AdminComment), None when the
        job did not go through it. The one place the node path reads that record, and
        only once per context (``is_shared`` asks for it on every use)."""
        return parse_record(self.admin_comment)

    @property
    def whole_gpu(self) -> bool:
        """job_submit turned a one-GPU request into all shards of a GPU (mode=whole)."""
        rec = self.submit
        return rec is not None and rec.mode == "whole"

    def limit_mib(self, shard_mib: int) -> int | None:
        """GPU memory of a shared job's shards (what its MPS limit derives from); None
        for a job that does not share its GPU."""
        return self.shards * shard_mib if self.is_shared else None

    @property
    def is_shared(self) -> bool:
        """A shard job: it shares its GPU and runs under MPS."""
        return (
            self.shards > 0 and self.gpu_count == 0 and self.foreign_shards == 0
            and len(self.gpus) == 1 and not self.whole_gpu
        )

    @property
    def gpu(self) -> int | None:
        """The one GPU of a shard job (shards of one job always sit on one GPU)."""
        return self.gpus[0] if self.gpus else None


def from_slurm(
    env: Mapping[str, str], adapter: SlurmAdapter, jobs: Mapping[int, SlurmJob] | None = None
) -> JobContext:
    """Build the context from slurmd's environment and the controller's JSON record.

    ``jobs`` is a snapshot the caller already holds (the prolog reuses the same
    ``squeue --json`` for its reaping), so a node script makes one controller call.
    """
    job_id, _ = ids_from_env(env)
    job = adapter.job(job_id) if jobs is None else jobs.get(job_id)
    if job is None:
        raise JobInfoError(f"job {job_id} is not known to the controller")
    return context_from_job(job, env)


def ids_from_env(env: Mapping[str, str]) -> tuple[int, int]:
    """(job id, uid) from slurmd's environment: the only identity root trusts."""
    try:
        job_id = int(env["SLURM_JOB_ID"])
        uid = int(env["SLURM_JOB_UID"])
    except (KeyError, ValueError) as e:
        raise JobInfoError(f"SLURM_JOB_ID/SLURM_JOB_UID missing or malformed: {e}") from e
    if job_id <= 0 or uid < 0:
        raise JobInfoError(f"SLURM_JOB_ID/SLURM_JOB_UID out of range: {job_id}/{uid}")
    return job_id, uid


def bare_context(env: Mapping[str, str]) -> JobContext:
    """A job slurmd bound no GPU to: identity from slurmd, nothing else needed."""
    job_id, uid = ids_from_env(env)
    return JobContext(
        job_id=job_id, uid=uid, user=env.get("SLURM_JOB_USER", str(uid)),
        node=env.get("SLURMD_NODENAME", ""), gpus=(), shards=0, gpu_count=0, stdout=None,
        stderr=None, restarts=0, admin_comment="", exit_code="", state="",
        sluid=procfs.sluid(env.get("SLURM_JOB_SLUID")),
    )


def _env_gpus(env: Mapping[str, str]) -> tuple[int, ...] | None:
    raw = env.get("SLURM_JOB_GPUS")
    if raw is None or raw == "":
        return None
    try:
        return tuple(sorted(set(parse_indices(raw))))
    except ValueError as e:
        raise JobInfoError(f"SLURM_JOB_GPUS={raw!r} is not an index list") from e


def _count(pattern: re.Pattern[str], *texts: str) -> int:
    """Largest count asked (Slurm accepts k/m/g suffixes on gres counts, as does
    job_submit.lua: ``shard:2k`` must not read as "no shards", i.e. not shared)."""
    total = 0
    for t in texts:
        for m in pattern.finditer(t):
            total = max(total, int(m.group(1)) * _COUNT_MULT[m.group(2).lower()])
    return total


def context_from_job(job: SlurmJob, env: Mapping[str, str]) -> JobContext:
    """Cross-check the controller's record with slurmd's environment; refuse on doubt.

    The job id and uid come from slurmd (SLURM_JOB_ID/SLURM_JOB_UID) and must match
    the record. The GPUs come from slurmd's SLURM_JOB_GPUS and must match the GPU
    indices of the allocation (``gres_detail``) when the controller shows them: root
    starts MPS on a GPU only when both agree.
    """
    job_id, uid = ids_from_env(env)
    if job.job_id != job_id:
        raise JobInfoError(f"controller record is for job {job.job_id}, slurmd runs {job_id}")
    if job.user_id != uid:
        raise JobInfoError(
            f"job {job_id}: controller says uid {job.user_id}, slurmd says {uid}: not acting"
        )
    env_gpus = _env_gpus(env)
    try:
        alloc = job.allocated_gpus
    except ValueError as e:
        raise JobInfoError(f"job {job_id}: allocation unreadable ({e}): not acting") from e
    if env_gpus is not None and alloc is not None and env_gpus != alloc:
        raise JobInfoError(
            f"job {job_id}: slurmd bound GPUs {list(env_gpus)} but the allocation shows "
            f"{list(alloc)}: not acting"
        )
    gpus = env_gpus if env_gpus is not None else (alloc or ())
    tres = (job.tres_per_node, job.tres_per_job, job.tres_per_task, job.tres_per_socket)
    return JobContext(
        job_id=job_id,
        uid=uid,
        user=env.get("SLURM_JOB_USER") or job.user_name or str(uid),
        node=env.get("SLURMD_NODENAME", ""),
        gpus=gpus,
        shards=_count(_TRES_SHARD, job.tres_per_node),
        gpu_count=_count(_TRES_GPU, *tres),
        stdout=job.stdout,
        stderr=job.stderr,
        restarts=job.restarts,
        admin_comment=job.admin_comment,
        # slurmd hands the Epilog the job's exit as SLURM_JOB_EXIT_CODE2 ("1:0")
        exit_code=env.get("SLURM_JOB_EXIT_CODE2", ""),
        state=job.state,
        foreign_shards=_count(_TRES_SHARD, job.tres_per_job, job.tres_per_task,
                              job.tres_per_socket),
        # from slurmd, like the job id; malformed is dropped (it names a cgroup path)
        sluid=procfs.sluid(env.get("SLURM_JOB_SLUID")),
        system_comment=getattr(job, "system_comment", ""),  # test doubles lack it
    )


def context_to_json(ctx: JobContext) -> str:
    """What the prolog keeps in root-owned state for the epilog (no second query)."""
    return json.dumps(dataclasses.asdict(ctx), sort_keys=True)


def context_from_json(text: str, env: Mapping[str, str]) -> JobContext:
    """Inverse of :func:`context_to_json`, checked against slurmd's environment."""
    try:
        d = json.loads(text)
        ctx = JobContext(
            job_id=int(d["job_id"]), uid=int(d["uid"]), user=str(d["user"]),
            node=str(d["node"]), gpus=tuple(int(g) for g in d["gpus"]),
            shards=int(d["shards"]), gpu_count=int(d["gpu_count"]),
            stdout=None if d["stdout"] is None else str(d["stdout"]),
            stderr=None if d["stderr"] is None else str(d["stderr"]),
            restarts=int(d["restarts"]), admin_comment=str(d["admin_comment"]),
            exit_code=str(d["exit_code"]), state=str(d["state"]),
            foreign_shards=int(d.get("foreign_shards", 0)),
            sluid=procfs.sluid(d.get("sluid")),
            system_comment=str(d.get("system_comment", "") or ""),
        )
    except (ValueError, KeyError, TypeError) as e:
        raise JobInfoError(f"saved job context unreadable: {e}") from e
    job_id, uid = ids_from_env(env)
    if (ctx.job_id, ctx.uid) != (job_id, uid):
        raise JobInfoError(f"saved context is for job {ctx.job_id}/uid {ctx.uid}")
    env_gpus = _env_gpus(env)
    if env_gpus is not None and env_gpus != ctx.gpus:
        raise JobInfoError(f"saved context GPUs {list(ctx.gpus)} != SLURM_JOB_GPUS")
    return dataclasses.replace(ctx, exit_code=env.get("SLURM_JOB_EXIT_CODE2", ""))


def context_from_record(
    job_id: int, uid: int, env: Mapping[str, str], rec: Mapping[str, Any]
) -> JobContext:
    """A context from scontrol-named fields (tests, and the report's live view).

    The mapping comes from :meth:`SlurmAdapter.show_job`, which is built from
    ``squeue --json``; node scripts use :func:`from_slurm` instead.
    """
    tres = str(rec.get("TresPerNode", "")) + "," + str(rec.get("TresPerJob", ""))
    m = _TRES_SHARD.search(tres)
    shards = int(m.group(1)) if m else 0
    m = _TRES_GPU.search(tres)
    gpu_count = int(m.group(1)) if m else 0
    gpus: list[int] = []
    for gm in _GRES_IDX.finditer(str(rec.get("GRES", ""))):
        gpus.extend(_indices(gm.group(3)))
    if not gpus:
        raw = env.get("SLURM_JOB_GPUS") or env.get("CUDA_VISIBLE_DEVICES") or ""
        gpus = _indices(raw)
    def _path(key: str) -> str | None:
        v = str(rec.get(key, "") or "")
        return v if v.startswith("/") else None

    try:
        restarts = int(rec.get("Restarts", 0))
    except ValueError:
        restarts = 0
    return JobContext(
        job_id=job_id,
        uid=uid,
        user=env.get("SLURM_JOB_USER", str(uid)),
        node=env.get("SLURMD_NODENAME", ""),
        gpus=tuple(sorted(set(gpus))),
        shards=shards,
        gpu_count=gpu_count,
        stdout=_path("StdOut"),
        stderr=_path("StdErr"),
        restarts=restarts,
        admin_comment=str(rec.get("AdminComment", "") or ""),
        system_comment=str(rec.get("SystemComment", "") or ""),
        # slurmd hands the Epilog the job's exit as SLURM_JOB_EXIT_CODE2 ("1:0")
        exit_code=env.get("SLURM_JOB_EXIT_CODE2") or str(rec.get("ExitCode", "") or ""),
        state=str(rec.get("JobState", "") or ""),
    )
