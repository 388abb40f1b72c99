"""Write finished jobs' accounting records once Slurm lets us: one writer per node,
replaying root's durable spool until accounting holds every attempt.

Why a detached helper: from inside the Epilog the job is still COMPLETING, when
``scontrol update AdminComment`` is refused ("Job has already finished"), and
``sacctmgr modify job`` only sticks once the controller has sent the job's final
record to slurmdbd (slurm-facts.md). The field is config ``record_field``
(AdminComment, or SystemComment at jobstats sites); a jobstats ``JS1:`` summary
found there is never replaced (:func:`write_verified`). So the epilog leaves the
encoded text in root's spool (:mod:`slurm_colloc.accounting.spool`: one fsync'd
``<job>.<attempt>.adminc`` per attempt, requeued ones too, written before Slurm is
asked anything) and makes sure a writer runs. The writer waits until slurmdbd has
each job's end (``sacct``: slurmdbd, not slurmctld, so no load on the controller;
slurmctld is asked only about records written minutes ago, below), writes with
sacctmgr (the encoding survives its lowercasing) and reads it back.

**Written is not yet kept** (issue 28: a slurmctld SIGKILLed and restarted while it
still held an ended job re-sent the job to slurmdbd with its own AdminComment, empty
or the requeue's carry, replacing the record colloc had written and read back: 1 of
3 records lost in CI). A record read back in accounting is therefore not removed:
its entry becomes *confirming* (``<name>.confirming``,
:func:`slurm_colloc.accounting.spool.mark_written`) and every replay re-reads
accounting for it (at most every :data:`CONFIRM_EVERY_S`, in the round's one
``sacct``) and writes it again, merged as below, if it was replaced (one replaced
record found, every confirming entry is re-read at once: the restart replaces every
ended job slurmctld still held). It is removed once slurmctld no longer holds the
job (one batched ``squeue --jobs`` per round, asked only for entries written
:data:`CONFIRM_MIN_S` ago: Slurm's default ``MinJobAge``; a controller that does not
answer is never "forgotten") or after
:data:`slurm_colloc.accounting.spool.CONFIRM_MAX_S`. A writer with nothing but
confirming entries not yet due exits; the collector's kick brings one back.

**Nothing is given up** (issue 28: slurmdbd and MariaDB away for four minutes lost
4 of 6 records to a writer that gave up after ~36 s). A writer that cannot finish
leaves the entries, with the reason in ``<name>.err``, and exits; the next prolog,
epilog or collector round (every :data:`REPLAY_EVERY_S`) starts another
(:func:`slurm_colloc.accounting.spool.kick`).

**Newest attempt wins** (:mod:`slurm_colloc.accounting.newest`): a record already
in accounting that holds a spooled record's attempts makes the file redundant
(removed, nothing written); otherwise what is written is the union of the attempts
known, based on the latest one, so an older attempt's writer finishing last never
replaces the final record, and replaying twice writes nothing twice.

**One writer per node** (issue 23):

* the writer holds an exclusive ``flock`` on :data:`LOCK_NAME` (root 0600 in root's
  spool directory, opened ``O_NOFOLLOW``; no user can open it, so no user can hold
  it); a second writer exits at once;
* the epilog spools first, then takes the lock (non-blocking) and hands it to the
  writer it starts (an inherited descriptor): while one writer runs or starts up no
  epilog starts another (:func:`spawn`); a writer that finds the spool empty releases
  the lock and looks once more (:func:`run_writer`), so a record spooled while it was
  ending is never left without a writer;
* each round asks slurmdbd once for every pending job (at most :data:`BATCH`), and
  the pause between rounds doubles while nothing can be written, from
  :data:`PAUSE_S` to :data:`MAX_PAUSE_S`;
* bounded: a record is written anyway after :data:`WAIT_S`, and one writer tries it
  :data:`TRIES` times before leaving it to the next replay.

**A full disk** (:func:`write_direct`): when the epilog cannot spool, it starts a
writer that holds the record in memory (``--direct``) and logs that loudly.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_colloc.accounting import spool as spoolmod
from slurm_colloc.accounting.codec import DEFAULT_MAX_BYTES, try_decode
from slurm_colloc.accounting.field import placement, read_order
from slurm_colloc.accounting.newest import best, covers, latest, merged_text
from slurm_colloc.accounting.record import JobRecord
from slurm_colloc.accounting.spool import LOCK_NAME, Entry, try_lock
from slurm_colloc.config import RecordField
from slurm_colloc.detach import PASSED_FD, spawn_module
from slurm_colloc.node.logging_setup import node_logger
from slurm_colloc.slurm.adapter import TERMINAL_STATES, SlurmAdapter, SlurmError, by_start

__all__ = ["LOCK_NAME", "try_lock"]

MODULE = spoolmod.WRITER_MODULE
TRIES = 8
"""Failed writes (or unverified read-backs) of one record per writer run; the entry
then waits for the next replay (never given up)."""
WAIT_S = 120.0
"""How long a record waits for slurmdbd to show its job's end before it is written
anyway."""
PAUSE_S = 1.0
"""The first pause between rounds, and after any progress."""
MAX_PAUSE_S = 30.0
"""The longest pause between rounds."""
REPLAY_EVERY_S = spoolmod.REPLAY_EVERY_S
DIRECT_WAIT_S = 3600.0
"""How long an in-memory (``--direct``) record is tried: the node's disk was full."""
CONFIRM_MIN_S = 300.0
"""A written record is only re-read for this long (Slurm's default ``MinJobAge``)
before slurmctld is asked whether it still holds the job."""
CONFIRM_EVERY_S = spoolmod.CONFIRM_EVERY_S
"""How often a confirming entry is re-read (by one writer run, or across runs)."""
RUN_S = WAIT_S + TRIES * MAX_PAUSE_S
"""One writer run's bound: what it could not settle by then waits for the next replay."""
BATCH = 100
"""Pending records looked at per round (the oldest first): one sacct call for them."""
MAX_RECORD_BYTES = spoolmod.MAX_RECORD_BYTES
LOCK_TRIES = 5
"""A starting writer retries the lock this often (0.1 s apart): an epilog's probe
holds it for an instant."""
DIRECT_ENV = "COLLOC_RECORD_TEXT"
"""Where a ``--direct`` writer finds its record (root's environment, never argv)."""

