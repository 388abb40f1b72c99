"""Where colloc's root-side logs go: a file that survives rotation, and syslog.

Why: the node scripts and the collector wrote ``log_file`` through a plain
``logging.FileHandler``, which keeps writing into the old inode once logrotate has
moved the file away (the lines vanish with the next rotation), and the documentation
promised syslog that nothing wrote. :func:`file_handler` reopens the file when it has
been moved or removed (``WatchedFileHandler``), so a site's ``logrotate`` with or
without ``copytruncate`` works (docs/admin.md has the snippet); :func:`syslog_handler`
sends the same escaped lines to the local syslog socket (journald reads it), where
there is one. A log that cannot be opened is never a reason to fail a prolog: the
callers log why and go on.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import stat
from pathlib import Path

from slurm_colloc.log_escape import EscapingFormatter

SYSLOG_SOCKET = "/dev/log"
SYSLOG_IDENT = "colloc: "


def file_handler(path: str, fmt: logging.Formatter) -> logging.Handler:
    """A rotation-safe handler for ``path``, its directory created.

    Raises :class:`OSError` when the file cannot be opened: the caller logs why.
    """
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    h = logging.handlers.WatchedFileHandler(path)
    h.setFormatter(fmt)
    return h


def syslog_handler(socket_path: str = SYSLOG_SOCKET) -> logging.Handler | None:
    """A daemon-facility syslog handler on ``socket_path``; None where there is none.

    Tagged ``colloc:``; syslog adds the time. Messages are escaped as in the file
    (:class:`~slurm_colloc.log_escape.EscapingFormatter`): one record, one line.
    """
    try:
        if not stat.S_ISSOCK(os.stat(socket_path).st_mode):
            return None
        h = logging.handlers.SysLogHandler(
            address=socket_path, facility=logging.handlers.SysLogHandler.LOG_DAEMON)
    except OSError:
        return None
    h.ident = SYSLOG_IDENT
    h.setFormatter(EscapingFormatter("%(message)s"))
    return h
