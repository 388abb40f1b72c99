"""The detached accounting writer (slurm_colloc.node.record_writer), with a fake adapter
and a fake clock: it waits for slurmdbd's End, writes, reads back, retries, gives up,
and keeps the spool file unless the write was verified."""

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


def test_waits_for_terminal_state_and_end_then_writes(clock: FakeClock) -> None:
    dbd = FakeDbd([
        [],  # not in slurmdbd yet
        SlurmError("sacct: connection refused"),  # slurmdbd down: keep waiting
        [rec("COMPLETING", end="Unknown")],
        [rec("FAILED", end="Unknown")],  # final state but the End record still queued
        [rec("FAILED")],
    ])
    out = record_writer.write_when_finished(dbd, JOB, "cl1:ABC", wait=60, pause=2.0)
    assert out == "written (7 bytes, try 1)"
    # four polls that did not see the end, one sleep each, then exactly one write
    assert dbd.calls == ["sacct"] * 5 + ["sacctmgr", "sacct"]
    assert clock.sleeps == [2.0] * 4
    assert dbd.writes == ["cl1:ABC"]


def test_first_word_of_state_decides(clock: FakeClock) -> None:
    """``CANCELLED by 1001`` is terminal (only the first word counts)."""
    dbd = FakeDbd([[rec("CANCELLED by 1001")]])
    assert record_writer.write_when_finished(dbd, JOB, "x", wait=5).startswith("written")
    assert clock.sleeps == []


def test_newest_attempt_decides(clock: FakeClock) -> None:
    """A requeued job: the older attempt is final, the newest still pending (sorted
    last by by_start whatever sacct's order): the writer keeps waiting."""
    old = rec("REQUEUED", start="2026-01-01T00:00:00")
    pending = rec("PENDING", end="Unknown", start="Unknown")
    done = rec("FAILED", start="2026-01-01T00:05:00")
    dbd = FakeDbd([[pending, old], [pending, old], [old, done]])
    record_writer.write_when_finished(dbd, JOB, "x", wait=60, pause=1.0)
    assert clock.sleeps == [1.0, 1.0]


def test_gives_up_waiting_after_deadline_and_still_writes(clock: FakeClock) -> None:
    """The wait is bounded: a job slurmdbd never reports final gets the write anyway."""
    dbd = FakeDbd([[rec("RUNNING", end="Unknown")]])
    out = record_writer.write_when_finished(dbd, JOB, "x", wait=10, pause=3.0)
    assert out.startswith("written")
    assert clock.sleeps == [3.0] * 4  # 0, 3, 6, 9 < 10; at 12 the wait is over
    assert dbd.writes == ["x"]


def test_retries_refused_writes_with_growing_pause(clock: FakeClock) -> None:
    dbd = FakeDbd([[rec("FAILED")]], write_errors=2)
    out = record_writer.write_when_finished(dbd, JOB, "Cl1:MiXeD", wait=5, pause=0.5)
    assert out == "written (9 bytes, try 3)"
    assert clock.sleeps == [0.5, 1.0]  # pause x attempt
    assert dbd.writes == ["Cl1:MiXeD"] * 3


def test_lowercased_read_back_counts_as_written(clock: FakeClock) -> None:
    """sacctmgr lower-cases AdminComment; the codec survives that, so does the check."""
    dbd = FakeDbd([[rec("FAILED")]])
    assert record_writer.write_when_finished(dbd, JOB, "CL1:UPPER", wait=5).endswith("try 1)")


def test_gives_up_after_tries_when_read_back_differs(clock: FakeClock) -> None:
    dbd = FakeDbd([[rec("FAILED")]], stored="someone else's text")
    with pytest.raises(SlurmError, match=r"not written after 8 tries: read back a different"):
        record_writer.write_when_finished(dbd, JOB, "mine", wait=5, pause=1.0)
    assert len(dbd.writes) == record_writer.TRIES
    assert clock.sleeps == [float(k) for k in range(1, record_writer.TRIES + 1)]


def test_gives_up_after_tries_with_last_error(clock: FakeClock) -> None:
    dbd = FakeDbd([[rec("FAILED")]], write_errors=100)
    with pytest.raises(SlurmError, match="sacctmgr: job not found"):
        record_writer.write_when_finished(dbd, JOB, "mine", wait=5)
    assert len(dbd.writes) == record_writer.TRIES


# was a bug (fixed): a SlurmError from the read-back sacct is not retried (the wait loop
# treats the same error as transient); the writer gives up on the first try
def test_transient_read_back_failure_is_retried(clock: FakeClock) -> None:
    dbd = FakeDbd([[rec("FAILED")]], readback_errors=1)
    out = record_writer.write_when_finished(dbd, JOB, "x", wait=5)
    assert out.startswith("written")


