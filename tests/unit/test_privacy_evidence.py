"""Issue 23, item 4 "private data stays private", root's evidence copies.

* The per-user cap counts attempts by the job's owner from root's own record (the
  copies are root's, so their owner says nothing).
* A sparse log (holes cost the user nothing) never becomes real bytes in root's copy.
* Root's copy and its directory are readable by the job's owner and root only: not by
  another member of the owner's primary group, nor by anybody else.

These run as root with the system users ``colloc-u1`` and ``colloc-u2`` (the unit
session fixture creates them).
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_colloc.node import evidence
from slurm_colloc.node.as_user import AsUserError, Credentials, run_as_user


def _user(name: str) -> pwd.struct_passwd:
    return pwd.getpwnam(name)


@pytest.fixture
def top() -> Iterator[Path]:
    """A directory others can traverse (pytest's tmp_path is 0700 root)."""
    d = Path(tempfile.mkdtemp(prefix="colloc-priv-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _user_log(top: Path, owner: pwd.struct_passwd, name: str, data: bytes,
              sparse_bytes: int = 0) -> Path:
    d = top / f"out-{owner.pw_name}"
    d.mkdir(exist_ok=True)
    os.chown(d, owner.pw_uid, owner.pw_gid)
    p = d / name
    with open(p, "wb") as f:
        if sparse_bytes:
            f.truncate(sparse_bytes)  # a hole: no block is used
            f.seek(sparse_bytes)
        f.write(data)
    os.chown(p, owner.pw_uid, owner.pw_gid)
    return p


def _can_read(path: str, creds: Credentials) -> bool:
    def action() -> str:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        os.close(fd)
        return "read"

    try:
        return run_as_user(creds, action, timeout_s=10) == "read"
    except AsUserError as e:
        assert "Permission denied" in str(e), e  # only a refusal counts as "cannot"
        return False


def test_per_user_cap_counts_attempts_by_the_jobs_owner(top: Path, monkeypatch) -> None:
    """The cap was never applied: the owner came from the copies, which are root's.

    Three attempts of colloc-u1 of about 2000 bytes each under a 3000-byte cap: only
    the newest stays. colloc-u2's attempt is not touched."""
    u1, u2 = _user("colloc-u1"), _user("colloc-u2")
    monkeypatch.setattr(evidence, "MAX_BYTES_PER_USER", 3000)
    ev = top / "evidence"
    other = evidence.keep(str(ev), 40, 0, u2.pw_uid, u2.pw_gid,
                          [str(_user_log(top, u2, "v.err", b"v" * 2000))], 1 << 20)
    kept = []
    for job in (41, 42, 43):
        log = _user_log(top, u1, f"{job}.err", os.urandom(2000))
        kept.append(evidence.keep(str(ev), job, 0, u1.pw_uid, u1.pw_gid, [str(log)], 1 << 20))
    assert all(kept)
    left = sorted(p.name for p in ev.iterdir())
    assert left == ["40", "43"], left  # 41 and 42 pruned (oldest first); 40 is colloc-u2's
    assert Path(other[0]).exists()


def test_owner_record_is_roots_and_names_the_jobs_owner(top: Path) -> None:
    u1 = _user("colloc-u1")
    log = _user_log(top, u1, "a.err", b"x" * 100)
    (copy,) = evidence.keep(str(top / "ev"), 50, 0, u1.pw_uid, u1.pw_gid, [str(log)], 1 << 20)
    info = evidence._scan_attempt(Path(copy).parent)
    assert info is not None and info.uid == u1.pw_uid
    assert info.size >= 100


def test_old_layout_attempt_is_counted_by_its_files_owner(top: Path) -> None:
    """An attempt left by an older release has no owner record: the user-owned files
    (that layout) still name the owner."""
    d = top / "ev" / "7" / "attempt0"
    d.mkdir(parents=True)
    (d / "0-job.err").write_bytes(b"z" * 100)
    os.chown(d / "0-job.err", 1234, 0)
    info = evidence._scan_attempt(d)
    assert info is not None and info.uid == 1234


def test_a_user_cannot_forge_the_owner_record(top: Path) -> None:
    """The record is root's (0600 in root's directory): a user-owned file of that
    name (an old, user-owned attempt directory) is not believed."""
    d = top / "ev" / "8" / "attempt0"
    d.mkdir(parents=True)
    rec = d / evidence.OWNER_RECORD
    rec.write_text('{"uid": 4242}')
    os.chown(rec, 1234, 1234)
    (d / "0-job.err").write_bytes(b"z" * 100)
    os.chown(d / "0-job.err", 1234, 0)
    info = evidence._scan_attempt(d)
    assert info is not None and info.uid == 1234


def test_sparse_log_is_not_expanded_into_real_bytes(top: Path) -> None:
    """64 MiB of holes cost the user nothing: root's copy must not cost root 64 MiB."""
    u1 = _user("colloc-u1")
    tail = b"torch.OutOfMemoryError: CUDA out of memory.\n"
    log = _user_log(top, u1, "sparse.err", tail, sparse_bytes=64 << 20)
    assert os.stat(log).st_blocks * 512 < (1 << 20)  # the precondition: really sparse
    (copy,) = evidence.keep(str(top / "ev"), 60, 0, u1.pw_uid, u1.pw_gid, [str(log)], 64 << 20)
    st = os.stat(copy)
    assert st.st_blocks * 512 < (1 << 20), f"root's copy uses {st.st_blocks * 512} bytes"
    with open(copy, "rb") as f:
        f.seek(-len(tail), os.SEEK_END)
        assert f.read() == tail  # the message itself is kept
    assert st.st_size >= (64 << 20)  # same content (holes read as zeros)
    info = evidence._scan_attempt(Path(copy).parent)
    assert info is not None and info.size < (1 << 20)


def test_copy_is_readable_by_its_owner_only(top: Path) -> None:
    """Root's copy and the attempt directory: the owner reads them; another user in
    the owner's primary group does not, nor does anyone else."""
    u1, u2 = _user("colloc-u1"), _user("colloc-u2")
    log = _user_log(top, u2, "victim.err", b"secret training data\n")
    (copy,) = evidence.keep(str(top / "ev"), 70, 0, u2.pw_uid, u2.pw_gid, [str(log)], 1 << 20)
    owner = Credentials(u2.pw_uid, u2.pw_gid, (u2.pw_gid,))
    same_group = Credentials(u1.pw_uid, u2.pw_gid, (u2.pw_gid,))  # a shared primary group
    stranger = Credentials(u1.pw_uid, u1.pw_gid, (u1.pw_gid,))
    assert _can_read(copy, owner)
    assert not _can_read(copy, same_group)
    assert not _can_read(copy, stranger)
    d = str(Path(copy).parent)
    assert _can_read(d, owner)
    assert not _can_read(d, same_group)
    for p in (copy, d):
        st = os.lstat(p)
        assert st.st_uid == 0 and st.st_gid == 0, p  # nothing handed to the user's group
        # nothing for others, no write for anyone but root (the group bits of a file
        # with an ACL show its mask: the functional checks above are the real test)
        assert not stat.S_IMODE(st.st_mode) & 0o027, oct(st.st_mode)


def test_one_byte_per_mib_is_not_amplified(tmp_path: Path) -> None:
    """A byte of data every MiB (the user pays a block per MiB) must not make root
    write whole MiB: zeros are skipped per block, not per read chunk."""
    src = tmp_path / "src"
    with open(src, "wb") as f:
        for i in range(16):
            f.seek(i << 20)
            f.write(b"x")
        f.truncate(16 << 20)
    out = tmp_path / "out"
    sfd, ofd = os.open(src, os.O_RDONLY), os.open(out, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        n = evidence.copy_tail_fd(sfd, ofd, 15 << 20)  # a header, then unaligned output
    finally:
        os.close(sfd)
        os.close(ofd)
    assert n == 15 << 20
    data = out.read_bytes()
    head = b"[colloc: first 1048576 bytes omitted]\n"
    assert data == head + src.read_bytes()[1 << 20:]
    assert os.stat(out).st_blocks * 512 <= 2 * 16 * 4096 + 4096


def test_without_acls_the_copy_is_root_only_and_says_so(top: Path, monkeypatch) -> None:
    import errno

    from slurm_colloc import owner_read

    def no_acl(*a: object) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(owner_read.os, "setxattr", no_acl)
    u2 = _user("colloc-u2")
    log = _user_log(top, u2, "v.err", b"data\n")
    errors: list[str] = []
    (copy,) = evidence.keep(str(top / "ev"), 80, 0, u2.pw_uid, u2.pw_gid, [str(log)], 1 << 20,
                            errors=errors)
    assert stat.S_IMODE(os.stat(copy).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(Path(copy).parent).st_mode) == 0o700
    assert any("root-only" in e for e in errors), errors
    assert not _can_read(copy, Credentials(u2.pw_uid, u2.pw_gid, (u2.pw_gid,)))


def test_an_older_releases_group_readable_attempt_is_closed_on_the_next_prune(
        top: Path) -> None:
    """Evidence kept before this release is root:<user's gid> 0750: the next prune
    takes it from the group (root-only: no owner record names whom to grant)."""
    u1, u2 = _user("colloc-u1"), _user("colloc-u2")
    d = top / "ev" / "9" / "attempt0"
    d.mkdir(parents=True)
    (d / "0-job.err").write_text("old secret\n")
    os.chown(d / "0-job.err", 0, u2.pw_gid)
    os.chmod(d / "0-job.err", 0o640)
    os.chown(d, 0, u2.pw_gid)
    os.chmod(d, 0o750)
    same_group = Credentials(u1.pw_uid, u2.pw_gid, (u2.pw_gid,))
    assert _can_read(str(d / "0-job.err"), same_group)  # the leak, before
    evidence.prune(str(top / "ev"), uid=u1.pw_uid)
    assert not _can_read(str(d / "0-job.err"), same_group)
    st = os.lstat(d)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o700)