LogFor = Callable[[int], "logging.LoggerAdapter[Any]"]


def spool_path(spool_dir: str, job_id: int, attempt: int | None = None) -> Path:
    """Where the epilog leaves the text for job ``job_id``'s ``attempt``."""
    return spoolmod.entry_path(Path(spool_dir), job_id, attempt)


def spawn(job_id: int, spool_file: Path, env: dict[str, str]) -> bool:
    """Start the node's writer detached unless one runs; True when one was started.

    Call it after the record is in the spool. The lock is taken here and handed to
    the writer (it inherits the descriptor), so no other epilog starts a second one
    while the first is still starting up (measured: 50 short jobs started 7 writers
    when each writer took the lock itself). A writer that is ending releases the lock,
    then looks at the spool once more. Raises OSError when the lock file is not root's.
    """
    fd = try_lock(spool_file.parent)
    if fd is None:
        return False  # a writer holds it: it drains this record too
    try:
        spawn_module(MODULE, (str(job_id), str(spool_file), str(PASSED_FD)), env, pass_fd=fd)
    finally:
        os.close(fd)  # the writer's copy keeps the lock
    return True


def spawn_direct(job_id: int, text: str, env: dict[str, str]) -> None:
    """Start a writer for one record held in memory (the spool could not take it)."""
    spawn_module(MODULE, (str(job_id), "-", "--direct"), {**env, DIRECT_ENV: text})


