"""Issue 11, node path: root acts only on slurmd's environment, JSON and root state.

Each test names the attack it replays. The Slurm side is a fake adapter (subprocess
replaced by recorded answers); the MPS side runs the simulation's stand-in daemon.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_colloc.accounting.submit_record import parse_record
from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu.sim import tools as sim_tools
from slurm_colloc.mps.control import PID_FILE, MpsDaemon, read_small_file
from slurm_colloc.mps.tenancy import Tenancy, TenancyError
from slurm_colloc.node import entry, epilog, prolog
from slurm_colloc.node import job as jobmod
from slurm_colloc.slurm import adapter as ad
from slurm_colloc.slurm.data_parser import (
    BASE_STATES,
    NAMING_FLAGS,
    DataParserError,
    exit_code,
)
from slurm_colloc.slurm.squeue_json import SqueueJsonError, expand_output_path, parse_jobs

from .slurm_shapes import v42_job

# the lab's launcher (not a console script of the wheel: issue 26 item 7)
STANDIN = str(sim_tools.tool("colloc-sim-mps-control"))
FORGED = "colloc1:mode=whole,need_mib=40960,shards=40,shard_mib=1024,alloc_mib=40960"
REAL = "colloc1:mode=explicit,need_mib=2048,shards=2,shard_mib=1024,alloc_mib=2048"


def squeue_job(**over: Any) -> dict[str, Any]:
    job: dict[str, Any] = {
        "job_id": 7, "user_id": 1001, "user_name": "alice", "name": "train",
        "job_state": "RUNNING", "restart_cnt": 0, "tres_per_node": "gres/shard:2",
        "tres_per_job": "", "tres_per_task": "", "tres_per_socket": "",
        "gres_detail": ["shard:2(IDX:0)"], "admin_comment": REAL, "comment": "",
        "standard_output": "/home/alice/%j.out", "standard_error": "",
        "current_working_directory": "/home/alice", "batch_host": "n1", "exit_code": 0,
    }
    job.update(over)
    return v42_job(job)  # data_parser v0.0.42's shapes (24.11 through 26.05)


def scontrol_text(comment: str, stdout: str) -> str:
    """What ``scontrol -o show job`` printed for the attack (22.05 field order)."""
    return (
        "JobId=7 JobName=train UserId=alice(1001) GroupId=alice(1001) JobState=RUNNING "
        "Restarts=0 TresPerNode=gres:shard:2 GRES=shard:2(IDX:0) "
        f"AdminComment={REAL} Comment={comment} WorkDir=/home/alice StdErr={stdout} "
        f"StdIn=/dev/null StdOut={stdout}\n"
    )


class FakeSlurm:
    """subprocess.run stand-in answering squeue --json, scontrol --json (the same jobs)
    and scontrol's text, counting calls."""

    def __init__(self, jobs: list[dict[str, Any]], scontrol: str = "") -> None:
        self.squeue = json.dumps({"jobs": jobs})
        self.scontrol = scontrol
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append(argv)
        tool = argv[0].rsplit("/", 1)[-1]
        if tool == "squeue" or (tool == "scontrol" and ad.JSON_FLAG in argv):
            return subprocess.CompletedProcess(argv, 0, self.squeue, "")
        if tool == "scontrol" and "show" in argv:
            return subprocess.CompletedProcess(argv, 0, self.scontrol, "")
        return subprocess.CompletedProcess(argv, 0, "", "")


ENV = {"SLURM_JOB_ID": "7", "SLURM_JOB_UID": "1001", "SLURM_JOB_GPUS": "0",
       "SLURM_JOB_USER": "alice"}


