"""Logging for node scripts: one prefix per component with the job id.

``colloc: epilog: job 1234: requeued on a whole GPU (gpu-oom, torch-oom-new)``.
Goes to ``CollocConfig.log_file`` and, for Slurm's own log, to stderr.

**One record, one line** (issue 23). Root logs text the user chose: output and
error paths, job names, comments, the matched line of a log. A newline in
``--output`` reached root's log unescaped, so a user could forge a whole line
(``... colloc: epilog: job 1: requeued``) in root's log and in slurmd's. Every
message is therefore escaped by :class:`EscapingFormatter` after its arguments are
filled in: C0 and C1 control characters, DEL and the Unicode line/paragraph
separators become ``\\n``, ``\\r``, ``\\xNN``, ``\\u2028``. Tabs stay. Root's own
tracebacks (appended after the message) keep their lines. Other root daemons that
log user text (the collector) should use the same formatter.
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

_CONTROLS = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r"}


def _escape_one(m: re.Match[str]) -> str:
    c = m.group()
    if c in _NAMED:
        return _NAMED[c]
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def escape_controls(text: str) -> str:
    """``text`` with every control character (tab aside) spelled out: one line."""
    return _CONTROLS.sub(_escape_one, text)


class EscapingFormatter(logging.Formatter):
    """A formatter whose message part is always one line (:func:`escape_controls`)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        """Escape the filled-in message; the traceback, added later, is untouched."""
        record.message = escape_controls(record.message)
        return super().formatMessage(record)


class JobAdapter(logging.LoggerAdapter[logging.Logger]):
    """Prefixes every message with the component and the job id."""

    def process(self, msg: str, kwargs):  # type: ignore[no-untyped-def]
        extra = self.extra or {}
        return f"{extra.get('component')}: job {extra.get('job_id')}: {msg}", kwargs


def node_logger(component: str, job_id: object, log_file: str | None) -> JobAdapter:
    """A logger for one node script invocation (never raises on a bad log path)."""
    logger = logging.getLogger(f"colloc.node.{component}")
    fmt = EscapingFormatter("%(asctime)s colloc: %(message)s")
    if not logger.handlers:
        logger.setLevel(logging.INFO)
        err = logging.StreamHandler(sys.stderr)
        err.setFormatter(fmt)
        logger.addHandler(err)
        logger.propagate = False
    has_file = any(isinstance(h, logging.FileHandler) for h in logger.handlers)
    if log_file and not has_file:
        try:
            Path(log_file).parent.mkdir(parents=True, exist_ok=True)
            fh = logging.FileHandler(log_file)
            fh.setFormatter(fmt)
            logger.addHandler(fh)
        except OSError as e:
            logger.warning("cannot open log file %s: %s", log_file, e)
    return JobAdapter(logger, {"component": component, "job_id": job_id})
