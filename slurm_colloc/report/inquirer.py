"""Where the report's facts come from: an abstract "inquirer" (as in reportseff).

:class:`Inquirer` answers the report's questions (a job's accounting lines, the jobs
of a period, the controller's live view of a running job, the node-local series);
:class:`SlurmInquirer` asks Slurm through a :class:`~slurm_colloc.slurm.adapter.SlurmAdapter`
and reads the metrics store when it is on this host. Tests use a fake.

:func:`check_evidence` says whether an attempt's OOM evidence file can be read from
this host (the report runs on login hosts, where the node's evidence directory is
absent): ``lstat`` + ``access``, never through a symlink or into a FIFO or device, and
at most :data:`EVIDENCE_TAIL_BYTES` read when a few lines are shown.
"""

from __future__ import annotations

import abc
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from slurm_colloc.accounting.field import record_texts
from slurm_colloc.config import RecordField
from slurm_colloc.metrics import liveness, store
from slurm_colloc.slurm.adapter import (
    AccountingRecord,
    SlurmAdapter,
    SlurmError,
    by_start,
    scontrol_view,
)

EVIDENCE_TAIL_BYTES = 4096
"""Most bytes of an evidence file the report reads (its end: where the error is)."""
EVIDENCE_LINES = 4
"""Most lines of an evidence file the report shows."""
EVIDENCE_LINE_CHARS = 240

_ELAPSED = re.compile(r"^(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)(?:\.\d+)?$")
_JOB_ID = re.compile(r"^\d{1,12}(?:_\d{1,9})?$")
"""A job id as users type it: ``123`` or an array task ``123_4``."""


def parse_elapsed(text: str) -> int | None:
    """Slurm's ``[D-][HH:]MM:SS`` as seconds."""
    m = _ELAPSED.match(text.strip())
    if not m:
        return None
    d, h, mi, s = (int(g) if g else 0 for g in m.groups())
    return ((d * 24 + h) * 60 + mi) * 60 + s


def parse_time(text: str) -> int | None:
    """Slurm's ``YYYY-MM-DDTHH:MM:SS`` (local time) as Unix seconds; None for Unknown."""
    try:
        return int(datetime.fromisoformat(text.strip()).timestamp())
    except ValueError:
        return None


@dataclass(frozen=True)
class JobRow:
    """One allocation line of sacct (a requeued job has one per attempt)."""

    job_id: str
    name: str = ""
    user: str = ""
    state: str = ""
    exit_code: str = ""
    submit: int | None = None
    start: int | None = None
    end: int | None = None
    elapsed_s: int | None = None
    node: str = ""
    alloc_tres: str = ""
    req_tres: str = ""
    admin_comment: str = ""
    display_id: str = ""
    """sacct's JobID: ``123_4`` for an array task, else the raw id ('' = same)."""
    account: str = ""
    system_comment: str = ""
    """Where colloc's ``cl1:`` record is at jobstats sites (config ``record_field``)."""
    partition: str = ""

    def record_texts(self, prefer: RecordField = "admin_comment") -> list[str]:
        """The texts that may hold colloc's record, the configured field first."""
        return record_texts({"AdminComment": self.admin_comment,
                             "SystemComment": self.system_comment}, prefer)

    @property
    def shown_id(self) -> str:
        """The id users know the job by (the array form for array tasks)."""
        return self.display_id or self.job_id

    @classmethod
    def from_fields(cls, f: Mapping[str, str]) -> JobRow:
        """Build from sacct fields by name."""
        return cls(
            job_id=f.get("JobIDRaw", ""), name=f.get("JobName", ""), user=f.get("User", ""),
            state=(f.get("State", "") or "").split(" ")[0], exit_code=f.get("ExitCode", ""),
            submit=parse_time(f.get("Submit", "")), start=parse_time(f.get("Start", "")),
            end=parse_time(f.get("End", "")), elapsed_s=parse_elapsed(f.get("Elapsed", "")),
            node=f.get("NodeList", ""), alloc_tres=f.get("AllocTRES", ""),
            req_tres=f.get("ReqTRES", ""), admin_comment=f.get("AdminComment", ""),
            display_id=f.get("JobID", ""), account=f.get("Account", ""),
            system_comment=f.get("SystemComment", ""), partition=f.get("Partition", ""),
        )


