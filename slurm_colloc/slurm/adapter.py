"""All talk with Slurm goes through here.

pyslurm matches none of the Slurm releases we support (Debian's 24.11 and 26.05; PyPI
carries pyslurm 25.11 and 17/18), so the shipped implementation drives Slurm's own
commands with ``--json=v0.0.42`` output (:data:`JSON_FLAG`: the same shapes on every
supported release, :mod:`slurm_colloc.slurm.data_parser`). :class:`SlurmAdapter` is
the seam: a site whose Slurm matches a pyslurm release can add a ``PyslurmAdapter``
with the same methods, and unit tests swap in a fake without patching subprocess
everywhere.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from slurm_colloc import waits
from slurm_colloc.slurm import sacct_json
from slurm_colloc.slurm.data_parser import JSON_FLAG
from slurm_colloc.slurm.records import SACCT_FIELDS, AccountingRecord, SlurmError
from slurm_colloc.slurm.squeue_json import (
    MAX_JSON_BYTES,
    SlurmJob,
    SqueueJsonError,
    gres_idx_view,
    parse_job,
    parse_jobs,
)

__all__ = [
    "JSON_FLAG",
    "SACCT_FIELDS",
    "TERMINAL_STATES",
    "AccountingRecord",
    "SlurmAdapter",
    "SlurmCli",
    "SlurmError",
    "by_start",
    "job_state",
    "scontrol_view",
    "wait_for_jobs",
]

MAX_HISTORY_JOBS = 5000
"""At most this many of a user's newest finished jobs are read for the history."""
_STATE_NAMES = {"CD": "COMPLETED", "F": "FAILED", "CA": "CANCELLED", "TO": "TIMEOUT",
                "OOM": "OUT_OF_MEMORY", "NF": "NODE_FAIL", "PR": "PREEMPTED", "DL": "DEADLINE"}
"""sacct's short state names :meth:`SlurmCli.finished_jobs_of_user` accepts."""


def by_start(records: Sequence[AccountingRecord]) -> list[AccountingRecord]:
    """Attempts of one job oldest first.

    ``sacct --duplicates`` does not promise an order: a requeued job's rows came back
    newest-first in one replay. Rows that never started (pending) sort last.
    """
    def key(r: AccountingRecord) -> tuple[int, str]:
        start = r.fields.get("Start", "")
        return (1, "") if not start or start in ("Unknown", "None") else (0, start)

    return sorted(records, key=key)


