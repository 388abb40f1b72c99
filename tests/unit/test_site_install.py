"""The installer: rendering, the plugin build, plugstack handling, the record codec."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu.backend import GpuInfo
from slurm_colloc.site import install as site
from slurm_colloc.site.record import parse_record

S = site.SiteSettings(shard_mib=2048, gpu_memory_mib=81920, estimator_command="/opt/c/bin/colloc")
needs_cc = pytest.mark.skipif(
    not (shutil.which("cc") and Path("/usr/include/slurm/spank.h").exists()),
    reason="needs a C compiler and libslurm-dev",
)


def test_render_substitutes_settings() -> None:
    js = site.render_job_submit(S)
    assert "shard_mib = 2048," in js and "gpu_memory_mib = 81920," in js
    assert "@@COLLOC_SETTINGS@@" not in js
    cf = site.render_cli_filter(S)
    assert 'estimator = "/opt/c/bin/colloc",' in cf


def test_settings_validation() -> None:
    with pytest.raises(site.InstallError, match="absolute"):
        site.SiteSettings(shard_mib=1024, gpu_memory_mib=4096, estimator_command="colloc")
    with pytest.raises(site.InstallError, match="smaller than one shard"):
        site.SiteSettings(shard_mib=1024, gpu_memory_mib=512)
    with pytest.raises(site.InstallError, match="cannot be written"):
        site.render_cli_filter(site.SiteSettings(1024, 4096, estimator_command='/a"b'))


def test_settings_from_config_uses_config_memory() -> None:
    s = site.settings_from_config(CollocConfig(gpu_memory_mib=16384), trusted_uids=[5])
    # 16384 - 2 MPS servers x 64 MiB leaves 16256 MiB: 15 whole shards, not 16
    assert s.shards_per_gpu == 15 and s.trusted_uids == (0, 5)
    assert "gpu_memory_mib = 16256," in site.render_job_submit(s)
    assert site.settings_from_config(
        CollocConfig(gpu_memory_mib=16384, mps_servers_per_gpu=0)).shards_per_gpu == 16


def test_gres_lines_leave_room_for_overheads_and_follow_device_files() -> None:
    """40 one-GiB shards on a 40 GiB GPU would over-commit it (reserve, servers)."""
    gpus = [GpuInfo(0, "u0", "A100", 40960, minor_number=1, reserved_mib=512),
            GpuInfo(1, "u1", "A100", 40536, minor_number=0, reserved_mib=0)]
    text, node = site.gres_conf_lines(gpus, CollocConfig())
    lines = text.splitlines()
    # Slurm's GPU 0 is /dev/nvidia0 = NVML's GPU 1 here: its lines come first
    assert lines.index("Name=gpu File=/dev/nvidia0") < lines.index("Name=gpu File=/dev/nvidia1")
    assert "Name=shard Count=39 File=/dev/nvidia1" in text  # (40960-512-128)//1024
    assert "Name=shard Count=39 File=/dev/nvidia0" in text  # (40536-128)//1024
    assert node == "Gres=gpu:2,shard:78"
    with pytest.raises(ValueError, match="not one shard"):
        site.gres_conf_lines([GpuInfo(0, "u", "tiny", 1100, reserved_mib=512)], CollocConfig())


@needs_cc
def test_install_builds_and_exports_only_spank_symbols(tmp_path: Path) -> None:
    res = site.install(tmp_path / "etc", tmp_path / "lib", S)
    plugin = tmp_path / "lib" / site.PLUGIN_NAME
    assert plugin in res.written
    syms = site.exported_symbols(plugin)
    assert {"slurm_spank_init", "slurm_spank_init_post_opt"} <= set(syms)
    assert all(s.startswith(("slurm_spank_", "plugin_", "spank_plugin_")) for s in syms), syms
    plugstack = (tmp_path / "etc" / "plugstack.conf").read_text()
    assert f"include {tmp_path / 'etc' / 'plugstack.conf.d'}/*.conf" in plugstack
    dropin = (tmp_path / "etc" / "plugstack.conf.d" / "colloc.conf").read_text()
    assert f"optional {plugin}" in dropin  # a broken plugin must not fail every sbatch
    assert res.slurm_conf_lines[1:] == ["CliFilterPlugins=lua", "JobSubmitPlugins=lua"]
    site.install(tmp_path / "etc", tmp_path / "lib", S)  # idempotent


@needs_cc
def test_install_respects_foreign_files(tmp_path: Path) -> None:
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "job_submit.lua").write_text("-- the site's own\n")
    (etc / "plugstack.conf").write_text("required /x/pyxis.so\n")
    with pytest.raises(site.InstallError, match="not written by slurm-colloc"):
        site.install(etc, tmp_path / "lib", S)
    res = site.install(etc, tmp_path / "lib", S, force=True)
    assert any("add this line" in n for n in res.notes)
    assert (etc / "plugstack.conf").read_text() == "required /x/pyxis.so\n"


def test_record_roundtrip() -> None:
    r = parse_record("colloc1:mode=estimate,need_mib=7500,shards=8,shard_mib=1024,"
                     "alloc_mib=8192,est=layer-aware,est_mib=7000,margin_mib=500,fp=ab12,new=1")
    assert r is not None and r.alloc_mib == 8192 and r.fingerprint == "ab12"
    assert r.extra == {"new": "1"}
    assert parse_record("colloc1:mode=default,need_mib=1,shards=1,shard_mib=1024;later") is not None
    for bad in (None, "", "other", "colloc1:mode=weird,need_mib=1,shards=1,shard_mib=1",
                "colloc1:mode=explicit,need_mib=x,shards=1,shard_mib=1",
                "colloc1:mode=explicit,shards=1,shard_mib=1", "colloc1:mode=explicit,BAD"):
        assert parse_record(bad) is None