def _adopt_lock(fd: int, spool_dir: Path) -> int | None:
    """The lock the epilog handed over as ``fd``, verified to be this spool's lock
    and held; None (and ``fd`` closed) otherwise."""
    import fcntl

    try:
        st, want = os.fstat(fd), os.stat(spool_dir / LOCK_NAME, follow_symlinks=False)
        if (st.st_dev, st.st_ino) != (want.st_dev, want.st_ino):
            raise OSError("not the spool's lock")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ours already: a no-op
    except OSError:
        with contextlib.suppress(OSError):
            os.close(fd)
        return None
    return fd


# --------------------------------------------------------------- the spool ---


def pending(spool_dir: Path) -> dict[tuple[int, int | None], Path]:
    """Spooled records not yet written, the oldest :data:`BATCH` (by mtime), by (job,
    attempt)."""
    return {(e.job_id, e.attempt): e.path
            for e in [e for e in spoolmod.entries(spool_dir) if not e.confirming][:BATCH]}


def _read_record(path: Path) -> str:
    """A spool file's text: a regular file, never through a link, bounded."""
    return spoolmod.read_text(path, MAX_RECORD_BYTES)


def _set_aside(path: Path) -> None:
    """An unreadable spool entry (a link, not a file) is renamed out of the way."""
    with contextlib.suppress(OSError):
        os.rename(path, path.with_name(path.name + ".unreadable"))


# --------------------------------------------------------------- slurmdbd ---


def _finished(adapter: SlurmAdapter, jobs: list[int],
              rows_out: dict[str, list[Any]] | None = None) -> set[int]:
    """The jobs whose end slurmdbd has recorded (one sacct call; none on error).

    The end time too, not only a final state: slurmdbd that was down gets the job-end
    record queued by slurmctld after the state already reads final, and that late
    record rewrote an AdminComment written in between (seen killing slurmdbd mid-run).
    ``rows_out`` (when given) receives the rows by job id, for :func:`write_verified`.
    """
    try:
        rows = adapter.accounting(jobs)
    except SlurmError:
        return set()
    by_job: dict[str, list[Any]] = {} if rows_out is None else rows_out
    for r in rows:
        by_job.setdefault(r.job_id, []).append(r)
    return _finished_in(by_job, jobs)


def write_verified(adapter: SlurmAdapter, job_id: int, text: str,
                   field: RecordField = "admin_comment",
                   current: Iterable[Mapping[str, str]] = ()) -> str | None:
    """Set the record's field once and read it back: None when verified, else why not.

    ``field`` is config ``record_field``; ``current`` the job's accounting fields as
    this round's sacct saw them. A jobstats summary (``JS1:``) already in that field is
    never replaced: the record goes to the other field instead
    (:func:`slurm_colloc.accounting.field.placement`)."""
    where = placement(current, field, text)
    if where is None:
        return "both comment fields hold a jobstats summary: nowhere to write"
    name, text = where
    try:
        if name == "AdminComment":
            adapter.set_admin_comment_finished(job_id, text)
        else:
            adapter.set_field_finished(job_id, name, text)
        recs = adapter.accounting([job_id])
    except SlurmError as e:  # sacctmgr or the read-back: both worth another try
        return str(e)
    want = text.lower()
    if any(r.fields.get(name, "").lower() == want for r in recs):
        return None
    return "read back a different value"


def _have(rows: list[Any], field: RecordField) -> tuple[JobRecord | None, str]:
    """Accounting's best record of a job (latest attempt, most attempts) and its text."""
    found: list[tuple[JobRecord, str]] = []
    for r in rows:
        for name in read_order(field):
            text = str(r.fields.get(name, "") or "")
            rec = try_decode(text)
            if rec is not None:
                found.append((rec, text))
    top = best(rec for rec, _ in found)
    return top, next((t for rec, t in found if rec is top), "")


def _moved_on(rows: list[Any], group: list[Entry]) -> bool:
    """Accounting knows a later attempt than any spooled here (the job was requeued):
    that attempt's record will carry these, so nothing is written over it before
    the job ends. Rows are attempts (``sacct --duplicates``), oldest first."""
    known = [e.attempt for e in group if e.attempt is not None]
    return bool(known) and len(rows) > max(known) + 1


