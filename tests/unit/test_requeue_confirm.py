"""Release confirmation (issue 28): a requeue Slurm accepted ends with the job released,
even when slurmctld lost the release (SIGKILLed before it saved its state).

State in tmp_path only; Slurm is a fake adapter answering with typed jobs as
``squeue --json`` would; the clock is passed in.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from slurm_colloc.config import CollocConfig
from slurm_colloc.mps import release_confirm as rc
from slurm_colloc.node import epilog, requeue_retry, requeue_steps
from slurm_colloc.slurm.adapter import SlurmError
from slurm_colloc.slurm.records import ExitCode, JobState
from slurm_colloc.slurm.squeue_json import SlurmJob, parse_jobs

from .test_node_cov_epilog import FakeSlurm as EpilogSlurm
from .test_node_cov_epilog import ctx_of

UID = 1001
T0 = 1_800_000_000.0
DATA = Path(__file__).parent / "data" / "slurm"


def cfg_of(tmp: Path) -> CollocConfig:
    return CollocConfig(mps_root=str(tmp / "mps"), metrics_dir=str(tmp / "var" / "metrics"),
                        evidence_dir=str(tmp / "var" / "evidence"),
                        log_file=str(tmp / "colloc.log"))


def sjob(state: str = "PENDING", flags: frozenset[str] = frozenset(), *, restarts: int = 1,
         uid: int = UID, held: bool = False, reason: str = "Priority",
         description: str = "") -> SlurmJob:
    return SlurmJob(
        job_id=77, user_id=uid, user_name="u", state=state, reason=reason, restarts=restarts,
        name="j", tres_per_node="gres/shard:40", tres_per_job="", tres_per_task="",
        tres_per_socket="", gres_detail=(), admin_comment="", comment="",
        exit_code=ExitCode(frozenset({"PENDING"}), None, None), stdout=None, stderr=None,
        batch_host="", array_job_id=0, array_task_id=None, job_state=JobState(state, flags),
        held=held, state_description=description,
    )


def requeue_held(**kw: Any) -> SlurmJob:
    """What the restarted slurmctld shows when it lost colloc's release."""
    return sjob(held=True, reason="JobHeldUser", description=rc.HELD_TEXT, **kw)


def marker(**kw: Any) -> rc.Marker:
    base: dict[str, Any] = dict(job_id=77, attempt=0, uid=UID, released_at=T0,
                                next_check=T0 + rc.CONFIRM_AFTER_S)
    base.update(kw)
    return rc.Marker(**base)


def a_plan() -> requeue_steps.RequeuePlan:
    return requeue_steps.RequeuePlan(job_id=77, attempt=0, new_shards=40, resize=True,
                                     nice=100, admin_comment="cl1:carried", decided_at=T0,
                                     done=list(requeue_steps.STEPS))


class Slurm:
    """squeue's answer (``jobs_among``) and the steps colloc sends, recorded."""

    def __init__(self, job: SlurmJob | None = None, *, away: bool = False) -> None:
        self.job, self.away = job, away
        self.asked = 0
        self.calls: list[str] = []

    def jobs_among(self, ids: Any) -> dict[int, SlurmJob]:
        self.asked += 1
        if self.away:
            raise SlurmError("squeue: Unable to contact slurm controller (connect failure)")
        return {77: self.job} if self.job is not None and 77 in set(ids) else {}

    def release(self, job_id: int) -> None:
        self.calls.append("release")
        if self.job is not None:
            self.job = replace(self.job, held=False, reason="Priority", state_description="")

    def update_job(self, job_id: int, **kw: str) -> None:
        self.calls.append(f"update:{next(iter(kw))}")

    def requeue(self, job_id: int, *, hold: bool = False) -> None:
        self.calls.append("hold")


def logged(caplog: Any, capfd: Any) -> str:
    return caplog.text + capfd.readouterr().err


# ------------------------------------------------------------------ decide ---


