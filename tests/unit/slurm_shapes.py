"""Test helper: a job object in data_parser v0.0.42's shapes from shorthand values.

Tests write ``job_state="RUNNING"``, ``exit_code=256``, ``array_task_id=2``; Slurm
24.11 through 26.05 print ``["RUNNING"]``, an exit code object and ``{set, infinite,
number}``. :func:`v42_job` turns the shorthand into those shapes (values of any other
type are left as they are, so malformed input still reaches the parser).
"""

from __future__ import annotations

from typing import Any


def number(n: int | None) -> dict[str, Any]:
    """A v0.0.42 number (``set: false`` for None)."""
    return {"set": n is not None, "infinite": False, "number": n or 0}


def exit_object(wait_status: int) -> dict[str, Any]:
    """A wait status (256 = exit 1, 9 = SIGKILL) as v0.0.42's exit code object."""
    sig, rc = wait_status & 0x7F, (wait_status >> 8) & 0xFF
    status = "SIGNALED" if sig else ("ERROR" if rc else "SUCCESS")
    return {"status": [status], "return_code": number(None if sig else rc),
            "signal": {"id": number(sig or None), "name": ""}}


def v42_job(job: dict[str, Any]) -> dict[str, Any]:
    """The same job with shorthand values in v0.0.42's shapes."""
    out = dict(job)
    if isinstance(out.get("job_state"), str) and out["job_state"]:
        out["job_state"] = out["job_state"].split()
    if isinstance(out.get("exit_code"), int) and not isinstance(out["exit_code"], bool):
        out["exit_code"] = exit_object(out["exit_code"])
    out.setdefault("exit_code", exit_object(0))
    for key in ("array_job_id", "array_task_id"):
        if isinstance(out.get(key), int) and not isinstance(out[key], bool):
            out[key] = number(out[key])
    return out
