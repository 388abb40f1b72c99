"""Issue 23, item 2: no user-writable tree that root walks or keeps.

The legacy MPS pipe directory is handed to the job's user. Whatever the user plants
there (a tree 5,000 levels deep, 200,000 entries, links to other places, FIFOs, files
it keeps open, another filesystem) must neither stop nor stall the next prolog under
the GPU lock, must not survive the user's last job on that GPU, and root's removal
must never leave the quarantined tree. Plus the MPS lows: ``hard_limit()`` whatever
the MPS set-up does, ``set_checked`` verifies, the v3 daemon's umask, the job env file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from slurm_colloc import safe_tree
from slurm_colloc.gpu.sim import tools as sim_tools
from slurm_colloc.mps.control import MpsControlError, MpsDaemon
from slurm_colloc.mps.tenancy import Tenancy

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown, setuid, mount)")

USER = 4242
# the lab's launcher (not a console script of the wheel: issue 26 item 7)
STANDIN = str(sim_tools.tool("colloc-sim-mps-control"))


# --- helpers ------------------------------------------------------------------------
def deep_tree(top: Path, depth: int, name: str = "d") -> None:
    """``top/d/d/.../d`` ``depth`` levels deep (paths far past PATH_MAX: made by fds)."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir(name, dir_fd=fd)
            nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        with contextlib.suppress(OSError):
            os.close(os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    finally:
        os.close(fd)


def wide_tree(top: Path, count: int) -> None:
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(count):
            os.close(os.open(f"f{i}", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    finally:
        os.close(fd)


def as_user(uid: int, fn: Any) -> int:
    """Run ``fn()`` in a forked child with ``uid``; its exit status (0: fn returned True)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 1
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            code = 0 if fn() else 1
        except BaseException:  # the child reports by its status only
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def handed_pipe(t: Tenancy, gpu: int = 0, uid: int = USER) -> Path:
    """A pipe directory as a running job sees it: made by root, then the user's."""
    with t.locked(gpu):
        pipe, _ = t.prepare_user_dirs(gpu, uid)
        t.hand_pipe_dir_to(gpu, uid, uid)
    t.purge_quarantine()
    return pipe


def quarantined(t: Tenancy) -> list[str]:
    q = t.quarantine_dir
    return sorted(os.listdir(q)) if q.is_dir() else []


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A directory other users can traverse (pytest's tmp_path is root's 0700): what a
    user cannot reach below it is then refused by our modes, not by the test's."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"  # tmpfs, as /run on a node
    d = Path(tempfile.mkdtemp(prefix="colloc-tree-", dir=base))
    d.chmod(0o755)
    yield d
    with contextlib.suppress(OSError):
        subprocess.run(["rm", "-rf", "--one-file-system", str(d)], check=False)


@pytest.fixture
def tenancy(open_tmp: Path) -> Tenancy:
    return Tenancy(open_tmp / "mps")


# --- the attack: a deep tree ----------------------------------------------------------
def test_a_deep_tree_in_the_pipe_dir_does_not_stop_the_next_prolog(tenancy: Tenancy) -> None:
    """Live: 1,200 levels made the next prolog die in shutil.rmtree (RecursionError)
    under the GPU lock: that user's jobs on that GPU ran with no MPS and no limit."""
    pipe = handed_pipe(tenancy)
    deep_tree(pipe, 5000)
    with tenancy.locked(0):
        fresh, _ = tenancy.prepare_user_dirs(0, USER)
    st = fresh.lstat()
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o700
    assert os.listdir(fresh) == []
    done = tenancy.purge_quarantine()
    assert not done.left, done
    assert quarantined(tenancy) == []


def test_the_walk_is_iterative_and_holds_few_descriptors(open_tmp: Path) -> None:
    tmp_path = open_tmp
    """A deep tree walked with one descriptor per level would run out of them."""
    q = safe_tree.private_dir(tmp_path / "q")
    (tmp_path / "victim").mkdir()
    deep_tree(tmp_path / "victim", 5000)
    safe_tree.quarantine(tmp_path / "victim", q, "t")
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
    try:
        done = safe_tree.purge(q, max_entries=1_000_000, max_seconds=60)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert not done.left and done.removed >= 5000, done
    assert os.listdir(q) == []


# --- a wide tree: bounded, never under the lock -------------------------------------
def test_a_wide_tree_is_moved_aside_under_the_lock_and_removed_in_bounded_passes(
    tenancy: Tenancy,
) -> None:
    """Live: a wide tree held the GPU lock for minutes (other prologs give up at 60 s)."""
    pipe = handed_pipe(tenancy)
    wide_tree(pipe, 200_000)
    t0 = time.monotonic()
    with tenancy.locked(0):
        tenancy.prepare_user_dirs(0, USER)
    under_lock = time.monotonic() - t0
    assert under_lock < 1.0, under_lock  # a rename, not a walk
    assert len(quarantined(tenancy)) == 1  # the planted tree waits in root's quarantine
    first = safe_tree.purge(tenancy.quarantine_dir, max_entries=50_000, max_seconds=30)
    assert first.left and first.removed <= 50_000 + 1, first
    passes = 1
    while safe_tree.purge(tenancy.quarantine_dir, max_entries=50_000, max_seconds=30).left:
        passes += 1
        assert passes < 10
    assert quarantined(tenancy) == []


def test_a_pass_is_bounded_in_time(open_tmp: Path) -> None:
    tmp_path = open_tmp
    q = safe_tree.private_dir(tmp_path / "q")
    (tmp_path / "v").mkdir()
    wide_tree(tmp_path / "v", 50_000)
    safe_tree.quarantine(tmp_path / "v", q, "t")
    t0 = time.monotonic()
    done = safe_tree.purge(q, max_entries=10**9, max_seconds=0.05)
    assert time.monotonic() - t0 < 1.0
    assert done.left and 0 < done.removed < 50_000, done


# --- nothing outside the quarantined tree is touched --------------------------------
def test_links_fifos_and_hard_links_are_unlinked_never_followed(
    tenancy: Tenancy, open_tmp: Path
) -> None:
    tmp_path = open_tmp  # the hard link needs the same filesystem
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("precious")
    secret = tmp_path / "secret"
    secret.write_text("root's")
    pipe = handed_pipe(tenancy)
    (pipe / "to-dir").symlink_to(outside)
    (pipe / "sub").mkdir()
    (pipe / "sub" / "to-file").symlink_to(outside / "keep")
    (pipe / "sub" / "dangling").symlink_to("/nonexistent/x")
    os.mkfifo(pipe / "sub" / "fifo")
    os.link(secret, pipe / "sub" / "hardlink")
    deep_tree(pipe / "sub", 50)
    with tenancy.locked(0):
        tenancy.prepare_user_dirs(0, USER)
    t0 = time.monotonic()
    done = tenancy.purge_quarantine()
    assert time.monotonic() - t0 < 5  # a FIFO is never opened
    assert not done.left and quarantined(tenancy) == []
    assert (outside / "keep").read_text() == "precious"
    assert secret.read_text() == "root's" and secret.stat().st_nlink == 1


def test_a_directory_swapped_for_a_link_is_not_followed(tmp_path: Path) -> None:
    """The user may still hold a descriptor inside the tree and swap names under us."""
    q = safe_tree.private_dir(tmp_path / "q")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    victim = tmp_path / "v"
    (victim / "a").mkdir(parents=True)
    (victim / "a" / "f").write_text("y")
    name = safe_tree.quarantine(victim, q, "t")
    assert name is not None
    # the swap a user with a descriptor on the tree could race in
    held = os.open(q / name, os.O_RDONLY | os.O_DIRECTORY)
    try:
        shutil.rmtree(q / name / "a")
        os.symlink(outside, "a", dir_fd=held)
        done = safe_tree.purge(q)
    finally:
        os.close(held)
    assert not done.left and os.listdir(q) == []
    assert (outside / "keep").read_text() == "x"


def test_another_filesystem_inside_the_tree_is_never_entered(tmp_path: Path) -> None:
    q = safe_tree.private_dir(tmp_path / "q")
    victim = tmp_path / "v"
    (victim / "mnt").mkdir(parents=True)
    (victim / "plain").write_text("gone")
    mnt = victim / "mnt"
    cp = subprocess.run(["mount", "-t", "tmpfs", "colloc-test", str(mnt)], check=False)
    assert cp.returncode == 0, "root could not mount a tmpfs for this test"
    try:
        (mnt / "other-fs").write_text("stays")
        name = safe_tree.quarantine(victim, q, "t")
        assert name is not None
        done = safe_tree.purge(q)
        assert done.left and done.errors, done  # reported, and it stays quarantined
        assert (q / name / "mnt" / "other-fs").read_text() == "stays"
        assert not (q / name / "plain").exists()
    finally:
        subprocess.run(["umount", "-l", str(q / name / "mnt") if name else str(mnt)],
                       check=False)


def test_files_the_user_keeps_open_do_not_stop_the_removal(tmp_path: Path) -> None:
    q = safe_tree.private_dir(tmp_path / "q")
    victim = tmp_path / "v"
    (victim / "a" / "b").mkdir(parents=True)
    f = open(victim / "a" / "big", "w")  # noqa: SIM115 - held open on purpose
    d = os.open(victim / "a" / "b", os.O_RDONLY | os.O_DIRECTORY)
    try:
        f.write("x" * 4096)
        safe_tree.quarantine(victim, q, "t")
        done = safe_tree.purge(q)
        assert not done.left and os.listdir(q) == [], done
        with pytest.raises(FileNotFoundError):  # the held directory is gone for good
            os.open("new", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=d)
    finally:
        f.close()
        os.close(d)


def test_the_quarantine_is_root_only_and_unreachable_for_the_user(tenancy: Tenancy) -> None:
    pipe = handed_pipe(tenancy)
    wide_tree(pipe, 10)
    assert as_user(USER, lambda: os.path.exists(pipe / "f1")) == 0  # reachable while handed
    with tenancy.locked(0):
        tenancy.prepare_user_dirs(0, USER)
    q = tenancy.quarantine_dir
    st = q.lstat()
    assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o700
    [name] = quarantined(tenancy)
    assert as_user(USER, lambda: os.path.exists(q / name / "f1")) == 1  # EACCES: False


def test_a_quarantine_someone_else_can_reach_is_refused(tmp_path: Path) -> None:
    q = tmp_path / "q"
    q.mkdir(mode=0o755)
    os.chmod(q, 0o755)
    os.chown(q, USER, USER)
    with pytest.raises(safe_tree.UnsafeTree):
        safe_tree.purge(q)
    link = tmp_path / "qlink"
    link.symlink_to(tmp_path)
    with pytest.raises(safe_tree.UnsafeTree):
        safe_tree.purge(link)


# --- end of the user's last job on that GPU ------------------------------------------
def _cfg(tmp_path: Path) -> Any:
    from slurm_colloc import config as cfgmod

    return cfgmod.CollocConfig(mps_root=str(tmp_path / "mps"), mps_control=STANDIN,
                               metrics_dir=str(tmp_path / "metrics"))


def test_the_epilog_removes_the_pipe_dir_after_the_users_last_job(tmp_path: Path) -> None:
    from slurm_colloc.node import epilog

    cfg = _cfg(tmp_path)
    t = Tenancy(Path(cfg.mps_root))
    pipe = handed_pipe(t)
    t.add_job(0, USER, 7)
    t.add_job(0, USER, 8)
    deep_tree(pipe, 1500)
    wide_tree(pipe, 1000)
    epilog.release_mps(7, cfg, epilog.EpilogResult(7))
    assert (pipe / "f1").exists()  # job 8 of the same user still runs: its directory stays
    epilog.release_mps(8, cfg, epilog.EpilogResult(8))
    assert not os.path.lexists(pipe), "the user's pipe directory outlived its last job"
    assert quarantined(t) == []


def test_reaping_a_stale_job_retires_its_pipe_dir(tmp_path: Path) -> None:
    from slurm_colloc.node import prolog

    cfg = _cfg(tmp_path)
    t = Tenancy(Path(cfg.mps_root))
    pipe = handed_pipe(t)
    t.add_job(0, USER, 5)
    deep_tree(pipe, 2000)
    with t.locked(0):
        assert prolog.reap_stale(cfg, t, 0, {}, now=1000.0) == []
        assert prolog.reap_stale(cfg, t, 0, {}, now=1000.0 + prolog.ABSENT_GRACE_S) == [5]
    assert t.jobs_of(0, USER) == []
    assert not os.path.lexists(pipe)
    t.purge_quarantine()
    assert quarantined(t) == []


def test_leftovers_are_finished_by_a_detached_purger(
    tenancy: Tenancy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What one bounded pass leaves is finished later, outside the prolog/epilog."""
    spawned: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(safe_tree, "spawn_module",
                        lambda mod, args, env: spawned.append((mod, list(args))))
    pipe = handed_pipe(tenancy)
    wide_tree(pipe, 5000)
    with tenancy.locked(0):
        tenancy.prepare_user_dirs(0, USER)
    done = tenancy.purge_quarantine(max_entries=100)
    assert done.left
    assert spawned == [("slurm_colloc.safe_tree", [str(tenancy.quarantine_dir)])]
    assert safe_tree.main([str(tenancy.quarantine_dir)]) == 0  # what the detached one runs
    assert quarantined(tenancy) == []


# --- hard_limit() whatever else fails -------------------------------------------------
@pytest.mark.parametrize("protocol", [2, 3])
def test_the_hard_limit_is_applied_when_the_mps_setup_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, protocol: int
) -> None:
    """Any exception in the MPS set-up (the planted tree's RecursionError) skipped
    ``hard_limit()``: the job then had neither MPS nor its cgroup cap."""
    import json

    from slurm_colloc.gpu.backend import GpuInfo
    from slurm_colloc.gpu.identity import GpuMap
    from slurm_colloc.node import prolog

    from .test_security_node import ENV, parse_jobs, squeue_job

    cfg = _cfg(tmp_path)
    info = GpuInfo(index=0, uuid="GPU-00000000-0000-0000-0000-000000000001", name="sim",
                   memory_total_mib=81920, minor_number=0)
    monkeypatch.setattr(prolog, "node_gpu_map", lambda c: GpuMap.from_gpus([info]))
    monkeypatch.setattr(prolog, "node_protocol", lambda c: protocol)
    monkeypatch.setattr(prolog, "start_metrics", lambda ctx, c: None)
    monkeypatch.setattr(prolog.pwd, "getpwuid", lambda uid: SimpleNamespace(pw_gid=uid))
    applied: list[tuple[int, int]] = []

    def hard(ctx: Any, c: Any, gpu: int, mib: int) -> str:
        applied.append((gpu, mib))
        return "applied"

    def boom(*a: Any, **k: Any) -> Any:
        raise RecursionError("planted tree")

    monkeypatch.setattr(prolog, "hard_limit", hard)
    monkeypatch.setattr(prolog, "_v2_setup", boom)
    monkeypatch.setattr(prolog, "_v3_setup", boom)
    ctx = jobmod_ctx(parse_jobs(json.dumps({"jobs": [squeue_job()]}))[7], ENV)
    with pytest.raises(prolog.MpsSetupError, match=r"RecursionError.*hard limit: applied"):
        prolog.run(ctx, cfg, adapter=None)  # type: ignore[arg-type]
    assert applied == [(0, 2 * cfg.shard_mib)]


def jobmod_ctx(job: Any, env: dict[str, str]) -> Any:
    from slurm_colloc.node import job as jobmod

    return jobmod.context_from_job(job, env)


# --- set_checked verifies -----------------------------------------------------------
class FakeDaemon(MpsDaemon):
    """Accepts every set_* command silently; its getters tell what really holds."""

    def __init__(self, state: dict[str, str]) -> None:
        super().__init__("x", 0, Path("/nonexistent/pipe"), Path("/nonexistent/log"))
        object.__setattr__(self, "_fake", state)

    def command(self, *lines: str, timeout: float = 10) -> str:
        out = []
        for ln in lines:
            words = ln.split()
            if words[0].startswith("get_"):
                out.append(self._fake.get(" ".join(words), "0"))  # type: ignore[attr-defined]
        return "\n".join(out)


def test_set_checked_takes_no_silence_for_success() -> None:
    """A daemon that prints nothing but did not apply the limit: the job would run
    without the cap it was promised."""
    d = FakeDaemon({"get_default_device_pinned_mem_limit 0": "0"})
    with pytest.raises(MpsControlError, match="did not take"):
        d.set_checked("set_default_device_pinned_mem_limit 0 4096M")
    d = FakeDaemon({"get_default_device_pinned_mem_limit 0": "4G",
                    "get_device_pinned_mem_limit 77 0": "4096M",
                    "get_default_active_thread_percentage": "50.0"})
    d.set_checked("set_default_device_pinned_mem_limit 0 4096M",
                  "set_device_pinned_mem_limit 77 0 4G",
                  "set_default_active_thread_percentage 50")
    with pytest.raises(MpsControlError, match="did not take"):
        d.set_checked("set_default_active_thread_percentage 25")
    with pytest.raises(MpsControlError, match="cannot be verified"):
        d.set_checked("start_server -uid 0")


def test_set_checked_verifies_against_the_stand_in(tmp_path: Path) -> None:
    t = Tenancy(tmp_path / "mps")
    pipe, logdir = t.prepare_user_dirs(0, os.getuid())
    d = MpsDaemon(STANDIN, 0, pipe, logdir, t.daemon_state(0, os.getuid()))
    d.start()
    try:
        d.cap_user(6144)
        d.set_defaults(None, 40)
        assert d.command("get_default_device_pinned_mem_limit 0").strip() == "6144M"
    finally:
        d.stop()


# --- the job env file: root and the job's owner only ----------------------------------
def test_the_job_env_file_is_the_owners_alone_and_root_never_reads_it(tenancy: Tenancy) -> None:
    from slurm_colloc import config as cfgmod
    from slurm_colloc.node import prolog
    from slurm_colloc.node.task_prolog import export_lines

    t = tenancy
    old = os.umask(0)
    try:
        t.write_job_env(5, {"COLLOC_LIMIT_MIB": "2048", "COLLOC_PINNED_MIB": "1536"},
                        uid=USER, gid=1234)
    finally:
        os.umask(old)
    st = t.job_env_file(5).lstat()
    assert st.st_uid == USER and stat.S_IMODE(st.st_mode) & 0o077 == 0, oct(st.st_mode)
    assert as_user(USER, lambda: bool(export_lines(str(t.root), 5))) == 0  # the TaskProlog
    assert as_user(USER + 1, lambda: bool(export_lines(str(t.root), 5))) == 1  # nobody else
    # the owner can rewrite its copy: root's sums never read it
    os.chmod(t.job_env_file(5), 0o600)
    t.job_env_file(5).write_text("COLLOC_PINNED_MIB=99999999\n")
    t.add_job(0, USER, 5)
    cfg = cfgmod.CollocConfig(mps_root=str(t.root))
    assert prolog.user_total_mib(cfg, t, 0, USER) == 1536
    t.remove_job(5)
    assert not t.job_env_file(5).exists()
    assert prolog.user_total_mib(cfg, t, 0, USER) == 0


# --- MPS v3: the daemon's files under umask 077 ---------------------------------------
def test_v3_commands_run_under_a_private_umask(tmp_path: Path) -> None:
    from slurm_colloc.mps.v3 import run_bounded

    out = tmp_path / "made"
    rc, _, _ = run_bounded(["/bin/sh", "-c", f"umask; : > {out}"], {"PATH": "/bin:/usr/bin"},
                           timeout=10)
    assert rc == 0
    assert stat.S_IMODE(out.stat().st_mode) & 0o077 == 0, oct(out.stat().st_mode)


def test_the_v3_daemon_keeps_its_files_private_and_opens_only_the_jobs_route() -> None:
    """The daemon started with umask 022: its logs and pid file were world-readable.
    Under 077 the directories on the way to a job's namespace socket are opened
    explicitly (here the server directory is made 0700 first, as a real daemon under
    umask 077 may make it): the job's user still reaches its namespace."""
    from slurm_colloc.gpu.sim.state import init_state
    from slurm_colloc.mps.v3 import MpsV3Node

    from .test_mps_v3 import USER_A, UserClient, stand_in

    d = Path(tempfile.mkdtemp(prefix="v3u", dir="/tmp"))
    d.chmod(0o755)
    spec = init_state(d / "sim", gpu_count=1, memory_mib=40960)
    node = MpsV3Node(stand_in(d), d / "pipe", d / "log", d / "state",
                     extra_env={"COLLOC_SIM_STATE": str(d / "sim")})
    try:
        node.start({0: spec.uuid(0)})
        logs = [p for p in (d / "log").rglob("*") if p.is_file()]
        assert logs and all(stat.S_IMODE(p.stat().st_mode) & 0o077 == 0 for p in logs), \
            [(str(p), oct(p.stat().st_mode)) for p in logs]
        os.chmod(d / "pipe" / "gpu0", 0o700)
        env = node.add_job(0, spec.uuid(0), 31, USER_A, USER_A, 2048, 0)
        ns = Path(env["CUDA_MPS_PIPE_DIRECTORY"])
        for p in (ns.parent, ns):
            assert stat.S_IMODE(p.stat().st_mode) == 0o755 and p.stat().st_uid == 0
        c = UserClient(USER_A, ns)
        try:
            assert c.first.startswith("READY"), c.first
        finally:
            c.release()
    finally:
        node.stop()
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize(("reply", "ok"), [("4096M", True), ("4G", True), ("0=4G", True),
                                          ("Device 0: 4096M", True), ("0", False),
                                          ("", False), ("unknown", False), ("4095M", False)])
def test_a_read_back_limit_is_compared_by_value(reply: str, ok: bool) -> None:
    from slurm_colloc.mps.control import _same_value

    assert _same_value("size", reply, "4096M") is ok
