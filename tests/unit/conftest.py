"""Fixtures shared by the unit tests that run real processes as stand-in GPU jobs."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest


class Clock:
    """A settable clock for the collector (``clock.t += 1`` between steps)."""

    def __init__(self, t: float = 2_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts; all killed and reaped afterwards."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()
