"""Errors of the estimators package.

Both are ``ValueError`` subclasses so that a caller who only wants "bad input or not"
can catch one thing; the CLI turns either into exit code 2 with a one-line message.
"""

from __future__ import annotations


class EstimatorInputError(ValueError):
    """Input that no estimator can use (bad batch size, unknown option, file too big)."""


class SummaryParseError(EstimatorInputError):
    """A model summary that cannot be parsed; names the offending line when there is one."""

    def __init__(self, message: str, *, line_no: int | None = None, line: str | None = None):
        self.line_no = line_no
        self.line = line
        where = f"line {line_no}: " if line_no is not None else ""
        shown = f": {line.strip()[:80]!r}" if line is not None else ""
        super().__init__(f"{where}{message}{shown}")
