"""The demo's line on the node scripts: how long the prologs took, and how they ran
(issue 28: the script server, and its CPU group weighted ahead of the jobs')."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from slurm_colloc.demo import _node_scripts_line

PROLOGS = [
    "2026-11-29 05:00:01,000 colloc: prolog: job 5: shared gpu=0 [took 0.40 s, cpu 0.05 s]",
    "2026-11-29 05:00:02,000 colloc: prolog: job 6: shared gpu=1 [took 0.60 s, cpu 0.04 s]",
]
SERVING = "2026-11-29 05:00:00,500 colloc: script-server: job -: serving /run/x.sock (pid 9"


def _line(tmp_path: Path, *lines: str) -> str:
    log = tmp_path / "colloc.log"
    log.write_text("\n".join(lines) + "\n")
    cfg: Any = SimpleNamespace(log_file=str(log))
    return _node_scripts_line(cfg, [5, 6])


def test_the_line_says_the_server_ran_them_with_its_group_weighted(tmp_path: Path) -> None:
    out = _line(tmp_path, SERVING + ", its CPU group at nice -10)", *PROLOGS)
    assert "2 prologs, median 0.40 s" in out
    assert "script server (started by the first prolog) ran them in forked workers, " \
           "its CPU group at nice -10 ahead of the jobs'." in out


def test_a_server_without_a_group_and_no_server_are_said_as_such(tmp_path: Path) -> None:
    out = _line(tmp_path, SERVING + ")", *PROLOGS)
    assert out.endswith("ran them in forked workers.")
    assert "each ran in its own interpreter" in _line(tmp_path, *PROLOGS)
    assert _line(tmp_path, SERVING + ")") == ""  # no prolog timed: nothing to say