def test_held_by_the_requeue_is_released_again_and_looked_at_later() -> None:
    v = rc.decide(marker(), requeue_held(), T0 + 40)
    assert v.action == "release" and v.marker.releases == 1
    assert v.marker.next_check == T0 + 40 + rc.CONFIRM_AFTER_S
    # the REQUEUE_HOLD flag says the same where the description is empty
    v = rc.decide(marker(), sjob(flags=frozenset({"REQUEUE_HOLD"}), held=True), T0 + 40)
    assert v.action == "release"


@pytest.mark.parametrize("job,why", [
    (sjob("RUNNING"), "RUNNING"),
    (sjob("COMPLETED"), "COMPLETED"),
    (None, "unknown to Slurm"),
    (requeue_held(restarts=2), "restart 2"),  # it ran again and was held anew: not ours
    (requeue_held(uid=4242), "uid 4242"),
])
def test_anything_but_the_held_attempt_ends_the_watch(job: SlurmJob | None, why: str) -> None:
    v = rc.decide(marker(), job, T0 + 40)
    assert v.action == "done" and why in v.why


def test_a_requeue_slurmctld_lost_itself_is_said_loudly(tmp_path: Path, caplog, capfd) -> None:
    """The restarted slurmctld's state predates the hold: nothing to release, and the
    log says the requeue was lost (an error line, not "confirmed")."""
    v = rc.decide(marker(), sjob("FAILED", restarts=0), T0 + 40)
    assert v.action == "lost" and "restart 0 (FAILED)" in v.why
    path = kept(tmp_path)
    slurm = Slurm(sjob("FAILED", restarts=0))
    round_at(tmp_path, slurm, T0 + 31)
    assert not path.exists() and slurm.calls == []
    assert "attempt 0: requeue lost: Slurm shows restart 0" in logged(caplog, capfd)


def test_pending_released_is_confirmed_only_after_a_while() -> None:
    assert rc.decide(marker(), sjob(), T0 + 5).action == "wait"
    v = rc.decide(marker(), sjob(), T0 + rc.CONFIRM_AFTER_S)
    assert v.action == "done" and "released" in v.why


@pytest.mark.parametrize("reason", ["JobHeldAdmin", "JobHeldUser"])
def test_an_admins_or_users_own_hold_is_left_alone(reason: str) -> None:
    v = rc.decide(marker(), sjob(held=True, reason=reason), T0 + 40)
    assert v.action == "done" and "left alone" in v.why and reason in v.why


def test_no_answer_is_asked_again_until_the_bound() -> None:
    v = rc.decide(marker(), None, T0 + 100, answered=False)
    assert v.action == "wait" and v.marker.next_check == T0 + 100 + rc.CHECK_EVERY_S
    v = rc.decide(marker(), None, T0 + rc.GIVE_UP_S, answered=False)
    assert v.action == "give_up" and "scontrol release 77" in v.why
    # a requeue_retry_s longer than 15 min: an away controller is waited for as long
    v = rc.decide(marker(give_up_s=3600.0), None, T0 + rc.GIVE_UP_S, answered=False)
    assert v.action == "wait"
    assert rc.decide(marker(give_up_s=3600.0), None, T0 + 3600, answered=False).action \
        == "give_up"


def test_releases_are_bounded() -> None:
    v = rc.decide(marker(releases=rc.MAX_RELEASES), requeue_held(), T0 + 400)
    assert v.action == "give_up" and "scontrol release 77" in v.why


def test_slurms_json_gives_hold_and_description() -> None:
    for rel in ("24.11", "26.05"):
        held = parse_jobs((DATA / rel / "squeue-held-pending.json").read_text())
        plain = parse_jobs((DATA / rel / "squeue-plain.json").read_text())
        (h,), (p,) = held.values(), plain.values()
        assert h.held and h.state_description == "" and not rc.held_by_requeue(h)
        assert not p.held


