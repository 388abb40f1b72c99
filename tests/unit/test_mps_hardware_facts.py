"""What NVIDIA's MPS control daemon does on real hardware, kept as tests.

Seen on a borrowed H100 (driver 580.159.04, legacy MPS) with
``benchmarks/hw_session.sh``; each test failed before the fix it guards:

- the control socket is ``SOCK_SEQPACKET`` (``/proc/net/unix`` type 0005): a stream
  connect fails with EPROTOTYPE, and the prolog took its own daemon for a stranger;
- ``/usr/bin/nvidia-cuda-mps-control`` was a wrapper script that execs the driver's
  copy under ``/usr/local/nvidia/bin``: the daemon's executable is not the configured
  file, and the prolog waited 10 s for a daemon that was already up;
- ``get_default_device_pinned_mem_limit`` shows whole GiB rounded down: ``1G`` after
  ``... 1536M``, ``2G`` after ``2560M``: the read-back refused every limit that was
  not a whole GiB.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_colloc import procfs
from slurm_colloc.mps import control
from slurm_colloc.mps.control import DaemonIdentity


def _me(pipe_dir: Path, binary: str = "/bin/true") -> DaemonIdentity:
    ticks = procfs.start_ticks(os.getpid())
    assert ticks is not None
    return DaemonIdentity(os.getpid(), ticks, binary, str(pipe_dir))


@pytest.mark.parametrize("kind", [socket.SOCK_SEQPACKET, socket.SOCK_STREAM])
def test_our_daemon_is_recognised_on_a_seqpacket_or_stream_socket(tmp_path, kind):
    path = tmp_path / "control"
    srv = socket.socket(socket.AF_UNIX, kind)
    srv.bind(str(path))
    srv.listen(4)
    try:
        assert _me(tmp_path).answers_on(path)
    finally:
        srv.close()


def test_a_seqpacket_socket_of_another_process_is_not_ours(tmp_path):
    path = tmp_path / "control"
    code = ("import socket,sys,time; s=socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET);"
            f"s.bind({str(path)!r}); s.listen(4); print('up', flush=True); time.sleep(30)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "up"
        assert not _me(tmp_path).answers_on(path)
    finally:
        p.kill()
        p.wait()


def test_nobody_listening_is_not_ours(tmp_path):
    path = tmp_path / "control"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(str(path))
    srv.close()  # the file stays, nobody listens
    assert not _me(tmp_path).answers_on(path)


def _wrapped_program(tmp_path: Path) -> tuple[Path, Path]:
    """A driver copy named nvidia-cuda-mps-control and a /usr/bin-style wrapper for it."""
    real = tmp_path / "driver" / "nvidia-cuda-mps-control"
    real.parent.mkdir()
    sleep = shutil.which("sleep")
    assert sleep is not None
    shutil.copy(sleep, real)
    wrapper = tmp_path / "bin" / "nvidia-cuda-mps-control"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\n# a launcher, as a GPU image ships one\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    return real, wrapper


def test_a_daemon_reached_through_a_wrapper_script_is_the_configured_program(tmp_path):
    _, wrapper = _wrapped_program(tmp_path)
    p = subprocess.Popen([str(wrapper), "30"])
    try:
        deadline = time.monotonic() + 5
        while not os.readlink(f"/proc/{p.pid}/exe").endswith("nvidia-cuda-mps-control"):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert control._runs_program(p.pid, str(wrapper))
    finally:
        p.kill()
        p.wait()


def test_another_program_is_still_refused_and_the_reason_names_it(tmp_path):
    _, wrapper = _wrapped_program(tmp_path)
    sleep = shutil.which("sleep")
    assert sleep is not None
    p = subprocess.Popen([sleep, "30"], env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})
    try:
        time.sleep(0.05)
        assert not control._runs_program(p.pid, str(wrapper))
        ident, why = DaemonIdentity.learn_or_why(p.pid, str(wrapper), tmp_path)
        assert ident is None
        assert str(p.pid) in why and ("sleep" in why or "uid" in why)
    finally:
        p.kill()
        p.wait()


def test_a_pid_file_naming_a_dead_process_says_so(tmp_path):
    p = subprocess.Popen(["true"])
    p.wait()
    ident, why = DaemonIdentity.learn_or_why(p.pid, "/bin/true", tmp_path)
    assert ident is None and "does not run" in why


def test_the_limit_read_back_in_gigabytes_matches_the_one_set_in_megabytes():
    assert control._same_value("size", "2G", "2048M")
    # the driver shows whole GiB, rounded down (1536M reads 1G, 2560M reads 2G)
    assert control._same_value("size", "1G", "1536M")
    assert control._same_value("size", "2G", "2560M")
    assert not control._same_value("size", "1G", "2560M")
    assert not control._same_value("size", "3G", "2560M")
    assert control._same_value("size", "2560M", "2560M")
    assert not control._same_value("size", "2559M", "2560M")
    assert not control._same_value("size", "", "2560M")
