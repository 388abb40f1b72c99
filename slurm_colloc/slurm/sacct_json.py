"""``sacct --json`` read once into typed accounting records.

``sacct --parsable2`` joins raw values with ``|`` and ends rows with a newline without
escaping either, so a job name or comment holding ``|`` or a newline hid rows or forged
whole rows (security issue 11, M6). The JSON output escapes strings; this module is the
only place that knows its layout.

Slurm 22.05's ``sacct --json`` is the ``openapi/dbv0.0.38`` job dumper (``parse_job[]``
in ``src/plugins/openapi/dbv0.0.38/parse.c``, called from ``src/sacct/data.c``):

* ``{"meta": ..., "errors": [...], "jobs": [job, ...]}``, one job object per attempt:
  the plugin always sets ``JOBCOND_FLAG_DUP`` when the query is not empty (``--jobs``
  or a start time), so ``--duplicates`` is implied (passing it is harmless).
* ``--user``/``--allusers`` are *not* passed on to the plugin: filter by ``user`` here.
* Strings may be ``null``; uint32 values are ``null`` for NO_VAL/INFINITE; times are
  epoch seconds with 0 for "never" (sacct's text prints ``Unknown``).

The mapping from the JSON to the ``--format`` names callers use is :data:`FIELD_MAP`:
one row per field, so a key that differs on a live cluster is a one-line fix. Newer
data_parser versions wrap numbers as ``{"set": true, "number": N}``; :func:`_int`
accepts both.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from slurm_colloc.slurm.records import SACCT_FIELDS, AccountingRecord, SlurmError

log = logging.getLogger(__name__)

SACCT_JSON_ARGS = ("--json", "--allocations", "--duplicates")
"""Arguments of every accounting read (jobs, not steps; every attempt of a requeue)."""

_JOB_ID = re.compile(r"^\d{1,12}$")
_MAX_TEXT = 1 << 16
"""Longest string kept from one JSON field (Slurm's own limits are far below)."""

Warn = Callable[[str], None]


def _get(obj: Any, path: Sequence[str]) -> Any:
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def _int(v: Any) -> int | None:
    """An integer field: plain int, or data_parser's ``{"set", "infinite", "number"}``."""
    if isinstance(v, Mapping):
        if v.get("infinite") or v.get("set") is False:
            return None
        v = v.get("number")
    if isinstance(v, bool) or not isinstance(v, int):
        return None
    return v


def _text(v: Any) -> str:
    """A string field as sacct's text would show it ('' for null / not a string)."""
    if isinstance(v, str):
        return v[:_MAX_TEXT]
    if isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    return ""


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


def _exit_code(v: Any) -> str:
    """``{"status", "return_code", "signal": {"signal_id"}}`` as sacct's ``N:S``.

    dbv0.0.38 reports every normal exit as ``SUCCESS`` with return_code 0 (its dumper
    tests WIFEXITED before the status), so a non-zero exit may read ``0:0`` here;
    the job's state (FAILED) still tells.
    """
    if not isinstance(v, Mapping):
        return ""
    status = _text(v.get("status")).upper()
    if status == "PENDING":
        return ""
    if status == "SIGNALED":
        return f"0:{_int(_get(v, ('signal', 'signal_id'))) or 0}"
    return f"{_int(v.get('return_code')) or 0}:0"


def _tres(v: Any) -> str:
    """``[{"type", "name", "count"}, ...]`` as sacct's ``type[/name]=count,...``."""
    if not isinstance(v, list):
        return ""
    out = []
    for t in v:
        if not isinstance(t, Mapping):
            continue
        kind, name, count = _text(t.get("type")), _text(t.get("name")), _int(t.get("count"))
        if kind and count is not None:
            out.append(f"{kind}/{name}={count}" if name else f"{kind}={count}")
    return ",".join(out)


def _state(v: Any) -> str:
    """``state.current`` (dbv0.0.38: a string; data_parser >= v0.0.40: a list)."""
    if isinstance(v, list):
        return " ".join(_text(x) for x in v if _text(x))
    return _text(v)


def _array_id(job: Any) -> str:
    """sacct's JobID: ``ARRAY_TASK`` (``123_4``) for an array task, else the raw id.

    dbv0.0.38: ``array.job_id`` (0 when not an array) and ``array.task_id`` (null or
    NO_VAL when not a task).
    """
    raw = _int(_get(job, ("job_id",)))
    arr, task = _int(_get(job, ("array", "job_id"))), _int(_get(job, ("array", "task_id")))
    if arr and task is not None and 0 <= task < 0xFFFFFFFE:
        return f"{arr}_{task}"
    return "" if raw is None else str(raw)


FIELD_MAP: dict[str, tuple[tuple[str, ...], Callable[[Any], str]]] = {
    # sacct --format name: (path in the job object, converter to sacct's text)
    "JobIDRaw": (("job_id",), _text),
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
    "Comment": (("comment", "job"), _text),  # sacct's Comment is job->derived_es
    "JobID": ((), _array_id),  # the whole job object: array id and task id
    "Account": (("account",), _text),
}
assert set(FIELD_MAP) == set(SACCT_FIELDS)


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
    return AccountingRecord(fields["JobIDRaw"], fields["State"], fields)


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
        except (ValueError, TypeError) as e:
            say(f"skipped an accounting entry: {e}")
    return out
