"""What a job's accounting lines say about its GPU use: the records, and GPU-hours
used and saved per attempt. Shared by the period summary (:mod:`.admin`) and the
job table (:mod:`.jobs`) so both count the same way."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from slurm_colloc.accounting.codec import try_decode
from slurm_colloc.accounting.record import Attempt, JobRecord
from slurm_colloc.accounting.submit_record import CollocRecord, parse_record
from slurm_colloc.config import RecordField
from slurm_colloc.oom.patterns import GPU_CRASH_CAUSES
from slurm_colloc.report.inquirer import JobRow


def job_records(lines: Sequence[JobRow], prefer: RecordField = "admin_comment",
                ) -> tuple[JobRecord | None, CollocRecord | None]:
    """The accounting record (the last readable one; in ``record_field`` or, failing
    that, the other comment field) and job_submit's record (AdminComment)."""
    rec: JobRecord | None = None
    sub: CollocRecord | None = None
    for ln in lines:
        found = (try_decode(t) for t in ln.record_texts(prefer))
        rec = next((r for r in found if r is not None), None) or rec
        sub = sub or parse_record(ln.admin_comment)
    return rec, sub


@dataclass
class Usage:
    """GPU-hours held (shards as a fraction of a GPU), saved against whole GPUs."""

    gpu_hours: float = 0.0
    gpu_hours_saved: float = 0.0
    gpu_crashes: int = 0
    shared: bool = False
    """Some attempt held less than a whole GPU."""


def attempt_usage(lines: Sequence[JobRow], attempts: Sequence[Attempt], spg: int) -> Usage:
    """Sum over the attempts; an attempt's time is its accounting line's elapsed when
    the lines match the attempts one to one, else its recorded start and end."""
    u = Usage()
    for i, a in enumerate(attempts):
        el = lines[i].elapsed_s if len(lines) == len(attempts) else None
        if el is None and a.start and a.end:
            el = a.end - a.start
        hours = max(0, el or 0) / 3600
        shards = a.shards or spg
        u.gpu_hours += hours * min(1.0, shards / spg)
        if shards < spg:
            u.shared = True
            u.gpu_hours_saved += hours * (1 - shards / spg)
        if a.oom and a.oom.cause in GPU_CRASH_CAUSES:
            u.gpu_crashes += 1
    return u
