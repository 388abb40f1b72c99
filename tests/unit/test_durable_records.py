"""Issue 28 item 1: durable records.

Fault injection lost 4 of 6 records with slurmdbd and MariaDB away for 243 s: the
writer gave up after ~36 s and left a file nothing replayed, and spool files named
per job let an older attempt's writer overwrite the final record. These tests drive
the spool, the replayer, the epilog's fallback and ``colloc admin records`` with a
fake slurmdbd, temporary directories and an injected clock.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from slurm_colloc.accounting import codec, newest
from slurm_colloc.accounting import spool as spoolmod
from slurm_colloc.accounting.record import Attempt, JobRecord, OomInfo, Requeue
from slurm_colloc.cli import records_cmd
from slurm_colloc.config import CollocConfig
from slurm_colloc.node import record_writer
from slurm_colloc.slurm.adapter import AccountingRecord, SlurmError

JOB = 501


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def monotonic(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
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


def _attempt(n: int, *, requeued: bool = False, cause: str = "none") -> Attempt:
    return Attempt(attempt=n, shards=4 * (n + 1), node="n1",
                   oom=OomInfo(cause) if cause != "none" else None,  # type: ignore[arg-type]
                   requeue=Requeue(requeued, "gpu-oom: whole GPU") if requeued else None)


def _text(*attempts: Attempt) -> str:
    return codec.encode(JobRecord(attempts=attempts))


A0 = _attempt(0, requeued=True, cause="gpu-oom")
A1 = _attempt(1)
REC_0 = _text(A0)  # the requeued attempt's record
REC_01 = _text(A0, A1)  # the final record, carrying attempt 0
REC_1_ALONE = _text(A1)  # the final record when the requeue's carry was lost


def _attempts_in(comment: str) -> list[int]:
    rec = codec.try_decode(comment)
    return sorted(newest.attempt_numbers(rec))


class Dbd:
    """slurmdbd with one row per attempt (``sacct --duplicates``); ``down`` raises
    like sacct does; ``drop`` accepts writes but keeps nothing (read-back differs)."""

    def __init__(self, rows: int = 1, *, finished: bool = True, down: bool = False,
                 drop: bool = False, comment: str = "") -> None:
        self.rows, self.finished, self.down, self.drop = rows, finished, down, drop
        self.comment = comment
        self.writes: list[str] = []

    def accounting(self, job_ids: list[int]) -> list[AccountingRecord]:
        if self.down:
            raise SlurmError("sacct: error: Problem talking to the database: Connection refused")
        out = []
        for j in job_ids:
            for n in range(self.rows):
                last = n == self.rows - 1
                state = "COMPLETED" if last and self.finished else (
                    "REQUEUED" if not last else "RUNNING")
                end = "2026-01-01T00:01:00" if state != "RUNNING" else "Unknown"
                out.append(AccountingRecord(str(j), state, {
                    "State": state, "End": end, "Start": f"2026-01-01T00:00:0{n}",
                    "AdminComment": self.comment if last else ""}))
        return out

    def set_admin_comment_finished(self, job_id: int, value: str) -> None:
        if self.down:
            raise SlurmError("sacctmgr: slurmdbd unreachable")
        self.writes.append(value)
        if not self.drop:
            self.comment = value.lower()


def _log(job: int) -> logging.LoggerAdapter[Any]:
    return logging.LoggerAdapter(logging.getLogger("test.durable"), {})


def _left(spool: Path) -> list[str]:
    return sorted(p.name for p in spool.glob("*.adminc"))


# ---------------------------------------------------------------- the spool ---


def test_one_file_per_attempt_written_whole_and_synced(spool: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(spoolmod.os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    p0 = spoolmod.write_entry(spool, JOB, 0, REC_0)
    p1 = spoolmod.write_entry(spool, JOB, 1, REC_01)
    assert (p0.name, p1.name) == (f"{JOB}.0.adminc", f"{JOB}.1.adminc")
    assert p0.read_text() == REC_0 and p1.read_text() == REC_01  # neither overwrote the other
    assert len(synced) == 4  # each file and the directory, before the rename counts
    assert [(e.job_id, e.attempt) for e in spoolmod.entries(spool)] == [(JOB, 0), (JOB, 1)]
    assert not [p for p in spool.iterdir() if p.name.endswith(".tmp")]


def test_a_full_disk_leaves_nothing_half_written(spool: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, data: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(spoolmod.os, "write", full)
    with pytest.raises(OSError, match="No space"):
        spoolmod.write_entry(spool, JOB, 0, REC_0)
    assert list(spool.iterdir()) == []


def test_legacy_per_job_files_are_replayed_too(spool: Path) -> None:
    (spool / "77.adminc").write_text("x")
    (spool / "78.adminc.failed").write_text("y")
    assert [(e.job_id, e.attempt) for e in spoolmod.entries(spool)] == [(77, None), (78, None)]


# ------------------------------------------------------- newest attempt wins ---


def test_older_attempt_spooled_last_never_replaces_the_final_record(spool: Path,
                                                                    clock: FakeClock) -> None:
    """The final record is in accounting; the requeued attempt's writer runs last."""
    dbd = Dbd(rows=2, comment=REC_01.lower())
    spoolmod.write_entry(spool, JOB, 0, REC_0)
    record_writer.run_writer(spool, dbd, _log)
    assert dbd.writes == []  # nothing written over it
    assert _attempts_in(dbd.comment) == [0, 1]
    assert _left(spool) == []  # confirmed by reading accounting: removed


