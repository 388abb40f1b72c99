"""Jobs a restarted slurmd left in their prolog (issue 28): decided from Slurm's JSON,
requeued, one log line each; the collector asks Slurm only after a slurmd restart.

State in tmp_path only; Slurm is a fake adapter."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest

from slurm_colloc import config as cfgmod
from slurm_colloc import slurmd_watch
from slurm_colloc.accounting import spool as spoolmod
from slurm_colloc.accounting.codec import decode, find_token
from slurm_colloc.config import CollocConfig, ConfigError, from_mapping
from slurm_colloc.metrics import collector
from slurm_colloc.mps.tenancy import Tenancy
from slurm_colloc.node import stuck_prologs as sp
from slurm_colloc.slurm.adapter import SlurmAdapter, SlurmError, parse_slurmd_start
from slurm_colloc.slurm.records import ExitCode, JobState
from slurm_colloc.slurm.squeue_json import SlurmJob, parse_jobs

NODE = "colloc-node0"
T_SLURMD = 1_795_891_223  # the restarted slurmd's start, as Slurm reports it
T_JOB = T_SLURMD - 5      # the jobs were allocated before it


def cfg_of(tmp: Path, **kw: Any) -> CollocConfig:
    return CollocConfig(
        gpu_backend="sim", sim_state_dir=str(tmp / "sim"), mps_root=str(tmp / "mps"),
        evidence_dir=str(tmp / "var" / "evidence"), metrics_dir=str(tmp / "var" / "metrics"),
        history_db=str(tmp / "var" / "history.sqlite"), log_file=str(tmp / "colloc.log"),
        **kw,
    )


def sjob(job_id: int = 7, base: str = "RUNNING", flags: frozenset[str] = frozenset(),
         reason: str = "Prolog", start: int = T_JOB, nodes: str = NODE,
         restarts: int = 0, admin_comment: str = "") -> SlurmJob:
    return SlurmJob(
        job_id=job_id, user_id=1000, user_name="u", state=base, reason=reason,
        restarts=restarts, name="j", tres_per_node="gres/shard:6", tres_per_job="",
        tres_per_task="", tres_per_socket="", gres_detail=(), admin_comment=admin_comment,
        comment="", exit_code=ExitCode(frozenset({"SUCCESS"}), 0, 0), stdout="/tmp/x.out",
        stderr=None, batch_host=NODE, array_job_id=0, array_task_id=None,
        job_state=JobState(base, flags), start_time=start, nodes=nodes,
    )


# ------------------------------------------------------------------ decide
def test_a_job_left_in_its_prolog_by_a_restarted_slurmd_is_requeued_after_the_grace() -> None:
    jobs = [sjob(7), sjob(8, flags=frozenset({"CONFIGURING"}))]
    got = sp.decide(jobs, T_SLURMD, T_SLURMD + 120, 120)
    assert [s.job_id for s in got] == [7, 8]
    assert "its prolog 120 s later (Reason=Prolog)" in got[0].why
    assert sp.decide(jobs, T_SLURMD, T_SLURMD + 119, 120) == []  # within the grace


@pytest.mark.parametrize("job", [
    sjob(reason="None"),                        # its prolog ended: it runs
    sjob(reason=""),
    sjob(start=T_SLURMD),                       # allocated by this slurmd: its prolog may run
    sjob(start=T_SLURMD + 30),
    sjob(start=0),                              # no start time: never acted on
    sjob(base="PENDING", reason="Prolog"),      # not running
    sjob(base="COMPLETED", reason="Prolog"),
])
def test_other_jobs_are_left_alone(job: SlurmJob) -> None:
    assert sp.decide([job], T_SLURMD, T_SLURMD + 3600, 120) == []


def test_without_slurms_slurmd_start_time_nothing_is_decided() -> None:
    assert sp.decide([sjob()], None, T_SLURMD + 3600, 120) == []
    assert sp.decide([sjob()], 0, T_SLURMD + 3600, 120) == []


# ------------------------------------------------------------------ a round
class FakeSlurm(SlurmAdapter):
    def __init__(self, jobs: list[SlurmJob], slurmd_start: int | None = T_SLURMD) -> None:
        self.answer = {j.job_id: j for j in jobs}
        self.start = slurmd_start
        self.requeued: list[int] = []
        self.refuse: set[int] = set()
        self.fail = False
        self.asked: list[str] = []

    def slurmd_start_time(self, node: str) -> int | None:
        self.asked.append(f"node {node}")
        if self.fail:
            raise SlurmError("scontrol: Unable to contact slurm controller")
        return self.start

    def jobs(self) -> dict[int, SlurmJob]:
        self.asked.append("jobs")
        return dict(self.answer)

    def requeue(self, job_id: int | str, *, hold: bool = False) -> None:
        assert not hold
        if int(job_id) in self.refuse:
            raise SlurmError("scontrol requeue: Requested operation is presently disabled")
        self.requeued.append(int(job_id))

    def submit(self, *a: Any, **k: Any) -> int:
        raise AssertionError("no submit")

    def accounting(self, *a: Any) -> list[Any]:
        raise AssertionError("no accounting")

    def update_job(self, *a: Any, **k: Any) -> None:
        raise AssertionError("no update")

    def release(self, *a: Any) -> None:
        raise AssertionError("no release")

    def set_admin_comment_finished(self, *a: Any) -> None:
        raise AssertionError("no sacctmgr")

    def nodes(self) -> list[dict[str, Any]]:
        raise AssertionError("no scontrol show nodes")

    def cancel(self, *a: Any) -> None:
        raise AssertionError("a stuck job is never cancelled")


@pytest.fixture(autouse=True)
def fresh_logger() -> Any:
    """node_logger keeps its first log file: each test's own file instead."""
    logger = logging.getLogger(f"colloc.node.{sp.LOG_COMPONENT}")

    def clear() -> None:
        for h in list(logger.handlers):
            logger.removeHandler(h)
            h.close()

    clear()
    yield
    clear()


