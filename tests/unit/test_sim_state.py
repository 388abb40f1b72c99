"""The sim state dir and SimBackend: memory, dead processes, concurrency, power, energy."""

from __future__ import annotations

import multiprocessing
import os
import stat
import subprocess
import sys
import time

import pytest

from slurm_colloc.gpu.backend import GpuBackend, GpuBackendError
from slurm_colloc.gpu.sim import SimBackend, init_state, load_spec
from slurm_colloc.gpu.sim.activity import combined_pct
from slurm_colloc.gpu.sim.power import power_w
from slurm_colloc.gpu.sim.state import (
    DEFAULT_CONTEXT_MIB,
    DEFAULT_RESERVED_MIB,
    DEFAULT_SERVER_MIB,
    ProcRecord,
    advance_energy,
    gpu_lock,
    process_start_ticks,
    read_records,
    remove_record,
    write_record,
)


def record(
    pid: int, gpu: int = 0, mib: int = 1024, sm: float = 50.0, server: int = 0
) -> ProcRecord:
    ticks = process_start_ticks(pid)
    assert ticks is not None
    return ProcRecord(
        pid=pid,
        gpu=gpu,
        uid=os.getuid(),
        used_mib=mib,
        sm_pct=sm,
        start_ticks=ticks,
        mps_server=server,
    )


def test_init_state_layout_and_modes(tmp_path):
    spec = init_state(tmp_path / "s", gpu_count=2, memory_mib=81920)
    assert load_spec(tmp_path / "s") == spec
    assert "80GB" in spec.name
    assert stat.S_IMODE(os.stat(tmp_path / "s" / "procs").st_mode) == 0o1777
    assert stat.S_IMODE(os.stat(tmp_path / "s" / "gpus" / "gpu1.ledger").st_mode) == 0o666
    # idempotent, keeps node id (UUIDs stable across devcluster restarts)
    assert init_state(tmp_path / "s", gpu_count=2, memory_mib=81920).node_id == spec.node_id


@pytest.mark.parametrize("kwargs", [{"gpu_count": 0}, {"memory_mib": 0}, {"idle_power_w": 500}])
def test_init_state_rejects_nonsense(tmp_path, kwargs):
    with pytest.raises(ValueError):
        init_state(tmp_path, **kwargs)


def test_backend_implements_interface(tmp_path):
    init_state(tmp_path, gpu_count=3)
    b = SimBackend(tmp_path)
    assert isinstance(b, GpuBackend) and b.name == "sim"
    gpus = b.gpus()
    assert [g.index for g in gpus] == [0, 1, 2]
    assert len({g.uuid for g in gpus}) == 3 and all(g.uuid.startswith("GPU-") for g in gpus)
    assert [g.minor_number for g in gpus] == [0, 1, 2]
    assert [g.pci_bus_id for g in gpus] == [
        "00000000:10:00.0",
        "00000000:11:00.0",
        "00000000:12:00.0",
    ]
    assert all(g.reserved_mib == DEFAULT_RESERVED_MIB for g in gpus)
    samples = b.sample_all()
    # an idle GPU shows the driver's reserve as used, as nvidia-smi does
    assert [s.memory_used_mib for s in samples] == [DEFAULT_RESERVED_MIB] * 3
    assert samples[0].power_w == pytest.approx(55.0)
    with pytest.raises(GpuBackendError):
        b.sample(3)


