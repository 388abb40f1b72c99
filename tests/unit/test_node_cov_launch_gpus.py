"""Prolog helpers: the metrics sidecar launch (slurm_colloc.node.metrics_launch) and the
per-boot GPU map cache (slurm_colloc.node.gpus)."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import Any

import pytest

from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu.backend import GpuInfo
from slurm_colloc.metrics import liveness, store
from slurm_colloc.node import gpus as gpusmod
from slurm_colloc.node import metrics_launch as ml
from slurm_colloc.node.job import JobContext

REC = "colloc1:mode=estimate,need_mib=3000,est_mib=2500,shards=3,shard_mib=1024,alloc_mib=3072"


def ctx(**over: Any) -> JobContext:
    base: dict[str, Any] = dict(
        job_id=21, uid=1001, user="alice", node="n1", gpus=(1,), shards=3, gpu_count=0,
        stdout=None, stderr=None, restarts=2, admin_comment=REC, exit_code="", state="RUNNING",
    )
    base.update(over)
    return JobContext(**base)


# ----------------------------------------------------------- metrics_launch ---


@pytest.mark.parametrize(
    ("raw", "want"),
    [("32", 32), ("0", 0), (None, None), ("", None), ("-1", None), ("3.5", None),
     ("1" * 10, None), ("٣", None)],  # Arabic-Indic digit: isdigit() but not ASCII
)
def test_int_accepts_small_plain_numbers(raw: str | None, want: int | None) -> None:
    if raw == "٣":
        # str.isdigit() is true for it and int() accepts it: a value, not a crash
        assert ml._int(raw) == 3
        return
    assert ml._int(raw) == want


@pytest.mark.parametrize(
    ("raw", "want"),
    [("AdamW", "adamw"), ("bf16", "bf16"), ("fp8_e4m3.x-y", "fp8_e4m3.x-y"), (None, None),
     ("", None), ("(null)", None), ("a" * 33, None), ("adam w", None), ("adam;rm", None),
     ("../etc", None)],
)
def test_name_is_a_short_safe_token(raw: str | None, want: str | None) -> None:
    assert ml._name(raw) == want


def test_meta_for_takes_job_facts_and_spank_options() -> None:
    env = {ml.SPANK + "batch_size": "16", ml.SPANK + "seq_len": "x",
           ml.SPANK + "optimizer": "AdamW", ml.SPANK + "precision": "bf16;rm -rf"}
    meta = ml.meta_for(ctx(), CollocConfig(shard_mib=1024), env)
    assert (meta.job_id, meta.attempt, meta.uid, meta.gpus) == (21, 2, 1001, (1,))
    assert meta.limit_mib == 3 * 1024 and meta.shards == 3
    assert meta.estimate_mib == 2500 and meta.estimator == "estimate"
    assert meta.batch_size == 16 and meta.seq_len is None
    assert meta.optimizer == "adamw" and meta.precision is None
    assert meta.start > 0


def test_meta_for_a_job_without_record() -> None:
    meta = ml.meta_for(ctx(admin_comment="", gpus=(0,), shards=0, gpu_count=1),
                       CollocConfig(), {})
    assert meta.estimate_mib is None and meta.estimator is None and meta.fingerprint is None
    assert meta.limit_mib is None  # not a shared job: no MPS limit


def test_collector_running_follows_the_lock_not_the_pid(tmp_path: Path) -> None:
    assert ml.collector_running(str(tmp_path)) is False  # no lock at all
    private = tmp_path / liveness.PRIVATE_DIR
    private.mkdir(mode=0o700)
    (private / liveness.PID).write_text("1\n")  # a stale pid (init!) must not fool it
    lock = private / liveness.LOCK
    lock.write_text("")
    assert ml.collector_running(str(tmp_path)) is False
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        # flock is per open file description: a new open in this process conflicts
        assert ml.collector_running(str(tmp_path)) is True
    finally:
        os.close(fd)
    assert ml.collector_running(str(tmp_path)) is False


def test_collector_running_does_not_follow_a_symlink(tmp_path: Path) -> None:
    real = tmp_path / "elsewhere"
    real.write_text("")
    private = tmp_path / liveness.PRIVATE_DIR
    private.mkdir(mode=0o700)
    (private / liveness.LOCK).symlink_to(real)
    fd = os.open(real, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert ml.collector_running(str(tmp_path)) is False  # O_NOFOLLOW: not opened
    finally:
        os.close(fd)


def test_spawn_collector_passes_only_fixed_path_and_configs(monkeypatch) -> None:
    seen: list[tuple[Any, ...]] = []
    monkeypatch.setattr(ml, "spawn_module", lambda *a: seen.append(a))
    ml.spawn_collector({"PATH": "/home/u/bin", "COLLOC_CONF": "/etc/c.conf",
                        "LD_PRELOAD": "/x.so", "SLURM_JOB_ID": "1"})
    assert seen == [("slurm_colloc.metrics.collector", (),
                     {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
                      "COLLOC_CONF": "/etc/c.conf"})]


def test_ensure_collector(tmp_path: Path, monkeypatch) -> None:
    started: list[dict[str, str]] = []
    monkeypatch.setattr(ml, "spawn_collector", lambda env: started.append(dict(env)))
    cfg = CollocConfig(metrics_dir=str(tmp_path / "m"))
    assert ml.ensure_collector(ctx(gpus=()), cfg, {}) == "no GPU"
    assert not (tmp_path / "m").exists()
    assert ml.ensure_collector(ctx(), cfg, {"SLURM_CONF": "/s"}) == "collector started"
    assert started == [{"SLURM_CONF": "/s"}]
    meta = store.read_meta(cfg.metrics_dir, 21, 2)
    assert meta is not None and meta.limit_mib == 3 * cfg.shard_mib
    monkeypatch.setattr(ml, "collector_running", lambda d: True)
    monkeypatch.setattr(os, "environ", {"SLURM_CONF": "/from-os"})
    assert ml.ensure_collector(ctx(restarts=3), cfg) == "collector running"
    assert len(started) == 1 and store.read_meta(cfg.metrics_dir, 21, 3) is not None


# ---------------------------------------------------------------------- gpus ---


GPUS = [GpuInfo(index=0, uuid="GPU-b", name="H100", memory_total_mib=81559, minor_number=1),
        GpuInfo(index=1, uuid="GPU-a", name="H100", memory_total_mib=81559, minor_number=0)]


def test_boot_id(monkeypatch, tmp_path: Path) -> None:
    f = tmp_path / "boot_id"
    f.write_text("abc-123\n")
    monkeypatch.setattr(gpusmod, "BOOT_ID", str(f))
    assert gpusmod.boot_id() == "abc-123"
    monkeypatch.setattr(gpusmod, "BOOT_ID", str(tmp_path / "missing"))
    assert gpusmod.boot_id() == ""


@pytest.fixture
def nvml(tmp_path: Path, monkeypatch):
    """An 'nvml' config whose backend is counted; the boot id is settable."""
    calls: list[int] = []

    def backend(cfg: CollocConfig) -> list[GpuInfo]:
        calls.append(1)
        return list(GPUS)

    import slurm_colloc.gpu.select as sel

    monkeypatch.setattr(sel, "gpus_from_config", backend)
    boot = {"id": "boot-1"}
    monkeypatch.setattr(gpusmod, "boot_id", lambda: boot["id"])
    (tmp_path / "mps").mkdir(mode=0o755)
    cfg = CollocConfig(gpu_backend="nvml", mps_root=str(tmp_path / "mps"))
    return cfg, calls, boot, tmp_path / "mps" / gpusmod.CACHE_FILE


def test_map_is_cached_per_boot(nvml) -> None:
    cfg, calls, boot, cache = nvml
    m1 = gpusmod.node_gpu_map(cfg)
    assert [g.uuid for g in m1.gpus] == ["GPU-a", "GPU-b"]  # Slurm's order: by minor
    assert calls == [1]
    assert (cache.stat().st_mode & 0o777) == 0o600
    assert json.loads(cache.read_text())["boot_id"] == "boot-1"
    m2 = gpusmod.node_gpu_map(cfg)
    assert calls == [1] and m2 == m1  # from the cache, no backend
    gpusmod.node_gpu_map(cfg, refresh=True)
    assert calls == [1, 1]
    boot["id"] = "boot-2"  # a reboot: GPUs may have been re-enumerated
    gpusmod.node_gpu_map(cfg)
    assert calls == [1, 1, 1]
    assert json.loads(cache.read_text())["boot_id"] == "boot-2"


@pytest.mark.parametrize(
    "content",
    ["not json", json.dumps({"boot_id": "boot-1"}), json.dumps({"boot_id": "boot-1",
                                                               "gpus": [{"index": "x"}]}),
     json.dumps({"boot_id": "boot-1", "gpus": [{"nope": 1}]}),
     json.dumps({"boot_id": "boot-2", "gpus": []})],
    ids=["garbage", "no-gpus", "bad-gpu", "bad-keys", "other-boot"],
)
def test_unusable_cache_is_rebuilt(nvml, content: str) -> None:
    cfg, calls, _, cache = nvml
    cache.write_text(content)
    os.chmod(cache, 0o600)
    assert [g.uuid for g in gpusmod.node_gpu_map(cfg).gpus] == ["GPU-a", "GPU-b"]
    assert calls == [1]
    assert json.loads(cache.read_text())["boot_id"] == "boot-1"


# was a bug (fixed): a cache that is JSON but not an object (a list, a number) raises
# AttributeError from _load instead of being treated as unusable and rebuilt
@pytest.mark.parametrize("content", ["[1, 2]", "42", "null"])
def test_cache_that_is_not_an_object_is_rebuilt(nvml, content: str) -> None:
    cfg, calls, _, cache = nvml
    cache.write_text(content)
    os.chmod(cache, 0o600)
    assert len(gpusmod.node_gpu_map(cfg).gpus) == 2 and calls == [1]


def test_unknown_boot_id_never_uses_the_cache(nvml) -> None:
    cfg, calls, boot, _ = nvml
    boot["id"] = ""
    gpusmod.node_gpu_map(cfg)
    gpusmod.node_gpu_map(cfg)
    assert calls == [1, 1]


def test_cache_owned_by_someone_else_is_ignored(nvml) -> None:
    cfg, calls, _, cache = nvml
    gpusmod.node_gpu_map(cfg)
    if os.geteuid() == 0:
        os.chown(cache, 1001, 1001)
        gpusmod.node_gpu_map(cfg)
        assert calls == [1, 1]


def test_symlinked_state_dir_gets_no_cache(nvml, tmp_path: Path) -> None:
    _, calls, _, _ = nvml
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    cfg2 = CollocConfig(gpu_backend="nvml", mps_root=str(link))
    assert len(gpusmod.node_gpu_map(cfg2).gpus) == 2 and calls == [1]
    assert not (real / gpusmod.CACHE_FILE).exists()


def test_save_failure_still_answers(nvml, monkeypatch) -> None:
    cfg, _, _, cache = nvml

    def full(*a: Any, **k: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gpusmod, "_save", full)
    assert len(gpusmod.node_gpu_map(cfg).gpus) == 2
    assert not cache.exists()


def test_save_replaces_a_leftover_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "gpus.json"
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text("leftover of a crash")
    gpusmod._save(path, "b", GPUS)
    assert not tmp.exists()
    assert json.loads(path.read_text())["gpus"][0]["uuid"] == "GPU-b"


def test_sim_backend_is_never_cached(tmp_path: Path, monkeypatch) -> None:
    import slurm_colloc.gpu.select as sel

    monkeypatch.setattr(sel, "gpus_from_config", lambda cfg: list(GPUS))
    (tmp_path / "mps").mkdir()
    cfg = CollocConfig(gpu_backend="sim", mps_root=str(tmp_path / "mps"))
    gpusmod.node_gpu_map(cfg)
    assert not (tmp_path / "mps" / gpusmod.CACHE_FILE).exists()
