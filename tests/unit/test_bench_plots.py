"""The replay's plots: a run of one policy (colloc-oracle alone) ends with its figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_colloc.bench import plots


def test_no_series_draws_nothing_instead_of_failing_the_replay(tmp_path: Path) -> None:
    # a one-policy replay (--policies colloc-oracle) had no whole-gpu/colloc series and
    # ended in matplotlib's "Number of rows must be a positive integer, not 0"
    out = tmp_path / "gpus.png"
    plots.gpu_timelines({}, 0.0, 120.0, out)
    assert not out.exists()


def test_one_policy_gets_its_timeline(tmp_path: Path) -> None:
    if not plots.available():
        pytest.fail("matplotlib is part of the dev extra: run make venv")
    from slurm_colloc.bench.sampler import GpuPoint

    point = GpuPoint(t=1.0, gpu=0, memory_mib=1024, sm_pct=50.0, power_w=200.0,
                     energy_j=0.0, processes=1)
    out = tmp_path / "gpus.png"
    plots.gpu_timelines({"colloc-oracle": [point]}, 0.0, 120.0, out)
    assert out.stat().st_size > 0
