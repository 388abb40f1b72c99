"""Issue 23 item 1: no user can hold the collector's lock and so keep collectors out.

Live: ``metrics_dir/collector.pid`` was 0644 in a 0755 directory, and ``flock`` works
on a read-only descriptor. A job that took a shared lock on it made
``collector_running()`` true in every prolog and made every collector exit at start.
Replayed here with a real unprivileged user (``nobody``) locking whatever it can open.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_colloc.metrics.collector import acquire_lock
from slurm_colloc.node.metrics_launch import collector_running

LOCK_ALL = r"""
import fcntl, os, sys, time
held = []
for top, dirs, files in os.walk(sys.argv[1]):
    for name in files:
        try:
            fd = os.open(os.path.join(top, name), os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            held.append(name)
        except OSError:
            pass
print("held", len(held), flush=True)
time.sleep(60)
"""


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every user can traverse (pytest's tmp_path is root's 0700)."""
    if os.geteuid() != 0:
        pytest.fail("this test runs a process as another user and needs root")
    d = Path(tempfile.mkdtemp(prefix="colloc-lock-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d)


def _as_nobody_lock_everything(metrics: Path) -> subprocess.Popen[str]:
    python = shutil.which("python3", path="/usr/bin:/bin")
    assert python is not None
    pwd.getpwnam("nobody")
    p = subprocess.Popen(["runuser", "-u", "nobody", "--", python, "-c", LOCK_ALL, str(metrics)],
                         stdout=subprocess.PIPE, text=True, cwd="/")
    assert p.stdout is not None
    assert p.stdout.readline().startswith("held")
    return p


def test_a_users_lock_keeps_no_collector_out(shared_dir: Path) -> None:
    metrics = shared_dir / "metrics"
    fd = acquire_lock(str(metrics))  # a collector ran and left its files
    assert fd is not None
    os.close(fd)
    attacker = _as_nobody_lock_everything(metrics)
    try:
        assert not collector_running(str(metrics)), "a user's lock passed for a collector"
        fd = acquire_lock(str(metrics), tries=1)
        assert fd is not None, "a user's lock kept the collector out"
        assert collector_running(str(metrics))
        os.close(fd)
    finally:
        attacker.kill()
        attacker.wait()


def test_the_lock_lives_in_roots_private_directory(shared_dir: Path) -> None:
    metrics = shared_dir / "metrics"
    metrics.mkdir()
    (metrics / "collector.pid").write_text("1\n")  # left by an older version
    os.chmod(metrics / "collector.pid", 0o644)
    fd = acquire_lock(str(metrics))
    assert fd is not None
    try:
        st = os.lstat(metrics / "collector")
        assert st.st_uid == 0 and st.st_mode & 0o777 == 0o700
        assert os.lstat(metrics / "collector" / "lock").st_mode & 0o777 == 0o600
        assert not (metrics / "collector.pid").exists(), "the old, openable lock stays"
    finally:
        os.close(fd)


def test_a_lock_directory_that_is_not_roots_is_never_trusted(shared_dir: Path) -> None:
    metrics = shared_dir / "metrics"
    (metrics / "collector").mkdir(parents=True)
    nobody = pwd.getpwnam("nobody")
    os.chown(metrics / "collector", nobody.pw_uid, nobody.pw_gid)
    (metrics / "collector" / "lock").write_text("")
    held = os.open(metrics / "collector" / "lock", os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_SH)
    try:
        assert not collector_running(str(metrics))
        with pytest.raises(PermissionError):
            acquire_lock(str(metrics))
    finally:
        os.close(held)


def test_a_symlinked_lock_directory_is_not_followed(shared_dir: Path) -> None:
    real = shared_dir / "real"
    real.mkdir(mode=0o700)
    (real / "lock").write_text("")
    metrics = shared_dir / "metrics"
    metrics.mkdir()
    (metrics / "collector").symlink_to(real)
    held = os.open(real / "lock", os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_SH)
    try:
        assert not collector_running(str(metrics))
        with pytest.raises(OSError):
            acquire_lock(str(metrics))
    finally:
        os.close(held)


def test_a_loose_mode_of_roots_lock_directory_is_tightened(shared_dir: Path) -> None:
    metrics = shared_dir / "metrics"
    (metrics / "collector").mkdir(parents=True)
    os.chmod(metrics / "collector", 0o755)
    assert not collector_running(str(metrics))  # not trusted as it is
    fd = acquire_lock(str(metrics))
    assert fd is not None
    os.close(fd)
    assert os.lstat(metrics / "collector").st_mode & 0o777 == 0o700
