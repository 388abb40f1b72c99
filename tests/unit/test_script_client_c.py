"""The C client of the node's script server (``slurm_colloc/node/script_client.c``).

Issue 28 (prolog p99 under a burst): slurmd's Prolog/Epilog may be the compiled client,
which hands the run to the node's script server in about a millisecond. It must speak
the Python server's wire exactly (the same server key, request and replies), and every
way the server can be missing, declining or dying must end in the Python script run
with the reason (``--not-served WHY``), never twice, never not at all; it always exits
0 when it cannot run anything (a non-zero Prolog drains the node).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_colloc.node import script_client as client
from slurm_colloc.node.script_client_build import BuildError, build
from slurm_colloc.site import doctor
from tests.unit.test_script_server import _conf, _fake_server, _start_server
from tests.unit.test_script_server import _env as server_env

pytestmark = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")),
                                reason="needs a C compiler (the rootfs the suite runs in has gcc)")
REPO = Path(__file__).resolve().parents[2]


def _env(conf: Path, job: int = 7) -> dict[str, str]:
    """slurmd's Prolog environment (a job without a GPU), with this checkout importable
    by the Python script behind the client."""
    return {**server_env(conf, job), "PYTHONPATH": str(REPO)}


@pytest.fixture
def recorder(tmp_path: Path) -> Path:
    """A stand-in for the Python script: records its arguments, nice and environment."""
    out = tmp_path / "fallback.out"
    script = tmp_path / "fallback.sh"
    script.write_text(f'#!/bin/sh\n{{ echo "$@"; nice; env; }} > {out}\nexit 0\n')
    script.chmod(0o755)
    return script


def _client(tmp_path: Path, run_dir: Path, fallback: Path, script: str = "prolog") -> Path:
    return build(tmp_path / f"colloc-{script}-client", script, fallback, run_dir=run_dir)


def _run(prog: Path, env: dict[str, str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(prog)], env=env, capture_output=True, text=True, timeout=60,
                          cwd="/", **kw)  # type: ignore[call-overload]


def _fallback_args(recorder: Path) -> list[str]:
    return (recorder.parent / "fallback.out").read_text().splitlines()


def test_no_server_runs_the_python_script_with_the_reason(tmp_path, run_dir, recorder) -> None:
    prog = _client(tmp_path, run_dir, recorder)
    env = _env(_conf(tmp_path))
    p = _run(prog, {**env, "ODD": "x y\tz"})
    assert p.returncode == 0, p.stderr
    lines = _fallback_args(recorder)
    assert lines[0] == "--not-served absent"
    assert "ODD=x y\tz" in lines and f"COLLOC_CONF={env['COLLOC_CONF']}" in lines


def test_it_raises_itself_to_the_scripts_priority(tmp_path, run_dir, recorder) -> None:
    """From its first instruction, as the nice wrapper did (root may lower its nice)."""
    if os.geteuid() != 0:
        pytest.skip("only root may lower a nice value")
    prog = _client(tmp_path, run_dir, recorder)
    _run(prog, _env(_conf(tmp_path)), preexec_fn=lambda: os.nice(2))
    assert _fallback_args(recorder)[1] == "-5"


def test_a_run_directory_others_may_enter_is_not_trusted(tmp_path, run_dir, recorder) -> None:
    run_dir.chmod(0o755)
    prog = _client(tmp_path, run_dir, recorder)
    assert _run(prog, _env(_conf(tmp_path))).returncode == 0
    assert _fallback_args(recorder)[0] == "--not-served absent"


@pytest.fixture
def served(tmp_path: Path, run_dir: Path) -> Iterator[dict[str, str]]:
    """A real Python server for a config in tmp_path; stopped after."""
    env = _env(_conf(tmp_path))
    p = _start_server(run_dir, env)
    yield env
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=30)


def test_the_python_server_serves_the_c_client(tmp_path, run_dir, recorder, served) -> None:
    """Same server key, request and replies: the worker runs the prolog with the
    client's environment and stderr, and the Python script is never run."""
    prog = _client(tmp_path, run_dir, recorder)
    p = _run(prog, served)
    assert p.returncode == 0, p.stderr
    assert not (recorder.parent / "fallback.out").exists()
    assert "colloc: prolog: job 7: none gpu=None no GPU bound by slurmd [took " in p.stderr
    line = next(x for x in (tmp_path / "colloc.log").read_text().splitlines()
                if "prolog: job 7:" in x)
    assert "not served" not in line and "[took " in line


