"""Keeps the node collector running: restarts a worker that dies or stalls, visibly.

The prolog starts ``python -m slurm_colloc.metrics.collector`` when no collector holds
the lock; that process is this supervisor. It holds the lock (root's private
directory, :mod:`.liveness`) and runs the sampling loop as a child, the *worker*
(``--worker``). Whatever ends the worker other than a clean exit (an exception, a
signal, the OOM killer, a crash in a GPU library) is logged with its cause and the
worker is started again after a short backoff (1 s, doubling to 30 s; reset after
:data:`STEADY_S` of good running). A worker that stops completing samples for
``stall_s`` is killed and restarted the same way. Each start, death, stall and clean
stop goes to root's log and to the public events file, so ``colloc doctor`` can say
that the collector is down or crashing and ``colloc-report`` can say when a job ran
without enforcement (:func:`.liveness.gaps`).

A clean worker exit (status 0: no GPU job for ``collector_idle_exit_s``, or
``--seconds`` elapsed) ends the supervisor too. If the supervisor itself is killed,
the lock goes with it; the worker sees its parent gone at its next step (within a
sample interval), records that, starts a new supervisor detached and exits
(:mod:`.spawn`, issue 28): sampling is back within seconds. The new supervisor takes
the lock or exits (a prolog's collector may have won it), so one collector runs.
Under systemd the worker only exits and systemd restarts the unit (``Restart=always``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

from slurm_colloc.metrics import liveness

log = logging.getLogger("colloc.metrics.supervisor")

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
STEADY_S = 300.0
"""A worker that ran this long before dying restarts after the shortest backoff."""
CRASH_FILE = "crash"
"""In the private directory: the dying worker's last exception, for the event line."""


def describe_exit(rc: int) -> str:
    """``exit 1`` / ``signal 9 (SIGKILL)``."""
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = "?"
        return f"signal {-rc} ({name})"
    return f"exit {rc}"


def write_crash(metrics_dir: str, text: str) -> None:
    """The worker's last words (its exception, one line) for the supervisor's event."""
    with contextlib.suppress(OSError):
        liveness.write_private(metrics_dir, CRASH_FILE, liveness.clean_detail(text))


def take_crash(metrics_dir: str) -> str:
    """Read and remove the worker's last words ("" when it left none)."""
    path = Path(metrics_dir) / liveness.PRIVATE_DIR / CRASH_FILE
    try:
        from slurm_colloc.metrics import store

        text = store.read_bounded(path, liveness.MAX_DETAIL).decode("utf-8", "replace")
    except OSError:
        return ""
    with contextlib.suppress(OSError):
        os.unlink(path)
    return text.strip()


