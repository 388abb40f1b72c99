"""Issue 28: a record written and read back is kept until slurmctld forgets the job.

With slurmctld SIGKILLed shortly after a job ended, its restart re-sent the job to
slurmdbd with its own AdminComment (empty, or the requeue's carry holding attempt 0
only) and replaced the record colloc had written and read back (measured on the
devcluster: ``{1: [[], [0, 1]], 2: [[0]]}`` before the restart, ``{1: [[], [0]],
2: [[]]}`` right after it). The writer had removed its spool entry, so nothing wrote
it again. Now the entry stays *confirming*: every replay re-reads accounting, writes
a replaced record again, and removes the entry once slurmctld no longer holds the
job. A fake slurmdbd and slurmctld, temporary directories, an injected clock.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest

from slurm_colloc.accounting import codec, newest
from slurm_colloc.accounting import spool as spoolmod
from slurm_colloc.accounting.record import Attempt, JobRecord, OomInfo, Requeue
from slurm_colloc.cli import records_cmd
from slurm_colloc.node import record_writer
from slurm_colloc.slurm.adapter import AccountingRecord, SlurmError

JOB, OTHER = 701, 702


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


def _text(*attempts: Attempt) -> str:
    return codec.encode(JobRecord(attempts=attempts))


A0 = Attempt(attempt=0, shards=6, node="n1", oom=OomInfo("gpu-oom"),
             requeue=Requeue(True, "gpu-oom: whole GPU"))
A1 = Attempt(attempt=1, shards=39, node="n1")
REC_0 = _text(A0)  # the requeued attempt's record: also slurmctld's carry
REC_01 = _text(A0, A1)  # the final record
GOOD = _text(Attempt(attempt=0, shards=4, node="n1"))


class Slurm:
    """slurmdbd (one finished row per attempt, comments by job) and slurmctld (the
    jobs it still holds; ``ctld_down`` raises like squeue does)."""

    def __init__(self, rows: dict[int, int]) -> None:
        self.rows = rows
        self.comment: dict[int, str] = {j: "" for j in rows}
        self.held: set[int] = set(rows)
        self.ctld_down = False
        self.writes: list[tuple[int, str]] = []
        self.sacct_calls: list[list[int]] = []
        self.squeue_calls: list[list[int]] = []

    def accounting(self, job_ids: list[int]) -> list[AccountingRecord]:
        self.sacct_calls.append([int(j) for j in job_ids])
        out = []
        for j in map(int, job_ids):
            for n in range(self.rows[j]):
                last = n == self.rows[j] - 1
                state = "COMPLETED" if last else "REQUEUED"
                out.append(AccountingRecord(str(j), state, {
                    "State": state, "End": "2026-01-01T00:01:00",
                    "Start": f"2026-01-01T00:00:0{n}",
                    "AdminComment": self.comment[j] if last else ""}))
        return out

    def set_admin_comment_finished(self, job_id: int, value: str) -> None:
        self.writes.append((int(job_id), value))
        self.comment[int(job_id)] = value.lower()

    def jobs_among(self, job_ids: Any) -> dict[int, Any]:
        ids = sorted(int(j) for j in job_ids)
        self.squeue_calls.append(ids)
        if self.ctld_down:
            raise SlurmError("squeue: slurm_load_jobs error: Unable to contact slurm controller")
        return {j: object() for j in ids if j in self.held}

    def restart_replaces(self, job: int, text: str) -> None:
        """slurmctld, restarted, re-sends the job with its own AdminComment."""
        self.comment[job] = text.lower()


def _log(job: int) -> logging.LoggerAdapter[Any]:
    return logging.LoggerAdapter(logging.getLogger("test.confirming"), {})


def _attempts(comment: str) -> list[int]:
    return sorted(newest.attempt_numbers(codec.try_decode(comment)))


def _later(spool: Path, clock: FakeClock, seconds: float = record_writer.CONFIRM_EVERY_S) -> None:
    """Time passes: the writer's clock, and the confirming entries' file times (when
    written, when last looked at)."""
    clock.t += seconds
    for p in spool.iterdir():
        if p.name.endswith((spoolmod.CONFIRM_SUFFIX, spoolmod.CONFIRM_SUFFIX + ".err")):
            t = p.stat().st_mtime - seconds
            os.utime(p, (t, t))


def _requeued_job_written(spool: Path) -> Slurm:
    s = Slurm({JOB: 2, OTHER: 1})
    spoolmod.write_entry(spool, JOB, 0, REC_0)
    spoolmod.write_entry(spool, JOB, 1, REC_01)
    spoolmod.write_entry(spool, OTHER, 0, GOOD)
    assert record_writer.run_writer(spool, s, _log) == 3
    assert _attempts(s.comment[JOB]) == [0, 1] and _attempts(s.comment[OTHER]) == [0]
    return s


def test_a_record_replaced_after_it_was_read_back_is_written_again(spool: Path,
                                                                   clock: FakeClock) -> None:
    """The devcluster's loss: slurmctld's restart replaces both jobs' records (the OOM
    job's with its carry of attempt 0, the other with nothing); the next replay (the
    collector's kick) writes both again, every attempt in them."""
    s = _requeued_job_written(spool)
    assert not list(spool.glob("*.adminc"))  # nothing pending
    assert len([e for e in spoolmod.entries(spool) if e.confirming]) == 3
    s.restart_replaces(JOB, REC_0)
    s.restart_replaces(OTHER, "")
    _later(spool, clock)
    s.writes.clear()
    record_writer.run_writer(spool, s, _log)
    assert _attempts(s.comment[JOB]) == [0, 1]  # newest attempt wins again
    assert _attempts(s.comment[OTHER]) == [0]
    assert sorted(j for j, _ in s.writes) == [JOB, OTHER]  # one write per job
    assert len([e for e in spoolmod.entries(spool) if e.confirming]) == 3  # still kept


