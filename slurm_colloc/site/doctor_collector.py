"""``colloc doctor`` on a GPU node: is the collector (limits enforcement) alive?

The collector is the only thing that stops a job outside MPS or over its allocation
(docs/security.md, "Collector: what keeps enforcement on"). It is started by the
prolog and restarted by its supervisor; this check reads what they leave in
``metrics_dir`` (:mod:`slurm_colloc.metrics.liveness`): the root-only lock directory,
the heartbeat of the last completed sample, and the events file of starts, deaths,
stalls and clean stops.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from slurm_colloc.config import CollocConfig
from slurm_colloc.metrics import liveness
from slurm_colloc.site.finding import Finding

WHAT = "collector"
RECENT_S = 86400.0
"""Deaths and stalls this recent are reported."""


def check_collector(cfg: CollocConfig, now: float | None = None) -> list[Finding]:
    """Lock directory root's, collector sampling (or cleanly stopped), no recent crashes."""
    now = time.time() if now is None else now
    metrics = Path(cfg.metrics_dir)
    private = metrics / liveness.PRIVATE_DIR
    if os.path.lexists(private):
        try:
            os.close(liveness.open_private_dir(metrics))
        except OSError as e:
            return [Finding("fail", WHAT, f"{private}: {e}: a user could hold the lock and "
                            f"keep the collector out; remove it (the collector recreates it)")]
    events = liveness.read_events(metrics)
    last = events[-1] if events else None
    recent = [e for e in events if e.kind in (liveness.DOWN, liveness.STALLED)
              and now - e.t <= RECENT_S]
    out: list[Finding] = []
    if liveness.collector_running(metrics):
        sup, worker = liveness.read_pids(metrics)
        age = liveness.heartbeat_age(metrics, now)
        stall = max(60.0, 30 * cfg.sample_interval_s)
        if age is None or age > stall:
            since = "never" if age is None else f"{age:.0f}s ago"
            out.append(Finding("fail", WHAT, f"running (supervisor {sup}) but its last "
                               f"completed sample was {since}: nothing is enforced; see "
                               f"{cfg.log_file}"))
        else:
            out.append(Finding("ok", WHAT, f"running (supervisor {sup}, worker {worker}), "
                               f"last sample {age:.0f}s ago"))
    elif last is not None and last.kind != liveness.STOP:
        out.append(Finding("fail", WHAT, f"not running, and it did not stop cleanly (last "
                           f"event: {last.kind} at {_when(last.t)}): jobs on this node run "
                           "unenforced until the next GPU job's prolog starts it; see "
                           f"{cfg.log_file}"))
    else:
        out.append(Finding("ok", WHAT, "not running (no GPU job; the next GPU job's prolog "
                           "starts it)"))
    if recent:
        ev = recent[-1]
        out.append(Finding("warn", WHAT, f"{len(recent)} crash(es)/stall(s) in the last "
                           f"24 h, last at {_when(ev.t)}: {ev.kind} "
                           f"({ev.detail or 'no detail'}); "
                           f"it was restarted each time; tracebacks in {cfg.log_file}"))
    return out


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
