"""MPS bookkeeping, daemon control (through the simulation's stand-in), TaskProlog."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from slurm_colloc.gpu.sim import tools as sim_tools
from slurm_colloc.mps.control import MpsControlError, MpsDaemon
from slurm_colloc.mps.tenancy import Tenancy, TenancyError, ensure_root_dir
from slurm_colloc.node.task_prolog import export_lines

# the lab's launcher (not a console script of the wheel: issue 26 item 7)
STANDIN = str(sim_tools.tool("colloc-sim-mps-control"))


def test_tenancy_tracks_jobs_per_gpu_and_user(tmp_path: Path) -> None:
    t = Tenancy(tmp_path / "mps")
    t.prepare_user_dirs(1, 1000)
    t.add_job(1, 1000, 11)
    t.add_job(1, 1000, 12)
    t.prepare_user_dirs(1, 1001)
    t.add_job(1, 1001, 13)
    assert t.users_on(1) == [1000, 1001]
    assert t.all_jobs() == {11: [(1, 1000)], 12: [(1, 1000)], 13: [(1, 1001)]}
    assert t.remove_job(11) == [(1, 1000)]
    assert t.jobs_of(1, 1000) == [12]
    assert oct(t.pipe_dir(1, 1000).stat().st_mode & 0o777) == "0o700"


def test_symlinked_state_dir_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "mps").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(TenancyError, match="symlink"):
        ensure_root_dir(tmp_path / "mps")


def test_prepared_pipe_dir_replaces_a_planted_symlink(tmp_path: Path) -> None:
    t = Tenancy(tmp_path / "mps")
    t.prepare_user_dirs(0, 5)
    pipe = t.pipe_dir(0, 5)
    pipe.rmdir()
    pipe.symlink_to("/etc")
    t.prepare_user_dirs(0, 5)
    assert pipe.is_dir() and not pipe.is_symlink()


def test_task_prolog_exports_only_known_safe_values(tmp_path: Path) -> None:
    t = Tenancy(tmp_path / "mps")
    t.write_job_env(5, {"CUDA_MPS_PIPE_DIRECTORY": "/run/x/pipe",
                        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8192M",
                        "LD_PRELOAD": "/tmp/evil.so",
                        "COLLOC_GPU": "1; rm -rf /"})
    lines = export_lines(str(tmp_path / "mps"), 5)
    assert lines == ["export CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8192M",
                     "export CUDA_MPS_PIPE_DIRECTORY=/run/x/pipe"]
    assert export_lines(str(tmp_path / "mps"), 6) == []  # not collocated: nothing


def test_daemon_start_command_stop_with_standin(tmp_path: Path) -> None:
    if not os.path.exists(STANDIN):
        pytest.fail(f"MPS stand-in not installed at {STANDIN}; run make venv")
    t = Tenancy(tmp_path / "mps")
    pipe, logdir = t.prepare_user_dirs(0, os.getuid())
    d = MpsDaemon(STANDIN, 0, pipe, logdir)
    assert not d.running()
    d.start()
    try:
        assert d.running() and d.pid() is not None
        d.start()  # idempotent
        d.set_defaults(4096, 50)
        assert d.server_pids() == []  # no client yet: no server
        assert "4096" in d.command("get_default_device_pinned_mem_limit 0")
    finally:
        d.stop()
    assert not d.running() and d.pid() is None
    assert (logdir / "control.log").exists()


def _standin_daemon(tmp_path: Path, device: str | None = None) -> MpsDaemon:
    if not os.path.exists(STANDIN):
        pytest.fail(f"MPS stand-in not installed at {STANDIN}; run make venv")
    t = Tenancy(tmp_path / "mps")
    pipe, logdir = t.prepare_user_dirs(0, os.getuid())
    return MpsDaemon(STANDIN, 0, pipe, logdir, device=device)


def test_a_refused_set_command_raises_instead_of_passing_silently(tmp_path: Path) -> None:
    from slurm_colloc.mps.control import MpsControlError

    d = _standin_daemon(tmp_path)
    d.start()
    try:
        with pytest.raises(MpsControlError, match="refused"):
            d.set_checked("set_default_device_pinned_mem_limit 0 lots")
        with pytest.raises(MpsControlError, match="refused"):
            d.set_checked("set_device_pinned_mem_limit 999999 0 1G")  # no such server
        d.set_checked("set_default_device_pinned_mem_limit 0 1G")  # accepted: no reply
    finally:
        d.stop()


def test_stop_shuts_each_server_down_by_name_before_quit(tmp_path: Path) -> None:
    d = _standin_daemon(tmp_path)
    d.start()
    assert d.command("start_server -uid 0").strip() == ""  # set_checked: set_* only
    servers = d.server_pids()
    assert len(servers) == 1
    d.stop()
    assert not d.running()
    assert not Path(f"/proc/{servers[0]}").exists()
    log = (d.log_dir / "control.log").read_text()
    assert log.index(f"Cmd:shutdown_server {servers[0]} -f") < log.index("Cmd:quit")


def test_daemon_sees_the_gpu_by_uuid_and_pci_order(tmp_path: Path) -> None:
    d = _standin_daemon(tmp_path, device="GPU-1234abcd")
    env = d._env()
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-1234abcd"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert _standin_daemon(tmp_path)._env()["CUDA_VISIBLE_DEVICES"] == "0"


def test_a_daemon_that_starts_but_is_not_recognised_is_not_left_behind(tmp_path: Path) -> None:
    # H100 (issue 24): a wrapper in mps_control made every prolog time out with the
    # daemon running, unknown to root state: nothing would ever have stopped it
    if not os.path.exists(STANDIN):
        pytest.fail(f"MPS stand-in not installed at {STANDIN}; run make venv")
    wrapper = tmp_path / "bin" / "site-mps-launcher"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec {STANDIN} "$@"\n')
    wrapper.chmod(0o755)
    t = Tenancy(tmp_path / "mps")
    pipe, logdir = t.prepare_user_dirs(0, os.getuid())
    d = MpsDaemon(str(wrapper), 0, pipe, logdir)
    with pytest.raises(MpsControlError, match="asked to quit") as err:
        d.start(timeout=1.5)
    assert "not" in str(err.value)  # says which identity check failed
    deadline = time.monotonic() + 5
    while _daemons_in(pipe) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _daemons_in(pipe) == []


def _daemons_in(pipe: Path) -> list[int]:
    """Live processes whose CUDA_MPS_PIPE_DIRECTORY is ``pipe``."""
    from slurm_colloc import procfs

    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and procfs.alive(int(entry)) and \
                procfs.environ(int(entry), "CUDA_MPS_PIPE_DIRECTORY") == str(pipe):
            found.append(int(entry))
    return found


class _RacingDaemon(MpsDaemon):
    """A daemon whose user's first client connects right after root lists the servers:
    the server it starts takes whatever default is set at that moment. Commands are
    carried out in order, as the control program does with its stdin lines."""

    def __init__(self) -> None:
        super().__init__("/bin/false", 0, Path("/nonexistent/pipe"), Path("/nonexistent/log"))
        object.__setattr__(self, "state", {"default": 2560, "servers": {}, "listed": 0,
                                           "runs": 0})

    def command(self, *lines: str, timeout: float = 10) -> str:
        st = self.state  # type: ignore[attr-defined]
        st["runs"] += 1
        out = []
        for line in lines:
            words = line.split()
            if words[0] == "get_server_list":
                out += [str(p) for p in st["servers"]]
                st["listed"] += 1
                if st["listed"] == 1 and not st["servers"]:
                    st["servers"][4242] = st["default"]  # spawned just after this listing
            elif words[0] == "set_default_device_pinned_mem_limit":
                st["default"] = int(words[-1].rstrip("M"))
            elif words[0] == "set_device_pinned_mem_limit":
                st["servers"][int(words[1])] = int(words[-1].rstrip("M"))
            elif words[0] == "get_default_device_pinned_mem_limit":
                out.append(f"{st['default']}M")
            elif words[0] == "get_device_pinned_mem_limit":
                out.append(f"{st['servers'][int(words[1])]}M")
        return "\n".join(out) + ("\n" if out else "")


def test_a_server_started_while_the_cap_is_raised_gets_the_new_cap() -> None:
    # issue 24 (philly90h replay): get_server_list found no server, the user's first
    # client then started one with the old default (2,560 MiB), and the default went
    # to 7,168 MiB only after: the 4,608 MiB job died of OOM inside its reservation
    d = _RacingDaemon()
    d.cap_user(7168)
    st = d.state  # type: ignore[attr-defined]
    assert st["default"] == 7168
    assert st["servers"] == {4242: 7168}
    assert st["runs"] == 1  # issue 28: no server listed: one run of the control program


def test_the_cap_takes_one_run_without_servers_and_two_with() -> None:
    """Issue 28 (burst): the default, its read-back and the listing share a session; a
    second one sets and reads back each running server's limit."""
    d = _RacingDaemon()
    object.__setattr__(d, "state", {"default": 2560, "servers": {}, "listed": 1, "runs": 0})
    d.cap_user(3072)
    assert d.state == {"default": 3072, "servers": {}, "listed": 2,  # type: ignore[attr-defined]
                       "runs": 1}
    object.__setattr__(d, "state", {"default": 2560, "servers": {77: 2560, 78: 2560},
                                    "listed": 1, "runs": 0})
    d.cap_user(6144)
    st = d.state  # type: ignore[attr-defined]
    assert st["servers"] == {77: 6144, 78: 6144} and st["default"] == 6144
    assert st["runs"] == 2


