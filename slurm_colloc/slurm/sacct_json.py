"""``sacct --json`` read once into typed accounting records.

``sacct --parsable2`` joins raw values with ``|`` and ends rows with a newline without
escaping either, so a job name or comment holding ``|`` or a newline hid rows or forged
whole rows (security issue 11, M6). The JSON output escapes strings; this module is the
only place that knows its layout.

``sacct --json=v0.0.42`` (:mod:`slurm_colloc.slurm.data_parser`, the same shapes on
24.11 through 26.05):

* ``{"meta": ..., "errors": [...], "warnings": [...], "jobs": [job, ...]}``, one job
  object per attempt with ``--duplicates`` (a requeued job's earlier attempts).
* ``state.current`` is a list, base state first (``["PENDING", "REQUEUED"]`` for an
  attempt ended by a requeue of a running job; it reads ``REQUEUED`` here, as in
  sacct's text); ``exit_code`` an object whose signal is kept (``0:9``).
* ``--user`` is honoured (22.05 ignored it; sacct matches the uid); ``user`` is null
  when Slurm could not name the job's uid (issue 27: jobs without an association;
  the uid is not in the JSON: data_parser skips it), so :func:`user_of` falls back
  to ``association.user`` and the adapter to the user it asked sacct for
  (``colloc report -u`` found none of such a user's jobs).
* Numbers are bare ints or ``{"set", "infinite", "number"}``; times epoch seconds with
  0 for "never" (sacct's text prints ``Unknown``); TRES counts without units (``mem``
  in MiB) and -2 for a count not gathered (energy).

The mapping from the JSON to the ``--format`` names callers use is :data:`FIELD_MAP`:
one row per field, so a key that differs on a live cluster is a one-line fix. A job
object whose fields are not v0.0.42's is skipped with a warning naming it, never
read with made-up values.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from slurm_colloc.slurm import data_parser as dp
from slurm_colloc.slurm.records import (
    NO_EXIT,
    SACCT_FIELDS,
    AccountingRecord,
    ExitCode,
    SlurmError,
)

log = logging.getLogger(__name__)

SACCT_JSON_ARGS = (dp.JSON_FLAG, "--allocations", "--duplicates")
"""Arguments of every accounting read (jobs, not steps; every attempt of a requeue)."""

_JOB_ID = re.compile(r"^\d{1,12}$")

Warn = Callable[[str], None]


def _get(obj: Any, path: Sequence[str]) -> Any:
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def _int(v: Any) -> int | None:
    """An integer field (bare or ``{"set", "infinite", "number"}``); null: None."""
    return None if v is None else dp.number(v, "number")


def _text(v: Any) -> str:
    """A string field as sacct's text would show it ('' for null)."""
    return dp.text(v, "string")


def _time(v: Any) -> str:
    """Epoch seconds as sacct's local ``YYYY-MM-DDTHH:MM:SS``; 0/null/absurd: Unknown."""
    t = _int(v)
    if not t or t < 0:
        return "Unknown"
    try:
        return datetime.fromtimestamp(t).strftime("%Y-%m-%dT%H:%M:%S")
    except (OverflowError, OSError, ValueError):
        return "Unknown"


def _elapsed(v: Any) -> str:
    """Seconds as sacct's ``[D-]HH:MM:SS``."""
    s = _int(v)
    if s is None or s < 0:
        return ""
    d, rem = divmod(s, 86400)
    h, rem = divmod(rem, 3600)
    m, sec = divmod(rem, 60)
    return (f"{d}-" if d else "") + f"{h:02d}:{m:02d}:{sec:02d}"


def _exit(v: Any) -> ExitCode:
    """The typed exit code; absent (not yet known to slurmdbd) is NO_EXIT, any other
    shape than v0.0.42's object is refused."""
    return NO_EXIT if v is None else dp.exit_code(v)


def _exit_code(v: Any) -> str:
    """The exit code object as sacct's ``N:S`` (signal kept: ``0:9``); absent: ''."""
    return _exit(v).text


def _tres(v: Any) -> str:
    """``[{"type", "name", "count"}, ...]`` as sacct's ``type[/name]=count,...``
    (``mem=256M``: the JSON's MiB with the unit sacct's text prints); null: ''."""
    return "" if v is None else dp.tres_text(dp.tres_list(v, "tres"))


def _state(v: Any) -> str:
    """``state.current`` as the one word sacct's text prints (``REQUEUED``)."""
    return dp.state_name(dp.job_state(v, "state.current"))


