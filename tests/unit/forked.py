"""Run a function in a forked child and bring back its result as a string.

For tests whose subject changes the process for good (a session, a uid): the change
stays in the child, the test process keeps what it had."""

from __future__ import annotations

import os
from collections.abc import Callable


def in_child(fn: Callable[[], object]) -> str:
    """``str(fn())`` computed in a forked child ("" if it raised)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            os.write(w, str(fn()).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return out
