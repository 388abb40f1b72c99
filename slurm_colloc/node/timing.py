"""What one Prolog/Epilog run cost: wall time and CPU, appended to its log line.

Every colloc Prolog and Epilog log line ends in ``[took W s, cpu C s]``: the wall time
from the script's start to its decision, and the CPU seconds it and its children
(squeue, nvidia-smi, nvidia-cuda-mps-control) used, then the named waits that took
longer than :data:`SHOWN_WAIT_S` (the controller, root's locks, the cap commit:
:mod:`slurm_colloc.waits`), so wall time far above CPU says what it waited for.
Slurm runs a node's prologs concurrently and a job does not start until its prolog
ends, so these figures are what a burst costs a job (issue 28: prolog p50/p99 under
a burst and under faults).
The fault-injection benchmark and the burst benchmark read them back with
:func:`parse_timing`; an admin reads them in the log.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field

from slurm_colloc import waits

_SUFFIX = re.compile(r"\[took (\d+(?:\.\d+)?) s, cpu (\d+(?:\.\d+)?) s(?:; [^\]]*)?\]\s*$")
SHOWN_WAIT_S = 0.05
"""Waits shorter than this are left out of the suffix."""


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _now() -> float:
    """``CLOCK_BOOTTIME``: monotonic, and the clock a process's start is counted in."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


@dataclass
class Stopwatch:
    """Started when the script starts; :meth:`suffix` is read when it logs its line."""

    wall0: float = field(default_factory=_now)
    cpu0: float = field(default_factory=_cpu)
    waits0: dict[str, float] = field(default_factory=waits.snapshot)
    not_served: str | None = None
    """Why the node's script server did not run this script (None: it did, or it was
    never asked); the suffix names it, so an admin sees a server that keeps declining."""

    @classmethod
    def since(cls, started: float | None, cpu_before: float = 0.0) -> Stopwatch:
        """From the script's process start (``/proc/self/stat``, on ``CLOCK_BOOTTIME``),
        counting all of this process's CPU plus ``cpu_before`` (a script server's
        client's): the figure slurmd sees, interpreter start-up included, whether the
        script ran in its own process or in a server's worker. Unknown start: now."""
        if started is None:
            return cls()
        return cls(wall0=started, cpu0=-cpu_before)

    def count_start(self) -> None:
        """Name the time from the script's process start to now ``start`` (its
        interpreter and imports, or a script server's hand-over to its worker)."""
        waits.add("start", _now() - self.wall0)

    def suffix(self) -> str:
        """``[took 0.41 s, cpu 0.27 s]``, with the named waits of at least
        :data:`SHOWN_WAIT_S` since the start (:mod:`slurm_colloc.waits`):
        ``[took 9.41 s, cpu 0.03 s; controller 0.40 s, gpu lock 8.70 s]``."""
        wall = _now() - self.wall0
        cpu = _cpu() - self.cpu0
        spent = {k: v - self.waits0.get(k, 0.0) for k, v in waits.snapshot().items()}
        shown = "".join(f", {k} {v:.2f} s" for k, v in spent.items() if v >= SHOWN_WAIT_S)
        if self.not_served:
            why = " ".join(self.not_served.replace("]", ")").split())[:200]
            shown += f", not served: {why}"
        return f"[took {wall:.2f} s, cpu {cpu:.2f} s{'; ' + shown[2:] if shown else ''}]"


def parse_timing(line: str) -> tuple[float, float] | None:
    """``(wall_s, cpu_s)`` from a line that ends in the suffix; ``None`` otherwise."""
    m = _SUFFIX.search(line)
    return (float(m.group(1)), float(m.group(2))) if m else None