def test_both_attempts_pending_write_the_newest_once(spool: Path, clock: FakeClock) -> None:
    """Either order of arrival: the newest attempt's record is written, once, and
    settles the older entry too."""
    for order in ((0, 1), (1, 0)):
        dbd = Dbd(rows=2)
        here = spool / f"order-{order[0]}"  # each order on a spool of its own
        here.mkdir()
        for n in order:
            spoolmod.write_entry(here, JOB, n, REC_0 if n == 0 else REC_01)
        assert record_writer.run_writer(here, dbd, _log) == 2
        assert len(dbd.writes) == 1 and _attempts_in(dbd.writes[0]) == [0, 1]
        assert _left(here) == []


def test_a_lost_carry_is_merged_back(spool: Path, clock: FakeClock) -> None:
    """The requeue's AdminComment carry was lost: the final record lacks attempt 0;
    what is written holds both, the final attempt's details first."""
    dbd = Dbd(rows=2)
    spoolmod.write_entry(spool, JOB, 0, REC_0)
    spoolmod.write_entry(spool, JOB, 1, REC_1_ALONE)
    record_writer.run_writer(spool, dbd, _log)
    assert _attempts_in(dbd.comment) == [0, 1]
    assert _left(spool) == []


def test_a_requeued_attempt_waits_while_the_job_runs_again(spool: Path, clock: FakeClock) -> None:
    """Accounting shows a later attempt running: nothing is written over the live
    job; the entry waits (the final record will carry it)."""
    dbd = Dbd(rows=2, finished=False)
    spoolmod.write_entry(spool, JOB, 0, REC_0)
    record_writer.run_writer(spool, dbd, _log)
    assert dbd.writes == [] and _left(spool) == [f"{JOB}.0.adminc"]
    assert "waiting for the job's end" in (spool / f"{JOB}.0.adminc.err").read_text()


def test_same_attempt_with_a_new_outcome_is_written(spool: Path, clock: FakeClock) -> None:
    """A requeue retried later did not land: the entry is rewritten in place and the
    record in accounting ("requeued") is replaced by what happened."""
    failed = _text(Attempt(attempt=0, oom=OomInfo("gpu-oom"),
                           requeue=Requeue(False, "requeue failed: slurmctld away")))
    dbd = Dbd(rows=1, comment=REC_0.lower())
    spoolmod.write_entry(spool, JOB, 0, failed)
    record_writer.run_writer(spool, dbd, _log)
    assert dbd.writes == [failed]
    assert _left(spool) == []


