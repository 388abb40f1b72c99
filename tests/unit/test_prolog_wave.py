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
        self.caps: list[tuple[bool, int]] = []
        self.wave = True

    def running(self) -> bool:
        return self.up

    def start(self) -> None:
        self.starts += 1
        deadline = time.monotonic() + (3 if self.starts == 1 and self.wave else 0)
        while time.monotonic() < deadline and self._registered() < WAVE:
            time.sleep(0.01)
        self.seen_at_start.append(self._registered())
        if self.fail_starts:
            self.fail_starts -= 1
            raise MpsControlError("nvidia-cuda-mps-control -d exited 1: stand-in refused")
        self.up = True

    def _registered(self) -> int:
        """Registrations complete so far (the ticket is the last step of one)."""
        return self.tenancy.read_counter(0, 0, "want")

    def stop(self) -> None:
        self.up = False

    def set_defaults(self, mib: int | None, pct: int | None) -> None:
        pass

    def cap_user(self, total: int) -> None:
        self.caps.append((self.up, total))


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
    assert daemon.seen_at_start == [WAVE]  # every job registered during it: the GPU's
    # lock was not held over the start (before: 1 registration seen, after 3 s)
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


class Recorder(SlowDaemon):
    """A running daemon whose stop and identity are recorded (the epilog asks both)."""

    def __init__(self, tenancy: Tenancy) -> None:
        super().__init__(tenancy)
        self.up = True
        self.stopped_at: list[float] = []

    def stop(self) -> None:
        self.stopped_at.append(time.monotonic())
        self.up = False

    def identity(self) -> object:
        return object() if self.up else None


def _start_in_progress(tenancy: Tenancy, seconds: float) -> tuple[threading.Thread, list[float]]:
    """A prolog holding the (GPU 0, user 0) cap lock over a daemon start."""
    done: list[float] = []
    holding = threading.Event()

    def starter() -> None:
        with tenancy.cap_locked(0, 0):
            holding.set()
            time.sleep(seconds)
            done.append(time.monotonic())

    th = threading.Thread(target=starter)
    th.start()
    assert holding.wait(10)
    return th, done


@pytest.mark.parametrize("who", ["reap", "epilog"])
def test_a_stop_waits_for_a_start_in_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              who: str) -> None:
    """From review: a start runs under the cap lock only, so a reaper or an epilog that
    found the user without jobs (the starter's job reaped, or its own epilog after a
    timed-out prolog) could stop the daemon and retire its pipe directory mid-start,
    before its identity was known: the start then timed out and left an unrecognised
    root daemon in quarantine. They now take the cap lock too and stop it after."""
    from slurm_colloc import config as cfgmod
    from slurm_colloc.node import epilog

    cfg = cfgmod.CollocConfig(mps_root=str(tmp_path / "mps"), metrics_dir=str(tmp_path / "m"))
    tenancy = Tenancy(Path(cfg.mps_root))
    daemon = Recorder(tenancy)
    monkeypatch.setattr(prolog, "daemon_for", lambda *a, **kw: daemon)
    monkeypatch.setattr(epilog, "daemon_for", lambda *a, **kw: daemon)
    tenancy.add_job(0, 0, 7)
    if who == "reap":
        tenancy.remove_job(7)  # the user is left on GPU 0 without jobs
    th, done = _start_in_progress(tenancy, 0.4)
    try:
        if who == "reap":
            with tenancy.locked(0):
                prolog.reap_stale(cfg, tenancy, 0, {})
        else:
            epilog.release_mps(7, cfg, epilog.EpilogResult(7))
    finally:
        th.join()
    assert len(daemon.stopped_at) == 1 and daemon.stopped_at[0] >= done[0]


def test_a_start_that_fails_half_way_stops_the_daemon(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """From review: a daemon that started but whose defaults were refused (or whose
    pipe directory could not be handed over) stayed up in a directory only root can
    enter, and the next job's commit, seeing it run, handed that directory out. It is
    stopped and the job withdrawn; the next job starts it afresh."""
    tenancy = Tenancy(tmp_path / "mps")
    daemon = SlowDaemon(tenancy)
    daemon.wave = False  # one job at a time here
    refused = [1]

    def set_defaults(mib: int | None, pct: int | None) -> None:
        if refused:
            refused.pop()
            raise MpsControlError("set_default_active_thread_percentage: refused")

    monkeypatch.setattr(daemon, "set_defaults", set_defaults)
    monkeypatch.setattr(prolog, "daemon_for", lambda *a, **kw: daemon)
    cfg: Any = SimpleNamespace(active_thread_percentage=50, shard_mib=1024)
    for job in (1, 2):
        ctx: Any = SimpleNamespace(job_id=job, uid=0, gpus=(0,), shards=1)
        try:
            prolog._v2_setup(ctx, cfg, tenancy, None, None, {"COLLOC_PINNED_MIB": "1024"},
                             0, "GPU-0", 0)
        except MpsControlError:
            assert job == 1
            assert not daemon.up and tenancy.jobs_of(0, 0) == []
    assert daemon.starts == 2 and daemon.up
    assert tenancy.jobs_of(0, 0) == [2] and daemon.caps == [(True, 1024)]