@dataclass
class _Entry:
    first_seen: float
    tries: int = 0
    next_try: float = 0.0
    looked: int = 0
    """The last round that looked at it (0: none yet in this run)."""
    checked: float = 0.0
    """When (monotonic) a round last looked at it."""


def _due(e: Entry, state: dict[Path, _Entry], now: float, eager: bool = False) -> bool:
    """Worth a look this round: a pending entry with tries left in this run, a
    confirming one not re-read in the last :data:`CONFIRM_EVERY_S` (by this run, or
    by any: :meth:`slurm_colloc.accounting.spool.Entry.due`; ``eager``: this run
    found a replaced record, so every confirming entry it has not looked at yet)."""
    st = state.get(e.path)
    if st is None:
        return eager or e.due()
    if e.confirming:
        return now - st.checked >= CONFIRM_EVERY_S
    return st.tries < TRIES


def _batch(listed: list[Entry], state: dict[Path, _Entry]) -> list[Entry]:
    """This round's entries: those looked at least recently first, oldest first among
    equals, at most :data:`BATCH`.

    Why: entries that can only wait (a job its owner requeued and holds: a later
    attempt exists and no end comes) would otherwise be the oldest for ever, and a
    user holding :data:`BATCH` jobs would keep every newer record on the node out of
    accounting (review of issue 28). Rotating through them bounds any record's wait
    for a look to ``len(listed) / BATCH`` rounds.
    """
    return sorted(listed, key=lambda e: state[e.path].looked if e.path in state else 0
                  )[:BATCH]


@dataclass
class _Round:
    """What one round knows: accounting's rows by job, the finished jobs, why sacct
    failed ("" when it answered), and the jobs slurmctld still holds among those
    asked about (None: not asked, or it did not answer)."""

    rows: dict[str, list[Any]]
    finished: set[int]
    error: str = ""
    held: set[int] | None = None
    asked: frozenset[int] = frozenset()
    replaced: bool = False
    """A confirming entry's record was no longer in accounting (slurmctld restarted:
    the other jobs it held are likely replaced too)."""


def _texts(group: list[Entry], log: logging.LoggerAdapter[Any]) -> dict[Path, str]:
    out: dict[Path, str] = {}
    for e in group:
        try:
            out[e.path] = _read_record(e.path)
        except FileNotFoundError:
            continue  # another replayer confirmed it meanwhile
        except OSError as err:
            log.error("spooled record unreadable, set aside: %s", err)
            _set_aside(e.path)
    return out


def _to_write(group: list[Entry], texts: dict[Path, str], have: JobRecord | None,
              have_text: str, max_bytes: int) -> tuple[str, list[Entry]]:
    """The text to write for a job (newest attempt first, every known attempt in it)
    and the entries it settles."""
    recs = {e.path: try_decode(texts[e.path]) for e in group}
    order = sorted(group, key=lambda e: (latest(recs[e.path]),
                                         -1 if e.attempt is None else e.attempt, e.mtime))
    base = order[-1]
    others = [recs[e.path] for e in order[:-1]]
    if have is not None and latest(have) > latest(recs[base.path]):
        text = merged_text(have_text, [recs[e.path] for e in order], max_bytes)
    else:
        text = merged_text(texts[base.path], [have, *others], max_bytes)
    done = try_decode(text)
    settles = [e for e in group if e is base or covers(done, recs[e.path])]
    return text, settles


def _holds(rows: list[Any], have: JobRecord | None, text: str, field: RecordField,
           written: bool) -> bool:
    """Accounting holds ``text``'s attempts; for a record written by us that does not
    decode (no colloc token), accounting's field reads back as that text."""
    want = try_decode(text)
    if want is not None or not written:
        return covers(have, want)
    return any(str(r.fields.get(name, "") or "").lower() == text.lower()
               for r in rows for name in read_order(field))