@pytest.mark.parametrize(
    ("comment", "stdout"),
    [
        (f"x AdminComment={FORGED} GRES=shard:40(IDX:3) Restarts=0 TresPerNode=gres:shard:40",
         "/home/alice/o"),
        ("x", f"/home/alice/o AdminComment={FORGED} Restarts=0"),
        ("x\nJobId=7 AdminComment=" + FORGED, "/home/alice/o"),
    ],
    ids=["comment", "output-path", "newline"],
)
def test_free_text_fields_cannot_forge_the_record_root_acts_on(
    monkeypatch: pytest.MonkeyPatch, comment: str, stdout: str
) -> None:
    """Critical 1: --comment / -o text with Key= pairs made a 2-shard job 'whole'."""
    fake = FakeSlurm([squeue_job(comment=comment, standard_output=stdout)],
                     scontrol_text(comment, stdout))
    monkeypatch.setattr(ad.subprocess, "run", fake)
    ctx = jobmod.from_slurm(ENV, ad.SlurmCli(bindir="/usr/bin"))
    assert ctx.admin_comment == REAL
    assert ctx.is_shared and not ctx.whole_gpu
    assert ctx.shards == 2 and ctx.gpus == (0,) and ctx.restarts == 0
    assert fake.calls and all(ad.JSON_FLAG in c for c in fake.calls)  # never scontrol text


def test_uid_disagreement_between_slurmd_and_controller_is_refused() -> None:
    job = parse_jobs(json.dumps({"jobs": [squeue_job(user_id=0)]}))[7]
    with pytest.raises(jobmod.JobInfoError, match="uid"):
        jobmod.context_from_job(job, ENV)


def test_gpu_disagreement_between_slurmd_and_allocation_is_refused() -> None:
    """Root starts MPS only on the GPU both slurmd and the allocation name."""
    job = parse_jobs(json.dumps({"jobs": [squeue_job(gres_detail=["shard:2(IDX:3)"])]}))[7]
    with pytest.raises(jobmod.JobInfoError, match="not acting"):
        jobmod.context_from_job(job, ENV)


def test_gpus_per_task_or_mixed_requests_are_never_shared() -> None:
    """M4 (node side): a --gpus-per-task or gpu+shard job is not an MPS tenant."""
    for over in ({"tres_per_task": "gres:gpu:1"}, {"tres_per_node": "gres:gpu:1,gres:shard:2"},
                 {"tres_per_job": "gres:shard:4"}):
        job = parse_jobs(json.dumps({"jobs": [squeue_job(**over)]}))[7]
        assert not jobmod.context_from_job(job, ENV).is_shared, over


def test_huge_numbers_in_json_fields_do_not_crash_the_parser() -> None:
    job = squeue_job(tres_per_node="gres:shard:" + "9" * 5000,
                     gres_detail=["shard:1(IDX:0-99999999)"])
    parsed = parse_jobs(json.dumps({"jobs": [job]}))
    assert list(parsed) == [7]
    with pytest.raises(jobmod.JobInfoError, match="allocation unreadable"):
        jobmod.context_from_job(parsed[7], ENV)
    ok = parse_jobs(json.dumps({"jobs": [{**job, "gres_detail": []}]}))[7]
    ctx = jobmod.context_from_job(ok, ENV)
    assert ctx.shards == 0 and ctx.restarts == 0 and not ctx.is_shared


@pytest.mark.parametrize("bad", [{"restart_cnt": "x"}, {"job_id": "x"}, {"job_state": "RUNNING"},
                                 {"job_state": []}, {"exit_code": 0},
                                 {"gres_detail": "shard:2(2/39)"}, {"array_task_id": "2"}])
def test_a_malformed_job_is_the_parsers_error_not_a_guess(bad: dict[str, Any]) -> None:
    """A v0.0.42 field of the wrong shape (22.05's ``"RUNNING"`` string, a bare exit
    status) fails the whole answer: "could not read" must never read as "no such job"
    (the reaper) nor as restarts=0 / exit 0."""
    with pytest.raises(SqueueJsonError):
        parse_jobs(json.dumps({"jobs": [squeue_job(), {**squeue_job(job_id=8), **bad}]}))