@pytest.fixture
def no_writer(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    kicked: list[int] = []
    monkeypatch.setattr(spoolmod, "kick", lambda d, env, job_id=0, **k: kicked.append(job_id))
    return kicked


def test_a_round_requeues_this_nodes_stuck_jobs_and_logs_one_line_each(
        tmp_path: Path, no_writer: list[int]) -> None:
    cfg = cfg_of(tmp_path)
    slurm = FakeSlurm([sjob(7), sjob(8, reason="None"), sjob(9, nodes="other-node"),
                       sjob(10, nodes=f"colloc-node[0-1],x{NODE}")])
    done = sp.run(cfg, slurm, NODE, now=T_SLURMD + 130)
    assert [s.job_id for s in done] == [7, 10] == slurm.requeued
    log = Path(cfg.log_file).read_text()
    lines = [ln for ln in log.splitlines() if "stuck-prolog: job" in ln]
    assert len(lines) == 2 and "job 7:" in lines[0] and "requeued" in lines[0]
    assert "before slurmd restarted at" in lines[0]


def test_an_attempt_colloc_never_saw_gets_its_record_spooled(tmp_path: Path,
                                                            no_writer: list[int]) -> None:
    """The epilog after the requeue has no context of it, so it records nothing."""
    cfg = cfg_of(tmp_path)
    sp.run(cfg, FakeSlurm([sjob(7, restarts=1, admin_comment="site note")]), NODE,
           now=T_SLURMD + 130)
    spooled = spoolmod.entry_path(spoolmod.spool_dir_of(cfg.evidence_dir), 7, 1)
    text = spooled.read_text()
    assert text.startswith("site note") and find_token(text) is not None
    rec = decode(text)
    assert [a.attempt for a in rec.attempts] == [1]
    a = rec.attempts[0]
    assert a.requeue is not None and a.requeue.requeued and "prolog" in a.requeue.reason
    assert a.node == NODE and a.start == T_JOB
    assert no_writer == [7]
    assert "record spooled" in Path(cfg.log_file).read_text()


def test_an_attempt_colloc_s_prolog_saw_is_left_to_the_epilog(tmp_path: Path,
                                                            no_writer: list[int]) -> None:
    cfg = cfg_of(tmp_path)
    Tenancy(Path(cfg.mps_root)).write_job_context(7, json.dumps({"job_id": 7, "restarts": 0}))
    sp.run(cfg, FakeSlurm([sjob(7)]), NODE, now=T_SLURMD + 130)
    assert not spoolmod.entry_path(spoolmod.spool_dir_of(cfg.evidence_dir), 7, 0).exists()
    assert no_writer == []


def test_a_refused_requeue_is_logged_and_the_others_still_go(tmp_path: Path,
                                                           no_writer: list[int]) -> None:
    cfg = cfg_of(tmp_path)
    slurm = FakeSlurm([sjob(7), sjob(8)])
    slurm.refuse = {7}
    assert [s.job_id for s in sp.run(cfg, slurm, NODE, now=T_SLURMD + 130)] == [8]
    log = Path(cfg.log_file).read_text()
    assert "job 7:" in log and "requeue refused" in log and "admin must act" in log
    assert not spoolmod.entry_path(spoolmod.spool_dir_of(cfg.evidence_dir), 7, 0).exists()


def test_slurm_not_answering_does_nothing(tmp_path: Path, no_writer: list[int]) -> None:
    cfg = cfg_of(tmp_path)
    slurm = FakeSlurm([sjob(7)])
    slurm.fail = True
    with pytest.raises(SlurmError):
        sp.run(cfg, slurm, NODE, now=T_SLURMD + 130)
    assert slurm.requeued == []


def test_a_round_is_bounded(tmp_path: Path, no_writer: list[int]) -> None:
    cfg = cfg_of(tmp_path)
    slurm = FakeSlurm([sjob(i) for i in range(1, sp.MAX_REQUEUES + 10)])
    assert len(sp.run(cfg, slurm, NODE, now=T_SLURMD + 130)) == sp.MAX_REQUEUES


def test_a_bad_node_name_is_never_passed_to_slurm() -> None:
    with pytest.raises(SlurmError):
        FakeSlurm([]).jobs_on_node("--all")


# ------------------------------------------------------------------ Slurm's JSON
def test_slurm_json_gives_the_start_time_the_nodes_and_the_slurmd_start() -> None:
    doc = {"jobs": [{"job_id": 1, "user_id": 0, "job_state": ["RUNNING"],
                     "state_reason": "Prolog", "nodes": NODE, "restart_cnt": 0,
                     "exit_code": {"status": ["SUCCESS"], "return_code": 0,
                                   "signal": {"id": 0, "name": ""}},
                     "start_time": {"set": True, "infinite": False, "number": T_JOB}}],
           "errors": []}
    job = parse_jobs(json.dumps(doc))[1]
    assert (job.start_time, job.nodes, job.reason) == (T_JOB, NODE, "Prolog")
    assert [s.job_id for s in sp.decide([job], T_SLURMD, T_SLURMD + 120, 120)] == [1]
    node = {"nodes": [{"name": "other", "slurmd_start_time": {"set": True, "number": 5}},
                      {"name": NODE, "boot_time": {"set": True, "number": 1},
                       "slurmd_start_time": {"set": True, "infinite": False,
                                             "number": T_SLURMD}}], "errors": []}
    assert parse_slurmd_start(json.dumps(node), NODE) == T_SLURMD
    assert parse_slurmd_start(json.dumps({"nodes": [], "errors": []}), NODE) is None
    with pytest.raises(SlurmError):
        parse_slurmd_start(json.dumps({"nodes": [], "errors": [{"error": "x"}]}), NODE)
    with pytest.raises(SlurmError):
        parse_slurmd_start("Unable to contact slurm controller", NODE)


# ------------------------------------------------------------------ the trigger
def fake_proc(tmp: Path, procs: dict[int, tuple[str, int, int]], btime: int = 1000) -> str:
    """``/proc`` with ``pid: (comm, real uid, start ticks)``."""
    proc = tmp / "proc"
    proc.mkdir()
    (proc / "stat").write_text(f"cpu 1 2 3\nbtime {btime}\n")
    for pid, (comm, uid, ticks) in procs.items():
        d = proc / str(pid)
        d.mkdir()
        (d / "comm").write_text(comm + "\n")
        (d / "status").write_text(f"Name:\t{comm}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
        rest = " ".join(["S", "1"] + ["0"] * 17 + [str(ticks)] + ["0"] * 20)
        (d / "stat").write_text(f"{pid} ({comm}) {rest}\n")
    return str(proc)


def test_slurmds_start_is_read_from_roots_processes_only(tmp_path: Path) -> None:
    hz = os.sysconf("SC_CLK_TCK")
    proc = fake_proc(tmp_path, {10: ("slurmd", 0, 50 * hz), 11: ("slurmd", 1000, 90 * hz),
                                12: ("slurmstepd", 0, 80 * hz), 13: ("bash", 0, 95 * hz)})
    assert slurmd_watch.slurmd_starts(proc) == [1050]  # a user's "slurmd" (uid 1000) moves nothing
    if os.geteuid() == 0:  # a process whose /proc entry is not root's is not root's
        os.chown(Path(proc) / "10", 1000, 1000)
        assert slurmd_watch.slurmd_starts(proc) == []
    assert slurmd_watch.slurmd_starts(str(tmp_path / "none")) == []


def test_the_trigger_starts_a_round_only_in_the_minutes_after_a_slurmd_restart(
        tmp_path: Path) -> None:
    cfg = cfg_of(tmp_path)
    started: list[tuple[str, tuple[str, ...]]] = []

    def spawner(module: str, args: tuple[str, ...], env: dict[str, str]) -> None:
        started.append((module, args))

    def kick(*ages: float) -> bool:
        now = 10_000.0
        return slurmd_watch.kick(cfg, {"SLURMD_NODENAME": NODE}, now=now, spawner=spawner,
                       starts=lambda: [now - a for a in ages], last=[float("-inf")])

    assert not kick() and not kick(60) and not kick(cfg.stuck_prolog_grace_s - 1)
    assert kick(cfg.stuck_prolog_grace_s) and kick(cfg.stuck_prolog_grace_s + slurmd_watch.WINDOW_S)
    assert not kick(cfg.stuck_prolog_grace_s + slurmd_watch.WINDOW_S + 1)
    assert not kick(86400)
    # several slurmds on one host (a test host's nodes): one restarted later hides none
    assert kick(cfg.stuck_prolog_grace_s + 30, 5)
    assert started == [(slurmd_watch.MODULE, ())] * 3


def test_one_collector_starts_a_round_at_most_once_a_minute(tmp_path: Path) -> None:
    cfg = cfg_of(tmp_path)
    started: list[str] = []
    last = [float("-inf")]
    for _ in range(3):
        slurmd_watch.kick(cfg, {}, now=10_000.0, spawner=lambda m, a, e: started.append(m),
                starts=lambda: [10_000.0 - cfg.stuck_prolog_grace_s - 1], last=last)
    assert started == [slurmd_watch.MODULE]
    last[0] -= slurmd_watch.ROUND_EVERY_S
    assert slurmd_watch.kick(cfg, {}, now=10_000.0, spawner=lambda m, a, e: started.append(m),
                   starts=lambda: [10_000.0 - cfg.stuck_prolog_grace_s - 1], last=last)


def test_the_runner_asks_slurm_nothing_outside_the_window(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = cfg_of(tmp_path)
    monkeypatch.setattr(cfgmod, "load", lambda *a, **k: cfg)
    monkeypatch.setattr(sp, "slurmd_starts", lambda: [time.time() - 86400])
    asked: list[Any] = []
    monkeypatch.setattr(sp, "run", lambda *a, **k: asked.append(a))
    assert sp.main([]) == 0 and asked == []
    assert sp.main(["--force"]) == 0 and len(asked) == 1
    assert asked[0][2] == sp.node_name(os.environ)


def test_the_node_name_is_slurmds() -> None:
    assert sp.node_name({"SLURMD_NODENAME": "gpu17"}) == "gpu17"
    assert sp.node_name({}) == os.uname().nodename.split(".")[0]


def test_the_collector_looks_every_few_seconds_without_asking_slurm(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    cfg = cfg_of(tmp_path)
    chores: list[str] = []

    class C:
        def _guarded(self, where: str, fn: Any) -> None:
            chores.append(where)
            if where == "stuck prologs":
                fn()

    kicks: list[Any] = []
    monkeypatch.setattr(slurmd_watch, "kick", lambda c, env: kicks.append(c))
    due: dict[str, float] = {}
    collector._chores(cfg, C(), due)  # type: ignore[arg-type]
    collector._chores(cfg, C(), due)  # type: ignore[arg-type]
    assert chores.count("stuck prologs") == 1 and kicks == [cfg]
    assert due["stuck-prologs"] > time.monotonic() + slurmd_watch.LOOK_EVERY_S - 1


def test_the_grace_is_a_checked_config_value() -> None:
    assert CollocConfig().stuck_prolog_grace_s == 120.0
    assert from_mapping({"stuck_prolog_grace_s": 30}).stuck_prolog_grace_s == 30
    for bad in (0.0, 5.0, 7200.0):
        with pytest.raises(ConfigError):
            from_mapping({"stuck_prolog_grace_s": bad})


def test_a_round_slurm_does_not_answer_is_logged_with_the_node_it_asked_about(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = cfg_of(tmp_path)
    monkeypatch.setattr(cfgmod, "load", lambda *a, **k: cfg)
    monkeypatch.setenv("SLURMD_NODENAME", "gpu17")

    def run(*a: Any, **k: Any) -> None:
        raise SlurmError("scontrol: error: Node gpu17 not found")

    monkeypatch.setattr(sp, "run", run)
    assert sp.main(["--force"]) == 0
    log = Path(cfg.log_file).read_text()
    assert "Slurm gave no answer about node gpu17" in log and "not found" in log