class SlurmAdapter(abc.ABC):
    """What colloc needs from Slurm; one method per question or action."""

    @abc.abstractmethod
    def submit(
        self, script: str, args: Sequence[str] = (), env: Mapping[str, str] | None = None
    ) -> int:
        """Submit a batch script (text), return the job id."""

    @abc.abstractmethod
    def jobs(self) -> dict[int, SlurmJob]:
        """Every job the controller holds, finished ones included, typed (one
        ``squeue --json -t all``: without ``-t all`` squeue hides finished jobs).

        Raises :class:`SlurmError` when the controller cannot be asked or its answer
        is not squeue's JSON: "unknown" must never look like "no jobs".
        """

    def jobs_among(self, job_ids: Iterable[int]) -> dict[int, SlurmJob]:
        """The jobs of ``job_ids`` the controller holds, finished ones included; an id
        it does not hold is missing from the answer (gone), never an error.

        A node script that judges only a few jobs asks for those (issue 28: under a
        burst, tens of prologs each parsing the whole queue cost the node's CPUs).
        Raises :class:`SlurmError` like :meth:`jobs`. This default reads :meth:`jobs`;
        :class:`SlurmCli` asks for the ids only.
        """
        want = set(job_ids)
        return {j: job for j, job in self.jobs().items() if j in want}

    def job(self, job_id: int | str) -> SlurmJob | None:
        """One job as the controller holds it; None when it holds no such job.

        A node script asks for its own job only: a whole-queue scan costs the
        controller far more on a busy cluster. Raises :class:`SlurmError` when the
        controller cannot be asked or reports an error: never "no job" for "unknown".
        This default reads :meth:`jobs`; :class:`SlurmCli` asks for the one job.
        """
        jid = _job_id(job_id)
        return None if jid is None else self.jobs().get(jid)

    def jobs_on_node(self, node: str) -> dict[int, SlurmJob]:
        """The running jobs (CONFIGURING ones included) the controller has allocated on
        ``node``, typed. Raises :class:`SlurmError` like :meth:`jobs`. This default
        reads :meth:`jobs`; :class:`SlurmCli` asks for that node's only."""
        if not _NODE_NAME.fullmatch(node):
            raise SlurmError(f"not a node name: {node[:80]!r}")
        return {j: job for j, job in self.jobs().items()
                if job.job_state.base == "RUNNING" and _on_node(job.nodes, node)}

    def slurmd_start_time(self, node: str) -> int | None:
        """When ``node``'s slurmd last started as the controller knows it (epoch s,
        ``slurmd_start_time`` of ``scontrol --json show node``); None when the
        controller holds no such time. Raises :class:`SlurmError` when it cannot be
        asked; adapters without it raise too."""
        raise SlurmError(f"{type(self).__name__} cannot ask about a node's slurmd")

    def show_job(self, job_id: int | str) -> dict[str, Any] | None:
        """One job with scontrol's field names (None when the controller forgot it).

        Built from :meth:`job` (JSON), never from ``scontrol`` text: a user's comment
        or output path can hold ``Key=Value`` text that scontrol prints unescaped.
        """
        job = self.job(job_id)
        return None if job is None else scontrol_view(job)

    @abc.abstractmethod
    def accounting(self, job_ids: Sequence[int | str]) -> list[AccountingRecord]:
        """Accounting lines (allocation level, not steps) for these jobs."""

    def finished_jobs_of_user(
        self, user: str, since_days: int, *, timeout: float | None = None,
        warn: Callable[[str], None] | None = None, states: tuple[str, ...] = ("CD",),
    ) -> list[AccountingRecord]:
        """``user``'s jobs (allocations, every attempt) that ended in one of ``states``
        (sacct's short names; default COMPLETED) in the last ``since_days`` days, from
        slurmdbd; only records Slurm reports as ``user``'s.

        Raises :class:`SlurmError` when slurmdbd cannot be asked (or in time): the
        caller decides what "unknown" means. Adapters without it raise too. ``warn``
        gets what sacct reported beside its answer (default: a log warning).
        """
        raise SlurmError(f"{type(self).__name__} cannot list a user's finished jobs")

    def accounting_period(
        self, since: str, until: str | None = None, user: str | None = None,
        warn: Callable[[str], None] | None = None, *, states: Sequence[str] = (),
        partitions: Sequence[str] = (),
    ) -> list[AccountingRecord]:
        """Allocation records of jobs that ran in a period (all users unless ``user``;
        only ``user``'s as Slurm reports them when given; ``states``/``partitions``
        as sacct's ``--state``/``--partition`` select)."""
        raise SlurmError(f"{type(self).__name__} cannot list a period's jobs")

    def controller_config(self) -> dict[str, str]:
        """The running controller's configuration (``scontrol show config``), keys
        lowercased: what slurmctld actually loaded, not what slurm.conf says now."""
        raise SlurmError(f"{type(self).__name__} cannot ask the controller's configuration")

    def sbatch_help(self) -> str:
        """``sbatch --help`` as this host's sbatch prints it (SPANK options included)."""
        raise SlurmError(f"{type(self).__name__} cannot run sbatch")

    @abc.abstractmethod
    def update_job(self, job_id: int | str, **settings: str) -> None:
        """``scontrol update jobid=N Key=Value ...`` for a job the controller still has."""

    @abc.abstractmethod
    def requeue(self, job_id: int | str, *, hold: bool = False) -> None:
        """Requeue a (finished or running) batch job."""

    @abc.abstractmethod
    def release(self, job_id: int | str) -> None:
        """Release a held job."""

    @abc.abstractmethod
    def set_admin_comment_finished(self, job_id: int | str, value: str) -> None:
        """Set AdminComment of a finished job in slurmdbd (sacctmgr; lowercases!)."""

    def set_field_finished(self, job_id: int | str, name: str, value: str) -> None:
        """Set ``name`` (``AdminComment`` or ``SystemComment``) of a finished job in
        slurmdbd; this base knows only AdminComment (test doubles)."""
        if name != "AdminComment":
            raise SlurmError(f"{name}: this adapter sets AdminComment only")
        self.set_admin_comment_finished(job_id, value)

    @abc.abstractmethod
    def nodes(self) -> list[dict[str, Any]]:
        """``scontrol show nodes`` as dicts."""

    @abc.abstractmethod
    def cancel(self, job_ids: Sequence[int | str]) -> None:
        """scancel the jobs."""


