"""Fair replay (issue 14): common-window energy, per GPU-hour, summaries, held-out traces."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from slurm_colloc.bench import generators, metrics, policies, report
from slurm_colloc.bench.collect import JobOutcome
from slurm_colloc.bench.replayer import job_script
from slurm_colloc.bench.sampler import GpuPoint
from slurm_colloc.bench.trace import TraceJob, jobs_from_csv, jobs_to_csv


def _job(**kw: object) -> TraceJob:
    base: dict[str, object] = dict(
        name="j0", arrival_s=0.0, size_class="light", model="m", batch_size=32,
        peak_mib=3000, steady_mib=2800, peak_at=0.1, sm_pct=60.0, work_s=3600.0,
        guess_mib=4096, summary="m", source="test",
    )
    base.update(kw)
    return TraceJob(**base)  # type: ignore[arg-type]


def _done(name: str, end: float) -> JobOutcome:
    return JobOutcome(name, 1, "COMPLETED", 1, 0.0, 0.0, end, 0, 0, "gpu=1", None, "")


def test_energy_over_the_common_window_counts_idle_after_the_end() -> None:
    # one GPU at 100 W (1 J per sample second x scale 1): the early policy ends at 5,
    # the replay's last policy at 10: the early one pays 10 s of energy, not 5
    pts = [GpuPoint(t, 0, 0, 0.0, 100.0, 100.0 * t, 0) for t in range(11)]
    outs = [_done("a", 5.0)]
    m = metrics.policy_metrics("t", "colloc", outs, pts, t0=0.0, scale=3600.0, n_jobs=1,
                               fallbacks=0, wall_s=5.0, common_end=10.0,
                               work_gpu_s={"a": 7200.0})
    assert m.energy_kwh == 500.0 / 3.6e6
    assert m.energy_common_kwh == 1000.0 / 3.6e6
    assert m.completed_gpu_h == 2.0 and m.kwh_per_gpu_h == m.energy_common_kwh / 2.0
    assert metrics.last_end(outs, 0.0) == 5.0 and metrics.last_end([], 3.0) == 3.0


def test_ratios_and_summary_median_and_range() -> None:
    def row(policy: str, makespan: float, e: float, scale: float = 120.0) -> metrics.PolicyMetrics:
        return metrics.PolicyMetrics(
            "t", policy, 10, 10, 0, makespan, 1.0, 2.0, 0.1, 0.5, e, 0, 0, 0, math.nan,
            math.nan, 1.0, energy_common_kwh=e, completed_gpu_h=10.0, kwh_per_gpu_h=e / 10,
            time_scale=scale)

    runs = [metrics.relative_to([row("whole-gpu", 10, 100), row("colloc", m, e)])
            for m, e in ((6, 80), (5, 90), (7, 85))]
    assert runs[0][1].makespan_vs_whole == 0.6 and runs[0][1].energy_common_vs_whole == 0.8
    rows = {r["policy"]: r for r in report.summary_rows(runs)}
    c = rows["colloc"]
    assert c["runs"] == 3 and c["makespan_vs_whole_median"] == 0.6
    assert (c["makespan_vs_whole_min"], c["makespan_vs_whole_max"]) == (0.5, 0.7)
    assert c["energy_common_vs_whole_median"] == 0.85
    md = report.summary_markdown(list(rows.values()))
    assert "| x120 | colloc | 3 | 0.60x [0.50x-0.70x]" in md
    assert "energy kWh (common window) | vs whole" in report.markdown_table(runs[0])
    assert report.summary_csv([]) == ""


def test_multi_gpu_jobs_ask_for_whole_gpus_under_every_policy() -> None:
    j = _job(gpus=2)
    for p in policies.POLICIES.values():
        if p.name in policies.DIAGNOSTIC:
            continue
        assert p.args(j, Path("/x/m.txt"), 1024) == ["--gres=gpu:2"]
    script = job_script(j)
    assert '"${devs[@]:0:2}"' in script and "wait" in script and "exec" not in script
    assert "exec " in job_script(_job())


def test_trace_csv_keeps_gpus_and_users_and_reads_old_files() -> None:
    jobs = (_job(gpus=2, user="colloc-r1"), _job(name="j1"))
    assert jobs_from_csv(jobs_to_csv(jobs)) == jobs
    # the last three columns (gpus, user, util_pct) are newer than the old files
    old = "\n".join(line.rsplit(",", 3)[0] for line in jobs_to_csv(jobs).splitlines())
    assert [j.gpus for j in jobs_from_csv(old)] == [1, 1]


def test_held_out_split_is_the_estimators() -> None:
    # the hash split of benchmarks/estimator_accuracy.py (30 % held out)
    import hashlib

    for m in ("resnet18", "vit_base_patch16_224", "beitv2_base_patch16_224", "convnext_tiny"):
        h = int(hashlib.sha256(m.encode()).hexdigest()[:8], 16)
        assert generators.held_out(m) == ((h % 1000) < 300)
    share = sum(generators.held_out(f"model{i}") for i in range(2000)) / 2000
    assert 0.25 < share < 0.35


def test_held_out_traces_use_only_held_out_summaries() -> None:
    from slurm_colloc.bench.profiles import LucidProfile

    lucid = [LucidProfile("ResNet18", "CIFAR-10", 32, False, 1.0, 58.0, 2360),
             LucidProfile("ResNet50", "ImageNet", 128, False, 1.0, 100.0, 13326),
             LucidProfile("BERT", "SQuAD", 32, False, 1.0, 99.7, 20162)]
    names = [f"model{i}" for i in range(60)]
    peaks = {}
    for i, n in enumerate(names):
        peaks[(n, 8)] = 2000 + 500 * (i % 50)
    pools = generators.ProfilePools(lucid, peaks, dict.fromkeys(names, "s"),
                                    held_out_only=True)
    t = generators.philly90h(pools)
    assert len(t.jobs) == 90 and sum(j.gpus == 2 for j in t.jobs) == 3
    assert all(generators.held_out(j.summary) for j in t.jobs if j.summary)
    assert {j.user for j in t.jobs} <= set(generators.REPLAY_USERS)
    assert len({j.user for j in t.jobs}) == 4


def test_idle_while_queued() -> None:
    samples = [(0.0, 0), (1.0, 0), (2.0, 1), (3.0, 0)]
    # a job waits from 0.5 to 2.5: idle samples inside it: t=1 only
    assert metrics.idle_while_queued(samples, [(0.5, 2.5)]) == 0.25
    assert metrics.idle_while_queued(samples, []) == 0.0
    assert math.isnan(metrics.idle_while_queued([], [(0, 1)]))


def test_nodes_split_the_traces_gpus_over_alike_hosts() -> None:
    """--nodes 2: the one-node run's 4 GPUs as two hosts of 2 (same capacity), in one
    partition with shards; an uneven split or a job wider than a host is refused."""
    from slurm_colloc.bench.replayer import ReplayConfig, cluster_for, gpus_per_node, sim_dirs
    from slurm_colloc.bench.trace import Trace

    trace = Trace("t", "test", 4, 40960, (_job(), _job(name="j1", gpus=2)))
    c = cluster_for(trace, policies.POLICIES["colloc"], 1, ReplayConfig(nodes=2))
    assert (c.spec.nodes, c.spec.gpus, c.spec.uniform) == (2, 2, True)
    assert [n.partition for n in c.spec.node_plans()] == ["gpu", "gpu"]
    assert [d.parent.name for d in sim_dirs(c)] == ["colloc-node0", "colloc-node1"]
    one = cluster_for(trace, policies.POLICIES["colloc"], 1, ReplayConfig())
    assert (one.spec.nodes, one.spec.gpus, sim_dirs(one)) == (1, 4, [one.layout.sim])
    assert one.spec.mps_protocol == "2"
    v3 = cluster_for(trace, policies.POLICIES["colloc-v3"], 2, ReplayConfig())
    assert v3.spec.mps_protocol == "3" and "colloc-v3" in policies.DIAGNOSTIC  # opt-in
    pack = cluster_for(trace, policies.POLICIES["colloc-pack"], 3, ReplayConfig())
    assert not pack.spec.spread_shards and one.spec.spread_shards
    assert "colloc-pack" in policies.DIAGNOSTIC
    for nodes, why in ((3, "split evenly"), (4, "asks for 2")):
        try:
            gpus_per_node(trace, nodes)
        except ValueError as e:
            assert why in str(e)
        else:
            raise AssertionError(f"--nodes {nodes} accepted")


def test_replay_refuses_a_bad_node_count_before_any_cluster(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.unit.bench_scripts import load

    mod = load("replay")
    assert mod.main(["--trace", "philly90h", "--nodes", "3", "--results", str(tmp_path),
                     "--root-base", str(tmp_path / "never")]) == 2
    assert "split evenly" in capsys.readouterr().err
    assert not (tmp_path / "never-whole-gpu").exists() and not list(tmp_path.iterdir())


def test_time_limits_are_whole_wall_minutes_of_the_scaled_work() -> None:
    """--time-limit-factor: backfill needs limits to keep GPUs free for a job that
    needs them whole (a multi-GPU job, an OOM recovery); none by default."""
    from slurm_colloc.bench.replayer import ReplayConfig, time_limit_args

    job = _job(work_s=3600.0)  # 1 trace hour: 60 s of wall time at x60
    assert time_limit_args(job, ReplayConfig(time_scale=60)) == []
    assert time_limit_args(job, ReplayConfig(time_scale=60, time_limit_factor=3)) == ["--time=3"]
    assert time_limit_args(job, ReplayConfig(time_scale=60, time_limit_factor=2.5)) == [
        "--time=3"]  # 150 s rounds up to 3 minutes
    short = _job(work_s=60.0)  # 1 s of wall time: never a zero limit (Slurm: unlimited)
    assert time_limit_args(short, ReplayConfig(time_scale=60, time_limit_factor=3)) == [
        "--time=1"]


def test_a_negative_time_limit_factor_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from tests.unit.bench_scripts import load

    assert load("replay").main(["--trace", "philly90h", "--time-limit-factor", "-1"]) == 2
    assert "must be 0 (no limits) or positive" in capsys.readouterr().err
