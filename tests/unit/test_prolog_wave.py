"""A GPU's wave of prologs registers while its first one starts the user's MPS daemon.

Issue 28 (burst p99): the prolog that found no daemon started it under the GPU lock
(~1.3 s at the wave's CPU peak), so the GPU's other prologs queued behind the start
and then behind each other's registrations before the group commit. The start now
happens after the registration, under the (GPU, user) cap lock: the others register
meanwhile, and one start plus one cap commit serves the whole wave. What must still
hold: no job's prolog returns before a daemon runs and a cap covering its share is
applied; a failed start withdraws only the starter's job and the next job starts it.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from slurm_colloc.mps.control import MpsControlError
from slurm_colloc.mps.tenancy import Tenancy
from slurm_colloc.node import prolog

WAVE = 6


class SlowDaemon:
    """A (GPU, user) daemon whose first start waits (bounded) for the wave to register.

    Shared by every prolog of the test (``daemon_for`` is patched to return it)."""

    def __init__(self, tenancy: Tenancy, fail_starts: int = 0) -> None:
        self.tenancy = tenancy
        self.up = False
        self.fail_starts = fail_starts
        self.starts = 0
        self.seen_at_start: list[int] = []
        self.gpu_lock_free: list[bool] = []
        self.caps: list[tuple[bool, int]] = []
        self.lock = threading.Lock()

    def running(self) -> bool:
        return self.up

    def start(self) -> None:
        self.starts += 1
        self.gpu_lock_free.append(_gpu_lock_free(self.tenancy))
        deadline = time.monotonic() + (3 if self.starts == 1 else 0)
        while time.monotonic() < deadline and len(self.tenancy.jobs_of(0, 0)) < WAVE:
            time.sleep(0.01)
        self.seen_at_start.append(len(self.tenancy.jobs_of(0, 0)))
        if self.fail_starts:
            self.fail_starts -= 1
            raise MpsControlError("nvidia-cuda-mps-control -d exited 1: stand-in refused")
        self.up = True

    def stop(self) -> None:
        self.up = False

    def set_defaults(self, mib: int | None, pct: int | None) -> None:
        pass

    def cap_user(self, total: int) -> None:
        self.caps.append((self.up, total))


def _gpu_lock_free(tenancy: Tenancy) -> bool:
    """Whether GPU 0's lock is free now (another open file description asks)."""
    fd = os.open(tenancy.gpu_dir(0) / "lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def _wave(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_starts: int = 0
          ) -> tuple[Tenancy, SlowDaemon, dict[int, BaseException | None]]:
    tenancy = Tenancy(tmp_path / "mps")
    daemon = SlowDaemon(tenancy, fail_starts)
    monkeypatch.setattr(prolog, "daemon_for", lambda *a, **kw: daemon)
    cfg: Any = SimpleNamespace(active_thread_percentage=0, shard_mib=1024)
    outcome: dict[int, BaseException | None] = {}

    def one(job: int) -> None:
        ctx: Any = SimpleNamespace(job_id=job, uid=0, gpus=(0,), shards=1)
        env = {"CUDA_MPS_PIPE_DIRECTORY": str(tenancy.pipe_dir(0, 0)),
               "COLLOC_PINNED_MIB": "1024"}
        try:
            prolog._v2_setup(ctx, cfg, tenancy, None, None, env, 0, "GPU-0", 0)
            # returned: a daemon runs and the cap applied holds this job's share
            assert daemon.up and daemon.caps and daemon.caps[-1][0]
            outcome[job] = None
        except BaseException as e:  # recorded for the test's asserts
            outcome[job] = e

    threads = [threading.Thread(target=one, args=(100 + i,)) for i in range(WAVE)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    return tenancy, daemon, outcome


def test_the_wave_registers_while_its_first_prolog_starts_the_daemon(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tenancy, daemon, outcome = _wave(tmp_path, monkeypatch)
    assert outcome == {100 + i: None for i in range(WAVE)}
    assert daemon.starts == 1
    assert daemon.gpu_lock_free == [True]  # the GPU's lock is not held over the start
    assert daemon.seen_at_start == [WAVE]  # every job registered during it
    assert daemon.caps == [(True, WAVE * 1024)]  # one commit, after the start, for all
    assert sorted(tenancy.jobs_of(0, 0)) == [100 + i for i in range(WAVE)]


def test_a_failed_start_withdraws_only_its_job_and_the_next_one_starts_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tenancy, daemon, outcome = _wave(tmp_path, monkeypatch, fail_starts=1)
    failed = [job for job, e in outcome.items() if e is not None]
    assert len(failed) == 1 and isinstance(outcome[failed[0]], MpsControlError)
    assert daemon.starts == 2 and daemon.up
    assert failed[0] not in tenancy.jobs_of(0, 0)  # no MPS for the starter's job
    assert not tenancy.job_env_file(failed[0]).exists()
    assert len(tenancy.jobs_of(0, 0)) == WAVE - 1
    assert daemon.caps == [(True, (WAVE - 1) * 1024)]  # the others', in one commit


def test_a_daemon_that_runs_is_not_started_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tenancy = Tenancy(tmp_path / "mps")
    daemon = SlowDaemon(tenancy)
    daemon.up = True
    monkeypatch.setattr(prolog, "daemon_for", lambda *a, **kw: daemon)
    ctx: Any = SimpleNamespace(job_id=5, uid=0, gpus=(0,), shards=1)
    prolog._v2_setup(ctx, SimpleNamespace(active_thread_percentage=0, shard_mib=1024),  # type: ignore[arg-type]
                     tenancy, None, None, {"COLLOC_PINNED_MIB": "2048"}, 0, "GPU-0", 0)
    assert daemon.starts == 0
    assert daemon.caps == [(True, 2048)]
