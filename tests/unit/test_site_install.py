"""The installer: rendering, the plugin build, plugstack handling, the record codec."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from slurm_colloc.accounting.submit_record import parse_record
from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu.backend import GpuInfo
from slurm_colloc.site import install as site

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
    # 0: a server per shard job (issue 24): 15 x (1024 + 64) fits 16384, 16 x does not
    assert site.settings_from_config(
        CollocConfig(gpu_memory_mib=16384, mps_servers_per_gpu=0)).shards_per_gpu == 15
    assert site.settings_from_config(
        CollocConfig(gpu_memory_mib=16384, mps_server_mib=0)).shards_per_gpu == 16


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


# ------------------------------------------------------------------ dry run, headers, uninstall
def _admin(args: list[str], tmp_path: Path, slurm: str = "slurm 24.11.5") -> tuple[int, str]:
    """``colloc admin ARGS`` with a stand-in ``sinfo --version`` printing ``slurm``."""
    from click.testing import CliRunner

    from slurm_colloc.cli.admin_cmd import admin

    env = {"COLLOC_CONF": str(_colloc_conf(tmp_path)), "SLURM_INCLUDE_DIR": "",
           "PATH": f"{_fake_sinfo(tmp_path, slurm)}:{os.environ['PATH']}"}
    r = CliRunner().invoke(admin, args, env=env, catch_exceptions=False)
    return r.exit_code, r.output


def _fake_sinfo(tmp_path: Path, version_line: str) -> Path:
    """A bin folder (not listed by :func:`_tree`) whose ``sinfo --version`` prints
    ``version_line``."""
    bin_ = tmp_path / "cfg" / "bin"
    bin_.mkdir(parents=True, exist_ok=True)
    sinfo = bin_ / "sinfo"
    sinfo.write_text(f"#!/bin/sh\necho '{version_line}'\n")
    sinfo.chmod(0o755)
    return bin_


def _colloc_conf(tmp_path: Path) -> Path:
    """An empty colloc.conf (defaults) in a folder :func:`_tree` does not list."""
    conf = tmp_path / "cfg" / "colloc.conf"
    conf.parent.mkdir(exist_ok=True)
    conf.write_text("")
    return conf


def _tree(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if "cfg" not in p.parts)


def test_install_is_a_dry_run_that_prints_every_slurm_conf_line(tmp_path: Path) -> None:
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "slurm.conf").write_text("ClusterName=x\n")
    before = _tree(tmp_path)
    rc, out = _admin(["install", "--slurm-conf", str(etc / "slurm.conf"),
                      "--lib-dir", str(tmp_path / "lib"),
                      "--gpu-memory-mib", "40960", "--gpu-memory-mib", "81920"], tmp_path)
    assert rc == 0, out
    assert _tree(tmp_path) == before  # nothing written, not even the lib dir
    lines = out.splitlines()
    bin_dir = Path(sys.executable).parent  # where pip put the console scripts
    for want in ("SelectType=select/cons_tres", "GresTypes=gpu,shard",
                 f"PlugStackConfig={etc}/plugstack.conf", "CliFilterPlugins=lua",
                 "JobSubmitPlugins=lua", f"Prolog={bin_dir}/colloc-prolog",
                 f"TaskProlog={bin_dir}/colloc-task-prolog", f"Epilog={bin_dir}/colloc-epilog",
                 "PrologFlags=Alloc,Contain", f"include {etc}/plugstack.conf.d/*.conf",
                 f"{etc}/job_submit.lua  # job_submit filter (slurmctld)"):
        assert want in lines, want
    flags = lines.index("PrologFlags=Alloc,Contain")
    why = " ".join(lines[flags - 3:flags])
    assert why.startswith("#") and "Alloc" in why and "Contain" in why and "cgroup" in why
    assert "proctrack/cgroup" in out and "ConstrainDevices" in out
    assert "colloc admin gres-conf" in out
    # shards per GPU size from the budget (total less MPS servers), not total // shard
    assert "40960 MiB GPU: 40832 MiB usable, Name=shard Count=39" in out
    assert "81920 MiB GPU: 81792 MiB usable, Name=shard Count=79" in out


def test_install_dry_run_warns_but_apply_fails_without_headers(tmp_path: Path) -> None:
    conf = tmp_path / "slurm.conf"
    args = ["install", "--slurm-conf", str(conf), "--lib-dir", str(tmp_path / "lib"),
            "--gpu-memory-mib", "40960", "--slurm-include", str(tmp_path / "none")]
    rc, out = _admin(args, tmp_path)
    assert rc == 0 and "warning: spank.h not found" in out and "libslurm-dev" in out
    from click.testing import CliRunner

    from slurm_colloc.cli.admin_cmd import admin

    r = CliRunner().invoke(admin, [*args, "--apply"],
                           env={"COLLOC_CONF": str(_colloc_conf(tmp_path)),
                                "PATH": f"{_fake_sinfo(tmp_path, 'slurm 24.11.5')}:"
                                        f"{os.environ['PATH']}"})
    assert r.exit_code != 0 and "spank.h not found" in r.output
    assert _tree(tmp_path) == []


def test_header_search_order_and_error(tmp_path: Path) -> None:
    inc = tmp_path / "inc"
    (inc / "slurm").mkdir(parents=True)
    (inc / "slurm" / "spank.h").write_text("")
    # --slurm-include: the include dir or its slurm/ both work, and nothing else is tried
    assert site.find_spank_header(inc, env={}) == inc / "slurm"
    assert site.find_spank_header(inc / "slurm", env={}) == inc / "slurm"
    with pytest.raises(site.InstallError) as e:
        site.find_spank_header(tmp_path / "x", env={})
    assert str(tmp_path / "x" / "slurm" / "spank.h") in str(e.value)
    assert "/usr/include/slurm/spank.h" not in str(e.value)
    # $SLURM_INCLUDE_DIR first, then the distributions' places
    cands = site.header_candidates(env={"SLURM_INCLUDE_DIR": str(inc)})
    assert cands[:2] == [inc, inc / "slurm"]
    assert cands[2:] == [Path("/usr/include/slurm"), Path("/usr/include/slurm-wlm"),
                         Path("/usr/local/include/slurm")]
    assert site.find_spank_header(env={"SLURM_INCLUDE_DIR": str(inc)}) == inc / "slurm"


def test_header_missing_everywhere_names_the_places_and_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(site, "HEADER_DIRS", (tmp_path / "a", tmp_path / "b"))
    with pytest.raises(site.InstallError) as e:
        site.find_spank_header(env={})
    msg = str(e.value)
    assert f"{tmp_path}/a/spank.h" in msg and f"{tmp_path}/b/spank.h" in msg
    assert "libslurm-dev" in msg and "slurm-devel" in msg and "--slurm-include" in msg


@needs_cc
def test_build_finds_headers_under_another_directory_name(tmp_path: Path) -> None:
    """Headers in e.g. /usr/include/slurm-wlm still satisfy ``#include <slurm/...>``."""
    odd = tmp_path / "slurm-wlm"
    shutil.copytree("/usr/include/slurm", odd)
    plugin = site.build_spank_plugin(tmp_path / "lib" / site.PLUGIN_NAME, include=odd)
    assert "slurm_spank_init" in site.exported_symbols(plugin)


