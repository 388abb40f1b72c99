"""The typed configuration: defaults, validation, unknown keys, file errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_colloc import config as cfgmod


def test_defaults_are_production_safe() -> None:
    cfg = cfgmod.CollocConfig()
    assert cfg.gpu_backend == "nvml"  # never the simulation unless asked
    assert cfg.shard_mib == 1024
    assert cfg.step_up_policy == "whole-gpu"


def test_dump_then_load_round_trips(tmp_path: Path) -> None:
    cfg = cfgmod.CollocConfig(gpu_backend="sim", shard_mib=512, max_requeues=3)
    p = tmp_path / "colloc.conf"
    p.write_text(cfgmod.dump(cfg))
    assert cfgmod.load(p) == cfg


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('gpu_backnd = "sim"', "unknown key(s) gpu_backnd"),
        ('gpu_backend = "fake"', "must be one of 'nvml', 'sim'"),
        ("shard_mib = 10", "at least 64 MiB"),
        ('shard_mib = "1G"', "must be an integer"),
        ("max_requeues = -1", "must not be negative"),
        ("requeue_on_oom = 1", "true or false"),
        ("active_thread_percentage = 150", "0..100"),
        ("recovery_nice = 2147483647", "at most 1,000,000"),
        ("recovery_nice = -5", "must not be negative"),
        ("sample_interval_s = 0", "must be positive"),
        ("shard_mib = ", "not valid TOML"),
    ],
)
def test_bad_files_name_the_problem(tmp_path: Path, text: str, message: str) -> None:
    p = tmp_path / "colloc.conf"
    p.write_text(text + "\n")
    with pytest.raises(cfgmod.ConfigError) as e:
        cfgmod.load(p)
    assert message in str(e.value)
    assert str(p) in str(e.value)


def test_explicit_missing_file_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cfgmod.ENV_VAR, str(tmp_path / "nope.conf"))
    with pytest.raises(cfgmod.ConfigError, match="not found"):
        cfgmod.load()


def test_missing_default_file_gives_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(cfgmod.ENV_VAR, raising=False)
    monkeypatch.setattr(cfgmod, "DEFAULT_PATH", tmp_path / "absent.conf")
    assert cfgmod.load() == cfgmod.CollocConfig()


def test_oversized_file_refused(tmp_path: Path) -> None:
    p = tmp_path / "big.conf"
    p.write_text("# " + "x" * (1 << 20) + "\n")
    with pytest.raises(cfgmod.ConfigError, match="larger than 1 MiB"):
        cfgmod.load(p)