def _keep(e: Entry, state: dict[Path, _Entry], seen: set[Path] | None) -> None:
    """``e`` is in accounting: keep it confirming, not due again in this run's next
    round (the next replay re-reads it)."""
    kept = spoolmod.mark_written(e)
    if kept is not None:
        state[kept.path] = _Entry(time.monotonic(), checked=time.monotonic())
        if seen is not None:
            seen.add(kept.path)


def _confirm(e: Entry, job: int, rnd: _Round, log: logging.LoggerAdapter[Any]) -> None:
    """A confirming entry accounting still holds: removed once slurmctld has forgotten
    the job (or after :data:`CONFIRM_MAX_S`), else noted."""
    age = e.age()
    if job in rnd.asked and rnd.held is not None and job not in rnd.held:
        spoolmod.remove(e)
        log.info("attempt %s confirmed: slurmctld no longer holds the job, spool entry "
                 "removed", e.attempt)
    elif age >= spoolmod.CONFIRM_MAX_S:
        spoolmod.remove(e)
        log.warning("attempt %s kept %.0f s after it was written (slurmctld still holds the "
                    "job or did not answer): spool entry removed", e.attempt, age)
    else:
        why = ("slurmctld did not answer" if job in rnd.asked and rnd.held is None
               else "slurmctld still holds the job" if job in rnd.asked
               else f"re-read for {CONFIRM_MIN_S:.0f} s")
        spoolmod.note_error(e, f"written {age:.0f} s ago, still in accounting; kept until "
                               f"slurmctld forgets the job ({why})")


def _replay_job(adapter: SlurmAdapter, job: int, group: list[Entry], rnd: _Round,
                state: dict[Path, _Entry], log: logging.LoggerAdapter[Any], *,
                wait: float, pause: float, field: RecordField, max_bytes: int,
                seen: set[Path] | None = None) -> int:
    """Settle one job's spooled records as far as accounting allows; the number of
    entries written or found in accounting (kept confirming)."""
    texts = _texts(group, log)
    rows = rnd.rows.get(str(job), [])
    have, have_text = _have(rows, field)
    left = []
    done = 0
    for e in group:
        if e.path not in texts:
            continue
        if rnd.error and e.confirming:
            spoolmod.note_error(e, f"written; not re-read: {rnd.error}")
        elif not _holds(rows, have, texts[e.path], field, e.confirming):
            if e.confirming:
                rnd.replaced = True
                log.warning("attempt %s: the record written %.0f s ago is no longer in "
                            "accounting (slurmctld re-sent the job with its own copy?): "
                            "to be written again", e.attempt, e.age())
            left.append(e)
        elif e.confirming:
            _confirm(e, job, rnd, log)
        else:
            _keep(e, state, seen)
            done += 1
            log.info("attempt %s already in accounting: kept until slurmctld forgets "
                     "the job", e.attempt)
    if not left:
        return done
    now = time.monotonic()
    first = min(state[e.path].first_seen for e in left)
    ready = job in rnd.finished or (now - first >= wait and not _moved_on(rows, left))
    if not ready or now < max(state[e.path].next_try for e in left):
        for e in left:
            spoolmod.note_error(e, rnd.error or "waiting for the job's end in accounting")
        return done
    text, settles = _to_write(left, texts, have, have_text, max_bytes)
    failed = write_verified(adapter, job, text, field, [r.fields for r in rows])
    if failed is None:
        for e in settles:
            _keep(e, state, seen)
        log.info("written (%d bytes, attempts %s)", len(text),
                 ",".join("?" if e.attempt is None else str(e.attempt) for e in settles))
        return done + len(settles)
    for e in left:
        st = state[e.path]
        st.tries += 1
        st.next_try = time.monotonic() + pause * st.tries
        spoolmod.note_error(e, f"try {st.tries}: {failed}")
        if st.tries == TRIES:
            log.error("record not written after %d tries, left in %s for the next replay: %s",
                      TRIES, e.path, failed)
    return done


