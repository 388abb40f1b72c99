"""The n-tenant interference model (issue 14): per tenant, saturation, published checks."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from slurm_colloc.gpu.sim.interference import (
    DEFAULT_MODEL,
    TIME_SLICED,
    rate_for,
    saturation_stretch,
    thread_cap,
)

DATA = Path("/work/shared/data/colocation")
REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks" / "interference_fit.py"
RESULT = REPO / "benchmarks" / "results" / "interference.json"


@dataclass(frozen=True)
class P:
    pid: int
    sm_pct: float
    mps_server: int = 7


def test_each_tenant_has_its_own_rate():
    busy, light = DEFAULT_MODEL.rates([95, 20])
    assert busy < light < 1.0  # the busier job suffers more from the same pair
    tenants = [P(1, 95), P(2, 20)]
    assert rate_for(tenants, 1) == pytest.approx(busy)
    assert rate_for(tenants, 2) == pytest.approx(light)
    assert rate_for(tenants, 99) == pytest.approx(busy)  # unknown pid: the first


def test_slowdown_grows_with_tenants_and_is_bounded_by_saturation():
    prev = 1.0
    for n in range(2, 9):
        s = DEFAULT_MODEL.slowdowns([60] * n)[0]
        assert s > prev
        prev = s
        # n jobs of 60 % cannot all run faster than the GPU's capacity allows
        assert 0.6 * n / s <= DEFAULT_MODEL.capacity + 1e-6 or 0.6 * n <= DEFAULT_MODEL.capacity


def test_saturation_stretch():
    assert saturation_stretch([0.5, 0.5], 1.0) == 1.0
    k = saturation_stretch([1.0, 1.0], 1.0)
    assert k == pytest.approx(2.0, rel=1e-6)
    us = [0.9, 0.4, 0.7]
    k = saturation_stretch(us, 1.25)
    assert sum(u / ((1 - u) + u * k) for u in us) == pytest.approx(1.25, rel=1e-6)


def test_published_multi_job_figures():
    # typical jobs from the Lucid singles: training (label >= 1) median 72.9 %,
    # small (CIFAR-10) median 44.4 %; published A100 MPS: 1.5-2.1x and 2-2.5x
    assert 1.5 <= DEFAULT_MODEL.slowdowns([72.9] * 3)[0] <= 2.1
    assert 2.0 <= DEFAULT_MODEL.slowdowns([44.4165] * 7)[0] <= 2.5


def test_separate_servers_time_slice_and_are_never_kinder():
    one = [P(1, 80, 7), P(2, 80, 7), P(3, 80, 7)]
    users = [P(1, 80, 7), P(2, 80, 8), P(3, 80, 9)]
    assert rate_for(users, 1) < rate_for(one, 1)
    # three contexts at 80 % cannot get more than one GPU's time between them
    assert 3 * 0.8 * rate_for(users, 1) <= 1.0 + 1e-6
    assert TIME_SLICED.rate([30, 30]) == DEFAULT_MODEL.rate([30, 30])  # below saturation


def test_thread_percentage_slows_the_capped_job():
    # alone at 80 % demand, capped to 40 %: half speed; co-tenants see 40 % of pressure
    assert thread_cap(80, 40) == pytest.approx(0.5)
    capped = DEFAULT_MODEL.rates([40, 80])
    uncapped = DEFAULT_MODEL.rates([80, 80])
    assert capped[1] > uncapped[1]
    assert thread_cap(80, 40) * capped[0] < uncapped[0]


@pytest.mark.skipif(not (DATA / "lucid_colocated_pairs.csv").exists(), reason="data not present")
def test_committed_json_is_what_the_script_prints():
    spec = importlib.util.spec_from_file_location("interference_fit", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = mod.report(DATA)
    assert set(r["pairs_holdout"]) == {"median_abs_err", "p90_abs_err"}
    assert set(r["multiway"]) == {"3", "7"}
    committed = json.loads(RESULT.read_text())
    assert committed["pairs_holdout"] == r["pairs_holdout"]
    assert committed["multiway"] == r["multiway"]
    # better than the previous model and than "no slowdown" on the same held-out folds
    base = r["baselines_holdout"]
    assert r["pairs_holdout"]["median_abs_err"] < base["no slowdown"]["median_abs_err"]
    assert r["pairs_holdout"]["median_abs_err"] < base["previous min(1,96/S)^0.52"]["median_abs_err"]
