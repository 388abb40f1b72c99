"""Where a job went and what it waited for, in words (issue 25 item 5).

Slurm, not colloc, places a job: job_submit turns its memory need into shards and
Slurm puts them on a GPU with room (the least-loaded one where the release has
``LL_SHARED_GRES``). So the report can explain a placement only from what Slurm and
the attempt records say: the shards asked for against a GPU's worth, the GPU and
co-tenants each attempt had, how long each attempt queued (sacct's Submit to Start;
a requeue starts a new Submit), and, for a job still pending, the controller's
reason and nice value. Every sentence names the figure it comes from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from slurm_colloc.report.fmt import hms

if TYPE_CHECKING:
    from slurm_colloc.report.model import AttemptView, JobReport

LONG_WAIT_S = 600
"""A wait worth a word of advice (10 minutes)."""

WHY_PENDING = {
    "Resources": "no GPU has the shards it asks for free yet",
    "Priority": "jobs with a higher priority are ahead of it",
    "BeginTime": "a requeued job waits out Slurm's credential lifetime (cred_expire) "
                 "before it may start again, so that its node reruns the prolog",
    "JobHeldAdmin": "an administrator (or colloc's requeue, for a moment) holds it",
    "JobHeldUser": "you hold it (scontrol release to let it run)",
    "Dependency": "it waits for another job (--dependency)",
    "ReqNodeNotAvail": "a node it needs is down, drained or reserved",
}
"""Slurm's pending reasons a GPU job most often shows, in a user's words."""


def _share(rep: JobReport, shards: int | None) -> str:
    if not shards or not rep.shards_per_gpu:
        return f"{shards} shards" if shards else "its request"
    if shards >= rep.shards_per_gpu:
        return f"{shards} shards, a GPU of its own"
    pct = 100 * shards / rep.shards_per_gpu
    return f"{shards} of a GPU's {rep.shards_per_gpu} shards ({pct:.0f} %)"


def attempt_note(rep: JobReport, a: AttemptView) -> str | None:
    """Where one attempt ran and how long it queued first (None: nothing known)."""
    if a.gpu is None and a.waited_s is None:
        return None
    where = f"GPU {a.gpu}" + (f" of {a.node}" if a.node else "") if a.gpu is not None else None
    waited = f"waited {hms(a.waited_s)} in the queue" if a.waited_s is not None else None
    after = " after its requeue" if a.attempt > 0 else ""
    parts = [p for p in (waited and waited + after, where and f"ran on {where}") if p]
    return (f"Attempt {a.attempt} asked for {_share(rep, a.shards)}, "
            + " then ".join(parts) + ".")


def compute_note(rep: JobReport) -> str | None:
    """How compute admission sized the job, when it was on (None: memory alone)."""
    sub = rep.submitted or {}
    sm, mem, shards = sub.get("sm_pct"), sub.get("mem_shards"), sub.get("shards")
    if not isinstance(sm, int) or not isinstance(mem, int) or not isinstance(shards, int):
        return None
    src = ("your earlier runs of this model" if sub.get("sm_source") == "history"
           else "the site's prior for a model it has not measured for you")
    if shards <= mem:
        return (f"Sized by memory ({mem} shards); its expected SM activity, {sm} % from "
                f"{src}, needed no more.")
    return (f"Sized by compute: expected SM activity {sm} % (from {src}) takes "
            f"{_share(rep, shards)} where memory needed {mem}, so the GPU is not "
            "promised more compute than it can serve (compute admission, docs/admin.md).")


def pending_notes(rep: JobReport) -> list[str]:
    """Why a pending job waits, from the controller's reason and nice value."""
    if not rep.pending:
        return []
    reason = str(rep.pending.get("reason") or "None")
    why = WHY_PENDING.get(reason, "see 'Reason' in scontrol show job")
    notes = [f"Pending ({reason}): {why}."]
    nice = rep.pending.get("nice")
    if isinstance(nice, int) and nice < 0:
        notes.append(f"It runs ahead of the queue: colloc requeued it after an OOM with "
                     f"Nice={nice}, so it takes the next GPU that comes wholly free.")
    return notes


def advice(rep: JobReport) -> list[str]:
    """What a user could change so that the job fits a shared GPU sooner."""
    shards = (rep.attempts[-1].shards if rep.attempts
              else (rep.submitted or {}).get("shards"))
    waited = max((a.waited_s or 0 for a in rep.attempts), default=0)
    waiting = bool(rep.pending and rep.pending.get("reason") == "Resources")
    if not shards or not rep.shards_per_gpu or not (waiting or waited >= LONG_WAIT_S):
        return []
    if shards * 2 <= rep.shards_per_gpu or (rep.pending or {}).get("nice", 0) < 0:
        return []
    mem = (rep.submitted or {}).get("mem_shards")
    if isinstance(mem, int) and mem * 2 <= rep.shards_per_gpu < shards * 2:
        return [f"It asks for {_share(rep, shards)} because of its expected compute, not "
                "its memory: it starts where that much of a GPU's compute is free. A "
                "smaller batch or model lowers both."]
    return [f"It asks for {_share(rep, shards)}: it can only start where half a GPU or "
            "more is free. A smaller batch lowers the estimate (--colloc-batch-size), and "
            "a job under half a GPU fits beside others and usually starts sooner."]
