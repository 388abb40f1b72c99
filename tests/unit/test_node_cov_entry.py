"""The node scripts' bodies (slurm_colloc.node.entry) with a fake Slurm adapter: the
configuration, the environment slurmd gives (no PATH, SLURM_* only), identity checks,
the order of the epilog's steps, and the exit status 0 whatever goes wrong."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from slurm_colloc.mps.tenancy import Tenancy
from slurm_colloc.node import entry, epilog, prolog, task_entry
from slurm_colloc.node import job as jobmod
from slurm_colloc.node.prolog import PrologDecision
from slurm_colloc.slurm.squeue_json import parse_jobs

from .slurm_shapes import v42_job

REC = "colloc1:mode=explicit,need_mib=2048,shards=2,shard_mib=1024,alloc_mib=2048"
ENV = {"SLURM_JOB_ID": "7", "SLURM_JOB_UID": "1001", "SLURM_JOB_GPUS": "0",
       "SLURM_JOB_USER": "alice", "SLURMD_NODENAME": "n1"}


def squeue_job(**over: Any) -> dict[str, Any]:
    job: dict[str, Any] = {
        "job_id": 7, "user_id": 1001, "user_name": "alice", "name": "train",
        "job_state": "RUNNING", "restart_cnt": 0, "tres_per_node": "gres/shard:2",
        "tres_per_job": "", "tres_per_task": "", "tres_per_socket": "",
        "gres_detail": ["shard:2(IDX:0)"], "admin_comment": REC, "comment": "",
        "standard_output": "/home/alice/%j.out", "standard_error": "",
        "current_working_directory": "/home/alice", "batch_host": "n1", "exit_code": 0,
    }
    job.update(over)
    return v42_job(job)  # data_parser v0.0.42's shapes (24.11 through 26.05)


class FakeSlurm:
    """A duck-typed SlurmAdapter that answers ``jobs()`` from squeue JSON and records."""

    def __init__(self, *jobs: dict[str, Any], fail: Exception | None = None) -> None:
        self._jobs = parse_jobs(json.dumps({"jobs": list(jobs)}))
        self.fail = fail
        self.calls: list[str] = []

    def jobs(self) -> dict[int, Any]:
        self.calls.append("jobs")
        if self.fail:
            raise self.fail
        return self._jobs

    def jobs_among(self, job_ids: Any) -> dict[int, Any]:
        """The prolog's query: only the jobs it judges (issue 28)."""
        self.calls.append("jobs_among")
        self.asked = sorted(job_ids)
        if self.fail:
            raise self.fail
        return {j: v for j, v in self._jobs.items() if j in set(job_ids)}

    def job(self, job_id: int) -> Any:
        """The per-job query (scontrol --json show job) the epilog falls back to."""
        self.calls.append("job")
        if self.fail:
            raise self.fail
        return self._jobs.get(int(job_id))

    def __getattr__(self, name: str) -> Any:
        def record(*a: Any, **k: Any) -> None:
            self.calls.append(name)

        return record


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A config file in $COLLOC_CONF, fresh node loggers, and a FakeSlurm as adapter."""
    root = tmp_path

    def write_conf(extra: dict[str, str] | None = None, text: str | None = None) -> None:
        body = text if text is not None else (
            f'mps_root = "{root / "mps"}"\nlog_file = "{root / "colloc.log"}"\n'
            f'evidence_dir = "{root / "ev"}"\nmetrics_dir = "{root / "metrics"}"\n'
            'gpu_backend = "sim"\n'
            f'sim_state_dir = "{root / "sim"}"\n'
        )
        if extra:
            body += "[extra]\n" + "".join(f'{k} = "{v}"\n' for k, v in extra.items())
        (root / "colloc.conf").write_text(body)

    write_conf()
    monkeypatch.setenv("COLLOC_CONF", str(root / "colloc.conf"))
    fake = {"slurm": FakeSlurm(squeue_job())}
    monkeypatch.setattr(entry, "_slurm", lambda env, timeout=20: fake["slurm"])

    def reset() -> None:
        for c in ("prolog", "epilog"):
            lg = logging.getLogger(f"colloc.node.{c}")
            for h in list(lg.handlers):
                lg.removeHandler(h)
                h.close()

    reset()

    class Node:
        conf = staticmethod(write_conf)
        mps = root / "mps"

        @staticmethod
        def log() -> str:
            p = root / "colloc.log"
            return p.read_text() if p.exists() else ""

        @staticmethod
        def use(slurm: FakeSlurm) -> FakeSlurm:
            fake["slurm"] = slurm
            return slurm

        @property
        def slurm(self) -> FakeSlurm:
            return fake["slurm"]

    yield Node()
    reset()


# ----------------------------------------------------------------- prolog ---


def test_prolog_without_gpu_asks_slurm_nothing(node) -> None:
    env = {k: v for k, v in ENV.items() if k != "SLURM_JOB_GPUS"}
    assert entry.prolog_main(env) == 0
    assert node.slurm.calls == []
    assert "prolog: job 7: none gpu=None no GPU bound by slurmd" in node.log()
    # the epilog will find the context and not ask the controller either
    saved = Tenancy(node.mps).read_job_context(7)
    assert saved is not None and json.loads(saved)["uid"] == 1001


def test_prolog_one_snapshot_and_logs_the_decision(node, monkeypatch) -> None:
    seen: dict[str, Any] = {}

    def fake_run(ctx, cfg, adapter, jobs, taken) -> PrologDecision:  # type: ignore[no-untyped-def]
        seen.update(ctx=ctx, jobs=jobs, taken=taken, adapter=adapter)
        return PrologDecision("shared", gpu=0, limit_mib=2048, detail="mps up")

    monkeypatch.setattr(prolog, "run", fake_run)
    assert entry.prolog_main(dict(ENV)) == 0
    assert node.slurm.calls == ["jobs_among"]  # one controller call, reused for reaping
    assert node.slurm.asked == [7]  # its own job: nothing registered on its GPU
    assert seen["ctx"].job_id == 7 and seen["ctx"].shards == 2 and seen["ctx"].gpus == (0,)
    assert list(seen["jobs"]) == [7] and seen["taken"] > 0
    assert "prolog: job 7: shared gpu=0 limit_mib=2048 mps up" in node.log()


def test_prolog_refuses_a_controller_record_for_another_uid(node, monkeypatch) -> None:
    """slurmd's SLURM_JOB_UID is the identity: a record naming uid 0 is refused."""
    node.use(FakeSlurm(squeue_job(user_id=0)))
    monkeypatch.setattr(prolog, "run", lambda *a: pytest.fail("prolog.run with a bad identity"))
    assert entry.prolog_main(dict(ENV)) == 0
    log = node.log()
    assert "internal error, job runs without MPS: JobInfoError" in log and "uid" in log


