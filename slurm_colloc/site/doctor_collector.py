"""``colloc doctor`` on a GPU node: is the collector (limits enforcement) alive?

The collector is the only thing that stops a job outside MPS or over its allocation
(docs/security.md, "Collector: what keeps enforcement on"). It is started by the
prolog and restarted by its supervisor; this check reads what they leave in
``metrics_dir`` (:mod:`slurm_colloc.metrics.liveness`): the root-only lock directory,
the heartbeat of the last completed sample, and the events file of starts, deaths,
stalls and clean stops. With ``collector_unit`` set, :func:`check_collector_unit` asks
systemd whether the unit is installed, enabled and running.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from slurm_colloc.config import CollocConfig
from slurm_colloc.metrics import liveness
from slurm_colloc.node import collector_start
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


Query = Callable[[Sequence[str]], tuple[int, str]]


def _query(argv: Sequence[str]) -> tuple[int, str]:
    """(exit status, first line of stdout) of a ``systemctl is-*`` question."""
    import subprocess

    try:
        r = subprocess.run(list(argv), stdin=subprocess.DEVNULL, capture_output=True,
                           timeout=10, check=False, env={"PATH": "/usr/bin:/bin", "LANG": "C"})
    except (OSError, subprocess.TimeoutExpired) as e:
        return 127, str(e)
    out = r.stdout.decode("utf-8", "replace").strip().splitlines()
    return r.returncode, out[0] if out else ""


ENABLED = ("enabled", "enabled-runtime", "static", "indirect", "alias", "linked")


def check_collector_unit(cfg: CollocConfig, *, systemctl: str | None = None,
                         query: Query = _query) -> list[Finding]:
    """With ``collector_unit`` set: the unit installed, enabled (starts at boot), active.

    ``systemctl`` (default: :func:`~slurm_colloc.node.collector_start.find_systemctl`)
    and ``query`` are parameters for tests. Nothing when no unit is configured.
    """
    unit = cfg.collector_unit
    if not unit:
        return []
    what = f"collector unit {unit}"
    ctl = systemctl if systemctl is not None else collector_start.find_systemctl()
    if ctl is None:
        return [Finding("warn", what, "this host does not run systemd: prologs start the "
                        "collector detached (the fallback), and nothing restarts it if its "
                        "supervisor dies")]
    rc_en, enabled = query([ctl, "is-enabled", "--", unit])
    if enabled not in ENABLED and enabled != "disabled":
        return [Finding("fail", what, f"not installed ({enabled or f'exit {rc_en}'}): run "
                        "`colloc admin collector-unit --install`, then `systemctl "
                        f"daemon-reload && systemctl enable --now {unit}`; until then "
                        "every prolog falls back to a detached start")]
    _, active = query([ctl, "is-active", "--", unit])
    if active == "failed":
        return [Finding("fail", what, f"failed (systemd gave up restarting it): "
                        f"`journalctl -u {unit}` says why; `systemctl reset-failed {unit}` "
                        "and the next prolog starts it again")]
    if enabled == "disabled":
        return [Finding("warn", what, f"installed but not enabled ({active or 'inactive'}): "
                        f"it does not start at boot; `systemctl enable --now {unit}`")]
    if active in ("active", "activating", "reloading"):
        return [Finding("ok", what, f"{enabled}, {active}")]
    return [Finding("warn", what, f"{enabled} but {active or 'inactive'}: the next GPU "
                    f"job's prolog starts it; `systemctl start {unit}` to start it now")]
