"""Issue 13: the user's copy of the OOM evidence, next to the job's output, written as
the job's user by a child that cannot get root back (slurm_colloc/node/as_user.py).

The privilege tests need root (the epilog's situation); they are skipped elsewhere.
``nobody`` (65534) is the job's user for the low-level tests, ``colloc-u1`` for the
epilog's (as in test_security_epilog.py).
"""

from __future__ import annotations

import ctypes
import logging
import os
import pwd
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from slurm_colloc.accounting.codec import decode
from slurm_colloc.config import CollocConfig
from slurm_colloc.node import as_user, epilog, evidence
from slurm_colloc.node.job import JobContext

NOBODY = 65534
NOGROUP = 65534
UNKNOWN_UID = 54321  # no passwd entry
GPU_LINE = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
    "total capacity of 39.38 GiB of which 1.58 GiB is free."
)
SHARD_RECORD = "colloc1:mode=estimate,need_mib=8000,shards=8,shard_mib=1024,alloc_mib=8192"

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (drops privileges)")

try:
    U1: pwd.struct_passwd | None = pwd.getpwnam("colloc-u1")
except KeyError:
    U1 = None
needs_u1 = pytest.mark.skipif(
    os.geteuid() != 0 or U1 is None, reason="needs root and the system user colloc-u1"
)


