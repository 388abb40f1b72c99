"""Issue 23 (lows): ``colloc selftest`` runs as root.

* The results file was written through ``<name>.tmp`` in the current directory,
  following a symlink planted there (root then wrote wherever it pointed).
* ``--python`` was run as root whoever owned it: an interpreter (or its venv) in a
  directory a user can write is that user's code running as root.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_colloc.selftest import gpu_kit, report, trust


def _res() -> gpu_kit.KitResult:
    return gpu_kit.KitResult(exit_code=0, refusal=None, host="n1", started=1.0, finished=2.0,
                             options={})


# ------------------------------------------------------------ the results file ---


def test_json_is_not_written_through_a_planted_tmp_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    out_dir = tmp_path / "cwd"
    out_dir.mkdir()
    path = out_dir / "colloc-selftest-n1.json"
    (out_dir / (path.name + ".tmp")).symlink_to(victim)
    report.write_json(_res(), path)
    assert victim.read_text() == "keep me\n"
    assert json.loads(path.read_text())["exit_code"] == 0
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o644
    # nothing of ours is left behind (the planted link is the user's business)
    assert sorted(p.name for p in out_dir.iterdir()) == sorted([path.name, path.name + ".tmp"])


def test_json_replaces_a_link_at_its_name_instead_of_following_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    path = tmp_path / "res.json"
    path.symlink_to(victim)
    report.write_json(_res(), path)
    assert victim.read_text() == "keep me\n"
    assert not path.is_symlink() and json.loads(path.read_text())["host"] == "n1"


def test_json_failure_leaves_no_temporary_file(tmp_path: Path, monkeypatch) -> None:
    def boom(*a: object, **k: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(report.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        report.write_json(_res(), tmp_path / "res.json")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------- --python as root ---


@pytest.fixture
def top() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="colloc-kit-", dir="/var/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _python_copy(where: Path) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    p = where / "python3"
    shutil.copy(sys.executable, p)
    os.chmod(p, 0o755)
    return p


def test_roots_own_interpreter_is_trusted(top: Path) -> None:
    assert trust.untrusted_interpreter(_python_copy(top / "root" / "bin").as_posix()) is None
    real = os.path.realpath(sys.executable)
    assert trust.untrusted_interpreter(real) is None


def test_an_interpreter_a_user_owns_is_refused(top: Path) -> None:
    u1 = pwd.getpwnam("colloc-u1")
    p = _python_copy(top / "u" / "bin")
    os.chown(p, u1.pw_uid, u1.pw_gid)
    why = trust.untrusted_interpreter(str(p))
    assert why is not None and "owned by uid" in why and str(p) in why


def test_an_interpreter_in_a_users_directory_is_refused(top: Path) -> None:
    """The user could swap the file (or the venv around it) whatever its owner."""
    u1 = pwd.getpwnam("colloc-u1")
    venv = top / "home" / "venv"
    p = _python_copy(venv / "bin")
    os.chown(venv, u1.pw_uid, u1.pw_gid)
    why = trust.untrusted_interpreter(str(p))
    assert why is not None and str(venv) in why


def test_a_writable_interpreter_or_directory_is_refused(top: Path) -> None:
    p = _python_copy(top / "w" / "bin")
    os.chmod(p, 0o757)
    assert "writable" in str(trust.untrusted_interpreter(str(p)))
    os.chmod(p, 0o755)
    os.chmod(p.parent, 0o777)
    assert "writable" in str(trust.untrusted_interpreter(str(p)))
    os.chmod(p.parent, 0o1777)  # like /tmp: nobody else can rename root's python3
    assert trust.untrusted_interpreter(str(p)) is None


def test_a_root_link_to_a_users_interpreter_is_refused(top: Path) -> None:
    u1 = pwd.getpwnam("colloc-u1")
    theirs = _python_copy(top / "u2" / "bin")
    os.chown(theirs.parent, u1.pw_uid, u1.pw_gid)
    link_dir = top / "root-bin"
    link_dir.mkdir()
    (link_dir / "python3").symlink_to(theirs)
    assert trust.untrusted_interpreter(str(link_dir / "python3")) is not None


def test_a_venv_with_user_writable_site_packages_is_refused(top: Path) -> None:
    u1 = pwd.getpwnam("colloc-u1")
    venv = top / "venv"
    p = _python_copy(venv / "bin")
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    site = venv / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    assert trust.untrusted_interpreter(str(p)) is None
    os.chown(site, u1.pw_uid, u1.pw_gid)
    why = trust.untrusted_interpreter(str(p))
    assert why is not None and "site-packages" in why


def test_a_bare_name_is_looked_up_on_a_fixed_path(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "/tmp/evil:/home/u/bin")
    assert trust.resolve("python3") == shutil.which("python3", path=trust.SAFE_PATH)
    assert trust.resolve("no-such-interpreter-xyz") is None


def test_missing_or_not_a_file_is_refused(top: Path) -> None:
    assert "not found" in str(trust.untrusted_interpreter(str(top / "nope")))
    assert "not a regular file" in str(trust.untrusted_interpreter(str(top)))


def test_the_kit_refuses_before_running_an_untrusted_python(tmp_path: Path) -> None:
    """As root the kit checks --python before it runs it (the torch probe)."""
    from tests.unit.test_selftest_kit import SITE, rig

    r = rig(tmp_path)
    r.deps.python_trust = lambda p: f"{p}: owned by uid 999, not root"
    probed: list[str] = []
    real_probe = r.runner.probe

    def probe(python: str, script: str) -> dict[str, object]:
        probed.append(python)
        return real_probe(python, script)

    r.runner.probe = probe  # type: ignore[method-assign]
    res = gpu_kit.run_kit(gpu_kit.KitOptions(python="/home/u/python"), r.deps, SITE)
    assert res.exit_code == 2 and res.refusal is not None
    assert "--python" in res.refusal and "owned by uid 999" in res.refusal
    assert probed == [] and r.runner.started == []