def test_slurms_json_of_a_requeuehold_and_of_an_admins_hold() -> None:
    """The fields 26.05 printed in tests/e2e/test_release_confirm.py: a requeuehold by
    root reads JobHeldUser with slurmctld's description; release then an admin's hold
    reads JobHeldAdmin with none."""
    doc = json.loads((DATA / "26.05" / "squeue-held-pending.json").read_text())
    doc["jobs"][0].update(state_reason="JobHeldUser", restart_cnt=1,
                          state_description="job requeued in held state")
    (j,) = parse_jobs(json.dumps(doc)).values()
    assert j.held and j.restarts == 1 and rc.held_by_requeue(j)
    doc["jobs"][0].update(state_reason="JobHeldAdmin", state_description="")
    (j,) = parse_jobs(json.dumps(doc)).values()
    assert j.held and not rc.held_by_requeue(j)


def test_a_hold_that_is_not_a_boolean_is_refused() -> None:
    doc = json.loads((DATA / "26.05" / "squeue-held-pending.json").read_text())
    doc["jobs"][0]["hold"] = "yes"
    with pytest.raises(ValueError, match="hold"):
        parse_jobs(json.dumps(doc))


# ------------------------------------------------------------------ a round ---


def kept(tmp_path: Path, **kw: Any) -> Path:
    cfg = cfg_of(tmp_path)
    path = requeue_steps.confirm_later(cfg.evidence_dir, a_plan(), UID, now=T0)
    assert path is not None
    if kw:
        m = rc.markers(path.parent)[0][0]
        rc.write_marker(path.parent, replace(m, **kw))
    return path


def round_at(tmp_path: Path, slurm: Slurm, t: float) -> int:
    cfg = cfg_of(tmp_path)
    return requeue_retry.confirm_round(cfg.evidence_dir, slurm, cfg.log_file, now=t)  # type: ignore[arg-type]


def test_a_lost_release_is_released_again_once(tmp_path: Path, caplog, capfd) -> None:
    path = kept(tmp_path)
    assert path.name == "77.0.confirm" and path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    slurm = Slurm(requeue_held())
    assert round_at(tmp_path, slurm, T0 + 10) == 0 and slurm.asked == 0  # not due yet
    assert round_at(tmp_path, slurm, T0 + 31) == 1
    # the plan's steps after the hold redone (a crash may have lost them too), once
    assert slurm.calls == ["update:TresPerNode", "update:Nice", "update:AdminComment",
                           "release"]
    assert "released again (1 of 3)" in logged(caplog, capfd)
    assert path.exists()  # looked at again
    assert round_at(tmp_path, slurm, T0 + 45) == 0 and slurm.asked == 1
    assert round_at(tmp_path, slurm, T0 + 62) == 1
    assert slurm.calls.count("release") == 1 and not path.exists()
    assert "release confirmed: pending and released" in logged(caplog, capfd)


@pytest.mark.parametrize("job", [sjob("RUNNING"), sjob(), None])
def test_running_pending_or_unknown_removes_the_marker_without_a_call(
        tmp_path: Path, job: SlurmJob | None) -> None:
    path = kept(tmp_path)
    slurm = Slurm(job)
    round_at(tmp_path, slurm, T0 + 31)
    assert slurm.asked == 1 and slurm.calls == [] and not path.exists()


def test_an_admin_hold_is_not_touched(tmp_path: Path, caplog, capfd) -> None:
    path = kept(tmp_path)
    slurm = Slurm(sjob(held=True, reason="JobHeldAdmin"))
    round_at(tmp_path, slurm, T0 + 31)
    assert slurm.calls == [] and not path.exists()
    assert "held by someone else (JobHeldAdmin): left alone" in logged(caplog, capfd)