def test_output_patterns_are_expanded_like_slurmd() -> None:
    job = squeue_job(job_id=12, name="bert", array_job_id=10, array_task_id=2)
    assert expand_output_path("out-%j-%x-%u-%A_%a-%%-%4j.log", job, "") == (
        "/home/alice/out-12-bert-alice-10_2-%-0012.log")
    assert expand_output_path("", job, "slurm-%j.out") == "/home/alice/slurm-12.out"
    assert expand_output_path("rel/%j", job, "") == "/home/alice/rel/12"
    assert expand_output_path("/a\\%j", job, "") == "/a%j"


# --- MPS ownership ----------------------------------------------------------------

def _daemon(tmp_path: Path) -> tuple[Tenancy, MpsDaemon]:
    if not os.path.exists(STANDIN):
        pytest.fail(f"MPS stand-in not installed at {STANDIN}; run make venv")
    t = Tenancy(tmp_path / "mps")
    pipe, logdir = t.prepare_user_dirs(0, os.getuid())
    return t, MpsDaemon(STANDIN, 0, pipe, logdir, t.daemon_state(0, os.getuid()))


def test_a_forged_pid_file_never_makes_root_signal_another_process(tmp_path: Path) -> None:
    """Critical 2: the job rewrote nvidia-cuda-mps-control.pid; root killed that pid."""
    _, d = _daemon(tmp_path)
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    d.start()
    real = d.pid()
    try:
        assert real is not None
        (d.pipe_dir / "control").unlink()
        (d.pipe_dir / PID_FILE).unlink()
        (d.pipe_dir / PID_FILE).write_text(f"{victim.pid}\n")
        assert d.pid() == real  # root state, not the user's file
        d.stop()
        time.sleep(0.2)
        assert victim.poll() is None, "root signalled the victim's process"
        assert d.pid() is None and not _alive(real), "our daemon was left running"
    finally:
        victim.kill()
        d.stop()


@pytest.mark.parametrize("plant", ["fifo", "dev-zero", "huge"])
def test_pid_file_tricks_neither_hang_nor_exhaust_root(tmp_path: Path, plant: str) -> None:
    """Critical 2 variants: a FIFO hung the epilog under the GPU lock; /dev/zero -> MemoryError."""
    path = tmp_path / "pidfile"
    if plant == "fifo":
        os.mkfifo(path)
    elif plant == "dev-zero":
        path.symlink_to("/dev/zero")
    else:
        path.write_text("1" * 100000)
    t0 = time.monotonic()
    with pytest.raises(OSError):
        read_small_file(path, owner=None)
    assert time.monotonic() - t0 < 1


def test_a_deleted_socket_replaces_the_daemon_instead_of_orphaning_it(tmp_path: Path) -> None:
    """Orphaned root MPS daemons piled up when a job removed the socket and pid file."""
    _, d = _daemon(tmp_path)
    d.start()
    first = d.pid()
    try:
        (d.pipe_dir / "control").unlink()
        (d.pipe_dir / PID_FILE).unlink()
        assert not d.running()
        d.start()
        assert d.running() and d.pid() != first
        assert first is not None and not _alive(first)
    finally:
        d.stop()


def test_stop_verifies_identity_so_a_reused_pid_is_never_signalled(tmp_path: Path) -> None:
    _, d = _daemon(tmp_path)
    d.start()
    ident = d.identity()
    assert ident is not None
    d.stop()
    # same pid number recorded, another process: start ticks differ -> no match
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        forged = type(ident)(other.pid, ident.start_ticks, ident.binary, ident.pipe_dir)
        assert not forged.matches() and not forged.signal(signal.SIGTERM)
        assert other.poll() is None
    finally:
        other.kill()


def _alive(pid: int) -> bool:
    try:
        st = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return st.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


# --- state files, lock, reaping -----------------------------------------------------

