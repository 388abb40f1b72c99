"""The (GPU, user) server cap's group commit and the bounded blocking lock (issue 28).

A burst's prologs register under the GPU lock and commit the cap after it; one commit
covers every registration before it. What must hold: a job's prolog returns only
once a cap covering its own limit (and its co-tenants') is applied; a failed commit
withdraws only its own job; the waits are bounded.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from slurm_colloc.mps import tenancy as tenancy_mod
from slurm_colloc.mps.control import MpsControlError
from slurm_colloc.mps.tenancy import Tenancy, TenancyError
from slurm_colloc.node import prolog, user_cap


def _register(t: Tenancy, job: int, mib: int, gpu: int = 0, uid: int = 0) -> int:
    t.add_job(gpu, uid, job)
    t.write_job_env(job, {"COLLOC_PINNED_MIB": str(mib)})
    return user_cap.register(t, gpu, uid)


def _total(t: Tenancy, gpu: int = 0, uid: int = 0) -> int:
    return prolog.user_total_mib(None, t, gpu, uid)  # type: ignore[arg-type]


def test_one_commit_covers_every_registration_before_it(tmp_path: Path) -> None:
    t = Tenancy(tmp_path / "mps")
    tickets = [_register(t, 10 + i, 1024) for i in range(5)]
    assert tickets == [1, 2, 3, 4, 5]
    caps: list[int] = []
    sent = [user_cap.commit(t, 0, 0, k, lambda: _total(t), caps.append) for k in tickets]
    assert sent == [True, False, False, False, False]
    assert caps == [5 * 1024]  # the first commit summed all five registrations
    k = _register(t, 20, 2048)  # a later registration is not covered: it commits
    assert user_cap.commit(t, 0, 0, k, lambda: _total(t), caps.append)
    assert caps == [5 * 1024, 7 * 1024]


def test_counters_are_per_gpu_and_user(tmp_path: Path) -> None:
    t = Tenancy(tmp_path / "mps")
    a = _register(t, 1, 1024, gpu=0, uid=5)
    b = _register(t, 2, 2048, gpu=1, uid=5)
    c = _register(t, 3, 4096, gpu=0, uid=6)
    caps: list[tuple[int, int, int]] = []
    for gpu, uid, k in ((0, 5, a), (1, 5, b), (0, 6, c)):
        assert user_cap.commit(t, gpu, uid, k, lambda g=gpu, u=uid: _total(t, g, u),
                               lambda x, g=gpu, u=uid: caps.append((g, u, x)))
    assert caps == [(0, 5, 1024), (1, 5, 2048), (0, 6, 4096)]


def test_a_failed_commit_leaves_the_next_prolog_to_commit(tmp_path: Path) -> None:
    t = Tenancy(tmp_path / "mps")
    k1, k2 = _register(t, 1, 1024), _register(t, 2, 1024)

    def refuse(total: int) -> None:
        raise MpsControlError("busy")

    with pytest.raises(MpsControlError):
        user_cap.commit(t, 0, 0, k1, lambda: _total(t), refuse)
    caps: list[int] = []
    assert user_cap.commit(t, 0, 0, k2, lambda: _total(t), caps.append)
    assert caps == [2048]


def test_an_unreadable_counter_only_makes_a_commit_happen(tmp_path: Path) -> None:
    t = Tenancy(tmp_path / "mps")
    k = _register(t, 1, 1024)
    user_cap.commit(t, 0, 0, k, lambda: _total(t), lambda x: None)
    (t.user_dir(0, 0) / "cap.want").write_text("garbage\n")
    k2 = _register(t, 2, 1024)
    assert k2 == 2  # above done, never below it
    caps: list[int] = []
    assert user_cap.commit(t, 0, 0, k2, lambda: _total(t), caps.append)
    assert caps == [2048]


def test_a_counter_not_roots_reads_as_zero(tmp_path: Path) -> None:
    t = Tenancy(tmp_path / "mps")
    t.write_counter(0, 0, "done", 9)
    path = t.user_dir(0, 0) / "cap.done"
    link = t.user_dir(0, 0) / "cap.want"
    link.symlink_to(path)
    assert t.read_counter(0, 0, "done") == 9
    assert t.read_counter(0, 0, "want") == 0  # a link is never followed


def test_concurrent_prologs_each_end_covered(tmp_path: Path) -> None:
    """Threads stand for prologs: each registers under the GPU lock, then commits;
    when each returns, the applied cap holds its own limit and every one registered
    before it (ticket k: k jobs of 1 GiB)."""
    t = Tenancy(tmp_path / "mps")
    applied: list[int] = []
    short: list[tuple[int, int]] = []

    def one(job: int) -> None:
        with t.locked(0):
            k = _register(t, job, 1024)
        user_cap.commit(t, 0, 0, k, lambda: _total(t),
                        lambda x: (time.sleep(0.01), applied.append(x)))
        if max(applied) < k * 1024:
            short.append((k, max(applied)))

    threads = [threading.Thread(target=one, args=(100 + i,)) for i in range(12)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert short == []
    assert max(applied) == 12 * 1024
    assert len(applied) < 12  # commits were shared


def test_the_lock_wait_blocks_and_is_bounded(tmp_path: Path) -> None:
    t = Tenancy(tmp_path / "mps")
    t.gpu_dir(0).mkdir(parents=True)
    fd = os.open(t.gpu_dir(0) / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    import fcntl

    fcntl.flock(fd, fcntl.LOCK_EX)
    t0 = time.monotonic()
    with pytest.raises(TenancyError, match="held for over"), t.locked(0, timeout=0.3):
        pass
    assert 0.25 < time.monotonic() - t0 < 5
    threading.Timer(0.2, lambda: os.close(fd)).start()
    t0 = time.monotonic()
    with t.locked(0, timeout=10):
        waited = time.monotonic() - t0
    assert 0.1 < waited < 5


def test_the_main_thread_wait_sleeps_in_the_kernel(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """No sleep loop in the main thread (the node scripts): the wait is one flock."""
    monkeypatch.setattr(tenancy_mod.time, "sleep",
                        lambda s: pytest.fail("polled instead of blocking"))
    t = Tenancy(tmp_path / "mps")
    t.gpu_dir(0).mkdir(parents=True)
    fd = os.open(t.gpu_dir(0) / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    import fcntl

    fcntl.flock(fd, fcntl.LOCK_EX)
    threading.Timer(0.2, lambda: os.close(fd)).start()
    with t.locked(0, timeout=10):
        pass
    with pytest.raises(TenancyError):  # and bounded, with no alarm left behind
        fd2 = os.open(t.gpu_dir(0) / "lock", os.O_RDWR)
        fcntl.flock(fd2, fcntl.LOCK_EX)
        with t.locked(0, timeout=0.2):
            pass
    os.close(fd2)
    import signal

    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0


def test_a_commit_that_cannot_run_takes_mps_back_from_its_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cap lock timed out (or anything else failed): the job's env files and
    marker go, so its TaskProlog exports no pipe directory under a cap that may not
    hold its share; the co-tenant's registration stays."""
    from types import SimpleNamespace

    t = Tenancy(tmp_path / "mps")
    _register(t, 6, 1024)
    k = _register(t, 7, 1024)

    def stuck(*a: object, **kw: object) -> bool:
        raise TenancyError("GPU 0 user 0 cap: lock held for over 60s")

    monkeypatch.setattr(user_cap, "commit", stuck)
    ctx = SimpleNamespace(job_id=7, uid=0, gpus=(0,))
    with pytest.raises(TenancyError):
        prolog._commit_cap(ctx, None, t, None, k, 0)  # type: ignore[arg-type]
    assert t.jobs_of(0, 0) == [6]
    assert not t.job_env_file(7).exists() and t.read_job_limits(7) is None
    assert t.read_job_limits(6) is not None


