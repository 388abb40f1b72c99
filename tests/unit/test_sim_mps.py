"""The nvidia-cuda-mps-control stand-in: daemon start, commands, per-UID servers, quit."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from slurm_colloc.gpu.sim.mps_protocol import parse_ready

ROOT = Path(__file__).resolve().parents[2]


def env_for(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(
        CUDA_MPS_PIPE_DIRECTORY=str(tmp_path / "pipe"),
        CUDA_MPS_LOG_DIRECTORY=str(tmp_path / "log"),
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    return env


def control(env: dict[str, str], *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "slurm_colloc.gpu.sim.mps_control", *args],
        input=stdin,
        env=env,
        capture_output=True,
        text=True,
        timeout=20,
    )


@pytest.fixture
def daemon(tmp_path):
    env = env_for(tmp_path)
    r = control(env, "-d")
    assert r.returncode == 0, r.stderr
    yield env
    control(env, stdin="quit\n")


def client(pipe: str, device: int = 0) -> tuple[socket.socket, str]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(os.path.join(pipe, "control"))
    s.sendall(f"CLIENT {device}\n".encode())
    s.settimeout(5)
    return s, s.makefile().readline().strip()


def test_daemon_creates_socket_pidfile_and_log(tmp_path, daemon):
    pipe = tmp_path / "pipe"
    assert (pipe / "control").exists()
    pid = int((pipe / "nvidia-cuda-mps-control.pid").read_text())
    os.kill(pid, 0)
    log = (tmp_path / "log" / "control.log").read_text()
    assert f"Control {pid}] Starting control daemon" in log
    second = control(daemon, "-d")  # one daemon per pipe dir
    assert second.returncode != 0 and "already running" in second.stderr


def test_commands_and_defaults(daemon):
    r = control(
        daemon,
        stdin="set_default_device_pinned_mem_limit 0 8G\nget_default_device_pinned_mem_limit 0\n"
        "set_default_active_thread_percentage 40\nget_default_active_thread_percentage\n"
        "get_server_list\nno_such_command\nset_default_device_pinned_mem_limit 0 lots\n",
    )
    lines = r.stdout.splitlines()
    assert lines[0] == "8192M" and lines[1] == "40.0"
    assert "Unrecognized command: no_such_command" in lines[2]
    assert "invalid arguments" in lines[3]


def test_start_server_and_client_get_defaults(daemon):
    control(
        daemon, stdin=f"set_default_device_pinned_mem_limit 0 4G\nstart_server -uid {os.getuid()}\n"
    )
    pids = control(daemon, stdin="get_server_list\n").stdout.split()
    assert len(pids) == 1
    os.kill(int(pids[0]), 0)  # a live server process
    s, line = client(daemon["CUDA_MPS_PIPE_DIRECTORY"])
    grant = parse_ready(line)
    assert grant.server_pid == int(pids[0])
    assert grant.limit_mib == 4096 and grant.active_thread_pct == 100
    assert control(daemon, stdin=f"get_client_list {pids[0]}\n").stdout.split() == [
        str(os.getpid())
    ]
    # defaults change later apply to the next server only
    control(daemon, stdin="set_default_device_pinned_mem_limit 0 2G\n")
    s2, line2 = client(daemon["CUDA_MPS_PIPE_DIRECTORY"])
    assert parse_ready(line2).limit_mib == 4096
    s.close()
    s2.close()
    time.sleep(0.4)
    assert control(daemon, stdin=f"get_client_list {pids[0]}\n").stdout.strip() == ""


def test_client_starts_server_on_demand_and_quit_stops_everything(tmp_path, daemon):
    s, line = client(daemon["CUDA_MPS_PIPE_DIRECTORY"])
    server_pid = parse_ready(line).server_pid
    r = control(daemon, stdin="quit\n")
    assert r.returncode == 0
    deadline = time.time() + 5
    while (tmp_path / "pipe" / "control").exists() and time.time() < deadline:
        time.sleep(0.05)
    assert not (tmp_path / "pipe" / "control").exists()
    assert not (tmp_path / "pipe" / "nvidia-cuda-mps-control.pid").exists()
    with pytest.raises(ProcessLookupError):
        for _ in range(50):
            os.kill(server_pid, 0)
            time.sleep(0.05)
    s.close()
    log = (tmp_path / "log" / "control.log").read_text()
    assert f"Server {server_pid} exited with status" in log and "Exit" in log


def test_ui_without_daemon_fails(tmp_path):
    r = control(env_for(tmp_path), stdin="get_server_list\n")
    assert r.returncode == 1 and "Cannot find MPS control daemon" in r.stderr


def _client_as(uid: int, pipe: str, hold_s: float, wfd: int) -> None:
    """Forked child: become `uid`, register, report every line, hold, exit."""
    os.setgid(65534)
    os.setuid(uid)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(os.path.join(pipe, "control"))
    s.sendall(b"CLIENT 0\n")
    f = s.makefile()
    while True:
        line = f.readline()
        os.write(wfd, f"{time.monotonic():.3f} {line}".encode())
        if not line or line.startswith("READY"):
            break
    time.sleep(hold_s)
    os._exit(0)


@pytest.fixture
def shared_daemon():
    """A daemon in a directory another user can reach (pytest's tmp dirs are 0700)."""
    d = Path(tempfile.mkdtemp(prefix="colloc-mps-test-"))
    os.chmod(d, 0o755)
    env = env_for(d)
    assert control(env, "-d").returncode == 0
    os.chmod(d / "pipe", 0o755)
    yield d, env
    control(env, stdin="quit\n")
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as two users")
def test_second_uid_waits_until_first_uids_clients_are_gone(shared_daemon):
    d, env = shared_daemon
    pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
    first, line = client(pipe)  # uid 0
    first_server = parse_ready(line).server_pid
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.close(r)
            first.close()  # else the child keeps uid 0's client connection alive
            _client_as(65534, pipe, 0.5, w)
        finally:
            os._exit(1)
    os.close(w)
    reader = os.fdopen(r)
    wait_line = reader.readline().split()
    assert wait_line[1:] == ["WAIT", "0", str(first_server), "1"]
    time.sleep(0.5)
    released = time.monotonic()
    first.close()  # the first user's only client goes away
    ready = reader.readline().split()
    assert ready[1] == "READY" and float(ready[0]) >= released - 0.01
    assert int(ready[2]) != first_server
    os.waitpid(pid, 0)
    servers = control(env, stdin="get_server_list\n").stdout.split()
    assert str(first_server) not in servers
    log = (d / "log" / "control.log").read_text()
    assert "Starting new server" in log and "for user 65534" in log


# --- the server-side limit holds without the client's cooperation (issue 11, H2) ------


def test_running_servers_pinned_limit_can_be_set_for_new_clients(daemon):
    control(daemon, stdin=f"start_server -uid {os.getuid()}\n")
    pid = control(daemon, stdin="get_server_list\n").stdout.split()[0]
    s1, line1 = client(daemon["CUDA_MPS_PIPE_DIRECTORY"])
    assert parse_ready(line1).limit_mib is None  # no limit yet
    r = control(
        daemon,
        stdin=f"set_device_pinned_mem_limit {pid} 0 6G\n"
        f"get_device_pinned_mem_limit {pid} 0\nset_device_pinned_mem_limit 1 0 6G\n",
    )
    lines = r.stdout.splitlines()
    assert lines[0] == "6144M" and "no server with PID 1" in lines[1]
    s2, line2 = client(daemon["CUDA_MPS_PIPE_DIRECTORY"])
    assert parse_ready(line2).limit_mib == 6144
    assert control(daemon, stdin="get_default_device_pinned_mem_limit 0\n").stdout.strip() == "0"
    s1.close()
    s2.close()


@pytest.fixture
def sim_gpus(tmp_path):
    from slurm_colloc.gpu.sim import init_state

    init_state(tmp_path / "state", gpu_count=1, memory_mib=40960)
    return tmp_path / "state"


def simjob_env(state: Path, base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    src = base if base is not None else dict(os.environ)
    env = {k: v for k, v in src.items() if not k.startswith(("COLLOC_", "CUDA_MPS_PINNED"))}
    if base is None:
        env = {k: v for k, v in env.items() if not k.startswith("CUDA_")}
    env.update(PYTHONPATH=str(ROOT), COLLOC_SIM_STATE=str(state), CUDA_VISIBLE_DEVICES="0")
    env.update(extra)
    return env


def simjob(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "slurm_colloc.gpu.sim.simjob", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("client_limit", [None, "0=30G", "30G"])
def test_client_cannot_raise_or_drop_the_servers_default_limit(daemon, sim_gpus, client_limit):
    control(daemon, stdin="set_default_device_pinned_mem_limit 0 2G\n")
    extra = {} if client_limit is None else {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": client_limit}
    _out, err = (
        p := simjob(simjob_env(sim_gpus, daemon, **extra), "--mem", "3G", "--seconds", "0.3")
    ).communicate(timeout=30)
    assert p.returncode == 1 and "total capacity of 2.00 GiB" in err


def test_client_can_lower_the_servers_default_limit(daemon, sim_gpus):
    control(daemon, stdin="set_default_device_pinned_mem_limit 0 8G\n")
    env = simjob_env(sim_gpus, daemon, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=1G")
    # the limit binds allocations: footprint 1537 MiB = 512 MiB context + 1025 MiB
    _out, err = (p := simjob(env, "--mem", "1537M", "--seconds", "0.3")).communicate(timeout=30)
    assert p.returncode == 1 and "total capacity of 1024.00 MiB" in err, err[-400:]


def test_job_without_mps_env_shows_up_as_a_non_mps_process(daemon, sim_gpus):
    from slurm_colloc.gpu.sim import SimBackend

    with_mps = simjob(simjob_env(sim_gpus, daemon), "--mem", "1G", "--seconds", "30")
    bypass = simjob(simjob_env(sim_gpus), "--mem", "2G", "--seconds", "30")  # env -i style
    try:
        backend = SimBackend(sim_gpus)
        deadline = time.monotonic() + 15
        procs: dict[int, bool | None] = {}
        while time.monotonic() < deadline and len(procs) < 3:
            procs = {p.pid: p.mps_client for p in backend.sample(0).processes}
            time.sleep(0.05)
        servers = control(daemon, stdin="get_server_list\n").stdout.split()
        assert len(servers) == 1
        server = int(servers[0])
        # the MPS server is a compute process and no MPS client, as NVML lists it
        assert procs == {with_mps.pid: True, bypass.pid: False, server: False}
        # the driver's reserve, one MPS server, both footprints
        sample = backend.sample(0)
        while sum(p.used_mib for p in sample.processes) < 3072 + 64 and \
                time.monotonic() < deadline:
            time.sleep(0.05)  # each creates its context before it allocates
            sample = backend.sample(0)
        assert sample.memory_used_mib == 512 + 64 + 1024 + 2048
        assert sum(p.used_mib for p in sample.processes) == 64 + 1024 + 2048
        from slurm_colloc.gpu.sim.state import read_records

        recs = {r.pid: r.mps_server for r in read_records(sim_gpus, 0)}
        assert recs[bypass.pid] == 0 and str(recs[with_mps.pid]) in servers
    finally:
        for p in (with_mps, bypass):
            p.terminate()
            p.communicate(timeout=10)


# --- the daemon's devices travel with the grant (issue 12) ---------------------------------


def test_ready_line_forms_and_backward_compatibility():
    from slurm_colloc.gpu.sim.mps_protocol import MpsError, format_ready

    old = parse_ready("READY 42 - 100")  # a four-field grant: the server sees every GPU
    assert old.visible_devices is None and old.limit_mib is None
    assert parse_ready("READY 42 4096 50 0,2").visible_devices == "0,2"
    for visible in (None, "", "GPU-1234", "0, 2"):
        line = format_ready(42, 4096, 50.0, visible)
        assert len(line.split()) == 5
        expected = None if visible is None else visible.replace(" ", "")
        assert parse_ready(line).visible_devices == expected
    for bad in ("READY 42 - 100 0 extra", "READY x - 100", "WAIT 1 2 3"):
        with pytest.raises(MpsError):
            parse_ready(bad)


@pytest.mark.parametrize("visible", [None, "GPU-6f1e5d1c-aaaa", "1,3"])
def test_daemon_hands_its_visible_devices_to_clients(tmp_path, visible):
    env = env_for(tmp_path)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    assert control(env, "-d").returncode == 0
    try:
        s, line = client(env["CUDA_MPS_PIPE_DIRECTORY"])
        assert parse_ready(line).visible_devices == visible
        s.close()
        shown = "<unset>" if visible is None else visible
        assert f"CUDA_VISIBLE_DEVICES={shown}" in (tmp_path / "log" / "control.log").read_text()
    finally:
        control(env, stdin="quit\n")


def test_the_c_client_answers_as_the_python_client_does(daemon):
    """The lab's launcher is a C client where a compiler exists (issue 28: ~1 ms a run,
    as NVIDIA's; ``gpu/sim/mps_ui.c``); it must print what ``mps_ui.py`` prints for the
    same commands, errors included, and its daemon mode must still be the stand-in."""
    from slurm_colloc.gpu.sim import tools

    launcher = tools.tool("colloc-sim-mps-control")
    if not launcher.read_bytes().startswith(b"\x7fELF"):
        pytest.skip("no C compiler: the lab uses the Python launcher")
    commands = ("get_server_list\n\n  set_default_device_pinned_mem_limit 0 2G  \n"
                "get_default_device_pinned_mem_limit 0\nno_such_command 1\n"
                "set_default_active_thread_percentage 50\n"
                "get_default_active_thread_percentage\nget_server_list\n")
    py = control(daemon, stdin=commands)
    c = subprocess.run([str(launcher)], input=commands, env=daemon, capture_output=True,
                       text=True, timeout=20)
    assert (c.returncode, c.stdout, c.stderr) == (py.returncode, py.stdout, py.stderr)
    assert "2G" in c.stdout or "2048" in c.stdout
    gone = {**daemon, "CUDA_MPS_PIPE_DIRECTORY": daemon["CUDA_MPS_PIPE_DIRECTORY"] + "-x"}
    c = subprocess.run([str(launcher)], input="get_server_list\n", env=gone,
                       capture_output=True, text=True, timeout=20)
    assert c.returncode == 1 and "Cannot find MPS control daemon process" in c.stderr
    # with arguments it is the Python stand-in, appended to it as a zip
    h = subprocess.run([str(launcher), "--help"], capture_output=True, text=True, timeout=60)
    assert h.returncode == 0 and h.stdout.startswith("usage: colloc-sim-mps-control")
