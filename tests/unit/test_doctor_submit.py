"""``colloc admin doctor`` on 24.11+: the release check, the SPANK plugin's release, an
old job_submit.lua's TRES spelling, and a real ``sbatch --test-only`` as a user."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_colloc.config import CollocConfig
from slurm_colloc.site import doctor
from slurm_colloc.site import install as site
from slurm_colloc.site.releases import PLUGIN_MARK, SlurmRelease
from tests.unit.test_site_install import S, _colloc_conf, _fake_sinfo

R2411 = SlurmRelease(24, 11, 5)
TRES_REFUSAL = ("sbatch: error: Batch job submission failed: Invalid Trackable RESource "
                "(TRES) specification\n")


def _plugin(tmp_path: Path, mark: bytes | None) -> Path:
    p = tmp_path / "lib" / site.PLUGIN_NAME
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"\x7fELF\0(slurm-colloc, NVIDIA MPS)\0" + (mark or b""))
    return p


def test_plugin_built_for_the_running_release_is_ok(tmp_path: Path) -> None:
    p = _plugin(tmp_path, PLUGIN_MARK + b"0x180b02\0")
    f = doctor.check_plugin_release(p, R2411, tmp_path / "slurm.conf")
    assert f.level == "ok" and "24.11.2" in f.detail


def test_plugin_of_another_major_says_how_to_rebuild(tmp_path: Path) -> None:
    p = _plugin(tmp_path, PLUGIN_MARK + b"0x160508\0")
    conf = tmp_path / "etc" / "slurm.conf"
    f = doctor.check_plugin_release(p, R2411, conf)
    assert f.level == "fail"
    assert "built for Slurm 22.05.8" in f.detail and "runs 24.11.5" in f.detail
    assert (f"colloc admin install --apply --slurm-conf {conf} --lib-dir {p.parent}"
            in f.detail)
    assert "24.11's headers" in f.detail


def test_plugin_without_a_mark_is_a_warning_with_the_command(tmp_path: Path) -> None:
    f = doctor.check_plugin_release(_plugin(tmp_path, None), R2411, tmp_path / "s.conf")
    assert f.level == "warn" and "older slurm-colloc" in f.detail
    assert "colloc admin install --apply" in f.detail


def _site(tmp_path: Path, plugin_mark: bytes, js_text: str | None = None) -> Path:
    etc = tmp_path / "etc"
    (etc / "plugstack.conf.d").mkdir(parents=True)
    plugin = _plugin(tmp_path, plugin_mark)
    (etc / "plugstack.conf").write_text(f"include {etc}/plugstack.conf.d/*.conf\n")
    (etc / "plugstack.conf.d" / "colloc.conf").write_text(f"optional {plugin}\n")
    (etc / "job_submit.lua").write_text(js_text or site.render_job_submit(S))
    (etc / "cli_filter.lua").write_text(site.render_cli_filter(S))
    conf = etc / "slurm.conf"
    conf.write_text("SelectType=select/cons_tres\nGresTypes=gpu,shard\n"
                    "CliFilterPlugins=lua\nJobSubmitPlugins=lua\n")
    return conf


def test_check_files_includes_the_plugin_release(tmp_path: Path) -> None:
    conf = _site(tmp_path, PLUGIN_MARK + b"0x160508\0")
    found = {f.what: f for f in doctor.check_files(conf, CollocConfig(shard_mib=2048), R2411)}
    assert found["SPANK plugin"].level == "ok"
    assert found["SPANK plugin Slurm release"].level == "fail"
    assert "job_submit.lua TRES spelling" not in found  # the current render writes gres/


def test_a_job_submit_lua_writing_the_old_spelling_fails(tmp_path: Path) -> None:
    old = site.render_job_submit(S).replace('"gres/shard:" .. k', '"gres:shard:" .. k')
    assert old != site.render_job_submit(S)
    conf = _site(tmp_path, PLUGIN_MARK + b"0x180b05\0", js_text=old)
    found = {f.what: f for f in doctor.check_files(conf, CollocConfig(shard_mib=2048), R2411)}
    f = found["job_submit.lua TRES spelling"]
    assert f.level == "fail" and "24.11+ refuses" in f.detail
    assert "colloc admin install --apply" in f.detail


# ------------------------------------------------------------------ sbatch --test-only
class Recorder:
    def __init__(self, rc: int, out: str) -> None:
        self.rc, self.out = rc, out
        self.argv: list[str] = []

    def __call__(self, argv: Sequence[str]) -> tuple[int, str]:
        self.argv = list(argv)
        return self.rc, self.out


WHICH = {"sbatch": "/usr/bin/sbatch", "runuser": "/usr/sbin/runuser"}.get


def test_root_submits_as_the_user_through_runuser() -> None:
    run = Recorder(0, "sbatch: Job 123 to start at 2026-11-25T10:00:00 using 1 processors "
                      "on nodes n1 in partition gpu\n")
    f = doctor.check_submit("alice", Path("/etc/slurm/slurm.conf"), run=run, which=WHICH,
                            euid=0)
    assert f.level == "ok" and "to start at" in f.detail and "as alice" in f.what
    assert run.argv[:4] == ["/usr/sbin/runuser", "-u", "alice", "--"]
    i = run.argv.index("/usr/bin/sbatch")
    assert run.argv[4:i] == ["env", "SLURM_CONF=/etc/slurm/slurm.conf"]
    probe = run.argv[i + 1:]
    assert "--test-only" in probe and "--colloc-mem=2G" in probe  # the plugin's option


def test_a_refusal_reports_slurms_words_and_the_fix() -> None:
    run = Recorder(1, "sbatch: warning: something\n" + TRES_REFUSAL)
    f = doctor.check_submit(run=run, which=WHICH, euid=0)
    assert f.level == "fail" and "as nobody" in f.what
    assert "Invalid Trackable RESource (TRES) specification" in f.detail
    assert "re-render it with colloc admin install --apply" in f.detail
    assert "warning: something" not in f.detail  # only the error lines


@pytest.mark.parametrize("out,hint", [
    ("sbatch: unrecognized option '--colloc-mem=2G'\n", "SPANK plugin did not load"),
    ("sbatch: error: Batch job submission failed: Invalid account or account/partition "
     "combination specified\n", "--submit-as USER"),
    ("sbatch: error: Batch job submission failed: Requested node configuration is not "
     "available\n", "no node offers shards"),
])
def test_other_refusals_name_their_cause(out: str, hint: str) -> None:
    f = doctor.check_submit(run=Recorder(1, out), which=WHICH, euid=0)
    assert f.level == "fail" and hint in f.detail, f.detail


def test_not_root_submits_as_itself_and_says_so() -> None:
    run = Recorder(0, "sbatch: Job 5 to start at now\n")
    f = doctor.check_submit("nobody", run=run, which=WHICH, euid=os.geteuid() or 12345)
    assert run.argv[0] == "/usr/bin/sbatch"
    assert f.level == "ok" and "cannot switch to nobody" in f.what


def test_root_without_runuser_fails_clearly() -> None:
    f = doctor.check_submit(run=Recorder(0, ""), which={"sbatch": "/b/sbatch"}.get, euid=0)
    assert f.level == "fail" and "runuser not found" in f.detail


# ------------------------------------------------------------------ the CLI
def _doctor(tmp_path: Path, version_line: str, *args: str) -> tuple[int, str]:
    from slurm_colloc.cli.admin_cmd import admin

    env = {"COLLOC_CONF": str(_colloc_conf(tmp_path)),
           "PATH": f"{_fake_sinfo(tmp_path, version_line)}:{os.environ['PATH']}"}
    r = CliRunner().invoke(admin, ["doctor", *args], env=env)
    return r.exit_code, r.output


def test_doctor_refuses_22_05_with_one_line(tmp_path: Path) -> None:
    conf = _site(tmp_path, PLUGIN_MARK + b"0x160508\0")
    rc, out = _doctor(tmp_path, "slurm-wlm 22.05.8", "--offline", "--slurm-conf", str(conf))
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert rc != 0 and len(lines) == 1, out
    assert "Slurm 22.05.8 is not supported" in lines[0]


def test_doctor_offline_reports_release_and_stale_plugin(tmp_path: Path) -> None:
    conf = _site(tmp_path, PLUGIN_MARK + b"0x160508\0")
    rc, out = _doctor(tmp_path, "slurm 24.11.5", "--offline", "--slurm-conf", str(conf))
    assert rc == 1, out
    assert "ok   Slurm release: 24.11.5 (supported: 24.11 <= Slurm < 26.11)" in out
    assert "FAIL SPANK plugin Slurm release" in out and "--test-only" not in out


@pytest.mark.parametrize("release,text,want", [
    (SlurmRelease(26, 5, 5), "CgroupPlugin=cgroup/v2\n", "warn"),
    (SlurmRelease(26, 5, 5), "CgroupPlugin=cgroup/v2\nCgroupJobIdPaths=yes\n", "ok"),
    (SlurmRelease(26, 5, 5), "CgroupPlugin=disabled\n", None),
    (SlurmRelease(25, 11, 2), "CgroupPlugin=cgroup/v2\n", None),
])
def test_cgroup_job_id_paths_on_26_05(tmp_path: Path, release: SlurmRelease, text: str,
                                      want: str | None) -> None:
    conf = tmp_path / "cgroup.conf"
    conf.write_text(text)
    found = doctor.check_cgroup_conf(conf, release)
    assert [f.level for f in found] == ([want] if want else [])
    if want == "warn":
        assert "CgroupJobIdPaths=yes" in found[0].detail and "SLUID" in found[0].detail
