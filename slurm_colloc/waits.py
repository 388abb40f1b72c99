"""Where a node script's wall time went: a per-process tally of named waits.

Why (issue 28): under a burst a prolog's ``[took W s, cpu C s]`` showed seconds of
wall for a few hundredths of CPU, and nothing said whether the time went to the
controller, a GPU lock, the (GPU, user) cap commit or simply a CPU queue. The places
that wait add what they waited here (:func:`add`, :func:`timed`); the script's
log line ends with the tally (:func:`slurm_colloc.node.timing.Stopwatch.suffix`).
Dependency-free, so that the lowest layers (root's lock files) can use it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

_tally: dict[str, float] = {}


def add(name: str, seconds: float) -> None:
    """Count ``seconds`` more against ``name``."""
    _tally[name] = _tally.get(name, 0.0) + max(0.0, seconds)


@contextlib.contextmanager
def timed(name: str) -> Iterator[None]:
    """Count the block's wall time against ``name`` (also when it raises)."""
    t0 = time.monotonic()
    try:
        yield
    finally:
        add(name, time.monotonic() - t0)


def snapshot() -> dict[str, float]:
    """The tally so far (a copy)."""
    return dict(_tally)


def reset() -> None:
    """Forget the tally (a script's start; tests)."""
    _tally.clear()
