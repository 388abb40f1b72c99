"""The estimator's history from Slurm's accounting: no node-local file, no new service.

The epilog (root, on the compute node) writes each attempt's record into the job's
AdminComment (:mod:`slurm_colloc.accounting.codec`); slurmdbd keeps it. The record's
estimate carries the history key (model fingerprint, batch size, sequence length,
optimizer, precision) and its metrics the measured peak, so ``colloc estimate`` on any
login host can rebuild the user's history with one ``sacct`` call:
:class:`AccountingHistory` is an :class:`slurm_colloc.estimators.history.HistoryStore` over the
calling user's completed jobs of the last ``history_days`` days.

Trust (``slurm_colloc/estimators/history.py``, "trust policy"): AdminComment is admin-only in
Slurm, so users cannot forge a record, but the key inside comes from the job's own
``--colloc-*`` options. History is therefore per user: a job counts only when Slurm
reports it as the caller's (the caller's uid, as a user name, compared with sacct's
``user``); another user's job with the same fingerprint is ignored, never used to
lower or raise an estimate. Only attempts that succeeded count (job COMPLETED, the
attempt not killed by an OOM nor requeued, a measured peak from real samples): a job
killed by OOM shows the limit it hit, not what it needed.

Bounded and never fatal: one ``sacct`` call with a timeout, at most
:data:`MAX_JOBS` jobs (the newest) are read; slurmdbd down, slow or unreadable gives
an empty history and one warning on stderr, and ``colloc estimate`` goes on without
history. Nothing is cached on disk.
"""

from __future__ import annotations

import os
import pwd
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from slurm_colloc.accounting.field import record_in
from slurm_colloc.accounting.record import Attempt, JobRecord
from slurm_colloc.config import RecordField

if TYPE_CHECKING:
    from slurm_colloc.slurm.adapter import AccountingRecord, SlurmAdapter

MAX_JOBS = 5000
"""Newest completed jobs of the user read at most."""
DEFAULT_TIMEOUT_S = 10.0
"""How long ``sacct`` may take (the cli_filter gives the whole estimate 30 s)."""
MAX_PEAK_MIB = 1 << 24
"""A larger "peak" (16 TiB) is not a measurement."""

Key = tuple[str, int, int, str, str]
"""(fingerprint, batch size, seq len or 0, optimizer, precision), as SqliteHistory."""


def _warn_stderr(message: str) -> None:
    sys.stderr.write(f"colloc estimate: warning: {message}\n")


def valid_fingerprint(v: str | None) -> str | None:
    """``v`` lowercased when it is 1-64 hex digits, else None (a user-given key)."""
    if not v:
        return None
    fp = v.lower()
    if len(fp) > 64 or any(c not in "0123456789abcdef" for c in fp):
        return None
    return fp


def attempt_key(a: Attempt) -> Key | None:
    """The history key of an attempt's estimate, or None when it has none."""
    e = a.estimate
    if e is None:
        return None
    fp = valid_fingerprint(e.fingerprint)
    b = e.batch_size
    if fp is None or isinstance(b, bool) or not isinstance(b, int) or not 0 < b < 1 << 31:
        return None
    seq = e.seq_len if isinstance(e.seq_len, int) and 0 < e.seq_len < 1 << 31 else 0
    return (fp, b, seq, e.optimizer or "adam", e.precision or "fp32")


def attempt_peak(a: Attempt) -> int | None:
    """The measured peak of an attempt that succeeded, else None."""
    if a.oom is not None and a.oom.cause != "none":
        return None
    if a.requeue is not None and a.requeue.requeued:
        return None
    m = a.metrics
    if m is None or m.samples <= 0 or m.peak_mib is None:
        return None
    if isinstance(m.peak_mib, bool) or not 0 < m.peak_mib <= MAX_PEAK_MIB:
        return None
    return m.peak_mib


def peaks_of(records: Iterable[JobRecord]) -> dict[Key, int]:
    """Largest succeeded peak per key over the records (pure)."""
    out: dict[Key, int] = {}
    for rec in records:
        for a in rec.attempts:
            key, peak = attempt_key(a), attempt_peak(a)
            if key is not None and peak is not None and peak > out.get(key, 0):
                out[key] = peak
    return out


