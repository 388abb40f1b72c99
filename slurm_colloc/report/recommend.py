"""Notes (what happened) and recommendations (what to change), from measured symptoms.

The rules are the well-known causes of poor GPU use, each tied to what the sidecar
measured, so a recommendation always says which figure it comes from:

- batch too small: SM activity and peak memory both under half of what was there;
- memory nearly full with low SM activity: memory-bound, not compute-bound;
- idle phases: many samples with the SM idle while the job holds memory
  (data loading, checkpointing, evaluation on the CPU);
- a smaller share would do: the measured peak plus margin fits in fewer shards;
- an OOM: the estimate was short by this much; ask for this much next time;
- what ended an attempt (colloc's kill, a co-tenant, a known failed allocation, a
  signal): :mod:`.cause_advice`; an attempt stopped from outside gets no memory advice,
  and a peak measured with the collector stopped never shrinks a share.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from slurm_colloc.report import cause_advice, placement
from slurm_colloc.report.fmt import gib
from slurm_colloc.report.sampling import collector_stopped
from slurm_colloc.report.story import CO_TENANT

if TYPE_CHECKING:
    from slurm_colloc.report.model import AttemptView, JobReport

MARGIN = 0.10
"""Headroom recommended over a measured peak."""


def _final(rep: JobReport) -> AttemptView | None:
    measured = [a for a in rep.attempts if a.samples]
    return measured[-1] if measured else (rep.attempts[-1] if rep.attempts else None)


def notes_and_advice(rep: JobReport) -> tuple[list[str], list[str]]:
    """(notes, recommendations) for the report."""
    if not rep.colloc:
        return ["This job carries no colloc data (not submitted with --colloc or a "
                "shard request, or it never reached a colloc node)."], []
    compute = placement.compute_note(rep)
    notes = (_state_notes(rep) + ([compute] if compute else []) + placement.pending_notes(rep)
             + [n for a in rep.attempts for n in _attempt_notes(rep, a)])
    advice: list[str] = placement.advice(rep)
    _fatal_cuda(rep, notes, advice)
    advice += cause_advice.advice(rep)
    f = _final(rep)
    if f is None or f.peak_mib is None or cause_advice.stopped_from_outside(rep):
        return notes, advice  # a killed or signalled attempt's peak is not its need
    est = f.estimate_mib or (rep.submitted or {}).get("estimate_mib")
    if est:
        err = (est - f.peak_mib) / f.peak_mib * 100 if f.peak_mib else 0.0
        notes.append(f"Estimate {gib(est)} vs measured peak {gib(f.peak_mib)} "
                     f"({err:+.0f}%).")
    return notes, advice + _advice(rep, f, est)


def _state_notes(rep: JobReport) -> list[str]:
    notes = []
    if rep.state in ("PENDING", "REQUEUED"):
        notes.append(f"The job is {rep.state}: it has not started (again) yet; figures of "
                     "earlier attempts only.")
    elif rep.running:
        notes.append(f"The job is {rep.state}: figures are what was measured so far.")
    if rep.truncated:
        notes.append("The accounting record was shortened to fit AdminComment; "
                     "older details are missing.")
    return notes


def _attempt_notes(rep: JobReport, a: AttemptView) -> list[str]:
    where = placement.attempt_note(rep, a)
    notes = [where] if where else []
    if a.oom:
        ev = (f"; log kept in {a.oom.get('evidence_where') or a.oom['evidence']}"
              if a.oom.get("evidence") else "")
        where = ("on a whole GPU" if a.oom.get("whole_gpu") else
                 "under its MPS limit" if a.oom["cause"] == "gpu-oom" else
                 "on a shared GPU (MPS)")
        notes.append(f"Attempt {a.attempt} died of {a.oom['cause']} {where}"
                     f" ({a.oom.get('pattern') or 'pattern unknown'}){ev}.")
    if a.requeue and a.requeue.get("requeued"):
        notes.append(f"It was requeued with {a.requeue.get('new_request')} "
                     f"({gib(a.requeue.get('new_limit_mib'))}): {a.requeue.get('reason')}.")
    if a.co_tenants:
        notes.append(f"Attempt {a.attempt} shared GPU {a.gpu} with job(s) "
                     f"{', '.join(a.co_tenants)}.")
    if a.unenforced:
        notes.append(_unenforced_note(a))
    if a.samples == 0 and not rep.running:
        notes.append(f"Attempt {a.attempt}: no GPU samples (sidecar not running, or the "
                     "job did not use the GPU).")
    elif a.sm_source == "utilization":
        notes.append(f"Attempt {a.attempt}: SM activity not measured (no DCGM); "
                     "GPU utilization shown instead, which overstates real use.")
    return notes


def _unenforced_note(a: AttemptView) -> str:
    """When the attempt ran with no collector on its node (no limit enforced)."""
    import time

    from slurm_colloc.report.fmt import hms

    spans = a.unenforced or []
    total = sum(b - f for f, b in spans)
    first = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(spans[0][0]))
    more = f" in {len(spans)} spans" if len(spans) > 1 else ""
    return (f"Attempt {a.attempt} ran {hms(total)} without the node's collector{more}, "
            f"from {first}: GPU memory limits were not enforced and nothing was sampled "
            "then (the collector had died or stopped; see `colloc doctor` on the node).")


def _fatal_cuda(rep: JobReport, notes: list[str], advice: list[str]) -> None:
    fatal = [a for a in rep.attempts if a.oom and a.oom["cause"] == "cuda-fatal"]
    if not fatal or rep.running:
        return
    if rep.state == "COMPLETED":
        notes.append("The fatal CUDA error did not recur on a GPU of its own: it was most "
                     "likely a co-tenant's fault, which MPS reports to every client.")
    elif fatal[-1] is rep.attempts[-1] and fatal[-1].oom and fatal[-1].oom.get("whole_gpu"):
        advice.append("The job hit a fatal CUDA error on a GPU of its own too, so the "
                      "fault is in the job (or its GPU): rerun with "
                      "CUDA_LAUNCH_BLOCKING=1 to see the failing kernel; a device-side "
                      "assert usually means an out-of-range index (class labels, "
                      "embedding ids).")


def _advice(rep: JobReport, f: AttemptView, est: int | None) -> list[str]:
    """Recommendations from the measured symptoms of the last measured attempt."""
    assert f.peak_mib is not None
    advice = []
    first = rep.attempts[0] if rep.attempts else None
    learned = (rep.submitted or {}).get("fingerprint")
    partial = collector_stopped(f.sampling)  # the peak may have been higher
    if (first is not None and first.oom and first.oom["cause"] == "gpu-oom" and not rep.running
            and cause_advice.cause(first) != CO_TENANT and not cause_advice.oom_sized(rep)):
        need = math.ceil(f.peak_mib * (1 + MARGIN) / 1024)
        advice.append(f"The first estimate ({gib(first.estimate_mib or est)}) was too low: "
                      f"this job peaked at {'at least ' if partial else ''}"
                      f"{gib(f.peak_mib)}. Next time submit with "
                      f"--colloc-mem={need}G (peak + 10%) to share a GPU without a crash"
                      + ("; a --colloc=SUMMARY rerun (this or another batch size) is now "
                         "sized from this measured peak automatically." if learned else "."))
    advice += _usage_advice(rep, f)
    if (f.limit_mib and rep.shard_mib and not f.oom and not (first and first.oom)
            and not partial):
        need_shards = math.ceil(f.peak_mib * (1 + MARGIN) / rep.shard_mib)
        have = f.shards or f.limit_mib // rep.shard_mib
        if have - need_shards >= 2:
            advice.append(f"This job used at most {gib(f.peak_mib)} of its {gib(f.limit_mib)} "
                          f"share: {need_shards} shards instead of {have} would do "
                          f"(--colloc-mem={math.ceil(need_shards * rep.shard_mib / 1024)}G), "
                          "so it starts sooner and leaves room for others."
                          + (" A --colloc=SUMMARY rerun of this model (this or another batch "
                             "size) is sized from this measured peak automatically."
                             if learned else ""))
    return advice


def _usage_advice(rep: JobReport, f: AttemptView) -> list[str]:
    """Batch too small, memory-bound, or idle phases."""
    assert f.peak_mib is not None
    advice = []
    cap = f.limit_mib or rep.gpu_memory_mib
    sm = f.sm_activity
    if cap and sm is not None:
        frac = f.peak_mib / cap
        if sm < 0.5 and frac < 0.5:
            advice.append(f"Both SM activity ({sm:.0%}) and peak memory ({frac:.0%} of "
                          f"{gib(cap)}) stayed under half: the batch is probably too small. "
                          "Try a larger batch size (e.g. 2x), or run more work per GPU.")
        elif frac >= 0.9 and sm < 0.4:
            advice.append(f"Memory was nearly full ({frac:.0%} of {gib(cap)}) while SM "
                          f"activity was low ({sm:.0%}): memory-bound. Mixed precision "
                          "(--colloc-precision=amp-bf16) or activation checkpointing frees "
                          "memory for a larger batch.")
    if f.idle_fraction is not None and f.idle_fraction >= 0.2:
        advice.append(f"The GPU was idle in {f.idle_fraction:.0%} of the samples while the "
                      "job held its memory: data loading or checkpointing stalls. Use more "
                      "DataLoader workers with pin_memory, prefetch, and write checkpoints "
                      "asynchronously.")
    return advice