@pytest.mark.parametrize(
    "env",
    [{**ENV, "SLURM_JOB_UID": ""}, {**ENV, "SLURM_JOB_ID": "x"},
     {k: v for k, v in ENV.items() if k != "SLURM_JOB_UID"}, {**ENV, "SLURM_JOB_ID": "0"}],
    ids=["empty-uid", "bad-id", "no-uid", "zero-id"],
)
def test_prolog_malformed_slurmd_env_is_logged_not_raised(node, monkeypatch, env) -> None:
    monkeypatch.setattr(prolog, "run", lambda *a: pytest.fail("must not run"))
    assert entry.prolog_main(env) == 0
    assert "internal error, job runs without MPS: JobInfoError: SLURM_JOB_ID/SLURM_JOB_UID" in (
        node.log())


def test_prolog_controller_down_exits_0(node, monkeypatch) -> None:
    from slurm_colloc.slurm.adapter import SlurmError

    class Clock:  # the prolog's budget on a fake clock (issue 28 item 3)
        now = 0.0

        def monotonic(self) -> float:
            return self.now

        def sleep(self, s: float) -> None:
            self.now += s

    from slurm_colloc.node import controller_wait

    monkeypatch.setattr(controller_wait, "time", Clock())
    node.use(FakeSlurm(fail=SlurmError("squeue: Unable to contact slurm controller")))
    assert entry.prolog_main(dict(ENV)) == 0
    log = node.log()
    assert "did not answer in 13s" in log and "squeue: Unable to contact" in log  # budget 15 s


def test_prolog_broken_config_does_nothing(node, caplog) -> None:
    node.conf(text="mps_root = [not toml")
    assert entry.prolog_main(dict(ENV)) == 0
    assert node.slurm.calls == []
    assert "prolog: job 7: broken configuration, doing nothing: " in caplog.text


