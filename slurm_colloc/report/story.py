"""What ended each attempt, in words: who stopped it, why, its exit code, how much was seen.

Issue 27: a job the collector killed read "FAILED, exit 0:0, peak 1500 %" with no word of
colloc; an OOM showed its peak but not the 10 GiB allocation that failed; a victim of a
co-tenant was not told the crash was not its own. This module reads the facts the
model assembled (the attempt's record: the collector's verdict, the OOM cause and its
failed allocation, the blamed co-tenant; sacct's state and ``N:S`` exit code; the
sampling gaps) and says in one sentence who stopped the attempt. :mod:`.recommend`
turns the same :attr:`AttemptView.story` into advice, so the two never disagree.

Precedence, most specific first: the collector's kill, a co-tenant's fault, the job's
own GPU error (OOM, fatal CUDA error, host OOM), Slurm (cancel, time limit,
preemption, node failure, cgroup OOM), a signal, an exit status.
"""

from __future__ import annotations

import itertools
import signal
from typing import TYPE_CHECKING, Any

from slurm_colloc.report.fmt import gib

if TYPE_CHECKING:
    from slurm_colloc.report.model import AttemptView

KILLED_BY_COLLOC = "killed-by-colloc"
CO_TENANT = "co-tenant"
SIGNALLED = frozenset({"signal", "cancelled", "timeout", "preempted", "node-fail"})
"""Causes that end an attempt from outside: its peak is not its need, so no memory advice."""
_SLURM_STATES = {
    "CANCELLED": ("cancelled", "Slurm cancelled it (scancel by its user or an admin)"),
    "TIMEOUT": ("timeout", "Slurm stopped it at its time limit"),
    "PREEMPTED": ("preempted", "Slurm preempted it for another job"),
    "NODE_FAIL": ("node-fail", "its node failed"),
    "BOOT_FAIL": ("node-fail", "its node failed to boot"),
    "OUT_OF_MEMORY": ("host-oom", "Slurm's cgroup killed it for using more host memory "
                      "than it asked for (--mem)"),
    "DEADLINE": ("timeout", "Slurm stopped it at its deadline"),
}


def signal_name(n: int) -> str:
    """``SIGKILL`` for 9; ``signal 77`` for a number this platform does not name."""
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def exit_words(code: str | None) -> str | None:
    """sacct's ``N:S`` in words: ``killed by signal 9 (SIGKILL)``, ``exit status 1``.

    ``137:0`` is a shell reporting a child killed by signal 9 (128 + 9): said so.
    """
    if not code or ":" not in code:
        return None
    try:
        status, sig = (int(x) for x in code.split(":", 1))
    except ValueError:
        return None
    if sig > 0:
        return f"killed by signal {sig} ({signal_name(sig)})"
    if 128 < status < 128 + 65:
        return (f"exit status {status} (128 + {status - 128}: a process of the job was "
                f"killed by {signal_name(status - 128)})")
    return f"exit status {status}"


def _signal_of(code: str | None) -> int | None:
    """The signal that ended the job (``0:9``, or a shell's ``137:0``), None if none."""
    try:
        status, sig = (int(x) for x in (code or "").split(":", 1))
    except ValueError:
        return None
    return sig if sig > 0 else (status - 128 if 128 < status < 128 + 65 else None)


def _enforced(a: AttemptView) -> tuple[str, str] | None:
    v = a.enforcement or {}
    if v.get("action") != "killed":
        return None
    if v.get("kind") == "over_limit":
        where = " outside MPS" if v.get("outside_mps") else ""
        return KILLED_BY_COLLOC, (
            f"colloc's collector killed it: its GPU memory reached {gib(v.get('peak_mib'))}"
            f"{where}, over its allocation of {gib(v.get('limit_mib'))}")
    return KILLED_BY_COLLOC, (
        "colloc's collector killed it: a process of the job used the GPU outside MPS "
        "(CUDA_MPS_PIPE_DIRECTORY unset or changed), where no memory limit holds")


def _requeued(a: AttemptView) -> str:
    rq = a.requeue or {}
    if rq.get("requeued"):
        return f"it was requeued ({rq.get('reason')})"
    return "it was not requeued" + (f" ({rq['reason']})" if rq.get("reason") else "")


def _co_tenant(a: AttemptView) -> tuple[str, str] | None:
    oom = a.oom or {}
    if oom.get("cause") == "gpu-oom" and oom.get("culprit"):
        return CO_TENANT, (
            f"not this job's fault: co-tenant job {oom['culprit']} went over its allocation "
            f"on GPU {a.gpu} and took the memory this job needed; {_requeued(a)}")
    if oom.get("cause") == "mps-fault" and not oom.get("whole_gpu"):
        return CO_TENANT, (
            "not this job's fault: the GPU's MPS server failed its clients (another "
            f"client's fatal error, or the server recovering from one); {_requeued(a)}")
    return None


def oom_words(a: AttemptView) -> str | None:
    """``OOM: a 10.0 GiB allocation failed with 4.0 GiB in use (limit 6.0 GiB)``."""
    oom = a.oom or {}
    if oom.get("cause") != "gpu-oom":
        return None
    alloc, used = oom.get("alloc_mib"), oom.get("in_use_mib") or a.peak_mib
    limit = f" (limit {gib(a.limit_mib)})" if a.limit_mib else ""
    if alloc is None:
        return f"OOM: it ran out of GPU memory at {gib(used)} in use{limit}"
    return f"OOM: a {gib(alloc)} allocation failed with {gib(used)} in use{limit}"