def test_confirming_entries_go_once_slurmctld_has_forgotten_the_job(spool: Path,
                                                                    clock: FakeClock) -> None:
    """Kept while slurmctld holds the job; asked only after CONFIRM_MIN_S, once per
    round for every such job; removed once it no longer holds it."""
    s = _requeued_job_written(spool)
    _later(spool, clock)
    record_writer.run_writer(spool, s, _log)
    assert s.squeue_calls == []  # written moments ago: accounting re-read only
    assert len(spoolmod.entries(spool)) == 3
    _later(spool, clock, record_writer.CONFIRM_MIN_S)
    record_writer.run_writer(spool, s, _log)
    assert s.squeue_calls == [[JOB, OTHER]]  # one batched question
    assert len(spoolmod.entries(spool)) == 3  # slurmctld still holds both
    e = next(e for e in spoolmod.entries(spool) if e.job_id == OTHER)
    assert "slurmctld still holds the job" in e.last_error()
    s.held = {JOB}
    _later(spool, clock)
    record_writer.run_writer(spool, s, _log)
    assert [(e.job_id, e.confirming) for e in spoolmod.entries(spool)] == [
        (JOB, True), (JOB, True)]
    s.held = set()
    _later(spool, clock)
    record_writer.run_writer(spool, s, _log)
    assert spoolmod.entries(spool) == [] and not list(spool.glob("*.err"))
    assert _attempts(s.comment[JOB]) == [0, 1]


def test_a_controller_that_does_not_answer_never_reads_as_forgotten(spool: Path,
                                                                    clock: FakeClock) -> None:
    """squeue's error keeps the entries; after CONFIRM_MAX_S they go anyway (bounded)."""
    s = _requeued_job_written(spool)
    s.ctld_down = True
    s.held = set()
    _later(spool, clock, record_writer.CONFIRM_MIN_S)
    record_writer.run_writer(spool, s, _log)
    assert len(spoolmod.entries(spool)) == 3
    assert "slurmctld did not answer" in spoolmod.entries(spool)[0].last_error()
    _later(spool, clock, spoolmod.CONFIRM_MAX_S)
    record_writer.run_writer(spool, s, _log)
    assert spoolmod.entries(spool) == []


def test_only_confirming_entries_not_due_the_writer_exits_at_once(spool: Path,
                                                                  clock: FakeClock) -> None:
    """A writer never sits on the lock for confirming entries: after writing it ends
    without a pause; a writer started within CONFIRM_EVERY_S asks nothing; one
    started later re-reads them once and ends (the collector's kick every 60 s
    brings the next)."""
    s = Slurm({JOB: 1})
    spoolmod.write_entry(spool, JOB, 0, GOOD)
    t0 = clock.t
    record_writer.run_writer(spool, s, _log)
    assert clock.t == t0 and len(s.sacct_calls) == 2  # the round and its read-back
    s.sacct_calls.clear()
    record_writer.run_writer(spool, s, _log)  # a prolog's kick moments later
    assert clock.t == t0 and s.sacct_calls == []
    _later(spool, clock)
    t1 = clock.t
    record_writer.run_writer(spool, s, _log)
    assert clock.t == t1 and len(s.sacct_calls) == 1 and s.writes[1:] == []
    record_writer.run_writer(spool, s, _log)  # looked at just now: nothing asked
    assert len(s.sacct_calls) == 1


