"""Starting a collector detached, and an orphaned worker's hand-over (issue 28).

The prolog starts the collector (its supervisor, :mod:`.supervisor`) with
:func:`spawn_collector` when none holds the lock. The supervisor runs the sampling
worker as its child. If the supervisor is SIGKILLed, the lock goes with it and the
worker, reparented, would otherwise just exit: nothing would sample or enforce until
the next GPU job's prolog. Instead the orphaned worker records the hand-over (root's
log, the public events file: the short gap stays visible to ``colloc doctor`` and the
report) and starts a new supervisor the same detached way, then exits. The new
supervisor takes the lock or, when another collector (a prolog's) already holds it,
exits at once: one collector wins, and the old worker never samples next to the new
one (it has stopped sampling before it starts its successor).

No respawn where the stop was meant (idle exit, ``--seconds``, SIGTERM: those never
reach here) or where systemd runs the collector (``INVOCATION_ID`` in the worker's
environment): systemd cleans the unit's processes up and restarts it
(``Restart=always``), and a detached start inside the unit would race with that.

The decision (:func:`respawn_decision`) and the new supervisor's arguments
(:func:`supervisor_args`) are pure functions, so unit tests drive them without
processes; :func:`hand_over` does the logging and the start (its ``spawn`` a parameter).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence

from slurm_colloc.detach import spawn_module
from slurm_colloc.metrics import liveness

log = logging.getLogger("colloc.metrics.spawn")

MODULE = "slurm_colloc.metrics.collector"
PATH = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
KEPT_ENV = ("COLLOC_CONF", "SLURM_CONF", "SLURMD_NODENAME")
"""All a detached collector gets of its starter's environment (plus a fixed PATH);
``SLURMD_NODENAME`` is slurmd's name for this node (the stuck-prolog check asks Slurm
about it, :mod:`slurm_colloc.node.stuck_prologs`)."""
MIN_SECONDS_LEFT = 1.0
"""An orphan with less than this of its ``--seconds`` left does not hand over."""


def collector_env(env: Mapping[str, str]) -> dict[str, str]:
    """The detached collector's environment: a fixed PATH and colloc's/Slurm's conf."""
    out = {"PATH": PATH}
    out.update({k: env[k] for k in KEPT_ENV if k in env})
    return out


def spawn_collector(env: Mapping[str, str], args: Sequence[str] = ()) -> None:
    """Start ``python -I -m slurm_colloc.metrics.collector *args`` fully detached (own
    session: neither slurmd nor an exiting worker waits for it or takes it along)."""
    spawn_module(MODULE, tuple(args), collector_env(env))


def under_systemd(env: Mapping[str, str]) -> bool:
    """True when systemd runs this collector (it sets ``INVOCATION_ID`` for a unit's
    processes; a prolog's detached start passes only :data:`KEPT_ENV` on)."""
    return bool(env.get("INVOCATION_ID"))


def respawn_decision(*, parent: int | None, ppid: int, stopping: bool,
                     env: Mapping[str, str], seconds_left: float | None = None) -> str:
    """What a worker does about its supervisor, checked before each step.

    ``"run"``: its supervisor lives (or it has none: ``--no-supervisor``), or it is
    stopping anyway (SIGTERM: a meant stop is never turned into a respawn).
    ``"exit"``: orphaned, but someone else restarts it (systemd) or its ``--seconds``
    are up. ``"respawn"``: orphaned, start a new supervisor, then exit.
    """
    if parent is None or ppid == parent or stopping:
        return "run"
    if under_systemd(env):
        return "exit"
    if seconds_left is not None and seconds_left < MIN_SECONDS_LEFT:
        return "exit"
    return "respawn"


def supervisor_args(*, conf: str | None, stay: bool,
                    seconds_left: float | None) -> list[str]:
    """The new supervisor's flags: the old one's (``--conf``, ``--stay``) and what is
    left of ``--seconds`` (a benchmark's bound stays a bound)."""
    args = ["--conf", conf] if conf else []
    args += ["--stay"] if stay else []
    if seconds_left is not None:
        args += ["--seconds", f"{max(seconds_left, MIN_SECONDS_LEFT):.1f}"]
    return args


def hand_over(metrics_dir: str, parent: int, args: Sequence[str], *,
              env: Mapping[str, str] | None = None,
              spawn: Callable[[Mapping[str, str], Sequence[str]], None] = spawn_collector,
              ) -> bool:
    """The orphaned worker's last act: say so, start a new supervisor; True if started.

    The event is ``down`` (the old pair's end, at the moment its worker stopped
    sampling); the new supervisor writes ``up`` when its worker starts, so the events
    file shows the gap as it was. A failed start is logged: the next GPU job's prolog
    is then the fallback, as before.
    """
    me = os.getpid()
    detail = f"supervisor {parent} gone (killed?): worker {me} starts a new one"
    log.error("%s; no enforcement until it samples", detail)
    try:
        liveness.append_event(metrics_dir, liveness.DOWN, me, detail)
    except OSError as e:
        log.warning("collector events file: %s", e)
    try:
        spawn(os.environ if env is None else env, args)
    except OSError as e:
        log.error("cannot start a new collector: %s (the next GPU job's prolog will)", e)
        return False
    log.info("new collector supervisor started")
    return True