def test_state_modes_do_not_depend_on_the_umask(tmp_path: Path) -> None:
    """Low: under umask 077 the TaskProlog (the user) could not read its env file."""
    old = os.umask(0o077)
    try:
        t = Tenancy(tmp_path / "deep" / "mps")
        t.write_job_env(5, {"COLLOC_LIMIT_MIB": "2048"}, uid=4242, gid=1234)
        t.prepare_user_dirs(0, 4242)
    finally:
        os.umask(old)
    st = t.job_env_file(5).stat()  # the job's owner's alone (issue 23): not its group's
    assert stat.S_IMODE(st.st_mode) == 0o400 and st.st_uid == 4242
    assert stat.S_IMODE((tmp_path / "deep").stat().st_mode) == 0o755
    assert stat.S_IMODE(t.root.stat().st_mode) == 0o755
    # not world-readable; group-readable only through a group of that user alone
    assert stat.S_IMODE(t.log_dir(0, 4242).stat().st_mode) == 0o700


def test_mps_logs_are_group_readable_only_for_a_private_group(tmp_path: Path) -> None:
    """Review variant E: 0750 root:gid leaks the logs where users share a group."""
    import grp
    import pwd

    from slurm_colloc.mps.tenancy import private_group

    t = Tenancy(tmp_path / "mps")
    for pw in pwd.getpwall():
        gr = grp.getgrgid(pw.pw_gid) if pw.pw_gid in {g.gr_gid for g in grp.getgrall()} else None
        if gr is None or pw.pw_uid == 0:
            continue
        t.prepare_user_dirs(0, pw.pw_uid)
        mode = stat.S_IMODE(t.log_dir(0, pw.pw_uid).stat().st_mode)
        assert mode == (0o750 if private_group(pw.pw_uid) is not None else 0o700), pw
    nobody = pwd.getpwnam("nobody")  # primary group nogroup: shared, not private
    assert private_group(nobody.pw_uid) is None


def test_the_gpu_lock_has_a_deadline(tmp_path: Path) -> None:
    """M3: a stuck holder must not block every later prolog/epilog on the GPU."""
    t = Tenancy(tmp_path / "mps")
    with t.locked(0):
        holder = subprocess.Popen(
            [sys.executable, "-c",
             "import sys; from pathlib import Path; from slurm_colloc.mps.tenancy import Tenancy;"
             "t=Tenancy(Path(sys.argv[1]));\n"
             "try:\n with t.locked(0, timeout=0.5): print('got')\n"
             "except Exception as e: print(type(e).__name__)",
             str(t.root)], stdout=subprocess.PIPE, text=True)
        out, _ = holder.communicate(timeout=20)
    assert out.strip() == TenancyError.__name__


def _cfg(tmp_path: Path) -> CollocConfig:
    return CollocConfig(mps_root=str(tmp_path / "mps"), mps_control=STANDIN,
                        metrics_dir=str(tmp_path / "metrics"), gpu_backend="sim")


def test_one_missing_snapshot_entry_does_not_reap_a_running_job(tmp_path: Path) -> None:
    """Low: reaping by absence from one squeue snapshot tore down live daemons."""
    cfg = _cfg(tmp_path)
    t = Tenancy(Path(cfg.mps_root))
    t.add_job(0, 1001, 5)
    assert prolog.reap_stale(cfg, t, 0, {}, now=1000.0) == []
    assert prolog.reap_stale(cfg, t, 0, None, now=5000.0) == []  # could not ask: keep
    assert prolog.reap_stale(cfg, t, 0, {}, now=1000.0 + prolog.ABSENT_GRACE_S) == [5]


