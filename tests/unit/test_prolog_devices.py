"""Issue 12: the prolog names the GPU by UUID for MPS and the job, and sizes the limit.

Unit tier: the prolog's real code with a fake Slurm (squeue --json), the simulated GPU
backend and the MPS stand-in, no slurmd.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu.sim.state import init_state, load_spec
from slurm_colloc.mps.tenancy import Tenancy
from slurm_colloc.node import entry, prolog
from slurm_colloc.node.task_prolog import export_lines
from slurm_colloc.slurm import adapter as ad
from tests.unit.test_security_node import STANDIN, FakeSlurm, squeue_job

V3_STANDIN = str(Path(STANDIN).with_name("colloc-sim-mps-control-v3"))


def _setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpu: int,
           control: str = STANDIN, protocol: str = "2") -> CollocConfig:
    state = tmp_path / "sim"
    init_state(state, gpu_count=4, memory_mib=40960)
    cfg = CollocConfig(mps_root=str(tmp_path / "mps"), mps_control=control, gpu_backend="sim",
                       sim_state_dir=str(state), metrics_dir=str(tmp_path / "metrics"),
                       mps_protocol=protocol)  # type: ignore[arg-type]
    conf = tmp_path / "colloc.conf"
    conf.write_text(
        f'mps_root = "{cfg.mps_root}"\nmps_control = "{control}"\ngpu_backend = "sim"\n'
        f'sim_state_dir = "{state}"\nmetrics_dir = "{cfg.metrics_dir}"\n'
        f'log_file = "{tmp_path / "node.log"}"\nmps_protocol = "{protocol}"\n'
    )
    uid = os.getuid()
    job = squeue_job(user_id=uid, gres_detail=[f"shard:3(IDX:{gpu})"],
                     tres_per_node="gres:shard:3",
                     admin_comment="colloc1:mode=explicit,need_mib=3072,shards=3,"
                                   "shard_mib=1024,alloc_mib=3072")
    fake, real = FakeSlurm([job]), subprocess.run

    def run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        """Slurm's tools are faked; the MPS stand-in and the simjob really run."""
        if argv[0].rsplit("/", 1)[-1] in ("squeue", "scontrol", "sacct", "sacctmgr"):
            return fake(argv, **kw)
        return real(argv, **kw)  # type: ignore[no-any-return]

    monkeypatch.setattr(ad.subprocess, "run", run)
    monkeypatch.setenv("COLLOC_CONF", str(conf))
    monkeypatch.setattr(prolog, "start_metrics", lambda ctx, cfg: None)
    return cfg


def _env(gpu: int) -> dict[str, str]:
    return {"SLURM_JOB_ID": "7", "SLURM_JOB_UID": str(os.getuid()),
            "SLURM_JOB_GPUS": str(gpu), "SLURM_JOB_USER": "root"}


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(x.decode().split("=", 1) for x in raw if b"=" in x)


