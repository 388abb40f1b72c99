"""The value shapes of Slurm's data_parser v0.0.42, read strictly, in one place.

Why pinned: Slurm's ``--json`` output changes shape between data_parser versions
(22.05's dumper printed a job state as one string and an exit code as a wait status;
v0.0.42 prints lists and objects). ``--json=v0.0.42`` (:data:`JSON_FLAG`) selects the
same shapes on every release we support (24.11 through 26.05, whose default is newer),
so one set of readers serves them all, checked against captured answers
(``tests/unit/data/slurm/<release>/``, ``tools/capture_slurm_fixtures.py``).

Why strict: root acts on these values (a job's state decides whether its MPS
registration is reaped; its GPUs where MPS starts). A value of the wrong shape raises
:class:`DataParserError`; it is never read as 0, "" or "no job".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from slurm_colloc.slurm.records import ExitCode, JobState

DATA_PARSER = "v0.0.42"
JSON_FLAG = f"--json={DATA_PARSER}"
"""The one ``--json`` argument every Slurm command gets (squeue, scontrol, sacct, sinfo)."""

BASE_STATES = frozenset({
    "PENDING", "RUNNING", "SUSPENDED", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT",
    "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY",
})
"""``job_state_string``'s base states (``JOB_STATE_BASE`` in slurm.h)."""

NAMING_FLAGS = (
    "COMPLETING", "STAGE_OUT", "CONFIGURING", "RESIZING", "REQUEUED", "REQUEUE_FED",
    "REQUEUE_HOLD", "SPECIAL_EXIT", "STOPPED", "REVOKED", "RESV_DEL_HOLD", "SIGNALING",
)
"""Flags that name the state in Slurm's own text output, in the order Slurm's
``job_state_string()`` tests them (``src/common/slurm_protocol_defs.c``): a requeued
attempt is ``["PENDING", "REQUEUED"]`` in JSON and ``REQUEUED`` in sacct's text."""

_MAX_TEXT = 1 << 16
"""Longest string kept from one JSON field (Slurm's own limits are far below)."""


class DataParserError(ValueError):
    """A value is not what data_parser v0.0.42 prints for its field."""


def number(v: Any, what: str) -> int | None:
    """A v0.0.42 integer: ``{"set", "infinite", "number"}`` or a bare int (job_id,
    user_id, restart_cnt are printed bare). Not set or infinite: None."""
    if isinstance(v, Mapping):
        if not isinstance(v.get("set"), bool) or not isinstance(v.get("infinite", False), bool):
            raise DataParserError(f"{what}: not a v0.0.42 number: {str(v)[:80]}")
        if v.get("infinite") or not v["set"]:
            return None
        v = v.get("number")
    if isinstance(v, bool) or not isinstance(v, int):
        raise DataParserError(f"{what}: not an integer: {str(v)[:80]}")
    return v


def text(v: Any, what: str, *, nullable: bool = True) -> str:
    """A string field ('' for null where Slurm prints null, e.g. a job's ``user``)."""
    if v is None and nullable:
        return ""
    if not isinstance(v, str):
        raise DataParserError(f"{what}: not a string: {str(v)[:80]}")
    return v[:_MAX_TEXT]


def strings(v: Any, what: str) -> tuple[str, ...]:
    """A list of strings (``gres_detail``, flags)."""
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise DataParserError(f"{what}: not a list of strings: {str(v)[:80]}")
    return tuple(x[:_MAX_TEXT] for x in v)


def job_state(v: Any, what: str = "job_state") -> JobState:
    """``["PENDING", "REQUEUED"]`` -> JobState(base PENDING, flags {REQUEUED}).

    The base state comes first (data_parser prints ``JOB_STATE_BASE`` then the flag
    bits); a list that does not start with a known base state is refused.
    """
    items = strings(v, what)
    if not items or items[0] not in BASE_STATES:
        raise DataParserError(f"{what}: no base state in {list(items)[:4]}")
    return JobState(items[0], frozenset(items[1:]))


def state_name(state: JobState) -> str:
    """The one word Slurm's text tools print for this state (see :data:`NAMING_FLAGS`)."""
    for flag in NAMING_FLAGS:
        if flag in state.flags:
            return flag
    return state.base


def exit_code(v: Any, what: str = "exit_code") -> ExitCode:
    """``{"status": [...], "return_code": N, "signal": {"id": N, "name": S}}``.

    The signal is kept: a job killed by SIGKILL reads ``0:9`` as in sacct's text.
    """
    if not isinstance(v, Mapping):
        raise DataParserError(f"{what}: not an object: {str(v)[:80]}")
    status = strings(v.get("status"), f"{what}.status")
    sig = v.get("signal")
    if not isinstance(sig, Mapping):
        raise DataParserError(f"{what}.signal: not an object: {str(sig)[:80]}")
    return ExitCode(
        status=frozenset(status),
        return_code=number(v.get("return_code"), f"{what}.return_code"),
        signal=number(sig.get("id"), f"{what}.signal.id"),
        signal_name=text(sig.get("name"), f"{what}.signal.name"),
    )


def tres_list(v: Any, what: str) -> dict[str, int]:
    """``[{"type", "name", "count"}]`` -> ``{"cpu": 1, "mem": 256, "gres/shard": 2}``.

    Counts Slurm marks as not known (energy's -2, NO_VAL64) are left out, as sacct's
    text leaves them out; ``mem`` is MiB (the JSON carries no unit).
    """
    if not isinstance(v, list):
        raise DataParserError(f"{what}: not a list: {str(v)[:80]}")
    out: dict[str, int] = {}
    for t in v:
        if not isinstance(t, Mapping):
            raise DataParserError(f"{what}: entry is not an object: {str(t)[:80]}")
        kind, name = text(t.get("type"), f"{what}.type"), text(t.get("name"), f"{what}.name")
        count = number(t.get("count"), f"{what}.count")
        if not kind:
            raise DataParserError(f"{what}: entry without a type")
        if count is not None and count >= 0:
            out[f"{kind}/{name}" if name else kind] = count
    return out


def tres_text(tres: Mapping[str, int]) -> str:
    """As sacct's text prints TRES: ``cpu=1,mem=256M,gres/shard=2``."""
    return ",".join(f"{k}={n}M" if k == "mem" else f"{k}={n}" for k, n in tres.items())
