"""The replay benchmark's whole path on tiny clusters: submit, wait, collect, metrics.

Its own two devclusters (whole-GPU and colloc; own roots and ports, so it never
touches the session cluster), four short jobs, one of which under-states its memory
and must be recovered by colloc's OOM requeue. Proves that outcomes come back from
sacct and the AdminComment records, not from the replayer's bookkeeping.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slurm_colloc.bench import policies
from slurm_colloc.bench.replayer import ReplayConfig
from slurm_colloc.bench.run import replay
from slurm_colloc.bench.trace import Trace, TraceJob

ROOT_BASE = os.environ.get("COLLOC_REPLAY_TEST_ROOT", "/var/lib/colloc-replay-e2e")
PORT_BASE = int(os.environ.get("COLLOC_REPLAY_TEST_PORT_BASE", "29810"))


def _job(i: int, peak: int, guess: int, work: float, arrival: float) -> TraceJob:
    return TraceJob(
        name=f"smoke-{i}", arrival_s=arrival, size_class="light", model="simjob",
        batch_size=8, peak_mib=peak, steady_mib=peak // 2, peak_at=0.3, sm_pct=50.0,
        work_s=work, guess_mib=guess, summary="", source="test",
    )


def test_replay_collects_from_accounting(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("the replay smoke test starts devclusters and needs root")
    trace = Trace("smoke", "smoke", gpus=2, gpu_memory_mib=16384, jobs=(
        _job(0, 4000, 5120, 600, 0), _job(1, 4000, 5120, 600, 0),
        _job(2, 6000, 3072, 600, 60),  # under-states its memory: OOM, requeue, completes
        _job(3, 3000, 4096, 600, 120),
    ))
    cfg = ReplayConfig(time_scale=60, root_base=ROOT_BASE, port_base=PORT_BASE, poll_s=1.0,
                       timeout_s=150, settle_s=40)
    rows, rp, wall = replay(trace, policies.get(["whole-gpu", "colloc"]), cfg, {}, tmp_path)
    by = {r.policy: r for r in rows}
    assert by["whole-gpu"].completed == 4 and by["whole-gpu"].lost == 0
    assert by["colloc"].completed == 4 and by["colloc"].lost == 0
    colloc = next(r for r in rp.runs if r.policy.name == "colloc")
    oom = {o.name: o for o in colloc.outcomes}["smoke-2"]
    # from the epilog's cl1 record and sacct's rows of each attempt
    assert (oom.oom_crashes, oom.requeues, oom.attempts, oom.state) == (1, 1, 2, "COMPLETED")
    assert oom.mode == "explicit" and oom.need_mib == 3072
    assert by["colloc"].oom_crashes == 1 and by["whole-gpu"].oom_crashes == 0
    assert by["whole-gpu"].energy_kwh > 0 and 0 < by["colloc"].gpu_busy_share <= 1
    assert (tmp_path / "smoke.csv").exists() and (tmp_path / "smoke.md").exists()
    assert wall < 180


def test_replay_on_two_hosts_numbers_gpus_across_them(tmp_path: Path) -> None:
    """``--nodes 2`` (issue 24 item 6): the trace's two GPUs as two hosts of one, each in
    its own namespaces with its own simulated GPU, collector and MPS. Every job is seen
    on a GPU by the ledger, both hosts' GPUs are used and named apart, and the OOM job
    is still recovered by the epilog's requeue."""
    if os.geteuid() != 0:
        pytest.fail("the replay smoke test starts devclusters and needs root")
    trace = Trace("smoke2", "smoke on two hosts", gpus=2, gpu_memory_mib=16384, jobs=(
        _job(0, 4000, 5120, 600, 0), _job(1, 9000, 10240, 600, 0),
        _job(2, 6000, 3072, 600, 60),  # under-states its memory: OOM, requeue, completes
        _job(3, 3000, 4096, 600, 120),
    ))
    cfg = ReplayConfig(time_scale=60, root_base=f"{ROOT_BASE}-n2", port_base=PORT_BASE + 50,
                       poll_s=1.0, timeout_s=150, settle_s=40, nodes=2)
    rows, rp, _ = replay(trace, policies.get(["colloc"]), cfg, {}, tmp_path)
    (row,) = rows
    (run,) = rp.runs
    assert run.cluster.spec.nodes == 2 and run.cluster.spec.gpus == 1
    assert (row.completed, row.lost, row.oom_crashes) == (4, 0, 1), run.outcomes
    assert run.sampler is not None
    assert {p.gpu for p in run.sampler.points} == {0, 1}
    used = set().union(*(s.gpus for s in run.sampler.ledger.seen.values()))
    assert used == {0, 1}  # 5 + 10 GiB do not fit one 16 GiB GPU: both hosts ran jobs
    assert all(o.first_on_gpu is not None for o in run.outcomes)
    oom = {o.name: o for o in run.outcomes}["smoke-2"]
    assert (oom.oom_crashes, oom.requeues, oom.state) == (1, 1, "COMPLETED")
    assert "2 compute hosts of 1 GPUs" in (tmp_path / "smoke2.md").read_text()
