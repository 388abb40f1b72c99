"""The one typed job model root acts on, parsed from the controller's ``--json``.

Why JSON and not ``scontrol -o show job``: scontrol prints user-chosen free text
(Comment, JobName, WorkDir, Command, StdOut/StdErr paths) unescaped, after the fields
root acts on (GRES, AdminComment, Restarts). A ``Key=`` inside a comment is then
indistinguishable from a real field, and a newline cuts the record: a user forged
``AdminComment=colloc1:mode=whole,...`` that way and ran a 2-shard job with no MPS and
no cap. The JSON escapes every string and keeps each field in its own key, so no user
text can become another field (docs/security.md).

``squeue --json`` and ``scontrol --json show job`` print the same job object
(data_parser v0.0.42, :mod:`slurm_colloc.slurm.data_parser`): :func:`parse_jobs` reads
a whole queue, :func:`parse_job` one job. Both are strict: an entry that is not
v0.0.42's job object raises :class:`SqueueJsonError` (naming the job), never "no such
job" nor a default value, because the reaper and the prolog's GPU check act on them.
"""

from __future__ import annotations

import json
import pwd
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from slurm_colloc.slurm import data_parser as dp
from slurm_colloc.slurm.records import ExitCode, JobState

MAX_JSON_BYTES = 512 << 20
"""squeue of a very large cluster is big; anything larger is refused, not parsed."""

MAX_JOB_JSON_BYTES = 64 << 20
"""One job's answer: a job is ~20 KB, but asking for an array's own id returns every
task of the array (an array of 1,000 tasks is ~20 MB)."""

_GRES_TOKEN = re.compile(
    r"^(gpu|shard)(?::[A-Za-z0-9_.-]{1,64})?:(\d{1,9})\(([^()]{0,4096})\)$")
"""One GPU-ish gres of one node's ``gres_detail``: ``gpu:2(IDX:0-1)``, ``gpu:a100:1(IDX:3)``
or ``shard:3(3/39,0/39,...)`` (shards used/total on each GPU of the node, in order)."""
_USED_TOTAL = re.compile(r"^(\d{1,9})/(\d{1,9})$")


UNKNOWN_STATE = JobState("UNKNOWN")
"""The typed state of a job built by hand (tests, the selftest kit)."""


class SqueueJsonError(ValueError):
    """The controller's answer is not the JSON document data_parser v0.0.42 prints."""


def parse_indices(text: str, limit: int = 1024) -> list[int]:
    """``0-2,5`` -> [0, 1, 2, 5]; raises ValueError on anything else or absurd ranges."""
    out: list[int] = []
    for part in text.split(","):
        if not part:
            continue
        a, dash, b = part.partition("-")
        if not a.isdigit() or (dash and not b.isdigit()) or len(a) > 6 or len(b) > 6:
            raise ValueError(f"not a GPU index list: {text!r}")
        lo, hi = int(a), int(b) if dash else int(a)
        if hi < lo or hi - lo >= limit or len(out) + hi - lo >= limit:
            raise ValueError(f"not a GPU index list: {text!r}")
        out.extend(range(lo, hi + 1))
    return out


def _split_gres(entry: str) -> list[str]:
    """One node's ``gres_detail`` split at the commas outside parentheses
    (``gpu:1(IDX:0),shard:2(2/39,0/39)`` is two gres)."""
    out, depth, start = [], 0, 0
    for i, c in enumerate(entry):
        depth += (c == "(") - (c == ")")
        if c == "," and depth == 0:
            out.append(entry[start:i])
            start = i + 1
    out.append(entry[start:])
    return [t for t in out if t]


def _shard_gpus(count: int, detail: str) -> list[int]:
    """``3/39,0/39`` -> the GPUs (positions) whose used count is > 0; the used counts
    must add up to the job's ``count`` (anything else is refused, not guessed at)."""
    used: list[int] = []
    for part in detail.split(","):
        m = _USED_TOTAL.match(part)
        if not m or int(m.group(1)) > int(m.group(2)):
            raise ValueError(f"shard detail {detail[:80]!r} is not used/total per GPU")
        used.append(int(m.group(1)))
    if sum(used) != count or len(used) > 1024:
        raise ValueError(f"shard detail {detail[:80]!r} does not add up to {count}")
    return [i for i, u in enumerate(used) if u > 0]