def _job_number(job_id: str) -> int:
    return int(job_id) if job_id.isdigit() else -1


def user_records(rows: Iterable[AccountingRecord], user: str,
                 max_jobs: int = MAX_JOBS, prefer: RecordField = "admin_comment",
                 ) -> list[JobRecord]:
    """Decoded records of ``user``'s COMPLETED jobs, the newest ``max_jobs`` (pure).

    Rows of another user (whatever their record says) and rows without a readable
    colloc record are skipped; a requeued job's rows give one record (its COMPLETED
    row's, which holds every attempt).
    """
    latest: dict[str, AccountingRecord] = {}
    for r in rows:
        if r.fields.get("User") != user or r.state.split()[:1] != ["COMPLETED"]:
            continue
        if not r.job_id.isdigit():
            continue
        latest[r.job_id] = r
    newest = sorted(latest, key=_job_number, reverse=True)[: max(0, max_jobs)]
    out = []
    for jid in newest:
        rec = record_in(latest[jid].fields, prefer)  # either field (record_field)
        if rec is not None:
            out.append(rec)
    return out


class AccountingHistory:
    """A :class:`~slurm_colloc.estimators.history.HistoryStore` over one user's completed jobs in
    Slurm's accounting (see the module docstring). Asks slurmdbd once, on the first
    lookup; :meth:`record` is not supported (the epilog writes the accounting)."""

    def __init__(
        self,
        adapter: SlurmAdapter | None = None,
        *,
        uid: int | None = None,
        days: int = 90,
        max_jobs: int = MAX_JOBS,
        timeout: float = DEFAULT_TIMEOUT_S,
        warn: Callable[[str], None] | None = None,
        prefer: RecordField = "admin_comment",
    ) -> None:
        self.uid = os.getuid() if uid is None else int(uid)
        self.prefer: RecordField = prefer
        """Config ``record_field``: where records are looked for first."""
        self.days = max(1, int(days))
        self.max_jobs = max_jobs
        self.timeout = timeout
        self._adapter = adapter
        self._warn = warn or _warn_stderr
        self._peaks: dict[Key, int] | None = None
        self.jobs_read = 0
        """Jobs whose record was read (after the first lookup)."""

    def _user(self) -> str | None:
        try:
            return pwd.getpwuid(self.uid).pw_name
        except (KeyError, OverflowError):
            return None

    def _load(self) -> dict[Key, int]:
        if self._peaks is not None:
            return self._peaks
        self._peaks = {}
        user = self._user()
        if user is None:
            self._warn(f"no history: uid {self.uid} has no user name")
            return self._peaks
        try:
            from slurm_colloc.slurm.adapter import SlurmCli

            adapter = self._adapter or SlurmCli(timeout=self.timeout)
            rows = adapter.finished_jobs_of_user(user, self.days, timeout=self.timeout,
                                                 warn=self._warn)
            records = user_records(rows, user, self.max_jobs, self.prefer)
        except Exception as e:  # noqa: BLE001 - history is an optimisation, never fatal
            self._warn(f"no history from Slurm accounting: {' '.join(str(e).split())[:300]}")
            return self._peaks
        self.jobs_read = len(records)
        self._peaks = peaks_of(records)
        return self._peaks

    def lookup(self, fingerprint: str, batch_size: int, seq_len: int | None, optimizer: str,
               precision: str) -> int | None:
        """Largest measured peak of this user for the key, or None."""
        key = (fingerprint.lower(), batch_size, seq_len or 0, optimizer, precision)
        return self._load().get(key)

    def peaks(self, fingerprint: str, seq_len: int | None, optimizer: str,
              precision: str) -> dict[int, int]:
        """This user's largest measured peak per batch size ({} when none)."""
        fp = fingerprint.lower()
        return {k[1]: v for k, v in self._load().items()
                if k[0] == fp and k[2] == (seq_len or 0) and k[3] == optimizer
                and k[4] == precision}

    def record(self, fingerprint: str, batch_size: int, seq_len: int | None, optimizer: str,
               precision: str, peak_mib: int, job_id: str | None = None) -> None:
        """Not supported: the epilog writes the peak into the job's accounting record."""
        raise NotImplementedError(
            "AccountingHistory is read-only: the epilog records peaks in AdminComment")
