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
from slurm_colloc.gpu.sim.interference import DEFAULT_MODEL

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
    assert SimBackend(state).sample(0).memory_used_mib == 0  # released at exit


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
        seen.add(s.memory_used_mib)
        if s.memory_used_mib:
            assert [q.pid for q in s.processes] == [p.pid]
            assert s.sm_activity_pct == 60 and s.power_w is not None and s.power_w > 55
        time.sleep(0.05)
    p.communicate()
    assert p.returncode == 0
    assert {4096, 6144} <= seen
    assert b.sample(0).memory_used_mib == 0  # the other GPU untouched


def test_oom_over_free_memory_prints_pytorch_text_and_exits_1(state):
    r = run(job_env(state), "--mem", "41G", "--seconds", "1")
    assert r.returncode == 1
    assert "Traceback (most recent call last):" in r.stderr
    assert pytest.importorskip("re").search(OOM_RE, r.stderr)
    assert "Tried to allocate 41.00 GiB" in r.stderr
    assert SimBackend(state).sample(0).memory_used_mib == 0


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
    while b.sample(0).memory_used_mib == 0 and time.time() < deadline:
        time.sleep(0.05)
    assert b.sample(0).memory_used_mib == 3072
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=10)
    assert p.returncode == -signal.SIGTERM
    assert "GPU memory released" in err
    assert b.sample(0).memory_used_mib == 0
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
    expected = 2 / DEFAULT_MODEL.rate([90, 90])  # about 2.7 s instead of 2 s
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


@pytest.fixture
def mps(tmp_path):
    env = job_env(tmp_path / "state")
    env.update(
        CUDA_MPS_PIPE_DIRECTORY=str(tmp_path / "pipe"), CUDA_MPS_LOG_DIRECTORY=str(tmp_path / "log")
    )
    ctl = [sys.executable, "-m", "slurm_colloc.gpu.sim.mps_control"]
    assert subprocess.run([*ctl, "-d"], env=env, timeout=20).returncode == 0
    yield env
    subprocess.run(ctl, input="quit\n", text=True, env=env, timeout=20)


def test_mps_limit_from_env_is_enforced(state, mps):
    env = {**mps, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4G", "CUDA_VISIBLE_DEVICES": "1"}
    r = run(env, "--mem", "2G", "--peak", "5G", "--peak-at", "0.2", "--seconds", "1")
    assert r.returncode == 1
    assert "GPU 0 has a total capacity of 4.00 GiB of which 2.00 GiB is free." in r.stderr
    ok = run(env, "--mem", "2G", "--peak", "4G", "--seconds", "0.3")
    assert ok.returncode == 0, ok.stderr


def test_mps_daemon_default_limit_applies(state, mps):
    ctl = [sys.executable, "-m", "slurm_colloc.gpu.sim.mps_control"]
    subprocess.run(ctl, input="set_default_device_pinned_mem_limit 0 3G\n", text=True, env=mps)
    r = run(mps, "--mem", "3500M", "--seconds", "0.3")
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
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
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