@pytest.fixture
def top():
    """A /tmp directory others can traverse (pytest's tmp_path is 0700 root)."""
    d = Path(tempfile.mkdtemp(prefix="colloc-ev13-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def owned_dir(parent: Path, name: str, uid: int, gid: int, mode: int = 0o700) -> Path:
    d = parent / name
    d.mkdir()
    os.chown(d, uid, gid)
    os.chmod(d, mode)
    return d


def _hang(*_: Any) -> str:
    time.sleep(60)
    return "not reached"


def _children() -> list[int]:
    """Our live children (zombies included), from /proc."""
    me, out = os.getpid(), []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            out.append(int(p.name))
    return out


# --------------------------------------------------------------- the child itself ---


@root_only
def test_child_runs_as_the_user_for_good() -> None:
    """All three uids and gids are the user's, no other groups, root cannot be
    regained, and the child is not dumpable (the user cannot ptrace it)."""

    def probe() -> str:
        try:
            os.setresuid(0, 0, 0)
            regained = "yes"
        except PermissionError:
            regained = "no"
        try:
            os.setgroups([0])
            groups_back = "yes"
        except PermissionError:
            groups_back = "no"
        dumpable = ctypes.CDLL(None, use_errno=True).prctl(3, 0, 0, 0, 0)  # PR_GET_DUMPABLE
        return repr((os.getresuid(), os.getresgid(), sorted(os.getgroups()), regained,
                     groups_back, dumpable))

    creds = as_user.credentials(NOBODY, NOGROUP)
    got = as_user.run_as_user(creds, probe, timeout_s=10)
    expected_groups = sorted(set(creds.groups))
    assert got == repr(((NOBODY,) * 3, (NOGROUP,) * 3, expected_groups, "no", "no", 0))
    assert os.geteuid() == 0 and os.getegid() == 0, "the parent must stay root"


@root_only
def test_unknown_uid_gets_no_supplementary_groups() -> None:
    creds = as_user.credentials(UNKNOWN_UID, UNKNOWN_UID)
    assert creds.groups == ()
    got = as_user.run_as_user(creds, lambda: repr((os.getuid(), os.getgroups())), timeout_s=10)
    assert got == repr((UNKNOWN_UID, []))


@root_only
def test_an_error_in_the_child_is_reported() -> None:
    def boom() -> str:
        raise ValueError("nope")

    with pytest.raises(as_user.AsUserError, match="ValueError: nope"):
        as_user.run_as_user(as_user.credentials(NOBODY, NOGROUP), boom, timeout_s=10)


@root_only
def test_a_hanging_child_is_killed_and_reaped() -> None:
    before = set(_children())
    t0 = time.monotonic()
    with pytest.raises(as_user.AsUserTimeout):
        as_user.run_as_user(
            as_user.credentials(NOBODY, NOGROUP), _hang, timeout_s=0.5
        )
    assert time.monotonic() - t0 < 5
    assert set(_children()) - before == set(), "the killed child was not reaped"


# ----------------------------------------------------------------- the user's copy ---


@root_only
def test_copy_is_created_as_the_user_0600(top) -> None:
    out = owned_dir(top, "out", NOBODY, NOGROUP)
    path = evidence.write_user_copy(str(out), 77, 1, b"hello\n", NOBODY, NOGROUP)
    assert path == str(out / "colloc-evidence-77-1.txt")
    st = os.lstat(path)
    assert (st.st_uid, st.st_gid) == (NOBODY, NOGROUP)
    assert stat.S_IMODE(st.st_mode) == 0o600 and stat.S_ISREG(st.st_mode)
    assert Path(path).read_bytes() == b"hello\n"


@root_only
def test_copy_for_a_uid_without_passwd_entry(top) -> None:
    out = owned_dir(top, "out", UNKNOWN_UID, UNKNOWN_UID)
    path = evidence.write_user_copy(str(out), 5, 0, b"x", UNKNOWN_UID, UNKNOWN_UID)
    assert os.lstat(path).st_uid == UNKNOWN_UID


def test_uid_0_job_writes_as_root(top) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    path = evidence.write_user_copy(str(top), 9, 0, b"x", 0, 0)
    assert os.lstat(path).st_uid == 0


@root_only
def test_existing_copy_is_never_overwritten(top) -> None:
    out = owned_dir(top, "out", NOBODY, NOGROUP)
    first = evidence.write_user_copy(str(out), 77, 0, b"first", NOBODY, NOGROUP)
    second = evidence.write_user_copy(str(out), 77, 0, b"second", NOBODY, NOGROUP)
    assert second == str(out / "colloc-evidence-77-0-1.txt")
    assert Path(first).read_bytes() == b"first" and Path(second).read_bytes() == b"second"


@root_only
def test_planted_symlink_is_not_followed(top) -> None:
    """A link at the target name (to a root file, or dangling into a root directory)
    is neither written through nor replaced: the next suffix is used."""
    secret = top / "root-file"
    secret.write_text("root's\n")
    os.chmod(secret, 0o666)  # even a file the user could write is not reached via the link
    rootdir = owned_dir(top, "rootdir", 0, 0, 0o777)
    out = owned_dir(top, "out", NOBODY, NOGROUP)
    os.symlink(secret, out / "colloc-evidence-77-0.txt")
    os.symlink(rootdir / "new", out / "colloc-evidence-77-0-1.txt")
    path = evidence.write_user_copy(str(out), 77, 0, b"evidence", NOBODY, NOGROUP)
    assert path == str(out / "colloc-evidence-77-0-2.txt")
    assert secret.read_text() == "root's\n"
    assert not (rootdir / "new").exists()
    assert os.path.islink(out / "colloc-evidence-77-0.txt")


@root_only
def test_all_names_taken_gives_up(top) -> None:
    out = owned_dir(top, "out", NOBODY, NOGROUP)
    for n in range(evidence.USER_COPY_MAX_SUFFIX + 1):
        (out / evidence.user_copy_name(77, 0, n)).write_text("old")
    with pytest.raises(as_user.AsUserError, match="taken"):
        evidence.write_user_copy(str(out), 77, 0, b"new", NOBODY, NOGROUP)
    assert all(p.read_text() == "old" for p in out.iterdir())


@root_only
def test_symlinked_directory_is_refused(top) -> None:
    real = owned_dir(top, "real", NOBODY, NOGROUP)
    link = top / "link"
    os.symlink(real, link)
    with pytest.raises(as_user.AsUserError, match=r"Too many levels|Not a directory"):
        evidence.write_user_copy(str(link), 77, 0, b"x", NOBODY, NOGROUP)
    assert list(real.iterdir()) == []


def _root_copy(top: Path, data: bytes) -> str:
    d = top / "evidence" / "77" / "attempt0"
    d.mkdir(parents=True)
    p = d / "0-job.out"
    p.write_bytes(data)
    return str(p)


@root_only
def test_directory_the_user_cannot_write_fails_cleanly(top) -> None:
    """A root directory (0755) next to the log: no file, an error, root's copy stays."""
    rootcopy = _root_copy(top, b"log\n")
    out = owned_dir(top, "out", 0, 0, 0o755)
    errors: list[str] = []
    got = evidence.keep_user_copy(
        str(out / "job.out"), 77, 0, NOBODY, NOGROUP, node="n1", cause="gpu-oom",
        pattern="torch-oom", line=GPU_LINE, root_files=[rootcopy], errors=errors,
    )
    assert got is None and list(out.iterdir()) == []
    assert len(errors) == 1 and "Permission denied" in errors[0]
    assert Path(rootcopy).read_bytes() == b"log\n"


@root_only
def test_hanging_writer_times_out(top, monkeypatch) -> None:
    """A writer that hangs (NFS) is killed at the deadline; the epilog goes on."""
    monkeypatch.setattr(evidence, "_create_exclusive", _hang)
    rootcopy = _root_copy(top, b"log\n")
    out = owned_dir(top, "out", NOBODY, NOGROUP)
    errors: list[str] = []
    t0 = time.monotonic()
    got = evidence.keep_user_copy(
        str(out / "job.out"), 77, 0, NOBODY, NOGROUP, node="n1", cause="gpu-oom",
        pattern=None, line=None, root_files=[rootcopy], errors=errors, timeout_s=0.5,
    )
    assert got is None and time.monotonic() - t0 < 5
    assert "no answer within 0.5 s" in errors[0]


def test_text_has_the_header_and_is_bounded(top) -> None:
    big = b"".join(b"line %d\n" % i for i in range(200_000)) + GPU_LINE.encode() + b"\n"
    rootcopy = _root_copy(top, big)
    text = evidence.user_copy_text(
        job_id=77, attempt=0, node="n1", cause="gpu-oom", pattern="torch-oom",
        line=GPU_LINE, root_files=[rootcopy, rootcopy], now=0,
    )
    assert len(text) <= evidence.USER_COPY_MAX_BYTES
    head = text.decode().splitlines()[:5]
    assert head[1] == "job: 77  attempt: 0  node: n1  written: 1970-01-01T00:00:00Z"
    assert head[2] == "cause: gpu-oom  pattern: torch-oom"
    assert head[3] == f"matched line: {GPU_LINE}"
    assert str(Path(rootcopy).parent) in head[4]
    assert text.count(GPU_LINE.encode()) == 3  # the header, and the end of each copy
    assert b"[colloc: last " in text


# ------------------------------------------------------------------ in the epilog ---


class _NoSlurm:
    def requeue(self, *a: Any, **k: Any) -> None:
        pass

    def update_job(self, *a: Any, **k: Any) -> None:
        pass

    def release(self, *a: Any, **k: Any) -> None:
        pass


def _u1() -> pwd.struct_passwd:
    assert U1 is not None
    return U1


def _epilog(top: Path, monkeypatch, **cfg_kw: Any) -> tuple[Path, Path, Any, list[str]]:
    udir = owned_dir(top, "user", _u1().pw_uid, _u1().pw_gid, 0o755)
    log = udir / "job.out"
    log.write_text("step 1\n" + GPU_LINE + "\n")
    os.chown(log, _u1().pw_uid, _u1().pw_gid)
    spooled: list[str] = []
    monkeypatch.setattr(epilog, "_spool_record", lambda ctx, cfg, text, r: spooled.append(text))
    monkeypatch.setattr(epilog, "shards_per_gpu", lambda cfg, gpu: 40)
    cfg = CollocConfig(
        gpu_backend="sim", sim_state_dir=str(top / "sim"), mps_root=str(top / "mps"),
        evidence_dir=str(top / "var" / "evidence"), metrics_dir=str(top / "var" / "metrics"),
        history_db=str(top / "var" / "history.sqlite"), log_file=str(top / "colloc.log"),
        log_scan_tail_mib=1, max_requeues=0, **cfg_kw,
    )
    ctx = JobContext(
        job_id=77, uid=_u1().pw_uid, user=_u1().pw_name, node="n1", gpus=(0,), shards=8,
        gpu_count=0, stdout=str(log), stderr=None, restarts=0, admin_comment=SHARD_RECORD,
        exit_code="1:0", state="FAILED",
    )
    r = epilog.run(ctx, cfg, _NoSlurm(), logging.LoggerAdapter(logging.getLogger("t"), {}))  # type: ignore[arg-type]
    return udir, Path(cfg.evidence_dir), r, spooled


@needs_u1
def test_epilog_leaves_the_users_copy_and_records_it(top, monkeypatch) -> None:
    udir, evdir, r, spooled = _epilog(top, monkeypatch)
    copy = udir / "colloc-evidence-77-0.txt"
    assert r.cause == "gpu-oom" and r.evidence_files[0] == str(copy), r.errors
    st = os.lstat(copy)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (
        _u1().pw_uid, _u1().pw_gid, 0o600)
    text = copy.read_text()
    assert "job: 77  attempt: 0  node: n1" in text and text.rstrip().endswith(GPU_LINE)
    root_copies = sorted(p for p in (evdir / "77" / "attempt0").iterdir()
                         if p.name != evidence.OWNER_RECORD)
    assert [str(p) for p in root_copies] == r.evidence_files[1:]
    assert len(spooled) == 1
    rec = decode(spooled[0])
    oom = rec.attempts[-1].oom
    assert oom is not None and oom.evidence_path == str(copy)


@needs_u1
def test_epilog_without_user_copy_records_roots_copy(top, monkeypatch) -> None:
    udir, evdir, r, spooled = _epilog(top, monkeypatch, evidence_user_copy=False)
    assert sorted(p.name for p in udir.iterdir()) == ["job.out"]
    oom = decode(spooled[0]).attempts[-1].oom
    assert oom is not None and oom.evidence_path == r.evidence_files[0]
    assert str(oom.evidence_path).startswith(str(evdir))


@needs_u1
def test_epilog_falls_back_to_roots_copy_when_the_write_fails(top, monkeypatch) -> None:
    monkeypatch.setattr(evidence, "_create_exclusive", lambda *a: str(1 / 0))
    _, evdir, r, spooled = _epilog(top, monkeypatch)
    assert any("user copy of the evidence" in e for e in r.errors)
    oom = decode(spooled[0]).attempts[-1].oom
    assert oom is not None and oom.evidence_path is not None
    assert oom.evidence_path.startswith(str(evdir))