def test_memory_is_sum_of_live_records_and_dead_ones_are_cleaned(tmp_path):
    init_state(tmp_path)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        write_record(tmp_path, record(os.getpid(), mib=4096, sm=30))
        write_record(tmp_path, record(child.pid, mib=2048, sm=40))
        write_record(tmp_path, record(os.getpid(), gpu=1, mib=100))
        s = SimBackend(tmp_path).sample(0)
        assert s.memory_used_mib == DEFAULT_RESERVED_MIB + 6144
        assert sorted(p.pid for p in s.processes) == sorted([os.getpid(), child.pid])
        # issue 24: tenants' activities combine as the Lucid pairs measured, not as a sum
        assert s.sm_activity_pct == pytest.approx(combined_pct([30, 40]))
        assert s.power_w == pytest.approx(power_w(combined_pct([30, 40]), 55, 400))
    finally:
        child.kill()
        child.wait()
    s = SimBackend(tmp_path).sample(0)
    assert s.memory_used_mib == DEFAULT_RESERVED_MIB + 4096  # the dead process no longer counts
    assert not (tmp_path / "procs" / f"gpu0.{child.pid}.json").exists()  # and is cleaned
    remove_record(tmp_path, 0, os.getpid())
    remove_record(tmp_path, 0, os.getpid())  # idempotent


def test_reused_pid_is_not_mistaken_for_the_old_process(tmp_path):
    init_state(tmp_path)
    rec = record(os.getpid())
    write_record(tmp_path, ProcRecord(**{**rec.__dict__, "start_ticks": rec.start_ticks - 1}))
    assert read_records(tmp_path, 0) == []


def test_malformed_record_is_skipped(tmp_path):
    init_state(tmp_path)
    (tmp_path / "procs" / "gpu0.1.json").write_text("{not json")
    write_record(tmp_path, record(os.getpid(), mib=7))
    assert [r.used_mib for r in read_records(tmp_path, 0)] == [7]


def _grab(state_dir: str, want: int, results) -> None:
    """Child: take `want` MiB on GPU 0 if it fits, under the GPU lock."""
    with gpu_lock(state_dir, 0):
        used = sum(r.used_mib for r in read_records(state_dir, 0))
        ok = used + want <= 40960
        if ok:
            write_record(state_dir, record(os.getpid(), mib=want))
    results.put(ok)
    time.sleep(1.0)  # hold the memory while the others try


def test_concurrent_allocations_never_overcommit(tmp_path):
    init_state(tmp_path)
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_grab, args=(str(tmp_path), 10240, results)) for _ in range(6)]
    for p in procs:
        p.start()
    oks = [results.get(timeout=10) for _ in procs]
    for p in procs:
        p.join()
    assert sum(oks) == 4  # exactly four 10 GiB jobs fit on a 40 GiB GPU


def test_energy_counter_is_monotonic_and_integrates_power(tmp_path):
    init_state(tmp_path, time_scale=1.0)
    b = SimBackend(tmp_path)
    e0 = b.sample(0).energy_j
    with gpu_lock(tmp_path, 0) as fd:
        t = time.time()
        advance_energy(tmp_path, b.spec, 0, fd, now=t)
        write_record(tmp_path, record(os.getpid(), sm=100))
        e1 = advance_energy(tmp_path, b.spec, 0, fd, now=t + 10)  # 10 s at full power
        e2 = advance_energy(tmp_path, b.spec, 0, fd, now=t + 10)
    assert e0 is not None and e1 >= e0
    assert e2 == pytest.approx(e1)
    remove_record(tmp_path, 0, os.getpid())
    e3 = b.sample(0).energy_j
    assert e3 is not None and e3 >= e1


def test_energy_rate_matches_power_model(tmp_path):
    init_state(tmp_path)
    spec = load_spec(tmp_path)
    with gpu_lock(tmp_path, 0) as fd:
        t = time.time()
        a = advance_energy(tmp_path, spec, 0, fd, now=t)
        b = advance_energy(tmp_path, spec, 0, fd, now=t + 100)  # idle
        write_record(tmp_path, record(os.getpid(), sm=50))
        c = advance_energy(tmp_path, spec, 0, fd, now=t + 200)
    remove_record(tmp_path, 0, os.getpid())
    assert b - a == pytest.approx(100 * 55.0)
    assert c - b == pytest.approx(100 * power_w(50, 55, 400))


