"""Issue 24: SM activity from utilisation, co-located tenants' combined activity, power."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slurm_colloc.bench.trace import TraceJob, jobs_from_csv, jobs_to_csv
from slurm_colloc.gpu.sim.activity import (
    combined_pct,
    sm_activity_from_util,
    util_from_sm_activity,
)
from slurm_colloc.gpu.sim.backend import SimBackend
from slurm_colloc.gpu.sim.power import power_w
from slurm_colloc.gpu.sim.state import ProcRecord, init_state, process_start_ticks, write_record

DATA = Path("/work/shared/data")


def test_util_maps_to_gpumemnet_sm_activity():
    # DCGM SMACT ~0.18/0.39/0.62/0.78 at GPU util 20-40/40-60/60-80/80-90 % (issue 24)
    for util, smact in ((35, 18), (50, 39), (70, 62), (85, 78)):
        assert sm_activity_from_util(util) == pytest.approx(smact, abs=4)
    xs = [sm_activity_from_util(u) for u in range(0, 101)]
    assert xs == sorted(xs) and xs[0] == 0 and xs[-1] < 100
    for u in (5, 33, 61, 99):
        assert util_from_sm_activity(sm_activity_from_util(u)) == pytest.approx(u)


def test_combined_activity_is_below_the_capped_sum_as_lucid_measured():
    assert combined_pct([40.0]) == pytest.approx(40.0)
    both = combined_pct([40.0, 40.0])
    assert 64.0 < both < 80.0  # between the independent union and the capped sum
    assert combined_pct([90.0, 90.0]) > 98.0
    assert combined_pct([]) == 0.0


def test_power_is_sublinear_two_half_jobs_on_one_gpu_cost_less_than_on_two():
    idle, top = 55.0, 400.0
    one_gpu = power_w(combined_pct([40, 40]), idle, top)
    two_gpus = 2 * power_w(40, idle, top)
    assert one_gpu < two_gpus - idle  # more than the freed GPU's idle floor is saved
    assert power_w(0, idle, top) == idle and power_w(100, idle, top, dram_pct=70) == top
    assert power_w(5, idle, top) > idle + 0.1 * (top - idle)  # active floor


def _rec(pid: int, sm: float) -> ProcRecord:
    ticks = process_start_ticks(pid)
    assert ticks is not None
    return ProcRecord(pid=pid, gpu=0, uid=os.getuid(), used_mib=100, sm_pct=sm,
                      start_ticks=ticks)


def test_backend_reports_combined_not_capped_sum(tmp_path):
    # fails with the old backend: SM activity min(100, 60 + 60) = 100
    init_state(tmp_path)
    write_record(tmp_path, _rec(os.getpid(), 60.0))
    write_record(tmp_path, _rec(os.getppid(), 60.0))
    s = SimBackend(tmp_path).sample(0)
    assert s.sm_activity_pct == pytest.approx(combined_pct([60, 60]))
    assert s.sm_activity_pct < 95.0
    assert s.utilization_pct is not None and s.utilization_pct >= s.sm_activity_pct
    assert s.power_w == pytest.approx(power_w(s.sm_activity_pct, 55, 400))


def test_trace_keeps_both_utilisation_and_sm_activity():
    j = TraceJob(name="a", arrival_s=0.0, size_class="light", model="m", batch_size=8,
                 peak_mib=3000, steady_mib=2800, peak_at=0.1, sm_pct=21.0, work_s=900.0,
                 guess_mib=4096, util_pct=36.0)
    assert jobs_from_csv(jobs_to_csv([j])) == (j,)
    old = "\n".join(line.rsplit(",", 1)[0] for line in jobs_to_csv([j]).splitlines())
    assert jobs_from_csv(old)[0].util_pct == 0.0  # a trace before issue 24 still reads


@pytest.mark.skipif(not DATA.exists(), reason="shared data not present")
def test_generated_jobs_carry_sm_activity_mapped_from_lucid_util():
    from slurm_colloc.bench.generators import ProfilePools, philly90
    from slurm_colloc.bench.profiles import load_lucid, load_summaries, load_timm_peaks

    pools = ProfilePools(load_lucid(), load_timm_peaks(), load_summaries())
    for j in philly90(pools).jobs:
        assert j.util_pct > 0
        assert j.sm_pct == pytest.approx(max(0.1, sm_activity_from_util(j.util_pct)), abs=0.2)
        assert j.sm_pct <= j.util_pct


@pytest.mark.skipif(not DATA.exists(), reason="shared data not present")
def test_stored_fits_match_the_data():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "power_fit", Path(__file__).resolve().parents[2] / "benchmarks" / "power_fit.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    o = mod.overlap()
    assert o["fitted_weight"] == pytest.approx(o["stored_weight"], abs=0.02)
    assert o["held_out"]["median"] < o["held_out_capped_sum"]["median"]
    u = mod.util_curve()
    assert u["held_out"]["median"] < 5.0


def test_power_model_on_the_h100_runs_gemm_and_small_kernels_within_ten_percent():
    # benchmarks/results/hardware: the assumed DRAM term (0.25) put the median error at
    # 13 % on these runs and copies (high DRAM) drew the least power; without it 7 %
    import json

    hw = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "hardware"
    errs = []
    for path in sorted(hw.glob("h100_colocation_run*.json")):
        doc = json.loads(path.read_text())
        idle, top = doc["idle"]["power_w"], doc["gpu"]["power_limit_w"]
        for mode in doc["modes"]:
            for r in mode["runs"]:
                if "B" in r["combo"]:
                    continue
                model = power_w(r["sm_active_pct"], idle, top, r["dram_bw_pct"])
                errs.append(abs(model - r["power_w"]) / r["power_w"])
    assert len(errs) >= 80
    errs.sort()
    assert errs[len(errs) // 2] < 0.10
