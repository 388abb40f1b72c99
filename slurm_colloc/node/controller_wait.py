"""Asking slurmctld from a node script: a total time budget, and "did not answer" kept
apart from every answer (issue 28 item 3).

Why: with slurmctld away, ``squeue --json`` and ``scontrol`` either hang until their
own timeout or exit 0 with an ``errors`` list and no jobs. A node script that reads
that as "no jobs" releases other jobs' MPS registrations or runs the job unmanaged
without saying why; one that retries per call multiplies the wait by the number of
calls. Here a caller gets one budget for all its tries together (each try's timeout
is what is left of it), retries only what means "the controller did not answer",
and gets :class:`Unanswered` (how long it waited, the last error) when the budget is
spent. Any other error is the controller's (or Slurm's) answer and is raised at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from slurm_colloc.slurm.records import SlurmError

T = TypeVar("T")

AWAY_MARKERS = (
    "timed out",
    "unable to contact slurm controller",
    "communication connection failure",
    "socket timed out",
    "connection refused",
    "zero bytes were transmitted",
    "unable to establish controller",
    "slurmctld not responding",
    "transport endpoint is not connected",
    "connection reset by peer",
    "unexpected message received",
)
"""Lower-case pieces of the messages Slurm's clients (and :class:`SlurmCli`'s own
timeout) give when slurmctld did not answer: 26.05's squeue with slurmctld stopped
exits 1 after 20 s with ``slurm_load_jobs error: Unable to contact slurm controller
(connect failure)`` (tests/e2e/test_fault_controller.py); a JSON ``errors`` entry
names ``Communication connection failure``; 24.11's ``scontrol requeuehold`` with
slurmctld stopped exits 1 with ``Unexpected message received for job N`` (no
working controller sends that); the adapter's own ``timed out after``."""

MIN_TRY_S = 2.0
"""No try gets less than this: a Slurm client needs a moment even when all is well."""


def controller_away(err: BaseException) -> bool:
    """Whether ``err`` says slurmctld did not answer (as opposed to answering no)."""
    text = str(err).lower()
    return any(m in text for m in AWAY_MARKERS)


@dataclass
class Budget:
    """One deadline for all of a script's tries; ``clock`` is injectable for tests."""

    total_s: float
    clock: Callable[[], float] = field(default=lambda: time.monotonic())
    """Looked up at each call, so a test may replace this module's ``time``."""
    started: float = field(default=-1.0)

    def __post_init__(self) -> None:
        if self.started < 0:
            self.started = self.clock()

    def spent(self) -> float:
        return self.clock() - self.started

    def left(self) -> float:
        return max(0.0, self.total_s - self.spent())


class Unanswered(SlurmError):
    """slurmctld did not answer within the budget (never "no such job")."""

    def __init__(self, waited_s: float, tries: int, last: BaseException) -> None:
        super().__init__(f"slurmctld did not answer in {waited_s:.0f}s ({tries} "
                         f"tr{'y' if tries == 1 else 'ies'}; last: {str(last)[:200]})")
        self.waited_s = waited_s
        self.tries = tries
        self.last = last


def ask(call: Callable[[float], T], budget: Budget, *,
        sleep: Callable[[float], None] | None = None, pause_s: float = 1.0) -> T:
    """``call(timeout)`` until it returns; each try's timeout is what is left of the
    budget (at least :data:`MIN_TRY_S`). A "did not answer" error is retried after
    ``pause_s`` while a whole try still fits; any other SlurmError is raised as is;
    the spent budget raises :class:`Unanswered`. The tries together never run past
    the budget (the first one excepted when the budget is below :data:`MIN_TRY_S`)."""
    tries = 0
    while True:
        tries += 1
        try:
            return call(max(MIN_TRY_S, budget.left()))
        except SlurmError as e:
            if not controller_away(e):
                raise
            if budget.left() - pause_s < MIN_TRY_S:  # no room for a real try: stop here
                raise Unanswered(budget.spent(), tries, e) from e
            (sleep or time.sleep)(pause_s)
