"""What happened to each job, read back from Slurm's accounting and colloc's records.

Nothing here comes from the replayer's own bookkeeping: times and states are
``sacct`` rows (one per attempt with ``--duplicates``), GPU shares come from
job_submit's ``colloc1:`` record, OOMs and requeues from the epilog's ``cl1:`` record
in AdminComment. Plain-Slurm policies have no colloc records: there an OOM is a
failed attempt whose output (opened in append mode, so requeues keep it) carries
PyTorch's out-of-memory error.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Protocol

from slurm_colloc.accounting.codec import try_decode
from slurm_colloc.accounting.submit_record import parse_record
from slurm_colloc.slurm.adapter import AccountingRecord, SlurmAdapter, by_start


class ProcRecordLike(Protocol):
    """What :class:`GpuLedger` reads of a sim process record (``gpu.sim.state.ProcRecord``)."""

    @property
    def gpu(self) -> int: ...
    @property
    def job_id(self) -> str: ...
    @property
    def started(self) -> float: ...


OOM_TEXT = "torch.OutOfMemoryError"
_GRES = re.compile(r"gres/(gpu|shard)=(\d+)")


@dataclass(frozen=True)
class JobOutcome:
    """One trace job under one policy, as accounting tells it."""

    name: str
    job_id: int
    state: str
    """Final state of the last attempt (COMPLETED = the work was done)."""
    attempts: int
    submit: float
    start: float | None
    """Start of the first attempt (Unix time)."""
    end: float | None
    """End of the last attempt."""
    oom_crashes: int
    requeues: int
    gres: str
    """GPU request of the first attempt (``gpu=1`` or ``shard=K``)."""
    need_mib: int | None
    """What job_submit reserved the job for (colloc1 record), if it ran through it."""
    mode: str
    first_on_gpu: float | None = None
    """Wall time the job's first process registered on a GPU (:class:`GpuLedger`);
    None where the replay did not keep a ledger (results before issue 24)."""
    recovery_wait: float | None = None
    """Wall seconds from the end of the attempt before the last to the start of the
    last: how long a requeued job waited for its rerun (issue 25 item 4); None for a
    job with one attempt."""

    @property
    def lost(self) -> bool:
        """The work never completed."""
        return self.state != "COMPLETED"


def _epoch(text: str) -> float | None:
    if not text or text in ("Unknown", "None"):
        return None
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def _signaled(exit_code: str) -> bool:
    """``N:S`` with a signal: killed (cancel, time limit), not a Python exception.

    Only the signal part is trusted: Slurm 22.05's ``sacct --json`` reports every
    normal exit as return code 0 (see :mod:`slurm_colloc.slurm.sacct_json`), so a
    failed attempt's ``0:0`` means "exited, code unknown".
    """
    _, _, sig = exit_code.partition(":")
    return sig.isdigit() and int(sig) != 0


def _gres(tres: str) -> str:
    m = _GRES.search(tres)
    return f"{m.group(1)}={m.group(2)}" if m else ""


def outcome(
    name: str, job_id: int, rows: Sequence[AccountingRecord], output: str | None,
) -> JobOutcome:
    """Fold a job's sacct rows (oldest first) and output into one outcome."""
    if not rows:
        return JobOutcome(name, job_id, "MISSING", 0, 0.0, None, None, 0, 0, "", None, "")
    rows = by_start(rows)
    first, last = rows[0], rows[-1]
    comment = next((r.fields.get("AdminComment", "") for r in reversed(rows)
                    if r.fields.get("AdminComment")), "")
    sub = parse_record(comment)
    rec = try_decode(comment)
    if rec is not None:
        ooms = sum(1 for a in rec.attempts if a.oom is not None and a.oom.cause == "gpu-oom")
        requeues = sum(1 for a in rec.attempts if a.requeue is not None and a.requeue.requeued)
    else:
        failed = sum(1 for r in rows if r.state.split()[0] in ("FAILED", "REQUEUED")
                     and not _signaled(r.exit_code))
        ooms = min(failed, output.count(OOM_TEXT)) if output is not None else failed
        requeues = max(0, len(rows) - 1)
    submits = [t for t in (_epoch(r.fields.get("Submit", "")) for r in rows) if t is not None]
    return JobOutcome(
        name=name, job_id=job_id, state=last.state.split()[0], attempts=len(rows),
        submit=min(submits) if submits else 0.0, start=_epoch(first.fields.get("Start", "")),
        end=_epoch(last.fields.get("End", "")), oom_crashes=ooms, requeues=requeues,
        gres=_gres(first.fields.get("AllocTRES", "") or first.fields.get("ReqTRES", "")),
        need_mib=sub.need_mib if sub else None, mode=sub.mode if sub else "",
        recovery_wait=_recovery_wait(rows),
    )


