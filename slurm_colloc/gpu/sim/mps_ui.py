"""The stand-in control program's client mode: stdin commands to the daemon, answers out.

``colloc-sim-mps-control`` without an option forwards each stdin line to the running
daemon and prints its answers, as ``nvidia-cuda-mps-control`` does. This half lives
apart from the daemon (:mod:`.mps_control`) and imports only the wire protocol, so the
launcher (:mod:`.tools`) starts it without the daemon's code. Why (issue 28): NVIDIA's
client answered the prolog's two cap runs in 0.005-0.007 s on an H200
(``benchmarks/results/hardware/h200_mps_cap.json``); the stand-in, importing the whole
daemon, took ~0.15 s each, and under a prolog burst the GPU's other prologs waited for
it: the simulation, not colloc, made the tail.
"""

from __future__ import annotations

import sys
from typing import TextIO

from slurm_colloc.gpu.sim.mps_protocol import (
    LineReader,
    MpsError,
    connect,
    pipe_dir_from_env,
    ui_command,
)


def run_ui(stdin: TextIO, stdout: TextIO) -> int:
    """No option: forward stdin commands to the daemon, print its answers."""
    pipe_dir = pipe_dir_from_env()
    try:
        sock = connect(pipe_dir)
    except MpsError as e:
        sys.stderr.write(f"Cannot find MPS control daemon process ({e})" + "\n")
        return 1
    with sock:
        sock.sendall(b"UI\n")
        reader = LineReader(sock)
        for raw in stdin:
            line = raw.strip()
            if not line:
                continue
            try:
                answer = ui_command(sock, reader, line)
            except (MpsError, OSError) as e:
                sys.stderr.write(f"MPS control daemon connection lost: {e}" + "\n")
                return 1
            if answer:
                stdout.write(answer.rstrip("\n") + "\n")
                stdout.flush()
            if line.split()[0] == "quit":
                break
    return 0


def main() -> int:
    """The launcher's entry when ``colloc-sim-mps-control`` has no argument."""
    return run_ui(sys.stdin, sys.stdout)
