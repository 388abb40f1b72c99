"""Which record wins: the one holding the newest attempt, and every attempt known.

Why (issue 28): with slurmctld killed while epilogs ran, a writer for an older
attempt finished last and replaced the final record. A record is therefore never
written over one that already holds its attempts, and what is written is the union
of the attempts known (accounting's record and every spooled one; for one attempt
number the newest source's version), based on the record of the latest attempt: a
requeue whose AdminComment carry failed still ends with every attempt recorded.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from slurm_colloc.accounting.codec import DEFAULT_MAX_BYTES, encode, find_token, try_decode
from slurm_colloc.accounting.record import Attempt, JobRecord


def attempt_numbers(rec: JobRecord | None) -> frozenset[int]:
    """The attempts a record holds."""
    return frozenset(a.attempt for a in rec.attempts) if rec is not None else frozenset()


def latest(rec: JobRecord | None) -> int:
    """The record's latest attempt number (-1: none)."""
    return max(attempt_numbers(rec), default=-1)


def _outcome(a: Attempt) -> tuple[bool | None, str | None]:
    """What an attempt's record says happened (survives truncation): requeued or not,
    and the cause."""
    return (a.requeue.requeued if a.requeue else None, a.oom.cause if a.oom else None)


def covers(have: JobRecord | None, want: JobRecord | None) -> bool:
    """Whether ``have`` already holds every attempt of ``want``, and the same outcome
    for want's latest one: writing ``want`` over it would add nothing. (A spool
    entry is rewritten in place when its attempt's outcome changes, as when a
    requeue retried later did not land.) A record truncated to fit (attempts
    dropped) covers the attempts up to its latest."""
    need = attempt_numbers(want)
    got = attempt_numbers(have)
    if not need or have is None or want is None:
        return False
    last = max(need)
    if last in got:
        mine = next(a for a in want.attempts if a.attempt == last)
        theirs = next(a for a in have.attempts if a.attempt == last)
        if _outcome(mine) != _outcome(theirs):
            return False
    if need <= got:
        return True
    return bool(have.dropped_attempts and latest(have) >= last)


def best(records: Iterable[JobRecord | None]) -> JobRecord | None:
    """The record with the latest attempt, then the most attempts."""
    found = [r for r in records if r is not None and r.attempts]
    return max(found, key=lambda r: (latest(r), len(r.attempts)), default=None)


def union(base: JobRecord, others: Iterable[JobRecord | None]) -> JobRecord:
    """``base`` with the attempts only ``others`` know added (base's own win)."""
    by_no: dict[int, Attempt] = {}
    for rec in others:
        for a in rec.attempts if rec is not None else ():
            by_no.setdefault(a.attempt, a)
    for a in base.attempts:
        by_no[a.attempt] = a
    return replace(base, attempts=tuple(by_no[n] for n in sorted(by_no)))


def merged_text(base_text: str, others: Iterable[JobRecord | None],
                max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """``base_text`` (a field value holding a record) with its token replaced by the
    union with ``others``; unchanged when they add nothing or it holds no record."""
    base = try_decode(base_text)
    m = find_token(base_text)
    if base is None or m is None:
        return base_text
    rec = union(base, others)
    if attempt_numbers(rec) == attempt_numbers(base):
        return base_text
    rest = (base_text[: m.start()] + " " + base_text[m.end():]).strip()
    room = max_bytes - (len(rest.encode("utf-8")) + 1 if rest else 0)
    token = encode(rec, max_bytes=room)
    return f"{rest} {token}" if rest else token
