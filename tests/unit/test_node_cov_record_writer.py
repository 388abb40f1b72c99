"""The detached accounting writer (slurm_colloc.node.record_writer), with a fake adapter
and a fake clock: what counts as finished in slurmdbd, one verified write, retries,
and main(). The one-writer-per-node drain: test_record_writer_drain.py."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest

from slurm_colloc import config as cfgmod
from slurm_colloc.node import record_writer
from slurm_colloc.slurm import adapter as ad
from slurm_colloc.slurm.adapter import AccountingRecord, SlurmError

JOB = 4242


class FakeClock:
    """``time`` stand-in: ``sleep`` advances ``monotonic``; every sleep is recorded."""

    def __init__(self) -> None:
        self.t = 1000.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    c = FakeClock()
    monkeypatch.setattr(record_writer, "time", c)
    return c


def rec(state: str, end: str = "2026-01-01T00:00:10", comment: str = "",
        start: str = "2026-01-01T00:00:00") -> AccountingRecord:
    return AccountingRecord(str(JOB), state, {"State": state, "End": end, "Start": start,
                                              "AdminComment": comment})


class FakeDbd:
    """A scripted slurmdbd: ``states`` answered in turn while waiting, then what the
    writes left (sacctmgr lower-cases nothing here; the writer compares lower-case)."""

    def __init__(self, states: list[Any], *, write_errors: int = 0, stored: str | None = None,
                 readback_errors: int = 0) -> None:
        self.states = list(states)
        self.write_errors = write_errors
        self.readback_errors = readback_errors
        self.stored = stored  # forces what the read-back returns when set
        self.comment = ""
        self.writes: list[str] = []
        self.calls: list[str] = []
        self.writing = False

    def accounting(self, job_ids: list[int]) -> list[AccountingRecord]:
        assert list(job_ids) == [JOB]
        self.calls.append("sacct")
        if not self.writing:
            nxt = self.states.pop(0) if len(self.states) > 1 else self.states[0]
            if isinstance(nxt, Exception):
                raise nxt
            return nxt
        if self.readback_errors:
            self.readback_errors -= 1
            raise SlurmError("sacct: slurmdbd not responding")
        value = self.stored if self.stored is not None else self.comment
        return [rec("FAILED", comment=value)]

    def set_admin_comment_finished(self, job_id: int, value: str) -> None:
        assert job_id == JOB
        self.writing = True
        self.calls.append("sacctmgr")
        self.writes.append(value)
        if self.write_errors:
            self.write_errors -= 1
            raise SlurmError("sacctmgr: job not found")
        self.comment = value.lower()  # sacctmgr lower-cases what it stores


class Rows:
    """sacct answers in turn (an exception is raised), then the last one again."""

    def __init__(self, answers: list[Any]) -> None:
        self.answers = list(answers)

    def accounting(self, job_ids: list[int]) -> list[AccountingRecord]:
        nxt = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(nxt, Exception):
            raise nxt
        return list(nxt)


def _done(answer: Any) -> bool:
    return JOB in record_writer._finished(Rows([answer]), [JOB])  # type: ignore[arg-type]


def test_finished_needs_a_terminal_state_and_the_end() -> None:
    assert not _done([])  # not in slurmdbd yet
    assert not _done(SlurmError("sacct: connection refused"))  # slurmdbd down: wait on
    assert not _done([rec("COMPLETING", end="Unknown")])
    assert not _done([rec("FAILED", end="Unknown")])  # final, the End record still queued
    assert _done([rec("FAILED")])


def test_first_word_of_state_decides() -> None:
    """``CANCELLED by 1001`` is terminal (only the first word counts)."""
    assert _done([rec("CANCELLED by 1001")])


def test_newest_attempt_decides() -> None:
    """A requeued job: the older attempt is final, the newest still pending (sorted
    last by by_start whatever sacct's order): not finished."""
    old = rec("REQUEUED", start="2026-01-01T00:00:00")
    pending = rec("PENDING", end="Unknown", start="Unknown")
    done = rec("FAILED", start="2026-01-01T00:05:00")
    assert not _done([pending, old])
    assert _done([old, done])


# was a bug (fixed): a sacct record with an empty State (sacct_json gives '' for a missing
# state.current) raised IndexError instead of waiting on
def test_record_without_state_is_waited_on() -> None:
    assert not _done([rec("", end="Unknown")])


def test_write_verified_once() -> None:
    dbd = FakeDbd([[rec("FAILED")]])
    assert record_writer.write_verified(dbd, JOB, "cl1:ABC") is None  # type: ignore[arg-type]
    assert dbd.calls == ["sacctmgr", "sacct"] and dbd.writes == ["cl1:ABC"]


def test_lowercased_read_back_counts_as_written() -> None:
    """sacctmgr lower-cases AdminComment; the codec survives that, so does the check."""
    dbd = FakeDbd([[rec("FAILED")]])
    assert record_writer.write_verified(dbd, JOB, "CL1:UPPER") is None  # type: ignore[arg-type]


def test_write_refused_or_read_back_different_or_failing() -> None:
    dbd = FakeDbd([[rec("FAILED")]], write_errors=1)
    assert record_writer.write_verified(dbd, JOB, "x") == "sacctmgr: job not found"  # type: ignore[arg-type]
    dbd = FakeDbd([[rec("FAILED")]], stored="someone else's text")
    assert record_writer.write_verified(dbd, JOB, "x") == "read back a different value"  # type: ignore[arg-type]
    dbd = FakeDbd([[rec("FAILED")]], readback_errors=1)
    assert "not responding" in str(record_writer.write_verified(dbd, JOB, "x"))  # type: ignore[arg-type]


def test_retries_refused_writes_with_growing_pause(clock: FakeClock, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o700)
    record_writer.spool_path(str(spool), JOB).write_text("Cl1:MiXeD")
    dbd = FakeDbd([[rec("FAILED")]], write_errors=2)
    log = logging.LoggerAdapter(logging.getLogger("test"), {})
    assert record_writer.drain(dbd, spool, lambda j: log, pause=0.5) == 1  # type: ignore[arg-type]
    assert dbd.writes == ["Cl1:MiXeD"] * 3
    assert not record_writer.spool_path(str(spool), JOB).exists()


def test_spool_path() -> None:
    assert record_writer.spool_path("/var/spool/colloc", 12) == Path("/var/spool/colloc/12.adminc")


def test_spawn_runs_the_module_detached(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[tuple[Any, ...]] = []
    monkeypatch.setattr(record_writer, "spawn_module",
                        lambda *a, pass_fd: seen.append((*a, pass_fd)))
    spool = tmp_path / "9.adminc"
    assert record_writer.spawn(9, spool, {"PATH": "/bin"})
    ((module, args, env, fd),) = seen
    assert (module, args, env) == ("slurm_colloc.node.record_writer",
                                   ("9", str(spool), "3"), {"PATH": "/bin"})
    assert isinstance(fd, int)


def test_spawn_reports_a_lock_that_is_not_roots(tmp_path: Path) -> None:
    (tmp_path / record_writer.LOCK_NAME).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):
        record_writer.spawn(9, tmp_path / "9.adminc", {"PATH": "/bin"})


# ------------------------------------------------------------------ main() ---


@pytest.fixture
def main_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """main()'s world: a config with a log file, a recorded SlurmCli, argv."""
    conf = tmp_path / "colloc.conf"
    log_file = tmp_path / "colloc.log"
    conf.write_text(f'log_file = "{log_file}"\n')
    monkeypatch.setenv("COLLOC_CONF", str(conf))
    monkeypatch.setenv("SLURM_CONF", "/etc/slurm/slurm.conf")
    monkeypatch.setenv("LD_PRELOAD", "/home/u/evil.so")
    made: list[dict[str, Any]] = []

    class Cli:
        def __init__(self, env: dict[str, str], timeout: float) -> None:
            made.append({"env": env, "timeout": timeout})

    monkeypatch.setattr(ad, "SlurmCli", Cli)
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir(mode=0o700)
    spool = spool_dir / f"{JOB}.adminc"
    monkeypatch.setattr(sys, "argv", ["record_writer", str(JOB), str(spool)])
    # node loggers are process-wide: start each test without file handlers
    lg = logging.getLogger("colloc.node.record-writer")
    for h in list(lg.handlers):
        lg.removeHandler(h)
    yield spool, log_file, made
    for h in list(lg.handlers):
        lg.removeHandler(h)
        h.close()


def test_main_drains_the_spool_directory(main_env, monkeypatch: pytest.MonkeyPatch) -> None:
    spool, log_file, made = main_env
    got: list[tuple[Any, ...]] = []

    def fake_run(spool_dir: Path, adapter: Any, log_for: Any, held: Any,
                 field: str = "", max_bytes: int = 0) -> int:
        got.append((spool_dir, type(adapter).__name__, held, field))
        log_for(JOB + 1).info("written")
        return 1

    monkeypatch.setattr(record_writer, "run_writer", fake_run)
    assert record_writer.main() == 0
    assert got == [(spool.parent, "Cli", None, "admin_comment")]  # record_field
    # the Slurm tools get a fixed PATH and the two config variables, nothing else
    assert made == [{"env": {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
                             "SLURM_CONF": "/etc/slurm/slurm.conf",
                             "COLLOC_CONF": str(spool.parent.parent / "colloc.conf")},
                     "timeout": 30}]
    assert f"record-writer: job {JOB + 1}: written" in log_file.read_text()


def test_main_failure_is_logged_and_exits_0(main_env, monkeypatch) -> None:
    spool, log_file, _ = main_env

    def broken(*a: Any) -> int:
        raise OSError("spool unreadable")

    monkeypatch.setattr(record_writer, "run_writer", broken)
    assert record_writer.main() == 0
    assert f"records not written, left in {spool.parent}: spool unreadable" in (
        log_file.read_text())


def test_main_survives_broken_config(main_env, monkeypatch, tmp_path, caplog) -> None:
    """A broken colloc.conf: no log file, but the records are still written."""
    _, log_file, _ = main_env
    (tmp_path / "colloc.conf").write_text("this is = = not toml")
    with pytest.raises(cfgmod.ConfigError):
        cfgmod.load()
    monkeypatch.setattr(record_writer, "run_writer",
                        lambda d, a, log_for, held, field, *_: log_for(JOB).info("written") or 1)
    assert record_writer.main() == 0
    assert not log_file.exists()
    assert [r.getMessage() for r in caplog.records] == [f"record-writer: job {JOB}: written"]


def test_main_adopts_the_lock_it_was_handed(main_env, monkeypatch) -> None:
    import os

    spool, _, _ = main_env
    fd = record_writer.try_lock(spool.parent)
    assert fd is not None
    monkeypatch.setattr(sys, "argv", ["record_writer", str(JOB), str(spool), str(fd)])
    got: list[Any] = []
    monkeypatch.setattr(record_writer, "run_writer",
                        lambda d, a, log_for, held, field, *_: got.append(held) or 0)
    try:
        assert record_writer.main() == 0
    finally:
        os.close(fd)
    assert got == [fd]
