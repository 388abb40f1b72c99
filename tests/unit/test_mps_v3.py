"""MPS v3: detection, the node driver against the v3 stand-in, and the stand-in itself.

Tests run as root: clients of other users are forked children that drop to uid
1001/1002 before they connect (no exec, so no interpreter has to be readable by them).
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_colloc.gpu.sim.mps_protocol import ExactLineReader
from slurm_colloc.gpu.sim.state import init_state
from slurm_colloc.mps import v3
from slurm_colloc.mps.v3 import MpsV3Error, MpsV3Node, detect, run_bounded

ROOT = Path(__file__).resolve().parents[2]
USER_A, USER_B = 1001, 1002

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (setuid clients)")


# --- helpers ----------------------------------------------------------------------
def script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def stand_in(directory: Path) -> str:
    """The v3 stand-in as a program of its own (its identity is this script's path)."""
    path = directory / "nvidia-cuda-mps-control"
    path.write_text(
        f"#!{sys.executable}\nimport sys\n"
        "from slurm_colloc.gpu.sim.mps_v3_control import main\nsys.exit(main())\n"
    )
    path.chmod(0o755)
    return str(path)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


class UserClient:
    """A CUDA client of ``uid`` (forked, setuid) on ``pipe_dir/control``; holds on."""

    def __init__(self, uid: int, pipe_dir: Path) -> None:
        self.uid = uid
        r, w = os.pipe()
        r2, w2 = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            try:
                os.close(r)
                os.close(w2)
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                s.settimeout(5)
                try:
                    s.connect(str(pipe_dir / "control"))
                except OSError as e:
                    os.write(w, f"ERR {e.errno}\n".encode())
                    os._exit(0)
                s.sendall(b"CLIENT 0\n")
                line = ExactLineReader(s).read_line()
                os.write(w, ((line or "EOF") + "\n").encode())
                os.read(r2, 1)  # hold the connection until released
                s.settimeout(1)
                try:
                    rest = s.recv(256)
                except OSError:
                    rest = b""
                os.write(w, b"AFTER " + rest.replace(b"\n", b" ").strip() + b"\n")
            finally:
                os._exit(0)
        os.close(w)
        os.close(r2)
        self.pid, self._out, self._release = pid, os.fdopen(r, "rb"), w2
        self.first = self._line()

    def _line(self, timeout: float = 10) -> str:
        ready, _, _ = select.select([self._out], [], [], timeout)
        assert ready, "client did not answer"
        return self._out.readline().decode().strip()

    def release(self) -> str:
        """Let it read what the daemon sent after READY; that text ('AFTER ...')."""
        with contextlib.suppress(OSError):
            os.write(self._release, b"x")
        after = self._line() if not self.first.startswith("ERR") else ""
        self.close()
        return after

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._release)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        self._out.close()


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """Socket paths must stay under 108 bytes: a short directory of our own."""
    d = Path(tempfile.mkdtemp(prefix="v3", dir="/tmp"))
    d.chmod(0o755)  # jobs traverse it to their namespace socket, as on a node
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def sim(short_tmp: Path) -> dict[int, str]:
    spec = init_state(short_tmp / "sim", gpu_count=2, memory_mib=40960)
    return {i: spec.uuid(i) for i in range(2)}


@pytest.fixture
def node(short_tmp: Path, sim: dict[int, str]) -> Iterator[MpsV3Node]:
    n = MpsV3Node(stand_in(short_tmp), short_tmp / "pipe", short_tmp / "log",
                  short_tmp / "state", extra_env={"COLLOC_SIM_STATE": str(short_tmp / "sim")})
    n.start(sim)
    yield n
    n.stop()


# --- detection --------------------------------------------------------------------
V3_HELP = """Usage: nvidia-cuda-mps-control [options] [<module> <verb> [args]]
  -h, --help              Print this message.
  -d, --daemon            Setup the daemon in the background.
  -m, --multiuser         Enable multiuser mode.
  -p, --protocol <2|3>    Protocol 2 (legacy, default) or 3.
Modules: server, namespace, client, device, sm-partition, feature, memacct, context-share
"""


def test_detect_v3_help_lists_server_and_namespace(tmp_path):
    (tmp_path / "help.txt").write_text(V3_HELP)
    fake = script(tmp_path / "mps", f'[ "$1 $2 $3" = "-p 3 -h" ] || exit 9\ncat {tmp_path}/help.txt\n')
    cap = detect(fake)
    assert cap.protocol == 3 and cap.multiuser, cap
    assert "MPS v3" in cap.detail