# ------------------------------------------- idempotent, confirmed, replayed ---


def test_replay_is_idempotent(spool: Path, clock: FakeClock) -> None:
    dbd = Dbd(rows=1)
    spoolmod.write_entry(spool, JOB, 0, REC_0)
    assert record_writer.run_writer(spool, dbd, _log) == 1
    spoolmod.write_entry(spool, JOB, 0, REC_0)  # a second writer replays the same
    record_writer.run_writer(spool, dbd, _log)
    assert len(dbd.writes) == 1 and _left(spool) == []


def test_an_unconfirmed_write_keeps_the_entry(spool: Path, clock: FakeClock) -> None:
    """sacctmgr said yes but the read-back does not show it: never deleted."""
    dbd = Dbd(rows=1, drop=True)
    spoolmod.write_entry(spool, JOB, 0, REC_0)
    assert record_writer.run_writer(spool, dbd, _log) == 0
    assert len(dbd.writes) == record_writer.TRIES
    assert _left(spool) == [f"{JOB}.0.adminc"]
    assert "read back a different value" in (spool / f"{JOB}.0.adminc.err").read_text()


def test_accounting_away_then_back(spool: Path, clock: FakeClock) -> None:
    """The writer leaves the entry when slurmdbd stays away (bounded), saying why;
    a later replay writes it as soon as slurmdbd answers."""
    dbd = Dbd(rows=2, down=True)
    spoolmod.write_entry(spool, JOB, 0, REC_0)
    spoolmod.write_entry(spool, JOB, 1, REC_01)
    t0 = clock.t
    record_writer.run_writer(spool, dbd, _log)
    assert clock.t - t0 <= record_writer.RUN_S + record_writer.MAX_PAUSE_S
    assert _left(spool) == [f"{JOB}.0.adminc", f"{JOB}.1.adminc"]
    assert "slurmdbd unreachable" in (spool / f"{JOB}.1.adminc.err").read_text()
    dbd.down = False
    t1 = clock.t
    assert record_writer.run_writer(spool, dbd, _log) == 2
    assert clock.t - t1 < 5  # written in the first round, no new wait
    assert _attempts_in(dbd.comment) == [0, 1] and _left(spool) == []


# ------------------------------------------------------------ the full disk ---


def _ctx(tmp_path: Path) -> tuple[Any, CollocConfig]:
    from types import SimpleNamespace

    cfg = CollocConfig(evidence_dir=str(tmp_path / "var" / "evidence"))
    return SimpleNamespace(job_id=JOB, restarts=0), cfg