def _job_id(job_id: int | str) -> int | None:
    """A job id as the controller knows them (digits only); None for anything else
    (``123_4`` array forms are resolved by the caller)."""
    text = str(job_id)
    return int(text) if text.isdigit() and len(text) <= 12 and int(text) > 0 else None


_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""A node name colloc passes to Slurm's tools (never an option, never a hostlist)."""


def _on_node(nodes: str, node: str) -> bool:
    """Whether Slurm's hostlist ``nodes`` names ``node`` (an unreadable list: no)."""
    from slurm_colloc.hostlist import HostlistError, contains

    try:
        return bool(nodes) and contains(nodes, node)
    except HostlistError:
        return False


MAX_NODE_JSON_BYTES = 16 << 20
"""The most ``scontrol --json show node NAME`` may print before colloc stops reading."""


def parse_slurmd_start(text: str, node: str) -> int | None:
    """``slurmd_start_time`` of ``node`` in a ``scontrol --json show node`` answer
    (None: not set, or no such node in it); SlurmError when it is not that answer."""
    from slurm_colloc.slurm import data_parser as dp
    from slurm_colloc.slurm.squeue_json import SqueueJsonError, json_list

    try:
        nodes = json_list(text, MAX_NODE_JSON_BYTES, "scontrol --json show node", "nodes")
    except SqueueJsonError as e:
        raise SlurmError(str(e)) from e
    for entry in nodes:
        if isinstance(entry, dict) and entry.get("name") == node:
            try:
                v = dp.number(entry.get("slurmd_start_time"), "slurmd_start_time")
            except dp.DataParserError as e:
                raise SlurmError(f"scontrol --json show node {node}: {e}") from e
            return v if v else None
    return None


_NONE_KNOWN = ("invalid job id",)
"""What squeue says (exit 1; with ``--json``, or an ``errors`` entry) when it holds
none of the ``--jobs`` ids: those jobs are gone, not an unanswered question."""


def _none_known(text: str) -> bool:
    low = text.lower()
    return any(m in low for m in _NONE_KNOWN)


def _json_errors(text: str) -> list[str]:
    """The ``errors`` entries of a squeue --json answer, as text ([] when none or
    when the answer is not JSON: the caller's parse then says why)."""
    try:
        doc = json.loads(text) if len(text) <= MAX_JSON_BYTES else None
    except (ValueError, RecursionError):
        return []
    errors = doc.get("errors") if isinstance(doc, dict) else None
    if not isinstance(errors, list):
        return []
    return [_error_entry(e) for e in errors[:16]]


def _error_entry(entry: Any) -> str:
    if not isinstance(entry, dict):
        return str(entry)[:200]
    return " / ".join(str(entry.get(k) or "") for k in ("description", "error"))[:240]


def _without_errors(text: str) -> str:
    """The answer with its ``errors`` list emptied (every entry said only that some
    ids are not known: the jobs it lists are still the controller's answer)."""
    doc = json.loads(text)
    doc["errors"] = []
    return json.dumps(doc)


def _gres_view(job: SlurmJob) -> str:
    """scontrol's ``GRES=`` in the ``name:count(IDX:...)`` form callers parse; the raw
    ``gres_detail`` when its GPUs cannot be read (the caller then finds no IDX)."""
    try:
        return gres_idx_view(job.gres_detail)
    except ValueError:
        return ",".join(job.gres_detail)


def scontrol_view(job: SlurmJob) -> dict[str, Any]:
    """The typed job under scontrol's field names, for callers written against them."""
    code = job.exit_status
    return {
        "JobId": str(job.job_id), "JobName": job.name, "UserId": str(job.user_id),
        "JobState": job.state, "Reason": job.reason, "Restarts": str(job.restarts),
        "TresPerNode": job.tres_per_node, "TresPerJob": job.tres_per_job,
        "TresPerTask": job.tres_per_task, "GRES": _gres_view(job),
        "AdminComment": job.admin_comment, "Comment": job.comment,
        "SystemComment": job.system_comment,
        "StdOut": job.stdout or "", "StdErr": job.stderr or job.stdout or "",
        "ExitCode": f"{code[0]}:{code[1]}", "BatchHost": job.batch_host,
        "Nice": str(job.nice),
    }