class Supervisor:
    """Runs ``argv`` (the worker) until it exits cleanly or we are told to stop."""

    def __init__(self, metrics_dir: str, argv: Sequence[str], *, stall_s: float = 60.0,
                 log_file: str | None = None, poll_s: float = 0.5,
                 backoff: Sequence[float] = BACKOFF_S,
                 clock: Callable[[], float] = time.time) -> None:
        """``log_file`` receives the worker's stderr (tracebacks of hard crashes)."""
        self.metrics_dir = metrics_dir
        self.argv = list(argv)
        self.stall_s = stall_s
        self.log_file = log_file
        self.poll_s = poll_s
        self.backoff = tuple(backoff)
        self.clock = clock
        self.stopping = False
        self.restarts = 0
        self._proc: subprocess.Popen[bytes] | None = None

    def event(self, kind: str, pid: int, detail: str = "") -> None:
        """An events-file line; a failure to write it is logged, never fatal."""
        try:
            liveness.append_event(self.metrics_dir, kind, pid, detail, now=self.clock())
        except OSError as e:
            log.warning("collector events file: %s", e)

    def stop(self, signum: int = signal.SIGTERM, frame: FrameType | None = None) -> None:
        """Stop (signal handler): the worker gets SIGTERM and ends its step."""
        self.stopping = True
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(OSError):
                self._proc.send_signal(signal.SIGTERM)

    def _stderr(self) -> int:
        """Where the worker's stderr goes: root's log file (appended), else nowhere."""
        if self.log_file:
            with contextlib.suppress(OSError):
                return os.open(self.log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT
                               | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
        return os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)

    def _spawn(self) -> subprocess.Popen[bytes]:
        err = self._stderr()
        try:
            return subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=err,
                                    stderr=err, cwd="/", close_fds=True)
        finally:
            os.close(err)

    def _watch(self, proc: subprocess.Popen[bytes]) -> tuple[int | None, float]:
        """Wait for the worker; returns (its status, or None if it stalled; run time)."""
        started = self.clock()
        next_alive = started + liveness.ALIVE_EVERY_S
        while True:
            try:
                return proc.wait(self.poll_s), self.clock() - started
            except subprocess.TimeoutExpired:
                pass
            now = self.clock()
            age = liveness.heartbeat_age(self.metrics_dir, now)
            since = min(age, now - started) if age is not None else now - started
            if since > self.stall_s and not self.stopping:
                proc.kill()
                proc.wait()
                return None, now - started
            if now >= next_alive:
                next_alive = now + liveness.ALIVE_EVERY_S
                if since < liveness.ALIVE_EVERY_S:
                    self.event(liveness.ALIVE, proc.pid)

    def close_previous(self) -> None:
        """A collector before us that ended without a word (its supervisor was killed,
        the node went down): record its end at its last completed sample, so the gap
        until now reads as what it was, unenforced time."""
        events = liveness.read_events(self.metrics_dir)
        if not events or events[-1].kind not in (liveness.UP, liveness.ALIVE):
            return
        last = events[-1]
        age = liveness.heartbeat_age(self.metrics_dir, self.clock())
        t = max(last.t, self.clock() - age) if age is not None else last.t
        log.error("the previous collector (worker %d) ended without a stop; no enforcement "
                  "since %s", last.pid, time.strftime("%H:%M:%S", time.localtime(t)))
        try:
            liveness.append_event(self.metrics_dir, liveness.DOWN, last.pid,
                                  "gone without a stop (killed, or the node went down)", now=t)
        except OSError as e:
            log.warning("collector events file: %s", e)

    def run(self) -> int:
        """The supervision loop (the caller holds the lock); 0 on a clean end."""
        self.close_previous()
        failures = 0
        while not self.stopping:
            take_crash(self.metrics_dir)  # a stale one is not this worker's
            try:
                proc = self._proc = self._spawn()
            except OSError as e:
                log.error("cannot start the collector worker: %s", e)
                self.event(liveness.DOWN, os.getpid(), f"cannot start: {e}")
                failures += 1
                self._pause(failures)
                continue
            with contextlib.suppress(OSError):
                liveness.write_pid(self.metrics_dir, os.getpid(), proc.pid)
            self.event(liveness.UP, proc.pid, "restart" if self.restarts else "start")
            rc, ran = self._watch(proc)
            if self.stopping or rc == 0:
                self.event(liveness.STOP, proc.pid, "stopped" if self.stopping else "idle")
                return 0
            self.restarts += 1
            failures = 1 if ran >= STEADY_S else failures + 1
            last = take_crash(self.metrics_dir)
            if rc is None:
                what = f"no sample for {self.stall_s:.0f}s: killed"
                log.error("collector worker %d stalled (%s); restarting", proc.pid, what)
                self.event(liveness.STALLED, proc.pid, what)
            else:
                what = describe_exit(rc) + (f": {last}" if last else "")
                log.error("collector worker %d died (%s) after %.0fs; restarting "
                          "(enforcement is off until it samples again)", proc.pid, what, ran)
                self.event(liveness.DOWN, proc.pid, what)
            self._pause(failures)
        return 0

    def _pause(self, failures: int) -> None:
        """Backoff before the next start (cut short by :meth:`stop`)."""
        delay = self.backoff[min(failures, len(self.backoff)) - 1] if failures else 0.0
        end = time.monotonic() + delay
        while not self.stopping and (left := end - time.monotonic()) > 0:
            time.sleep(min(0.1, left))