def _recovery_wait(rows: Sequence[AccountingRecord]) -> float | None:
    """Seconds between the last two attempts (rows oldest first); None if unknown."""
    if len(rows) < 2:
        return None
    ended = _epoch(rows[-2].fields.get("End", ""))
    started = _epoch(rows[-1].fields.get("Start", ""))
    return max(0.0, started - ended) if ended is not None and started is not None else None


def collect(
    slurm: SlurmAdapter, jobs: Mapping[str, int], outputs: Mapping[str, Path],
) -> list[JobOutcome]:
    """Outcomes of all ``jobs`` (trace name -> Slurm job id), one sacct call."""
    rows: dict[str, list[AccountingRecord]] = {}
    ids = list(jobs.values())
    for i in range(0, len(ids), 200):
        for r in slurm.accounting(ids[i:i + 200]):
            rows.setdefault(r.job_id, []).append(r)
    out = []
    for name, jid in jobs.items():
        path = outputs.get(name)
        text = path.read_text(errors="replace") if path is not None and path.exists() else None
        job_rows = sorted(rows.get(str(jid), []), key=lambda r: r.fields.get("Start", ""))
        out.append(outcome(name, jid, job_rows, text))
    return out


@dataclass(frozen=True)
class GpuSeen:
    """When one Slurm job was on the simulated GPUs, from the sim's own process records."""

    job_id: str
    gpus: frozenset[int]
    first: float
    """Earliest ``started`` of its records: when its process registered on a GPU."""
    last: float
    """Wall time of the last observation that still listed it."""


class GpuLedger:
    """First and last time each job had a process on a GPU, by Slurm job id.

    Why: the per-GPU samples say how many processes a GPU has, not whose, so a job's
    start lag (Slurm start -> first process) could only be inferred from memory steps
    (:mod:`slurm_colloc.bench.lag`), with 1 s samples that are 2 trace minutes at x120.
    The sim's records carry the job id and the wall time the process registered: one
    observation while the job lives gives its start to the millisecond. Observe from
    the sampler's loop (``ledger.observe(read_records(state_dir), time.time())``).
    """

    def __init__(self) -> None:
        """An empty ledger."""
        self.seen: dict[str, GpuSeen] = {}

    def observe(self, records: Sequence[ProcRecordLike], now: float,
                gpu_offset: int = 0) -> None:
        """Fold one snapshot of live records (every GPU of one host) into the ledger;
        ``gpu_offset`` numbers that host's GPUs after the previous hosts' ones."""
        for r in records:
            if not r.job_id:
                continue
            old = self.seen.get(r.job_id)
            started = r.started or now
            gpu = gpu_offset + r.gpu
            if old is None:
                self.seen[r.job_id] = GpuSeen(r.job_id, frozenset({gpu}), started, now)
            else:
                self.seen[r.job_id] = GpuSeen(r.job_id, old.gpus | {gpu},
                                              min(old.first, started), max(old.last, now))

    def first_on_gpu(self, job_id: int | str) -> float | None:
        """When the job's first process registered on a GPU (None: never seen)."""
        seen = self.seen.get(str(job_id))
        return seen.first if seen is not None else None


def with_ledger(outcomes: Sequence[JobOutcome], ledger: GpuLedger) -> list[JobOutcome]:
    """The outcomes with :attr:`JobOutcome.first_on_gpu` filled from ``ledger``.

    A requeued job's records of every attempt share its id: the earliest is its
    first attempt's, the one :attr:`JobOutcome.start` is about.
    """
    from dataclasses import replace

    return [replace(o, first_on_gpu=ledger.first_on_gpu(o.job_id)) for o in outcomes]


def records_settled(slurm: SlurmAdapter, jobs: Mapping[str, int]) -> bool:
    """Every colloc job's final attempt has its ``cl1`` record in accounting.

    The epilog writes it through a detached sacctmgr after the job ended, so
    collection waits for it instead of reading a half-written history.
    """
    ids = list(jobs.values())
    rows = slurm.accounting(ids) if ids else []
    last: dict[str, AccountingRecord] = {}
    for r in rows:
        last[r.job_id] = r
    for r in last.values():
        comment = r.fields.get("AdminComment", "")
        if parse_record(comment) is not None and try_decode(comment) is None:
            return False
    return len(last) == len(ids)
