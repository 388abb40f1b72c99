"""Issue 23 (low): every finished job started a detached root process that polled
sacct every second for 120 s, so a flood of short jobs forked hundreds of pollers.

Now the epilog leaves its record in root's spool and starts a writer only when none
runs on the node: one writer at a time (a root-only lock in the spool directory)
drains every pending record with one ``sacct`` per round for all of them, backs off
while nothing can be written, gives a record up after a bounded number of tries, and
exits when the spool is empty.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from slurm_colloc.node import record_writer
from slurm_colloc.slurm.adapter import AccountingRecord, SlurmError


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    c = FakeClock()
    monkeypatch.setattr(record_writer, "time", c)
    return c


@pytest.fixture
def spool(tmp_path: Path) -> Path:
    d = tmp_path / "spool"
    d.mkdir(mode=0o700)
    return d


def _rec(job: int, state: str = "FAILED", end: str = "2026-01-01T00:00:10",
         comment: str = "") -> AccountingRecord:
    return AccountingRecord(str(job), state, {"State": state, "End": end,
                                              "Start": "2026-01-01T00:00:00",
                                              "AdminComment": comment})


class Dbd:
    """slurmdbd: ``finished`` jobs have their end recorded; writes are remembered."""

    def __init__(self, finished: set[int] | None = None, *, refuse: set[int] | None = None,
                 down: bool = False) -> None:
        self.finished = set() if finished is None else finished
        self.refuse = refuse or set()
        self.down = down
        self.comments: dict[int, str] = {}
        self.sacct_calls: list[list[int]] = []
        self.writes: list[int] = []

    def accounting(self, job_ids: list[int]) -> list[AccountingRecord]:
        self.sacct_calls.append([int(j) for j in job_ids])
        if self.down:
            raise SlurmError("sacct: slurmdbd not responding")
        out = []
        for j in map(int, job_ids):
            if j in self.finished:
                out.append(_rec(j, comment=self.comments.get(j, "")))
            else:
                out.append(_rec(j, state="RUNNING", end="Unknown",
                                comment=self.comments.get(j, "")))
        return out

    def set_admin_comment_finished(self, job_id: int, value: str) -> None:
        self.writes.append(int(job_id))
        if int(job_id) in self.refuse:
            raise SlurmError("sacctmgr: job not found")
        self.comments[int(job_id)] = value.lower()


def _put(spool: Path, job: int, text: str = "cl1:rec") -> Path:
    p = record_writer.spool_path(str(spool), job)
    p.write_text(text)
    return p


# --------------------------------------------------- one writer per node ---


def test_no_second_writer_while_one_holds_the_lock(spool: Path, monkeypatch) -> None:
    """50 epilogs while a writer runs start no process; the first after it ends does."""
    started: list[tuple[Any, ...]] = []
    locked_at_spawn: list[bool] = []

    def fake_spawn(module: str, args: tuple[str, ...], env: Any, *, pass_fd: int) -> None:
        started.append((module, args, pass_fd))
        locked_at_spawn.append(record_writer.try_lock(spool) is None)

    monkeypatch.setattr(record_writer, "spawn_module", fake_spawn)
    held = record_writer.try_lock(spool)
    assert held is not None
    try:
        for job in range(50):
            assert not record_writer.spawn(job, _put(spool, job), {"PATH": "/bin"})
        assert started == []
    finally:
        os.close(held)
    assert record_writer.spawn(50, _put(spool, 50), {"PATH": "/bin"})
    assert len(started) == 1
    module, args, _ = started[0]
    assert module == "slurm_colloc.node.record_writer"
    assert args == ("50", str(spool / "50.adminc"), "3")
    # the lock is already held when the writer is started (it inherits it), and the
    # epilog's own copy is closed afterwards
    assert locked_at_spawn == [True]
    fd = record_writer.try_lock(spool)
    assert fd is not None
    os.close(fd)


def test_the_writer_inherits_the_held_lock(spool: Path) -> None:
    """The real hand-over: the detached helper keeps the lock after the epilog closed
    its descriptor, until it exits."""
    import time as real_time

    from slurm_colloc.detach import spawn_module

    fd = record_writer.try_lock(spool)
    assert fd is not None
    try:
        spawn_module("timeit", ("-n", "1", "-r", "1", "import time; time.sleep(3)"),
                     {"PATH": "/usr/bin:/bin"}, pass_fd=fd)
    finally:
        os.close(fd)
    assert record_writer.try_lock(spool) is None  # the helper holds it
    deadline = real_time.monotonic() + 20
    while (fd2 := record_writer.try_lock(spool)) is None and real_time.monotonic() < deadline:
        real_time.sleep(0.2)
    assert fd2 is not None, "the lock was never released"
    os.close(fd2)


def test_a_handed_over_lock_is_verified(spool: Path, tmp_path: Path) -> None:
    fd = record_writer.try_lock(spool)
    assert fd is not None
    assert record_writer._adopt_lock(fd, spool) == fd
    os.close(fd)
    other = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT, 0o600)
    assert record_writer._adopt_lock(other, spool) is None  # not the spool's lock: closed
    with pytest.raises(OSError):
        os.fstat(other)


def test_the_lock_is_roots_and_never_followed(spool: Path, tmp_path: Path) -> None:
    fd = record_writer.try_lock(spool)
    assert fd is not None
    os.close(fd)
    st = os.lstat(spool / record_writer.LOCK_NAME)
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o600
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    target = tmp_path / "target"
    target.write_text("")
    (other / record_writer.LOCK_NAME).symlink_to(target)
    with pytest.raises(OSError):
        record_writer.try_lock(other)  # a link: refused (and reported), not followed


def test_a_second_writer_exits_at_once(spool: Path, clock: FakeClock) -> None:
    held = record_writer.try_lock(spool)
    assert held is not None
    try:
        _put(spool, 1)
        dbd = Dbd({1})
        assert record_writer.run_writer(spool, dbd, _log()) == 0
        assert dbd.sacct_calls == [] and (spool / "1.adminc").exists()
    finally:
        os.close(held)


# ------------------------------------------------------------- draining ---


def _log() -> Any:
    """``log_for(job)``: a logger for messages about one job."""
    import logging

    return lambda job: logging.LoggerAdapter(logging.getLogger("test.record-writer"), {})


def test_drains_every_pending_record_with_one_sacct_per_round(spool: Path,
                                                              clock: FakeClock) -> None:
    for job in (11, 12, 13):
        _put(spool, job, f"cl1:rec{job}")
    dbd = Dbd({11, 12, 13})
    assert record_writer.run_writer(spool, dbd, _log()) == 3
    assert sorted(dbd.comments) == [11, 12, 13] and dbd.comments[12] == "cl1:rec12"
    assert not list(spool.glob("*.adminc"))
    # one sacct for the three states, then one read-back per write
    assert sorted(dbd.sacct_calls[0]) == [11, 12, 13]
    assert len(dbd.sacct_calls) == 1 + 3


def test_waits_for_the_end_with_backoff_then_writes_anyway(spool: Path,
                                                           clock: FakeClock) -> None:
    """A job slurmdbd never shows finished is written after the bounded wait; the
    pauses grow (no poll every second) up to the cap."""
    _put(spool, 21)
    dbd = Dbd(set())
    assert record_writer.run_writer(spool, dbd, _log()) == 1
    assert dbd.writes == [21]
    assert clock.sleeps[:4] == [1.0, 2.0, 4.0, 8.0]
    assert max(clock.sleeps) <= record_writer.MAX_PAUSE_S
    assert clock.t - 1000.0 >= record_writer.WAIT_S
    assert len(dbd.sacct_calls) < 20  # not 120 polls


def test_a_refused_record_is_kept_for_the_next_replay_and_the_writer_ends(
        spool: Path, clock: FakeClock) -> None:
    """Issue 28: nothing is given up; the entry stays with the reason beside it."""
    _put(spool, 31)
    _put(spool, 32)
    dbd = Dbd({31, 32}, refuse={31})
    assert record_writer.run_writer(spool, dbd, _log()) == 1
    assert dbd.writes.count(31) == record_writer.TRIES
    assert (spool / "31.adminc").read_text() == "cl1:rec"  # left for the next replay
    assert "job not found" in (spool / "31.adminc.err").read_text()
    assert not (spool / "32.adminc").exists()


def test_slurmdbd_down_is_bounded(spool: Path, clock: FakeClock) -> None:
    _put(spool, 41)
    dbd = Dbd({41}, down=True)
    record_writer.run_writer(spool, dbd, _log())
    assert (spool / "41.adminc").exists()
    assert "slurmdbd not responding" in (spool / "41.adminc.err").read_text()
    assert clock.t - 1000.0 < record_writer.WAIT_S + record_writer.TRIES * (
        record_writer.MAX_PAUSE_S + 1) * 2


def test_a_record_spooled_while_the_writer_ends_is_not_orphaned(spool: Path, clock: FakeClock,
                                                                 monkeypatch) -> None:
    """The writer releases its lock, then looks again: a record an epilog left
    meanwhile (it saw the lock held and started nobody) is still written."""
    _put(spool, 51)
    real = record_writer.drain
    rounds: list[int] = []

    def drain_then_spool(*a: Any, **k: Any) -> int:
        n = real(*a, **k)
        rounds.append(n)
        if len(rounds) == 1:
            _put(spool, 52)  # arrives as the first drain finishes
        return n

    monkeypatch.setattr(record_writer, "drain", drain_then_spool)
    dbd = Dbd({51, 52})
    assert record_writer.run_writer(spool, dbd, _log()) == 2
    assert sorted(dbd.comments) == [51, 52] and rounds == [1, 1]


def test_spool_entries_are_read_bounded_and_never_through_a_link(spool: Path, tmp_path: Path,
                                                                 clock: FakeClock) -> None:
    secret = tmp_path / "secret"
    secret.write_text("root's secret")
    (spool / "61.adminc").symlink_to(secret)
    _put(spool, 62, "a" * 70000)
    (spool / "not-a-job.adminc").write_text("x")
    dbd = Dbd({61, 62})
    record_writer.run_writer(spool, dbd, _log())
    assert 61 not in dbd.comments
    assert len(dbd.comments[62]) == 65536


def test_pending_is_bounded(spool: Path, monkeypatch) -> None:
    monkeypatch.setattr(record_writer, "BATCH", 5)
    for job in range(20):
        _put(spool, job)
    assert len(record_writer.pending(spool)) == 5


def test_run_writer_uses_the_lock_it_was_handed(spool: Path, clock: FakeClock) -> None:
    fd = record_writer.try_lock(spool)
    assert fd is not None
    _put(spool, 71)
    dbd = Dbd({71})
    assert record_writer.run_writer(spool, dbd, _log(), held=fd) == 1
    with pytest.raises(OSError):
        os.fstat(fd)  # released (closed) when done


def test_a_writer_that_finds_a_newer_writer_after_its_round_exits_at_once(
        spool: Path, clock: FakeClock, monkeypatch) -> None:
    """After its round the lock held by anyone else is a newer writer's, which drains
    what is left: no waiting on it (each waiting loser was one more root process alive
    during a flood of short jobs: 3 at once seen on two cores)."""
    _put(spool, 81)
    real_lock, real_drain = record_writer.try_lock, record_writer.drain
    calls: list[str] = []

    def lock(d: Path) -> int | None:
        calls.append("lock")
        return real_lock(d) if len(calls) == 1 else None  # then a newer writer holds it

    def drain_then_spool(*a: Any, **k: Any) -> int:
        n = real_drain(*a, **k)
        _put(spool, 82)  # left by an epilog that handed the lock to a newer writer
        return n

    monkeypatch.setattr(record_writer, "try_lock", lock)
    monkeypatch.setattr(record_writer, "drain", drain_then_spool)
    assert record_writer.run_writer(spool, Dbd({81, 82}), _log()) == 1
    assert calls == ["lock", "lock"] and clock.sleeps == []


class HeldDbd(Dbd):
    """Jobs in ``held`` were requeued and are held by their owner: two rows (the
    requeued attempt and the pending one), never an end."""

    def __init__(self, finished: set[int], held: set[int]) -> None:
        super().__init__(finished)
        self.held = held

    def accounting(self, job_ids: list[int]) -> list[AccountingRecord]:
        out = super().accounting([j for j in job_ids if int(j) not in self.held])
        for j in map(int, job_ids):
            if j in self.held:
                out += [_rec(j, state="REQUEUED"), _rec(j, state="PENDING", end="Unknown")]
        return out


def test_entries_that_only_wait_never_starve_a_newer_record(spool: Path,
                                                             clock: FakeClock) -> None:
    """Review finding (issue 28): a user who requeue-holds 100 of their own jobs left
    100 spool entries that wait for ever (a later attempt exists, no end); the writer
    looked only at the 100 oldest, so no newer job's record on that node was ever
    written. The writer now looks at the entries it has looked at least first."""
    held = set(range(1000, 1000 + record_writer.BATCH))
    for i, job in enumerate(sorted(held)):
        p = _put(spool, job)
        p.rename(record_writer.spool_path(str(spool), job, 0))
        os.utime(record_writer.spool_path(str(spool), job, 0), (1000.0 + i, 1000.0 + i))
    _put(spool, 77, "cl1:rec77")  # newer than every held one
    dbd = HeldDbd({77}, held)
    record_writer.run_writer(spool, dbd, _log())
    assert dbd.comments.get(77) == "cl1:rec77"
    assert not (spool / "77.adminc").exists()
    assert len(list(spool.glob("*.0.adminc"))) == record_writer.BATCH  # still waiting


def test_a_spool_file_not_written_by_the_writers_user_is_never_replayed(
        spool: Path, clock: FakeClock) -> None:
    """Review finding (issue 28): with the spool under a directory users can write, a
    planted ``<job>.0.adminc`` was read by root and written into that job's record.
    A file the writer's own user (root) did not write is set aside, never replayed."""
    assert os.geteuid() == 0, "the suite runs as root, as the node scripts do"
    os.chown(_put(spool, 63, "cl1:forged"), 65534, 65534)  # nobody wrote it
    dbd = Dbd({63})
    record_writer.run_writer(spool, dbd, _log())
    assert 63 not in dbd.comments and dbd.writes == []
    assert (spool / "63.adminc.unreadable").exists()
