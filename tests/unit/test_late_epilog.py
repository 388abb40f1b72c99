"""The late epilog (issue 28): colloc's epilog for a job slurmd never ran it for.

State in tmp_path only; Slurm is a fake adapter; the epilog library is replaced by
recorders (its own tests cover what it does)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from slurm_colloc.config import CollocConfig
from slurm_colloc.mps import missed_epilogs as missed
from slurm_colloc.mps.tenancy import Tenancy
from slurm_colloc.node import entry, epilog, epilog_once, late_epilog
from slurm_colloc.node.epilog import EpilogResult
from slurm_colloc.node.job import JobContext, context_to_json
from slurm_colloc.slurm.adapter import SlurmError
from slurm_colloc.slurm.records import ExitCode, JobState
from slurm_colloc.slurm.squeue_json import SlurmJob

UID = os.geteuid()


def logged(caplog: Any, capfd: Any) -> str:
    """What the node loggers wrote (caplog, or stderr once a handler of an earlier
    test made the logger stop propagating)."""
    return caplog.text + capfd.readouterr().err


def cfg_of(tmp: Path) -> CollocConfig:
    return CollocConfig(
        gpu_backend="sim", sim_state_dir=str(tmp / "sim"), mps_root=str(tmp / "mps"),
        evidence_dir=str(tmp / "var" / "evidence"), metrics_dir=str(tmp / "var" / "metrics"),
        history_db=str(tmp / "var" / "history.sqlite"), log_file=str(tmp / "colloc.log"),
    )


def sjob(job_id: int = 7, state: str = "FAILED", flags: frozenset[str] = frozenset(),
         restarts: int = 0, uid: int = UID, exit_code: tuple[int, int] = (1, 0)) -> SlurmJob:
    return SlurmJob(
        job_id=job_id, user_id=uid, user_name="u", state=state, reason="", restarts=restarts,
        name="j", tres_per_node="gres/shard:6", tres_per_job="", tres_per_task="",
        tres_per_socket="", gres_detail=(), admin_comment="", comment="",
        exit_code=ExitCode(frozenset({"ERROR"}), exit_code[0], exit_code[1]),
        stdout="/tmp/x.out", stderr=None, batch_host="n1", array_job_id=0,
        array_task_id=None, job_state=JobState(state, flags),
    )


def ctx_of(job_id: int = 7, restarts: int = 0) -> JobContext:
    return JobContext(job_id=job_id, uid=UID, user="u", node="n1", gpus=(0,), shards=6,
                      gpu_count=0, stdout="/tmp/x.out", stderr=None, restarts=restarts,
                      admin_comment="", exit_code="", state="RUNNING")


def save_ctx(cfg: CollocConfig, job_id: int = 7, age: float = 100.0, restarts: int = 0) -> float:
    t = Tenancy(Path(cfg.mps_root))
    t.write_job_context(job_id, context_to_json(ctx_of(job_id, restarts)))
    mtime = time.time() - age
    os.utime(t.job_context_file(job_id), (mtime, mtime))
    return t.job_context_file(job_id).stat().st_mtime


# ------------------------------------------------------------------ decide

def test_a_job_slurm_shows_running_waits_and_is_asked_again_later() -> None:
    w = missed.Watch(ctx_mtime=0.0)
    for state in ("RUNNING", "CONFIGURING", "SUSPENDED", "PENDING"):
        v = missed.decide(UID, 0, sjob(state=state), w, now=100.0)
        assert v.action == "wait" and v.watch.first_ended is None
        assert v.watch.next_check == 100.0 + missed.CHECK_EVERY_S
    # a long job is asked about less often (bounded)
    v = missed.decide(UID, 0, sjob(state="RUNNING"), w, now=86400.0)
    assert v.watch.next_check == 86400.0 + missed.MAX_CHECK_EVERY_S


def test_completing_flag_means_an_epilog_may_still_run() -> None:
    v = missed.decide(UID, 0, sjob(state="COMPLETING", flags=frozenset({"COMPLETING"})),
                      missed.Watch(0.0, first_ended=0.0), now=1000.0)
    assert v.action == "wait" and v.watch.first_ended is None


def test_an_ended_attempt_runs_only_after_it_stayed_ended() -> None:
    w = missed.Watch(ctx_mtime=0.0)
    v = missed.decide(UID, 0, sjob(), w, now=100.0)
    assert v.action == "wait" and v.watch.first_ended == 100.0
    assert v.watch.next_check == 100.0 + missed.ENDED_FOR_S  # asked again when due
    v = missed.decide(UID, 0, sjob(), v.watch, now=100.0 + missed.ENDED_FOR_S - 1)
    assert v.action == "wait"
    v = missed.decide(UID, 0, sjob(), v.watch, now=100.0 + missed.ENDED_FOR_S)
    assert v.action == "run"


def test_back_to_running_resets_the_ended_clock() -> None:
    w = missed.Watch(ctx_mtime=0.0, first_ended=10.0)
    v = missed.decide(UID, 0, sjob(state="RUNNING"), w, now=100.0)
    assert v.watch.first_ended is None
    assert missed.decide(UID, 0, sjob(), v.watch, now=101.0).action == "wait"


@pytest.mark.parametrize("uid,restarts", [(UID + 1, 0), (UID, 1)])
def test_another_attempt_or_user_is_only_released(uid: int, restarts: int) -> None:
    w = missed.Watch(ctx_mtime=0.0, first_ended=0.0)
    v = missed.decide(UID, 0, sjob(uid=uid, restarts=restarts), w, now=100.0)
    assert v.action == "release"


def test_a_job_slurm_forgot_is_released_after_a_grace_never_run() -> None:
    v = missed.decide(UID, 0, None, missed.Watch(0.0), now=100.0)
    assert v.action == "wait" and v.watch.first_gone == 100.0
    v = missed.decide(UID, 0, None, v.watch, now=100.0 + missed.GONE_FOR_S)
    assert v.action == "release"


def test_gives_up_after_six_hours() -> None:
    w = missed.Watch(ctx_mtime=0.0, first_ended=0.0)
    assert missed.decide(UID, 1, sjob(), w, now=missed.GIVE_UP_S).action == "give_up"
    w = missed.Watch(ctx_mtime=0.0, first_gone=0.0)
    assert missed.decide(UID, 0, None, w, now=missed.GIVE_UP_S).action == "give_up"


# ------------------------------------------------------------------ due

def test_due_lists_old_root_contexts_only(tmp_path: Path) -> None:
    cfg = cfg_of(tmp_path)
    save_ctx(cfg, 7, age=100.0)
    save_ctx(cfg, 8, age=1.0)  # its prolog may still run
    ctx_dir = Path(cfg.mps_root) / "ctx"
    (ctx_dir / "9.json").symlink_to(ctx_dir / "7.json")
    (ctx_dir / "x.json").write_text("{}")
    sdir = missed.state_dir(cfg.evidence_dir)
    assert list(missed.due(cfg.mps_root, sdir, time.time())) == [7]


def test_due_respects_the_next_check_and_a_new_context(tmp_path: Path) -> None:
    cfg = cfg_of(tmp_path)
    mtime = save_ctx(cfg, 7)
    sdir = missed.state_dir(cfg.evidence_dir)
    sdir.mkdir(parents=True)
    now = time.time()
    missed.write_watch(sdir, 7, missed.Watch(ctx_mtime=mtime, next_check=now + 30))
    assert missed.due(cfg.mps_root, sdir, now) == {}
    assert list(missed.due(cfg.mps_root, sdir, now + 31)) == [7]
    save_ctx(cfg, 7, age=50.0)  # a new attempt's prolog: a new watch
    assert list(missed.due(cfg.mps_root, sdir, now)) == [7]


def test_no_state_no_question(tmp_path: Path) -> None:
    cfg = cfg_of(tmp_path)
    assert missed.due(cfg.mps_root, missed.state_dir(cfg.evidence_dir), time.time()) == {}


# ------------------------------------------------------------------ the lock

def test_the_job_lock_admits_one(tmp_path: Path) -> None:
    sdir = tmp_path / "late"
    fd = epilog_once.take(sdir, 7)
    assert fd is not None
    assert epilog_once.take(sdir, 7, wait_s=0.3) is None
    assert epilog_once.take(sdir, 8) is not None
    epilog_once.drop(sdir, 7, fd)
    assert not (sdir / "7.lock").exists()
    fd2 = epilog_once.take(sdir, 7)
    assert fd2 is not None
    epilog_once.drop(sdir, 7, fd2)


def test_slurmd_epilog_after_the_late_one_does_nothing(tmp_path: Path) -> None:
    cfg = cfg_of(tmp_path)
    sdir = missed.state_dir(cfg.evidence_dir)
    sdir.mkdir(parents=True)
    epilog_once.mark_late(sdir, 7, 1.0)
    with epilog_once.slurmd_epilog(cfg, 7) as not_here:
        assert not_here is not None and "already" in not_here
    # a later attempt's prolog saved a new context: its epilog runs, the marker goes
    save_ctx(cfg, 7, restarts=1)
    with epilog_once.slurmd_epilog(cfg, 7) as not_here:
        assert not_here is None
        assert epilog_once.take(sdir, 7) is None  # held meanwhile
    assert not epilog_once.late_marker(sdir, 7).exists()


def test_slurmd_epilog_waits_for_a_late_one_then_stands_aside(tmp_path: Path,
                                                              monkeypatch) -> None:
    cfg = cfg_of(tmp_path)
    sdir = missed.state_dir(cfg.evidence_dir)
    fd = epilog_once.take(sdir, 7)
    assert fd is not None
    monkeypatch.setattr(epilog_once, "WAIT_S", 0.3)
    with epilog_once.slurmd_epilog(cfg, 7) as not_here:
        assert not_here is not None and "holds" in not_here
    epilog_once.drop(sdir, 7, fd)


def test_slurmd_epilog_goes_ahead_when_bookkeeping_fails(tmp_path: Path) -> None:
    cfg = cfg_of(tmp_path)
    Path(cfg.evidence_dir).parent.mkdir(parents=True)
    missed.state_dir(cfg.evidence_dir).write_text("not a directory")
    with epilog_once.slurmd_epilog(cfg, 7) as not_here:
        assert not_here is None


def test_epilog_main_skips_a_job_the_late_epilog_did(tmp_path: Path, monkeypatch,
                                                     caplog, capfd) -> None:
    cfg = cfg_of(tmp_path)
    sdir = missed.state_dir(cfg.evidence_dir)
    sdir.mkdir(parents=True)
    epilog_once.mark_late(sdir, 7, 1.0)
    monkeypatch.setattr(entry.cfgmod, "load", lambda *a, **k: cfg)
    called: list[int] = []
    monkeypatch.setattr(epilog, "release_first", lambda j, c: called.append(j))
    assert entry.epilog_main({"SLURM_JOB_ID": "7", "SLURM_JOB_UID": str(UID)}) == 0
    assert called == []
    assert "epilog: job 7: the late epilog already did" in logged(caplog, capfd)


# ------------------------------------------------------------------ a round

class FakeSlurm:
    def __init__(self, jobs: dict[int, SlurmJob] | None = None) -> None:
        self.answer = jobs or {}
        self.asked = 0
        self.fail = False

    def jobs(self) -> dict[int, SlurmJob]:
        self.asked += 1
        if self.fail:
            raise SlurmError("squeue: Unable to contact slurm controller")
        return dict(self.answer)


@pytest.fixture
def recorded(monkeypatch) -> list[tuple[str, Any]]:
    calls: list[tuple[str, Any]] = []

    def release_first(job_id: int, cfg: CollocConfig) -> EpilogResult:
        calls.append(("release", job_id))
        return EpilogResult(job_id)

    def run(ctx: JobContext, cfg: CollocConfig, adapter: Any, log: Any,
            result: EpilogResult | None = None) -> EpilogResult:
        calls.append(("run", ctx))
        return replace(result or EpilogResult(ctx.job_id), requeued=True)

    monkeypatch.setattr(epilog, "release_first", release_first)
    monkeypatch.setattr(epilog, "run", run)
    return calls


def test_a_round_runs_the_epilog_once_with_slurms_exit(tmp_path: Path, recorded,
                                                       caplog, capfd) -> None:
    cfg = cfg_of(tmp_path)
    save_ctx(cfg, 7)
    slurm = FakeSlurm({7: sjob(exit_code=(1, 0)), 99: sjob(99)})
    now = time.time()
    assert late_epilog.scan(cfg, slurm, now) == 0  # first seen ended
    assert late_epilog.scan(cfg, slurm, now + 5) == 0  # not due yet: no question
    assert slurm.asked == 1
    assert late_epilog.scan(cfg, slurm, now + missed.CHECK_EVERY_S) == 1
    kinds = [c[0] for c in recorded]
    assert kinds == ["release", "run"]
    ctx = recorded[1][1]
    assert (ctx.job_id, ctx.uid, ctx.restarts, ctx.exit_code) == (7, UID, 0, "1:0")
    assert Tenancy(Path(cfg.mps_root)).read_job_context(7) is None
    sdir = missed.state_dir(cfg.evidence_dir)
    assert epilog_once.late_marker(sdir, 7).exists()
    assert late_epilog.scan(cfg, slurm, now + 1000) == 0 and len(recorded) == 2
    assert "late-epilog: job 7: no colloc epilog did its work" in logged(caplog, capfd)


def test_a_round_never_acts_while_the_job_lock_is_held(tmp_path: Path, recorded) -> None:
    cfg = cfg_of(tmp_path)
    save_ctx(cfg, 7)
    slurm = FakeSlurm({7: sjob()})
    sdir = missed.state_dir(cfg.evidence_dir)
    now = time.time()
    late_epilog.scan(cfg, slurm, now)
    fd = epilog_once.take(sdir, 7)
    assert fd is not None
    late_epilog.scan(cfg, slurm, now + missed.CHECK_EVERY_S)
    assert recorded == []
    epilog_once.drop(sdir, 7, fd)


def test_an_unanswered_question_is_not_gone(tmp_path: Path, recorded, caplog, capfd) -> None:
    cfg = cfg_of(tmp_path)
    save_ctx(cfg, 7)
    slurm = FakeSlurm()
    slurm.fail = True
    now = time.time()
    for k in range(5):
        assert late_epilog.scan(cfg, slurm, now + k * missed.GONE_FOR_S) == 0
    assert recorded == [] and slurm.asked == 5
    assert "slurmctld did not answer" in logged(caplog, capfd)


def test_a_forgotten_job_has_its_mps_state_released_only(tmp_path: Path, recorded,
                                                         caplog, capfd) -> None:
    cfg = cfg_of(tmp_path)
    save_ctx(cfg, 7)
    slurm = FakeSlurm({})
    now = time.time()
    late_epilog.scan(cfg, slurm, now)
    late_epilog.scan(cfg, slurm, now + missed.GONE_FOR_S)
    assert [c[0] for c in recorded] == ["release"]
    assert Tenancy(Path(cfg.mps_root)).read_job_context(7) is None
    assert "late-epilog: job 7: released MPS state only" in logged(caplog, capfd)


def test_a_job_still_running_is_left_alone(tmp_path: Path, recorded) -> None:
    cfg = cfg_of(tmp_path)
    save_ctx(cfg, 7)
    slurm = FakeSlurm({7: sjob(state="RUNNING")})
    now = time.time()
    for k in range(4):
        late_epilog.scan(cfg, slurm, now + k * missed.MAX_CHECK_EVERY_S)
    assert recorded == []
    assert Tenancy(Path(cfg.mps_root)).read_job_context(7) is not None


def test_a_new_prolog_between_decision_and_act_stops_it(tmp_path: Path, recorded) -> None:
    cfg = cfg_of(tmp_path)
    mtime = save_ctx(cfg, 7)
    sdir = missed.state_dir(cfg.evidence_dir)
    sdir.mkdir(parents=True)
    save_ctx(cfg, 7, age=30.0, restarts=1)
    v = missed.Verdict("run", missed.Watch(mtime), "FAILED for 30 s")
    late_epilog.act(cfg, FakeSlurm(), sdir, 7, mtime, v, sjob())  # type: ignore[arg-type]
    assert recorded == []
    assert json.loads(Tenancy(Path(cfg.mps_root)).read_job_context(7) or "")["restarts"] == 1


def test_watches_of_consumed_contexts_and_old_markers_are_pruned(tmp_path: Path) -> None:
    cfg = cfg_of(tmp_path)
    mtime = save_ctx(cfg, 7)
    sdir = missed.state_dir(cfg.evidence_dir)
    sdir.mkdir(parents=True)
    for job in (7, 8):
        missed.write_watch(sdir, job, missed.Watch(ctx_mtime=mtime))
    epilog_once.mark_late(sdir, 9, 1.0)
    epilog_once.mark_late(sdir, 10, 1.0)
    old = time.time() - missed.KEEP_MARKERS_S - 10
    os.utime(epilog_once.late_marker(sdir, 10), (old, old))
    assert missed.prune(cfg.mps_root, sdir, time.time()) == 2
    assert sorted(p.name for p in sdir.iterdir()) == ["7.watch", "9.late"]
