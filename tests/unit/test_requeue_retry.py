"""Issue 28 item 2: a decided requeue is retried until slurmctld answers, and the
record says what really happened.

A fake Slurm adapter that does not answer for a while (``timed out``, as the adapter
says when scontrol hangs), a fake clock: the retry goes on from the step slurmctld
did not answer, gives up at the cap with a record saying so, and stops at once when
Slurm answers no.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from slurm_colloc.accounting.codec import append_attempt, decode
from slurm_colloc.accounting.record import Attempt, Requeue
from slurm_colloc.node import epilog, requeue_retry, requeue_steps
from slurm_colloc.node import job as jobmod
from slurm_colloc.slurm.adapter import SlurmError

from .test_node_cov_epilog import cfg_of, ctx_of, quiet, scan  # noqa: F401 - fixtures

LOG = logging.LoggerAdapter(logging.getLogger("test-requeue-retry"), {})
AWAY = SlurmError("scontrol requeuehold 77: timed out after 20s")


def record(requeued: bool = True) -> str:
    a = Attempt(attempt=0, shards=8, requeue=Requeue(
        requeued, "GPU OOM with 8 shards: requeued on a whole GPU (40 shards)",
        "gres/shard:40" if requeued else None, 40960 if requeued else None))
    return append_attempt("colloc1:mode=explicit,shards=8", a, max_bytes=4096)


class Clock:
    def __init__(self) -> None:
        self.now = 5000.0
        self.sleeps: list[float] = []

    def time(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


class AwaySlurm:
    """Does not answer (each try costs ``cost`` s of the clock) until ``back_at``;
    ``refuse``: Slurm's answer to a step once it is back."""

    def __init__(self, clock: Clock, back_at: float, *, cost: float = 20.0,
                 refuse: dict[str, SlurmError] | None = None, restarts: int = 0) -> None:
        self.clock, self.back_at, self.cost = clock, back_at, cost
        self.refuse = refuse or {}
        self.calls: list[str] = []
        self.accepted: list[str] = []
        self.restarts = restarts

    def _step(self, name: str) -> None:
        self.calls.append(name)
        if self.clock.now < self.back_at:
            self.clock.now += self.cost
            raise AWAY
        if name in self.refuse:
            raise self.refuse[name]
        self.accepted.append(name)

    def requeue(self, job_id: int, *, hold: bool = False) -> None:
        assert hold
        self._step("hold")

    def update_job(self, job_id: int, **kw: str) -> None:
        self._step(f"update:{next(iter(kw))}")

    def release(self, job_id: int) -> None:
        self._step("release")

    def job(self, job_id: int) -> Any:
        self.calls.append("job")

        class J:
            restarts = self.restarts

        return J()


def plan(clock: Clock, **kw: Any) -> requeue_steps.RequeuePlan:
    base: dict[str, Any] = dict(job_id=77, attempt=0, new_shards=40, resize=True, nice=100,
                                admin_comment="cl1:carried", record=record(),
                                decided_at=clock.now)
    base.update(kw)
    return requeue_steps.RequeuePlan(**base)


# ------------------------------------------------------------- retry ---


def test_retried_until_slurmctld_answers_then_every_step_once() -> None:
    clock = Clock()
    slurm = AwaySlurm(clock, back_at=clock.now + 70)
    saved: list[list[str]] = []
    out = requeue_retry.retry(plan(clock), slurm, cap_s=3600, clock=clock.time,  # type: ignore[arg-type]
                              sleep=clock.sleep, save=lambda p: saved.append(list(p.done)))
    assert out.requeued and out.errors == ()
    assert out.why.startswith("requeued after") and out.tries > 1
    assert slurm.accepted == ["hold", "update:TresPerNode", "update:Nice",
                              "update:AdminComment", "release"]
    assert clock.sleeps[:3] == [1.0, 2.0, 4.0]  # the pause doubles
    assert saved[-1] == list(requeue_steps.STEPS)


def test_a_step_not_answered_half_way_goes_on_from_there() -> None:
    """The hold was accepted, then slurmctld went away: no second hold, and the job is
    released in the end (it must not stay held)."""
    clock = Clock()
    p = plan(clock, done=["hold"])
    slurm = AwaySlurm(clock, back_at=clock.now + 30)
    out = requeue_retry.retry(p, slurm, cap_s=3600, clock=clock.time, sleep=clock.sleep)  # type: ignore[arg-type]
    assert out.requeued
    assert "hold" not in slurm.calls and slurm.accepted[-1] == "release"


def test_an_unanswered_hold_that_landed_is_not_counted_as_refused() -> None:
    """The first hold was cut off by the timeout but slurmctld did it: the second is
    refused ("pending"), the restart count says the requeue happened."""
    clock = Clock()
    slurm = AwaySlurm(clock, back_at=clock.now + 10, restarts=1,
                      refuse={"hold": SlurmError("exit 1: Job is pending execution")})
    out = requeue_retry.retry(plan(clock), slurm, cap_s=3600, clock=clock.time,  # type: ignore[arg-type]
                              sleep=clock.sleep)
    assert out.requeued and "job" in slurm.calls
    assert slurm.accepted[-1] == "release"


