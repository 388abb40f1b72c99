"""Start a colloc module as a process slurmd does not wait for.

Node scripts sometimes hand work to a helper that must outlive them (the metrics
collector, the accounting writer that waits for the job to leave COMPLETING). A double
fork with a new session takes the helper out of slurmd's process group, so slurmd
neither waits for it nor kills it with the script. No shell: a fixed module path and
an argv array; stdio on /dev/null, other descriptors closed, cwd /.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence


def spawn_module(module: str, args: Sequence[str], env: dict[str, str]) -> None:
    """Run ``python -m module *args`` detached; returns once the helper is started."""
    pid = os.fork()
    if pid:
        os.waitpid(pid, 0)
        return
    try:
        os.setsid()
        if os.fork():
            os._exit(0)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.closerange(3, 1024)
        os.chdir("/")
        os.execve(  # noqa: S606 - argv array, no shell; fixed module path
            sys.executable, [sys.executable, "-m", module, *args], env
        )
    finally:
        os._exit(0)