@dataclass(frozen=True)
class EvidenceCheck:
    """Whether an evidence file can be read from this host, and its last lines."""

    readable: bool
    status: str
    """``readable``, ``absent`` (not on this host), ``denied`` (here, but not for this
    user), ``not-a-file`` (symlink, FIFO, device, directory: never opened) or
    ``invalid`` (not an absolute path)."""
    tail: tuple[str, ...] = ()
    """Up to :data:`EVIDENCE_LINES` last lines (empty when not read)."""


def check_evidence(path: str, lines: int = EVIDENCE_LINES) -> EvidenceCheck:
    """Can ``path`` be read here? Optionally its last ``lines`` lines (bounded read).

    The final component is never followed (``lstat``, ``O_NOFOLLOW``) and only a
    regular file is opened (``O_NONBLOCK``, so a FIFO swapped in cannot block). Run
    as root, lines are shown only from a root-owned file: the path may sit in a
    user's directory, and root must not display whatever the user links there.
    """
    if not path or not os.path.isabs(path) or "\x00" in path:
        return EvidenceCheck(False, "invalid")
    try:
        st = os.lstat(path)
    except PermissionError:
        return EvidenceCheck(False, "denied")
    except (OSError, ValueError):
        return EvidenceCheck(False, "absent")
    if not stat.S_ISREG(st.st_mode):
        return EvidenceCheck(False, "not-a-file")
    try:
        ok = os.access(path, os.R_OK, follow_symlinks=False)
    except (NotImplementedError, OSError, ValueError):
        ok = os.access(path, os.R_OK)
    if not ok:
        return EvidenceCheck(False, "denied")
    if lines <= 0 or (os.geteuid() == 0 and st.st_uid != 0):
        return EvidenceCheck(True, "readable")
    return EvidenceCheck(True, "readable", _tail(path, st, lines))


def _tail(path: str, st: os.stat_result, lines: int) -> tuple[str, ...]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ()
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return ()
        start = max(0, now.st_size - EVIDENCE_TAIL_BYTES)
        raw = os.pread(fd, EVIDENCE_TAIL_BYTES, start)
    except OSError:
        return ()
    finally:
        os.close(fd)
    text = raw.decode("utf-8", "replace").splitlines()
    if start > 0 and text:
        text = text[1:]  # the first line is cut
    kept = [ln.rstrip()[:EVIDENCE_LINE_CHARS] for ln in text if ln.strip()]
    return tuple(kept[-lines:])


@dataclass(frozen=True)
class JobQuery:
    """Which jobs the job table shows (reportseff-like): ids, or a period with filters."""

    ids: tuple[str, ...] = ()
    user: str | None = None
    account: str | None = None
    since: str | None = None
    until: str | None = None
    states: tuple[str, ...] = ()
    """Slurm state names (upper case, e.g. COMPLETED, FAILED, RUNNING); empty = all."""
    partitions: tuple[str, ...] = ()
    """Partition names; empty = all."""

    def keeps(self, r: JobRow) -> bool:
        """Whether ``r`` passes the user/account filters (ids are asked for)."""
        if self.user is not None and r.user != self.user:
            return False
        return self.account is None or r.account == self.account

    def keeps_job(self, lines: list[JobRow]) -> bool:
        """Whether a job (its lines, any order) passes the state and partition
        filters: its latest attempt's state, any attempt's partition."""
        if self.partitions and not any(
                p in self.partitions for r in lines for p in r.partition.split(",")):
            return False
        if not self.states:
            return True
        last = max(enumerate(lines), key=lambda p: (
            p[1].start if p[1].start is not None else float("inf"), p[0]))[1]
        return last.state.split(" ")[0] in self.states