def drain(adapter: SlurmAdapter, spool_dir: Path, log_for: LogFor, *, wait: float = WAIT_S,
          pause: float = PAUSE_S, field: RecordField = "admin_comment",
          max_bytes: int = DEFAULT_MAX_BYTES, seen: set[Path] | None = None,
          max_rounds: int | None = None) -> int:
    """Replay spooled records until the spool is empty or every entry left has had
    :data:`TRIES` tries in this run, at most :data:`RUN_S`; the number of entries
    confirmed.

    The caller holds the writer's lock. ``field``: config ``record_field``;
    ``seen`` (when given) receives every entry looked at; ``max_rounds``: stop after
    that many (``colloc admin records --replay`` makes one). An entry's wait for its
    job's end counts from when it was spooled, not from when this writer started."""
    state: dict[Path, _Entry] = {}
    written, delay = 0, pause
    eager = False
    started, rounds = time.monotonic(), 0
    while True:
        now = time.monotonic()
        found = _batch([e for e in spoolmod.entries(spool_dir)
                        if _due(e, state, now, eager)], state)
        if not found or now - started > RUN_S:
            return written
        fresh = any(e.path not in state for e in found)
        rounds += 1
        for e in found:
            st = state.setdefault(e.path, _Entry(now - e.age()))
            st.looked, st.checked = rounds, now
            if seen is not None:
                seen.add(e.path)
        groups: dict[int, list[Entry]] = {}
        for e in found:
            groups.setdefault(e.job_id, []).append(e)
        rnd = _ask_round(adapter, list(groups))
        if not rnd.error:
            _ask_held(adapter, rnd, sorted({e.job_id for e in found if e.confirming
                                            and e.age() >= CONFIRM_MIN_S}))
        before = written
        for job, group in groups.items():
            written += _replay_job(adapter, job, group, rnd, state, log_for(job), wait=wait,
                                   pause=pause, field=field, max_bytes=max_bytes, seen=seen)
        eager = eager or rnd.replaced
        now = time.monotonic()
        if rounds == max_rounds or not any(_due(e, state, now, eager)
                                           for e in spoolmod.entries(spool_dir)):
            return written
        delay = pause if written > before or fresh else min(MAX_PAUSE_S, delay * 2)
        time.sleep(delay)


def _ask_round(adapter: SlurmAdapter, jobs: list[int]) -> _Round:
    """One sacct for the round's jobs: their rows, the finished ones, or the error."""
    rows: dict[str, list[Any]] = {}
    try:
        recs = adapter.accounting(jobs)
    except SlurmError as e:
        return _Round({}, set(), f"accounting unreachable: {e}")
    for r in recs:
        rows.setdefault(r.job_id, []).append(r)
    return _Round(rows, _finished_in(rows, jobs))


def _ask_held(adapter: SlurmAdapter, rnd: _Round, jobs: list[int]) -> None:
    """Which of ``jobs`` slurmctld still holds (one ``squeue --jobs``), into ``rnd``;
    an error leaves ``held`` None: never "forgotten" for "did not answer"."""
    if not jobs:
        return
    rnd.asked = frozenset(jobs)
    try:
        rnd.held = set(adapter.jobs_among(jobs))
    except SlurmError:
        rnd.held = None


def _finished_in(rows: Mapping[str, list[Any]], jobs: Iterable[int]) -> set[int]:
    done = set()
    for job in jobs:
        recs = by_start(rows.get(str(job), []))
        if not recs:
            continue
        state = (recs[-1].state.split() or [""])[0]
        if state in TERMINAL_STATES and recs[-1].fields.get("End", "Unknown") != "Unknown":
            done.add(job)
    return done