def test_a_newer_pending_attempt_and_a_confirming_older_one_newest_wins(
        spool: Path, clock: FakeClock) -> None:
    """Attempt 0 written and confirming; slurmctld's restart puts its carry back (no
    loss for attempt 0); attempt 1 is spooled: one write holding both, the final
    attempt's details first, nothing older written over it afterwards."""
    s = Slurm({JOB: 2})
    spoolmod.write_entry(spool, JOB, 0, REC_0)
    record_writer.run_writer(spool, s, _log)
    s.restart_replaces(JOB, REC_0)
    spoolmod.write_entry(spool, JOB, 1, _text(A1))  # the carry was lost: attempt 1 alone
    s.writes.clear()
    _later(spool, clock)
    record_writer.run_writer(spool, s, _log)
    assert len(s.writes) == 1 and _attempts(s.writes[0][1]) == [0, 1]
    rec = codec.try_decode(s.comment[JOB])
    assert rec is not None and newest.latest(rec) == 1
    _later(spool, clock)
    s.writes.clear()
    record_writer.run_writer(spool, s, _log)
    assert s.writes == []  # both confirming entries are covered: nothing rewritten


def test_kick_keeps_the_writer_coming_back_while_entries_confirm(spool: Path,
                                                                  clock: FakeClock) -> None:
    """The collector's kick (every 60 s) starts a writer for a confirming entry due a
    look; a burst of prologs' kicks right after a look starts none."""
    started: list[Any] = []

    def spawner(module: str, args: Any, env: Any, *, pass_fd: int) -> None:
        started.append(module)

    assert not spoolmod.kick(spool, {}, spawner=spawner)  # empty spool: nothing
    path = spoolmod.write_entry(spool, JOB, 0, GOOD)
    kept = spoolmod.mark_written(spoolmod.entries(spool)[0])
    assert kept is not None and kept.confirming and not path.exists()
    assert kept.path.name == f"{JOB}.0.adminc.confirming"
    assert not spoolmod.kick(spool, {}, spawner=spawner)  # written moments ago
    _later(spool, clock)
    assert spoolmod.kick(spool, {}, spawner=spawner)
    assert started == [record_writer.MODULE]
    assert record_writer.pending(spool) == {}  # written: not pending


def test_admin_listing_shows_confirming_apart(spool: Path) -> None:
    spoolmod.write_entry(spool, JOB, 1, REC_01)
    spoolmod.write_entry(spool, OTHER, 0, GOOD)
    kept = spoolmod.mark_written(next(e for e in spoolmod.entries(spool) if e.job_id == OTHER))
    assert kept is not None
    spoolmod.note_error(kept, "written 5 s ago, still in accounting; kept until slurmctld "
                              "forgets the job (re-read for 300 s)")
    lines = records_cmd.listing(spool)
    assert lines[0].startswith("1 pending record(s)")
    assert "1 written and confirming" in lines[0]
    rows = {ln.split()[0]: ln.split() for ln in lines[2:]}
    assert rows[str(JOB)][3] == "pending" and rows[str(OTHER)][3] == "confirming"
    assert " ".join(rows[str(OTHER)]).endswith("(re-read for 300 s)")


def test_a_replaced_record_has_every_confirming_entry_looked_at_at_once(
        spool: Path, clock: FakeClock) -> None:
    """slurmctld's restart replaces every job it held: the writer that finds one
    replaced record re-reads the other confirming entries too, even those another
    writer looked at moments ago (measured: the second job's record came back 60 s
    after the first's without this)."""
    s = _requeued_job_written(spool)
    _later(spool, clock)
    other = next(e for e in spoolmod.entries(spool) if e.job_id == OTHER)
    spoolmod.note_error(other, "looked at just now by another writer")
    assert not other.due()
    s.restart_replaces(JOB, REC_0)
    s.restart_replaces(OTHER, "")
    s.writes.clear()
    record_writer.run_writer(spool, s, _log)
    assert _attempts(s.comment[JOB]) == [0, 1] and _attempts(s.comment[OTHER]) == [0]
    assert sorted(j for j, _ in s.writes) == [JOB, OTHER]
