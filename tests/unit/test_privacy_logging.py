"""Issue 23 (low): a newline in ``--output``/``--error`` reached root's log unescaped.

A user names their output file ``"x\\n2026-01-01 colloc: epilog: job 1: requeued"``
and root's log (and slurmd's, through stderr) shows a forged line. Every message of
a node script's logger has its control characters escaped, whatever logged it.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest

from slurm_colloc.node import logging_setup
from slurm_colloc.node.logging_setup import escape_controls, node_logger

FORGED = "/home/u/out\n2026-01-01 00:00:00,000 colloc: epilog: job 1: requeued\rX\x1b[2J\u2028Y"


@pytest.fixture
def fresh_logger():
    """node_logger keeps its handlers per component: start from none, end with none."""
    name = "colloc.node.test-escape"
    logger = logging.getLogger(name)
    for h in list(logger.handlers):
        logger.removeHandler(h)
    yield "test-escape"
    for h in list(logger.handlers):
        logger.removeHandler(h)
        h.close()


def test_user_text_cannot_forge_a_line_in_roots_log(tmp_path: Path, fresh_logger,
                                                   monkeypatch) -> None:
    err = io.StringIO()
    monkeypatch.setattr(logging_setup.sys, "stderr", err)
    log_file = tmp_path / "colloc.log"
    log = node_logger(fresh_logger, 7, str(log_file))
    log.info("evidence kept from %s", FORGED)
    log.error("%s: not kept", FORGED)
    for text in (log_file.read_text(), err.getvalue()):
        lines = text.splitlines()
        assert len(lines) == 2, lines
        assert all(": job 7: " in line for line in lines)
        assert "\\n2026-01-01" in lines[0] and "\\r" in lines[0] and "\\x1b[2J" in lines[0]
        assert "\\u2028" in lines[0]
        assert "\x1b" not in text and "\r" not in text and "\u2028" not in text


def test_a_traceback_keeps_its_lines(tmp_path: Path, fresh_logger, monkeypatch) -> None:
    """Root's own traceback is not user text: it stays readable."""
    monkeypatch.setattr(logging_setup.sys, "stderr", io.StringIO())
    log_file = tmp_path / "colloc.log"
    log = node_logger(fresh_logger, 8, str(log_file))
    try:
        raise ValueError("bad\nvalue")
    except ValueError:
        log.exception("failed on %s", "a\nb")
    text = log_file.read_text()
    assert "failed on a\\nb" in text and "Traceback (most recent call last):\n" in text


@pytest.mark.parametrize(("raw", "shown"), [
    ("plain text: ok", "plain text: ok"),
    ("tab\there", "tab\there"),
    ("a\nb\r\nc", "a\\nb\\r\\nc"),
    ("\x00\x07\x7f\x85\x9b", "\\x00\\x07\\x7f\\x85\\x9b"),
    ("\u2028\u2029", "\\u2028\\u2029"),
    ("back\\slash", "back\\slash"),
    ("utf-8 é ü 日本", "utf-8 é ü 日本"),
])
def test_escape_controls(raw: str, shown: str) -> None:
    assert escape_controls(raw) == shown
