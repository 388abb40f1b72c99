"""The (GPU, user) MPS server cap, raised by a group commit outside the GPU lock.

Why (issue 28): a legacy (v2) prolog raises its user's server-side pinned limit to
the sum of the user's registered jobs on the GPU (``cap_user``: two to three MPS
control commands). Done under the GPU lock, a burst of 40 prologs on four GPUs
queued behind each other's control commands and the burst's prolog p99 reached
12-22 s. Here the GPU lock covers only the registration; the cap is then committed
under a lock of its own per (GPU, user), and one commit covers every registration
made before it: a prolog whose registration an earlier commit already covered sends
no command at all.

How it stays correct, with two root-owned counters under ``gpu<i>/uid<u>/``:

* :func:`register` (under the GPU lock, after the job's marker and root's copy of
  its limits are written) bumps ``cap.want`` and returns the job's ticket ``k``.
* :func:`commit` (under ``cap.lock``, never under the GPU lock): if ``cap.done`` >= k
  the cap already covers the job; else it starts the user's daemon if it does not run
  (the first job of a wave: the others register meanwhile), reads ``want`` = N, then
  sums the user's registered limits (every registration up to N is on disk: its files
  were written before its bump), applies the sum and writes ``done`` = N.

The committer runs at a raised priority while it holds the cap lock
(:mod:`slurm_colloc.priority`): the waiters' wall time is its wall time.

The job returns only once a commit covering it succeeded, so it never starts with a
cap below its co-tenants' and its own share (issue 24's OOM inside a reservation), nor
without a daemon (a commit covering it made the daemon run after the job registered).
The daemon cannot be stopped while the job is registered (the user's last job stops
it), so the commit talks to the job's own daemon. A failed commit withdraws only the
committer's own job (:func:`slurm_colloc.node.prolog._cap_or_withdraw`); the
waiters behind it find ``done`` < k and commit themselves. Counters are root's and
read with :func:`~slurm_colloc.mps.control.read_small_file`; an unreadable one
reads as 0, which only makes a commit happen (``want`` starts above ``done``).
"""

from __future__ import annotations

from collections.abc import Callable

from slurm_colloc.mps.tenancy import Tenancy


def register(tenancy: Tenancy, gpu: int, uid: int) -> int:
    """Bump the (GPU, user) registration counter; the caller's ticket. Under the GPU
    lock, after the job's marker and limits are written."""
    ticket = max(tenancy.read_counter(gpu, uid, "want"),
                 tenancy.read_counter(gpu, uid, "done")) + 1
    tenancy.write_counter(gpu, uid, "want", ticket)
    return ticket


def commit(tenancy: Tenancy, gpu: int, uid: int, ticket: int,
           total_mib: Callable[[], int], apply: Callable[[int], None],
           ensure: Callable[[], None] | None = None) -> bool:
    """Make the server cap cover registration ``ticket``; True when this call sent it.

    ``total_mib``: the user's registered limits summed now; ``apply``: sends the cap
    (raises on failure: ``done`` is then left as it was); ``ensure``: makes the user's
    daemon run (started here, under the cap lock, for the first job of a wave: the
    wave's other jobs register meanwhile and this one commit covers them). Not under
    the GPU lock.
    """
    with tenancy.cap_locked(gpu, uid):
        if tenancy.read_counter(gpu, uid, "done") >= ticket:
            return False  # an earlier commit (after this registration) covered it
        if ensure is not None:
            ensure()
        wanted = max(tenancy.read_counter(gpu, uid, "want"), ticket)
        apply(total_mib())  # at the lock holder's raised priority (slurm_colloc.priority)
        tenancy.write_counter(gpu, uid, "done", wanted)
        return True
