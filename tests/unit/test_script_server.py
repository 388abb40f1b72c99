"""The node's script server and its client (issue 28: prolog p99 under a burst).

A Prolog handed to a resident server must do exactly what it would have done in its own
process (same log line, same stdio, exit status back), and every way the server can be
missing, slow, declining or dying must end with the script run by the client itself,
never twice, never not at all. Root talks to root only.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_colloc import config as cfgmod
from slurm_colloc import priority as priority_mod
from slurm_colloc import root_lock
from slurm_colloc.node import script_client as client
from slurm_colloc.node import script_server as server
from slurm_colloc.node import script_start
from tests.unit.forked import in_child

REPO = Path(__file__).resolve().parents[2]


def _conf(tmp_path: Path, extra: str = "") -> Path:
    conf = tmp_path / "colloc.conf"
    conf.write_text(
        extra
        + f'mps_root = "{tmp_path / "mps"}"\nlog_file = "{tmp_path / "colloc.log"}"\n'
        f'evidence_dir = "{tmp_path / "ev"}"\nmetrics_dir = "{tmp_path / "metrics"}"\n'
        f'gpu_backend = "sim"\nsim_state_dir = "{tmp_path / "sim"}"\n')
    return conf


def _env(conf: Path, job: int = 7) -> dict[str, str]:
    """slurmd's Prolog environment for a job slurmd bound no GPU to (asks Slurm nothing)."""
    return {"COLLOC_CONF": str(conf), "SLURMD_NODENAME": "n1", "SLURM_JOB_ID": str(job),
            "SLURM_JOB_UID": "1001", "SLURM_JOB_USER": "alice", "PATH": "/usr/bin:/bin"}


def _start_server(run_dir: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    p = subprocess.Popen([sys.executable, "-I", "-m", script_start.MODULE, "--run-dir", str(run_dir)],
                         env=env, cwd="/")
    sock = client.socket_path(env, run_dir)
    deadline = time.monotonic() + 60
    while not sock.exists():
        assert p.poll() is None, "the server exited before listening"
        assert time.monotonic() < deadline, "the server never listened"
        time.sleep(0.05)
    return p


@pytest.fixture
def served(tmp_path: Path, run_dir: Path) -> Iterator[tuple[dict[str, str], Path]]:
    """A real server (its own interpreter) for a config in tmp_path; stopped after."""
    env = _env(_conf(tmp_path))
    p = _start_server(run_dir, env)
    yield env, run_dir
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=30)


def _client_in_subprocess(env: dict[str, str], run_dir: Path) -> subprocess.CompletedProcess[str]:
    """A client in a process of its own (its stdio is what the worker must write to)."""
    code = ("import json, os, sys; from pathlib import Path; "
            "from slurm_colloc.node import script_client as c; "
            f"o = c.call('prolog', dict(os.environ), c.process_start(), run_dir=Path({str(run_dir)!r})); "
            "print(json.dumps([o.status, o.why]), flush=True)")
    return subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120, cwd=REPO)


def test_a_served_prolog_logs_its_line_and_writes_to_the_clients_stderr(served, tmp_path) -> None:
    env, run_dir = served
    p = _client_in_subprocess(env, run_dir)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.splitlines()[-1]) == [0, "served"]
    # the worker's stderr is the client's (slurmd reads it there), and its log line
    # is the one a prolog in its own process writes, timed from the client's start
    assert "colloc: prolog: job 7: none gpu=None no GPU bound by slurmd [took " in p.stderr
    log = (tmp_path / "colloc.log").read_text()
    assert "prolog: job 7: none gpu=None no GPU bound by slurmd [took " in log
    assert "script-server: job -: serving " in log
    # root, on a kernel that groups by session: the server weighted its own group
    grouped = os.geteuid() == 0 and Path("/proc/self/autogroup").exists()
    assert (f"{server.GROUPED}{priority_mod.SERVER_NICE})" in log) == grouped
    # the job's context is in root's state, as after an in-process run
    assert (tmp_path / "mps").exists()


