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


def test_the_suffix_names_what_the_script_waited_for(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Issue 28: a burst's prolog took seconds of wall for 0.03 s of CPU and its line
    did not say why. Root's lock waits and the Slurm/MPS calls are tallied
    (:mod:`slurm_colloc.waits`) and the suffix names those of at least 0.05 s; the line
    still parses."""
    import fcntl
    import os
    import threading

    from slurm_colloc import waits
    from slurm_colloc.mps.tenancy import Tenancy

    waits.reset()
    tenancy = Tenancy(tmp_path / "mps")
    with tenancy.locked(0):
        pass  # creates the lock file
    holder = os.open(tenancy.gpu_dir(0) / "lock", os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)
    threading.Timer(0.3, os.close, (holder,)).start()
    watch = timing.Stopwatch()
    with tenancy.locked(0):  # waits ~0.3 s for the holder, then holds it ~0.1 s
        time.sleep(0.1)
    with waits.timed("squeue"):
        time.sleep(0.01)  # too short to be shown
    line = f"job 7: shared gpu=0 {watch.suffix()}"
    assert "; gpu lock 0." in line and "squeue" not in line
    assert ", gpu held 0.1" in line  # what this holder cost the GPU's other prologs
    got = timing.parse_timing(line)
    assert got is not None and got[0] >= 0.25
    assert timing.Stopwatch().suffix().endswith(" s]")  # a fresh watch: no waits shown
