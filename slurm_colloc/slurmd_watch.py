"""When this host's slurmd (re)started, from /proc: the trigger of the stuck-prolog check.

Issue 28: a job whose prolog a killed slurmd never finished stays ``Reason=Prolog``
for good; :mod:`slurm_colloc.node.stuck_prologs` requeues it. Asking slurmctld on
every collector loop of every node would cost the controller, so the node's collector
(:mod:`slurm_colloc.metrics.collector`, a lower layer than ``node``) calls :func:`kick`
every :data:`LOOK_EVERY_S`: a /proc read, and a detached round of the check (by module
name) only in the minutes after a slurmd of this host started.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Mapping

from slurm_colloc import config as cfgmod
from slurm_colloc import procfs
from slurm_colloc.detach import spawn_module

MODULE = "slurm_colloc.node.stuck_prologs"
LOOK_EVERY_S = 15.0
"""How often the collector looks at slurmd's start times (a /proc read, no Slurm call)."""
ROUND_EVERY_S = 60.0
"""At most one round (two Slurm questions) this often from one collector."""
WINDOW_S = 480.0
"""After the grace, for how long the check keeps running once a minute (a failed
Slurm question or a requeue Slurm refused is asked again within it)."""


def slurmd_starts(proc: str = "/proc") -> list[float]:
    """When each slurmd process on this host started (epoch s; one on a usual node,
    one per node on a test host that runs several).

    Only root's processes count (``/proc/<pid>`` owned by uid 0, real uid 0): a user
    can name a process ``slurmd`` but cannot make it root's, so no user moves these
    times. Only the trigger reads them; :func:`decide` uses Slurm's own start time."""
    btime = _boot_time(proc)
    if btime is None:
        return []
    hz = os.sysconf("SC_CLK_TCK")
    try:
        pids = [e for e in os.listdir(proc) if e.isdigit()]
    except OSError:
        return []
    out = []
    for pid_text in pids:
        comm = procfs.read(f"{proc}/{pid_text}/comm", 64)
        if comm is None or comm.strip() != b"slurmd":
            continue
        pid = int(pid_text)
        try:
            if os.stat(f"{proc}/{pid}").st_uid != 0 or procfs.uid(pid, proc) != 0:
                continue
        except OSError:
            continue
        ticks = procfs.start_ticks(pid, proc)
        if ticks is not None:
            out.append(btime + ticks / hz)
    return sorted(out)


def _boot_time(proc: str) -> float | None:
    for line in (procfs.read(f"{proc}/stat", 1 << 20) or b"").splitlines():
        if line.startswith(b"btime "):
            with contextlib.suppress(ValueError):
                return float(line.split()[1])
    return None


def check_due(starts: Iterable[float], now: float, grace_s: float) -> bool:
    """Whether a round may find something: a slurmd started between ``grace_s`` and
    ``grace_s`` + :data:`WINDOW_S` ago."""
    return any(grace_s <= now - t <= grace_s + WINDOW_S for t in starts)


_last_round = [float("-inf")]
"""When this process last started a round (monotonic s)."""


def kick(cfg: cfgmod.CollocConfig, env: Mapping[str, str], *, now: float | None = None,
         starts: Callable[[], list[float]] = slurmd_starts,
         spawner: Callable[..., None] = spawn_module,
         last: list[float] = _last_round) -> bool:
    """The collector's chore: start one detached round when :func:`check_due` and none
    was started in the last :data:`ROUND_EVERY_S`; True when one was started. No Slurm
    call here."""
    now = time.time() if now is None else now
    mono = time.monotonic()
    if mono - last[0] < ROUND_EVERY_S or not check_due(starts(), now,
                                                        cfg.stuck_prolog_grace_s):
        return False
    last[0] = mono
    spawner(MODULE, (), dict(env))
    return True
