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

from slurm_colloc.accounting.codec import try_decode
from slurm_colloc.accounting.submit_record import parse_record
from slurm_colloc.slurm.adapter import AccountingRecord, SlurmAdapter, by_start

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
    )


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