def test_prolog_unknown_key_in_config_is_a_broken_config(node, caplog) -> None:
    node.conf(text='no_such_key = 1\n')
    assert entry.prolog_main(dict(ENV)) == 0
    assert node.slurm.calls == []
    assert "broken configuration" in caplog.text and "no_such_key" in caplog.text


@pytest.mark.parametrize("component", ["prolog", "epilog"])
def test_injected_fault_is_logged_and_exits_0(node, component) -> None:
    node.conf(extra={entry.FAULT_KEY: f"task_prolog,{component}"})
    main = entry.prolog_main if component == "prolog" else entry.epilog_main
    assert main(dict(ENV)) == 0
    assert node.slurm.calls == []
    assert f"{component}: job 7: internal error" in node.log()
    assert "InjectedFault" in node.log()


def test_fault_for_another_script_is_ignored(node, monkeypatch) -> None:
    node.conf(extra={entry.FAULT_KEY: "epilog"})
    monkeypatch.setattr(prolog, "run", lambda *a: PrologDecision("exclusive", gpu=0))
    assert entry.prolog_main(dict(ENV)) == 0
    assert "exclusive gpu=0" in node.log() and "InjectedFault" not in node.log()


def test_slurm_tools_get_a_fixed_path_and_only_the_config_variables() -> None:
    """slurmd gives node scripts no PATH; the user's LD_*/PYTHON* never reach the tools."""
    cli = entry._slurm({"SLURM_CONF": "/etc/slurm/x.conf", "COLLOC_CONF": "/etc/c.conf",
                        "LD_PRELOAD": "/tmp/x.so", "PATH": "/home/u/bin",
                        "SLURM_JOB_ID": "7"})
    assert cli._env == {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
                        "SLURM_CONF": "/etc/slurm/x.conf", "COLLOC_CONF": "/etc/c.conf"}
    assert cli._timeout == 20


# -------------------------------------------------------------- task prolog ---


def test_task_prolog_prints_exports(node, capsys) -> None:
    t = Tenancy(node.mps)
    t.write_job_env(7, {"CUDA_MPS_PIPE_DIRECTORY": "/run/mps/0/1001",
                        "COLLOC_LIMIT_MIB": "2048", "LD_PRELOAD": "/evil.so"})
    assert task_entry.task_prolog_main({"SLURM_JOB_ID": "7"}) == 0
    out = capsys.readouterr().out.splitlines()
    assert "export CUDA_MPS_PIPE_DIRECTORY=/run/mps/0/1001" in out
    assert "export COLLOC_LIMIT_MIB=2048" in out
    assert not any("LD_PRELOAD" in ln for ln in out)  # only the allowed keys
    assert all(ln.startswith(("export ", "print ", "unset ")) for ln in out)


def test_task_prolog_nothing_prepared_prints_nothing(node, capsys) -> None:
    assert task_entry.task_prolog_main({"SLURM_JOB_ID": "7"}) == 0
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(
    ("env", "extra", "text"),
    [({}, None, "SLURM_JOB_ID"), ({"SLURM_JOB_ID": "x7"}, None, "invalid literal"),
     ({"SLURM_JOB_ID": "7"}, {entry.FAULT_KEY: "task_prolog"}, "injected fault")],
    ids=["no-job-id", "bad-job-id", "fault"],
)
def test_task_prolog_errors_become_one_print_line(node, capsys, env, extra, text) -> None:
    if extra:
        node.conf(extra=extra)
    assert task_entry.task_prolog_main(env) == 0
    out = capsys.readouterr().out
    assert out.startswith("print colloc: task prolog: internal error, no MPS settings: ")
    assert text in out and out.count("\n") == 1


def test_task_prolog_broken_config(node, capsys) -> None:
    node.conf(text="[[[")
    assert task_entry.task_prolog_main({"SLURM_JOB_ID": "7"}) == 0
    assert capsys.readouterr().out.startswith("print colloc: task prolog: internal error")


# ------------------------------------------------------------------ epilog ---


def _save_context(node, **over: Any) -> None:
    ctx = jobmod.JobContext(
        job_id=7, uid=1001, user="alice", node="n1", gpus=(0,), shards=2, gpu_count=0,
        stdout="/home/alice/7.out", stderr=None, restarts=0, admin_comment=REC,
        exit_code="", state="RUNNING",
    )
    d = {**json.loads(jobmod.context_to_json(ctx)), **over}
    Tenancy(node.mps).write_job_context(7, json.dumps(d))