def test_a_default_not_read_back_in_the_first_run_is_never_taken_as_set() -> None:
    class Stale(_RacingDaemon):  # the batched getter answers the old value
        def command(self, *lines: str, timeout: float = 10) -> str:
            if len(lines) == 3:
                self.state["runs"] += 1  # type: ignore[attr-defined]
                return "2560M\n"
            return super().command(*lines, timeout=timeout)

    d = Stale()
    object.__setattr__(d, "state", {"default": 2560, "servers": {}, "listed": 1, "runs": 0})
    with pytest.raises(MpsControlError, match="did not take the cap"):
        d.cap_user(4096)


class _LongAnswers(_RacingDaemon):
    """A daemon whose read-backs come in a format of more than one line each: the cap
    is still read back, one getter per run (nothing is paired by guess)."""

    def command(self, *lines: str, timeout: float = 10) -> str:
        out = super().command(*lines, timeout=timeout)
        if any(ln.startswith("get_") and "server_list" not in ln for ln in lines):
            return "".join(f"Device 0:\n  limit = {a}\n" for a in out.split())
        return out


def test_an_unknown_answer_format_falls_back_to_one_read_back_per_run() -> None:
    d = _LongAnswers()
    object.__setattr__(d, "state", {"default": 2560, "servers": {77: 2560}, "listed": 1,
                                    "runs": 0})
    d.cap_user(4096)
    st = d.state  # type: ignore[attr-defined]
    assert st["servers"] == {77: 4096} and st["default"] == 4096
    assert st["runs"] == 6  # batched try, a listing, the sets, the sets again, two read-backs