def test_time_scale_env_speeds_up_energy(tmp_path, monkeypatch):
    init_state(tmp_path)
    spec = load_spec(tmp_path)
    monkeypatch.setenv("COLLOC_SIM_TIME_SCALE", "60")
    with gpu_lock(tmp_path, 0) as fd:
        t = time.time()
        a = advance_energy(tmp_path, spec, 0, fd, now=t)
        b = advance_energy(tmp_path, spec, 0, fd, now=t + 1)
    assert b - a == pytest.approx(60 * 55.0)


def test_power_model_is_a100_like():
    assert power_w(0, 55, 400) == 55
    assert power_w(100, 55, 400) == 400
    assert power_w(150, 55, 400) == 400  # summed demand is capped
    assert 55 < power_w(50, 55, 400) < 400


# --- overheads: reserve, MPS servers, contexts (issue 12) ---------------------------------


def test_spec_carries_the_overheads_and_init_state_takes_them(tmp_path):
    spec = init_state(tmp_path / "d")
    assert (spec.reserved_mib, spec.context_mib, spec.server_mib) == (512, 512, 64)
    assert (DEFAULT_RESERVED_MIB, DEFAULT_CONTEXT_MIB, DEFAULT_SERVER_MIB) == (512, 512, 64)
    custom = init_state(tmp_path / "c", reserved_mib=0, context_mib=300, server_mib=30)
    assert load_spec(tmp_path / "c") == custom and custom.allocatable_mib == 40960
    assert SimBackend(tmp_path / "c").gpus()[0].reserved_mib == 0


def test_version_1_spec_loads_with_realistic_overheads(tmp_path):
    import json

    spec = init_state(tmp_path)
    data = json.loads((tmp_path / "spec.json").read_text())
    for key in ("reserved_mib", "context_mib", "server_mib"):
        del data[key]
    data["version"] = 1
    (tmp_path / "spec.json").write_text(json.dumps(data))
    old = load_spec(tmp_path)
    assert old == spec  # the defaults, not zeros: an old devcluster becomes realistic
    data["version"] = 3
    (tmp_path / "spec.json").write_text(json.dumps(data))
    with pytest.raises(GpuBackendError, match="version 3"):
        load_spec(tmp_path)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"reserved_mib": -1},
        {"context_mib": -1},
        {"server_mib": -1},
        {"memory_mib": 1024, "reserved_mib": 512, "context_mib": 512},
    ],
)
def test_init_state_rejects_impossible_overheads(tmp_path, kwargs):
    with pytest.raises(ValueError):
        init_state(tmp_path, **kwargs)


def test_memory_used_counts_each_live_mps_server_once(tmp_path):
    init_state(tmp_path)
    servers = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) for _ in "ab"
    ]
    clients = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) for _ in "abc"
    ]
    try:
        a, b = (p.pid for p in servers)
        write_record(tmp_path, record(clients[0].pid, mib=1000, server=a))
        write_record(tmp_path, record(clients[1].pid, mib=2000, server=a))
        write_record(tmp_path, record(os.getpid(), mib=700))  # outside MPS: no server
        backend = SimBackend(tmp_path)
        one = backend.sample(0)
        assert one.memory_used_mib == 512 + 64 + 3700  # two clients, one server
        write_record(tmp_path, record(clients[2].pid, mib=300, server=b))
        two = backend.sample(0)
        assert two.memory_used_mib == 512 + 2 * 64 + 4000  # another user's server
        # servers are compute processes but no MPS clients, as in NVML (issue 23)
        listed = {p.pid: (p.used_mib, p.mps_client) for p in two.processes}
        assert listed == {clients[0].pid: (1000, True), clients[1].pid: (2000, True),
                          clients[2].pid: (300, True), os.getpid(): (700, False),
                          a: (64, False), b: (64, False)}
        assert sum(p.used_mib for p in two.processes) == two.memory_used_mib - 512
        servers[1].kill()
        servers[1].wait()
        three = backend.sample(0)
        assert three.memory_used_mib == 512 + 64 + 4000  # a dead server holds nothing
        assert b not in {p.pid for p in three.processes}
    finally:
        for p in servers + clients:
            p.kill()
            p.wait()
        remove_record(tmp_path, 0, os.getpid())
