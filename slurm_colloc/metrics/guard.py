"""Failures of one part of a loop that must go on: logged, rate limited, never raised.

Root's collector runs one loop for the whole node: an exception that escapes it for
one process (a value in its environment, a file it planted, a bug it triggers) stops
enforcement for every job there. The collector therefore isolates each process and
each GPU and reports what failed here: the first failure of a cause with its
traceback, later ones of the same cause at most once per ``every_s`` with a count,
so a job that fails every second cannot flood root's log either.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

MAX_CAUSES = 256
"""Causes remembered at most (the oldest are forgotten, and log again if they recur)."""


@dataclass
class _Cause:
    last_logged: float
    suppressed: int = 0


class Failures:
    """Where a loop failed and why, logged once per cause per ``every_s``."""

    def __init__(self, logger: logging.Logger, every_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``logger`` gets the reports; ``clock`` is for tests."""
        self.log = logger
        self.every_s = every_s
        self.clock = clock
        self._causes: dict[tuple[str, str], _Cause] = {}
        self.count = 0
        """Failures seen so far (logged or not)."""

    def failed(self, where: str, e: BaseException) -> None:
        """Record one failure of ``where`` (a short, fixed description, e.g. ``GPU 0``)."""
        self.count += 1
        key = (where, type(e).__name__)
        now = self.clock()
        c = self._causes.get(key)
        if c is None:
            if len(self._causes) >= MAX_CAUSES:
                self._causes.pop(next(iter(self._causes)))
            self._causes[key] = _Cause(now)
            self.log.error("%s failed, skipped (%s: %s); going on\n%s", where,
                           type(e).__name__, _short(e), _where(e))
            return
        if now - c.last_logged < self.every_s:
            c.suppressed += 1
            return
        self.log.warning("%s failed again (%s: %s), %d more time(s) since last logged",
                         where, type(e).__name__, _short(e), c.suppressed + 1)
        c.last_logged, c.suppressed = now, 0


def _short(e: BaseException, limit: int = 200) -> str:
    """The message, one line and bounded: it may carry a user's value."""
    text = str(e)
    text = "".join(ch if ch.isprintable() else "?" for ch in text[: limit + 1])
    return text if len(text) <= limit else text[:limit] + "..."


def _where(e: BaseException, frames: int = 8) -> str:
    """The innermost frames of the traceback (code lines only, not the message, which
    may carry a user's value of any size)."""
    return "".join(traceback.format_tb(e.__traceback__)[-frames:]).rstrip()