def test_past_the_bound_it_is_given_up_with_a_line(tmp_path: Path, caplog, capfd) -> None:
    path = kept(tmp_path)
    slurm = Slurm(requeue_held(), away=True)
    assert round_at(tmp_path, slurm, T0 + 31) == 0
    assert path.exists() and slurm.calls == []  # no answer is not "gone"
    round_at(tmp_path, slurm, T0 + rc.GIVE_UP_S + 1)
    assert not path.exists() and slurm.calls == []
    assert "release confirmation given up: slurmctld did not answer" in logged(caplog, capfd)


def test_a_retry_helper_at_work_is_waited_for(tmp_path: Path) -> None:
    path = kept(tmp_path)
    cfg = cfg_of(tmp_path)
    requeue_steps.write_plan(requeue_steps.plan_path(cfg.evidence_dir, 77, 0), a_plan())
    slurm = Slurm(requeue_held())
    assert round_at(tmp_path, slurm, T0 + 31) == 0
    assert slurm.asked == 0 and slurm.calls == [] and path.exists()
    assert rc.markers(path.parent)[0][0].next_check == T0 + 31 + rc.CHECK_EVERY_S


def test_a_bare_release_without_a_readable_plan(tmp_path: Path) -> None:
    path = kept(tmp_path, plan="not json")
    slurm = Slurm(requeue_held())
    round_at(tmp_path, slurm, T0 + 31)
    assert slurm.calls == ["release"] and path.exists()


def test_unreadable_and_foreign_files_are_never_acted_on(tmp_path: Path, caplog, capfd) -> None:
    sdir = rc.state_dir(cfg_of(tmp_path).evidence_dir)
    sdir.mkdir(parents=True)
    (sdir / "77.0.confirm").write_text("{")
    (sdir / "78.0.confirm").symlink_to(sdir / "77.0.confirm")
    slurm = Slurm(requeue_held())
    assert round_at(tmp_path, slurm, T0 + 31) == 0 and slurm.asked == 0
    assert not (sdir / "77.0.confirm").exists()
    assert "unreadable release marker 77.0.confirm removed" in logged(caplog, capfd)
    assert rc.markers(sdir) == ([], [])


# ------------------------------------------------------------ who leaves one ---


def test_the_epilogs_requeue_leaves_a_marker_after_slurm_answered(tmp_path: Path) -> None:
    cfg = cfg_of(tmp_path)
    seen: list[requeue_steps.RequeuePlan] = []
    epilog.requeue(ctx_of(), EpilogSlurm(), 40, confirm=seen.append)
    assert len(seen) == 1 and seen[0].done == list(requeue_steps.STEPS)
    # an unanswered step: the retry helper goes on and leaves its own marker
    away = EpilogSlurm(fail={"Nice": SlurmError("scontrol update: timed out after 20s")})
    with pytest.raises(requeue_steps.ControllerAway):
        epilog.requeue(ctx_of(), away, 40, nice=5, confirm=seen.append)
    assert len(seen) == 1
    # a refused request after the hold: released at once, and confirmed too
    refused = EpilogSlurm(fail={"TresPerNode": SlurmError("exit 1: Invalid generic resource")})
    with pytest.raises(SlurmError):
        epilog.requeue(ctx_of(), refused, 40, confirm=seen.append)
    assert len(seen) == 2 and seen[1].held
    # the hold itself refused: nothing to confirm
    path = requeue_steps.confirm_later(cfg.evidence_dir, requeue_steps.RequeuePlan(
        job_id=77, attempt=0, new_shards=40, resize=True), UID)
    assert path is None and not rc.state_dir(cfg.evidence_dir).exists()


def test_the_retry_helper_leaves_a_marker_when_its_hold_landed(tmp_path: Path) -> None:
    cfg = cfg_of(tmp_path)
    p = replace(a_plan(), context=json.dumps({"uid": UID}))
    log = logging.LoggerAdapter(logging.getLogger("test-requeue-confirm"), {})
    requeue_retry._keep_confirming(p, cfg, log)
    (m,), _ = rc.markers(rc.state_dir(cfg.evidence_dir))
    assert (m.job_id, m.attempt, m.uid) == (77, 0, UID)
    assert requeue_steps.RequeuePlan.from_json(m.plan or "").new_shards == 40


