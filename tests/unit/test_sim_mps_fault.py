"""MPS error containment, simulated: one client's fatal fault reaches every client of its
server, the server refuses new clients until all have exited, then recovers."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from slurm_colloc.gpu.sim import init_state, load_spec
from slurm_colloc.gpu.sim.mps_client import ServerNotReady, request_server
from slurm_colloc.gpu.sim.mps_protocol import ExactLineReader, parse_ready
from slurm_colloc.gpu.sim.state import read_records
from tests.unit.test_sim_simjob import simjob

ROOT = Path(__file__).resolve().parents[2]
CTL = [sys.executable, "-m", "slurm_colloc.gpu.sim.mps_control"]
ILLEGAL = "RuntimeError: CUDA error: an illegal memory access was encountered"
NOT_READY = "RuntimeError: CUDA error: MPS server is not ready to accept new MPS client requests"
HINTS = (
    "CUDA kernel errors might be asynchronously reported at some other API call, "
    "so the stacktrace below might be incorrect.\n"
    "For debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
)
RECOVERED = "All clients exited: recovered"
TIMEOUT = 60.0  # generous: a loaded 2-core machine starts Python slowly


def base_env(state: Path, gpu: str = "0") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "COLLOC_"))}
    env.update(PYTHONPATH=str(ROOT), COLLOC_SIM_STATE=str(state), CUDA_VISIBLE_DEVICES=gpu)
    return env


def start_daemon(root: Path, state: Path, gpu: str = "0") -> dict[str, str]:
    """A daemon with its own pipe/log dirs under ``root`` (one daemon = one GPU).

    As the prolog does it: daemon and clients name the GPU by UUID, the one name
    that means the same GPU inside and outside MPS (a client keeping the node's index
    of a GPU other than 0 finds no device under a daemon that sees only that GPU).
    """
    name = gpu
    if (state / "spec.json").exists():
        name = load_spec(state).uuid(int(gpu))
    env = base_env(state, name)
    env.update(CUDA_MPS_PIPE_DIRECTORY=str(root / "pipe"), CUDA_MPS_LOG_DIRECTORY=str(root / "log"))
    r = subprocess.run([*CTL, "-d"], env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr
    return env


def stop_daemon(env: dict[str, str]) -> None:
    subprocess.run(CTL, input="quit\n", text=True, env=env, capture_output=True, timeout=TIMEOUT)


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    p = simjob(env, *args)
    try:
        out, err = p.communicate(timeout=TIMEOUT)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def finish(p: subprocess.Popen[str]) -> tuple[str, str]:
    try:
        return p.communicate(timeout=TIMEOUT)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()


def wait_for(cond: Callable[[], bool], what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def pids_on(state: Path, gpu: int) -> set[int]:
    return {r.pid for r in read_records(state, gpu)}


def read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def raw_client(pipe: str) -> tuple[socket.socket, ExactLineReader]:
    """A bare CUDA client: registers, then reads only when told to (FATAL is ignored)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(os.path.join(pipe, "control"))
    s.sendall(b"CLIENT 0\n")
    s.settimeout(TIMEOUT)
    return s, ExactLineReader(s)


def assert_illegal_address(err: str) -> None:
    assert "Traceback (most recent call last):" in err
    assert f"{ILLEGAL}\n{HINTS}" in err, err


@pytest.fixture
def state(tmp_path: Path) -> Path:
    init_state(tmp_path / "state", gpu_count=2, memory_mib=40960)
    return tmp_path / "state"


@pytest.fixture
def mps(tmp_path: Path, state: Path) -> Iterator[dict[str, str]]:
    env = start_daemon(tmp_path / "gpu0", state, "0")
    yield env
    stop_daemon(env)


def logs(env: dict[str, str]) -> tuple[Path, Path]:
    d = Path(env["CUDA_MPS_LOG_DIRECTORY"])
    return d / "control.log", d / "server.log"


# --- the daemon's protocol, with bare clients --------------------------------------------


def test_protocol_fault_fatal_notready_then_recovery(mps):
    pipe = mps["CUDA_MPS_PIPE_DIRECTORY"]
    a, a_lines = raw_client(pipe)
    b, b_lines = raw_client(pipe)
    server_pid = parse_ready(a_lines.read_line() or "").server_pid
    assert parse_ready(b_lines.read_line() or "").server_pid == server_pid
    a.sendall(b"FAULT\n")
    assert b_lines.read_line() == "FATAL"  # the other client is told, not who caused it
    c, c_lines = raw_client(pipe)
    assert c_lines.read_line() == "NOTREADY"
    assert c_lines.read_line() is None  # and closed
    c.close()
    a.setblocking(False)
    with pytest.raises(BlockingIOError):  # the faulting client is not sent FATAL
        a.recv(100)
    a.close()
    ctl_log, srv_log = logs(mps)
    assert RECOVERED not in read(srv_log)  # b is still connected
    b.close()
    wait_for(lambda: RECOVERED in read(srv_log), "the server to recover")
    d, d_lines = raw_client(pipe)
    # the same server, running again
    assert parse_ready(d_lines.read_line() or "").server_pid == server_pid
    d.close()
    srv = read(srv_log)
    assert f"Server {server_pid}] Client " in srv
    assert (
        "encountered a fatal GPU exception; reported to 1 other client(s); "
        "new clients refused until all have exited"
    ) in srv
    assert f"Server {server_pid} is recovering from a fatal exception: not ready" in read(ctl_log)