def test_a_cap_the_daemon_did_not_take_is_an_error() -> None:
    class Deaf(_RacingDaemon):
        def command(self, *lines: str, timeout: float = 10) -> str:
            return super().command(*(ln for ln in lines if not ln.startswith("set_device")),
                                   timeout=timeout)

    d = Deaf()
    object.__setattr__(d, "state", {"default": 2560, "servers": {77: 2560}, "listed": 1,
                                    "runs": 0})
    with pytest.raises(MpsControlError, match="did not take the cap"):
        d.cap_user(4096)


def test_a_lock_holder_runs_ahead_and_a_daemon_it_starts_does_not(tmp_path: Path) -> None:
    """Issue 28: under a burst the GPU's prologs waited seconds for a lock holder that
    started an MPS daemon or committed the cap on busy CPUs. A holder of root's locks
    runs at ``priority.HOLDER_NICE`` (root) and gets its own priority back at release;
    the daemon it started is given the holder's old priority as soon as it is up, so
    no MPS server it spawns later inherits the raised one."""
    from slurm_colloc import priority

    t = Tenancy(tmp_path / "mps")
    pipe, logdir = t.prepare_user_dirs(0, os.getuid())
    d = MpsDaemon(STANDIN, 0, pipe, logdir, t.daemon_state(0, os.getuid()))
    before = os.getpriority(os.PRIO_PROCESS, 0)
    root = os.geteuid() == 0
    try:
        with t.locked(0):
            held = os.getpriority(os.PRIO_PROCESS, 0)
            with t.cap_locked(0, os.getuid()):  # nested: no second raise, no early drop
                assert os.getpriority(os.PRIO_PROCESS, 0) == held
            assert os.getpriority(os.PRIO_PROCESS, 0) == held
            d.start()
        assert held == (priority.HOLDER_NICE if root else before)
        assert os.getpriority(os.PRIO_PROCESS, 0) == before
        pid = d.pid()
        assert pid is not None and os.getpriority(os.PRIO_PROCESS, pid) == before
    finally:
        d.stop()


def _session_recorder(tmp_path: Path) -> tuple[Path, Path]:
    """A control program that records the session it runs in and fails its start (a
    daemonising program that never calls setsid itself)."""
    seen = tmp_path / "sid"
    prog = tmp_path / "mps-control-no-setsid"
    prog.write_text(f"#!/bin/sh\ncut -d' ' -f6 /proc/self/stat > {seen}\nexit 1\n")
    prog.chmod(0o755)
    return prog, seen


def test_a_started_daemon_leaves_its_starters_session(tmp_path: Path) -> None:
    """Issue 28: the script server weights its session's CPU group for the scripts
    (``priority.raise_session``); an MPS control daemon started from a script must not
    keep that weight, with its servers, for the rest of its life, whatever NVIDIA's
    program does when it daemonises: its start runs in a session of its own (v2 and v3)."""
    from slurm_colloc.mps import v3

    prog, seen = _session_recorder(tmp_path)
    t = Tenancy(tmp_path / "mps")
    pipe, logdir = t.prepare_user_dirs(0, os.getuid())
    with pytest.raises(MpsControlError, match="exited 1"):
        MpsDaemon(str(prog), 0, pipe, logdir).start()
    sid = int(seen.read_text())
    assert sid != os.getsid(0)
    seen.unlink()
    rc, _, _ = v3.run_bounded([str(prog), "-d"], {"PATH": "/usr/bin:/bin"}, 10,
                              new_session=True)
    assert rc == 1 and int(seen.read_text()) != os.getsid(0)