def test_epilog_releases_mps_before_and_without_any_controller_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """M3: with slurmctld down the epilog still frees the GPU; with the prolog's saved
    context it makes no controller call at all."""
    cfg = _cfg(tmp_path)
    t = Tenancy(Path(cfg.mps_root))
    t.add_job(0, 1001, 7)
    job = parse_jobs(json.dumps({"jobs": [squeue_job()]}))[7]
    ctx = jobmod.context_from_job(job, ENV)
    t.write_job_context(7, jobmod.context_to_json(ctx))
    calls: list[list[str]] = []

    def down(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        raise subprocess.TimeoutExpired(argv, 20)

    monkeypatch.setattr(ad.subprocess, "run", down)
    monkeypatch.setenv("COLLOC_CONF", str(_write_conf(tmp_path, cfg)))
    assert entry.epilog_main({**ENV, "SLURM_JOB_EXIT_CODE2": "0:0"}) == 0
    assert t.jobs_of(0, 1001) == [] and calls == []
    assert not t.job_context_file(7).exists()


def test_prolog_makes_one_controller_call_and_none_for_cpu_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """M3 target: at most one controller call per job from our node scripts."""
    cfg = _cfg(tmp_path)
    fake = FakeSlurm([squeue_job(tres_per_node="gres:gpu:1", gres_detail=["gpu:1(IDX:0)"],
                                 admin_comment="")])
    monkeypatch.setattr(ad.subprocess, "run", fake)
    monkeypatch.setenv("COLLOC_CONF", str(_write_conf(tmp_path, cfg)))
    monkeypatch.setattr(prolog, "start_metrics", lambda ctx, cfg: None)
    assert entry.prolog_main(ENV) == 0
    assert len(fake.calls) == 1
    assert entry.epilog_main({**ENV, "SLURM_JOB_EXIT_CODE2": "0:0"}) == 0
    assert len(fake.calls) == 1
    cpu_env = {k: v for k, v in ENV.items() if k != "SLURM_JOB_GPUS"}
    assert entry.prolog_main(cpu_env) == 0 and entry.epilog_main(cpu_env) == 0
    assert len(fake.calls) == 1


def _write_conf(tmp_path: Path, cfg: CollocConfig) -> Path:
    p = tmp_path / "colloc.conf"
    p.write_text(
        f'mps_root = "{cfg.mps_root}"\nmps_control = "{cfg.mps_control}"\n'
        f'metrics_dir = "{cfg.metrics_dir}"\ngpu_backend = "sim"\n'
        f'log_file = "{tmp_path / "node.log"}"\n'
        f'evidence_dir = "{tmp_path / "evidence"}"\nhistory_db = "{tmp_path / "h.db"}"\n'
    )
    return p


def test_epilog_run_signature_keeps_release_first(tmp_path: Path) -> None:
    res = epilog.release_first(99, _cfg(tmp_path))
    assert res.released == [] and res.errors == []


def test_an_oom_caused_by_an_over_limit_co_tenant_requeues_the_victim_unchanged(
    tmp_path: Path,
) -> None:
    """H2: the epilog requeued the *victims* onto whole GPUs and left the offender alone."""
    from slurm_colloc.metrics import enforce, store
    from slurm_colloc.node import requeue_policy

    cfg = _cfg(tmp_path)
    job = parse_jobs(json.dumps({"jobs": [squeue_job(gres_detail=["shard:4(IDX:0)"],
                                                     tres_per_node="gres:shard:4")]}))[7]
    ctx = jobmod.context_from_job(job, {**ENV, "SLURM_JOB_EXIT_CODE2": "1:0"})
    store.write_meta(cfg.metrics_dir, store.JobMeta(job_id=7, attempt=0, uid=1001, gpus=(0,),
                                                    limit_mib=4096, shards=4,
                                                    start=time.time() - 60))
    res = epilog.EpilogResult(7)
    assert epilog._culprit(ctx, cfg, res) is None  # nobody over: ordinary OOM path
    now = time.time()
    enforce.write_verdict(cfg.metrics_dir, enforce.Verdict(
        job_id="8", attempt=0, uid=1002, gpu=0, kind="over_limit", peak_mib=30000,
        limit_mib=2048, first_seen=now - 5, last_seen=now, action="killed"))
    reason = epilog._culprit(ctx, cfg, res)
    assert reason is not None and res.culprit == "8" and "job 8" in reason
    d = requeue_policy.decide(cause="gpu-oom", shards=4, shards_per_gpu=40, restarts=0,
                              estimate_mib=None, cfg=cfg, culprit=reason)
    assert d.requeue and d.new_shards == 4
    plain = requeue_policy.decide(cause="gpu-oom", shards=4, shards_per_gpu=40, restarts=0,
                                  estimate_mib=None, cfg=cfg)
    assert plain.new_shards > 4  # without a culprit the job is stepped up


def test_the_server_side_cap_follows_the_users_total_on_the_gpu(tmp_path: Path) -> None:
    """H2: a client that drops CUDA_MPS_PINNED_DEVICE_MEM_LIMIT must not get the GPU."""
    t, d = _daemon(tmp_path)
    d.start()
    try:
        d.cap_user(6144)
        assert "6144" in d.command("get_default_device_pinned_mem_limit 0")
    finally:
        d.stop()
    cfg = _cfg(tmp_path)
    for job, mib in ((1, 2048), (2, 4096)):
        t.add_job(0, os.getuid(), job)
        t.write_job_env(job, {"COLLOC_LIMIT_MIB": str(mib)})
    t.write_job_env(3, {"COLLOC_LIMIT_MIB": "99999"})  # not on this GPU: not counted
    assert prolog.user_total_mib(cfg, t, 0, os.getuid()) == 6144


# --- fuzzing the parsers on this trust boundary ---------------------------------------


_json_scalar = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                         st.text(max_size=40))
_json = st.recursive(_json_scalar, lambda c: st.one_of(
    st.lists(c, max_size=4), st.dictionaries(st.text(max_size=10), c, max_size=4)), max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from([*list(squeue_job()), "x"]), _json,
                                max_size=12), max_size=5))