# --- simjobs ------------------------------------------------------------------------------


def test_fault_kills_every_client_of_the_server_and_the_server_recovers(state, mps):
    victim = simjob(mps, "--mem", "2G", "--seconds", "600", "--time-scale", "1")
    try:
        # it registers its memory only once MPS has granted it a server
        wait_for(lambda: victim.pid in pids_on(state, 0), "the victim to start")
        culprit = simjob(
            mps, "--mem", "3G", "--seconds", "10", "--time-scale", "20", "--fault-at", "0.3"
        )
        c_out, c_err = finish(culprit)
        v_out, v_err = finish(victim)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.communicate()
    assert culprit.returncode == 1 and victim.returncode == 1
    assert_illegal_address(c_err)
    assert_illegal_address(v_err)  # same error: MPS does not say whose fault it was
    assert "epoch 3/10" in c_out and "done:" not in c_out and "done:" not in v_out
    assert pids_on(state, 0) == set()  # both released their memory
    _, srv_log = logs(mps)
    wait_for(lambda: RECOVERED in read(srv_log), "the server to recover")
    srv = read(srv_log)
    assert (
        f"Client {culprit.pid} encountered a fatal GPU exception; reported to 1 other client(s)"
    ) in srv
    assert f"Client {victim.pid} disconnected" in srv
    assert srv.index("fatal GPU exception") < srv.index(RECOVERED)


def test_new_job_is_refused_while_faulted_then_runs_after_recovery(state, mps):
    pipe = mps["CUDA_MPS_PIPE_DIRECTORY"]
    holder, lines = raw_client(pipe)  # a victim that ignores FATAL keeps the fault open
    try:
        server_pid = parse_ready(lines.read_line() or "").server_pid
        culprit = run(mps, "--mem", "1G", "--seconds", "1", "--fault-at", "0")
        assert culprit.returncode == 1
        assert_illegal_address(culprit.stderr)
        assert lines.read_line() == "FATAL"
        with pytest.raises(ServerNotReady):
            request_server(Path(pipe), 0, lambda *a: None, lambda: False)
        refused = run(mps, "--mem", "1G", "--seconds", "1")
        assert refused.returncode == 1, refused.stderr  # a CUDA error, not bad input (2)
        assert "Traceback (most recent call last):" in refused.stderr
        assert f"{NOT_READY}\n{HINTS}" in refused.stderr
        assert "[colloc-simjob]" not in refused.stdout  # it never got to train
        assert pids_on(state, 0) == set()
        ctl_log, srv_log = logs(mps)
        assert "is recovering from a fatal exception: not ready" in read(ctl_log)
        assert RECOVERED not in read(srv_log)
    finally:
        holder.close()
    wait_for(lambda: RECOVERED in read(srv_log), "the server to recover")
    ok = run(mps, "--mem", "1G", "--seconds", "10", "--time-scale", "20")
    assert ok.returncode == 0, ok.stderr
    assert "done:" in ok.stdout
    servers = subprocess.run(
        CTL, input="get_server_list\n", text=True, env=mps, capture_output=True, timeout=TIMEOUT
    ).stdout.split()
    assert servers == [str(server_pid)]  # recovered in place, not restarted


def test_fault_on_another_gpu_leaves_its_jobs_alone(tmp_path, state, mps):
    other = start_daemon(tmp_path / "gpu1", state, "1")  # GPU 1 has its own daemon
    bystander = simjob(other, "--mem", "2G", "--seconds", "600", "--time-scale", "1")
    victim = simjob(mps, "--mem", "2G", "--seconds", "600", "--time-scale", "1")
    try:
        wait_for(lambda: bystander.pid in pids_on(state, 1), "the bystander to start")
        wait_for(lambda: victim.pid in pids_on(state, 0), "the victim to start")
        culprit = run(mps, "--mem", "1G", "--seconds", "1", "--fault-at", "0")
        assert culprit.returncode == 1
        _, v_err = finish(victim)
        assert victim.returncode == 1
        assert_illegal_address(v_err)
        time.sleep(1.0)  # ten ticks in which the bystander would have seen a FATAL
        assert bystander.poll() is None
        bystander.send_signal(signal.SIGTERM)  # cleanup on SIGTERM as ever
        _, b_err = finish(bystander)
        assert bystander.returncode == -signal.SIGTERM
        assert "GPU memory released" in b_err and "CUDA error" not in b_err
        assert pids_on(state, 1) == set()
        assert "fatal GPU exception" not in read(logs(other)[1])
    finally:
        for p in (bystander, victim):
            if p.poll() is None:
                p.kill()
                p.communicate()
        stop_daemon(other)


