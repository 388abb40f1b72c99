"""One log record, one line: control characters in a message spelled out (issue 23).

Root logs text users chose (output paths, job names, a matched log line, a process's
environment). A newline in ``--output`` reached root's log unescaped and forged a
whole line. :class:`EscapingFormatter` escapes the filled-in message: C0 and C1
control characters, DEL and the Unicode line/paragraph separators become ``\\n``,
``\\r``, ``\\xNN``, ``\\u2028``; tabs stay; root's own tracebacks (appended after the
message) keep their lines. Every root process that logs (node scripts, the collector
and its supervisor) uses it.
"""

from __future__ import annotations

import logging
import re

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
