"""Measured peaks at other batch sizes -> a peak at this one (slurm_colloc.estimators.history_scaling)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slurm_colloc.estimators import SqliteHistory, estimate, parse_summary
from slurm_colloc.estimators.history_scaling import FIT_MARGIN, HISTORY_MARGIN, scale_history

DATA = Path(__file__).parent / "data" / "summaries"


def never(_b: int) -> int:
    raise AssertionError("the summary estimator must not be consulted")


def test_no_points_is_no_answer() -> None:
    assert scale_history({}, 32, never) is None
    assert scale_history({0: 100, 8: 0}, 32, never) is None  # junk rows are ignored


def test_exact_batch_wins() -> None:
    s = scale_history({32: 10000, 64: 15000}, 32, never)
    assert s is not None and s.method == "exact" and s.estimator == "history"
    assert s.estimate_mib == 10500


def test_fit_interpolates_and_extrapolates_on_the_line() -> None:
    pts = {16: 3000 + 100 * 16, 64: 3000 + 100 * 64}
    mid = scale_history(pts, 32, never)
    assert mid is not None and mid.method == "fit" and mid.estimator == "history-fit"
    assert mid.peak_mib == pytest.approx(3000 + 100 * 32)
    assert mid.estimate_mib == pytest.approx((3000 + 3200) * (1 + FIT_MARGIN), abs=1)
    far = scale_history(pts, 256, never)
    assert far is not None and far.peak_mib == pytest.approx(3000 + 100 * 256)


def test_fit_never_goes_below_a_measured_smaller_batch() -> None:
    # a transient spike at batch 16 (cuDNN benchmark trials) pulls the line's slope
    # negative: the slope is clamped and the answer is at least the spike's peak
    s = scale_history({16: 9000, 32: 5000, 64: 6000}, 48, never)
    assert s is not None
    assert s.estimate_mib >= 9000 * (1 + HISTORY_MARGIN)


def test_anchor_adds_the_estimators_growth_above_the_measured_batch() -> None:
    cold = {8: 4000, 64: 9000}
    s = scale_history({8: 3000}, 64, cold.__getitem__)
    assert s is not None and s.method == "anchored"
    assert s.estimate_mib == pytest.approx(3000 * (1 + HISTORY_MARGIN) + 5000, abs=1)


def test_anchor_caps_a_smaller_batch_by_the_measured_peak() -> None:
    s = scale_history({64: 6000}, 8, {8: 7000}.__getitem__)
    assert s is not None and s.estimate_mib == 6300  # measured at a larger batch bounds it
    s = scale_history({64: 6000}, 8, {8: 5000}.__getitem__)
    assert s is not None and s.estimate_mib == 5000  # the estimator is already lower


@given(st.dictionaries(st.integers(1, 4096), st.integers(1, 80000), min_size=1, max_size=6),
       st.integers(1, 4096))
def test_answer_is_positive_and_covers_every_smaller_measured_peak(
        pts: dict[int, int], batch: int) -> None:
    s = scale_history(pts, batch, lambda b: 1000 + 10 * b)
    assert s is not None and s.estimate_mib > 0
    if len(pts) >= 2 or batch in pts:
        assert all(s.estimate_mib >= p for b, p in pts.items() if b <= batch)


def test_store_and_estimate_use_other_batch_sizes(tmp_path: Path) -> None:
    text = (DATA / "resnet50_torchinfo.txt").read_text()
    fp = parse_summary(text).fingerprint()
    store = SqliteHistory(tmp_path / "history.sqlite")
    assert store.peaks(fp, None, "adam", "fp32") == {}  # no db yet
    store.record(fp, 16, None, "adam", "fp32", 5000)
    store.record(fp, 64, None, "adam", "fp32", 11000)
    store.record(fp, 64, None, "sgd", "fp32", 8000)  # another optimizer: another key
    assert store.peaks(fp, None, "adam", "fp32") == {16: 5000, 64: 11000}
    e = estimate(text, batch_size=32, history=store)
    assert e.estimator == "history-fit"
    assert e.estimate_mib == pytest.approx(7000 * (1 + FIT_MARGIN), abs=1)
    assert sum(e.breakdown.values()) == pytest.approx(e.estimate_mib, abs=1)
    assert "line through" in e.notes[0]
    other = estimate(text, batch_size=32, history=store, optimizer="momentum")
    assert other.estimator == "layer-aware"  # nothing measured for that key
