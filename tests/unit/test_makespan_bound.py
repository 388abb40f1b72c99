"""benchmarks/makespan_bound.py: the arrival and work bounds by hand, the weights, the
real philly90h trace and reading whole-gpu's makespan from a summary CSV."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from slurm_colloc.bench import profiles
from slurm_colloc.bench.trace import TraceJob
from tests.unit.bench_scripts import BENCHMARKS, load

C = 1.08  # MPS_FIT.capacity


@pytest.fixture(scope="module")
def mb() -> ModuleType:
    return load("makespan_bound")


def job(name: str, arrival_s: float, work_s: float, sm_pct: float, gpus: int = 1,
        user: str = "u1") -> TraceJob:
    return TraceJob(name=name, arrival_s=arrival_s, size_class="light", model="m",
                    batch_size=1, peak_mib=1000, steady_mib=500, peak_at=0.5,
                    sm_pct=sm_pct, work_s=work_s, guess_mib=1000, gpus=gpus, user=user)


# SM activity at two knots of activity.UTIL_TO_SMACT, so the utilisation is exact:
# 46.3 % SM -> 54.5 % util, 21.6 % SM -> 36.5 % util.
JOBS = (
    job("a", 0.0, 3600.0, 46.3),
    job("b", 0.0, 7200.0, 21.6, user="u2"),
    job("c", 1800.0, 3600.0, 58.0, gpus=2),
)


def test_arrival_bound_is_the_latest_solo_finish(mb: ModuleType) -> None:
    assert mb.arrival_bound_s(JOBS) == 7200.0
    assert mb.arrival_bound_s(()) == 0.0


def test_work_bounds_by_hand_on_two_gpus(mb: ModuleType) -> None:
    # exclusive: t0=0: (3600 + 7200 + 2*3600) / 2 = 9000; t0=1800: 1800 + 7200/2 = 5400
    assert mb.work_bound_s(JOBS, 2, mb.exclusive_weight) == pytest.approx(9000.0)
    # time-sliced: t0=0: (0.545*3600 + 0.365*7200 + 7200) / 2 = 5895 > 5400
    assert mb.work_bound_s(JOBS, 2, mb.time_sliced_weight) == pytest.approx(5895.0)
    # one-server: t0=0: (0.463/C*3600 + 0.216/C*7200 + 7200) / 2 = 5091.7 < 5400 (t0=1800)
    t0_0 = (0.463 / C * 3600 + 0.216 / C * 7200 + 7200) / 2
    assert t0_0 == pytest.approx(5091.67, abs=0.01)
    assert mb.work_bound_s(JOBS, 2, mb.one_server_weight) == pytest.approx(5400.0)


def test_mode_bounds_take_the_larger_of_arrival_and_work(mb: ModuleType) -> None:
    arrival_h, modes = mb.mode_bounds(JOBS, 2)
    assert arrival_h == pytest.approx(2.0)
    got = {m.mode: (m.work_h, m.bound_h) for m in modes}
    assert list(got) == ["exclusive", "time-sliced", "one-server"]
    assert got["exclusive"] == pytest.approx((2.5, 2.5))
    assert got["time-sliced"] == pytest.approx((5895 / 3600, 2.0))
    assert got["one-server"] == pytest.approx((1.5, 2.0))


def test_jobs_arriving_together_all_count_from_their_arrival(mb: ModuleType) -> None:
    jobs = [job("x", 0.0, 100.0, 50.0), job("y", 1000.0, 3600.0, 50.0),
            job("z", 1000.0, 3600.0, 50.0)]
    # t0=1000 must hold both y and z: 1000 + 7200 / 1 (not 1000 + 3600)
    assert mb.work_bound_s(jobs, 1, mb.exclusive_weight) == pytest.approx(8200.0)
    with pytest.raises(ValueError):
        mb.work_bound_s(jobs, 0, mb.exclusive_weight)


def test_multi_gpu_jobs_weigh_one_in_the_shared_modes(mb: ModuleType) -> None:
    small_wide = job("w", 0.0, 100.0, 10.0, gpus=2)
    small = job("s", 0.0, 100.0, 10.0)
    for weight in (mb.exclusive_weight, mb.time_sliced_weight, mb.one_server_weight):
        assert weight(small_wide) == 1.0
    assert mb.time_sliced_weight(small) < 1.0
    assert mb.one_server_weight(small) == pytest.approx(0.10 / C)
    assert mb.time_sliced_weight(JOBS[0]) == pytest.approx(0.545)


def test_whole_makespan_from_a_summary_csv(mb: ModuleType, tmp_path: Path) -> None:
    committed = BENCHMARKS / "results" / "issue25_tl" / "philly90h_summary.csv"
    if committed.exists():
        assert mb.whole_makespan_from_summary(committed) == pytest.approx(13.5667)
    odd = tmp_path / "t_summary.csv"
    odd.write_text("Policy,makespan vs whole,Makespan h\n"
                   "colloc,0.8,10\nwhole-gpu,1.0,12\nwhole-gpu,1.0,14\nwhole-gpu,1.0,nan\n")
    assert mb.whole_makespan_from_summary(odd) == pytest.approx(13.0)
    (tmp_path / "bad_summary.csv").write_text("policy,makespan_vs_whole\nwhole-gpu,1.0\n")
    assert mb.whole_makespan_from_summary(tmp_path / "bad_summary.csv") is None
    assert mb.whole_makespan_from_summary(tmp_path / "missing.csv") is None


def test_report_ratios_and_target(mb: ModuleType) -> None:
    arrival_h, modes = mb.mode_bounds(JOBS, 2)
    r = mb.Report("philly90h", 3, 2, arrival_h, modes, 4.0, 0.65)
    d = json.loads(mb.report_json(r))
    assert d["arrival_ratio"] == pytest.approx(0.5)
    rows = {m["mode"]: m for m in d["modes"]}
    assert rows["exclusive"]["ratio"] == pytest.approx(2.5 / 4)
    assert rows["exclusive"]["below_target"] is True
    text = mb.report_text(mb.Report("t", 3, 2, arrival_h, modes, 3.0, 0.65))
    assert "ruled out (bound above)" in text and "not ruled out" not in text
    assert "-" in mb.report_text(mb.Report("t", 3, 2, arrival_h, modes, None, None))


@pytest.mark.skipif(not profiles.SHARED_DATA.exists(), reason="shared data not present")
def test_real_philly90h_bounds_are_ordered(mb: ModuleType, capsys: pytest.CaptureFixture[str]
                                           ) -> None:
    assert mb.main(["--trace", "philly90h", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["gpus"] == 4 and d["jobs"] == 90
    assert d["arrival_h"] == pytest.approx(7.61, abs=0.01)
    b = {m["mode"]: m["bound_h"] for m in d["modes"]}
    assert b["one-server"] <= b["time-sliced"] <= b["exclusive"]
    assert all(v >= d["arrival_h"] for v in b.values())