def _token_gpus(token: str) -> list[int] | None:
    """GPU indices of one gres of a node's ``gres_detail``; None for a gres that is
    not gpu/shard. ValueError for a gpu/shard entry of a shape we do not know: the
    prolog's check of slurmd's GPUs against the controller's must not be skipped."""
    if not token.startswith(("gpu:", "shard:")):
        return None  # other gres (gpumem, a site's own) are not GPUs
    m = _GRES_TOKEN.match(token)
    if not m:
        raise ValueError(f"gres_detail {token[:80]!r}: unknown shape")
    detail = m.group(3)
    if detail.startswith("IDX:"):
        return parse_indices(detail[4:])
    if m.group(1) == "shard":
        return _shard_gpus(int(m.group(2)), detail)
    raise ValueError(f"gres_detail {token[:80]!r}: no GPU index")


def gres_gpus(gres_detail: tuple[str, ...]) -> tuple[int, ...] | None:
    """GPU indices of an allocation's ``gres_detail``; None when it names no GPU or
    shard. Raises ValueError on a gpu/shard entry of unknown shape."""
    found: list[int] = []
    for entry in gres_detail:
        for token in _split_gres(entry):
            found.extend(_token_gpus(token) or ())
    return tuple(sorted(set(found))) if found else None


def gres_idx_view(gres_detail: tuple[str, ...]) -> str:
    """``gres_detail`` in scontrol's ``name:count(IDX:...)`` form (shards' used/total
    detail turned into the GPUs they sit on), for callers that parse that form.
    Raises ValueError like :func:`gres_gpus`."""
    out: list[str] = []
    for entry in gres_detail:
        for token in _split_gres(entry):
            gpus = _token_gpus(token)
            if gpus is None:
                out.append(token)
            else:
                head = token[:token.index("(")]
                out.append(f"{head}(IDX:{','.join(str(g) for g in gpus)})")
    return ",".join(out)


@dataclass(frozen=True)
class SlurmJob:
    """One job as the controller sees it; every field from its own JSON key."""

    job_id: int
    user_id: int
    user_name: str
    """From the JSON, else this host's passwd (null for jobs without association)."""
    state: str
    """One word as Slurm's text prints it: ``REQUEUED`` for ``["PENDING","REQUEUED"]``."""
    reason: str
    restarts: int
    name: str
    tres_per_node: str
    tres_per_job: str
    tres_per_task: str
    tres_per_socket: str
    gres_detail: tuple[str, ...]
    admin_comment: str
    comment: str
    """The user's own comment: free text, shown, never acted on."""
    exit_code: ExitCode
    """The batch script's exit, signal kept (``0:9`` for SIGKILL)."""
    stdout: str | None
    """Absolute output path as Slurm expanded it (None: unknown)."""
    stderr: str | None
    """Absolute error path; None when errors go to stdout."""
    batch_host: str
    array_job_id: int
    array_task_id: int | None
    job_state: JobState = UNKNOWN_STATE
    """The typed state: base and flags (``state`` is its one-word name)."""
    nice: int = 0
    """Slurm's nice value, signed (negative: a boost only root may give, such as an
    OOM recovery's ``recovery_nice``)."""
    system_comment: str = ""
    """Admin-only like AdminComment; holds colloc's ``cl1:`` record where config
    ``record_field = "system_comment"`` (jobstats sites)."""
    held: bool = False
    """Slurm's ``hold`` (priority 0: held by ``scontrol hold``, ``requeuehold`` or
    ``sbatch --hold``); who held it is in ``reason`` and ``state_description``."""
    state_description: str = ""
    """slurmctld's own text beside ``reason`` (``job requeued in held state`` after a
    ``requeuehold``); users cannot set it."""
    start_time: int = 0
    """When the current attempt was allocated (epoch s; 0: not set), from ``start_time``."""
    nodes: str = ""
    """The allocated nodes as a Slurm hostlist (``''`` while pending), from ``nodes``."""

    @property
    def allocated_gpus(self) -> tuple[int, ...] | None:
        """GPU indices of the allocation (``gres_detail``); None when Slurm gave none.

        Raises ValueError on a gpu/shard entry of unknown shape (see :func:`gres_gpus`).
        """
        return gres_gpus(self.gres_detail)

    @property
    def exit_status(self) -> tuple[int, int]:
        """(exit status, signal), as sacct's ``N:S``."""
        return self.exit_code.pair

    @property
    def active(self) -> bool:
        """Holding resources now (not pending, not over)."""
        return self.state in ACTIVE_STATES


