"""Fixtures shared by the unit tests that run real processes as stand-in GPU jobs."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

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


@pytest.fixture(autouse=True)
def no_node_script_server(tmp_path_factory: pytest.TempPathFactory,
                          monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[object, ...]]]:
    """Unit tests never meet or start the node's real script server (/run/colloc-scripts): a
    Prolog run through ``slurm_colloc.node.scripts`` by a root test would otherwise be
    served by, or leave behind, a resident root process. Its run directory is a fresh
    path that does not exist, and a start is recorded, not spawned (the server's own
    tests run it in a subprocess of theirs). A script run in the test's process raises
    its priority for good (``slurm_colloc.priority.raise_process``): the test's
    priority and that module's record of it are put back afterwards."""
    import os

    from slurm_colloc import priority
    from slurm_colloc.node import script_client, script_start

    monkeypatch.setattr(script_client, "RUN_DIR", tmp_path_factory.mktemp("run") / "colloc")
    spawned: list[tuple[object, ...]] = []
    monkeypatch.setattr(script_start, "spawn_module", lambda *a, **k: spawned.append(a))
    nice, base = os.getpriority(os.PRIO_PROCESS, 0), list(priority._base)
    yield spawned
    if os.getpriority(os.PRIO_PROCESS, 0) != nice:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    priority._base[:] = base


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A script-server run directory as root keeps one (0700) for a test's own server
    (tests/unit/test_script_server.py, test_script_client_c.py)."""
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    return d