def unreachable_reason(e: SlurmError) -> str:
    """sacct's failure in a few words: its last ``error:`` line, shortened."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    errs = [ln for ln in lines if "error" in ln.lower()] or lines or ["no answer"]
    return " ".join(errs[-1].split())[:200]


class Inquirer(abc.ABC):
    """The report's questions; one implementation per source of facts."""

    @abc.abstractmethod
    def job_rows(self, job_id: str) -> list[JobRow]:
        """Accounting lines of the job, oldest attempt first ([] = unknown job)."""

    @abc.abstractmethod
    def period_rows(self, since: str, until: str | None, user: str | None) -> list[JobRow]:
        """Accounting lines of all jobs that ran in the period (admin view)."""

    @abc.abstractmethod
    def live(self, job_id: str) -> dict[str, Any] | None:
        """The controller's view of a job it still has (running, pending), else None."""

    @abc.abstractmethod
    def series(self, job_id: str, attempt: int) -> store.Series | None:
        """The attempt's node-local time series when readable from here, else None."""

    def metas(self, job_id: str) -> dict[int, store.JobMeta]:
        """Prolog metas per attempt when the node's store is readable here."""
        return {}

    def select(self, q: JobQuery) -> tuple[list[JobRow], bool]:
        """The period's lines for ``q`` and whether Slurm applied its state and
        partition filters already (sacct's ``--state`` picks jobs that were in a
        state during the period, which the rows' final states cannot redo)."""
        return self.period_rows(q.since or "now-7days", q.until, q.user), False

    def query(self, q: JobQuery) -> list[JobRow]:
        """Accounting lines of the jobs ``q`` names or filters (job table)."""
        slurm_filtered = False
        if q.ids:
            rows = [r for j in q.ids for r in self.job_rows(j)]
            rows += [r for j in q.ids for t in self.array_tasks(j) for r in self.job_rows(t)]
        else:
            rows, slurm_filtered = self.select(q)
        seen: set[tuple[str, int | None, str]] = set()
        by_job: dict[str, list[JobRow]] = {}
        for r in rows:
            key = (r.job_id, r.start, r.state)
            if key not in seen and q.keeps(r):
                seen.add(key)
                by_job.setdefault(r.job_id, []).append(r)
        return [r for lines in by_job.values()
                if slurm_filtered or q.keeps_job(lines) for r in lines]

    def array_tasks(self, job_id: str) -> list[str]:
        """The tasks (``123_0``, ...) of array job ``job_id`` ([] when it is no array)."""
        return []

    def warnings(self) -> list[str]:
        """Accounting entries skipped so far (one line each, naming the job)."""
        return []

    def accounting_away(self) -> str | None:
        """Why accounting (slurmdbd) could not be asked, as one line starting
        "accounting unreachable:"; None while it answers (issue 28)."""
        return None

    def evidence(self, path: str) -> EvidenceCheck:
        """Whether an attempt's evidence file is readable from this host."""
        return check_evidence(path)

    def collector_gaps(self, job_id: str, start: float,
                       end: float | None) -> list[tuple[float, float]] | None:
        """Spans of ``[start, end]`` the job's node ran no collector (None: unknown)."""
        return None

    def history_rows(self, user: str, days: int) -> list[AccountingRecord] | None:
        """``user``'s ended jobs of the last ``days`` days, as the estimator's history
        reads them (None: not known here)."""
        return None


