"""Issue 13: the attempt summary carries a downsampled series for the accounting record."""

from __future__ import annotations

from pathlib import Path

from slurm_colloc.config import CollocConfig
from slurm_colloc.metrics import store
from slurm_colloc.metrics.summary import downsample, job_summary, summarize


def _row(t: float, mem: int, sm: float | None = None, util: float | None = None,
         n: int = 1, gpu: int = 0) -> store.Row:
    return store.Row(t=t, gpu=gpu, mem_mib=float(mem), mem_max_mib=mem, gpu_mem_mib=mem,
                     util_pct=util, sm_pct=sm, n=n)


def test_buckets_keep_max_memory_and_mean_sm() -> None:
    rows = [_row(1000 + i, 100 + i, sm=float(i % 10)) for i in range(100)]
    rows[37] = _row(1037, 9999, sm=50.0)
    s = downsample(rows, 10, start=990)
    assert len(s) == 10
    assert s[0][0] == 10  # seconds from the attempt's start to the first row
    assert [t for t, _, _ in s] == sorted(t for t, _, _ in s)
    assert max(m for _, m, _ in s) == 9999  # the peak survives
    assert s[3][1] == 9999
    assert s[0][2] == round(sum(i % 10 for i in range(10)) / 10)


def test_fewer_rows_than_points_and_one_row() -> None:
    rows = [_row(5, 10, sm=1.0), _row(6, 20, sm=3.0), _row(7, 5, sm=None)]
    assert downsample(rows, 48) == ((0, 10, 1), (1, 20, 3), (2, 5, None))
    assert downsample(rows[:1], 48) == ((0, 10, 1),)
    assert downsample(rows, 0) == () and downsample([], 48) == ()


def test_sm_falls_back_to_utilization_and_is_sample_weighted() -> None:
    rows = [_row(0, 1, sm=None, util=80.0, n=3), _row(0, 1, sm=20.0, n=1)]
    assert downsample(rows, 4) == ((0, 1, 65),)


def test_unsorted_and_multi_gpu_rows_and_start_after_first_row() -> None:
    rows = [_row(20, 7, gpu=1), _row(10, 3, gpu=0), _row(10, 4, gpu=1), _row(20, 1, gpu=0)]
    # start later than a row (clock skew): offsets never go below zero
    assert downsample(rows, 2, start=15) == ((0, 4, None), (5, 7, None))


def test_non_finite_values_do_not_break_it() -> None:
    rows = [_row(float("nan"), 5), _row(3, 6, sm=float("nan")), _row(4, 7, sm=10.0)]
    assert downsample(rows, 8) == ((0, 6, None), (1, 7, 10))


def test_summarize_without_points_has_no_series() -> None:
    s, _ = summarize([_row(1, 2)])
    assert s is not None and s.series == ()
    s, _ = summarize([_row(1, 2)], points=4)
    assert s is not None and s.series == ((0, 2, None),)


def test_job_summary_uses_series_points_and_the_prologs_start(tmp_path: Path) -> None:
    cfg = CollocConfig(metrics_dir=str(tmp_path), series_points=12)
    store.write_meta(cfg.metrics_dir, store.JobMeta(job_id=55, attempt=1, uid=1000, gpus=(0,),
                                                    start=1_000_000.0))
    p = store.series_path(cfg.metrics_dir, 55, 1)
    store.ensure_dir(p.parent)
    rows = [_row(1_000_030 + 10 * i, 1000 + i, sm=40.0) for i in range(500)]
    p.write_text(store.HEADER + "\n" + "".join(r.line() for r in rows))
    s, _ = job_summary(cfg, 55, 1)
    assert s is not None and s.peak_mib == 1499 and s.samples == 500
    assert len(s.series) == 12 and s.series[0] == (30, 1041, 40)
    assert s.series[-1][1] == 1499
    s, _ = job_summary(CollocConfig(metrics_dir=str(tmp_path), series_points=0), 55, 1)
    assert s is not None and s.series == ()
