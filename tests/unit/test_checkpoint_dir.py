"""The job's checkpoint directory (colloc.conf ``checkpoint_dir``): the TaskProlog makes
it as the job's user, mode 0700, exports it with the restart count, refuses paths
another user could change (and to run as root), and says why in one ``print`` line;
nothing at all when the feature is off. The directory-making runs in a child that is
really the job's user (uid 65534), as slurmstepd runs the TaskProlog."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_colloc.config import ConfigError, load
from slurm_colloc.node import checkpoint_dir as cd
from slurm_colloc.node.task_entry import task_prolog_main
from tests.unit.forked import in_child

USER = 65534
OTHER = 1000


@pytest.fixture
def base() -> Iterator[Path]:
    """A root-owned 0755 directory under /tmp that uid 65534 can reach."""
    if os.geteuid() != 0:
        pytest.fail("these tests need root (to run the child as another uid)")
    d = Path(tempfile.mkdtemp(prefix="colloc-ckpt-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d)


def _as_user(template: str, env: dict[str, str]) -> list[str]:
    """checkpoint_lines(template, env) run by a child that is uid/gid 65534."""
    def child() -> str:
        os.setgroups([])
        os.setresgid(USER, USER, USER)
        os.setresuid(USER, USER, USER)
        return json.dumps(cd.checkpoint_lines(template, env))

    return list(json.loads(in_child(child)))


def _scratch(base: Path, mode: int = 0o1777) -> Path:
    s = base / "scratch"
    s.mkdir()
    s.chmod(mode)
    return s


def test_off_says_nothing() -> None:
    assert cd.prepare("", {"SLURM_JOB_ID": "3"}) is None
    assert cd.checkpoint_lines("", {"SLURM_JOB_ID": "3"}) == []


def test_made_as_the_user_0700_and_exported_with_the_restart_count(base: Path) -> None:
    s = _scratch(base)
    out = _as_user(f"{s}/{{user}}/ckpt/{{jobid}}",
                   {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "2"})
    path = s / "nobody" / "ckpt" / "42"
    assert out == ["export COLLOC_RESTART_COUNT=2", f"export COLLOC_CHECKPOINT_DIR={path}"]
    st = path.stat()
    assert st.st_uid == USER and stat.S_IMODE(st.st_mode) == 0o700
    assert (s / "nobody").stat().st_uid == USER
    # the next attempt (same job id) finds the same directory, files and all
    (path / "step-10.ckpt").write_text("x")
    again = _as_user(f"{s}/{{user}}/ckpt/{{jobid}}", {"SLURM_JOB_ID": "42"})
    assert again == ["export COLLOC_RESTART_COUNT=0", f"export COLLOC_CHECKPOINT_DIR={path}"]
    assert (path / "step-10.ckpt").exists()


def test_a_directory_someone_else_made_for_you_is_refused(base: Path) -> None:
    s = _scratch(base)
    squat = s / "nobody"
    squat.mkdir(mode=0o777)
    squat.chmod(0o777)
    os.chown(squat, OTHER, OTHER)
    out = _as_user(f"{s}/{{user}}/{{jobid}}", {"SLURM_JOB_ID": "42"})
    assert out[0] == "export COLLOC_RESTART_COUNT=0" and len(out) == 2
    assert out[1].startswith("print colloc: no checkpoint directory for this job")
    assert f"{squat} is owned by uid {OTHER}" in out[1]


def test_a_link_to_another_users_directory_is_refused(base: Path) -> None:
    s = _scratch(base)
    theirs = base / "theirs"
    theirs.mkdir()
    os.chown(theirs, OTHER, OTHER)
    (s / "nobody").symlink_to(theirs)
    out = _as_user(f"{s}/{{user}}", {"SLURM_JOB_ID": "42"})
    assert "print colloc: no checkpoint directory" in out[-1]
    assert f"owned by uid {OTHER}" in out[-1]


def test_a_parent_others_may_write_without_sticky_bit_is_refused(base: Path) -> None:
    s = _scratch(base, 0o777)
    out = _as_user(f"{s}/{{user}}/{{jobid}}", {"SLURM_JOB_ID": "42"})
    assert f"{s} is writable by others (mode 0777)" in out[-1]


def test_cannot_create_is_told_and_the_task_runs(base: Path) -> None:
    out = _as_user(f"{base}/{{user}}/{{jobid}}", {"SLURM_JOB_ID": "42"})
    assert out[-1].startswith("print colloc: no checkpoint directory")
    assert "cannot create" in out[-1] and "Permission denied" in out[-1]


def test_never_made_as_root(base: Path) -> None:
    got = cd.prepare(f"{base}/{{user}}/{{jobid}}", {"SLURM_JOB_ID": "42"}, uid=0)
    assert got is not None and got.path is None and "as root" in (got.problem or "")
    assert list(base.iterdir()) == []


def test_the_users_own_variable_wins() -> None:
    env = {"SLURM_JOB_ID": "42", "COLLOC_CHECKPOINT_DIR": "/mine", "SLURM_RESTART_COUNT": "1"}
    assert cd.checkpoint_lines("/x/{jobid}", env) == ["export COLLOC_RESTART_COUNT=1"]


@pytest.mark.parametrize(("template", "why"), [
    ("/x/{jobid}/{nope}", "unknown placeholder"), ("/x/{jobid", "{"),
    ("/x/{jobid}/../y", "'..'"), ("rel/{jobid}", "absolute")])
def test_expand_refuses_bad_templates(template: str, why: str) -> None:
    with pytest.raises(cd.TemplateError, match=None) as e:
        cd.expand(template, home="/h", user="u", uid=5, job_id="7")
    assert why in str(e.value)


def test_expand_fills_in_and_normalises() -> None:
    assert cd.expand("{home}//.colloc/{user}-{uid}/{jobid}/", home="/h/u/", user="u",
                     uid=5, job_id="7") == "/h/u/.colloc/u-5/7"


@pytest.mark.parametrize(("value", "why"), [
    ("/x/ckpt", "must contain {jobid}"), ("x/{jobid}", "absolute path or start with {home}"),
    ("{home}/{jobid}/{job}", "unknown placeholder")])
def test_config_refuses_templates_that_cannot_work(tmp_path: Path, value: str, why: str) -> None:
    conf = tmp_path / "colloc.conf"
    conf.write_text(f'checkpoint_dir = "{value}"\n')
    with pytest.raises(ConfigError, match="checkpoint_dir") as e:
        load(conf)
    assert why in str(e.value)
    conf.write_text('checkpoint_dir = "{home}/.colloc/checkpoints/{jobid}"\n')
    assert load(conf).checkpoint_dir == "{home}/.colloc/checkpoints/{jobid}"


def _main(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
          conf_text: str, env: dict[str, str]) -> list[str]:
    conf = tmp_path / "colloc.conf"
    conf.write_text(f'mps_root = "{tmp_path / "mps"}"\n' + conf_text)
    monkeypatch.setenv("COLLOC_CONF", str(conf))
    assert task_prolog_main({"SLURM_JOB_ID": "5", "PATH": "/usr/bin:/bin", **env}) == 0
    return capsys.readouterr().out.splitlines()


def test_task_prolog_off_is_silent_and_on_says_why_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    assert _main(tmp_path, monkeypatch, capsys, "", {}) == []
    out = _main(tmp_path, monkeypatch, capsys,
                f'checkpoint_dir = "{tmp_path}/c/{{jobid}}"\n', {"SLURM_RESTART_COUNT": "1"})
    # these tests run as root: colloc refuses to make the directory as root
    assert out[0] == "export COLLOC_RESTART_COUNT=1"
    assert out[1].startswith("print colloc: no checkpoint directory") and "root" in out[1]
    assert not (tmp_path / "c").exists()


def test_task_prolog_keeps_a_site_task_prologs_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    site = tmp_path / "site"
    site.mkdir(mode=0o755)
    script = site / "tp"
    script.write_text("#!/bin/sh\necho 'export COLLOC_CHECKPOINT_DIR=/site/ckpt'\n")
    script.chmod(0o755)
    out = _main(tmp_path, monkeypatch, capsys,
                f'chain_task_prolog = "{script}"\ncheckpoint_dir = "/c/{{jobid}}"\n', {})
    assert out == ["export COLLOC_CHECKPOINT_DIR=/site/ckpt", "export COLLOC_RESTART_COUNT=0"]
