"""The collector's log: one line per record, and each record once (issue 23)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_colloc.config import CollocConfig
from slurm_colloc.metrics import collector


@pytest.fixture
def root_handlers() -> Iterator[None]:
    root = logging.getLogger()
    before = list(root.handlers)
    yield
    for h in [h for h in root.handlers if h not in before]:
        root.removeHandler(h)
        h.close()


@pytest.mark.parametrize("worker", [True, False])
def test_a_record_is_one_escaped_line_written_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], root_handlers: None, worker: bool
) -> None:
    log_file = tmp_path / "colloc.log"
    collector._logging(CollocConfig(log_file=str(log_file)), worker=worker)
    collector.log.warning("process %s: %s", 7, "evil\n2026-01-01 colloc: collector: forged")
    err = capsys.readouterr().err
    text = log_file.read_text() if log_file.exists() else ""
    # a worker's stderr is the log file (its supervisor sends it there): no second copy
    written = err + text if worker else text
    lines = [ln for ln in written.splitlines() if "process 7" in ln]
    assert len(lines) == 1, written
    assert "evil\\n2026-01-01" in lines[0] and "\n2026-01-01 colloc" not in written
    assert (text == "") is worker
