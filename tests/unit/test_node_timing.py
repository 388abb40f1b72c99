"""The ``[took W s, cpu C s]`` suffix of every Prolog/Epilog log line (issue 28)."""

from __future__ import annotations

import time

from hypothesis import given
from hypothesis import strategies as st

from slurm_colloc.node import timing


def test_the_suffix_reads_back_as_what_it_measured() -> None:
    watch = timing.Stopwatch()
    end = time.monotonic() + 0.05
    while time.monotonic() < end:  # burn some CPU so cpu > 0 is possible
        pass
    line = f"job 7: shared gpu=0 limit_mib=4096 {watch.suffix()}"
    got = timing.parse_timing(line)
    assert got is not None
    wall, cpu = got
    assert 0.04 <= wall < 5.0
    assert 0.0 <= cpu < 5.0


@given(st.floats(0, 1e4), st.floats(0, 1e4))
def test_parse_timing_round_trips(wall: float, cpu: float) -> None:
    got = timing.parse_timing(f"x [took {wall:.2f} s, cpu {cpu:.2f} s]")
    assert got == (float(f"{wall:.2f}"), float(f"{cpu:.2f}"))


def test_lines_without_the_suffix_are_not_timed() -> None:
    assert timing.parse_timing("job 7: shared gpu=0") is None
    assert timing.parse_timing("[took 1 s, cpu 1 s] and then more") is None
