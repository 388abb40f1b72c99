"""The report's "next estimate for this model" line: which runs it comes from.

Why (issue 27): a report that files a partial peak in the user's history, silently,
let the next run be sized too small. The report now says what the next ``sbatch
--colloc`` of the same model (same batch size, sequence length, optimizer and
precision) will be sized from: the user's complete runs, and the runs set aside and
why (sampling gaps, killed, OOM), with the same classification the estimator uses
(:mod:`slurm_colloc.accounting.history_runs`), over the same accounting history
(the job owner's ended jobs of the last ``history_days`` days).

Never fatal: without a model key in the job's record, or when Slurm's accounting
cannot be asked, there is no line (None).
"""

from __future__ import annotations

from typing import Any

from slurm_colloc.accounting.codec import try_decode
from slurm_colloc.accounting.history import user_jobs
from slurm_colloc.accounting.history_runs import Key, attempt_key, provenance, runs_of
from slurm_colloc.accounting.record import JobRecord
from slurm_colloc.config import CollocConfig
from slurm_colloc.report.inquirer import Inquirer


def job_key(job_id: str, inquirer: Inquirer, cfg: CollocConfig) -> Key | None:
    """The history key of the job's newest attempt that has one (None: no model)."""
    record: JobRecord | None = None
    for row in inquirer.job_rows(job_id):
        for text in row.record_texts(cfg.record_field):
            r = try_decode(text)
            if r is not None and (record is None or len(r.attempts) >= len(record.attempts)):
                record = r
    keys = [k for a in (record.attempts if record else ()) if (k := attempt_key(a))]
    return keys[-1] if keys else None


def of(job_id: str, user: str, inquirer: Inquirer, cfg: CollocConfig) -> dict[str, Any] | None:
    """The ``next_estimate`` object of the report (see
    :meth:`~slurm_colloc.accounting.history_runs.Provenance.to_json`), or None."""
    key = job_key(job_id, inquirer, cfg)
    if key is None or not user:
        return None
    rows = inquirer.history_rows(user, cfg.history_days)
    if rows is None:
        return None
    fp, batch, seq, optimizer, precision = key
    runs = runs_of(user_jobs(rows, user, prefer=cfg.record_field))
    p = provenance(runs, fp, batch, seq, optimizer, precision)
    if not (p.used or p.bounds or p.ignored):
        return None
    return {**p.to_json(), "fingerprint": fp}