def test_a_shard_job_on_gpu_2_gets_the_uuid_not_the_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NVIDIA: a client keeping the daemon's global index would see no device."""
    cfg = _setup(tmp_path, monkeypatch, gpu=2)
    uuid = load_spec(cfg.sim_state_dir).uuid(2)
    assert entry.prolog_main(_env(2)) == 0
    try:
        exports = dict(line.removeprefix("export ").split("=", 1)
                       for line in export_lines(cfg.mps_root, 7))
        assert exports["CUDA_VISIBLE_DEVICES"] == uuid
        assert exports["COLLOC_GPU"] == "2" and exports["COLLOC_GPU_UUID"] == uuid
        # 3 shards = 3072 MiB; the CUDA context (512 MiB) is outside the pinned limit
        assert exports["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2560M"
        assert exports["COLLOC_LIMIT_MIB"] == "3072" and exports["COLLOC_PINNED_MIB"] == "2560"
        daemon = prolog.daemon_for(cfg, Tenancy(Path(cfg.mps_root)), 2, os.getuid())
        pid = daemon.pid()
        assert pid is not None
        env = _environ(pid)
        assert env["CUDA_VISIBLE_DEVICES"] == uuid
        assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        # the user's server-side cap is the sum of pinned limits, not of allocations
        assert "2560" in daemon.command("get_default_device_pinned_mem_limit 0")
    finally:
        assert entry.epilog_main({**_env(2), "SLURM_JOB_EXIT_CODE2": "0:0"}) == 0
    assert prolog.daemon_for(cfg, Tenancy(Path(cfg.mps_root)), 2, os.getuid()).pid() is None


def test_a_client_with_the_exported_env_runs_on_its_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The simulated client takes what the TaskProlog exports and lands on GPU 2."""
    cfg = _setup(tmp_path, monkeypatch, gpu=2)
    assert entry.prolog_main(_env(2)) == 0
    try:
        exports = dict(line.removeprefix("export ").split("=", 1)
                       for line in export_lines(cfg.mps_root, 7))
        simjob = Path(STANDIN).with_name("colloc-simjob")
        # what slurmd put there (Slurm's index) is replaced by the TaskProlog's export
        env = {"PATH": os.environ["PATH"], "CUDA_VISIBLE_DEVICES": "2",
               "COLLOC_SIM_STATE": cfg.sim_state_dir, **exports}
        cp = subprocess.run([str(simjob), "--mem", "3G", "--seconds", "0.3",
                             "--time-scale", "1"], env=env, capture_output=True, text=True,
                            timeout=60, check=False)
        assert cp.returncode == 0, cp.stderr
        assert "on GPU 2" in cp.stdout
        over = subprocess.run([str(simjob), "--mem", "3073M", "--seconds", "0.3"], env=env,
                              capture_output=True, text=True, timeout=60, check=False)
        assert over.returncode == 1 and "OutOfMemoryError" in over.stderr
    finally:
        assert entry.epilog_main({**_env(2), "SLURM_JOB_EXIT_CODE2": "0:0"}) == 0


def test_gpu_map_cache_is_root_state_and_per_boot(tmp_path: Path) -> None:
    """NVML is asked once per boot on real nodes; a stale or foreign file is ignored."""
    from slurm_colloc.gpu.backend import GpuInfo
    from slurm_colloc.node import gpus as node_gpus

    path = tmp_path / "gpus.json"
    info = [GpuInfo(0, "GPU-a", "H100", 81559, minor_number=1),
            GpuInfo(1, "GPU-b", "H100", 81559, minor_number=0)]
    node_gpus._save(path, "boot-1", info)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    gmap = node_gpus._load(path, "boot-1")
    assert gmap is not None and gmap.uuid(0) == "GPU-b"
    assert node_gpus._load(path, "boot-2") is None
    path.write_text(json.dumps({"boot_id": "boot-1", "gpus": "junk"}))
    assert node_gpus._load(path, "boot-1") is None


def test_mps_v3_node_gives_the_job_a_namespace_with_its_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mps_protocol = auto on a node whose control program speaks v3: one root daemon,
    the job's namespace carries its pinned limit, the epilog deletes it."""
    from slurm_colloc.node.mps_protocol import node_protocol, v3_node

    if not os.path.exists(V3_STANDIN):
        pytest.fail(f"MPS v3 stand-in not installed at {V3_STANDIN}; run make venv")
    cfg = _setup(tmp_path, monkeypatch, gpu=2, control=V3_STANDIN, protocol="auto")
    assert node_protocol(cfg) == 3
    node = v3_node(cfg)
    try:
        assert entry.prolog_main(_env(2)) == 0
        exports = dict(line.removeprefix("export ").split("=", 1)
                       for line in export_lines(cfg.mps_root, 7))
        assert exports["COLLOC_MPS_PROTOCOL"] == "3"
        assert exports["CUDA_MPS_PIPE_DIRECTORY"].endswith("/v3/pipe/gpu2/job7")
        assert exports["CUDA_VISIBLE_DEVICES"] == load_spec(cfg.sim_state_dir).uuid(2)
        record = node.job(7)
        assert record is not None and record.limit_mib == 2560
        simjob = Path(STANDIN).with_name("colloc-simjob")
        env = {"PATH": os.environ["PATH"], "CUDA_VISIBLE_DEVICES": "2",
               "COLLOC_SIM_STATE": cfg.sim_state_dir, **exports}
        ok = subprocess.run([str(simjob), "--mem", "3G", "--seconds", "0.3"], env=env,
                            capture_output=True, text=True, timeout=60, check=False)
        assert ok.returncode == 0 and "on GPU 2" in ok.stdout, ok.stderr
        # the namespace's limit holds although the client raises its own variable
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = "0=30G"
        over = subprocess.run([str(simjob), "--mem", "3073M", "--seconds", "0.3"], env=env,
                              capture_output=True, text=True, timeout=60, check=False)
        assert over.returncode == 1 and "OutOfMemoryError" in over.stderr
        assert entry.epilog_main({**_env(2), "SLURM_JOB_EXIT_CODE2": "0:0"}) == 0
        assert node.job(7) is None and node.running()  # the daemon stays for the next job
    finally:
        node.stop()


def test_a_gpu_map_cache_not_owned_by_root_is_ignored(tmp_path: Path) -> None:
    """Root acts only on root-owned state: a planted map would point MPS at another GPU."""
    from slurm_colloc.gpu.backend import GpuInfo
    from slurm_colloc.node import gpus as node_gpus

    path = tmp_path / "gpus.json"
    node_gpus._save(path, "boot-1", [GpuInfo(0, "GPU-planted", "H100", 81559, minor_number=0)])
    assert node_gpus._load(path, "boot-1") is not None
    os.chown(path, 1000, 1000)
    assert node_gpus._load(path, "boot-1") is None
