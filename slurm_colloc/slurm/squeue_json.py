"""The one typed job model root acts on, parsed from ``squeue --json``.

Why JSON and not ``scontrol -o show job``: scontrol prints user-chosen free text
(Comment, JobName, WorkDir, Command, StdOut/StdErr paths) unescaped, after the fields
root acts on (GRES, AdminComment, Restarts). A ``Key=`` inside a comment is then
indistinguishable from a real field, and a newline cuts the record: a user forged
``AdminComment=colloc1:mode=whole,...`` that way and ran a 2-shard job with no MPS and
no cap. ``squeue --json`` escapes every string and keeps each field in its own JSON
key, so no user text can become another field (docs/security.md).

Slurm 22.05's ``squeue --json`` ignores ``-j`` and returns every job the controller
holds: :func:`parse_jobs` parses all of them once (one controller call serves the
job's own record and the prolog's check of which registered jobs are still alive).
Malformed entries are dropped, never guessed at.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_JSON_BYTES = 512 << 20
"""squeue of a very large cluster is big; anything larger is refused, not parsed."""

_GRES_IDX = re.compile(r"^(gpu|shard)(?::[A-Za-z0-9_.-]+)?:(\d+)\(IDX:([0-9,\-]+)\)$")


class SqueueJsonError(ValueError):
    """squeue's answer is not the JSON document Slurm documents."""


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


@dataclass(frozen=True)
class SlurmJob:
    """One job as the controller sees it; every field from its own JSON key."""

    job_id: int
    user_id: int
    user_name: str
    state: str
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
    exit_code: int
    """The batch script's wait status as squeue gives it (256 = exit 1)."""
    stdout: str | None
    """Absolute output path with Slurm's ``%`` patterns expanded (None: unknown)."""
    stderr: str | None
    """Absolute error path; None when errors go to stdout."""
    batch_host: str
    array_job_id: int
    array_task_id: int | None

    @property
    def allocated_gpus(self) -> tuple[int, ...] | None:
        """GPU indices of the allocation (``gres_detail``); None when Slurm gave none."""
        found: list[int] = []
        for entry in self.gres_detail:
            m = _GRES_IDX.match(entry)
            if m:
                found.extend(parse_indices(m.group(3)))
        return tuple(sorted(set(found))) if found else None

    @property
    def exit_status(self) -> tuple[int, int]:
        """(exit status, signal), as sacct's ``N:S``."""
        code = self.exit_code
        return ((code >> 8) & 0xFF, code & 0x7F) if code > 0 else (0, 0)

    @property
    def active(self) -> bool:
        """Holding resources now (not pending, not over)."""
        return self.state in ACTIVE_STATES


ACTIVE_STATES = frozenset(
    {"CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING",
     "RESIZING", "REQUEUED", "STAGE_OUT"}
)


def _str(d: Mapping[str, Any], key: str) -> str:
    v = d.get(key)
    return v if isinstance(v, str) else ""


def _int(d: Mapping[str, Any], key: str, default: int | None = 0) -> int | None:
    v = d.get(key)
    if isinstance(v, bool):
        return default
    if isinstance(v, int):
        return v
    if isinstance(v, dict) and isinstance(v.get("number"), int) and v.get("set", True):
        return int(v["number"])  # newer Slurm wraps numbers as {set, infinite, number}
    return default


def _state(d: Mapping[str, Any]) -> str:
    v = d.get("job_state")
    if isinstance(v, list):  # 23.02+: a list of flags, base state first
        v = v[0] if v and isinstance(v[0], str) else ""
    return v.split()[0].upper() if isinstance(v, str) and v.split() else "UNKNOWN"


_PATTERN = re.compile(r"%(\d{0,2})([%AaJjNnstux])")


def expand_output_path(pattern: str, job: Mapping[str, Any], default_name: str) -> str | None:
    """Slurm's ``--output`` filename pattern as slurmd expands it for the batch step.

    ``squeue --json`` shows the pattern as submitted (``/dir/%j.out``), scontrol the
    expanded path. A path with a backslash is not expanded by Slurm either. A relative
    path is relative to the job's working directory.
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
    if not path.startswith("/"):
        if not cwd.startswith("/"):
            return None
        path = cwd.rstrip("/") + "/" + path
    return path


def job_from_json(d: Mapping[str, Any]) -> SlurmJob | None:
    """One ``jobs[]`` entry; None when it lacks what a job must have."""
    job_id = _int(d, "job_id", None)
    uid = _int(d, "user_id", None)
    if job_id is None or uid is None or job_id <= 0 or uid < 0:
        return None
    gres = d.get("gres_detail")
    gres_detail = tuple(g for g in gres if isinstance(g, str)) if isinstance(gres, list) else ()
    task = _int(d, "array_task_id", None)
    default_out = "slurm-%A_%a.out" if task is not None else "slurm-%j.out"
    stdout = expand_output_path(_str(d, "standard_output"), d, default_out)
    err_pattern = _str(d, "standard_error")
    stderr = expand_output_path(err_pattern, d, default_out) if err_pattern else None
    return SlurmJob(
        job_id=job_id,
        user_id=uid,
        user_name=_str(d, "user_name"),
        state=_state(d),
        reason=_str(d, "state_reason"),
        restarts=_int(d, "restart_cnt") or 0,
        name=_str(d, "name"),
        tres_per_node=_str(d, "tres_per_node"),
        tres_per_job=_str(d, "tres_per_job"),
        tres_per_task=_str(d, "tres_per_task"),
        tres_per_socket=_str(d, "tres_per_socket"),
        gres_detail=gres_detail,
        admin_comment=_str(d, "admin_comment"),
        comment=_str(d, "comment"),
        exit_code=_int(d, "exit_code") or 0,
        stdout=stdout,
        stderr=stderr if stderr != stdout else None,
        batch_host=_str(d, "batch_host"),
        array_job_id=_int(d, "array_job_id") or 0,
        array_task_id=task,
    )


def parse_jobs(text: str) -> dict[int, SlurmJob]:
    """Every job in a ``squeue --json`` answer, by job id.

    Raises :class:`SqueueJsonError` when the document itself is not squeue's (not
    JSON, no ``jobs`` list, too large): the caller then knows nothing, which is not
    the same as "no jobs" (a reaper must never read it as "every job is gone").
    """
    if len(text) > MAX_JSON_BYTES:
        raise SqueueJsonError(f"squeue --json answer too large ({len(text)} bytes)")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise SqueueJsonError(f"squeue --json: not JSON: {e}") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("jobs"), list):
        raise SqueueJsonError("squeue --json: no 'jobs' list in the answer")
    out: dict[int, SlurmJob] = {}
    for entry in doc["jobs"]:
        if isinstance(entry, dict):
            job = job_from_json(entry)
            if job is not None:
                out[job.job_id] = job
    return out
