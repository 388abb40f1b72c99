"""When the collector ran: the events file and the gaps a job's report names."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slurm_colloc.metrics import liveness
from slurm_colloc.metrics.liveness import ALIVE, DOWN, STOP, UP, Event, gaps

T = 1_000_000.0


def ev(*pairs: tuple[float, str]) -> list[Event]:
    return [Event(T + t, k, 1) for t, k in pairs]


def test_a_job_covered_throughout_has_no_gap() -> None:
    events = ev((0, UP), (30, ALIVE), (60, ALIVE), (90, ALIVE))
    assert gaps(events, T + 5, T + 95, now=T + 100) == []


def test_a_crash_and_the_restart_backoff_are_a_gap() -> None:
    events = ev((0, UP), (30, ALIVE), (40, DOWN), (70, UP), (100, ALIVE))
    assert gaps(events, T + 5, T + 110, now=T + 120) == [(T + 40, T + 70)]


def test_a_collector_that_went_silent_is_taken_as_gone() -> None:
    """Its supervisor was killed (no event): covered only until the stale limit."""
    events = ev((0, UP), (30, ALIVE))
    out = gaps(events, T + 5, T + 300, now=T + 400)
    assert out == [(T + 30 + liveness.STALE_AFTER_S, T + 300)]


def test_short_start_up_gaps_are_not_reported_and_no_record_is_unknown() -> None:
    events = ev((0, STOP), (101, UP), (130, ALIVE))
    assert gaps(events, T + 100, T + 140, now=T + 150) == []  # 1 s to start: grace
    assert gaps([], T, T + 10, now=T + 20) is None
    assert gaps(ev((500, UP)), T, T + 600, now=T + 700) is None  # before any record


def test_a_running_job_is_measured_until_now() -> None:
    events = ev((0, UP), (20, DOWN))
    assert gaps(events, T + 5, None, now=T + 80) == [(T + 20, T + 80)]


def test_events_file_round_trip_rotation_and_junk(tmp_path: Path) -> None:
    m = tmp_path / "m"
    m.mkdir()
    liveness.append_event(m, UP, 7, "start", now=T)
    liveness.append_event(m, DOWN, 7, "exit 1: ValueError: a\tb\nc\x1b[31m", now=T + 1)
    with open(m / liveness.EVENTS, "a") as f:
        f.write("junk line\n1\tup\tx\t\n")
    got = liveness.read_events(m)
    assert [(e.kind, e.pid) for e in got] == [(UP, 7), (DOWN, 7)]
    assert "\n" not in got[1].detail and "\t" not in got[1].detail
    assert "\x1b" not in got[1].detail
    big = "x" * 200
    for i in range(liveness.MAX_EVENTS_BYTES // 200 + 10):
        liveness.append_event(m, ALIVE, 7, big, now=T + 2 + i)
    assert (m / (liveness.EVENTS + ".1")).exists()
    assert os.path.getsize(m / liveness.EVENTS) < liveness.MAX_EVENTS_BYTES
    assert liveness.read_events(m)[0].t == T  # the previous file is read too


def test_a_planted_events_file_is_refused(tmp_path: Path) -> None:
    m = tmp_path / "m"
    m.mkdir()
    (m / liveness.EVENTS).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):
        liveness.append_event(m, UP, 1)
    assert not (tmp_path / "elsewhere").exists()
