"""Issue 26 item 4: the report says when a job's sampling had gaps.

Gap finding (:mod:`slurm_colloc.metrics.gaps`, with hypothesis properties), the
epilog's summary keeping them, the record carrying them (old records still decode),
and the report's text, JSON and HTML showing them."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_colloc.accounting import codec
from slurm_colloc.accounting.record import Attempt, JobRecord, MetricsSummary
from slurm_colloc.config import CollocConfig
from slurm_colloc.metrics import gaps, liveness, store
from slurm_colloc.metrics.summary import job_summary
from slurm_colloc.report import html as html_report
from slurm_colloc.report import job as job_report
from slurm_colloc.report import text as text_report
from slurm_colloc.report.sampling import sampling_line
from tests.unit.test_report_build import CFG, COLLOCATED, Fake, comment, row


def rows_at(ts: list[float], n: int = 1) -> list[store.Row]:
    return [store.Row(t=t, gpu=0, mem_mib=1.0, mem_max_mib=1, gpu_mem_mib=1, n=n) for t in ts]


# ------------------------------------------------------------------ finding ---


def test_a_full_series_has_no_gap_and_a_hole_in_it_is_one() -> None:
    full = rows_at([100.0 + i for i in range(120)])
    assert gaps.sampling_gaps(full, 100.0, 220.0, 1.0) == []
    holed = [r for r in full if r.t < 160]  # killed at 160
    got = gaps.sampling_gaps(holed, 100.0, 220.0, 1.0, down=[(160.0, 222.0)])
    assert got == [gaps.Gap(160.0, 220.0, "collector")]


def test_a_short_hole_is_jitter_and_merged_rows_cover_their_samples() -> None:
    assert gaps.sampling_gaps(rows_at([100.0, 101.0, 103.5, 104.5]), 100.0, 105.5, 1.0) == []
    # compacted rows of 8 samples every 8 s leave no hole
    assert gaps.sampling_gaps(rows_at([100.0 + 8 * i for i in range(10)], n=8),
                              100.0, 180.0, 1.0) == []


def test_edges_count_only_when_the_collector_explains_them() -> None:
    r = rows_at([130.0 + i for i in range(30)])  # job touched its GPU at 130, left at 160
    assert gaps.sampling_gaps(r, 100.0, 200.0, 1.0) == []  # loading, then CPU work: normal
    got = gaps.sampling_gaps(r, 100.0, 200.0, 1.0, down=[(160.0, 200.0)])
    assert got == [gaps.Gap(160.0, 200.0, "collector")]
    inner = gaps.sampling_gaps(rows_at([100.0, 101.0, 150.0, 151.0]), 100.0, 152.0, 1.0)
    assert inner == [gaps.Gap(102.0, 150.0, "job")]  # between two programs


def test_no_rows_at_all_with_the_collector_down_is_one_gap() -> None:
    assert gaps.sampling_gaps([], 0.0, 60.0, 1.0, down=[(0.0, 60.0)]) == [
        gaps.Gap(0.0, 60.0, "collector")]
    assert gaps.sampling_gaps([], 0.0, 60.0, 1.0) == []
    assert gaps.sampling_gaps(rows_at([1.0]), 60.0, 60.0, 1.0) == []


times = st.lists(st.floats(min_value=0, max_value=500, allow_nan=False), max_size=80)


@settings(max_examples=300, deadline=None)
@given(ts=times, interval=st.sampled_from([0.5, 1.0, 2.0, 5.0]),
       start=st.floats(min_value=-50, max_value=200), length=st.floats(min_value=0.1, max_value=600),
       down=st.lists(st.tuples(st.floats(0, 600), st.floats(0, 100)), max_size=4))
def test_gap_properties(ts: list[float], interval: float, start: float, length: float,
                        down: list[tuple[float, float]]) -> None:
    end = start + length
    spans = [(a, a + d) for a, d in down]
    got = gaps.sampling_gaps(rows_at(ts), start, end, interval, spans)
    assert len(got) <= gaps.MAX_GAPS
    prev = start
    for g in got:
        assert prev <= g.start < g.end <= end  # inside the attempt, sorted, disjoint
        prev = g.end
        assert g.seconds > gaps.GAP_FACTOR * interval  # never jitter
        assert g.cause in (gaps.COLLECTOR, gaps.JOB)
        for t in ts:  # no sample's own interval falls inside a gap
            assert not (g.start < t and t + interval < g.end) or not (start <= t < end)
        if g.cause == gaps.JOB:  # the job's own holes are never at the edges
            assert g.start > start and g.end < end
    assert sum(g.seconds for g in got) <= length + 1e-6


@settings(max_examples=200, deadline=None)
@given(n=st.integers(10, 200), cut_from=st.integers(0, 199), cut=st.integers(5, 80))
def test_removed_samples_are_found_as_one_gap(n: int, cut_from: int, cut: int) -> None:
    ts = [1000.0 + i for i in range(n)]
    hole = (1000.0 + cut_from, 1000.0 + cut_from + cut)
    kept = [t for t in ts if not hole[0] <= t < hole[1]]
    got = gaps.sampling_gaps(rows_at(kept), 1000.0, 1000.0 + n, 1.0, down=[hole])
    lost = min(hole[1], 1000.0 + n) - max(hole[0], 1000.0)
    if lost > max(gaps.GAP_FACTOR, gaps.EDGE_GRACE_S):
        assert len(got) == 1 and got[0].cause == "collector"
        assert abs(got[0].seconds - lost) <= 1.0
    elif lost <= gaps.GAP_FACTOR:
        assert got == []


# --------------------------------------------------------- collector's records ---


def test_collector_down_since_its_last_sample_when_no_collector_holds_the_lock(
        tmp_path: Path) -> None:
    m = tmp_path / "m"
    hb = liveness.Heartbeat(m)
    hb.beat()
    hb.close()
    now = time.time()
    last = (m / liveness.PRIVATE_DIR / liveness.HEARTBEAT).stat().st_mtime
    down = gaps.collector_down(str(m), now - 100, now + 50, now + 50)
    assert len(down) == 1 and abs(down[0][0] - last) < 1 and down[0][1] == now + 50
    fd = liveness.acquire_lock(m)  # a collector runs: the heartbeat says nothing
    try:
        assert gaps.collector_down(str(m), now - 100, now + 50, now + 50) == []
    finally:
        import os

        os.close(fd)  # type: ignore[arg-type]


def test_a_stalled_worker_counts_as_down_for_the_stall_before_its_kill(
        tmp_path: Path) -> None:
    m = tmp_path / "m"
    fd = liveness.acquire_lock(m)  # a collector runs now (restarted after the stall)
    assert fd is not None
    try:
        liveness.append_event(m, liveness.UP, 1, now=1000.0)
        liveness.append_event(m, liveness.ALIVE, 1, now=1030.0)
        liveness.append_event(m, liveness.STALLED, 1, "no sample for 60s: killed", now=1100.0)
        liveness.append_event(m, liveness.UP, 2, now=1101.0)
        down = gaps.collector_down(str(m), 1000.0, 1200.0, 1200.0, stall_s=60.0)
        assert (1040.0, 1100.0) in down
        rows = rows_at([1000.0 + i for i in range(40)] + [1102.0 + i for i in range(98)])
        assert gaps.sampling_gaps(rows, 1000.0, 1200.0, 1.0, down) == [
            gaps.Gap(1040.0, 1102.0, "collector")]
    finally:
        import os

        os.close(fd)


def test_job_summary_keeps_the_gap_the_killed_collector_left(tmp_path: Path) -> None:
    cfg = CollocConfig(metrics_dir=str(tmp_path / "m"), series_points=8)
    t0 = time.time() - 120
    store.write_meta(cfg.metrics_dir, store.JobMeta(55, 0, 1000, (0,), start=t0))
    w = store.SeriesWriter(store.series_path(cfg.metrics_dir, 55, 0), 1000)
    for r in rows_at([t0 + 1 + i for i in range(38)]):  # sampled 39 s, then killed
        w.append(r)
    w.close()
    hb = liveness.Heartbeat(cfg.metrics_dir)
    import os

    os.utime(tmp_path / "m" / liveness.PRIVATE_DIR / liveness.HEARTBEAT, (t0 + 39, t0 + 39))
    hb.close()
    summ, _ = job_summary(cfg, 55, 0, now=t0 + 120)
    assert summ is not None and summ.span_s == 120
    assert summ.gaps == ((39, 81, "collector"),)


# ------------------------------------------------------------------ record ---


def test_gaps_round_trip_and_old_records_still_decode() -> None:
    m = MetricsSummary(peak_mib=10, samples=5, gaps=((39, 81, "collector"), (5, 7, "job")),
                       span_s=120)
    rec = JobRecord((Attempt(0, metrics=m, start=1000, end=1120),))
    back = codec.decode(codec.encode(rec))
    assert back.attempts[0].metrics == m
    old = JobRecord((Attempt(0, metrics=replace(m, gaps=(), span_s=None)),))
    back = codec.decode(codec.encode(old)).attempts[0].metrics
    assert back is not None and back.gaps == () and back.span_s is None


def test_bad_gaps_are_dropped_not_the_record() -> None:
    for bad in ([[1, 2, "x"]], [[1, "2", "c"]], [[-1, 2, "c"]], "c", [[1, 2]] * 3,
                [[0, 1, "c"]] * (codec.MAX_GAPS + 1), [[True, 1, "c"]]):
        assert codec._gaps_from_json(bad) == ()
    assert codec._span(-1) is None and codec._span(True) is None and codec._span(60) == 60


# ------------------------------------------------------------------ report ---


def _world(metrics: MetricsSummary) -> Fake:
    a = replace(COLLOCATED, metrics=metrics, start=int(time.mktime((2026, 1, 5, 12, 0, 0, 0, 0, -1))),
                end=None)
    a = replace(a, end=(a.start or 0) + 120)
    return Fake(rows={"10": [row("10", "COMPLETED", comment(a))]})


def test_the_report_says_when_the_collector_stopped() -> None:
    m = replace(COLLOCATED.metrics, gaps=((65, 81, "collector"),), span_s=120)  # type: ignore[type-var]
    rep = job_report.build("10", _world(m), CFG)
    a = rep.to_json()["attempts"][0]
    assert a["sampling"]["unsampled_s"] == 81 and a["sampling"]["span_s"] == 120
    assert a["sampling"]["source"] == "record"
    assert [g["cause"] for g in a["sampling"]["gaps"]] == ["collector"]
    line = sampling_line(rep.attempts[0].sampling)
    assert line == "sampling: 81 s of 120 s unsampled (collector stopped 12:01:05-12:02:26)"
    from rich.console import Console

    con = Console(record=True, width=120, color_system=None)
    con.print(text_report.render(rep))
    assert "sampling: 81 s of 120 s unsampled (collector stopped 12:01:05-12:02:26)" in \
        con.export_text()
    assert "collector stopped 12:01:05-12:02:26" in html_report.render(rep)


def test_no_gaps_no_line_and_an_old_record_says_nothing() -> None:
    m = replace(COLLOCATED.metrics, gaps=(), span_s=120)  # type: ignore[type-var]
    rep = job_report.build("10", _world(m), CFG)
    assert rep.attempts[0].sampling == {"span_s": 120, "unsampled_s": 0, "source": "record",
                                        "gaps": []}
    assert sampling_line(rep.attempts[0].sampling) is None
    old = job_report.build("10", _world(COLLOCATED.metrics), CFG)  # type: ignore[arg-type]
    assert old.attempts[0].sampling is None


def test_a_running_jobs_gaps_come_from_its_node_local_series() -> None:
    from tests.unit.test_report_build import world

    w = world()
    s = w.ser[("10", 0)]
    s.rows = [r for r in s.rows if not 1020 <= r.t < 1040]
    rep = job_report.build("10", w, CFG)
    smp = rep.attempts[0].sampling
    assert smp is not None and smp["source"] == "series"
    assert smp["gaps"] == [{"from": 1020, "to": 1040, "cause": "job"}]