def _array_id(job: Any) -> str:
    """sacct's JobID: ``ARRAY_TASK`` (``123_4``) for an array task, else the raw id.

    ``array.job_id`` is 0 when not an array; ``array.task_id`` not set when not a task.
    """
    raw = _int(_get(job, ("job_id",)))
    arr, task = _int(_get(job, ("array", "job_id"))), _int(_get(job, ("array", "task_id")))
    if arr and task is not None and 0 <= task < 0xFFFFFFFE:
        return f"{arr}_{task}"
    return "" if raw is None else str(raw)


FIELD_MAP: dict[str, tuple[tuple[str, ...], Callable[[Any], str]]] = {
    # sacct --format name: (path in the job object, converter to sacct's text)
    "JobIDRaw": (("job_id",), lambda v: str(_int(v) or "")),
    "JobName": (("name",), _text),
    "User": (("user",), _text),
    "State": (("state", "current"), _state),
    "ExitCode": (("exit_code",), _exit_code),
    "Submit": (("time", "submission"), _time),
    "Start": (("time", "start"), _time),
    "End": (("time", "end"), _time),
    "Elapsed": (("time", "elapsed"), _elapsed),
    "AllocTRES": (("tres", "allocated"), _tres),
    "ReqTRES": (("tres", "requested"), _tres),
    "NodeList": (("nodes",), _text),
    "AdminComment": (("comment", "administrator"), _text),
    # 24.11 and 26.05 (v0.0.42): comment.system; where colloc's record lives when
    # record_field = "system_comment" (jobstats sites, accounting.field)
    "SystemComment": (("comment", "system"), _text),
    "Comment": (("comment", "job"), _text),  # sacct's Comment is job->derived_es
    "JobID": ((), _array_id),  # the whole job object: array id and task id
    "Account": (("account",), _text),
    "Partition": (("partition",), _text),
}
assert set(FIELD_MAP) == set(SACCT_FIELDS)


def user_of(obj: Any) -> str:
    """The job's user: ``user``, else ``association.user``; '' when the JSON names
    none (a job without an association: only the query's user can say whose)."""
    return _text(_get(obj, ("user",))) or _text(_get(obj, ("association", "user")))


def job_record(obj: Any) -> AccountingRecord:
    """One job object as a record; ValueError when it has no usable job id."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"job entry is a {type(obj).__name__}, not an object")
    raw_id = obj.get("job_id")
    jid = _int(raw_id)
    if jid is None and isinstance(raw_id, str) and _JOB_ID.match(raw_id):
        jid = int(raw_id)
    if jid is None or not _JOB_ID.match(str(jid)):
        raise ValueError(f"job {_text(raw_id)[:40]!r}: no valid job_id")
    fields = {name: conv(_get(obj, path)) for name, (path, conv) in FIELD_MAP.items()}
    fields["JobIDRaw"] = str(jid)
    fields["User"] = user_of(obj)
    alloc = _get(obj, ("tres", "allocated"))
    return AccountingRecord(
        fields["JobIDRaw"], fields["State"], fields,
        job_state=dp.job_state(_get(obj, ("state", "current")), "state.current"),
        exit=_exit(obj.get("exit_code")),
        alloc_tres=dp.tres_list(alloc, "tres.allocated") if alloc is not None else {},
    )


def parse(text: str, warn: Warn | None = None) -> list[AccountingRecord]:
    """All job objects of one ``sacct --json`` output, in its order.

    A job object that cannot be read is skipped with ``warn`` (default: a log
    warning) naming its job id; output that is not sacct's JSON raises SlurmError.
    """
    say = warn or log.warning
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise SlurmError(f"sacct --json: output is not JSON ({e})") from e
    jobs = doc.get("jobs") if isinstance(doc, Mapping) else None
    if not isinstance(jobs, list):
        raise SlurmError("sacct --json: output has no 'jobs' list")
    errors = doc.get("errors")
    for err in errors if isinstance(errors, list) else ():
        msg = _text(_get(err, ("error",)) or err)[:200]
        if "nothing found" not in msg.lower():  # a job slurmdbd has not heard of yet
            say(f"sacct reported: {msg}")
    out = []
    for obj in jobs:
        try:
            out.append(job_record(obj))
        except (ValueError, TypeError) as e:  # DataParserError is a ValueError
            say(f"skipped an accounting entry: {e}")
    return out
