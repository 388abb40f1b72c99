"""``colloc doctor`` says when the node's collector (enforcement) is dead or crashing."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

from slurm_colloc.config import CollocConfig
from slurm_colloc.metrics import liveness
from slurm_colloc.site.doctor_collector import check_collector

T = 1_000_000.0


def cfg_at(tmp_path: Path) -> CollocConfig:
    (tmp_path / "m").mkdir(exist_ok=True)
    return CollocConfig(metrics_dir=str(tmp_path / "m"), log_file=str(tmp_path / "log"))


def levels(findings: list) -> list[str]:  # type: ignore[type-arg]
    return [f.level for f in findings]


def test_never_started_and_cleanly_stopped_are_fine(tmp_path: Path) -> None:
    cfg = cfg_at(tmp_path)
    assert levels(check_collector(cfg, now=T)) == ["ok"]
    liveness.append_event(cfg.metrics_dir, liveness.UP, 5, now=T - 100)
    liveness.append_event(cfg.metrics_dir, liveness.STOP, 5, "idle", now=T - 50)
    assert levels(check_collector(cfg, now=T)) == ["ok"]


def test_gone_without_a_clean_stop_fails(tmp_path: Path) -> None:
    cfg = cfg_at(tmp_path)
    liveness.append_event(cfg.metrics_dir, liveness.UP, 5, now=T - 100)
    f = check_collector(cfg, now=T)
    assert levels(f) == ["fail"] and "unenforced" in f[0].detail


def test_running_and_sampling_is_ok_but_recent_crashes_warn(tmp_path: Path) -> None:
    cfg = cfg_at(tmp_path)
    fd = liveness.acquire_lock(cfg.metrics_dir)
    assert fd is not None
    hb = liveness.Heartbeat(cfg.metrics_dir)
    try:
        hb.beat()
        assert levels(check_collector(cfg)) == ["ok"]
        liveness.append_event(cfg.metrics_dir, liveness.DOWN, 6, "exit 1: ValueError: x")
        f = check_collector(cfg)
        assert levels(f) == ["ok", "warn"] and "ValueError" in f[1].detail
    finally:
        hb.close()
        os.close(fd)


def test_running_but_not_sampling_fails(tmp_path: Path) -> None:
    cfg = cfg_at(tmp_path)
    fd = liveness.acquire_lock(cfg.metrics_dir)
    assert fd is not None
    hb = liveness.Heartbeat(cfg.metrics_dir)
    old = os.path.getmtime(Path(cfg.metrics_dir) / "collector" / "heartbeat") - 3600
    os.utime(Path(cfg.metrics_dir) / "collector" / "heartbeat", (old, old))
    try:
        f = check_collector(cfg)
        assert levels(f) == ["fail"] and "nothing is enforced" in f[0].detail
    finally:
        hb.close()
        os.close(fd)


def test_a_lock_directory_a_user_owns_fails(tmp_path: Path) -> None:
    cfg = cfg_at(tmp_path)
    d = Path(cfg.metrics_dir) / "collector"
    d.mkdir(parents=True, mode=0o700)
    os.chown(d, pwd.getpwnam("nobody").pw_uid, -1)
    f = check_collector(cfg, now=T)
    assert levels(f) == ["fail"] and "hold the lock" in f[0].detail
