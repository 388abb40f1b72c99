"""A decided requeue as steps Slurm accepts one by one, so a retry goes on from the
step slurmctld did not answer (issue 28 item 2).

The requeue is ``scontrol requeuehold``, then the new shard request, the recovery
boost and the record carried in AdminComment, then ``scontrol release``. When
slurmctld goes away half-way (it was killed in an OOM job's epilog in the fault
runs), redoing the hold would be refused ("job is pending") and skipping the release
would leave the job held for ever: :class:`RequeuePlan` remembers which steps Slurm
accepted, and :func:`advance` does the rest. :class:`ControllerAway` (with the plan)
says "not answered, retry later"; any other SlurmError is Slurm's answer.

The record the epilog built says "requeued"; :func:`failed_record` turns it into what
really happened when the requeue never lands.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from slurm_colloc.accounting.codec import append_attempt, try_decode
from slurm_colloc.accounting.record import Requeue
from slurm_colloc.node.controller_wait import controller_away
from slurm_colloc.slurm.adapter import SlurmAdapter, SlurmError

STEPS = ("hold", "resize", "nice", "comment", "release")
RETRY_MODULE = "slurm_colloc.node.requeue_retry"
"""The detached helper that retries a plan (:func:`hand_off` starts it by name)."""
DIR_NAME = "requeue"
MAX_PLAN_BYTES = 65536
"""In this order; ``hold`` is the requeue itself (Slurm counts a restart)."""


@dataclass
class RequeuePlan:
    """Everything a retry needs, kept in root-owned state (no user text acted on:
    the record texts are colloc's own encodings, written back as they are)."""

    job_id: int
    attempt: int
    """The restart count of the attempt that failed (Slurm's before the requeue)."""
    new_shards: int
    resize: bool
    """Write the shard request (a changed request, or a ``mode=whole`` job's)."""
    nice: int = 0
    admin_comment: str | None = None
    """The record carried to the next attempt in AdminComment."""
    record: str | None = None
    """This attempt's record in ``record_field`` form, saying "requeued"."""
    reason: str = ""
    """The decision's sentence (kept in the record when the requeue fails)."""
    decided_at: float = 0.0
    """Wall-clock time of the decision (the retry's cap counts from it)."""
    done: list[str] = field(default_factory=list)
    """Steps Slurm accepted."""
    hold_unsure: bool = False
    """A hold was sent and not answered: Slurm may have done it."""
    context: str = ""
    """The job context (:func:`slurm_colloc.node.job.context_to_json`) for the spool."""

    @property
    def held(self) -> bool:
        """Slurm accepted the requeue itself."""
        return "hold" in self.done

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RequeuePlan:
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError("requeue plan is not an object")
        names = {f.name for f in dataclasses.fields(cls)}
        plan = cls(**{k: v for k, v in d.items() if k in names})
        if not (isinstance(plan.job_id, int) and plan.job_id > 0 and isinstance(plan.attempt, int)
                and isinstance(plan.new_shards, int) and plan.new_shards > 0
                and all(s in STEPS for s in plan.done)):
            raise ValueError("requeue plan fields out of range")
        return plan


class ControllerAway(SlurmError):
    """slurmctld did not answer a step; ``plan.done`` says how far the requeue got."""

    def __init__(self, plan: RequeuePlan, step: str, err: BaseException) -> None:
        super().__init__(f"slurmctld did not answer ({step}): {str(err)[:200]}")
        self.plan = plan
        self.step = step


def _do(step: str, plan: RequeuePlan, adapter: SlurmAdapter) -> None:
    jid = plan.job_id
    if step == "hold":
        adapter.requeue(jid, hold=True)
    elif step == "resize" and plan.resize:
        adapter.update_job(jid, TresPerNode=f"gres/shard:{plan.new_shards}")
    elif step == "nice" and plan.nice > 0:
        adapter.update_job(jid, Nice=str(-plan.nice))
    elif step == "comment" and plan.admin_comment:
        # allowed now: the job is pending again, not finished
        adapter.update_job(jid, AdminComment=plan.admin_comment)
    elif step == "release":
        adapter.release(jid)


def _hold_happened(plan: RequeuePlan, adapter: SlurmAdapter) -> bool:
    """After an unanswered hold and a refused one: did the first land? (The restart
    count went up: Slurm requeued the job.)"""
    try:
        job = adapter.job(plan.job_id)
    except SlurmError:
        return False
    return job is not None and job.restarts > plan.attempt


_SOFT = {"nice": "recovery priority not raised after the requeue",
         "comment": "AdminComment not updated after the requeue"}


def advance(plan: RequeuePlan, adapter: SlurmAdapter) -> list[str]:
    """Do the plan's remaining steps in order, noting each one Slurm accepted.

    Returns the messages of refused boosts and comments (the requeue stands). Raises
    :class:`ControllerAway` when slurmctld did not answer (retry later: ``plan.done``
    keeps the progress), SlurmError when Slurm refused the requeue or the new request
    (after the hold the job is released first: whatever fails, it must not stay held).
    """
    errors: list[str] = []
    for step in STEPS:
        if step in plan.done:
            continue
        try:
            _do(step, plan, adapter)
        except SlurmError as e:
            if controller_away(e):
                plan.hold_unsure = plan.hold_unsure or step == "hold"
                raise ControllerAway(plan, step, e) from e
            if step == "hold" and plan.hold_unsure and _hold_happened(plan, adapter):
                plan.done.append(step)
                continue
            if step in _SOFT:
                errors.append(f"{_SOFT[step]}: {e}")
            elif step == "resize":
                _release_after(plan, adapter)
                raise
            else:
                raise
        plan.done.append(step)
    return errors


def _release_after(plan: RequeuePlan, adapter: SlurmAdapter) -> None:
    """Release a held job whose new request was refused (it runs as it was)."""
    try:
        adapter.release(plan.job_id)
        plan.done.append("release")
    except SlurmError as e:
        if controller_away(e):
            raise ControllerAway(plan, "release", e) from e
        raise


def failed_record(record: str | None, attempt: int, why: str, *, max_bytes: int) -> str | None:
    """``record`` with attempt ``attempt``'s requeue marked as not done, ``why`` first
    in its reason (the decision's sentence kept after it). None when there is no
    record; the text unchanged when it holds no readable attempt of that number."""
    if record is None:
        return None
    rec = try_decode(record)
    last = next((a for a in (rec.attempts if rec else ()) if a.attempt == attempt), None)
    if last is None or last.requeue is None:
        return record
    reason = f"{why}; decided: {last.requeue.reason}" if last.requeue.reason else why
    new = dataclasses.replace(last, requeue=Requeue(requeued=False, reason=reason))
    return append_attempt(record, new, max_bytes=max_bytes)


# ------------------------------------------------------------- the plan file ---


def plan_dir(evidence_dir: str) -> Path:
    """Root's directory for pending requeues (beside the evidence and the spool)."""
    return Path(evidence_dir).parent / DIR_NAME


def plan_path(evidence_dir: str, job_id: int, attempt: int) -> Path:
    return plan_dir(evidence_dir) / f"{job_id}.{attempt}.json"


def write_plan(path: Path, plan: RequeuePlan) -> None:
    """Whole or not at all, root 0600, never through a link."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(plan.to_json())
    os.replace(tmp, path)


def read_plan(path: Path) -> RequeuePlan:
    from slurm_colloc.mps.control import read_small_file

    return RequeuePlan.from_json(read_small_file(path, owner=os.geteuid(),
                                                 limit=MAX_PLAN_BYTES))


def confirm_later(evidence_dir: str, plan: RequeuePlan, uid: int,
                  now: float | None = None, wait_s: float = 0.0) -> Path | None:
    """After a hold Slurm accepted (and the release sent): leave the marker that has
    the node's collector check the job does not stay held
    (:mod:`slurm_colloc.mps.release_confirm`); ``wait_s`` (``requeue_retry_s``): how
    long an away controller is waited for, when longer than its own 15 min. None when
    the hold never landed."""
    import time

    from slurm_colloc.mps import release_confirm as rc
    from slurm_colloc.mps.tenancy import ensure_root_dir

    if not plan.held:
        return None
    t = time.time() if now is None else now
    sdir = ensure_root_dir(plan_dir(evidence_dir), 0o700)
    return rc.write_marker(sdir, rc.Marker(
        job_id=plan.job_id, attempt=plan.attempt, uid=uid, released_at=t,
        next_check=t + rc.CONFIRM_AFTER_S,
        plan=dataclasses.replace(plan, record=None, context="").to_json(),
        give_up_s=min(rc.MAX_GIVE_UP_S, max(rc.GIVE_UP_S, float(wait_s)))))


def hand_off(plan: RequeuePlan, evidence_dir: str, env: dict[str, str]) -> Path:
    """Leave ``plan`` in root's state and start the detached helper; the path."""
    from slurm_colloc.detach import spawn_module
    from slurm_colloc.mps.tenancy import ensure_root_dir

    ensure_root_dir(plan_dir(evidence_dir), 0o700)
    path = plan_path(evidence_dir, plan.job_id, plan.attempt)
    write_plan(path, plan)
    spawn_module(RETRY_MODULE, (str(path),), env)
    return path