def test_full_disk_goes_to_an_in_memory_writer(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from slurm_colloc.node import epilog

    def full(*a: Any) -> Path:
        raise OSError(errno.ENOSPC, "No space left on device")

    direct: list[tuple[Any, ...]] = []
    monkeypatch.setattr(spoolmod, "write_entry", full)
    monkeypatch.setattr(record_writer, "spawn_direct", lambda *a: direct.append(a))
    ctx, cfg = _ctx(tmp_path)
    r = epilog.EpilogResult(JOB)
    epilog._spool_record(ctx, cfg, REC_01, r)
    assert [(a[0], a[1]) for a in direct] == [(JOB, REC_01)]
    assert r.errors[0].startswith("RECORD NOT SPOOLED") and r.record_spooled is None


def test_full_disk_before_a_requeue_leaves_the_record_to_the_carry(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from slurm_colloc.node import epilog

    def full(*a: Any) -> Path:
        raise OSError(errno.ENOSPC, "No space left on device")

    direct: list[Any] = []
    monkeypatch.setattr(spoolmod, "write_entry", full)
    monkeypatch.setattr(record_writer, "spawn_direct", lambda *a: direct.append(a))
    ctx, cfg = _ctx(tmp_path)
    r = epilog.EpilogResult(JOB)
    epilog._spool_entry(ctx, cfg, REC_0, r, kick=False)  # before the requeue
    assert direct == []  # the requeue's AdminComment carries it, and the log says so
    assert "the requeue carries it" in r.errors[0]


def test_the_requeued_attempt_is_spooled_before_slurm_is_asked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from slurm_colloc.node import epilog

    ctx, cfg = _ctx(tmp_path)
    r = epilog.EpilogResult(JOB)
    epilog._spool_entry(ctx, cfg, REC_0, r, kick=False)
    assert Path(r.record_spooled or "").read_text() == REC_0
    assert Path(r.record_spooled or "").name == f"{JOB}.0.adminc"


def test_direct_writer_waits_for_the_end_and_respects_a_newer_record(clock: FakeClock) -> None:
    dbd = Dbd(rows=1, finished=False)
    calls = {"n": 0}
    real = dbd.accounting

    def ending(job_ids: list[int]) -> list[AccountingRecord]:
        calls["n"] += 1
        dbd.finished = calls["n"] > 3
        return real(job_ids)

    dbd.accounting = ending  # type: ignore[method-assign]
    assert record_writer.write_direct(dbd, JOB, REC_0, _log(JOB))
    assert dbd.writes == [REC_0]
    newer = Dbd(rows=2, comment=REC_01.lower())
    assert record_writer.write_direct(newer, JOB, REC_0, _log(JOB))
    assert newer.writes == []


# --------------------------------------------------------------- the admin ---


def test_admin_listing_and_replay(spool: Path, clock: FakeClock) -> None:
    p = spoolmod.write_entry(spool, JOB, 1, REC_01)
    os.utime(p, (p.stat().st_mtime - 300, p.stat().st_mtime - 300))
    spoolmod.note_error(spoolmod.entries(spool)[0], "accounting unreachable: sacct: refused")
    lines = records_cmd.listing(spool)
    assert lines[0].startswith("1 pending record(s)")
    assert lines[2].split()[:4] == [str(JOB), "1", "5m", "pending"]
    assert lines[2].endswith("accounting unreachable: sacct: refused")
    n, note = records_cmd.replay(spool, Dbd(rows=2), CollocConfig(), _log)
    assert n == 1 and "1 record(s) read back in accounting" in note
    # written and read back: kept, shown apart, until slurmctld forgets the job
    lines = records_cmd.listing(spool)
    assert lines[0].startswith("0 pending record(s)") and "1 written and confirming" in lines[0]
    assert lines[2].split()[:4] == [str(JOB), "1", "0s", "confirming"]


def test_admin_replay_defers_to_a_running_writer(spool: Path) -> None:
    spoolmod.write_entry(spool, JOB, 0, REC_0)
    fd = spoolmod.try_lock(spool)
    try:
        n, note = records_cmd.replay(spool, Dbd(), CollocConfig(), _log)
    finally:
        os.close(fd or -1)
    assert n == 0 and "a writer is replaying" in note


def test_kick_starts_a_writer_only_for_a_non_empty_spool(spool: Path) -> None:
    started: list[Any] = []

    def spawner(module: str, args: Any, env: Any, *, pass_fd: int) -> None:
        started.append((module, args))

    assert not spoolmod.kick(spool, {}, spawner=spawner)
    spoolmod.write_entry(spool, JOB, 0, REC_0)
    assert spoolmod.kick(spool, {}, spawner=spawner)
    fd = spoolmod.try_lock(spool)
    try:
        assert not spoolmod.kick(spool, {}, spawner=spawner)  # a writer holds the lock
    finally:
        os.close(fd or -1)
    assert [m for m, _ in started] == [record_writer.MODULE]