_KEY = re.compile(r"^[A-Za-z][A-Za-z0-9_:/.]*$")


def _kv_records(text: str) -> list[dict[str, str]]:
    """Parse ``scontrol -o show ...`` output: one record per line, Key=Value tokens.

    A few values contain spaces (Command, WorkDir, Comment, Reason), so a token that
    does not start with ``Key=`` is glued to the previous value.
    """
    records = []
    for line in text.splitlines():
        if not line.strip():
            continue
        rec: dict[str, str] = {}
        last: str | None = None
        for token in line.split(" "):
            key, eq, value = token.partition("=")
            if eq and _KEY.match(key):
                rec[key] = value
                last = key
            elif last is not None and token:
                rec[last] += " " + token
        records.append(rec)
    return records


class SlurmCli(SlurmAdapter):
    """The adapter over Slurm's command-line tools.

    ``env`` lets callers point at a private cluster (``SLURM_CONF``) without
    touching this process's environment; ``bindir`` pins the tools for code that
    runs with no PATH (Prolog/Epilog).
    """

    def __init__(
        self, env: Mapping[str, str] | None = None, bindir: str | None = None, timeout: float = 60
    ) -> None:
        self._env = dict(os.environ if env is None else env)
        self._env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
        self._bindir = bindir
        self._timeout = timeout

    def _tool(self, name: str) -> str:
        if self._bindir:
            return os.path.join(self._bindir, name)
        found = shutil.which(name, path=self._env.get("PATH"))
        if not found:
            raise SlurmError(f"{name}: not found on PATH (is slurm-client installed?)")
        return found

    def _run(
        self, tool: str, *args: str, input_text: str | None = None, check: bool = True,
        timeout: float | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run one Slurm tool with argv (never a shell); ``timeout`` overrides the
        adapter's own for this call."""
        argv = [self._tool(tool), *args]
        limit = self._timeout if timeout is None else timeout
        try:
            with waits.timed(tool):  # e.g. "squeue 0.40 s" in a node script's log line
                cp = subprocess.run(
                    argv,
                    input=input_text,
                    capture_output=True,
                    text=True,
                    env=self._env,
                    timeout=limit,
                    check=False,
                )
        except subprocess.TimeoutExpired as e:
            raise SlurmError(f"{' '.join(argv)}: timed out after {limit:.0f}s") from e
        if check and cp.returncode != 0:
            raise SlurmError(
                f"{' '.join(argv)}: exit {cp.returncode}: {cp.stderr.strip() or cp.stdout.strip()}"
            )
        return cp

    def submit(
        self, script: str, args: Sequence[str] = (), env: Mapping[str, str] | None = None
    ) -> int:
        cp = self._run("sbatch", "--parsable", *args, input_text=script)
        out = cp.stdout.strip().split(";")[0]
        try:
            return int(out)
        except ValueError as e:
            raise SlurmError(f"sbatch printed no job id: {cp.stdout!r} {cp.stderr!r}") from e

    def jobs(self) -> dict[int, SlurmJob]:
        cp = self._run("squeue", JSON_FLAG, "--states=all")
        try:
            return parse_jobs(cp.stdout)
        except SqueueJsonError as e:
            raise SlurmError(str(e)) from e

    def jobs_among(self, job_ids: Iterable[int]) -> dict[int, SlurmJob]:
        ids = sorted({j for j in map(_job_id, job_ids) if j is not None})
        if not ids:
            return {}
        cp = self._run("squeue", JSON_FLAG, "--states=all", f"--jobs={','.join(map(str, ids))}",
                       check=False)
        errors = _json_errors(cp.stdout)
        if cp.returncode != 0 or errors:
            # 26.05's squeue asked for one id it does not hold exits 1 ("Invalid job
            # id specified" on stderr; for several, exit 0 and no jobs): gone. Only
            # stderr and the errors list (slurmctld's text) are read, never the jobs'
            # fields, which users write.
            said = [t for t in (*errors, cp.stderr) if t.strip()]
            if not said or not all(_none_known(t) for t in said):
                raise SlurmError(f"squeue --jobs: exit {cp.returncode}: "
                                 f"{(cp.stderr.strip() or '; '.join(errors))[:500]}")
            if cp.returncode != 0:
                return {}
        try:
            jobs = parse_jobs(_without_errors(cp.stdout) if errors else cp.stdout)
        except SqueueJsonError as e:
            raise SlurmError(str(e)) from e
        return {j: job for j, job in jobs.items() if j in set(ids)}

    def jobs_on_node(self, node: str) -> dict[int, SlurmJob]:
        if not _NODE_NAME.fullmatch(node):
            raise SlurmError(f"not a node name: {node[:80]!r}")
        cp = self._run("squeue", JSON_FLAG, "--states=RUNNING,CONFIGURING",
                       f"--nodelist={node}")
        try:
            jobs = parse_jobs(cp.stdout)
        except SqueueJsonError as e:
            raise SlurmError(str(e)) from e
        # the filter again here: the node list is Slurm's own field, read by colloc
        return {j: job for j, job in jobs.items()
                if job.job_state.base == "RUNNING" and _on_node(job.nodes, node)}

    def slurmd_start_time(self, node: str) -> int | None:
        if not _NODE_NAME.fullmatch(node):
            raise SlurmError(f"not a node name: {node[:80]!r}")
        cp = self._run("scontrol", JSON_FLAG, "show", "node", node)
        return parse_slurmd_start(cp.stdout, node)

    def job(self, job_id: int | str) -> SlurmJob | None:
        jid = _job_id(job_id)
        if jid is None:
            return None
        cp = self._run("scontrol", JSON_FLAG, "show", "job", str(jid))
        try:
            return parse_job(cp.stdout, jid)
        except SqueueJsonError as e:
            raise SlurmError(str(e)) from e

    def accounting(self, job_ids: Sequence[int | str]) -> list[AccountingRecord]:
        # JSON, never --parsable2: its '|' and newlines are not escaped (issue 11, M6)
        if not job_ids:
            return []
        cp = self._run(
            "sacct", *sacct_json.SACCT_JSON_ARGS, "--jobs", ",".join(str(j) for j in job_ids),
        )
        return sacct_json.parse(cp.stdout)

    def finished_jobs_of_user(
        self, user: str, since_days: int, *, timeout: float | None = None,
        warn: Callable[[str], None] | None = None, states: tuple[str, ...] = ("CD",),
    ) -> list[AccountingRecord]:
        # `sacct --json` honours --user on 24.11+ (22.05's did not); user and state are
        # still checked on each record, and only the newest MAX_HISTORY_JOBS are kept.
        if not user or not all(c.isalnum() or c in "._-@$" for c in user):
            raise SlurmError(f"not a user name: {user[:40]!r}")
        names = {_STATE_NAMES[s] for s in states if s in _STATE_NAMES}
        if not names:
            raise SlurmError(f"no known job state in {states!r}")
        days = max(1, int(since_days))
        cp = self._run("sacct", *sacct_json.SACCT_JSON_ARGS, f"--user={user}",
                       f"--starttime=now-{days}days", "--endtime=now",
                       "--state=" + ",".join(s for s in states if s in _STATE_NAMES),
                       timeout=timeout)
        recs = [
            r for r in sacct_json.parse(cp.stdout, warn=warn)
            if r.fields.get("User") == user and r.state.split(" ")[0] in names
        ]
        return recs[-MAX_HISTORY_JOBS:]

    def accounting_period(
        self, since: str, until: str | None = None, user: str | None = None,
        warn: Callable[[str], None] | None = None, *, states: Sequence[str] = (),
        partitions: Sequence[str] = (),
    ) -> list[AccountingRecord]:
        # JSON, never --parsable2 (issue 11, M6); sacct selects by the user's uid,
        # and a record naming another user is dropped here. A job without an
        # association names no user in the JSON (issue 27): sacct chose it by the
        # uid asked for, so it is that user's.
        # an explicit end: with --state and no --endtime, sacct looks at one second
        # after the start ("Jobs FAILED in the time window from 06:21:40 to 06:21:41")
        args = [*sacct_json.SACCT_JSON_ARGS, f"--starttime={since}",
                f"--endtime={until or 'now'}"]
        args += [f"--user={user}"] if user else ["--allusers"]
        args += [f"--state={','.join(states)}"] if states else []
        args += [f"--partition={','.join(partitions)}"] if partitions else []
        cp = self._run("sacct", *args)
        recs = sacct_json.parse(cp.stdout, warn=warn)
        if user is None:
            return recs
        out = []
        for r in recs:
            if not r.fields.get("User"):
                r = dataclasses.replace(r, fields={**r.fields, "User": user})
            if r.fields.get("User") == user:
                out.append(r)
        return out

    def controller_config(self) -> dict[str, str]:
        cp = self._run("scontrol", "show", "config")
        out: dict[str, str] = {}
        for line in cp.stdout.splitlines():
            k, eq, v = line.partition("=")
            if eq:
                # 23.02+ lists several Prolog/Epilog scripts as ``Prolog[0]``, ``Prolog[1]``
                key = re.sub(r"\[\d+\]$", "", k.strip()).lower()
                out[key] = f"{out[key]},{v.strip()}" if key in out else v.strip()
        return out

    def sbatch_help(self) -> str:
        return self._run("sbatch", "--help", check=False).stdout

    def update_job(self, job_id: int | str, **settings: str) -> None:
        pairs = (f"{k}={v}" for k, v in settings.items())
        self._run("scontrol", "update", f"jobid={job_id}", *pairs)

    def requeue(self, job_id: int | str, *, hold: bool = False) -> None:
        self._run("scontrol", "requeuehold" if hold else "requeue", str(job_id))

    def release(self, job_id: int | str) -> None:
        self._run("scontrol", "release", str(job_id))

    def set_admin_comment_finished(self, job_id: int | str, value: str) -> None:
        self.set_field_finished(job_id, "AdminComment", value)

    def set_field_finished(self, job_id: int | str, name: str, value: str) -> None:
        if name not in WRITABLE_FIELDS:
            raise SlurmError(f"{name}: not a field colloc writes")
        self._run(
            "sacctmgr", "-i", "modify", "job", "where", f"jobid={job_id}", "set",
            f"{name}={value}",
        )

    def nodes(self) -> list[dict[str, Any]]:
        cp = self._run("scontrol", "-o", "show", "nodes")
        return [dict(r) for r in _kv_records(cp.stdout)]

    def cancel(self, job_ids: Sequence[int | str]) -> None:
        if job_ids:
            self._run("scancel", *(str(j) for j in job_ids), check=False)



WRITABLE_FIELDS = frozenset({"AdminComment", "SystemComment"})
"""Job fields colloc's record may be written to (``sacctmgr modify job ... set``)."""

TERMINAL_STATES = frozenset(
    {
        "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL",
        "PREEMPTED", "BOOT_FAIL", "DEADLINE",
    }
)


def job_state(adapter: SlurmAdapter, job_id: int | str) -> str:
    """The job's current state: the controller's view while it has one, else sacct's.

    The controller is authoritative (it knows COMPLETING and requeues at once);
    sacct lags behind slurmdbd but remembers jobs the controller has purged.
    """
    info = adapter.show_job(job_id)
    if info is not None:
        return str(info.get("JobState", "UNKNOWN"))
    recs = by_start(adapter.accounting([job_id]))
    return recs[-1].state.split()[0] if recs else "UNKNOWN"


def wait_for_jobs(
    adapter: SlurmAdapter, job_ids: Sequence[int | str], timeout: float = 300,
    poll: float = 0.5,
) -> dict[str, str]:
    """Block until every job is in a terminal state; return job id -> state.

    Raises TimeoutError naming the jobs still running, so a test or benchmark that
    hangs says which job it waited for.
    """
    import time

    pending = {str(j) for j in job_ids}
    done: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while pending:
        for j in sorted(pending):
            state = job_state(adapter, j)
            if state in TERMINAL_STATES:
                done[j] = state
        pending -= set(done)
        if not pending:
            break
        if time.monotonic() > deadline:
            states = {j: job_state(adapter, j) for j in sorted(pending)}
            raise TimeoutError(f"jobs still not finished after {timeout:.0f}s: {states}")
        time.sleep(poll)
    return done