@pytest.fixture
def epilog_steps(monkeypatch):
    """Record the epilog's steps; the real library is exercised elsewhere."""
    steps: list[Any] = []

    def release_first(job_id, cfg):  # type: ignore[no-untyped-def]
        steps.append(("release", job_id))
        return epilog.EpilogResult(job_id)

    def run(ctx, cfg, adapter, log, released):  # type: ignore[no-untyped-def]
        steps.append(("run", ctx))
        released.cause = "gpu-oom"
        return released

    monkeypatch.setattr(epilog, "release_first", release_first)
    monkeypatch.setattr(epilog, "run", run)
    return steps


def test_epilog_uses_saved_context_without_the_controller(node, epilog_steps) -> None:
    _save_context(node)
    env = {**ENV, "SLURM_JOB_EXIT_CODE2": "1:0"}
    assert entry.epilog_main(env) == 0
    assert node.slurm.calls == []
    assert [s[0] for s in epilog_steps] == ["release", "run"]
    ctx = epilog_steps[1][1]
    assert ctx.exit_code == "1:0" and ctx.stdout == "/home/alice/7.out"
    assert "epilog: job 7: cause=gpu-oom" in node.log()
    # the saved context is used once: a second epilog would ask the controller
    assert Tenancy(node.mps).read_job_context(7) is None


def test_epilog_falls_back_to_the_controller(node, epilog_steps) -> None:
    assert entry.epilog_main(dict(ENV)) == 0
    assert node.slurm.calls == ["job"]  # this one job, not the whole queue
    assert [s[0] for s in epilog_steps] == ["release", "run"]
    assert epilog_steps[1][1].shards == 2


def test_epilog_releases_mps_before_the_controller_fails(node, epilog_steps) -> None:
    from slurm_colloc.slurm.adapter import SlurmError

    node.use(FakeSlurm(fail=SlurmError("slurmctld down")))
    assert entry.epilog_main(dict(ENV)) == 0
    assert [s[0] for s in epilog_steps] == ["release"]
    assert "internal error, nothing requeued: SlurmError: slurmctld down" in node.log()


@pytest.mark.parametrize(
    ("over", "env"),
    [({"uid": 0}, ENV), ({"job_id": 8}, ENV), ({"gpus": [1]}, ENV),
     ({}, {**ENV, "SLURM_JOB_GPUS": "3"}), ({"uid": "x"}, ENV)],
    ids=["uid", "job", "gpu", "env-gpu", "garbage"],
)
def test_epilog_refuses_a_saved_context_of_another_identity(node, epilog_steps, over,
                                                            env) -> None:
    """The saved context must match slurmd's SLURM_JOB_ID/UID/GPUS: else nothing is done
    with it (no scan as another user, no requeue) and the status is still 0."""
    _save_context(node, **over)
    assert entry.epilog_main(dict(env)) == 0
    assert [s[0] for s in epilog_steps] == ["release"]
    assert "internal error, nothing requeued: JobInfoError" in node.log()
    assert node.slurm.calls == []


def test_epilog_context_reads_and_forgets(node) -> None:
    from slurm_colloc import config as cfgmod

    _save_context(node)
    cfg = cfgmod.load()
    ctx = entry.epilog_context(dict(ENV), cfg, node.slurm)
    assert ctx.job_id == 7 and ctx.uid == 1001
    with pytest.raises(jobmod.JobInfoError, match="not known to the controller"):
        entry.epilog_context(dict(ENV), cfg, FakeSlurm())


def test_unusable_log_file_does_not_stop_a_node_script(tmp_path: Path) -> None:
    """``log_file`` under a regular file (or on a read-only mount): a warning, then the
    script logs to stderr only; node_logger never raises."""
    from slurm_colloc.node.logging_setup import node_logger

    class Keep(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    blocker = tmp_path / "file"
    blocker.write_text("")
    lg = logging.getLogger("colloc.node.cov-test")
    keep = Keep()
    lg.addHandler(keep)
    lg.setLevel(logging.INFO)
    try:
        log = node_logger("cov-test", 9, str(blocker / "sub" / "colloc.log"))
        log.info("still logging")
        assert not any(isinstance(h, logging.FileHandler) for h in lg.handlers)
        assert keep.lines[0].startswith(f"cannot open log file {blocker}/sub/colloc.log: ")
        assert keep.lines[1] == "cov-test: job 9: still logging"
    finally:
        for h in list(lg.handlers):
            lg.removeHandler(h)
            h.close()
