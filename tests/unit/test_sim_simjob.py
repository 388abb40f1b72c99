"""colloc-simjob: runs, registers memory, OOMs like PyTorch, rejects nonsense, slows down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_colloc.gpu.sim import SimBackend, init_state
from slurm_colloc.gpu.sim.interference import DEFAULT_MODEL, TIME_SLICED
from slurm_colloc.gpu.sim.state import DEFAULT_CONTEXT_MIB, DEFAULT_RESERVED_MIB, read_records

ROOT = Path(__file__).resolve().parents[2]
OOM_RE = (
    r"torch\.OutOfMemoryError: CUDA out of memory\. Tried to allocate [\d.]+ (MiB|GiB)\. "
    r"GPU 0 has a total capacity of [\d.]+ GiB of which [\d.]+ (MiB|GiB|bytes) is free\."
)


@pytest.fixture
def state(tmp_path):
    init_state(tmp_path / "state", gpu_count=2, memory_mib=40960)
    return tmp_path / "state"


def job_env(state: Path, gpu: str | None = "0", **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "COLLOC_"))}
    env["PYTHONPATH"] = str(ROOT)
    env["COLLOC_SIM_STATE"] = str(state)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    env.update(extra)
    return env


def simjob(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "slurm_colloc.gpu.sim.simjob", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    p = simjob(env, *args)
    out, err = p.communicate(timeout=30)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def test_runs_prints_progress_and_finishes(state):
    r = run(job_env(state), "--mem", "2G", "--seconds", "0.5")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert sum("epoch" in line for line in lines) == 10
    assert "done:" in lines[-1] and "peak 2048 MiB on GPU 0" in lines[-1]
    idle = SimBackend(state).sample(0)
    assert idle.processes == ()  # released at exit; the driver's reserve stays
    assert idle.memory_used_mib == DEFAULT_RESERVED_MIB


def test_registers_memory_and_grows_to_peak(state):
    p = simjob(
        job_env(state, "1"),
        "--mem",
        "4G",
        "--peak",
        "6G",
        "--peak-at",
        "0.5",
        "--sm-activity",
        "60",
        "--seconds",
        "2",
    )
    b = SimBackend(state)
    seen = set()
    deadline = time.time() + 10
    while p.poll() is None and time.time() < deadline:
        s = b.sample(1)
        if s.processes:
            assert [q.pid for q in s.processes] == [p.pid]
            seen.add(s.processes[0].used_mib)
            # no MPS server: the reserve and the process's footprint, context included
            assert s.memory_used_mib == DEFAULT_RESERVED_MIB + s.processes[0].used_mib
            assert s.sm_activity_pct == 60 and s.power_w is not None and s.power_w > 55
        time.sleep(0.05)
    p.communicate()
    assert p.returncode == 0
    assert {4096, 6144} <= seen
    assert b.sample(0).processes == ()  # the other GPU untouched


def test_oom_over_free_memory_prints_pytorch_text_and_exits_1(state):
    r = run(job_env(state), "--mem", "41G", "--seconds", "1")
    assert r.returncode == 1
    assert "Traceback (most recent call last):" in r.stderr
    assert pytest.importorskip("re").search(OOM_RE, r.stderr)
    # the context came first (512 MiB); cudaMemGetInfo's total leaves out the reserve
    assert "Tried to allocate 40.50 GiB" in r.stderr
    assert "GPU 0 has a total capacity of 39.50 GiB of which 39.00 GiB is free." in r.stderr
    assert "this process has 512.00 MiB memory in use" in r.stderr
    assert SimBackend(state).sample(0).processes == ()


def test_oom_when_peak_does_not_fit_next_to_another_job(state):
    big = simjob(job_env(state), "--mem", "30G", "--seconds", "3")
    try:
        time.sleep(0.8)
        r = run(
            job_env(state), "--mem", "5G", "--peak", "12G", "--peak-at", "0.1", "--seconds", "1"
        )
        assert r.returncode == 1
        assert "Tried to allocate 7.00 GiB" in r.stderr
        assert f"Process {big.pid} has 30.00 GiB memory in use." in r.stderr
        assert "this process has 5.00 GiB memory in use" in r.stderr
    finally:
        big.kill()
        big.communicate()


@pytest.mark.parametrize(
    ("gpu", "args", "needle"),
    [
        ("0", ["--mem", "-4G"], "negative"),
        ("0", ["--mem", "lots"], "cannot read size"),
        ("0", ["--mem", "4G", "--peak", "2G"], "smaller than --mem"),
        ("0", ["--mem", "4G", "--sm-activity", "150"], "0..100"),
        ("0", ["--mem", "4G", "--seconds", "0"], "positive"),
        ("7", ["--mem", "4G"], "GPU 7 does not exist"),
        ("", ["--mem", "4G"], "CUDA_VISIBLE_DEVICES is empty"),
        (None, ["--mem", "4G"], "CUDA_VISIBLE_DEVICES is unset"),
        ("zero", ["--mem", "4G"], "not a GPU index"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(state, gpu, args, needle):
    r = run(job_env(state, gpu), *args)
    assert r.returncode == 2
    assert needle in r.stderr and "OutOfMemoryError" not in r.stderr


def test_missing_state_dir_exits_2(tmp_path):
    r = run(job_env(tmp_path / "nowhere"), "--mem", "1G")
    assert r.returncode == 2 and "init_state" in r.stderr


def test_uuid_in_cuda_visible_devices(state):
    uuid = SimBackend(state).gpus()[1].uuid
    r = run(job_env(state, uuid), "--mem", "1G", "--seconds", "0.2")
    assert r.returncode == 0 and "on GPU 1" in r.stdout


def test_sigterm_removes_records_and_dies_of_the_signal(state):
    p = simjob(job_env(state), "--mem", "3G", "--seconds", "20")
    b = SimBackend(state)
    deadline = time.time() + 10
    while sum(q.used_mib for q in b.sample(0).processes) < 3072 and time.time() < deadline:
        time.sleep(0.05)
    assert b.sample(0).memory_used_mib == DEFAULT_RESERVED_MIB + 3072
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=10)
    assert p.returncode == -signal.SIGTERM
    assert "GPU memory released" in err
    assert b.sample(0).memory_used_mib == DEFAULT_RESERVED_MIB
    assert list((state / "procs").iterdir()) == []


def test_two_jobs_on_one_gpu_slow_each_other_per_the_model(state):
    env = job_env(state, COLLOC_SIM_TIME_SCALE="1")
    t0 = time.monotonic()
    a = simjob(env, "--mem", "2G", "--sm-activity", "90", "--seconds", "2")
    b = simjob(env, "--mem", "2G", "--sm-activity", "90", "--seconds", "2")
    a.communicate(timeout=30)
    b.communicate(timeout=30)
    both = time.monotonic() - t0
    assert a.returncode == b.returncode == 0
    # two processes outside MPS: two contexts, time-sliced (MPS would give ~2.7 s)
    expected = 2 / TIME_SLICED.rate([90, 90])  # about 3.75 s instead of 2 s
    assert both >= 0.9 * expected
    assert both < expected + 2.0
    alone = simjob(job_env(state, "1"), "--mem", "2G", "--sm-activity", "90", "--seconds", "2")
    t1 = time.monotonic()
    alone.communicate(timeout=30)
    assert time.monotonic() - t1 < 0.9 * expected


def test_time_scale_compresses_wall_time(state):
    t0 = time.monotonic()
    r = run(job_env(state), "--mem", "1G", "--seconds", "60", "--time-scale", "100")
    assert r.returncode == 0 and time.monotonic() - t0 < 5


CTL = [sys.executable, "-m", "slurm_colloc.gpu.sim.mps_control"]


def start_daemon(tmp_path: Path, state: Path, visible: str | None) -> dict[str, str]:
    """A daemon started with ``CUDA_VISIBLE_DEVICES=visible`` (None: unset); its env."""
    env = job_env(state, visible)
    env.update(
        CUDA_MPS_PIPE_DIRECTORY=str(tmp_path / "pipe"), CUDA_MPS_LOG_DIRECTORY=str(tmp_path / "log")
    )
    assert subprocess.run([*CTL, "-d"], env=env, timeout=20).returncode == 0
    return env


@pytest.fixture
def mps(tmp_path):
    """A daemon that sees every GPU (its CUDA_VISIBLE_DEVICES unset); clients get "0"."""
    env = start_daemon(tmp_path, tmp_path / "state", None)
    yield {**env, "CUDA_VISIBLE_DEVICES": "0"}
    subprocess.run(CTL, input="quit\n", text=True, env=env, timeout=20)


def test_mps_limit_from_env_is_enforced(state, mps):
    env = {**mps, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4G", "CUDA_VISIBLE_DEVICES": "1"}
    r = run(env, "--mem", "2G", "--peak", "5G", "--peak-at", "0.2", "--seconds", "1")
    assert r.returncode == 1
    # 2 GiB footprint = 512 MiB context + 1.5 GiB allocated: 2.5 GiB of the limit left
    assert "GPU 0 has a total capacity of 4.00 GiB of which 2.50 GiB is free." in r.stderr
    assert "Tried to allocate 3.00 GiB" in r.stderr
    assert "this process has 2.00 GiB memory in use. Of the allocated memory 1.50 GiB" in r.stderr
    ok = run(env, "--mem", "2G", "--peak", "4G", "--seconds", "0.3")
    assert ok.returncode == 0, ok.stderr
    assert "on GPU 1" in ok.stdout


@pytest.mark.parametrize(("mem", "code"), [("4G", 0), ("4097M", 1)])
def test_pinned_limit_binds_allocations_not_the_context(state, mps, mem, code):
    # what the prolog gives a 4-shard job of 1 GiB shards: 4 GiB less one context
    limit = 4096 - DEFAULT_CONTEXT_MIB
    env = {**mps, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={limit}M"}
    r = run(env, "--mem", mem, "--seconds", "0.2")
    assert r.returncode == code, r.stderr
    if code:
        # 3585 MiB asked, 3584 MiB left: PyTorch rounds both to 3.50 GiB
        assert (
            "Tried to allocate 3.50 GiB. GPU 0 has a total capacity of 3.50 GiB "
            "of which 3.50 GiB is free."
        ) in r.stderr
    else:
        assert "peak 4096 MiB on GPU 0" in r.stdout  # NVML's figure: the whole footprint


def test_mps_daemon_default_limit_applies(state, mps):
    subprocess.run(CTL, input="set_default_device_pinned_mem_limit 0 3G\n", text=True, env=mps)
    r = run(mps, "--mem", f"{3072 + DEFAULT_CONTEXT_MIB + 1}M", "--seconds", "0.3")
    assert r.returncode == 1 and "total capacity of 3.00 GiB" in r.stderr


def test_limit_without_mps_daemon_is_ignored_like_cuda(state, tmp_path):
    env = job_env(
        state, CUDA_MPS_PIPE_DIRECTORY=str(tmp_path / "none"), CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="1G"
    )
    r = run(env, "--mem", "2G", "--seconds", "0.2")
    assert r.returncode == 0
    assert "no MPS control daemon" in r.stderr and "has no effect" in r.stderr


def test_bad_limit_env_is_bad_input(state, mps):
    r = run({**mps, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=much"}, "--mem", "1G")
    assert r.returncode == 2 and "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" in r.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")
def test_simjob_waits_for_another_users_mps_server_and_says_so(tmp_path):
    import shutil
    import socket
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="colloc-simjob-test-"))
    os.chmod(d, 0o755)
    init_state(d / "state")
    env = job_env(
        d / "state", CUDA_MPS_PIPE_DIRECTORY=str(d / "pipe"), CUDA_MPS_LOG_DIRECTORY=str(d / "log")
    )
    ctl = [sys.executable, "-m", "slurm_colloc.gpu.sim.mps_control"]
    assert subprocess.run([*ctl, "-d"], env=env, timeout=20).returncode == 0
    os.chmod(d / "pipe", 0o755)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child: another user's client holds the GPU
        try:
            os.close(r)
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(str(d / "pipe" / "control"))
            s.sendall(b"CLIENT 0\n")
            os.write(w, s.makefile().readline().encode())
            time.sleep(1.5)
        finally:
            os._exit(0)
    os.close(w)
    try:
        assert os.fdopen(r).readline().startswith("READY")
        t0 = time.monotonic()
        res = run(env, "--mem", "1G", "--seconds", "0.2")
        assert res.returncode == 0, res.stderr
        assert "waiting for MPS: the server of uid 65534" in res.stderr
        assert time.monotonic() - t0 >= 1.0  # it really waited for the other user
    finally:
        os.waitpid(pid, 0)
        subprocess.run(ctl, input="quit\n", text=True, env=env, timeout=20)
        shutil.rmtree(d, ignore_errors=True)


# --- device remapping under MPS (issue 12) ---------------------------------------------

NO_GPUS = "RuntimeError: No CUDA GPUs are available"


@pytest.fixture
def four(tmp_path):
    init_state(tmp_path / "state", gpu_count=4, memory_mib=40960)
    return tmp_path / "state"


@pytest.fixture
def daemon_on_gpu2(tmp_path, four):
    """The prolog's layout: the daemon started with CUDA_VISIBLE_DEVICES=<GPU 2's UUID>."""
    uuid = SimBackend(four).gpus()[2].uuid
    env = start_daemon(tmp_path, four, uuid)
    yield env, uuid
    subprocess.run(CTL, input="quit\n", text=True, env=env, timeout=20)


def on_gpu(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()[-1].rsplit(" ", 1)[-1]


def test_node_index_on_a_daemon_that_sees_one_gpu_fails_like_pytorch(four, daemon_on_gpu2):
    env, _ = daemon_on_gpu2
    r = run({**env, "CUDA_VISIBLE_DEVICES": "2"}, "--mem", "1G", "--seconds", "0.2")
    assert r.returncode == 1  # a CUDA error, as on a real node; never another GPU
    assert r.stderr.rstrip().endswith(f"in <module>\n{NO_GPUS}")
    assert "devices 0..0" in r.stderr and "[colloc-simjob]" not in r.stdout
    assert read_records(four) == []


@pytest.mark.parametrize("client", ["uuid", "prefix", "0", None])
def test_client_names_the_daemons_gpu_by_uuid_or_the_servers_number(four, daemon_on_gpu2, client):
    env, uuid = daemon_on_gpu2
    value = {"uuid": uuid, "prefix": uuid[:12], "0": "0", None: None}[client]
    env = {k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"}
    if value is not None:
        env["CUDA_VISIBLE_DEVICES"] = value
    assert on_gpu(run(env, "--mem", "1G", "--seconds", "0.2")) == "2"


def test_uuid_of_a_gpu_the_daemon_does_not_see_fails(four, daemon_on_gpu2):
    env, _ = daemon_on_gpu2
    other = SimBackend(four).gpus()[1].uuid
    r = run({**env, "CUDA_VISIBLE_DEVICES": other}, "--mem", "1G", "--seconds", "0.2")
    assert r.returncode == 1 and NO_GPUS in r.stderr


def test_empty_visible_devices_hides_every_gpu_under_mps_too(four, daemon_on_gpu2):
    env, _ = daemon_on_gpu2
    r = run({**env, "CUDA_VISIBLE_DEVICES": ""}, "--mem", "1G", "--seconds", "0.2")
    assert r.returncode == 2 and "CUDA_VISIBLE_DEVICES is empty" in r.stderr


def test_daemon_that_sees_every_gpu_keeps_node_numbers(tmp_path, four):
    env = start_daemon(tmp_path, four, None)
    try:
        assert (
            on_gpu(run({**env, "CUDA_VISIBLE_DEVICES": "2"}, "--mem", "1G", "--seconds", "0.2"))
            == "2"
        )
    finally:
        subprocess.run(CTL, input="quit\n", text=True, env=env, timeout=20)


def test_daemon_numbering_by_index_list(tmp_path, four):
    env = start_daemon(tmp_path, four, "1,3")  # the server's devices 0 and 1
    try:
        assert (
            on_gpu(run({**env, "CUDA_VISIBLE_DEVICES": "1"}, "--mem", "1G", "--seconds", "0.2"))
            == "3"
        )
        r = run({**env, "CUDA_VISIBLE_DEVICES": "3"}, "--mem", "1G", "--seconds", "0.2")
        assert r.returncode == 1 and NO_GPUS in r.stderr  # "0,2"-style lists fail, as documented
    finally:
        subprocess.run(CTL, input="quit\n", text=True, env=env, timeout=20)


def test_server_limit_of_the_device_a_uuid_selects(tmp_path, four):
    env = start_daemon(tmp_path, four, None)
    try:
        subprocess.run(
            CTL,
            input="set_default_device_pinned_mem_limit 0 8G\nset_default_device_pinned_mem_limit 2 1G\n",
            text=True,
            env=env,
            timeout=20,
        )
        uuid = SimBackend(four).gpus()[2].uuid
        for value in (uuid, "2"):
            r = run({**env, "CUDA_VISIBLE_DEVICES": value}, "--mem", "2G", "--seconds", "0.2")
            assert r.returncode == 1 and "total capacity of 1024.00 MiB" in r.stderr, value
    finally:
        subprocess.run(CTL, input="quit\n", text=True, env=env, timeout=20)


# --- memory overheads (issue 12) ---------------------------------------------------------


def test_footprint_is_at_least_one_context(state):
    p = simjob(job_env(state), "--mem", "100M", "--seconds", "20")
    try:
        deadline = time.time() + 10
        while not read_records(state, 0) and time.time() < deadline:
            time.sleep(0.05)
        assert [r.used_mib for r in read_records(state, 0)] == [DEFAULT_CONTEXT_MIB]
    finally:
        p.terminate()
        p.communicate(timeout=10)


@pytest.mark.parametrize(
    ("mem", "code"), [(40960 - DEFAULT_RESERVED_MIB, 0), (40960 - DEFAULT_RESERVED_MIB + 1, 1)]
)
def test_the_drivers_reserve_is_nobodys(state, mem, code):
    r = run(job_env(state), "--mem", f"{mem}M", "--seconds", "0.2")
    assert r.returncode == code, r.stderr
    if code:
        assert "torch.OutOfMemoryError" in r.stderr


@pytest.mark.parametrize(
    ("mem", "code"),
    [(40960 - DEFAULT_RESERVED_MIB - 64, 0), (40960 - DEFAULT_RESERVED_MIB - 63, 1)],
)
def test_the_mps_server_holds_memory_too(state, mps, mem, code):
    r = run(mps, "--mem", f"{mem}M", "--seconds", "0.2")
    assert r.returncode == code, r.stderr


def test_a_context_that_does_not_fit_is_cudas_out_of_memory(tmp_path):
    init_state(tmp_path / "small", gpu_count=1, memory_mib=4096)
    env = job_env(tmp_path / "small")
    big = simjob(env, "--mem", "3200M", "--seconds", "30")
    try:
        deadline = time.time() + 10
        while sum(r.used_mib for r in read_records(tmp_path / "small", 0)) < 3200:
            assert time.time() < deadline
            time.sleep(0.05)
        r = run(env, "--mem", "100M", "--seconds", "0.2")  # 384 MiB left, a context is 512
        assert r.returncode == 1
        assert "RuntimeError: CUDA error: out of memory\nCUDA kernel errors" in r.stderr
        assert "torch.OutOfMemoryError" not in r.stderr
    finally:
        big.kill()
        big.communicate()


# --- thread percentage and time slicing (issue 12) -----------------------------------------


@pytest.mark.parametrize(("pct", "speed"), [("40", 0.5), ("90", 1.0)])
def test_thread_percentage_below_the_demand_slows_a_job_down(state, mps, pct, speed):
    env = {**mps, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": pct}
    r = run(env, "--mem", "1G", "--sm-activity", "80", "--seconds", "20", "--time-scale", "40")
    assert r.returncode == 0, r.stderr
    progress = [line for line in r.stdout.splitlines() if "epoch" in line]
    assert progress and all(f"speed {speed:.2f}x" in line for line in progress)


def mean_speed(p: subprocess.Popen[str]) -> float:
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    return float(out.split("mean speed ")[1].split("x")[0])


def test_separate_contexts_slow_down_more_than_one_servers_clients(state, mps):
    args = ("--mem", "2G", "--sm-activity", "90", "--seconds", "30", "--time-scale", "10")
    outside = job_env(state)  # two processes outside MPS: two contexts, time-sliced
    pair = [simjob(outside, *args), simjob(outside, *args)]
    sliced = [mean_speed(p) for p in pair]
    pair = [simjob(mps, *args), simjob(mps, *args)]  # one user's clients of one server
    shared = [mean_speed(p) for p in pair]
    assert max(sliced) < min(shared)
    assert min(shared) > 0.9 * DEFAULT_MODEL.rate([90, 90])
    assert max(sliced) < 1.1 * TIME_SLICED.rate([90, 90]) + 0.05