def run_writer(spool_dir: Path, adapter: SlurmAdapter, log_for: LogFor,
               held: int | None = None, field: RecordField = "admin_comment",
               max_bytes: int = DEFAULT_MAX_BYTES) -> int:
    """Be the node's one writer: lock, drain, release, look again; the number written.

    ``held``: the lock the epilog took and handed over (the first round uses it).
    Returns at once (0) when another writer holds the lock; returns leaving entries
    it could not write in this run (the next replay tries them again)."""
    written = 0
    fd = held
    tries = LOCK_TRIES
    seen: set[Path] = set()
    while True:
        for attempt in range(tries):
            if fd is not None:
                break
            fd = try_lock(spool_dir)
            if fd is None and attempt < tries - 1:
                time.sleep(0.1)
        if fd is None:
            return written  # another writer drains the spool
        tries = 1  # after a round: a lock held now is a newer writer's, which drains
        try:
            written += drain(adapter, spool_dir, log_for, field=field, max_bytes=max_bytes,
                             seen=seen)
        finally:
            os.close(fd)
            fd = None
        if all(e.path in seen or not e.due() for e in spoolmod.entries(spool_dir, BATCH)):
            return written


def write_direct(adapter: SlurmAdapter, job_id: int, text: str, log: logging.LoggerAdapter[Any],
                 *, field: RecordField = "admin_comment", limit_s: float = DIRECT_WAIT_S,
                 pause: float = PAUSE_S) -> bool:
    """Write one record held in memory (the spool was full): wait for the job's end,
    never over a record that holds its attempts; True once confirmed."""
    want = try_decode(text)
    deadline = time.monotonic() + limit_s
    delay, why = pause, ""
    while time.monotonic() < deadline:
        rnd = _ask_round(adapter, [job_id])
        rows = rnd.rows.get(str(job_id), [])
        have, _ = _have(rows, field)
        if want is not None and covers(have, want):
            log.info("record already in accounting (written directly, no spool)")
            return True
        if job_id in rnd.finished:
            why = write_verified(adapter, job_id, text, field, [r.fields for r in rows]) or ""
            if not why:
                log.warning("record written directly (the spool could not take it)")
                return True
        else:
            why = rnd.error or "waiting for the job's end in accounting"
        time.sleep(delay)
        delay = min(MAX_PAUSE_S, delay * 2)
    log.error("RECORD LOST: job %d's record (not spooled: disk full) not written in %.0f s: %s",
              job_id, limit_s, why)
    return False


def main() -> int:
    """Entry: ``python -m slurm_colloc.node.record_writer JOBID SPOOLFILE [LOCKFD]``
    (root). Drains SPOOLFILE's directory; JOBID is the job whose epilog started it;
    LOCKFD the writer's lock that epilog took and handed over. ``JOBID - --direct``:
    write the record in ``$COLLOC_RECORD_TEXT`` (the spool could not take it)."""
    from slurm_colloc import config as cfgmod
    from slurm_colloc.node.prolog import main_env
    from slurm_colloc.slurm.adapter import SlurmCli

    job_id, spool = int(sys.argv[1]), Path(sys.argv[2])
    direct = len(sys.argv) > 3 and sys.argv[3] == "--direct"
    handed = int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3].isdigit() else None
    log_file = None
    field: RecordField = "admin_comment"
    max_bytes = DEFAULT_MAX_BYTES
    with contextlib.suppress(cfgmod.ConfigError):
        cfg = cfgmod.load()
        log_file, field, max_bytes = cfg.log_file, cfg.record_field, cfg.admin_comment_max_bytes

    def log_for(job: int) -> logging.LoggerAdapter[Any]:
        return node_logger("record-writer", job, log_file)

    try:
        adapter = SlurmCli(env=main_env(os.environ), timeout=30)
        if direct:
            write_direct(adapter, job_id, os.environ.get(DIRECT_ENV, ""), log_for(job_id),
                         field=field)
            return 0
        held = _adopt_lock(handed, spool.parent) if handed is not None else None
        run_writer(spool.parent, adapter, log_for, held, field, max_bytes)
    except Exception as e:  # noqa: BLE001 - detached: nothing above us to report to
        log_for(job_id).error("records not written, left in %s: %s", spool.parent, e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
