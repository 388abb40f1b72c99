"""The installer's side of job_submit's scope: shared partitions, --chain-job-submit."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_colloc.config import CollocConfig
from slurm_colloc.site import install as site
from tests.unit.test_site_install import _admin

SITE = "function slurm_job_submit(job_desc, part_list, submit_uid)\n  return slurm.SUCCESS\nend\n"


def test_shared_partitions_entries_are_checked() -> None:
    assert site.parse_shared_partitions(["gpu", "a100:40960", " h100.x-1:81920 "]) == [
        ("gpu", None), ("a100", 40960), ("h100.x-1", 81920)]
    for bad, needle in (("gpu:", "positive"), ("gpu:40G", "positive"), ("gpu:0", "positive"),
                        ("", "NAME"), ("a b", "NAME"), ('a"b', "NAME")):
        with pytest.raises(site.InstallError, match=needle):
            site.parse_shared_partitions([bad])
    with pytest.raises(site.InstallError, match="twice"):
        site.parse_shared_partitions(["gpu", "gpu:40960"])


def test_partition_sizes_default_and_need_no_detection() -> None:
    s = site.settings_from_config(CollocConfig(shared_partitions=("gpu", "big:81920"),
                                               gpu_memory_mib=40960))
    assert [(p.name, p.gpu_memory_mib, p.usable_mib) for p in s.shared_partitions] == [
        ("gpu", 40960, 40832), ("big", 81920, 81792)]
    # every partition sized: the controller needs no GPU to detect
    s = site.settings_from_config(CollocConfig(gpu_backend="nvml",
                                               shared_partitions=("a:40960", "b:81920")))
    assert s.gpu_memory_mib == 40960 and s.jobs_mib == 40832
    with pytest.raises(site.InstallError, match="smaller than one shard"):
        site.settings_from_config(CollocConfig(shared_partitions=("tiny:600",),
                                               gpu_memory_mib=40960))
    assert site.settings_from_config(CollocConfig(gpu_memory_mib=40960)).shared_partitions == ()


def test_site_script_checks() -> None:
    assert site.check_site_job_submit(SITE, "s.lua").text == SITE
    assert site.check_site_job_submit("slurm_job_submit = function(d, p, u) return 0 end",
                                      "s.lua")
    with pytest.raises(site.InstallError, match="defines no slurm_job_submit"):
        site.check_site_job_submit("function slurm_job_modify(a, b, c, d) return 0 end", "s.lua")
    with pytest.raises(site.InstallError, match="defines no slurm_job_submit"):
        site.check_site_job_submit("-- function slurm_job_submit(a)\nx = 1\n", "s.lua")
    with pytest.raises(site.InstallError, match=r"not valid Lua 5\.1.*s\.lua:5: .end. expected"):
        site.check_site_job_submit(SITE + "if x then\n", "s.lua")
    with pytest.raises(site.InstallError, match=r"not valid Lua 5\.1"):
        site.check_site_job_submit(SITE + "x = 7 // 2\n", "s.lua")  # Lua 5.3 syntax
    own = site.render_job_submit(site.SiteSettings(shard_mib=1024, gpu_memory_mib=40960))
    with pytest.raises(site.InstallError, match="colloc's own"):
        site.check_site_job_submit(own, "/etc/slurm/job_submit.lua")


def test_chained_render_is_valid_lua() -> None:
    lupa = pytest.importorskip("lupa.lua51")
    s = site.SiteSettings(shard_mib=1024, gpu_memory_mib=40960)
    js = site.render_job_submit(s, site.check_site_job_submit(SITE + "-- ]]]=]\n", "s.lua"))
    rt = lupa.LuaRuntime(unpack_returned_tuples=True)
    fn, err = rt.globals().loadstring(js, "=job_submit.lua"), None
    if isinstance(fn, tuple):
        fn, err = fn
    assert fn is not None, err


def test_install_cli_chain_dry_run_and_refusal(tmp_path: Path) -> None:
    etc = tmp_path / "etc"
    etc.mkdir()
    good, bad = etc / "site.lua", etc / "bad.lua"
    good.write_text(SITE)
    bad.write_text("function other() end\n")
    base = ["install", "--slurm-conf", str(etc / "slurm.conf"), "--lib-dir",
            str(tmp_path / "lib"), "--gpu-memory-mib", "40960"]
    rc, out = _admin([*base, "--chain-job-submit", str(good)], tmp_path)
    assert rc == 0, out
    assert f"chained: {good}" in out and "shared partitions: none (opt-in" in out
    rc, out = _admin([*base, "--chain-job-submit", str(bad)], tmp_path)
    assert rc != 0 and "defines no slurm_job_submit" in out


def _fake_build(dest: Path, **_: object) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(b"slurm-colloc")
    return dest


def test_install_chaining_the_file_it_replaces_keeps_a_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(site, "build_spank_plugin", _fake_build)
    etc = tmp_path / "etc"
    etc.mkdir()
    js = etc / "job_submit.lua"
    js.write_text(SITE)
    s = site.settings_from_config(CollocConfig(shared_partitions=("gpu:40960",)))
    # a foreign job_submit.lua is not replaced without --force ...
    with pytest.raises(site.InstallError, match="not written by slurm-colloc"):
        site.install(etc, tmp_path / "lib", s)
    # ... unless it is the script being chained: it lives on inside colloc's
    res = site.install(etc, tmp_path / "lib", s, chain=site.load_site_job_submit(js))
    assert (etc / "job_submit.lua.pre-colloc").read_text() == SITE
    text = js.read_text()
    assert "job_submit.lua of slurm-colloc" in text[:400] and SITE in text
    assert 'shared_partitions = { "gpu" },' in text
    assert any("pre-colloc" in n for n in res.notes)
    # installing again (now colloc's file) from the saved copy leaves the copy alone
    site.install(etc, tmp_path / "lib", s,
                 chain=site.load_site_job_submit(etc / "job_submit.lua.pre-colloc"))
    assert SITE in js.read_text() and "job_submit.lua.pre-colloc" in js.read_text()
    assert (etc / "job_submit.lua.pre-colloc").read_text() == SITE


def test_plan_names_the_scope() -> None:
    s = site.settings_from_config(CollocConfig(shared_partitions=("a:40960", "b:81920")))
    text = site.render_plan(Path("/etc/slurm"), Path("/lib"), s)
    assert "#   a: 40960 MiB GPU, 40832 MiB for jobs, 39 shards per GPU" in text
    assert "#   b: 81920 MiB GPU, 81792 MiB for jobs, 79 shards per GPU" in text
    assert "never touched" in text