# was a bug (fixed): a sacct record with an empty State (sacct_json gives '' for a missing
# state.current) raises IndexError in the wait loop instead of waiting on
def test_record_without_state_is_waited_on(clock: FakeClock) -> None:
    dbd = FakeDbd([[rec("", end="Unknown")], [rec("FAILED")]])
    out = record_writer.write_when_finished(dbd, JOB, "x", wait=5, pause=1.0)
    assert out.startswith("written") and clock.sleeps == [1.0]


def test_spool_path() -> None:
    assert record_writer.spool_path("/var/spool/colloc", 12) == Path("/var/spool/colloc/12.adminc")


def test_spawn_runs_the_module_detached(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[Any, ...]] = []
    monkeypatch.setattr(record_writer, "spawn_module", lambda *a: seen.append(a))
    record_writer.spawn(9, Path("/s/9.adminc"), {"PATH": "/bin"})
    assert seen == [("slurm_colloc.node.record_writer", ("9", "/s/9.adminc"), {"PATH": "/bin"})]


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
    spool = tmp_path / f"{JOB}.adminc"
    monkeypatch.setattr(sys, "argv", ["record_writer", str(JOB), str(spool)])
    # node loggers are process-wide: start each test without file handlers
    lg = logging.getLogger("colloc.node.record-writer")
    for h in list(lg.handlers):
        lg.removeHandler(h)
    yield spool, log_file, made
    for h in list(lg.handlers):
        lg.removeHandler(h)
        h.close()


def test_main_writes_then_removes_spool(main_env, monkeypatch: pytest.MonkeyPatch) -> None:
    spool, log_file, made = main_env
    spool.write_text("  cl1:rec  \n")
    got: list[tuple[Any, ...]] = []

    def fake_write(adapter: Any, job_id: int, text: str) -> str:
        got.append((job_id, text))
        return "written (7 bytes, try 1)"

    monkeypatch.setattr(record_writer, "write_when_finished", fake_write)
    assert record_writer.main() == 0
    assert got == [(JOB, "cl1:rec")]  # stripped
    assert not spool.exists()
    # the Slurm tools get a fixed PATH and the two config variables, nothing else
    assert made == [{"env": {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
                             "SLURM_CONF": "/etc/slurm/slurm.conf",
                             "COLLOC_CONF": str(spool.parent / "colloc.conf")},
                     "timeout": 30}]
    assert f"record-writer: job {JOB}: written" in log_file.read_text()


def test_main_keeps_spool_on_failure_and_exits_0(main_env, monkeypatch) -> None:
    spool, log_file, _ = main_env
    spool.write_text("cl1:rec")

    def broken(adapter: Any, job_id: int, text: str) -> str:
        raise SlurmError("AdminComment not written after 8 tries: boom")

    monkeypatch.setattr(record_writer, "write_when_finished", broken)
    assert record_writer.main() == 0
    assert spool.read_text() == "cl1:rec"  # left for replay
    assert f"record not written, left in {spool}: AdminComment not written" in log_file.read_text()


def test_main_missing_spool_is_logged_not_raised(main_env, monkeypatch) -> None:
    _, log_file, _ = main_env
    monkeypatch.setattr(record_writer, "write_when_finished",
                        lambda *a: pytest.fail("must not write without a spool file"))
    assert record_writer.main() == 0
    assert "record not written" in log_file.read_text()


def test_main_caps_what_it_reads_from_the_spool(main_env, monkeypatch) -> None:
    spool, _, _ = main_env
    spool.write_text("a" * 70000)
    got: list[str] = []
    monkeypatch.setattr(record_writer, "write_when_finished",
                        lambda adapter, job_id, text: got.append(text) or "ok")
    record_writer.main()
    assert len(got[0]) == 65536


def test_main_survives_broken_config(main_env, monkeypatch, tmp_path, caplog) -> None:
    """A broken colloc.conf: no log file, but the record is still written."""
    spool, log_file, _ = main_env
    (tmp_path / "colloc.conf").write_text("this is = = not toml")
    with pytest.raises(cfgmod.ConfigError):
        cfgmod.load()
    spool.write_text("cl1:rec")
    monkeypatch.setattr(record_writer, "write_when_finished", lambda *a: "written")
    assert record_writer.main() == 0
    assert not spool.exists()
    assert not log_file.exists()
    assert [r.getMessage() for r in caplog.records] == [f"record-writer: job {JOB}: written"]