# ------------------------------------------------------------ the collector ---


def test_the_collector_stays_and_kicks_only_when_a_marker_is_due(
        tmp_path: Path, monkeypatch) -> None:
    from slurm_colloc.metrics.collector import work_left

    cfg = cfg_of(tmp_path)
    started: list[tuple[str, tuple[str, ...]]] = []
    monkeypatch.setattr(rc, "spawn_module", lambda mod, args, env: started.append((mod, args)))
    sdir = rc.state_dir(cfg.evidence_dir)
    assert work_left(cfg) is None
    assert not rc.kick(sdir, {}, time.time()) and started == []
    now = time.time()
    requeue_steps.confirm_later(cfg.evidence_dir, a_plan(), UID, now=now)
    assert work_left(cfg, now) == "a requeue's release to confirm"
    assert not rc.kick(sdir, {}, now + 5) and started == []
    assert rc.kick(sdir, {}, now + rc.CONFIRM_AFTER_S)
    assert started == [("slurm_colloc.node.requeue_retry", ("--confirm",))]
    assert work_left(cfg, now + rc.GIVE_UP_S + rc.LATE_S + 1) is None  # bounded


def test_confirm_main_runs_one_round_under_a_lock(tmp_path: Path, monkeypatch) -> None:
    from slurm_colloc import config as cfgmod

    cfg = cfg_of(tmp_path)
    monkeypatch.setattr(cfgmod, "load", lambda *a, **k: cfg)
    rounds: list[str] = []
    monkeypatch.setattr(requeue_retry, "confirm_round",
                        lambda evidence_dir, adapter, log_file: rounds.append(evidence_dir))
    assert requeue_retry.main(["--confirm"]) == 0
    assert rounds == [cfg.evidence_dir]
    fd = requeue_retry._confirm_lock(rc.state_dir(cfg.evidence_dir))
    assert fd is not None
    try:
        assert requeue_retry.main(["--confirm"]) == 0 and len(rounds) == 1  # one at a time
    finally:
        os.close(fd)


def test_the_retry_helper_confirms_its_own_release(tmp_path: Path, caplog, capfd) -> None:
    """After a long outage the collector may be gone: the helper that finished the
    requeue does the rounds itself until the marker is gone."""
    path = kept(tmp_path)
    slurm = Slurm(requeue_held())
    now = [T0]

    def sleep(s: float) -> None:
        now[0] += s

    cfg = cfg_of(tmp_path)
    requeue_retry.confirm_here(path, cfg.evidence_dir, slurm, cfg.log_file,  # type: ignore[arg-type]
                               sleep=sleep, clock=lambda: now[0])
    assert not path.exists() and slurm.calls.count("release") == 1
    assert now[0] == T0 + 2 * rc.CONFIRM_AFTER_S
    text = logged(caplog, capfd)
    assert "released again (1 of 3)" in text and "release confirmed" in text


def test_the_bound_follows_requeue_retry_s_when_longer(tmp_path: Path) -> None:
    cfg = cfg_of(tmp_path)
    for wait, want in ((0, rc.GIVE_UP_S), (3600, 3600.0), (10**9, rc.MAX_GIVE_UP_S)):
        path = requeue_steps.confirm_later(cfg.evidence_dir, a_plan(), UID, now=T0, wait_s=wait)
        assert path is not None
        (m,), _ = rc.markers(path.parent)
        assert m.give_up_s == want
    ctx_cfg = replace(cfg, requeue_retry_s=7200)
    requeue_retry._keep_confirming(replace(a_plan(), context=json.dumps({"uid": UID})),
                                   ctx_cfg, logging.LoggerAdapter(logging.getLogger("t"), {}))
    (m,), _ = rc.markers(rc.state_dir(cfg.evidence_dir))
    assert m.give_up_s == 7200.0
