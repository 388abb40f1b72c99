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
lower or raise an estimate. Only complete measurements set the history's peaks
(:mod:`.history_runs`: job COMPLETED, the attempt not killed by an OOM, enforcement or
a signal, not requeued, sampled without a gap): a job killed by OOM shows the limit it
hit, not what it needed. An incomplete attempt's peak is a lower bound: it may raise
the next estimate (:meth:`AccountingHistory.floors`), never lower it. So the user's
ended jobs are read, not only the COMPLETED ones.

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
from slurm_colloc.accounting.history_runs import (
    MAX_PEAK_MIB,
    Key,
    Provenance,
    Run,
    UserJob,
    attempt_key,
    classify,
    peaks_of,
    provenance,
    runs_of,
    valid_fingerprint,
)
from slurm_colloc.accounting.record import Attempt, JobRecord
from slurm_colloc.config import RecordField

__all__ = ["MAX_PEAK_MIB", "AccountingHistory", "Key", "attempt_key", "attempt_peak",
           "user_jobs", "user_records", "valid_fingerprint"]

if TYPE_CHECKING:
    from slurm_colloc.slurm.adapter import AccountingRecord, SlurmAdapter

MAX_JOBS = 5000
"""Newest ended jobs of the user read at most."""
DEFAULT_TIMEOUT_S = 10.0
"""How long ``sacct`` may take (the cli_filter gives the whole estimate 30 s)."""
ENDED_STATES = ("CD", "F", "CA", "TO", "OOM", "NF", "PR", "DL")
"""sacct states read: every way a job ends (the incomplete ones give lower bounds)."""
ENDED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY",
                   "NODE_FAIL", "PREEMPTED", "DEADLINE"})
"""The same as the base state sacct prints."""


def _warn_stderr(message: str) -> None:
    sys.stderr.write(f"colloc estimate: warning: {message}\n")


def attempt_peak(a: Attempt) -> int | None:
    """The measured peak of a complete attempt (:func:`.history_runs.classify`), else None."""
    r = classify(a)
    return r.peak_mib if r.use == "measured" else None


def _job_number(job_id: str) -> int:
    return int(job_id) if job_id.isdigit() else -1


def _base_state(r: AccountingRecord) -> str:
    return (r.state.split()[:1] or [""])[0]


def user_jobs(rows: Iterable[AccountingRecord], user: str, max_jobs: int = MAX_JOBS,
              prefer: RecordField = "admin_comment") -> list[UserJob]:
    """``user``'s ended jobs with a readable colloc record, the newest ``max_jobs`` (pure).

    Rows of another user (whatever their record says) and rows without a readable
    colloc record are skipped; a requeued job's rows give one job (its final row's,
    which holds every attempt; ``REQUEUED`` rows are skipped).
    """
    latest: dict[str, AccountingRecord] = {}
    for r in rows:
        if r.fields.get("User") == user and r.job_id.isdigit() and _base_state(r) in ENDED:
            latest[r.job_id] = r
    newest = sorted(latest, key=_job_number, reverse=True)[: max(0, max_jobs)]
    out = []
    for jid in newest:
        r = latest[jid]
        rec = record_in(r.fields, prefer)  # either field (record_field)
        if rec is not None:
            out.append(UserJob(jid, _base_state(r), rec, r.exit.signal or 0))
    return out


def user_records(rows: Iterable[AccountingRecord], user: str,
                 max_jobs: int = MAX_JOBS, prefer: RecordField = "admin_comment",
                 ) -> list[JobRecord]:
    """Decoded records of ``user``'s COMPLETED jobs, the newest ``max_jobs`` (pure)."""
    done = [r for r in rows if _base_state(r) == "COMPLETED"]
    return [j.record for j in user_jobs(done, user, max_jobs, prefer)]


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
        self._runs: list[Run] | None = None
        self._peaks: dict[Key, int] = {}
        self._bounds: dict[Key, int] = {}
        self.jobs_read = 0
        """Jobs whose record was read (after the first lookup)."""

    def _user(self) -> str | None:
        try:
            return pwd.getpwuid(self.uid).pw_name
        except (KeyError, OverflowError):
            return None

    def runs(self) -> list[Run]:
        """Every attempt of the user's ended jobs, classified (asks slurmdbd once)."""
        if self._runs is not None:
            return self._runs
        self._runs = []
        user = self._user()
        if user is None:
            self._warn(f"no history: uid {self.uid} has no user name")
            return self._runs
        try:
            from slurm_colloc.slurm.adapter import SlurmCli

            adapter = self._adapter or SlurmCli(timeout=self.timeout)
            rows = adapter.finished_jobs_of_user(user, self.days, timeout=self.timeout,
                                                 warn=self._warn, states=ENDED_STATES)
            jobs = user_jobs(rows, user, self.max_jobs, self.prefer)
        except Exception as e:  # noqa: BLE001 - history is an optimisation, never fatal
            self._warn(f"no history from Slurm accounting: {' '.join(str(e).split())[:300]}")
            return self._runs
        self.jobs_read = len(jobs)
        self._runs = runs_of(jobs)
        self._peaks = peaks_of(self._runs)
        self._bounds = peaks_of(self._runs, "bound")
        return self._runs

    def _load(self) -> dict[Key, int]:
        self.runs()
        return self._peaks

    def lookup(self, fingerprint: str, batch_size: int, seq_len: int | None, optimizer: str,
               precision: str) -> int | None:
        """Largest measured peak of this user for the key, or None."""
        key = (fingerprint.lower(), batch_size, seq_len or 0, optimizer, precision)
        return self._load().get(key)

    def peaks(self, fingerprint: str, seq_len: int | None, optimizer: str,
              precision: str) -> dict[int, int]:
        """This user's largest measured peak per batch size ({} when none)."""
        return _by_batch(self._load(), fingerprint, seq_len, optimizer, precision)

    def floors(self, fingerprint: str, seq_len: int | None, optimizer: str,
               precision: str) -> dict[int, int]:
        """This user's largest lower bound per batch size, from incomplete attempts
        ({} when none): the estimate may be raised to them, never lowered."""
        self.runs()
        return _by_batch(self._bounds, fingerprint, seq_len, optimizer, precision)

    def provenance(self, fingerprint: str, batch_size: int, seq_len: int | None,
                   optimizer: str, precision: str) -> Provenance:
        """Which of the user's runs the next estimate of this job comes from, and which
        were set aside and why (:func:`.history_runs.provenance`)."""
        return provenance(self.runs(), fingerprint, batch_size, seq_len, optimizer, precision)

    def record(self, fingerprint: str, batch_size: int, seq_len: int | None, optimizer: str,
               precision: str, peak_mib: int, job_id: str | None = None) -> None:
        """Not supported: the epilog writes the peak into the job's accounting record."""
        raise NotImplementedError(
            "AccountingHistory is read-only: the epilog records peaks in AdminComment")


def _by_batch(table: dict[Key, int], fingerprint: str, seq_len: int | None, optimizer: str,
              precision: str) -> dict[int, int]:
    fp = fingerprint.lower()
    return {k[1]: v for k, v in table.items()
            if k[0] == fp and k[2] == (seq_len or 0) and k[3] == optimizer and k[4] == precision}