def test_daemon_going_away_does_not_disturb_a_running_job(state, mps):
    job = simjob(mps, "--mem", "2G", "--seconds", "600", "--time-scale", "1")
    try:
        wait_for(lambda: job.pid in pids_on(state, 0), "the job to start")
        stop_daemon(mps)
        pipe = Path(mps["CUDA_MPS_PIPE_DIRECTORY"])
        wait_for(lambda: not (pipe / "control").exists(), "the daemon to exit")
        time.sleep(1.0)  # ten ticks, each of which sees EOF on the daemon connection
        assert job.poll() is None
        job.send_signal(signal.SIGTERM)
        _, err = finish(job)
        assert job.returncode == -signal.SIGTERM, err
        assert "Traceback" not in err and pids_on(state, 0) == set()
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()


@pytest.mark.parametrize("frac", ["0", "0.5", "1"])
def test_fault_without_mps_is_a_fault_on_a_gpu_of_its_own(state, frac):
    r = run(
        base_env(state), "--mem", "1G", "--seconds", "10", "--time-scale", "20", "--fault-at", frac
    )
    assert r.returncode == 1
    assert_illegal_address(r.stderr)
    assert "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions." in r.stderr
    assert "done:" not in r.stdout
    assert ("epoch 10/10" in r.stdout) == (frac == "1")
    assert pids_on(state, 0) == set()


def test_cuda_launch_blocking_drops_the_hint_lines(state):
    env = {**base_env(state), "CUDA_LAUNCH_BLOCKING": "1"}
    r = run(env, "--mem", "1G", "--seconds", "1", "--fault-at", "0")
    assert r.returncode == 1
    assert f"{ILLEGAL}\nCompile with `TORCH_USE_CUDA_DSA`" in r.stderr
    assert "CUDA_LAUNCH_BLOCKING=1" not in r.stderr


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("-0.1", "--fault-at -0.1: must be a fraction between 0 and 1"),
        ("1.5", "--fault-at 1.5: must be a fraction between 0 and 1"),
        ("nan", "--fault-at nan: must be a fraction between 0 and 1"),
        ("often", "argument --fault-at: invalid float value"),
    ],
)
def test_fault_at_must_be_a_fraction(state, value, needle):
    r = run(base_env(state), "--mem", "1G", "--fault-at", value)
    assert r.returncode == 2
    assert needle in r.stderr and "CUDA error" not in r.stderr


# --- another user ---------------------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")
def test_another_users_client_waits_as_usual_while_the_server_recovers():
    d = Path(tempfile.mkdtemp(prefix="colloc-mps-fault-test-"))
    os.chmod(d, 0o755)
    env = start_daemon(d, d / "no-state")
    pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
    os.chmod(pipe, 0o755)
    holder, lines = raw_client(pipe)  # uid 0
    culprit, c_lines = raw_client(pipe)
    r, w = os.pipe()
    pid = -1
    try:
        first_server = parse_ready(lines.read_line() or "").server_pid
        assert (c_lines.read_line() or "").startswith("READY")
        culprit.sendall(b"FAULT\n")
        assert lines.read_line() == "FATAL"
        culprit.close()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child: uid 65534 asks for a server
            try:
                os.close(r)
                holder.close()  # else the child keeps uid 0's client alive
                os.setgid(65534)
                os.setuid(65534)
                _, child_lines = raw_client(pipe)
                while (line := child_lines.read_line()) is not None:
                    os.write(w, f"{line}\n".encode())
                    if line.startswith("READY"):
                        break
            finally:
                os._exit(0)
        os.close(w)
        answers = os.fdopen(r)
        first = answers.readline().split()
        assert first[:3] == ["WAIT", "0", str(first_server)]  # not NOTREADY: not its server
        holder.close()  # the last client of the faulted server exits
        ready = answers.readline()
        assert ready.startswith("READY") and parse_ready(ready).server_pid != first_server
        srv = read(d / "log" / "server.log")
        assert RECOVERED in srv
        assert "recovering from a fatal exception" not in read(d / "log" / "control.log")
    finally:
        holder.close()
        if pid > 0:
            os.waitpid(pid, 0)
        stop_daemon(env)
        shutil.rmtree(d, ignore_errors=True)
