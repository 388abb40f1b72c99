"""The interference model, and that its constants are what the Lucid data says."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from slurm_colloc.gpu.sim.interference import DEFAULT_MODEL, InterferenceModel

DATA = Path("/work/shared/data/colocation")
BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "interference_fit.py"


def test_no_slowdown_below_capacity():
    m = InterferenceModel(capacity_pct=100, alpha=0.5)
    assert m.rate([]) == 1.0
    assert m.rate([40, 50]) == 1.0
    assert m.rate([100, 100]) == pytest.approx(0.5**0.5)
    assert m.rate([100, 100, 100]) < m.rate([100, 100])


def test_default_model_matches_published_collocation_figures():
    # thesis (A100, MPS): 3-way collocation adds 50-110 % epoch time
    slowdown = 1 / DEFAULT_MODEL.rate([80, 80, 80]) - 1
    assert 0.3 <= slowdown <= 1.1
    # two small jobs share a GPU in about the time of one
    assert DEFAULT_MODEL.rate([35, 40]) == 1.0


@pytest.mark.skipif(not (DATA / "lucid_colocated_pairs.csv").exists(), reason="data not present")
def test_constants_are_the_fit_of_the_data():
    spec = importlib.util.spec_from_file_location("interference_fit", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    frame = mod.load_pairs(DATA)
    fitted = mod.fit(frame)
    assert fitted.capacity_pct == pytest.approx(DEFAULT_MODEL.capacity_pct, abs=3)
    assert fitted.alpha == pytest.approx(DEFAULT_MODEL.alpha, abs=0.05)
    errs = mod.errors(frame, lambda s: DEFAULT_MODEL.rate([s]))
    naive = mod.errors(frame, lambda s: 1.0)
    assert errs["mae"] < naive["mae"]
