"""The report's "sampling:" line: how much of an attempt went unsampled, and why.

One wording for the text and HTML reports, from :attr:`AttemptView.sampling`
(:mod:`slurm_colloc.metrics.gaps` finds the holes; the epilog keeps them in the
record). A stretch with the collector stopped is the one that matters: nothing was
sampled and no GPU memory limit was enforced then.
"""

from __future__ import annotations

import time
from typing import Any

MAX_LISTED = 4
CAUSE_WORDS = {"collector": "collector stopped", "job": "no process of the job on its GPU"}


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def sampling_line(sampling: dict[str, Any] | None) -> str | None:
    """``sampling: 81 s of 120 s unsampled (collector stopped 12:01:05-12:02:26)``;
    None when the attempt's sampling had no gap (or is not known)."""
    if not sampling or not sampling.get("gaps"):
        return None
    gaps = sampling["gaps"]
    spans = [f"{CAUSE_WORDS.get(g['cause'], g['cause'])} {_clock(g['from'])}-{_clock(g['to'])}"
             for g in gaps[:MAX_LISTED]]
    if len(gaps) > MAX_LISTED:
        spans.append(f"{len(gaps) - MAX_LISTED} more")
    return (f"sampling: {sampling['unsampled_s']} s of {sampling['span_s']} s unsampled "
            f"({'; '.join(spans)})")


def collector_stopped(sampling: dict[str, Any] | None) -> bool:
    """Some of the attempt ran with no collector (nothing enforced then)."""
    return any(g["cause"] == "collector" for g in (sampling or {}).get("gaps") or [])