def test_detect_older_driver_rejecting_p_is_protocol_2(tmp_path):
    fake = script(tmp_path / "mps", 'echo "nvidia-cuda-mps-control: invalid option -- \'p\'" >&2\nexit 1\n')
    cap = detect(fake)
    assert cap.protocol == 2 and not cap.multiuser
    assert "exited 1" in cap.detail and "invalid option" in cap.detail


def test_detect_help_without_modules_is_protocol_2(tmp_path):
    fake = script(tmp_path / "mps", 'echo "Usage: nvidia-cuda-mps-control [-d | -f]"; echo "start_server -uid"\n')
    cap = detect(fake)
    assert cap.protocol == 2 and "no server and namespace" in cap.detail


def test_detect_missing_binary_and_hanging_binary(tmp_path):
    cap = detect(str(tmp_path / "nope"))
    assert cap.protocol == 2 and "cannot run" in cap.detail
    hang = script(tmp_path / "hang", "exec sleep 30\n")
    t0 = time.monotonic()
    cap = detect(hang, timeout=0.5)
    assert cap.protocol == 2 and "did not finish" in cap.detail
    assert time.monotonic() - t0 < 5


def test_detect_runs_without_a_shell_and_with_a_minimal_env(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_MPS_PROTOCOL_VERSION", "2")  # would win over -p 3
    monkeypatch.setenv("LD_PRELOAD", "/nonexistent.so")
    out = tmp_path / "env.txt"
    fake = script(tmp_path / "mps", f"env > {out}\necho 'Modules: server, namespace'\n")
    assert detect(fake).protocol == 3
    env = out.read_text()
    assert "CUDA_MPS_PROTOCOL_VERSION" not in env and "LD_PRELOAD" not in env


def test_detect_bounds_the_output(tmp_path):
    fake = script(tmp_path / "mps", "yes server namespace | head -c 5000000\n")
    rc, out, _ = run_bounded([fake], {"PATH": "/usr/bin:/bin"}, 10)
    assert rc == 0 and len(out) == v3.MAX_OUTPUT


def test_detect_the_stand_in(short_tmp):
    cap = detect(stand_in(short_tmp))
    assert cap.protocol == 3 and cap.multiuser, cap


# --- the node driver --------------------------------------------------------------
def test_start_writes_root_config_and_locks_shared_routes(node, short_tmp, sim):
    assert node.running()
    conf = node.config_file
    st = conf.stat()
    assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o600
    text = conf.read_text()
    assert f'[servers.gpu0]\nallowed_devices = "{sim[0]}"' in text and "uid = 0" in text
    assert {s["name"] for s in node.servers()} == {"gpu0", "gpu1"}
    for sock in ("control", "gpu0/control", "gpu0/default/control", "gpu1/control"):
        st = (short_tmp / "pipe" / sock).lstat()
        assert stat.S_ISSOCK(st.st_mode) and st.st_uid == 0
        assert stat.S_IMODE(st.st_mode) == 0o600, sock
    # users cannot reach a GPU through a route without a job's limit
    c = UserClient(USER_A, short_tmp / "pipe" / "gpu0")
    assert c.first == "ERR 13"
    c.close()
    assert v3.running_protocol(node.binary, short_tmp / "pipe") == 3
    node.start(sim)  # running for the same GPUs: kept
    with pytest.raises(MpsV3Error, match="stop it first"):
        node.start({0: sim[0]})


def test_two_users_share_one_gpu_server_each_with_its_namespace_limit(node, short_tmp, sim):
    env_a = node.add_job(0, sim[0], 101, USER_A, USER_A, 4096, 30)
    env_b = node.add_job(0, sim[0], 102, USER_B, USER_B, 8192, 0)
    pipe = short_tmp / "pipe"
    assert env_a == {
        "CUDA_MPS_PIPE_DIRECTORY": str(pipe / "gpu0" / "job101"),
        "CUDA_MPS_LOG_DIRECTORY": str(short_tmp / "log"),
        "CUDA_VISIBLE_DEVICES": sim[0],
    }
    for env, uid in ((env_a, USER_A), (env_b, USER_B)):
        d = Path(env["CUDA_MPS_PIPE_DIRECTORY"])
        dst, sst = d.lstat(), (d / "control").lstat()
        assert dst.st_uid == 0 and not dst.st_mode & 0o022  # the directory stays root's
        assert sst.st_uid == uid and stat.S_IMODE(sst.st_mode) == 0o600
    server_pid = int(next(s["pid"] for s in node.servers() if s["name"] == "gpu0"))

    a = UserClient(USER_A, Path(env_a["CUDA_MPS_PIPE_DIRECTORY"]))
    b = UserClient(USER_B, Path(env_b["CUDA_MPS_PIPE_DIRECTORY"]))  # no WAIT for A's server
    try:
        assert a.first == f"READY {server_pid} 4096 30 {sim[0]}"
        assert b.first == f"READY {server_pid} 8192 100 {sim[0]}"
        assert sorted(ns for _, ns in node.clients("gpu0")) == ["job101", "job102"]
        for uid, other in ((USER_B, env_a), (USER_A, env_b)):
            intruder = UserClient(uid, Path(other["CUDA_MPS_PIPE_DIRECTORY"]))
            assert intruder.first == "ERR 13"  # EACCES: not the job's user
            intruder.close()
        assert node.remove_job(101) == "forced"  # its client was still connected
        assert a.release() == "AFTER TERMINATED"
    finally:
        a.close()
        b.release()
    assert node.remove_job(102) == "deleted"
    assert node.remove_job(102) == "absent" and node.remove_job(999) == "absent"
    assert not (pipe / "gpu0" / "job101").exists() and node.jobs() == []


def test_add_job_is_idempotent_and_sweeps_a_foreign_early_client(node, short_tmp, sim):
    # a user polling for the predictable name gets in before the socket is handed over
    node.command("namespace", "create", "job7", "--server=gpu0", silent=True)
    early = UserClient(USER_B, short_tmp / "pipe" / "gpu0" / "job7")
    try:
        assert early.first.startswith("READY")
        env = node.add_job(0, sim[0], 7, USER_A, USER_A, 2048, 0)
        assert early.release() == "AFTER TERMINATED"
    finally:
        early.close()
    assert node.add_job(0, sim[0], 7, USER_A, USER_A, 2048, 0) == env
    assert [r.namespace for r in node.jobs()] == ["job7"]


def test_simjob_is_a_namespace_client_held_to_the_namespace_limit(node, short_tmp, sim):
    env = node.add_job(1, sim[1], 55, USER_A, USER_A, 4096, 0)
    base = {"PATH": "/usr/bin:/bin", "COLLOC_SIM_STATE": str(short_tmp / "sim"),
            "PYTHONPATH": str(ROOT), **env}
    cmd = [sys.executable, "-m", "slurm_colloc.gpu.sim.simjob", "--seconds", "0.3"]
    ok = subprocess.run([*cmd, "--mem", "2G"], env=base, capture_output=True, text=True,
                        timeout=60)
    assert ok.returncode == 0, ok.stderr
    # the client's own variable cannot raise the namespace's limit
    over = subprocess.run([*cmd, "--mem", "6G"], capture_output=True, text=True, timeout=60,
                          env={**base, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=20G"})
    assert over.returncode == 1 and "out of memory" in over.stderr.lower(), over.stderr


def test_a_fault_reaches_every_users_namespace_on_that_gpu(node, short_tmp, sim):
    env_a = node.add_job(0, sim[0], 201, USER_A, USER_A, 1024, 0)
    env_b = node.add_job(0, sim[0], 202, USER_B, USER_B, 1024, 0)
    env_c = node.add_job(1, sim[1], 203, USER_B, USER_B, 1024, 0)
    b = UserClient(USER_B, Path(env_b["CUDA_MPS_PIPE_DIRECTORY"]))
    c = UserClient(USER_B, Path(env_c["CUDA_MPS_PIPE_DIRECTORY"]))
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # root: user A's job, by hand
    s.connect(str(Path(env_a["CUDA_MPS_PIPE_DIRECTORY"]) / "control"))
    s.sendall(b"CLIENT 0\n")
    assert (ExactLineReader(s).read_line() or "").startswith("READY")
    s.sendall(b"FAULT\n")
    time.sleep(0.3)
    late = UserClient(USER_A, Path(env_a["CUDA_MPS_PIPE_DIRECTORY"]))
    try:
        assert late.first == "NOTREADY"  # the shared server recovers for everyone
        assert b.release() == "AFTER FATAL"  # another user's job on the same GPU
    finally:
        late.close()
        b.close()
        s.close()
    c_after = c.release()
    assert c_after == "AFTER", c_after  # the other GPU's server is not affected
    time.sleep(0.3)
    again = UserClient(USER_A, Path(env_a["CUDA_MPS_PIPE_DIRECTORY"]))
    assert again.first.startswith("READY")  # recovered once every client left
    again.release()


def test_stop_leaves_no_process_and_only_signals_verified_pids(node, short_tmp):
    ident = node.identity()
    assert ident is not None
    servers = [int(s["pid"]) for s in node.servers()]
    assert servers and all(alive(p) for p in servers)
    node.stop()
    assert not alive(ident.pid) and not any(alive(p) for p in servers)
    assert not (short_tmp / "pipe" / "control").exists()
    assert node.identity() is None and not node.running()
    assert node.stop() == []  # idempotent


def test_stop_kills_a_daemon_that_ignores_quit_but_never_a_stranger(node, short_tmp):
    ident = node.identity()
    assert ident is not None
    servers = [int(s["pid"]) for s in node.servers()]
    node.timeout = 1.0  # every command to it will time out
    os.kill(ident.pid, 19)  # SIGSTOP: it can no longer answer -q
    try:
        signalled = node.stop(timeout=1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(ident.pid, 18)
    assert ident.pid in signalled and not alive(ident.pid)
    assert not any(alive(p) for p in servers)  # recorded at start: not orphaned
    # a recorded identity whose pid now belongs to someone else is never signalled
    stranger = subprocess.Popen(["sleep", "30"])
    try:
        (short_tmp / "state" / "daemon.json").write_text(
            f'{{"pid": {stranger.pid}, "start_ticks": 1, "binary": "{node.binary}", '
            f'"pipe_dir": "{short_tmp / "pipe"}"}}')
        os.chmod(short_tmp / "state" / "daemon.json", 0o600)
        assert node.stop() == [] and stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


# --- errors -----------------------------------------------------------------------
def test_error_replies_raise(node, sim):
    with pytest.raises(MpsV3Error, match="invalid namespace name"):
        node.command("namespace", "create", "Job-1", "--server=gpu0", silent=True)
    with pytest.raises(MpsV3Error, match="not found"):
        node.command("namespace", "delete", "job404", "--server=gpu0", silent=True)
    with pytest.raises(MpsV3Error, match="at least one option"):
        node.command("namespace", "set", "default", "--server=gpu0", silent=True)
    with pytest.raises(MpsV3Error, match="pinned memory limit"):
        node.add_job(0, sim[0], 1, USER_A, USER_A, 0, 0)
    with pytest.raises(MpsV3Error, match="0-100"):
        node.add_job(0, sim[0], 1, USER_A, USER_A, 1024, 101)
    with pytest.raises(MpsV3Error, match="not served"):
        node.add_job(0, sim[1], 1, USER_A, USER_A, 1024, 0)
    assert node.jobs() == []


def test_silent_verb_with_output_and_nonzero_exit_raise(tmp_path):
    n = MpsV3Node(script(tmp_path / "a", 'echo "Error: namespace exists"\n'), tmp_path / "p",
                  tmp_path / "l", tmp_path / "s")
    with pytest.raises(MpsV3Error, match="unexpected reply"):
        n._run("namespace", "create", "job1", "--server=gpu0", silent=True)
    assert n._run("server", "list").strip() == "Error: namespace exists"
    n = MpsV3Node(script(tmp_path / "b", "exit 3\n"), tmp_path / "p", tmp_path / "l",
                  tmp_path / "s")
    with pytest.raises(MpsV3Error, match="exit 3"):
        n._run("server", "list")
    with pytest.raises(MpsV3Error, match="no MPS v3 daemon of ours"):
        n.command("server", "list")


def test_start_refuses_a_gpu_that_is_not_on_the_node(short_tmp, sim):
    n = MpsV3Node(stand_in(short_tmp), short_tmp / "pipe", short_tmp / "log",
                  short_tmp / "state", extra_env={"COLLOC_SIM_STATE": str(short_tmp / "sim")})
    with pytest.raises(MpsV3Error, match="not a GPU UUID"):
        n.start({0: 'GPU-x"\n[evil]'})
    with pytest.raises(MpsV3Error, match="not running"):
        n.start({0: sim[0], 1: "GPU-00000000-0000-0000-0000-000000000000"})
    assert not n.running() and n.identity() is None
    assert not (short_tmp / "pipe" / "control").exists()


def test_a_pipe_dir_someone_else_can_write_is_refused(node, short_tmp, sim):
    os.chmod(short_tmp / "pipe" / "gpu0", 0o777)
    try:
        with pytest.raises(MpsV3Error, match="only root can write"):
            node.add_job(0, sim[0], 9, USER_A, USER_A, 1024, 0)
    finally:
        os.chmod(short_tmp / "pipe" / "gpu0", 0o755)


# --- the stand-in itself ------------------------------------------------------------
def sim_control(short_tmp: Path, *args: str, env: dict[str, str] | None = None):
    e = {"PATH": "/usr/bin:/bin", "CUDA_MPS_PIPE_DIRECTORY": str(short_tmp / "p"),
         "CUDA_MPS_LOG_DIRECTORY": str(short_tmp / "l"), "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "slurm_colloc.gpu.sim.mps_v3_control", *args],
                          env=e, capture_output=True, text=True, timeout=30)


def test_stand_in_refuses_unknown_config_keys(short_tmp):
    bad = short_tmp / "bad.toml"
    bad.write_text('[servers.gpu0]\nallowed_devices = "GPU-1"\nmemory = "1G"\n')
    r = sim_control(short_tmp, "-d", "-p", "3", "-a", str(bad))
    assert r.returncode == 1 and "unknown key 'memory'" in r.stderr
    bad.write_text('[servers.gpu0.namespaces.a]\nuid = 5\n')
    r = sim_control(short_tmp, "-d", "-p", "3", "-a", str(bad))
    assert r.returncode == 1 and "unknown key 'uid'" in r.stderr
    assert not (short_tmp / "p" / "control").exists()


def test_stand_in_single_user_mode_refuses_other_uids(short_tmp):
    conf = short_tmp / "c.toml"
    conf.write_text('schema_version = "1.0"\n[servers.solo.namespaces.ns]\n'
                    'pinned_memory_limit = "2G"\n')
    r = sim_control(short_tmp, "-d", "-p", "3", "-a", str(conf))
    assert r.returncode == 0, r.stderr
    try:
        other = UserClient(USER_A, short_tmp / "p" / "solo" / "ns")
        assert other.first == "NOTPERMITTED"
        other.close()
        r = sim_control(short_tmp, "namespace", "list", "--format=csv")  # follows protocol 3
        assert r.returncode == 0 and "ns,solo,Ready,2G,-,-," in r.stdout
        r = sim_control(short_tmp, "-p", "3", "server", "create", "two", "--uid=5")
        assert r.returncode == 0, r.stderr  # single-user mode: any owner uid
    finally:
        assert sim_control(short_tmp, "-q").returncode == 0
    deadline = time.monotonic() + 10
    while (short_tmp / "p" / "control").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (short_tmp / "p" / "control").exists()


def test_stand_in_protocol_env_wins_and_v2_is_the_legacy_stand_in(short_tmp):
    r = sim_control(short_tmp, "-p", "3", "-h", env={"CUDA_MPS_PROTOCOL_VERSION": "2"})
    assert r.returncode == 0 and "Modules" not in r.stdout
    r = sim_control(short_tmp, "-h", env={"CUDA_MPS_PROTOCOL_VERSION": "3"})
    assert "Modules: server, namespace" in r.stdout
    r = sim_control(short_tmp, "-m", "-d")
    assert r.returncode == 1 and "protocol 3" in r.stderr


def test_a_v3_daemon_that_starts_but_is_not_recognised_is_asked_to_quit(short_tmp, sim):
    """The legacy daemon's H100 finding (issue 24), for v3: a site wrapper in
    ``mps_control`` that execs the daemon under another name. The start times out
    naming the check that failed, and the daemon it ran is not left behind with its
    root servers (no identity in root state: no epilog would ever stop it)."""
    real = Path(stand_in(short_tmp))
    hidden = real.with_name("site-mps-v3")
    real.rename(hidden)
    wrapper = script(short_tmp / "site-mps-launcher", f'exec {hidden} "$@"\n')
    n = MpsV3Node(wrapper, short_tmp / "pipe", short_tmp / "log", short_tmp / "state",
                  timeout=4, extra_env={"COLLOC_SIM_STATE": str(short_tmp / "sim")})
    with pytest.raises(MpsV3Error, match="asked to quit") as err:
        n.start(sim)
    assert "not" in str(err.value).split("s:", 1)[1]  # the failed check, not only "timeout"
    assert n.identity() is None
    deadline = time.monotonic() + 5
    while (short_tmp / "pipe" / "control").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (short_tmp / "pipe" / "control").exists()
    leftovers = [int(p) for p in os.listdir("/proc") if p.isdigit() and alive(int(p))
                 and str(short_tmp / "pipe") in _environ(int(p))]
    assert leftovers == []


def _environ(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""