def test_a_client_whose_stdio_slurmd_closed_is_still_served(tmp_path, run_dir, recorder,
                                                           served) -> None:
    prog = _client(tmp_path, run_dir, recorder)
    p = subprocess.run(
        ["/bin/sh", "-c", f'exec {prog} <&- 2>&-'], env=served, capture_output=True,
        text=True, timeout=60)
    assert p.returncode == 0
    assert not (recorder.parent / "fallback.out").exists()
    assert "prolog: job 7: none gpu=None" in (tmp_path / "colloc.log").read_text()


def test_served_concurrently_each_once(tmp_path, run_dir, recorder, served) -> None:
    prog = _client(tmp_path, run_dir, recorder)
    procs = [subprocess.Popen([str(prog)], env={**served, "SLURM_JOB_ID": str(j)}, cwd="/",
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for j in range(200, 216)]
    assert [p.wait(timeout=120) for p in procs] == [0] * 16
    log = (tmp_path / "colloc.log").read_text()
    assert all(log.count(f"prolog: job {j}: none gpu=None") == 1 for j in range(200, 216))
    assert not (recorder.parent / "fallback.out").exists()


def test_a_declined_request_runs_the_script_with_the_servers_reason(
        tmp_path, run_dir, recorder) -> None:
    env = _env(_conf(tmp_path))
    prog = _client(tmp_path, run_dir, recorder, "epilog")

    def declines(conn: socket.socket, got: list[bytes]) -> None:
        conn.sendall(b"declined colloc's code changed since the server started\n")

    seen: list[str] = []
    for _ in _fake_server(run_dir, env, declines, seen):
        assert _run(prog, env).returncode == 0
    assert seen == ["epilog 3 [0, 1, 2]"]  # its three stdio descriptors, as a worker reads
    assert _fallback_args(recorder)[0] == \
        "--not-served colloc's code changed since the server started"


def test_a_worker_that_dies_after_go_leaves_the_run_to_the_script(tmp_path, run_dir,
                                                                   recorder) -> None:
    env = _env(_conf(tmp_path))
    prog = _client(tmp_path, run_dir, recorder)

    def dies(conn: socket.socket, got: list[bytes]) -> None:
        conn.sendall(b"taken\n")
        got.append(conn.recv(3))

    for got in _fake_server(run_dir, env, dies):  # noqa: B007
        assert _run(prog, env).returncode == 0
    assert got == [b"go\n"]
    assert _fallback_args(recorder)[0] == \
        "--not-served the server's worker ended without a status"


def test_the_workers_status_is_the_clients(tmp_path, run_dir, recorder) -> None:
    env = _env(_conf(tmp_path))
    prog = _client(tmp_path, run_dir, recorder)

    def answers(conn: socket.socket, got: list[bytes]) -> None:
        conn.sendall(b"taken\n")
        got.append(conn.recv(3))
        conn.sendall(b"status 3\n")

    for _ in _fake_server(run_dir, env, answers):
        assert _run(prog, env).returncode == 3
    assert not (recorder.parent / "fallback.out").exists()


def test_a_missing_python_script_still_exits_0(tmp_path, run_dir) -> None:
    """Removed after the build (an uninstalled venv): the client still never drains."""
    gone = tmp_path / "gone" / "colloc-prolog"
    gone.parent.mkdir()
    gone.write_text("#!/bin/sh\n")
    gone.chmod(0o755)
    prog = _client(tmp_path, run_dir, gone)
    gone.unlink()
    p = _run(prog, _env(_conf(tmp_path)))
    assert p.returncode == 0
    assert "cannot run" in p.stderr and "gone/colloc-prolog" in p.stderr


def test_the_real_fallback_logs_why_it_was_not_served(tmp_path, run_dir) -> None:
    """The Python script behind the client runs the prolog without asking the server
    again and names the reason on its log line."""
    fallback = tmp_path / "colloc-prolog"
    fallback.write_text(f"#!{sys.executable}\nimport sys\n"
                        "from slurm_colloc.node.scripts import prolog\nsys.exit(prolog())\n")
    fallback.chmod(0o755)
    prog = _client(tmp_path, run_dir, fallback)
    conf = _conf(tmp_path, "script_server_idle_s = 0\n")  # it starts no server
    p = _run(prog, _env(conf))
    assert p.returncode == 0, p.stderr
    line = next(x for x in (tmp_path / "colloc.log").read_text().splitlines()
                if "prolog: job 7:" in x)
    assert "none gpu=None no GPU bound by slurmd [took " in line
    assert line.rstrip().endswith("not served: absent]")


def test_paths_c_cannot_hold_are_refused(tmp_path, run_dir) -> None:
    with pytest.raises(BuildError, match="cannot be compiled"):
        build(tmp_path / "c", "prolog", Path('/opt/x"; system("id'), run_dir=run_dir)
    with pytest.raises(BuildError, match="not a root script"):
        build(tmp_path / "c", "task_prolog", Path("/bin/true"))
    with pytest.raises(BuildError, match="absolute"):
        build(tmp_path / "c", "prolog", Path("colloc-prolog"))
    with pytest.raises(BuildError, match="cannot be compiled"):  # doctor reads up to a space
        build(tmp_path / "c", "prolog", Path("/opt/my colloc/colloc-prolog"))
    with pytest.raises(BuildError, match="not an executable"):  # it could never fall back
        build(tmp_path / "c", "prolog", tmp_path / "no-such-script")


def test_doctor_follows_the_client_to_its_python_script(tmp_path, run_dir) -> None:
    """``colloc doctor`` checks the version slurm.conf's node scripts run: through the
    devcluster's shell wrapper, the C client, to the console script."""
    console = tmp_path / "colloc-prolog"
    console.write_text(f"#!{sys.executable}\nimport sys\n")
    console.chmod(0o755)
    prog = _client(tmp_path, run_dir, console)
    wrapper = tmp_path / "wrapper"
    wrapper.write_text(f'#!/bin/sh\nexport COLLOC_CONF=/x\nexec {prog} "$@"\n')
    version, how = doctor.script_version(wrapper)
    assert version == doctor.__version__ and str(console) in how


def test_admin_node_clients_builds_both_and_prints_the_slurm_conf_lines(tmp_path) -> None:
    """``colloc admin node-clients``: the two clients, each falling back to this
    installation's console script, and the lines slurm.conf needs."""
    from click.testing import CliRunner

    from slurm_colloc.cli import main as cli
    from slurm_colloc.site.install import node_script_paths

    r = CliRunner().invoke(cli, ["admin", "node-clients", "--dest", str(tmp_path / "lib")])
    assert r.exit_code == 0, r.output
    for key, name in (("Prolog", "colloc-prolog"), ("Epilog", "colloc-epilog")):
        built = tmp_path / "lib" / f"{name}-client"
        assert f"{key}={built}" in r.output
        assert built.stat().st_mode & 0o777 == 0o755
        assert f"fallback={node_script_paths()[key]}".encode() in built.read_bytes()
    blocked = tmp_path / "file"
    blocked.write_text("")
    r = CliRunner().invoke(cli, ["admin", "node-clients", "--dest", str(blocked / "lib")])
    assert r.exit_code != 0 and "Not a directory" in r.output


def test_doctor_names_a_client_of_an_older_wire(tmp_path) -> None:
    """After an upgrade that changes the wire, an old client is served by nobody (each
    run falls back): doctor says to rebuild it."""
    old = tmp_path / "colloc-prolog-client"
    old.write_bytes(b"\x7fELF" + b"\0" * 64 + b"colloc-script/1\0"
                    b"colloc-script-client fallback=/opt/colloc/bin/colloc-prolog\0")
    version, how = doctor.script_version(old)
    assert version is None and "another wire" in how and "colloc admin node-clients" in how


def test_a_stuck_server_with_a_full_backlog_ends_in_the_fallback(tmp_path, run_dir,
                                                                   recorder) -> None:
    """A server that stopped accepting (stuck, or its backlog filled by clients that
    gave up) must not hang slurmd's Prolog: the connect times out (5 s) and the script
    runs itself. Found in review: the connect had no timeout."""
    env = _env(_conf(tmp_path))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(client.socket_path(env, run_dir)))
    listener.listen(0)
    filler = []
    while True:  # fill the backlog: the next blocking connect would wait for ever
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(str(client.socket_path(env, run_dir)))
        except BlockingIOError:
            s.close()
            break
        filler.append(s)
    prog = _client(tmp_path, run_dir, recorder)
    try:
        p = _run(prog, env)
    finally:
        for s in filler:
            s.close()
        listener.close()
    assert p.returncode == 0
    assert _fallback_args(recorder)[0] == "--not-served absent"