def _fake_install(etc: Path, lib: Path) -> None:
    """What install() writes, without a compiler: the plugin carries the marker in its
    option help, the text files in their first lines."""
    (etc / "plugstack.conf.d").mkdir(parents=True)
    lib.mkdir()
    (lib / site.PLUGIN_NAME).write_bytes(b"\x7fELF\0\0" * 100 + b"(slurm-colloc, NVIDIA MPS)\0")
    (etc / "job_submit.lua").write_text(site.render_job_submit(S))
    (etc / "cli_filter.lua").write_text(site.render_cli_filter(S))
    (etc / "plugstack.conf.d" / "colloc.conf").write_text("# slurm-colloc: x\noptional y\n")


def test_uninstall_dry_run_lists_and_apply_removes_only_marked_files(tmp_path: Path) -> None:
    etc, lib = tmp_path / "etc", tmp_path / "lib"
    _fake_install(etc, lib)
    (etc / "plugstack.conf").write_text(
        f"required /x/pyxis.so\ninclude {etc}/plugstack.conf.d/*.conf\n")  # the site's
    (etc / "slurm.conf").write_text(
        "ClusterName=x\nSelectType=select/cons_tres\nPlugStackConfig=/etc/other.conf\n"
        "Prolog=/opt/colloc/bin/colloc-prolog\nEpilog=/opt/colloc/bin/colloc-epilog\n"
        "# Prolog=/old/colloc-prolog\nJobSubmitPlugins=lua\nPrologFlags=Alloc,Contain\n")
    before = _tree(tmp_path)
    args = ["uninstall", "--slurm-conf", str(etc / "slurm.conf"), "--lib-dir", str(lib)]
    rc, out = _admin(args, tmp_path)
    assert rc == 0 and _tree(tmp_path) == before
    for name in (lib / site.PLUGIN_NAME, etc / "job_submit.lua", etc / "cli_filter.lua",
                 etc / "plugstack.conf.d" / "colloc.conf"):
        assert f"would remove {name}" in out
    assert f"kept {etc / 'plugstack.conf'}" in out
    assert f"remove include {etc}/plugstack.conf.d/*.conf" in out
    lines = out.splitlines()
    for line in ("Prolog=/opt/colloc/bin/colloc-prolog", "Epilog=/opt/colloc/bin/colloc-epilog",
                 "JobSubmitPlugins=lua", "PrologFlags=Alloc,Contain"):
        assert line in lines
    # comments and lines a site needs without colloc are not listed
    assert "# Prolog=/old/colloc-prolog" not in lines
    assert "SelectType=select/cons_tres" not in lines and "ClusterName=x" not in lines

    rc, out = _admin([*args, "--apply"], tmp_path)
    assert rc == 0, out
    assert _tree(tmp_path) == ["etc", "etc/plugstack.conf", "etc/slurm.conf", "lib"]


