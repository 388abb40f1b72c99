"""The replay's sampler notes when each job first had a process on a GPU (issue 24).

The start lag (Slurm start -> first process) was inferred from memory steps in 1 s
samples (2 trace minutes at x120); the sim's records carry the job id and the wall
time the process registered, so the sampler's ledger gives it to the millisecond.
"""

from __future__ import annotations

import os
from pathlib import Path

from slurm_colloc.bench.sampler import GpuSampler
from slurm_colloc.gpu.sim.state import ProcRecord, init_state, process_start_ticks, write_record


def test_the_sampler_records_each_jobs_first_process_on_a_gpu(tmp_path: Path) -> None:
    state = tmp_path / "sim"
    init_state(state, gpu_count=2)
    pid = os.getpid()  # a live process (records of dead ones are skipped)
    ticks = process_start_ticks(pid)
    assert ticks is not None
    write_record(state, ProcRecord(pid=pid, gpu=1, uid=os.getuid(), used_mib=1000, sm_pct=30.0,
                                   start_ticks=ticks, job_id="4242", started=1234.5))
    sampler = GpuSampler(state)
    sampler.sample_once()
    assert sampler.ledger.first_on_gpu("4242") == 1234.5
    assert sampler.ledger.first_on_gpu("9999") is None
    assert any(p.processes == 1 for p in sampler.points if p.gpu == 1)


def test_several_hosts_gpus_are_numbered_across_the_cluster(tmp_path: Path) -> None:
    """Two hosts of two GPUs: host 1's GPU 0 is the cluster's GPU 2, in the points and in
    the ledger (one name per GPU, or a multi-node replay's series would mix hosts)."""
    hosts = [tmp_path / "node0" / "sim", tmp_path / "node1" / "sim"]
    for d in hosts:
        init_state(d, gpu_count=2)
    pid = os.getpid()
    ticks = process_start_ticks(pid)
    assert ticks is not None
    write_record(hosts[1], ProcRecord(pid=pid, gpu=0, uid=os.getuid(), used_mib=2000,
                                      sm_pct=50.0, start_ticks=ticks, job_id="77",
                                      started=99.0))
    sampler = GpuSampler(hosts)
    sampler.sample_once()
    assert sorted({p.gpu for p in sampler.points}) == [0, 1, 2, 3]
    assert [p.gpu for p in sampler.points if p.processes] == [2]
    assert sampler.ledger.seen["77"].gpus == frozenset({2})
    assert sampler.ledger.first_on_gpu("77") == 99.0
