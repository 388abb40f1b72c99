"""Issue 24 item 5: a job within its reservation never runs a simulated GPU out of memory.

Slurm's shards bound the sum of the jobs' allocations on a GPU; the budget
(:mod:`slurm_colloc.gpu.budget`) must leave room for everything else the simulated GPU
charges (:func:`slurm_colloc.gpu.sim.simjob.room`, :func:`~slurm_colloc.gpu.sim.state.
gpu_used_mib`): the driver's reserve and one MPS server per user with jobs on the GPU.
The property runs that very arithmetic over tenant mixes: any number of users, any
shard split, footprints up to each job's shards, contexts and peaks in any order.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu.budget import GpuBudget, budget
from slurm_colloc.gpu.sim.simjob import room
from slurm_colloc.gpu.sim.state import ProcRecord, SimSpec, gpu_used_mib


@dataclass
class Tenant:
    """One shard job on the GPU: its user, shards, footprints (steady, peak)."""

    uid: int
    shards: int
    steady: int
    peak: int
    used: int = 0
    context: bool = False


def spec_of(memory: int, reserved: int, context: int, server: int) -> SimSpec:
    return SimSpec(gpu_count=1, memory_mib=memory, name="sim", idle_power_w=50.0,
                   max_power_w=400.0, time_scale=1.0, node_id="0" * 32,
                   reserved_mib=reserved, context_mib=context, server_mib=server)


def grow(spec: SimSpec, b: GpuBudget, tenants: list[Tenant], i: int, to: int) -> bool:
    """Tenant ``i`` grows to footprint ``to`` as the simjob does; False if refused."""
    me = tenants[i]
    if me.context and to <= me.used:
        return True
    others = [t for k, t in enumerate(tenants) if k != i and t.context]
    records = [ProcRecord(pid=1000 + k, gpu=0, uid=t.uid, used_mib=t.used, sm_pct=0.0,
                          start_ticks=0, mps_server=1) for k, t in enumerate(others)]
    servers = len({t.uid for t in others} | {me.uid})
    pinned = b.pinned_limit_mib(me.shards)
    # the prolog caps the user's server at the sum of the user's pinned limits, and a
    # client gets the smaller of that and its own: its own, for every job counted
    server_cap = sum(b.pinned_limit_mib(t.shards) for t in tenants if t.uid == me.uid)
    limit = min(pinned, server_cap)
    _, gpu_free, free = room(spec, gpu_used_mib(spec, records, servers), me.used, limit)
    context = not me.context
    extra = spec.context_mib if context else to - me.used
    if extra > (gpu_free if context else free):
        return False
    me.used += extra
    me.context = True
    return not context or grow(spec, b, tenants, i, to)


@st.composite
def gpu_and_tenants(draw: st.DrawFn, cap: int) -> tuple[SimSpec, GpuBudget, list[Tenant], list[int]]:
    memory = draw(st.integers(8_000, 82_000))
    reserved = draw(st.integers(0, 1024))
    context = draw(st.integers(0, 1024))
    server = draw(st.integers(0, 512))
    shard = draw(st.sampled_from([256, 512, 1000, 1024, 2048]))
    cfg = CollocConfig(shard_mib=shard, cuda_context_mib=context, mps_server_mib=server,
                       mps_servers_per_gpu=cap, gpu_reserved_mib=reserved)
    b = budget(cfg, memory, reserved)
    assume(b.shards_per_gpu >= 1)
    spec = spec_of(memory, reserved, context, server)
    left, tenants = b.shards_per_gpu, []
    users = draw(st.integers(1, cap if cap else 64))
    while left > 0 and len(tenants) < 40:
        shards = draw(st.integers(1, left))
        alloc = shards * shard
        if alloc < context:  # no footprint within this reservation holds a context
            break
        # the edge is where the bugs are: a footprint of all its shards, often
        peak = draw(st.one_of(st.just(alloc), st.integers(max(context, 1), alloc)))
        steady = draw(st.one_of(st.just(peak), st.integers(max(context, 1), peak)))
        tenants.append(Tenant(draw(st.integers(0, users - 1)) if cap else len(tenants),
                              shards, steady, peak))
        left -= shards
        if draw(st.integers(0, 7)) == 0:  # mostly fill the GPU's shards
            break
    assume(tenants)
    # every tenant reaches its steady footprint, then its peak, in a drawn order
    steps = draw(st.permutations([k for k in range(len(tenants)) for _ in (0, 1)]))
    return spec, b, tenants, steps


def replay(spec: SimSpec, b: GpuBudget, tenants: list[Tenant], steps: list[int]) -> list[int]:
    """The steps in order; the tenants refused although within their reservation."""
    refused, seen = [], set()
    for k in steps:
        t = tenants[k]
        to = t.peak if k in seen else t.steady
        seen.add(k)
        if not grow(spec, b, tenants, k, to):
            refused.append(k)
    return refused


@settings(max_examples=300, deadline=None)
@given(gpu_and_tenants(cap=0))
def test_no_job_within_its_shards_is_refused_whatever_the_users(case) -> None:
    """Legacy MPS, one server per user on the GPU, users unbounded: the budget counts
    a server per job, so no mix of users and jobs within their shards runs out."""
    spec, b, tenants, steps = case
    assert replay(spec, b, tenants, steps) == []


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4).flatmap(lambda cap: gpu_and_tenants(cap=cap)))
def test_no_job_within_its_shards_is_refused_within_the_sites_server_cap(case) -> None:
    """A site that promises at most N servers per GPU (mps_servers_per_gpu = N), and
    keeps it (here: at most N users on the GPU), gets the same guarantee."""
    spec, b, tenants, steps = case
    assert replay(spec, b, tenants, steps) == []


def test_a_third_user_on_an_80gb_gpu_found_the_gap() -> None:
    """The defect: servers budgeted per GPU were a fixed count (2) however many users
    shared it. An H100 80 GB (81,559 MiB, 512 reserved) then offered 79 shards with
    23 MiB of slack; three users' jobs filling them ran the GPU out of memory. With a
    server per job budgeted (mps_servers_per_gpu = 0) the GPU offers 74 shards and the
    same three jobs fit."""
    spec = spec_of(81_559, 512, 512, 64)
    two = budget(CollocConfig(mps_servers_per_gpu=2, gpu_reserved_mib=512), 81_559, 512)
    assert two.shards_per_gpu == (81_559 - 512 - 2 * 64) // 1024 == 79
    gap = [Tenant(u, s, s * 1024, s * 1024) for u, s in enumerate([77, 1, 1])]
    assert replay(spec, two, gap, [0, 1, 2]) == [2]  # the third user's server: no room
    b = budget(CollocConfig(mps_servers_per_gpu=0, gpu_reserved_mib=512), 81_559, 512)
    assert b.shards_per_gpu == 74
    assert b.servers_for(74) == 74 and b.usable_mib == 81_559 - 512 - 74 * 64
    split = [b.shards_per_gpu - 2, 1, 1]
    tenants = [Tenant(u, s, s * 1024, s * 1024) for u, s in enumerate(split)]
    assert replay(spec, b, tenants, [0, 1, 2]) == []


@pytest.mark.parametrize(("cap", "memory", "want"), [
    (2, 40_960, 39), (2, 81_920, 79), (1, 40_960, 39), (0, 40_960, 37), (0, 81_920, 74),
])
def test_shards_per_gpu_by_server_cap(cap: int, memory: int, want: int) -> None:
    """A cap of 2 keeps the old figures (39 on a 40 GiB GPU); 0 budgets the worst case."""
    b = budget(CollocConfig(mps_servers_per_gpu=cap, gpu_reserved_mib=512), memory, 512)
    assert b.shards_per_gpu == want
    fits = 512 + want * 1024 + b.servers_for(want) * 64 <= memory
    over = 512 + (want + 1) * 1024 + b.servers_for(want + 1) * 64 > memory
    assert fits and over