def _own_error(a: AttemptView) -> tuple[str, str] | None:
    oom = a.oom or {}
    cause = oom.get("cause")
    if cause == "gpu-oom":
        return "gpu-oom", f"{oom_words(a)}; {_requeued(a)}"
    if cause == "cuda-fatal":
        return "cuda-fatal", ("a fatal CUDA error (" + str(oom.get("pattern") or "?") + ")"
                              + ("" if oom.get("whole_gpu") else
                                 " under MPS, where one client's fault ends every client")
                              + f"; {_requeued(a)}")
    if cause == "host-oom":
        return "host-oom", "it ran out of host memory (not GPU memory)"
    if cause == "mps-fault":
        return "mps-fault", f"the GPU's MPS server failed it; {_requeued(a)}"
    return None


def _slurm_or_exit(a: AttemptView) -> tuple[str, str]:
    state = (a.state or "").split(" ")[0]
    if state in _SLURM_STATES:
        return _SLURM_STATES[state]
    sig = _signal_of(a.exit_code)
    if sig is not None:
        return "signal", (f"it was killed by {signal_name(sig)} (scancel --signal, the "
                          "job itself, or an admin; colloc did not send it)")
    if state == "COMPLETED":
        return "completed", "it completed"
    if state == "REQUEUED":
        return "requeued", "it was requeued (by Slurm or an admin; colloc found no cause)"
    if state in ("RUNNING", "PENDING", "SUSPENDED", "CONFIGURING", "COMPLETING"):
        return "running", f"it is {state}"
    words = exit_words(a.exit_code)
    return "exit", f"it ended with {words}" if words else f"it ended {state or 'unknown'}"


def measured_words(sampling: dict[str, Any] | None) -> str | None:
    """``measured 8 s of 16 s (50 %); the collector was stopped for 8 s``."""
    if not sampling or not sampling.get("span_s"):
        return None
    span, un = int(sampling["span_s"]), int(sampling.get("unsampled_s") or 0)
    if un <= 0:
        return f"measured all of its {span} s"
    stopped = sum(g["to"] - g["from"] for g in sampling.get("gaps") or []
                  if g.get("cause") == "collector")
    why = (f"; the collector was stopped for {round(stopped)} s (nothing sampled or "
           "enforced then): its peak may have been higher" if stopped > 0 else "")
    return f"measured {span - un} s of {span} s ({(span - un) / span:.0%}){why}"


def _flag(a: AttemptView) -> str | None:
    v = a.enforcement or {}
    if not v or v.get("action") == "killed":
        return None
    what = ("over its allocation" if v.get("kind") == "over_limit" else "outside MPS")
    return (f"the collector saw it {what} (peak {gib(v.get('peak_mib'))}, allocation "
            f"{gib(v.get('limit_mib'))}) and {v.get('action')} it without killing it")


def of(a: AttemptView) -> dict[str, Any]:
    """The :attr:`AttemptView.story` object: ``cause`` (a stable word), ``summary``
    (who stopped it and why), ``exit_code`` (sacct's ``N:S``), ``exit`` (in words),
    ``measured`` (how much of it was sampled) and ``flag`` (a verdict without a kill)."""
    cause, summary = (_enforced(a) or _co_tenant(a) or _own_error(a) or _slurm_or_exit(a))
    return {"cause": cause, "summary": summary, "exit_code": a.exit_code or None,
            "exit": exit_words(a.exit_code), "measured": measured_words(a.sampling),
            "flag": _flag(a)}


def across(attempts: list[AttemptView]) -> None:
    """Amend the stories with what only later attempts show (after :func:`of`).

    Under MPS one client's fatal fault ends every client of the GPU, and every client
    prints the same error, so an attempt alone cannot tell the culprit from a victim.
    Its requeue can: a job whose shared attempt ended in a fatal CUDA error and whose
    next attempt completed did not cause it (a culprit's fault comes back on a GPU of
    its own, as tests/e2e/test_node_path.py's culprit shows). Such an attempt is told
    it was a co-tenant's fault, so its advice is "no resize" rather than a debugging hunt.
    """
    for a, nxt in itertools.pairwise(attempts):
        s, oom = a.story or {}, a.oom or {}
        if (s.get("cause") == "cuda-fatal" and not oom.get("whole_gpu")
                and (nxt.story or {}).get("cause") == "completed"):
            s["cause"] = CO_TENANT
            s["summary"] = (
                "most likely not this job's fault: a fatal CUDA error under MPS, where one "
                f"client's fault ends every client of the GPU ({oom.get('pattern') or '?'}),"
                f" and its next attempt completed without one; {_requeued(a)}")


def line(a: AttemptView) -> str:
    """The story as one line of the text and HTML reports."""
    s = a.story or of(a)
    parts = [f"Attempt {a.attempt}: {s['summary']}."]
    if s.get("exit_code"):
        parts.append(f"Exit code {s['exit_code']} ({s['exit']}).")
    if s.get("flag"):
        parts.append(f"Also: {s['flag']}.")
    if s.get("measured"):
        parts.append(f"Sampling: {s['measured']}.")
    return " ".join(parts)
