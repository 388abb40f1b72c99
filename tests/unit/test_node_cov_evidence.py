"""Error paths of slurm_colloc.node.evidence: logs that cannot be read, symlinks, huge
or lying files, an attempt directory that already exists, the user's copy when its
name is taken or the write fails, and pruning of odd evidence trees."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from slurm_colloc.node import evidence
from slurm_colloc.node.as_user import AsUserError

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="chown/evidence ownership need root")
ME = os.getuid()
MYGID = os.getgid()


def _pipe_bytes(fd: int) -> bytes:
    chunks = []
    while True:
        b = os.read(fd, 1 << 16)
        if not b:
            return b"".join(chunks)
        chunks.append(b)


# ------------------------------------------------------------ copy_tail_fd ---


def _copy(src: Path, max_bytes: int, size: int | None = None) -> tuple[int, bytes]:
    out = src.with_name(src.name + ".copy")
    sfd = os.open(src, os.O_RDONLY)
    ofd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        n = evidence.copy_tail_fd(sfd, ofd, max_bytes, size=size)
    finally:
        os.close(sfd)
        os.close(ofd)
    return n, out.read_bytes()


def test_copy_tail_keeps_the_end_and_says_what_was_cut(tmp_path: Path) -> None:
    src = tmp_path / "log"
    src.write_bytes(b"a" * 3000 + b"THE END\n")
    n, data = _copy(src, 100)
    assert n == 100
    assert data == b"[colloc: first 2908 bytes omitted]\n" + (b"a" * 92 + b"THE END\n")


def test_copy_tail_small_file_is_copied_whole(tmp_path: Path) -> None:
    src = tmp_path / "log"
    src.write_bytes(b"short\n")
    assert _copy(src, 1 << 20) == (6, b"short\n")


def test_copy_tail_file_shorter_than_its_size_said(tmp_path: Path) -> None:
    """Truncated between fstat and read: copy what is there, no hang, no error."""
    src = tmp_path / "log"
    src.write_bytes(b"x" * 10)
    n, data = _copy(src, 1000, size=500)
    assert n == 10 and data == b"x" * 10


def test_copy_tail_never_reads_more_than_max_even_if_file_grew(tmp_path: Path) -> None:
    """The size said 10 (an fstat before the job wrote on): still at most max_bytes."""
    src = tmp_path / "log"
    src.write_bytes(b"y" * (3 << 20))
    n, data = _copy(src, 1 << 20, size=10)
    assert n == 1 << 20 and len(data) == 1 << 20


def test_copy_tail_zero_budget(tmp_path: Path) -> None:
    src = tmp_path / "log"
    src.write_bytes(b"abc")
    n, data = _copy(src, 0)
    assert n == 0 and data == b"[colloc: first 3 bytes omitted]\n"


# ------------------------------------------------------------------- keep ---


@pytest.fixture
def evdir(tmp_path: Path) -> Path:
    os.chmod(tmp_path, 0o755)
    return tmp_path / "evidence"


@root_only
def test_keep_never_overwrites_an_earlier_attempt(evdir: Path, tmp_path: Path) -> None:
    log = tmp_path / "job.out"
    log.write_text("OOM\n")
    assert evidence.keep(str(evdir), 5, 0, ME, MYGID, [str(log)], 1 << 20)
    with pytest.raises(FileExistsError, match="already exists"):
        evidence.keep(str(evdir), 5, 0, ME, MYGID, [str(log)], 1 << 20)
    # a symlink planted at the attempt's name is refused just the same
    (evdir / "5" / "attempt1").symlink_to(tmp_path)
    with pytest.raises(FileExistsError):
        evidence.keep(str(evdir), 5, 1, ME, MYGID, [str(log)], 1 << 20)


@root_only
def test_keep_root_owned_private_copies(evdir: Path, tmp_path: Path) -> None:
    log = tmp_path / "job.out"
    log.write_text("z" * 5000)
    errors: list[str] = []
    (written,) = evidence.keep(str(evdir), 6, 0, ME, 1234, [str(log), str(log)], 1000,
                               errors=errors)
    assert errors == []  # the same log named twice is copied once
    # root's, root's group (never the user's: issue 23); the owner (root here) needs
    # no ACL entry (test_privacy_evidence.py checks another owner's)
    st = os.stat(written)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o600)
    dst = os.stat(Path(written).parent)
    assert (dst.st_uid, dst.st_gid, stat.S_IMODE(dst.st_mode)) == (0, 0, 0o700)
    assert Path(written).name == "0-job.out"
    assert os.path.getsize(written) == 1000 + len(b"[colloc: first 4000 bytes omitted]\n")


@root_only
def test_keep_skips_unreadable_sources_and_leaves_no_empty_dir(evdir: Path,
                                                                tmp_path: Path) -> None:
    real = tmp_path / "real.out"
    real.write_text("secret")
    link = tmp_path / "link.out"
    link.symlink_to(real)
    errors: list[str] = []
    written = evidence.keep(str(evdir), 7, 0, ME, MYGID,
                            [str(tmp_path / "missing.out"), str(link), str(tmp_path)], 1 << 20,
                            errors=errors)
    assert written == []
    assert len(errors) == 3 and all(": not kept: " in e for e in errors)
    assert not evidence.attempt_dir(str(evdir), 7, 0).exists()
    # without an errors list, the same call is just as quiet
    assert evidence.keep(str(evdir), 7, 1, ME, MYGID, [str(link)], 1 << 20) == []


@root_only
def test_keep_reports_prune_failure(evdir: Path, tmp_path: Path, monkeypatch) -> None:
    log = tmp_path / "job.out"
    log.write_text("x")

    def broken(*a: Any, **k: Any) -> list[str]:
        raise PermissionError("EACCES")

    monkeypatch.setattr(evidence, "prune", broken)
    errors: list[str] = []
    assert len(evidence.keep(str(evdir), 8, 0, ME, MYGID, [str(log)], 10, errors=errors)) == 1
    assert errors == ["evidence not pruned: EACCES"]
    evidence.keep(str(evdir), 8, 1, ME, MYGID, [str(log)], 10)  # errors=None: no raise


@root_only
def test_keep_partial_copy_is_removed(evdir: Path, tmp_path: Path, monkeypatch) -> None:
    log = tmp_path / "job.out"
    log.write_text("x" * 100)

    def disk_full(src_fd: int, out_fd: int, max_bytes: int, *, size: int | None = None) -> int:
        os.write(out_fd, b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(evidence, "copy_tail_fd", disk_full)
    errors: list[str] = []
    assert evidence.keep(str(evdir), 9, 0, ME, MYGID, [str(log)], 100, errors=errors) == []
    assert "No space left on device" in errors[0]
    assert not evidence.attempt_dir(str(evdir), 9, 0).exists()


def test_target_names_are_safe() -> None:
    assert evidence._target_name(0, "/home/u/my job;rm -rf.out") == "0-my_job_rm_-rf.out"
    assert evidence._target_name(3, "/") == "3-log"
    assert len(evidence._target_name(1, "/x/" + "a" * 500)) == 2 + 100


# ---------------------------------------------------------- user copy text ---


def test_user_copy_text_reports_unreadable_root_copies(tmp_path: Path) -> None:
    good = tmp_path / "0-job.out"
    good.write_bytes(b"line\n" * 10)
    text = evidence.user_copy_text(
        job_id=7, attempt=1, node="", cause="gpu-oom", pattern=None, line=None,
        root_files=[str(tmp_path / "gone"), str(tmp_path), str(good)], now=0,
    )
    s = text.decode()
    assert "job: 7  attempt: 1  node: ?  written: 1970-01-01T00:00:00Z" in s
    assert "pattern: -" in s and "matched line" not in s
    assert "root's copy on the node: " + str(tmp_path) in s
    assert s.count("[colloc: not readable: ") == 2
    assert "not a regular file" in s
    assert s.endswith("line\n" * 10)


def test_user_copy_text_is_bounded_and_marks_cuts(tmp_path: Path) -> None:
    big = tmp_path / "0-big"
    big.write_bytes(b"b" * 10000)
    text = evidence.user_copy_text(
        job_id=7, attempt=0, node="n1", cause="gpu-oom", pattern="torch-oom",
        line="CUDA out of memory", root_files=[str(big)], max_bytes=2000,
    )
    assert len(text) <= 2000
    assert b"[colloc: last " in text and b"of 10000 bytes]" in text
    assert text.endswith(b"b" * 100)


def test_user_copy_text_too_small_for_any_file(tmp_path: Path) -> None:
    f = tmp_path / "0-x"
    f.write_bytes(b"data")
    text = evidence.user_copy_text(job_id=7, attempt=0, node="n", cause="c", pattern=None,
                                   line=None, root_files=[str(f)], max_bytes=250)
    assert b"--- 0-x ---" not in text and len(text) <= 250


def test_user_copy_text_symlinked_root_copy_is_not_followed(tmp_path: Path) -> None:
    secret = tmp_path / "shadow"
    secret.write_text("root:x:0:0")
    link = tmp_path / "0-link"
    link.symlink_to(secret)
    text = evidence.user_copy_text(job_id=1, attempt=0, node="n", cause="c", pattern=None,
                                   line=None, root_files=[str(link)])
    assert b"root:x:0:0" not in text and b"not readable" in text


# ------------------------------------------------ the user's copy, in-process ---


def test_create_exclusive_moves_to_the_next_suffix(tmp_path: Path) -> None:
    (tmp_path / evidence.user_copy_name(7, 0)).write_text("the user's own file")
    (tmp_path / evidence.user_copy_name(7, 0, 1)).symlink_to("/etc/passwd")
    p = evidence._create_exclusive(str(tmp_path), 7, 0, b"evidence")
    assert p == str(tmp_path / "colloc-evidence-7-0-2.txt")
    assert Path(p).read_bytes() == b"evidence"
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    assert (tmp_path / evidence.user_copy_name(7, 0)).read_text() == "the user's own file"


def test_create_exclusive_gives_up_when_all_names_are_taken(tmp_path: Path) -> None:
    for n in range(evidence.USER_COPY_MAX_SUFFIX + 1):
        (tmp_path / evidence.user_copy_name(7, 0, n)).write_text("")
    with pytest.raises(FileExistsError, match=r"and its 9 suffixes are taken"):
        evidence._create_exclusive(str(tmp_path), 7, 0, b"x")


def test_create_exclusive_failed_write_leaves_no_file(tmp_path: Path, monkeypatch) -> None:
    def quota(fd: int, data: bytes) -> None:
        raise OSError(122, "Disk quota exceeded")

    monkeypatch.setattr(evidence, "_write_all", quota)
    with pytest.raises(OSError, match="Disk quota exceeded"):
        evidence._create_exclusive(str(tmp_path), 7, 0, b"x")
    assert list(tmp_path.iterdir()) == []


def test_create_exclusive_refuses_a_symlinked_directory(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(OSError):
        evidence._create_exclusive(str(tmp_path / "link"), 7, 0, b"x")
    assert list(real.iterdir()) == []


def test_write_user_copy_needs_an_absolute_directory() -> None:
    with pytest.raises(AsUserError, match="not an absolute directory"):
        evidence.write_user_copy("relative/dir", 7, 0, b"x", ME, MYGID)


def test_write_user_copy_caps_the_data(tmp_path: Path, monkeypatch) -> None:
    seen: dict[str, Any] = {}

    def run(creds, action, *, timeout_s):  # type: ignore[no-untyped-def]
        seen.update(creds=creds, timeout=timeout_s)
        return action()

    monkeypatch.setattr(evidence, "run_as_user", run)
    p = evidence.write_user_copy(str(tmp_path), 7, 0, b"q" * (evidence.USER_COPY_MAX_BYTES * 2),
                                 ME, MYGID, timeout_s=3)
    assert os.path.getsize(p) == evidence.USER_COPY_MAX_BYTES
    assert seen["creds"].uid == ME and seen["timeout"] == 3


def test_keep_user_copy_never_raises(tmp_path: Path, monkeypatch) -> None:
    def refused(*a: Any, **k: Any) -> str:
        raise AsUserError("PermissionError: [Errno 13] Permission denied")

    monkeypatch.setattr(evidence, "write_user_copy", refused)
    errors: list[str] = []
    got = evidence.keep_user_copy("/logs/7.out", 7, 0, ME, MYGID, node="n", cause="gpu-oom",
                                  pattern=None, line=None, root_files=[], errors=errors)
    assert got is None
    assert errors == ["user copy of the evidence next to /logs/7.out not written: "
                      "PermissionError: [Errno 13] Permission denied"]
    assert evidence.keep_user_copy("x.out", 7, 0, ME, MYGID, node="n", cause="c", pattern=None,
                                   line=None, root_files=[]) is None  # errors=None


def test_keep_user_copy_of_a_bare_file_name_goes_to_root_dir(monkeypatch) -> None:
    dirs: list[str] = []
    monkeypatch.setattr(evidence, "write_user_copy",
                        lambda d, *a, **k: dirs.append(d) or f"{d}/c")
    evidence.keep_user_copy("7.out", 7, 0, ME, MYGID, node="n", cause="c", pattern=None,
                            line=None, root_files=[])
    assert dirs == ["/"]  # no directory part: "/", never the epilog's cwd


# ------------------------------------------------------------------ prune ---


def _attempt(root: Path, job: int, k: int, *, size: int = 0, age: float = 0,
             uid: int | None = None, now: float) -> Path:
    d = evidence.attempt_dir(str(root), job, k)
    d.mkdir(parents=True)
    if size:
        f = d / "0-log"
        f.write_bytes(b"x" * size)
        if uid is not None:
            os.chown(f, uid, uid)
    os.utime(d, (now - age, now - age))
    return d


def test_prune_missing_evidence_dir(tmp_path: Path) -> None:
    assert evidence.prune(str(tmp_path / "nope"), uid=ME) == []


@root_only
def test_prune_by_age_then_by_the_users_total(tmp_path: Path) -> None:
    now = time.time()
    old = _attempt(tmp_path, 1, 0, size=10, age=evidence.RETENTION_S + 60, uid=1001, now=now)
    a = _attempt(tmp_path, 2, 0, size=8192, age=300, uid=1001, now=now)
    b = _attempt(tmp_path, 3, 0, size=8192, age=200, uid=1001, now=now)
    other = _attempt(tmp_path, 4, 0, size=8192, age=400, uid=1002, now=now)
    just = _attempt(tmp_path, 5, 0, size=8192, age=500, uid=1001, now=now)
    (tmp_path / "stray-file").write_text("")  # not a job directory: ignored
    (tmp_path / "6").mkdir()
    (tmp_path / "6" / "notes").mkdir()  # not an attempt directory: ignored
    removed = evidence.prune(str(tmp_path), uid=1001, now=now, max_bytes_per_user=10000,
                             keep=just)
    # old by age (its job dir goes too), then 1001's oldest until under the cap;
    # ``keep`` (the oldest here) is never removed, nor another user's evidence
    assert removed == [str(old), str(a), str(b)]
    assert not (tmp_path / "1").exists()
    assert just.exists() and other.exists()


@root_only
def test_prune_counts_root_owned_attempts_by_their_files(tmp_path: Path) -> None:
    now = time.time()
    d = _attempt(tmp_path, 1, 0, size=100, uid=1001, now=now, age=10)
    os.chown(d, 0, 0)
    info = evidence._scan_attempt(d)
    assert info is not None and info.uid == 1001 and info.size >= 100
    empty = _attempt(tmp_path, 2, 0, now=now, age=10)
    assert evidence._scan_attempt(empty).uid == 0  # type: ignore[union-attr]


def test_scan_attempt_odd_entries(tmp_path: Path, monkeypatch) -> None:
    assert evidence._scan_attempt(tmp_path / "missing") is None
    f = tmp_path / "file"
    f.write_text("")
    assert evidence._scan_attempt(f) is None
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    assert evidence._scan_attempt(link) is None  # lstat: a link is not followed
    d = tmp_path / "attempt0"
    d.mkdir()
    for i in range(evidence.MAX_ENTRIES_PER_ATTEMPT + 20):
        (d / f"f{i}").write_bytes(b"")
    info = evidence._scan_attempt(d)
    assert info is not None and info.size == 0


def test_scan_attempt_unlistable_or_vanishing(tmp_path: Path, monkeypatch) -> None:
    d = tmp_path / "attempt0"
    d.mkdir()
    (d / "a").write_bytes(b"x" * 10)
    real_scandir = os.scandir

    def unlistable(path: Any) -> Any:
        raise PermissionError("EACCES")

    monkeypatch.setattr(evidence.os, "scandir", unlistable)
    info = evidence._scan_attempt(d)
    assert info is not None and info.size == 0

    class Vanishing:
        def __init__(self, entry: Any) -> None:
            self.entry = entry

        def stat(self, follow_symlinks: bool = True) -> Any:
            raise FileNotFoundError("gone")

    class It:
        def __init__(self, path: Any) -> None:
            self.it = real_scandir(path)

        def __enter__(self) -> Any:
            return (Vanishing(e) for e in self.it)

        def __exit__(self, *a: Any) -> None:
            self.it.close()

    monkeypatch.setattr(evidence.os, "scandir", It)
    info = evidence._scan_attempt(d)
    assert info is not None and info.size == 0


def test_remove_tolerates_a_vanished_attempt(tmp_path: Path) -> None:
    job = tmp_path / "9"
    job.mkdir()
    evidence._remove(job / "attempt0")  # already gone: no error
    assert not job.exists()  # the empty job directory is tidied
