"""The burst benchmark's reading of the node log and its statistics (issue 28)."""

from __future__ import annotations

from slurm_colloc.bench import burst

LOG = """\
2026-11-28 15:00:00,001 colloc: prolog: job 11: shared gpu=0 limit_mib=4096 4 shards [took 0.41 s, cpu 0.27 s]
2026-11-28 15:00:00,002 colloc: epilog: job 11: released [took 0.10 s, cpu 0.05 s]
2026-11-28 15:00:01,000 colloc: prolog: job 12: job runs without MPS: slurmctld did not answer
2026-11-28 15:00:02,000 colloc: prolog: job 13: internal error, job runs without MPS: X: y [took 3.00 s, cpu 0.50 s]
2026-11-28 15:00:03,000 colloc: prolog: job 11: exclusive gpu=1 limit_mib=None whole GPU [took 12.50 s, cpu 0.30 s]
2026-11-28 15:00:04,000 colloc: prolog: job 99: shared gpu=2 [took 1.00 s, cpu 1.00 s]
"""


def test_prolog_runs_reads_every_timed_prolog_line_of_the_jobs() -> None:
    runs = burst.prolog_runs(LOG.splitlines(), [11, 12, 13])
    assert [(r.job_id, r.mode, r.wall_s, r.cpu_s) for r in runs] == [
        (11, "shared", 0.41, 0.27), (13, "internal", 3.0, 0.5), (11, "exclusive", 12.5, 0.3)]
    assert len(burst.prolog_runs(LOG.splitlines())) == 4  # no filter: job 99 too


def test_a_users_forged_suffix_in_the_middle_of_a_line_is_not_a_timing() -> None:
    line = "x colloc: prolog: job 5: shared [took 0.01 s, cpu 0.01 s] gpu=0"
    assert burst.prolog_runs([line]) == []


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert burst.percentile(values, 50) == 50.0
    assert burst.percentile(values, 99) == 99.0
    assert burst.percentile(values, 100) == 100.0
    assert burst.percentile([3.0, 1.0, 2.0], 99) == 3.0
    assert burst.percentile([7.0], 50) == 7.0
    assert burst.percentile([], 50) is None


def test_summarize_and_losses() -> None:
    runs = burst.prolog_runs(LOG.splitlines(), [11, 13])
    s = burst.summarize(runs)
    assert s["prologs"] == 3
    assert s["wall_p50_s"] == 3.0 and s["wall_p99_s"] == 12.5 and s["wall_max_s"] == 12.5
    assert s["cpu_p50_s"] == 0.3 and s["cpu_total_s"] == 1.07
    assert burst.summarize([])["wall_p99_s"] is None
    assert burst.lost_jobs({1: "COMPLETED", 2: "FAILED", 3: "MISSING"}) == [2, 3]
    assert burst.lost_requeues({1: 1, 2: 0}, [1, 2, 3]) == [2, 3]


def test_markdown_holds_the_command_and_the_figures() -> None:
    out = {"jobs": 150, "oom_jobs": 30, "submit_s": 2.4, "done_s": 300.0, "lost_jobs": [],
           "lost_requeues": [], "variant": "baseline",
           "prolog": burst.summarize(burst.prolog_runs(LOG.splitlines()))}
    md = burst.markdown(out, "prolog_burst.py --jobs 150")
    assert "`prolog_burst.py --jobs 150`" in md and "150 (30)" in md and "0 / 0" in md
    assert "12.5" in md
    assert "nice" not in md  # an older result: nothing modelled to say
    md = burst.markdown({**out, "submitter_nice": -10, "controller_nice": 0}, "p")
    assert "| submitters' / controller's nice (0: as is) | -10 / 0 |" in md