def test_uninstall_never_removes_a_file_without_the_marker(tmp_path: Path) -> None:
    etc, lib = tmp_path / "etc", tmp_path / "lib"
    _fake_install(etc, lib)
    (etc / "job_submit.lua").write_text("-- the site's own filter\n")
    (lib / site.PLUGIN_NAME).write_bytes(b"\x7fELF another plugin\0")
    plan = site.plan_uninstall(etc, lib)
    assert etc / "job_submit.lua" in plan.foreign and lib / site.PLUGIN_NAME in plan.foreign
    # a file replaced between the dry run and --apply is re-checked, and kept
    plan2 = site.plan_uninstall(etc, lib)
    (etc / "cli_filter.lua").write_text("-- replaced by the site\n")
    removed = site.uninstall(plan2)
    assert removed == [etc / "plugstack.conf.d" / "colloc.conf"]
    assert (etc / "job_submit.lua").exists() and (etc / "cli_filter.lua").exists()
    assert (lib / site.PLUGIN_NAME).exists() and not (etc / "plugstack.conf.d").exists()


@needs_cc
def test_uninstall_removes_what_install_wrote(tmp_path: Path) -> None:
    etc, lib = tmp_path / "etc", tmp_path / "lib"
    res = site.install(etc, lib, S)
    plan = site.plan_uninstall(etc, lib)
    assert sorted(plan.remove) == sorted(res.written) and plan.foreign == []
    assert sorted(site.uninstall(plan)) == sorted(res.written)
    assert _tree(tmp_path) == ["etc", "lib"]


def test_uninstall_picks_lines_by_exact_markers_never_by_the_word_colloc(
        tmp_path: Path) -> None:
    """issue 26 item 5: on the devcluster the substring rule proposed removing ClusterName,
    AuthInfo, StateSaveLocation, NodeName and PartitionName (all named 'colloc-...')."""
    etc = tmp_path / "etc"
    etc.mkdir()
    site_lines = [
        "ClusterName=colloc-devcluster",
        "AuthInfo=/var/lib/colloc-devcluster/munge/munge.socket.2,cred_expire=10",
        "StateSaveLocation=/var/lib/colloc-devcluster/state",
        "NodeName=colloc-n1 CPUs=8 Gres=gpu:4,shard:156 State=UNKNOWN",
        "PartitionName=gpu Nodes=colloc-n1 Default=YES",
        "Epilog=/etc/slurm/epilog.d/colloc-health.sh",  # the site's, not colloc's script
        "SelectTypeParameters=CR_Core_Memory,LL_SHARED_GRES",
    ]
    ours = ["PlugStackConfig=/somewhere/else/plugstack.conf", "CliFilterPlugins=lua"]
    (etc / "slurm.conf").write_text("\n".join(
        [*site_lines[:3], site.BEGIN_MARK, *ours, "# a comment", site.END_MARK,
         *site_lines[3:], "Prolog=/opt/x/bin/colloc-prolog", "JobSubmitPlugins=lua"]) + "\n")
    plan = site.plan_uninstall(etc, tmp_path / "lib")
    assert plan.slurm_conf_lines == [*ours, "Prolog=/opt/x/bin/colloc-prolog",
                                     "JobSubmitPlugins=lua"]
    assert not set(site_lines) & set(plan.slurm_conf_lines)


def test_the_install_plan_wraps_slurm_conf_lines_in_the_uninstall_markers(
        tmp_path: Path) -> None:
    text = site.render_plan(tmp_path / "etc", tmp_path / "lib", S)
    lines = text.splitlines()
    b, e = lines.index(site.BEGIN_MARK), lines.index(site.END_MARK)
    assert b < e and "JobSubmitPlugins=lua" in lines[b:e]
    # pasted as printed, uninstall finds exactly the non-comment, colloc-only lines
    found = site.colloc_conf_lines("\n".join(lines[b:e + 1]), [])
    assert "JobSubmitPlugins=lua" in found and "PrologFlags=Alloc,Contain" in found
    assert not any(ln.startswith(("SelectType", "GresTypes", "#")) for ln in found)