class SlurmInquirer(Inquirer):
    """sacct/scontrol through the Slurm adapter, plus the local metrics store."""

    def __init__(self, slurm: SlurmAdapter, metrics_dir: str | None) -> None:
        """``metrics_dir`` None: do not look for node-local series."""
        self.slurm = slurm
        self.metrics_dir = metrics_dir
        self._warnings: list[str] = []
        self._acct: dict[str, list[AccountingRecord]] = {}
        self._away: str | None = None

    def warnings(self) -> list[str]:
        return list(self._warnings)

    def accounting_away(self) -> str | None:
        return self._away

    def _accounting(self, job_id: str) -> list[AccountingRecord]:
        """The job's accounting lines; none while slurmdbd (or its database) is away:
        the report then goes on from the controller and this node's store, and says
        so (issue 28: it used to stop with sacct's raw error)."""
        if job_id not in self._acct:
            try:
                self._acct[job_id] = self.slurm.accounting([job_id])
            except SlurmError as e:
                self._away = f"accounting unreachable: {unreachable_reason(e)}"
                self._acct[job_id] = []
        return self._acct[job_id]

    def job_rows(self, job_id: str) -> list[JobRow]:
        if not _JOB_ID.match(job_id):
            return []
        recs = self._accounting(job_id)
        if "_" in job_id:  # an array task: Slurm gave its own raw id
            rows = [r for r in recs if r.fields.get("JobID") == job_id]
        else:
            rows = [r for r in recs if r.job_id == job_id
                    and "_" not in (r.fields.get("JobID") or "")]
        return [JobRow.from_fields(r.fields) for r in by_start(rows)]

    def array_tasks(self, job_id: str) -> list[str]:
        if not _JOB_ID.match(job_id) or "_" in job_id:
            return []
        done = [r.fields.get("JobID", "") for r in self._accounting(job_id)]
        tasks = {t for t in done if t.startswith(f"{job_id}_")}
        try:
            live = self.slurm.jobs()
        except SlurmError as e:  # not "no tasks": the report says what it could not see
            self._warnings.append(f"slurmctld did not answer, array tasks not yet in "
                                  f"accounting are not listed: {str(e)[:160]}")
            live = {}
        tasks |= {f"{j.array_job_id}_{j.array_task_id}" for j in live.values()
                  if str(j.array_job_id) == job_id and j.array_task_id is not None}
        return sorted(tasks, key=lambda t: int(t.split("_")[1]))

    def select(self, q: JobQuery) -> tuple[list[JobRow], bool]:
        # sacct filters by state and partition itself, as `sacct -s/-r` would
        return self._period(q.since or "now-7days", q.until, q.user, q.states,
                            q.partitions), True

    def period_rows(self, since: str, until: str | None, user: str | None) -> list[JobRow]:
        return self._period(since, until, user)

    def _period(self, since: str, until: str | None, user: str | None,
                states: tuple[str, ...] = (), partitions: tuple[str, ...] = (),
                ) -> list[JobRow]:
        # one bad entry is skipped, not fatal; the adapter keeps only ``user``'s records
        out = []
        for rec in self.slurm.accounting_period(since, until, user, warn=self._warnings.append,
                                                states=states, partitions=partitions):
            try:
                out.append(JobRow.from_fields(rec.fields))
            except (ValueError, TypeError, OverflowError) as e:
                self._warnings.append(f"job {rec.job_id}: skipped, unreadable ({e})")
        return out

    def live(self, job_id: str) -> dict[str, Any] | None:
        if not _JOB_ID.match(job_id):
            return None
        try:
            if "_" not in job_id:
                return self.slurm.show_job(job_id)
            arr, task = (int(x) for x in job_id.split("_"))
            for j in self.slurm.jobs().values():
                if j.array_job_id == arr and j.array_task_id == task:
                    return scontrol_view(j)
        except SlurmError as e:  # the report goes on from accounting, and says so
            self._warnings.append(f"slurmctld did not answer, the job's live state is "
                                  f"not shown: {str(e)[:160]}")
        return None

    def series(self, job_id: str, attempt: int) -> store.Series | None:
        if self.metrics_dir is None:
            return None
        try:
            path = store.series_path(self.metrics_dir, job_id, attempt)
        except ValueError:
            return None
        if not path.exists():
            return None
        return store.read_series(self.metrics_dir, job_id, attempt)

    def collector_gaps(self, job_id: str, start: float,
                       end: float | None) -> list[tuple[float, float]] | None:
        # the node's own record, only where the job ran (its directory is here)
        if self.metrics_dir is None:
            return None
        try:
            if not store.job_dir(self.metrics_dir, job_id).is_dir():
                return None
        except (ValueError, OSError):
            return None
        return liveness.gaps(liveness.read_events(self.metrics_dir), start, end)

    def metas(self, job_id: str) -> dict[int, store.JobMeta]:
        if self.metrics_dir is None:
            return {}
        out = {}
        for a in store.attempts_on_node(self.metrics_dir, job_id):
            m = store.read_meta(self.metrics_dir, job_id, a)
            if m is not None:
                out[a] = m
        return out

    def history_rows(self, user: str, days: int) -> list[AccountingRecord] | None:
        from slurm_colloc.accounting.history import ENDED_STATES

        try:
            return self.slurm.finished_jobs_of_user(user, days, states=ENDED_STATES,
                                                    warn=self._warnings.append)
        except SlurmError as e:
            self._warnings.append(f"next estimate: no history from Slurm accounting ({e})")
            return None
