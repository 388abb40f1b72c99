"""A node script that others wait for runs ahead of the node's other work while they wait.

Why (issue 28): under a burst of 150 job starts the one prolog per GPU that commits
the (GPU, user) MPS cap (:mod:`slurm_colloc.node.user_cap`) used 0.2 s of CPU but
took 3-4 s of wall in its two runs of the control program, queued for the node's busy
CPUs behind ~40 other prologs' interpreter starts, the ending jobs' epilogs and the
jobs themselves; the GPU's other prologs waited on its lock, so the burst's p99 was
two or three such commits long (and likewise for a GPU lock held while an MPS daemon
starts or stops). Priority inheritance by hand: a holder of one of root's locks
(:func:`slurm_colloc.mps.tenancy._flocked`), and the short-lived programs it runs,
which inherit the nice value, run at :data:`HOLDER_NICE`; the lock's release gives the
process back what it had.

A daemon started under a lock (the MPS control daemon) is given the holder's own
priority back as soon as it is up (:func:`give_back`), before any MPS server or client
exists, so nothing long-lived keeps the raised priority.

Root only: an unprivileged caller (a test) keeps its priority, the work is the same.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

HOLDER_NICE = -15
"""The nice value of a lock holder that other prologs wait for (Slurm's daemons run at 0).
Under a burst up to ~10 prologs per GPU wait on one holder (the one starting the GPU's
MPS daemon) while ~30 others run at :data:`SCRIPT_NICE`: at -10 the holder's share of
the CPUs was 3x a waiter's and a daemon start of ~0.12 s of CPU took 1-2 s on the
lab's two cores; -15 gives it ~9x (issue 28)."""


_base: list[int] = []
"""The nice value each raise replaced (innermost last): what :func:`give_back` restores."""


@contextlib.contextmanager
def boosted(nice: int = HOLDER_NICE) -> Iterator[bool]:
    """Run the block at ``nice`` when that is higher priority than now; yields whether
    the priority was raised. Restored afterwards, also when the block raises."""
    try:
        old = os.getpriority(os.PRIO_PROCESS, 0)
    except OSError:
        yield False
        return
    raised = False
    if nice < old:
        with contextlib.suppress(OSError):  # not root: the same work at normal priority
            os.setpriority(os.PRIO_PROCESS, 0, nice)
            raised = True
    if raised:
        _base.append(old)
    try:
        yield raised
    finally:
        if raised:
            _base.pop()
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, 0, old)


SCRIPT_NICE = -5
"""A whole Prolog/Epilog run (:func:`slurm_colloc.node.scripts.run_here`): its job cannot
start, or its node's next job cannot be placed, until it ends, while the jobs already
running lose a few hundredths of a second; lock holders still go ahead of it."""


SERVER_NICE = -10
"""The node's script server (:mod:`slurm_colloc.node.script_server`): it only accepts and
forks, and every served script's start waits for that, so it runs ahead of the scripts
it serves; each worker drops to :data:`SCRIPT_NICE` as soon as it is forked."""


def raise_process(nice: int = SCRIPT_NICE) -> bool:
    """Raise this whole process to ``nice`` from its start (a node script's client, the
    script server), remembering the priority it had as the one :func:`give_back` and
    :func:`for_child` restore. Returns whether it was raised (root only)."""
    if _base:
        return False
    try:
        old = os.getpriority(os.PRIO_PROCESS, 0)
        if nice >= old:
            # started raised already (a wrapper's ``nice -n -5``, before its
            # interpreter): what it starts long-lived gets nice 0, not the raise
            if old < 0:
                _base.append(0)
            return False
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError:
        return False
    _base.append(old)
    return True


def for_child() -> None:
    """In a child about to become a long-lived process (a detached helper): the priority
    this process had before any raise, so no daemon keeps a script's priority."""
    if _base:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, _base[0])


def give_back(pid: int) -> None:
    """A long-lived process started while this one was raised gets the priority this
    one had before (no-op when not raised; a vanished process is ignored)."""
    if _base:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, pid, _base[0])


AUTOGROUP = Path("/proc/self/autogroup")
"""The kernel's per-session scheduling group of this process (``CONFIG_SCHED_AUTOGROUP``)."""


def raise_session(nice: int = SERVER_NICE, autogroup: Path = AUTOGROUP) -> bool:
    """Give this session's scheduling group the weight of ``nice`` (root, session leader only).

    Why (issue 28): where the kernel groups tasks by session (``autogroup``, on by
    default in Debian's kernels; it applies to tasks outside any CPU cgroup), CPU time
    is shared between the groups first and a process's nice value only counts inside
    its own. The script server is a session of its own (it is detached), so every
    prolog and epilog it serves shared one group's share with each job, each Slurm
    daemon and each MPS daemon: under a burst of 150 job starts on two cores, ~40
    groups. The group must be its own: a detached process (double fork) is not its
    session's leader, so it first starts a session (and group) of its own; one that
    cannot (a process group leader, as a shell's foreground job) leaves its caller's
    group alone. Returns whether the weight was set (a session of its own may have been
    started even when it was not); where there is no such group (the
    kernel has none, or the process sits in a CPU cgroup, where this file does
    nothing), the same work runs at its own priority.

    Only the scripts are weighted: a daemon a script starts leaves the group (the MPS
    control daemon's ``-d``, v2 and v3, runs with ``start_new_session``, whatever
    NVIDIA's program does when it daemonises, so neither it nor the MPS servers it
    spawns keep the weight; helpers are detached with ``setsid``, :mod:`slurm_colloc.detach`).
    """
    try:
        if os.getsid(0) != os.getpid():
            os.setsid()
        autogroup.write_text(f"{nice}\n")
    except OSError:
        return False
    return True