ACTIVE_STATES = frozenset(
    {"CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING",
     "RESIZING", "REQUEUED", "STAGE_OUT"}
)


def _str(d: Mapping[str, Any], key: str) -> str:
    """A string key; absent or null is '' (v0.0.42 prints null for some unset
    strings), any other type is malformed."""
    return dp.text(d.get(key), key)


def _int(d: Mapping[str, Any], key: str, default: int | None = 0) -> int | None:
    """A number key (bare or ``{set, infinite, number}``); absent or unset: default."""
    if key not in d:
        return default
    v = dp.number(d[key], key)
    return default if v is None else v


_PATTERN = re.compile(r"%(\d{0,2})([%AaJjNnstux])")


def expand_output_path(pattern: str, job: Mapping[str, Any], default_name: str) -> str | None:
    """Slurm's ``--output`` filename pattern as slurmd expands it for the batch step.

    data_parser v0.0.42 prints the paths already expanded (seen on 24.11 and 26.05),
    so :func:`job_from_json` does not use this; it stays for tools that hold a
    pattern. A path with a backslash is not expanded by Slurm either. A relative path
    is relative to the job's working directory.
    """
    cwd = _str(job, "current_working_directory")
    path = pattern or default_name
    if "\\" in path:
        path = path.replace("\\", "")
    else:
        job_id = _int(job, "job_id") or 0
        array_id = _int(job, "array_job_id") or 0
        task = _int(job, "array_task_id", None)
        values = {
            "%": "%",
            "A": str(array_id or job_id),
            "a": str(task) if task is not None else "4294967294",
            "J": f"{job_id}.batch",
            "j": str(job_id),
            "N": _str(job, "batch_host").split(".")[0],
            "n": "0",
            "s": "batch",
            "t": "0",
            "u": _str(job, "user_name"),
            "x": _str(job, "name"),
        }

        def sub(m: re.Match[str]) -> str:
            v = values[m.group(2)]
            width = int(m.group(1)) if m.group(1) else 0
            return v.zfill(width) if v.isdigit() and width else v

        path = _PATTERN.sub(sub, path)
    return _absolute(path, cwd)


def _absolute(path: str, cwd: str) -> str | None:
    """A job's path made absolute against its working directory (None: cannot be)."""
    if path.startswith("/"):
        return path
    if not path or not cwd.startswith("/"):
        return None
    return cwd.rstrip("/") + "/" + path


def _user_name(d: Mapping[str, Any], uid: int) -> str:
    """The JSON's name, else this host's passwd entry for the uid, else ''."""
    name = _str(d, "user_name")
    if name:
        return name
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return ""


def _gres_detail(d: Mapping[str, Any]) -> tuple[str, ...]:
    return dp.strings(d.get("gres_detail", []), "gres_detail")


def job_from_json(d: Any) -> SlurmJob:
    """One ``jobs[]`` entry; raises :class:`SqueueJsonError` when it is not one."""
    try:
        if not isinstance(d, Mapping):
            raise dp.DataParserError(f"a {type(d).__name__}, not an object")
        return _job(d)
    except dp.DataParserError as e:
        jid = d.get("job_id") if isinstance(d, Mapping) else None
        raise SqueueJsonError(f"job {str(jid)[:20]}: {e}") from e


