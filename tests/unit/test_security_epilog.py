"""Security issue 11, the epilog's part: evidence copy, record building, requeue policy.

Each test names the finding it covers (M1, M2, M5, Low) in its docstring. The epilog
runs as root on compute nodes, so the tests that drop to a user need root and the
system user ``colloc-u1``; they are skipped elsewhere.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import pwd
import shutil
import stat
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

from slurm_colloc.config import CollocConfig
from slurm_colloc.node import epilog, evidence
from slurm_colloc.node.job import JobContext
from slurm_colloc.slurm.adapter import AccountingRecord, SlurmError

GPU_LINE = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
    "total capacity of 39.38 GiB of which 1.58 GiB is free."
)
MPS_LINE = "RuntimeError: CUDA error: the MPS client has been terminated by the server"
SHARD_RECORD = "colloc1:mode=estimate,need_mib=8000,shards=8,shard_mib=1024,alloc_mib=8192"
WHOLE_RECORD = "colloc1:mode=whole,need_mib=40960,shards=40,shard_mib=1024,alloc_mib=40960"

try:
    USER: pwd.struct_passwd | None = pwd.getpwnam("colloc-u1")
except KeyError:
    USER = None

needs_user = pytest.mark.skipif(
    os.geteuid() != 0 or USER is None, reason="needs root and the system user colloc-u1"
)


def _u() -> pwd.struct_passwd:
    assert USER is not None
    return USER


@pytest.fixture
def top():
    """A /tmp directory others can traverse (pytest's tmp_path is 0700 root)."""
    d = Path(tempfile.mkdtemp(prefix="colloc-sec-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def udir(top):
    """A directory owned by the job's user, as a job's output directory would be."""
    d = top / "user"
    d.mkdir()
    os.chown(d, _u().pw_uid, _u().pw_gid)
    return d


def user_file(d: Path, name: str, data: bytes | str) -> Path:
    p = d / name
    p.write_bytes(data.encode() if isinstance(data, str) else data)
    os.chown(p, _u().pw_uid, _u().pw_gid)
    return p


def attempt_files(evidence_dir: Path, job_id: int = 77, attempt: int = 0) -> list[Path]:
    d = evidence.attempt_dir(str(evidence_dir), job_id, attempt)
    return sorted(d.iterdir()) if d.is_dir() else []


# ---------------------------------------------------------------- M1: evidence ---


@needs_user
def test_m1_keep_refuses_fifo(top, udir) -> None:
    """M1: a FIFO as output path is never copied (root must not block or copy it)."""
    fifo = udir / "fifo.out"
    os.mkfifo(fifo)
    os.chown(fifo, _u().pw_uid, _u().pw_gid)
    ev = top / "evidence"
    t0 = time.monotonic()
    try:
        written = evidence.keep(str(ev), 77, 0, _u().pw_uid, _u().pw_gid, [str(fifo)], 1 << 20)
    except Exception:
        written = []
    assert time.monotonic() - t0 < 10
    assert written == [] and attempt_files(ev) == []


@needs_user
def test_m1_keep_refuses_device_nodes(top, udir) -> None:
    """M1: ``-e /dev/zero`` (or a device node of the user's) is never copied."""
    dev = udir / "null.out"
    os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    os.chown(dev, _u().pw_uid, _u().pw_gid)
    ev = top / "evidence"
    try:
        written = evidence.keep(
            str(ev), 77, 0, _u().pw_uid, _u().pw_gid, [str(dev), "/dev/zero"], 1 << 20
        )
    except Exception:
        written = []
    assert written == [] and attempt_files(ev) == []


@needs_user
def test_m1_keep_does_not_follow_symlinks(top, udir) -> None:
    """M1: the log is opened with O_NOFOLLOW: a symlink as output path is not copied."""
    real = user_file(udir, "real.out", "secret of the user's other job\n")
    link = udir / "link.out"
    os.symlink(real, link)
    os.chown(link, _u().pw_uid, _u().pw_gid, follow_symlinks=False)
    ev = top / "evidence"
    try:
        written = evidence.keep(str(ev), 77, 0, _u().pw_uid, _u().pw_gid, [str(link)], 1 << 20)
    except Exception:
        written = []
    assert written == [] and attempt_files(ev) == []


@needs_user
def test_m1_keep_copies_only_the_tail_and_user_cannot_grow_it(top, udir) -> None:
    """M1: at most ``max_bytes`` (the tail) is copied, and the copy lives in a directory
    the user cannot write to, so nothing the user does adds to root's disk use."""
    log = user_file(udir, "job.err", b"a" * (3 << 20) + GPU_LINE.encode() + b"\n")
    ev = top / "evidence"
    errors: list[str] = []
    written = evidence.keep(
        str(ev), 77, 0, _u().pw_uid, _u().pw_gid, [str(log)], 1 << 20, errors=errors
    )
    assert len(written) == 1 and not errors
    data = Path(written[0]).read_bytes()
    assert data.endswith(GPU_LINE.encode() + b"\n")
    body = data.split(b"\n", 1)[1]  # after the "[colloc: first N bytes omitted]" header
    assert len(body) == 1 << 20
    fst = os.stat(written[0])
    # root:root (the user's group does not read it, issue 23); the owner reads it by
    # an ACL entry (the group bits show the ACL's mask, r)
    assert (fst.st_uid, fst.st_gid, stat.S_IMODE(fst.st_mode)) == (0, 0, 0o640)
    d = os.stat(Path(written[0]).parent)
    assert d.st_uid == 0 and not d.st_mode & 0o022  # root's, not writable by the user


def test_m1_copy_stops_at_max_bytes_even_if_the_file_keeps_going(tmp_path) -> None:
    """M1: the copy loop reads at most ``max_bytes`` whatever the file's size says
    (/proc-style files report size 0 and still deliver data; a log may grow)."""
    src = tmp_path / "src"
    src.write_bytes(b"x" * 5000)
    dst = tmp_path / "dst"
    fd = os.open(src, os.O_RDONLY)
    out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        # pretend fstat said 0 bytes: the loop must still stop at max_bytes
        n = evidence.copy_tail_fd(fd, out, 100, size=0)
    finally:
        os.close(fd)
        os.close(out)
    assert n == 100 and dst.read_bytes() == b"x" * 100


def _fake_attempt(ev: Path, job_id: int, attempt: int, uid: int, size: int, age_s: float) -> Path:
    d = ev / str(job_id) / f"attempt{attempt}"
    d.mkdir(parents=True)
    f = d / "0-job.err"
    f.write_bytes(b"z" * size)
    os.chown(f, uid, 0)
    t = time.time() - age_s
    os.utime(f, (t, t))
    os.utime(d, (t, t))
    return d


def test_m1_prune_by_age(tmp_path) -> None:
    """M1: evidence older than the retention is deleted (it was never pruned)."""
    ev = tmp_path / "ev"
    old = _fake_attempt(ev, 1, 0, 1001, 10, evidence.RETENTION_S + 3600)
    new = _fake_attempt(ev, 2, 0, 1001, 10, 60)
    evidence.prune(str(ev), uid=1001)
    assert not old.exists() and not old.parent.exists()
    assert new.exists()


def test_m1_prune_by_size_per_user(tmp_path) -> None:
    """M1: a user's evidence is capped in total; the oldest goes first, the newest and
    other users' evidence stay."""
    ev = tmp_path / "ev"
    cap = 1000
    a = _fake_attempt(ev, 1, 0, 1001, 600, 300)
    b = _fake_attempt(ev, 2, 0, 1001, 600, 200)
    other = _fake_attempt(ev, 3, 0, 1002, 600, 400)
    c = _fake_attempt(ev, 4, 0, 1001, 600, 100)
    evidence.prune(str(ev), uid=1001, max_bytes_per_user=cap, keep=c)
    assert c.exists() and other.exists()
    assert not a.exists() and not b.exists()


def test_m1_prune_never_follows_symlinks(tmp_path) -> None:
    """M1: pruning deletes in place; a symlink planted in an (old-layout, user-owned)
    attempt directory is removed, its target is not."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keepme").write_text("x")
    ev = tmp_path / "ev"
    d = _fake_attempt(ev, 1, 0, 1001, 10, evidence.RETENTION_S + 10)
    os.symlink(victim, d / "link")
    t = time.time() - evidence.RETENTION_S - 10
    os.utime(d, (t, t))
    evidence.prune(str(ev), uid=1001)
    assert not d.exists() and (victim / "keepme").exists()


# ----------------------------------------------------- M1: detached module child ---


def test_m1_detached_child_is_isolated(tmp_path, monkeypatch) -> None:
    """M1: spawn_module's ``python -m`` must not import a module planted in a directory
    of the environment or the cwd (isolated mode, cwd /, scrubbed environment)."""
    from slurm_colloc.detach import spawn_module

    planted = tmp_path / "plant"
    planted.mkdir()
    marker = tmp_path / "imported"
    (planted / "coll_evil.py").write_text(f"open({str(marker)!r}, 'w').write('pwned')\n")
    monkeypatch.chdir(planted)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(planted), "PYTHONSTARTUP": str(planted)}
    spawn_module("coll_evil", (), env)
    # a legitimate module still runs (positive control): json.tool writes its output
    src = tmp_path / "in.json"
    src.write_text('{"a": 1}')
    out = tmp_path / "out.json"
    spawn_module("json.tool", (str(src), str(out)), env)
    deadline = time.monotonic() + 15
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    assert out.exists(), "the detached child did not run at all"
    assert not marker.exists(), "a module from PYTHONPATH/cwd was imported as root"


def test_m1_detached_child_argv_and_env(monkeypatch) -> None:
    """M1: the exec'd command line uses -I and the environment loses PYTHON*/LD_*."""
    from slurm_colloc import detach

    seen: dict[str, Any] = {}

    class Exec(Exception):
        pass

    def fake_execve(path: str, argv: list[str], env: dict[str, str]) -> None:
        seen.update(path=path, argv=argv, env=env)
        raise Exec

    def fake_exit(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(detach.os, "fork", lambda: 0)
    monkeypatch.setattr(detach.os, "setsid", lambda: None)
    monkeypatch.setattr(detach.os, "dup2", lambda a, b: None)
    monkeypatch.setattr(detach.os, "open", lambda *a, **k: 99)
    monkeypatch.setattr(detach.os, "closerange", lambda a, b: None)
    monkeypatch.setattr(detach.os, "chdir", lambda p: seen.setdefault("cwd", p))
    monkeypatch.setattr(detach.os, "execve", fake_execve)
    monkeypatch.setattr(detach.os, "_exit", fake_exit)
    with pytest.raises((Exec, SystemExit)):
        detach.spawn_module(
            "slurm_colloc.node.record_writer", ("1", "/x"),
            {"PATH": "/bin", "PYTHONPATH": "/home/u", "LD_PRELOAD": "/home/u/x.so",
             "COLLOC_CONF": "/etc/colloc.conf"},
        )
    assert seen["cwd"] == "/"
    assert seen["argv"][1] == "-I" and seen["argv"][2:4] == ["-m", "slurm_colloc.node.record_writer"]
    assert seen["env"] == {"PATH": "/bin", "COLLOC_CONF": "/etc/colloc.conf"}


# ------------------------------------------------------ the epilog, end to end ---


class FakeSlurm:
    """Records what the epilog asks of Slurm (duck-typed :class:`SlurmAdapter`)."""

    def __init__(self, fail_comment: bool = False) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail_comment = fail_comment

    def submit(self, script, args=(), env=None) -> int:  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def show_job(self, job_id):  # type: ignore[no-untyped-def]
        return None

    def jobs(self) -> dict[int, Any]:
        return {}

    def jobs_among(self, job_ids: Any) -> dict[int, Any]:
        return {}

    def accounting(self, job_ids) -> list[AccountingRecord]:  # type: ignore[no-untyped-def]
        return []

    def update_job(self, job_id, **settings: str) -> None:  # type: ignore[no-untyped-def]
        if self.fail_comment and "AdminComment" in settings:
            raise SlurmError("scontrol update: AdminComment refused")
        self.calls.append(("update", int(job_id), settings))

    def requeue(self, job_id, *, hold: bool = False) -> None:  # type: ignore[no-untyped-def]
        self.calls.append(("requeue", int(job_id), hold))

    def release(self, job_id) -> None:  # type: ignore[no-untyped-def]
        self.calls.append(("release", int(job_id)))

    def set_admin_comment_finished(self, job_id, value: str) -> None:  # type: ignore[no-untyped-def]
        self.calls.append(("sacctmgr", int(job_id), value))

    def nodes(self) -> list[dict[str, Any]]:
        return []

    def cancel(self, job_ids) -> None:  # type: ignore[no-untyped-def]
        self.calls.append(("cancel", list(job_ids)))

    def kinds(self) -> list[str]:
        return [c[0] for c in self.calls]

    def tres(self) -> list[str]:
        return [c[2]["TresPerNode"] for c in self.calls if c[0] == "update" and "TresPerNode" in c[2]]


LOG = logging.LoggerAdapter(logging.getLogger("test-epilog"), {})


def _cfg(top: Path, **kw: Any) -> CollocConfig:
    base: dict[str, Any] = dict(
        gpu_backend="sim", sim_state_dir=str(top / "sim"), mps_root=str(top / "mps"),
        evidence_dir=str(top / "var" / "evidence"), metrics_dir=str(top / "var" / "metrics"),
        history_db=str(top / "var" / "history.sqlite"), log_file=str(top / "colloc.log"),
        log_scan_tail_mib=1,
    )
    base.update(kw)
    return CollocConfig(**base)


def _ctx(log: Path, **kw: Any) -> JobContext:
    base: dict[str, Any] = dict(
        job_id=77, uid=_u().pw_uid, user=_u().pw_name, node="n1", gpus=(0,), shards=8,
        gpu_count=0, stdout=str(log), stderr=str(log), restarts=0,
        admin_comment=SHARD_RECORD, exit_code="1:0", state="FAILED",
    )
    base.update(kw)
    return JobContext(**base)


@pytest.fixture
def quiet_epilog(monkeypatch):
    """No detached record writer, a GPU of 40 shards (the sim backend has none here)."""
    spooled: list[str] = []
    monkeypatch.setattr(epilog, "_spool_record", lambda ctx, cfg, text, r: spooled.append(text))
    monkeypatch.setattr(epilog, "shards_per_gpu", lambda cfg, gpu: 40)
    return spooled


def _token(payload: bytes) -> str:
    return "cl1:" + base64.b32encode(zlib.compress(payload)).decode().rstrip("=").lower()


@needs_user
@pytest.mark.parametrize(
    "comment",
    [
        SHARD_RECORD + " othertool:" + "z" * 5000,  # > 4 KiB of someone else's text
        SHARD_RECORD + " " + _token(b'{"a":[{"n":' + b"9" * 5000 + b"}]}"),  # huge integer
        SHARD_RECORD + " " + _token(b"[" * 200_000),  # deep nesting
        SHARD_RECORD + " " + _token(b'{"a":[{"e":{"m":1,"x":"","g":' + b"9" * 400 + b"}}]}"),
    ],
    ids=["foreign-4k", "5000-digits", "deep-nesting", "float-overflow"],
)
def test_m2_requeue_survives_hostile_admin_comment(top, udir, quiet_epilog, comment) -> None:
    """M2: building the AdminComment text must not cancel a requeue already decided."""
    log = user_file(udir, "job.err", "step 1\n" + GPU_LINE + "\n")
    slurm = FakeSlurm()
    r = epilog.run(_ctx(log, admin_comment=comment), _cfg(top), slurm, LOG)
    assert r.cause == "gpu-oom" and r.decision is not None and r.decision.requeue
    assert r.requeued and slurm.kinds()[0] == "requeue" and slurm.kinds()[-1] == "release"
    assert slurm.tres() == ["gres/shard:40"]


@needs_user
def test_m2_requeue_survives_nvml_failure(top, udir, monkeypatch) -> None:
    """M2: an NVML error in shards_per_gpu() falls back to what is known (the config's
    GPU size here) instead of cancelling the requeue."""
    monkeypatch.setattr(epilog, "_spool_record", lambda ctx, cfg, text, r: None)

    def broken(cfg: CollocConfig, gpu: int | None) -> int:
        raise RuntimeError("NVML_ERROR_GPU_IS_LOST")

    monkeypatch.setattr(epilog, "shards_per_gpu", broken)
    log = user_file(udir, "job.err", GPU_LINE + "\n")
    slurm = FakeSlurm()
    r = epilog.run(_ctx(log), _cfg(top, gpu_memory_mib=40960), slurm, LOG)
    # the config's GPU less its MPS servers' budget: (40960 - 2 x 64) // 1024
    assert r.requeued and slurm.tres() == ["gres/shard:39"]
    assert any("NVML_ERROR_GPU_IS_LOST" in e for e in r.errors)


@needs_user
def test_m2_whole_record_gives_shards_per_gpu_when_nvml_fails(top, udir, monkeypatch) -> None:
    """M2: with no GPU size anywhere else, a mode=whole record's shards are the GPU's."""
    monkeypatch.setattr(epilog, "_spool_record", lambda ctx, cfg, text, r: None)

    def broken(cfg: CollocConfig, gpu: int | None) -> int:
        raise RuntimeError("NVML_ERROR_UNKNOWN")

    monkeypatch.setattr(epilog, "shards_per_gpu", broken)
    log = user_file(udir, "job.err", MPS_LINE + "\n")
    slurm = FakeSlurm()
    r = epilog.run(
        _ctx(log, shards=40, admin_comment=WHOLE_RECORD), _cfg(top), slurm, LOG
    )
    assert r.shards_per_gpu == 40 and r.requeued


@needs_user
def test_m2_comment_update_failure_keeps_the_requeue(top, udir, quiet_epilog) -> None:
    """M2: a refused AdminComment update after the requeue does not undo it or hide it."""
    log = user_file(udir, "job.err", GPU_LINE + "\n")
    slurm = FakeSlurm(fail_comment=True)
    r = epilog.run(_ctx(log), _cfg(top), slurm, LOG)
    assert r.requeued and slurm.kinds()[-1] == "release"
    assert any("AdminComment" in e for e in r.errors)


# ----------------------------------------------------------- M5: whole-GPU jobs ---


@needs_user
@pytest.mark.parametrize("line", [MPS_LINE, GPU_LINE])
def test_m5_plain_multi_gpu_job_is_never_rewritten_to_shards(top, udir, quiet_epilog, line) -> None:
    """M5: a plain ``gres:gpu:4`` job (not placed by colloc) whose log shows an MPS or
    OOM string is not requeued by root, let alone as ``gres:shard:40``."""
    log = user_file(udir, "job.err", line + "\n")
    slurm = FakeSlurm()
    ctx = _ctx(log, gpus=(0, 1, 2, 3), shards=0, gpu_count=4, admin_comment="")
    r = epilog.run(ctx, _cfg(top), slurm, LOG)
    assert slurm.calls == []
    assert not r.requeued and r.decision is not None and not r.decision.requeue
    assert "not placed by colloc" in r.decision.reason


def test_m5_requeue_refuses_whole_gpu_user_jobs() -> None:
    """M5: requeue() itself never rewrites a gres/gpu job (defence in depth)."""
    slurm = FakeSlurm()
    ctx = JobContext(
        job_id=5, uid=1000, user="u", node="n", gpus=(0, 1), shards=0, gpu_count=2,
        stdout=None, stderr=None, restarts=0, admin_comment="", exit_code="1:0",
        state="FAILED",
    )
    with pytest.raises(ValueError):
        epilog.requeue(ctx, slurm, 40)
    assert slurm.calls == []


@needs_user
def test_m5_colloc_whole_gpu_job_keeps_its_request_on_mps_fault(top, udir, quiet_epilog) -> None:
    """M5: a mode=whole job (colloc placed it) is still requeued on an MPS fault."""
    log = user_file(udir, "job.err", MPS_LINE + "\n")
    slurm = FakeSlurm()
    r = epilog.run(_ctx(log, shards=40, admin_comment=WHOLE_RECORD), _cfg(top), slurm, LOG)
    assert r.requeued and set(slurm.tres()) <= {"gres/shard:40"}


# ------------------------------------------------- M1 in the epilog: refused logs ---


@needs_user
def test_m1_epilog_keeps_only_logs_the_scan_read(top, udir, quiet_epilog, monkeypatch) -> None:
    """M1: logs the scan refused (symlink, FIFO, foreign owner) are not handed to keep."""
    good = user_file(udir, "job.out", GPU_LINE + "\n")
    link = udir / "job.err"
    os.symlink("/etc/shadow", link)
    os.chown(link, _u().pw_uid, _u().pw_gid, follow_symlinks=False)
    seen: list[list[str]] = []

    def fake_keep(*a: Any, **k: Any) -> list[str]:
        seen.append(list(a[5]))
        return []

    monkeypatch.setattr(evidence, "keep", fake_keep)
    epilog.run(_ctx(good, stderr=str(link)), _cfg(top), FakeSlurm(), LOG)
    assert seen == [[str(good)]]


@needs_user
def test_low_epilog_scans_with_the_users_primary_gid(top, udir, quiet_epilog, monkeypatch) -> None:
    """Low: the epilog's log scan runs with the user's primary gid, not gid = uid."""
    import slurm_colloc.oom.detector as det

    seen: dict[str, Any] = {}
    real = det.scan_files

    def spy(paths: Any, **kw: Any) -> Any:
        seen.update(kw)
        return real(paths, **kw)

    monkeypatch.setattr(det, "scan_files", spy)
    log = user_file(udir, "job.err", GPU_LINE + "\n")
    epilog.run(_ctx(log), _cfg(top), FakeSlurm(), LOG)
    assert seen["uid"] == _u().pw_uid and seen["gid"] == _u().pw_gid


def test_token_helper_roundtrip() -> None:
    """The test's token helper writes what the codec reads (guards the M2 tests)."""
    from slurm_colloc.accounting.codec import decode

    rec = decode(_token(json.dumps({"a": [{"n": 1}]}).encode()))
    assert rec.attempts[0].attempt == 1