def test_squeue_json_parser_never_crashes_on_any_job_objects(jobs: list[dict[str, Any]]) -> None:
    """Any JSON squeue could hold: parsed, or the parser's own error; nothing else."""
    try:
        parsed = parse_jobs(json.dumps({"jobs": [squeue_job(**j) for j in jobs]}))
    except SqueueJsonError:
        return
    for job in parsed.values():
        assert isinstance(job.job_id, int) and job.job_id > 0
        assert isinstance(job.admin_comment, str) and isinstance(job.tres_per_node, str)
        assert job.state in BASE_STATES or job.state in NAMING_FLAGS
        try:
            ctx = jobmod.context_from_job(job, {**ENV, "SLURM_JOB_ID": str(job.job_id),
                                                "SLURM_JOB_UID": str(job.user_id)})
        except jobmod.JobInfoError:
            continue
        assert ctx.shards >= 0 and ctx.gpu_count >= 0


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["status", "return_code", "signal", "x"]), _json,
                       max_size=4))
def test_exit_code_parser_is_total(obj: dict[str, Any]) -> None:
    """An exit code object of any shape: typed, or the parser's error."""
    try:
        code = exit_code(obj)
    except DataParserError:
        return
    assert all(isinstance(x, str) for x in code.status)
    assert code.return_code is None or isinstance(code.return_code, int)
    assert code.signal is None or isinstance(code.signal, int)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_squeue_json_parser_refuses_non_documents(text: str) -> None:
    with contextlib.suppress(SqueueJsonError):
        parse_jobs(text)


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.text(max_size=300), st.from_regex(
    r"colloc1:mode=(whole|shards|estimate),need_mib=\d{1,6000},shards=\d{1,3},"
    r"shard_mib=\d{1,5}(,[a-z_]{1,8}=[a-z0-9._-]{0,9}){0,5}", fullmatch=True)))
def test_colloc1_record_parser_is_total(text: str) -> None:
    """The record root acts on: parsed or None, never an exception (5,000-digit ints too)."""
    rec = parse_record(text)
    if rec is not None:
        assert rec.mode in ("estimate", "explicit", "default", "shards", "whole")