def test_concurrent_clients_are_each_served_once(served, tmp_path) -> None:
    env, run_dir = served
    outs: dict[int, client.Outcome] = {}

    def one(job: int) -> None:
        outs[job] = client.call("prolog", _env(Path(env["COLLOC_CONF"]), job), None,
                                run_dir=run_dir)

    threads = [threading.Thread(target=one, args=(j,)) for j in range(100, 120)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert {j: o.status for j, o in outs.items()} == {j: 0 for j in range(100, 120)}
    log = (tmp_path / "colloc.log").read_text()
    for j in range(100, 120):
        assert log.count(f"prolog: job {j}: none gpu=None") == 1


def test_no_run_directory_or_no_server_means_run_it_here(tmp_path, run_dir) -> None:
    env = _env(_conf(tmp_path))
    assert client.call("prolog", env, run_dir=tmp_path / "nowhere") == client.Outcome(None, "absent")
    out = client.call("prolog", env, run_dir=run_dir)
    assert out.status is None and out.absent


def test_a_run_directory_others_may_enter_is_not_trusted(tmp_path, run_dir, served) -> None:
    env, _ = served
    run_dir.chmod(0o755)
    try:
        assert client.call("prolog", env, run_dir=run_dir).absent
    finally:
        run_dir.chmod(0o700)
    link = tmp_path / "link"
    link.symlink_to(run_dir)
    assert not client.private_dir(link)
    assert client.call("prolog", env, run_dir=run_dir).status == 0


def test_a_server_being_started_is_waited_for_then_given_up(tmp_path, run_dir) -> None:
    """Its lock held and no socket yet: the client waits (bounded), then runs it here."""
    env = _env(_conf(tmp_path))
    fd = root_lock.try_lock(client.lock_path(env, run_dir))
    assert fd is not None
    try:
        t0 = time.monotonic()
        out = client.call("prolog", env, run_dir=run_dir, start_wait_s=0.5)
        assert out.absent and 0.4 < time.monotonic() - t0 < 5
    finally:
        os.close(fd)
    t0 = time.monotonic()
    assert client.call("prolog", env, run_dir=run_dir, start_wait_s=30).absent
    assert time.monotonic() - t0 < 1  # no lock held: nothing to wait for


def _fake_server(run_dir: Path, env: dict[str, str], handle,
                 seen: list[str] | None = None) -> Iterator[list[bytes]]:
    """A socket at the server's path whose one connection ``handle`` answers, after
    reading and checking the request as a worker does; ``seen`` gets ``"<script>
    <descriptors> <stdio>"`` of it."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(client.socket_path(env, run_dir)))
    s.listen(1)
    got: list[bytes] = []

    def serve() -> None:
        conn, _ = s.accept()
        with conn:
            data, fds = server._receive(conn)  # the whole request, as a worker reads it
            for fd in fds:
                os.close(fd)
            req = server.parse_request(data, client.server_key(env))
            if seen is not None:
                seen.append(f"{req['script']} {len(fds)} {req['stdio']}")
            handle(conn, got)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield got
    t.join(10)
    s.close()


def test_a_worker_that_never_takes_the_request_is_never_told_to_go(tmp_path, run_dir) -> None:
    env = _env(_conf(tmp_path))

    def silent(conn: socket.socket, got: list[bytes]) -> None:
        conn.settimeout(5)
        time.sleep(1.0)
        try:
            conn.sendall(b"taken\n")  # too late: the client has given up
            got.append(conn.recv(10))
        except OSError:
            got.append(b"")

    got: list[bytes] = []
    for got in _fake_server(run_dir, env, silent):  # noqa: B007 - read after the server ends
        out = client.call("prolog", env, run_dir=run_dir, ack_wait_s=0.3)
        assert out.status is None and not out.absent
    assert got == [b""]  # never "go": the worker would not have run it


def test_a_worker_that_dies_after_go_leaves_the_run_to_the_client(tmp_path, run_dir) -> None:
    env = _env(_conf(tmp_path))

    def dies(conn: socket.socket, got: list[bytes]) -> None:
        conn.sendall(b"taken\n")
        got.append(conn.recv(3))

    got: list[bytes] = []
    for got in _fake_server(run_dir, env, dies):  # noqa: B007 - read after the server ends
        out = client.call("prolog", env, run_dir=run_dir)
        assert out == client.Outcome(None, "the server's worker ended without a status")
    assert got == [b"go\n"]


def test_a_declined_request_is_run_here_with_the_reason(tmp_path, run_dir) -> None:
    env = _env(_conf(tmp_path))

    def declines(conn: socket.socket, got: list[bytes]) -> None:
        conn.sendall(b"declined colloc's code changed since the server started\n")

    for _ in _fake_server(run_dir, env, declines):
        out = client.call("prolog", env, run_dir=run_dir)
    assert out == client.Outcome(None, "colloc's code changed since the server started")


def _request(base: dict[str, str], **over: object) -> bytes:
    """A request body as the clients write it, with fields replaced (``env``: raw
    ``NAME=VALUE`` entries when a list)."""
    f: dict[str, object] = {"magic": client.MAGIC.decode(), "script": "prolog",
                            "started": "12.5", "cpu": "0.03", "stdio": "0,1,2", "env": base}
    f.update(over)
    env = f["env"]
    entries = env if isinstance(env, list) else [f"{k}={v}" for k, v in env.items()]  # type: ignore[union-attr]
    fields = [f["magic"], f["script"], f["started"], f["cpu"], f["stdio"], *entries]
    return b"".join(str(x).encode() + b"\0" for x in fields)


@pytest.mark.parametrize(("over", "why"), [
    ({"script": "task_prolog"}, "unknown script"),
    ({"script": ""}, "unknown script"),
    ({"magic": "colloc-script/1"}, "not a request"),
    ({"env": ["A"]}, "not a request"),
    ({"env": ["=x"]}, "not a request"),
    ({"env": ["A=1", "A=2"]}, "not a request"),
    ({"env": {f"V{i}": "x" for i in range(server.MAX_ENV + 1)}}, "too many variables"),
    ({"started": "now"}, "bad started"),
    ({"cpu": "-1"}, "bad cpu"),
    ({"cpu": "nan"}, "bad cpu"),
    ({"cpu": "1e12"}, "bad cpu"),
    ({"stdio": "0,1,2,3"}, "bad stdio"),
    ({"stdio": "5"}, "bad stdio"),
    ({"stdio": "1,1"}, "bad stdio"),
    ({"stdio": "x"}, "bad stdio"),
])
def test_a_malformed_request_is_declined(tmp_path, over, why) -> None:
    env = _env(_conf(tmp_path))
    with pytest.raises(server.Declined, match=why):
        server.parse_request(_request(env, **over), client.server_key(env))


def test_a_request_for_another_config_or_node_is_declined(tmp_path) -> None:
    env = _env(_conf(tmp_path))
    key = client.server_key(env)
    assert server.parse_request(_request(env), key)["script"] == "prolog"
    with pytest.raises(server.Declined, match=r"another colloc\.conf or node"):
        server.parse_request(_request({**env, "SLURMD_NODENAME": "n2"}), key)
    with pytest.raises(server.Declined, match="not a request"):
        server.parse_request(b"\xff{", key)


def test_a_request_round_trips_what_os_environ_holds() -> None:
    """Names and values go as bytes and come back as ``os.environ`` decodes them: a
    value that is not UTF-8 (slurmd passes job names as bytes) survives unchanged."""
    odd = os.fsdecode(b"caf\xe9 \n=x")
    env = {"COLLOC_CONF": "/c", "SLURMD_NODENAME": "n1", "SLURM_JOB_NAME": odd, "EMPTY": ""}
    body = client.encode_request("epilog", env, None, 0.25, [1, 2])
    assert client.decode_request(body) == (["epilog", "", "0.25", "1,2"], env)
    req = server.parse_request(body, client.server_key(env))
    assert (req["started"], req["cpu"], req["stdio"], req["env"]) == (None, 0.25, [1, 2], env)


def test_the_server_key_is_fnv1a_of_config_and_node() -> None:
    """The C client computes the same name (``script_client.c``): FNV-1a 64 over
    ``COLLOC_CONF``, NUL, ``SLURMD_NODENAME``; a known vector pins it."""
    assert client.server_key({}) == "af63bd4c8601b7df"  # FNV-1a 64 of one NUL byte
    assert client.server_key({"COLLOC_CONF": "/c", "SLURMD_NODENAME": "n1"}) != \
        client.server_key({"COLLOC_CONF": "/c", "SLURMD_NODENAME": "n2"})


def test_a_peer_that_is_not_root_is_dropped_unread(monkeypatch, caplog) -> None:
    a, b = socket.socketpair()
    srv = server.Server(a, "k", 60)
    monkeypatch.setattr(client, "peer_uid", lambda s: os.geteuid() + 1)
    forked: list[int] = []
    def fork() -> int:
        forked.append(1)
        return 0

    monkeypatch.setattr(os, "fork", fork)
    srv.serve_one(b)
    assert forked == [] and srv.children == set()
    assert "dropped a connection of uid" in caplog.text
    a.close()


def test_an_upgrade_is_seen_in_the_code_stamp(tmp_path, monkeypatch) -> None:
    mod = tmp_path / "m.py"
    mod.write_text("x = 1\n")
    fake = type(sys)("slurm_colloc._stamp_probe")
    fake.__file__ = str(mod)
    monkeypatch.setitem(sys.modules, "slurm_colloc._stamp_probe", fake)
    stamp = server.code_stamp()
    assert str(mod) in stamp and not server.changed(stamp)
    mod.write_text("x = 2\n")
    os.utime(mod, ns=(1, 1))
    assert server.changed(stamp)
    mod.unlink()
    assert server.changed(stamp)


def test_the_server_goes_when_idle_and_removes_its_socket(tmp_path, run_dir) -> None:
    env = _env(_conf(tmp_path, "script_server_idle_s = 1\n"))
    p = _start_server(run_dir, env)
    assert client.call("prolog", env, run_dir=run_dir).status == 0
    assert p.wait(timeout=30) == 0
    assert not client.socket_path(env, run_dir).exists()
    assert "exiting: no request for 1s" in (tmp_path / "colloc.log").read_text()
    assert client.call("prolog", env, run_dir=run_dir).absent


def test_switched_off_in_colloc_conf_the_server_declines_and_goes(served, tmp_path) -> None:
    env, run_dir = served
    _conf(tmp_path, "script_server_idle_s = 0\n")
    out = client.call("prolog", env, run_dir=run_dir)
    assert out == client.Outcome(None, "script_server_idle_s is 0 in colloc.conf")
    deadline = time.monotonic() + 30
    while client.socket_path(env, run_dir).exists():
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_start_hands_its_lock_to_one_server(tmp_path, no_node_script_server) -> None:
    env = _env(_conf(tmp_path))
    cfg = cfgmod.load(env["COLLOC_CONF"])
    run_dir = tmp_path / "fresh-run"
    assert script_start.start(env, cfg, run_dir) is True
    assert (run_dir.stat().st_mode & 0o777) == 0o700
    (module, args, child_env), = no_node_script_server
    assert module == script_start.MODULE and args == ("--run-dir", str(run_dir))
    # no job's variables reach the resident process
    assert set(child_env) == {"PATH", "COLLOC_CONF", "SLURMD_NODENAME"}
    held = root_lock.try_lock(client.lock_path(env, run_dir))
    assert held is not None  # the fake spawn did not keep it: free again
    try:
        assert script_start.start(env, cfg, run_dir) is False  # one is starting
    finally:
        os.close(held)
    assert len(no_node_script_server) == 1
    off = cfgmod.from_mapping({"script_server_idle_s": 0})
    assert script_start.start(env, off, run_dir) is False
    # a prolog run by hand (no slurmd around it) leaves no resident server behind
    for missing in ("SLURMD_NODENAME", "SLURM_JOB_ID"):
        bare = {k: v for k, v in env.items() if k != missing}
        assert script_start.start(bare, cfg, run_dir) is False
    assert len(no_node_script_server) == 1


def test_start_refuses_a_run_directory_that_is_not_roots_own(tmp_path, caplog) -> None:
    env = _env(_conf(tmp_path))
    run_dir = tmp_path / "open"
    run_dir.mkdir(mode=0o755)
    run_dir.chmod(0o755)
    assert script_start.start(env, cfgmod.load(env["COLLOC_CONF"]), run_dir) is False
    assert "is not a 0700 directory" in caplog.text


def test_config_bounds_of_the_idle_time() -> None:
    assert cfgmod.from_mapping({"script_server_idle_s": 0}).script_server_idle_s == 0
    with pytest.raises(cfgmod.ConfigError, match="script_server_idle_s"):
        cfgmod.from_mapping({"script_server_idle_s": -1})
    with pytest.raises(cfgmod.ConfigError, match="script_server_idle_s"):
        cfgmod.from_mapping({"script_server_idle_s": 8 * 86400})


def test_a_killed_server_is_seen_gone_while_its_workers_still_run(tmp_path, run_dir) -> None:
    """Workers let go of the server's lock: with the server SIGKILLed while one of its
    workers is busy (an epilog may take minutes), the next script does not wait for a
    server that will never listen; it runs itself (and starts another)."""
    env = _env(_conf(tmp_path))
    p = _start_server(run_dir, env)
    busy = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    busy.connect(str(client.socket_path(env, run_dir)))
    body = client.encode_request("prolog", env, None, 0.0, [])
    busy.sendall(client._HEADER.pack(len(body)) + body)
    assert busy.recv(100) == b"taken\n"  # a worker waits for our "go"
    p.kill()
    p.wait(timeout=10)
    t0 = time.monotonic()
    assert client.call("prolog", env, run_dir=run_dir, start_wait_s=3).absent
    assert time.monotonic() - t0 < 1.5
    busy.close()


def test_a_server_started_by_hand_takes_its_own_lock(tmp_path, run_dir) -> None:
    """Without a handed-over lock (systemd, by hand) the server locks for itself, so
    a second one started beside it exits at once instead of serving too."""
    env = _env(_conf(tmp_path))
    p = _start_server(run_dir, env)
    try:
        assert client._starting(client.lock_path(env, run_dir))
        second = subprocess.run(
            [sys.executable, "-I", "-m", script_start.MODULE, "--run-dir", str(run_dir)],
            env=env, cwd="/", timeout=60)
        assert second.returncode == 0
        assert (tmp_path / "colloc.log").read_text().count("serving ") == 1
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a priority needs root (CI runs as root)")
def test_a_script_raises_itself_once_and_its_long_lived_children_get_nice_0() -> None:
    from slurm_colloc import priority

    os.setpriority(os.PRIO_PROCESS, 0, 0)
    priority._base.clear()
    assert priority.raise_process() is True
    assert os.getpriority(os.PRIO_PROCESS, 0) == priority.SCRIPT_NICE
    assert priority._base == [0]
    assert priority.raise_process() is False and priority._base == [0]  # once
    # started raised by a wrapper (nice -n -5): nothing to raise, children get 0
    priority._base.clear()
    assert priority.raise_process() is False and priority._base == [0]
    pid = os.fork()
    if pid == 0:
        priority.for_child()
        os._exit(0 if os.getpriority(os.PRIO_PROCESS, 0) == 0 else 1)
    assert os.waitpid(pid, 0)[1] == 0


def test_the_server_weights_its_own_session_group_and_no_one_elses(tmp_path) -> None:
    """Issue 28: where the kernel shares the CPUs between sessions first (autogroup),
    the served scripts' nice values counted only inside the server's one group, which
    got one share among a burst's ~40 (each job, daemon, ...). The server's group gets
    SERVER_NICE's weight; a detached server (not its session's leader) first starts a
    session of its own; a process group leader (a shell's foreground job) cannot, and
    its caller's group is left alone."""
    from slurm_colloc import priority

    fake = tmp_path / "autogroup"

    def detached() -> str:
        done = priority.raise_session(-10, fake)
        return f"{done} {os.getsid(0) == os.getpid()} {fake.read_text().strip()}"

    assert in_child(detached) == "True True -10"
    fake.unlink()

    def group_leader() -> str:
        os.setpgid(0, 0)  # its own process group, in the caller's session
        return f"{priority.raise_session(-10, fake)} {fake.exists()}"

    assert in_child(group_leader) == "False False"

    real = Path("/proc/self/autogroup")

    def on_this_kernel() -> str:
        done = priority.raise_session(priority.SERVER_NICE)
        return f"{done} {real.read_text().split()[-1] if real.exists() else '-'}"

    if not real.exists():  # a kernel without autogroup: nothing to weight, said so
        assert in_child(on_this_kernel) == "False -"
    elif os.geteuid() == 0:
        assert in_child(on_this_kernel) == f"True {priority.SERVER_NICE}"
    else:  # a negative nice needs root: refused, the same work at its own weight
        assert in_child(on_this_kernel).startswith("False")


def test_a_stopping_worker_tells_its_server_by_exit_status_never_by_signal() -> None:
    """A worker that finds the code changed or the server switched off stops the server
    through its exit status; it never signals its parent, which after the server's
    exit is init (review of issue 28's server: SIGTERM to PID 1)."""
    a, b = socket.socketpair()
    srv = server.Server(a, "k", 60)
    pid = os.fork()
    if pid == 0:
        os._exit(server.STOP_STATUS)
    srv.children.add(pid)
    deadline = time.monotonic() + 10
    while srv.children:
        srv.reap()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert srv.stop
    a.close()
    b.close()
    text = (REPO / "slurm_colloc" / "node" / "script_server.py").read_text()
    assert "os.kill(" not in text and "getppid" not in text


def test_a_client_whose_stderr_slurmd_closed_is_still_served(served) -> None:
    """slurmd may start the client with fd 2 closed: it is still served, and its socket
    never takes that number (it would be sent to the worker as its own stderr, the
    review of issue 28's server found: the worker's lines then went nowhere)."""
    env, run_dir = served
    probe = ("import socket; from slurm_colloc.node import script_client as c; "
             "c._fill_stdio(); s = socket.socket(socket.AF_UNIX); print(s.fileno())")
    fd = subprocess.run(["/bin/sh", "-c", 'exec "$0" -c "$1" 2>&-', sys.executable, probe],
                        capture_output=True, text=True, timeout=60, cwd=REPO).stdout
    assert int(fd) > 2, fd
    code = ("import json, os; from pathlib import Path; "
            "from slurm_colloc.node import script_client as c; "
            f"o = c.call('prolog', dict(os.environ), None, run_dir=Path({str(run_dir)!r})); "
            "print(json.dumps([o.status, o.why]), flush=True)")
    p = subprocess.run(["/bin/sh", "-c", 'exec "$0" -c "$1" 2>&-', sys.executable, code],
                       env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    assert json.loads(p.stdout.splitlines()[-1]) == [0, "served"], p.stdout


def test_the_servers_directory_is_no_parent_of_what_jobs_must_reach(monkeypatch) -> None:
    """Review of issue 28's server: with its 0700 directory at /run/colloc, the parent
    of the default mps_root, the first prolog on a fresh node locked every job out of
    its MPS pipe directory (or, made 0755 first by MPS, kept the server off)."""
    monkeypatch.undo()  # the real RUN_DIR, not the unit tests' stand-in
    defaults = cfgmod.CollocConfig()
    for path in (defaults.mps_root, defaults.metrics_dir, defaults.evidence_dir):
        assert not Path(path).is_relative_to(client.RUN_DIR), path
    assert client.RUN_DIR.parent == Path("/run")


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a priority needs root (CI runs as root)")
def test_the_server_runs_ahead_of_its_workers_which_run_as_scripts(tmp_path, run_dir) -> None:
    """Every served script's start waits for the server's accept and fork, so the server
    runs at SERVER_NICE; a worker is a script and drops to SCRIPT_NICE at once."""
    from slurm_colloc import priority

    env = _env(_conf(tmp_path))
    p = _start_server(run_dir, env)
    try:
        assert os.getpriority(os.PRIO_PROCESS, p.pid) == priority.SERVER_NICE
        idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        idle.connect(str(client.socket_path(env, run_dir)))  # its worker waits for a request
        children: list[int] = []
        deadline = time.monotonic() + 10
        while not children and time.monotonic() < deadline:
            text = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text()
            children = [int(c) for c in text.split()]
            time.sleep(0.02)
        assert children, "no worker was forked"
        nice = None
        while time.monotonic() < deadline and nice != priority.SCRIPT_NICE:
            nice = os.getpriority(os.PRIO_PROCESS, children[0])  # set just after the fork
            time.sleep(0.02)
        assert nice == priority.SCRIPT_NICE
        idle.close()
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
