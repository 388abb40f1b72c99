"""Start a colloc module as a process slurmd does not wait for.

Node scripts sometimes hand work to a helper that must outlive them (the metrics
collector, the accounting writer that waits for the job to leave COMPLETING). A double
fork with a new session takes the helper out of slurmd's process group, so slurmd
neither waits for it nor kills it with the script. No shell: a fixed module path and
an argv array; stdio on /dev/null, other descriptors closed, cwd /.

The helper runs as root, so its interpreter must import colloc's code and nothing
else (issue 11, M1): ``python -I`` (isolated mode: no script/cwd directory on
``sys.path``, PYTHON* variables and the user site directory ignored), cwd ``/``, and an
environment scrubbed of ``PYTHON*`` and ``LD_*`` variables, so a module or library in a
directory a user can write cannot be loaded as root.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from slurm_colloc import priority

_UNSAFE_ENV_PREFIXES = ("PYTHON", "LD_")


def scrub_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without variables that steer the interpreter or the dynamic loader."""
    return {k: v for k, v in env.items() if not k.upper().startswith(_UNSAFE_ENV_PREFIXES)}


def child_argv(module: str, args: Sequence[str]) -> list[str]:
    """The helper's command line: this interpreter, isolated, running ``module``."""
    return [sys.executable, "-I", "-m", module, *args]


PASSED_FD = 3
"""Where the helper finds the descriptor :func:`spawn_module` hands it (``pass_fd``)."""


def spawn_module(module: str, args: Sequence[str], env: Mapping[str, str], *,
                 pass_fd: int | None = None) -> None:
    """Run ``python -I -m module *args`` detached; returns once the helper is started.

    ``pass_fd``: one descriptor the helper keeps, as :data:`PASSED_FD` (a lock the
    caller took for it: the lock stays held across the hand-over, issue 23); every
    other descriptor is closed.
    """
    argv = child_argv(module, args)
    child_env = scrub_env(env)
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
        if pass_fd is not None:
            os.dup2(pass_fd, PASSED_FD)  # inheritable: it survives the exec
        os.closerange(PASSED_FD if pass_fd is None else PASSED_FD + 1, 1024)
        os.chdir("/")
        priority.for_child()  # a helper never keeps a node script's raised priority
        os.execve(argv[0], argv, child_env)  # noqa: S606 - argv array, no shell; fixed module
    finally:
        os._exit(0)
