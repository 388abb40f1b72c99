"""Name the job logs the epilog could not scan (issue 28, item 5).

A failed job whose StdOut is a FIFO, a device, a deleted file or a file its user
cannot read has its last words nowhere the epilog may look: the scan refuses it by
design (:mod:`slurm_colloc.oom.safe_open`: a FIFO would block root, a device could
act on hardware). Before, the epilog then said only ``cause=none`` and the report
nothing, as if the log had been read and was clean. Now each such log is named, with
why it was not read, in the epilog's log line and in the attempt's record
(``Attempt.unscanned``), so the report can say "the job's output could not be
scanned: ..." instead of implying there was no error to find.

Only the scan's own verdicts are used (:class:`~slurm_colloc.oom.detector.ScanResult`:
status and the message :func:`~slurm_colloc.oom.safe_open.open_log` wrote); nothing
is opened or stat-ed here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from slurm_colloc.oom.detector import ScanResult

MAX_LOGS = 2
"""StdOut and StdErr: a record names at most this many logs."""
MAX_CHARS = 240
"""One entry (path and why) is cut to this many characters in the record."""
_MODE = re.compile(r"not a regular file \(mode (.)")
_KINDS = {"p": "FIFO", "c": "character device", "b": "block device", "s": "socket",
          "d": "directory"}


def why(r: ScanResult) -> str | None:
    """Why the scan did not read ``r.path`` (None: it did), in a few words."""
    if r.status == "ok":
        return None
    err = r.error or ""
    if r.status == "missing":
        return "missing (deleted?), not read"
    if r.status == "unreadable":
        return f"unreadable ({err or 'I/O error'})"
    m = _MODE.search(err)
    if m:
        return f"{_KINDS.get(m.group(1), 'not a regular file')}, not read"
    if "symlink" in err:
        return "a symlink, not followed"
    if "owned by uid" in err:
        return "not the job user's file, not read"
    if "changed while being opened" in err:
        return "changed while being opened, not read"
    return f"refused ({err[:120] or 'by the scan rules'})"


def named(results: Iterable[ScanResult]) -> list[str]:
    """``"<path>: <why>"`` for each log the scan could not read (at most
    :data:`MAX_LOGS`, each at most :data:`MAX_CHARS` characters, printable)."""
    out: list[str] = []
    for r in results:
        reason = why(r)
        if reason is None:
            continue
        text = "".join(c if c.isprintable() else "?" for c in f"{r.path}: {reason}")
        if text[:MAX_CHARS] not in out:
            out.append(text[:MAX_CHARS])
        if len(out) >= MAX_LOGS:
            break
    return out


def log_line(entries: Iterable[str]) -> str:
    """The epilog log's words: ``cannot scan /path: FIFO, not read; ...``."""
    return "; ".join(f"cannot scan {e}" for e in entries)