def test_giving_up_at_the_cap_is_recorded_truthfully(tmp_path: Path) -> None:
    clock = Clock()
    p = plan(clock)
    slurm = AwaySlurm(clock, back_at=float("inf"))
    out = requeue_retry.retry(p, slurm, cap_s=300, clock=clock.time, sleep=clock.sleep)  # type: ignore[arg-type]
    assert not out.requeued and slurm.accepted == []
    assert 300 <= out.waited_s < 300 + 20 + 30
    assert out.why == f"requeue failed: controller unreachable for {out.waited_s:.0f} s"
    spooled: list[str] = []
    text = requeue_retry.finish(p, out, cfg_of(tmp_path), LOG, spooled.append)
    assert spooled == [text]
    rq = decode(spooled[0]).attempts[-1].requeue
    assert rq is not None and not rq.requeued and rq.new_request is None
    assert rq.reason.startswith("requeue failed: controller unreachable for ")
    assert "decided: GPU OOM with 8 shards" in rq.reason
    assert spooled[0].startswith("colloc1:mode=explicit,shards=8 ")  # job_submit's text kept


def test_a_job_slurm_no_longer_knows_ends_the_retry() -> None:
    """The job's own life in Slurm bounds the retry: past MinJobAge slurmctld answers
    "Invalid job id" and the record says so."""
    clock = Clock()
    slurm = AwaySlurm(clock, back_at=clock.now + 40,
                      refuse={"hold": SlurmError("exit 1: Invalid job id specified")})
    out = requeue_retry.retry(plan(clock), slurm, cap_s=3600, clock=clock.time,  # type: ignore[arg-type]
                              sleep=clock.sleep)
    assert not out.requeued
    assert out.why.startswith("requeue failed: slurmctld refused it after")
    assert "Invalid job id" in out.why


def test_a_successful_retry_spools_nothing(tmp_path: Path) -> None:
    clock = Clock()
    p = plan(clock)
    out = requeue_retry.Outcome(True, 12.0, 3, "requeued after 12 s (3 tries)")
    spooled: list[str] = []
    assert requeue_retry.finish(p, out, cfg_of(tmp_path), LOG, spooled.append) is None
    assert spooled == []


def test_plan_file_is_roots_0600_and_round_trips(tmp_path: Path) -> None:
    clock = Clock()
    p = plan(clock, done=["hold"], context=jobmod.context_to_json(ctx_of()))
    path = tmp_path / "p.json"
    requeue_steps.write_plan(path, p)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    back = requeue_steps.read_plan(path)
    assert back == p
    with pytest.raises(ValueError):
        requeue_steps.RequeuePlan.from_json('{"job_id": 0, "attempt": 0, "new_shards": 4, '
                                            '"resize": true}')


def test_the_helper_spools_through_the_epilogs_own_path(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    ctx = ctx_of(uid=os.getuid())
    p = plan(clock, context=jobmod.context_to_json(ctx))
    seen: list[tuple[int, str]] = []
    monkeypatch.setattr(epilog, "_spool_record",
                        lambda c, cfg, text, result: seen.append((c.job_id, text)))
    spool = requeue_retry._spool_with_epilog(p, cfg_of(tmp_path))
    spool("cl1:x")
    assert seen == [(77, "cl1:x")]


# ------------------------------------------------------------- the epilog ---


def test_epilog_hands_an_unanswered_requeue_to_the_helper(tmp_path, scan, quiet,  # noqa: F811
                                                          monkeypatch) -> None:
    handed: list[requeue_steps.RequeuePlan] = []

    def hand_off(p: requeue_steps.RequeuePlan, evidence_dir: str, env: Any) -> Path:
        handed.append(p)
        return tmp_path / "requeue" / "77.0.json"

    monkeypatch.setattr(requeue_steps, "hand_off", hand_off)
    s = AwaySlurm(Clock(), back_at=float("inf"))
    r = epilog.run(ctx_of(uid=0), cfg_of(tmp_path, evidence_user_copy=False), s, LOG,  # type: ignore[arg-type]
                   epilog.EpilogResult(77))
    assert not r.requeued and r.requeue_pending
    assert "requeue=pending" in r.summary()
    assert any(e.startswith("requeue pending: slurmctld did not answer") for e in r.errors)
    assert quiet["spooled"] == []  # the helper writes the record once it knows
    (p,) = handed
    assert p.done == [] and p.hold_unsure and p.new_shards == 40
    rq = decode(p.record or "").attempts[-1].requeue
    assert rq is not None and rq.requeued  # becomes true only if Slurm accepts it
    assert jobmod.context_from_json(p.context, {"SLURM_JOB_ID": "77", "SLURM_JOB_UID": "0"})


def test_epilog_refused_requeue_spools_a_record_that_says_so(tmp_path, scan, quiet) -> None:  # noqa: F811
    s = AwaySlurm(Clock(), back_at=0, refuse={"hold": SlurmError("Job is no longer pending")})
    r = epilog.run(ctx_of(uid=0), cfg_of(tmp_path, evidence_user_copy=False), s, LOG,  # type: ignore[arg-type]
                   epilog.EpilogResult(77))
    assert not r.requeued and not r.requeue_pending
    (text,) = quiet["spooled"]
    rq = decode(text).attempts[-1].requeue
    assert rq is not None and not rq.requeued
    assert rq.reason.startswith("requeue failed: Job is no longer pending")


def test_epilog_whose_helper_cannot_start_records_the_failure(tmp_path, scan, quiet,  # noqa: F811
                                                              monkeypatch) -> None:
    def hand_off(*a: Any) -> Path:
        raise OSError("No space left on device")

    monkeypatch.setattr(requeue_steps, "hand_off", hand_off)
    r = epilog.run(ctx_of(uid=0), cfg_of(tmp_path, evidence_user_copy=False),
                   AwaySlurm(Clock(), back_at=float("inf")), LOG, epilog.EpilogResult(77))  # type: ignore[arg-type]
    assert not r.requeue_pending
    (text,) = quiet["spooled"]
    rq = decode(text).attempts[-1].requeue
    assert rq is not None and not rq.requeued and "No space left" in rq.reason
