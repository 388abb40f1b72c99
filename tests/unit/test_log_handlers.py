"""issue 26 item 4: root's log survives logrotate, and reaches syslog where there is one."""

from __future__ import annotations

import logging
import logging.handlers
import socket
from pathlib import Path

import pytest

from slurm_colloc.log_escape import EscapingFormatter
from slurm_colloc.log_handlers import file_handler, syslog_handler
from slurm_colloc.node.logging_setup import node_logger


def test_a_rotated_log_file_is_reopened_not_written_into_the_old_inode(tmp_path: Path) -> None:
    path = tmp_path / "log" / "colloc.log"
    h = file_handler(str(path), EscapingFormatter("%(message)s"))
    log = logging.getLogger("test.rotate")
    log.propagate, log.level = False, logging.INFO
    log.addHandler(h)
    try:
        log.info("before")
        path.rename(path.with_suffix(".log.1"))  # logrotate's default: move, then create
        log.info("after\nforged line")
    finally:
        log.removeHandler(h)
        h.close()
    assert path.with_suffix(".log.1").read_text() == "before\n"
    assert path.read_text() == "after\\nforged line\n"  # a new file, one escaped line


def test_an_unusable_log_path_gives_no_handler(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(OSError):
        file_handler(str(tmp_path / "f" / "x.log"), logging.Formatter())
    assert syslog_handler(str(tmp_path / "no-socket")) is None
    assert syslog_handler(str(tmp_path / "f")) is None  # a file, not a socket


def test_syslog_gets_one_escaped_tagged_line_per_record(tmp_path: Path) -> None:
    addr = str(tmp_path / "log.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(addr)
    server.settimeout(5)
    try:
        h = syslog_handler(addr)
        assert h is not None
        log = logging.getLogger("test.syslog")
        log.propagate, log.level = False, logging.INFO
        log.addHandler(h)
        log.info("prolog: job %s: %s", 7, "evil\nline")
        log.removeHandler(h)
        h.close()
        data = server.recv(4096).decode()
    finally:
        server.close()
    # <facility*8+severity>: daemon (3) * 8 + info (6) = 30
    assert data.startswith("<30>colloc: prolog: job 7: evil\\nline")
    assert "\n" not in data.rstrip("\x00")


def test_node_scripts_log_through_the_rotation_safe_handler(tmp_path: Path) -> None:
    adapter = node_logger("prolog-rotation-test", 5, str(tmp_path / "c.log"))
    kinds = {type(h) for h in adapter.logger.handlers}
    assert logging.handlers.WatchedFileHandler in kinds
    assert logging.FileHandler not in kinds  # the plain one kept the rotated-away inode