def test_the_committer_and_its_control_program_run_ahead_while_others_wait(
        tmp_path: Path) -> None:
    """Issue 28: under a burst the committer used 0.2 s of CPU over 3-4 s of wall while
    the GPU's other prologs waited on its lock. While it applies the cap it runs at
    ``priority.HOLDER_NICE`` (root), and so does the control program it starts; before
    and after, its own priority."""
    import subprocess
    import sys

    from slurm_colloc import priority

    t = Tenancy(tmp_path / "mps")
    k = _register(t, 10, 1024)
    before = os.getpriority(os.PRIO_PROCESS, 0)
    seen: list[tuple[int, int]] = []

    def apply(mib: int) -> None:
        child = subprocess.run([sys.executable, "-c", "import os; print(os.getpriority(0, 0))"],
                               capture_output=True, text=True, check=True, timeout=60)
        seen.append((os.getpriority(os.PRIO_PROCESS, 0), int(child.stdout)))

    assert user_cap.commit(t, 0, 0, k, lambda: _total(t), apply)
    want = priority.HOLDER_NICE if os.geteuid() == 0 else before
    assert seen == [(want, want)]
    assert os.getpriority(os.PRIO_PROCESS, 0) == before  # given back

    def failing(mib: int) -> None:
        raise MpsControlError("refused")

    k2 = _register(t, 11, 1024)
    with pytest.raises(MpsControlError):
        user_cap.commit(t, 0, 0, k2, lambda: _total(t), failing)
    assert os.getpriority(os.PRIO_PROCESS, 0) == before  # given back on failure too
