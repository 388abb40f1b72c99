"""The console scripts slurm.conf points at (slurm_colloc.node.scripts): whatever goes
wrong inside colloc, Prolog and Epilog exit 0 (a non-zero status drains the node) and
the TaskProlog prints only ``print``/``export`` lines (anything else fails the task)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from slurm_colloc.node import entry, scripts, task_entry

RAISES: list[BaseException] = [
    RuntimeError("boom"),
    KeyError("SLURM_JOB_UID"),
    MemoryError(),
    SystemExit(3),  # a library calling sys.exit must not become the script's status
    KeyboardInterrupt(),  # slurmd's SIGINT while we work
]


def _raiser(exc: BaseException) -> Callable[[dict[str, str]], int]:
    def main(env: dict[str, str], *_: object) -> int:
        raise exc

    return main


@pytest.mark.parametrize("exc", RAISES, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize(
    ("script", "target", "stream", "says"),
    [
        (scripts.prolog, "prolog_main", "err", "colloc: prolog: job 31: internal error, "
         "job runs without MPS: "),
        (scripts.epilog, "epilog_main", "err", "colloc: epilog: job 31: internal error, "
         "nothing requeued: "),
        (scripts.task_prolog, "task_prolog_main", "out", "print colloc: task prolog: job 31: "
         "internal error: "),
    ],
    ids=["prolog", "epilog", "task_prolog"],
)
def test_internal_error_exits_0_and_says_so(monkeypatch, capsys, script, target, stream, says,
                                            exc) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "31")
    monkeypatch.setattr(task_entry if target == "task_prolog_main" else entry, target,
                        _raiser(exc))
    assert script() == 0
    out = capsys.readouterr()
    text = out.err if stream == "err" else out.out
    assert text == says + repr(exc) + "\n"
    if stream == "out":  # the TaskProlog's stdout is parsed by slurmd: one print line
        assert out.err == ""
        assert text.startswith("print ") and text.count("\n") == 1


@pytest.mark.parametrize(
    ("script", "target"),
    [(scripts.prolog, "prolog_main"), (scripts.epilog, "epilog_main"),
     (scripts.task_prolog, "task_prolog_main")],
)
def test_passes_a_copy_of_the_environment(monkeypatch, script, target) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "8")
    seen: list[dict[str, str]] = []

    def main(env: dict[str, str], *_: object) -> int:
        seen.append(env)
        env["SLURM_JOB_ID"] = "changed"  # must not leak into the process environment
        return 0

    monkeypatch.setattr(task_entry if target == "task_prolog_main" else entry, target, main)
    assert script() == 0
    assert type(seen[0]) is dict and seen[0]["SLURM_JOB_ID"] == "changed"
    import os

    assert os.environ["SLURM_JOB_ID"] == "8"


def test_job_id_unknown_is_reported_as_question_mark(monkeypatch, capsys) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setattr(entry, "epilog_main", _raiser(ValueError("x")))
    assert scripts.epilog() == 0
    assert "epilog: job ?: internal error" in capsys.readouterr().err


def test_import_failure_of_entry_is_caught(monkeypatch, capsys) -> None:
    """A broken install (entry cannot be imported) still exits 0."""
    monkeypatch.setenv("SLURM_JOB_ID", "5")
    monkeypatch.setitem(sys.modules, "slurm_colloc.node.entry", None)  # import raises
    monkeypatch.setitem(sys.modules, "slurm_colloc.node.task_entry", None)
    assert scripts.prolog() == 0
    assert scripts.epilog() == 0
    assert scripts.task_prolog() == 0
    out = capsys.readouterr()
    assert out.err.count("internal error") == 2 and "ModuleNotFoundError" in out.err
    assert out.out.startswith("print colloc: task prolog: job 5: internal error: ModuleNotFoundError")


def test_real_scripts_exit_0_with_a_missing_config(tmp_path: Path) -> None:
    """End to end through the console-script functions in a fresh interpreter: a
    COLLOC_CONF that does not exist, no PATH at all (slurmd gives none)."""
    code = ("import sys; from slurm_colloc.node import scripts; "
            "sys.exit(max(scripts.prolog(), scripts.epilog(), scripts.task_prolog()))")
    env = {"COLLOC_CONF": str(tmp_path / "missing.conf"), "SLURM_JOB_ID": "12",
           "SLURM_JOB_UID": "1001", "SLURM_JOB_GPUS": "0"}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert p.returncode == 0, p.stderr
    assert "broken configuration, doing nothing" in p.stderr
    assert p.stdout.startswith("print colloc: task prolog: internal error, no MPS settings")
