"""Expected SM activity per (uid, model fingerprint): the compute side of admission.

Why: shards are memory, and memory alone let Slurm put seven jobs on one GPU whose
summed SM activity (DCGM SMACT) was 150-330 % of what the GPU can serve (issue 25).
With ``sm_capacity_pct`` set, job_submit.lua gives a ``--colloc`` job at least its
expected share of the GPU's compute in shards, so Slurm, still the only scheduler,
never promises a GPU more compute than that capacity. The expectation comes from the
user's own measured runs of the same model, which is what this module builds.

The table is made by root (``colloc admin compute-history --write``, run by a timer)
from every user's completed jobs in Slurm's accounting: the epilog's ``cl1`` record of
each attempt carries the estimate's fingerprint and the collector's mean SM activity.
It is written atomically as a small root-owned text file that job_submit.lua, inside
slurmctld, can read without a JSON parser::

    # colloc compute-history v1 ...
    <uid> <fingerprint> <sm_pct>

Trust: the fingerprint comes from the job's own ``--colloc`` options, so a key is
only ever used for the uid Slurm reports the job under: a user can change the figure
of their own jobs only, never another user's. The SM figure is the root collector's
measurement. Only complete attempts count (succeeded, not OOM-killed nor requeued,
sampled without a collector gap: :mod:`.history_runs`); the figure is the largest of
the key's newest :data:`RUNS_KEPT` runs, so one light run does not undo heavier
recent ones. Keyed by model, not batch size
(job_submit sees only the fingerprint): the largest over batch sizes is kept, the
safe side. Without DCGM the collector's figure is NVML utilisation, which is at
least the SM activity: again the safe side.
"""

from __future__ import annotations

import math
import os
import pwd
import stat
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from slurm_colloc.accounting.field import record_in
from slurm_colloc.accounting.history import attempt_peak, valid_fingerprint
from slurm_colloc.accounting.record import Attempt
from slurm_colloc.config import RecordField

if TYPE_CHECKING:
    from slurm_colloc.slurm.records import AccountingRecord

HEADER = "# colloc compute-history v1: <uid> <fingerprint> <expected SM activity %>"
RUNS_KEPT = 5
"""Newest measured runs of one (uid, fingerprint) the figure is taken from."""
MAX_ENTRIES = 200_000
"""Lines job_submit.lua reads at most (it stops there); the writer keeps the newest."""

Key = tuple[int, str]
"""(uid, model fingerprint)."""


class ComputeHistoryError(RuntimeError):
    """The table cannot be written safely where the configuration says."""


@dataclass(frozen=True)
class Measured:
    """One complete attempt's SM activity, with the job it came from (for ordering)."""

    job: int
    sm_pct: float


def attempt_sm_pct(a: Attempt) -> float | None:
    """Mean SM activity (%) of an attempt that ran to completion, else None."""
    if attempt_peak(a) is None or a.metrics is None:
        return None
    v = a.metrics.mean_sm_activity
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0.0 <= v <= 1.0:
        return None
    return 100.0 * float(v)


def measurements(
    rows: Iterable[AccountingRecord], uid_of: Callable[[str], int | None],
    prefer: RecordField = "admin_comment",
) -> dict[Key, list[Measured]]:
    """Complete attempts per (uid, fingerprint) from COMPLETED jobs' records (pure).

    ``uid_of`` maps Slurm's user name to a uid; a job without one is skipped (its
    figure could not be matched to the submitting uid job_submit sees).
    """
    latest: dict[str, AccountingRecord] = {}
    for r in rows:
        if r.job_id.isdigit() and r.state.split()[:1] == ["COMPLETED"]:
            latest[r.job_id] = r  # a requeued job's COMPLETED row holds every attempt
    out: dict[Key, list[Measured]] = {}
    for jid, r in latest.items():
        user = r.fields.get("User") or ""
        uid = uid_of(user) if user else None
        rec = record_in(r.fields, prefer)  # either field (record_field)
        if uid is None or rec is None:
            continue
        for a in rec.attempts:
            fp = valid_fingerprint(a.estimate.fingerprint) if a.estimate else None
            sm = attempt_sm_pct(a)
            if fp is not None and sm is not None:
                out.setdefault((uid, fp), []).append(Measured(int(jid), sm))
    return out


def expected_sm(runs: list[Measured]) -> int:
    """The figure kept for a key: the largest of the newest :data:`RUNS_KEPT` runs, 1..100."""
    newest = sorted(runs, key=lambda m: m.job, reverse=True)[:RUNS_KEPT]
    return max(1, min(100, math.ceil(max(m.sm_pct for m in newest) - 1e-9)))


def build_table(per_key: dict[Key, list[Measured]]) -> dict[Key, int]:
    """Expected SM % per key; the :data:`MAX_ENTRIES` most recently run keys."""
    keys = sorted(per_key, key=lambda k: max(m.job for m in per_key[k]), reverse=True)
    return {k: expected_sm(per_key[k]) for k in keys[:MAX_ENTRIES] if per_key[k]}


def render(table: dict[Key, int]) -> str:
    """The file's text: a header, then ``uid fingerprint sm_pct`` lines, sorted."""
    lines = [HEADER] + [f"{uid} {fp} {sm}" for (uid, fp), sm in sorted(table.items())]
    return "\n".join(lines) + "\n"


def parse(text: str) -> dict[Key, int]:
    """Read a table back (what job_submit.lua accepts: bad lines are skipped)."""
    out: dict[Key, int] = {}
    for line in text.splitlines()[: MAX_ENTRIES + 1]:
        parts = line.split(" ")
        if len(parts) != 3 or not parts[0].isdigit() or not parts[2].isdigit():
            continue
        fp = valid_fingerprint(parts[1])
        sm = int(parts[2])
        if fp is not None and fp == parts[1] and 1 <= sm <= 100:
            out[(int(parts[0]), fp)] = sm
    return out


def _check_parent(parent: Path) -> None:
    """Root writes here: the directory must be root's and writable by root alone."""
    try:
        st = os.lstat(parent)
    except OSError as e:
        raise ComputeHistoryError(f"{parent}: {e.strerror}: create it (root, 0755)") from e
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise ComputeHistoryError(
            f"{parent}: must be a directory owned by uid {os.geteuid()} and writable by "
            "it alone (a user who can write there could plant the table slurmctld reads)")


def write(path: Path, table: dict[Key, int]) -> None:
    """Replace ``path`` atomically with the table (0644: slurmctld's user reads it)."""
    _check_parent(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=".compute-history.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            os.fchmod(f.fileno(), 0o644)
            f.write(render(table))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def uid_by_name(name: str) -> int | None:
    """The uid of a user name (None when the host does not know it)."""
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        return None