def _job(d: Mapping[str, Any]) -> SlurmJob:
    job_id, uid = dp.number(d.get("job_id"), "job_id"), dp.number(d.get("user_id"), "user_id")
    if job_id is None or uid is None or job_id <= 0 or uid < 0:
        raise dp.DataParserError(f"job_id/user_id out of range: {job_id}/{uid}")
    state = dp.job_state(d.get("job_state"))
    cwd = _str(d, "current_working_directory")
    stdout = _absolute(_str(d, "standard_output"), cwd)
    stderr = _absolute(_str(d, "standard_error"), cwd)
    return SlurmJob(
        job_id=job_id,
        user_id=uid,
        user_name=_user_name(d, uid),
        state=dp.state_name(state),
        reason=_str(d, "state_reason"),
        restarts=_int(d, "restart_cnt") or 0,
        name=_str(d, "name"),
        tres_per_node=_str(d, "tres_per_node"),
        tres_per_job=_str(d, "tres_per_job"),
        tres_per_task=_str(d, "tres_per_task"),
        tres_per_socket=_str(d, "tres_per_socket"),
        gres_detail=_gres_detail(d),
        admin_comment=_str(d, "admin_comment"),
        comment=_str(d, "comment"),
        exit_code=dp.exit_code(d.get("exit_code")),
        stdout=stdout,
        stderr=stderr if stderr != stdout else None,
        batch_host=_str(d, "batch_host"),
        array_job_id=_int(d, "array_job_id") or 0,
        array_task_id=_int(d, "array_task_id", None),
        job_state=state,
        nice=_int(d, "nice") or 0,
        system_comment=_str(d, "system_comment"),
        start_time=_int(d, "start_time") or 0,
        nodes=_str(d, "nodes"),
        held=_bool(d, "hold"),
        state_description=_str(d, "state_description"),
    )


def _bool(d: Mapping[str, Any], key: str) -> bool:
    """A boolean key; absent or null is False, any other type is malformed."""
    v = d.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise dp.DataParserError(f"{key}: not a boolean: {str(v)[:80]}")
    return v


def json_list(text: str, limit: int, what: str, key: str = "jobs") -> list[Any]:
    """The ``key`` list (``jobs``, ``nodes``) of a v0.0.42 answer; SqueueJsonError when
    the answer is not one, is too large, or carries controller errors (the caller then
    knows nothing, which is not the same as "no jobs")."""
    if len(text) > limit:
        raise SqueueJsonError(f"{what}: answer too large ({len(text)} bytes)")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise SqueueJsonError(f"{what}: not JSON: {e}") from e
    if not isinstance(doc, dict) or not isinstance(doc.get(key), list):
        raise SqueueJsonError(f"{what}: no '{key}' list in the answer")
    errors = doc.get("errors", [])
    if not isinstance(errors, list):
        raise SqueueJsonError(f"{what}: 'errors' is not a list")
    if errors:  # slurmctld away: exit 0, no jobs and this list (seen in issue 28)
        raise SqueueJsonError(f"{what}: the controller reported: {_error_text(errors[0])}")
    found: list[Any] = doc[key]
    return found


def _error_text(entry: Any) -> str:
    """One ``errors[]`` entry as a line: its description and its error name (either
    may be empty; the name, ``Communication connection failure``, is what says the
    controller did not answer)."""
    if not isinstance(entry, dict):
        return str(entry)[:200]
    parts = [str(entry.get(k) or "").strip() for k in ("description", "error")]
    text = " / ".join(dict.fromkeys(p for p in parts if p)) or "an error without text"
    return text[:240]


def parse_jobs(text: str) -> dict[int, SlurmJob]:
    """Every job in a ``squeue --json`` answer, by job id.

    Raises :class:`SqueueJsonError` when the document or any job in it is not
    v0.0.42's: a reaper must never read "could not read" as "that job is gone".
    """
    out: dict[int, SlurmJob] = {}
    for entry in json_list(text, MAX_JSON_BYTES, "squeue --json"):
        job = job_from_json(entry)
        out[job.job_id] = job
    return out


def parse_job(text: str, job_id: int) -> SlurmJob | None:
    """Job ``job_id`` from a ``scontrol --json show job ID`` answer; None when the
    controller does not hold it (``jobs`` without it; an array's other tasks are read
    and checked but not returned). Raises :class:`SqueueJsonError` like
    :func:`parse_jobs`."""
    found = None
    for entry in json_list(text, MAX_JOB_JSON_BYTES, "scontrol --json show job"):
        job = job_from_json(entry)
        if job.job_id == job_id:
            found = job
    return found