def test_the_prolog_puts_a_hard_cgroup_limit_where_the_driver_has_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """H2 where r615+ exists: a cap that holds even for a job that bypasses MPS."""
    from slurm_colloc.gpu import backend as gb
    from slurm_colloc.gpu import nvml, select

    calls: list[tuple[int, str, int]] = []

    class Fake:
        def __init__(self, ok: bool) -> None:
            self.ok = ok

        def hard_memory_limit_supported(self, index: int) -> gb.HardLimitSupport:
            return gb.HardLimitSupport(self.ok, "driver r610: no memory limits")

        def set_job_memory_limit(self, index: int, cg: str, hard: int,
                                 soft: int = 0) -> gb.LimitResult:
            calls.append((index, cg, hard))
            return gb.LimitResult(True, "set", "")

        def close(self) -> None:
            pass

    ctx = jobmod.context_from_job(parse_jobs(json.dumps({"jobs": [squeue_job()]}))[7], ENV)
    cfg = _cfg(tmp_path)
    monkeypatch.setattr(nvml, "slurm_job_cgroup",
                        lambda job, sluid=None: f"/sys/fs/cgroup/job_{job}")
    monkeypatch.setattr(select, "backend_from_config", lambda c, with_dcgm=True: Fake(True))
    assert prolog.hard_limit(ctx, cfg, 0, 2048) == "set"
    assert calls == [(0, "/sys/fs/cgroup/job_7", 2048)]
    monkeypatch.setattr(select, "backend_from_config", lambda c, with_dcgm=True: Fake(False))
    assert prolog.hard_limit(ctx, cfg, 0, 2048).startswith("unsupported")

    def boom(c: CollocConfig, with_dcgm: bool = True) -> Fake:
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setattr(select, "backend_from_config", boom)
    assert prolog.hard_limit(ctx, cfg, 0, 2048).startswith("error")  # never fatal
    assert len(calls) == 1


def test_a_fake_control_socket_is_never_talked_to_and_never_stalls_root(
    tmp_path: Path,
) -> None:
    """Review variant A: the job put its own silent listener at ``control``; every root
    MPS command then waited out its timeout under the GPU lock (stop: about 34 s)."""
    import socket as so

    _, d = _daemon(tmp_path)
    d.start()
    real = d.pid()
    fake = so.socket(so.AF_UNIX)
    try:
        (d.pipe_dir / "control").unlink()
        fake.bind(str(d.pipe_dir / "control"))
        fake.listen(8)  # accepts, never answers
        assert not d.running()
        t0 = time.monotonic()
        with pytest.raises(Exception, match="not our daemon"):
            d.command("get_server_list")
        d.stop()
        assert time.monotonic() - t0 < 6, "root waited on the user's socket"
        assert real is not None and not _alive(real)
    finally:
        fake.close()
        d.stop()


def test_gres_count_suffixes_are_read_like_job_submit_reads_them() -> None:
    """Review variant D: ``shard:2k`` read as 0 shards made the job 'not shared'."""
    job = parse_jobs(json.dumps({"jobs": [squeue_job(tres_per_node="gres:shard:2k")]}))[7]
    assert jobmod.context_from_job(job, ENV).shards == 2048


def test_a_job_registered_after_the_snapshot_is_not_reaped_by_it(tmp_path: Path) -> None:
    """Found by the philly90 replay after the M3 change: the prolog takes its squeue
    snapshot before the GPU lock; another job's prolog may register in between. That
    job shows as PENDING in the older snapshot and was reaped: its MPS registration
    and its share of the user's server-side cap were lost, and it died of an OOM far
    below its own limit (peak 4.3 GiB under a 7 GiB allocation)."""
    cfg = _cfg(tmp_path)
    t = Tenancy(Path(cfg.mps_root))
    snapshot = parse_jobs(json.dumps({"jobs": [squeue_job(job_id=5, job_state="PENDING"),
                                               squeue_job(job_id=6, job_state="PENDING")]}))
    t.add_job(0, 1001, 5)
    taken = time.time()
    time.sleep(0.02)
    t.add_job(0, 1001, 6)  # registered by a prolog that got the lock first
    assert prolog.reap_stale(cfg, t, 0, snapshot, taken=taken) == [5]
    assert t.jobs_of(0, 1001) == [6]
