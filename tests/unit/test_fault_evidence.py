"""Issue 28, items 4 and 5: evidence and causes that survive, promises checked.

* The user's copy of the OOM evidence is made when root's copy fails (a full evidence
  file system), and root's when the user's fails.
* A job log the scan could not read (FIFO, deleted, unreadable) is named in the
  epilog's log line, in the attempt's record (old records still decode) and in the
  report, instead of a bare ``cause=none``.
* A newcomer whose shards and the GPU's registered jobs' exceed the GPU is not
  co-located: it is requeued (never held, never a drained node), at most
  ``promise.MAX_REFUSALS`` times; a COMPLETING neighbour does not count.
* A job whose MPS marker is gone still takes its GPU's idle pipe directory along.

The epilog tests that drop privileges need root and the system user ``colloc-u1``
(as in test_evidence_user_copy.py).
"""

from __future__ import annotations

import errno
import logging
import os
import pwd
import shutil
import stat
import tempfile
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from slurm_colloc.accounting import codec
from slurm_colloc.accounting.record import Attempt, JobRecord, OomInfo
from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu.backend import GpuInfo
from slurm_colloc.gpu.budget import budget_of
from slurm_colloc.gpu.identity import GpuMap
from slurm_colloc.mps.tenancy import Tenancy
from slurm_colloc.node import epilog, evidence, prolog, promise, unscanned
from slurm_colloc.node.job import JobContext, context_to_json
from slurm_colloc.oom.detector import ScanResult
from slurm_colloc.slurm.adapter import SlurmError

GPU_LINE = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. "
            "GPU 0 has a total capacity of 39.38 GiB of which 1.58 GiB is free.")
SHARD_RECORD = "colloc1:mode=estimate,need_mib=8000,shards=8,shard_mib=1024,alloc_mib=8192"
LOG = logging.LoggerAdapter(logging.getLogger("test-fault-evidence"), {})

try:
    U1: pwd.struct_passwd | None = pwd.getpwnam("colloc-u1")
except KeyError:
    U1 = None
needs_u1 = pytest.mark.skipif(
    os.geteuid() != 0 or U1 is None, reason="needs root and the system user colloc-u1"
)


def _u1() -> pwd.struct_passwd:
    assert U1 is not None
    return U1


class FakeSlurm:
    """Duck-typed SlurmAdapter: records calls; ``fail`` makes requeue raise."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail = fail

    def jobs_among(self, job_ids: Any) -> dict[int, Any]:
        """The prolog's query (issue 28); the epilog asks nothing of it."""
        return {}

    def requeue(self, job_id: int, *, hold: bool = False) -> None:
        self.calls.append(("requeue", job_id, hold))
        if self.fail is not None:
            raise self.fail

    def update_job(self, job_id: int, **settings: str) -> None:
        self.calls.append(("update", job_id, settings))

    def release(self, job_id: int) -> None:
        self.calls.append(("release", job_id))


@pytest.fixture
def top():
    """A /tmp directory others can traverse (pytest's tmp_path is 0700 root)."""
    d = Path(tempfile.mkdtemp(prefix="colloc-f28-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _cfg(top: Path, **kw: Any) -> CollocConfig:
    return CollocConfig(
        gpu_backend="sim", sim_state_dir=str(top / "sim"), mps_root=str(top / "mps"),
        evidence_dir=str(top / "var" / "evidence"), metrics_dir=str(top / "var" / "metrics"),
        history_db=str(top / "var" / "history.sqlite"), log_file=str(top / "colloc.log"),
        log_scan_tail_mib=1, max_requeues=0, **kw,
    )


def _user_dir(top: Path) -> Path:
    d = top / "user"
    d.mkdir()
    os.chown(d, _u1().pw_uid, _u1().pw_gid)
    os.chmod(d, 0o755)
    return d


def _user_log(udir: Path, name: str = "job.out", text: str = "step 1\n" + GPU_LINE + "\n"
              ) -> Path:
    log = udir / name
    log.write_text(text)
    os.chown(log, _u1().pw_uid, _u1().pw_gid)
    return log


def _epilog(top: Path, monkeypatch: pytest.MonkeyPatch, stdout: Path, stderr: Path | None = None,
            **cfg_kw: Any) -> tuple[Any, list[str]]:
    spooled: list[str] = []
    monkeypatch.setattr(epilog, "_spool_record", lambda ctx, cfg, text, r: spooled.append(text))
    monkeypatch.setattr(epilog, "shards_per_gpu", lambda cfg, gpu: 40)
    monkeypatch.setattr(epilog, "_metrics", lambda ctx, cfg: (None, ()))
    ctx = JobContext(
        job_id=77, uid=_u1().pw_uid, user=_u1().pw_name, node="n1", gpus=(0,), shards=8,
        gpu_count=0, stdout=str(stdout), stderr=str(stderr) if stderr else None, restarts=0,
        admin_comment=SHARD_RECORD, exit_code="1:0", state="FAILED",
    )
    r = epilog.run(ctx, _cfg(top, **cfg_kw), FakeSlurm(), LOG)  # type: ignore[arg-type]
    return r, spooled


# ------------------------------------------------ evidence copies are independent ---


@needs_u1
def test_users_copy_is_made_when_roots_copy_fails(top, monkeypatch) -> None:
    """A full evidence file system: root keeps nothing, the user's copy is still made
    from the log itself, and the failure is in the epilog's log line."""
    udir = _user_dir(top)
    log = _user_log(udir)

    def full(*a: Any, **k: Any) -> list[str]:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(evidence, "keep", full)
    r, spooled = _epilog(top, monkeypatch, log)
    copy = udir / "colloc-evidence-77-0.txt"
    assert r.cause == "gpu-oom" and r.evidence_files == [str(copy)], r.errors
    assert any("evidence not kept" in e and "No space left" in e for e in r.errors)
    assert "No space left" in r.summary()
    st = os.lstat(copy)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (_u1().pw_uid, 0o600)
    text = copy.read_text()
    assert "root's copy on n1: not kept" in text
    assert "--- job.out ---" in text and text.rstrip().endswith(GPU_LINE)
    oom = codec.decode(spooled[0]).attempts[-1].oom
    assert oom is not None and oom.evidence_path == str(copy)


@needs_u1
def test_roots_copy_is_made_when_the_users_copy_fails(top, monkeypatch) -> None:
    udir = _user_dir(top)
    log = _user_log(udir)
    monkeypatch.setattr(evidence, "_create_exclusive", lambda *a: str(1 / 0))
    r, spooled = _epilog(top, monkeypatch, log)
    assert any("user copy of the evidence" in e for e in r.errors)
    assert sorted(p.name for p in udir.iterdir()) == ["job.out"]
    assert len(r.evidence_files) == 1
    assert Path(r.evidence_files[0]).read_text().rstrip().endswith(GPU_LINE)
    oom = codec.decode(spooled[0]).attempts[-1].oom
    assert oom is not None and oom.evidence_path == r.evidence_files[0]


@needs_u1
def test_both_copies_fail_and_each_failure_is_logged(top, monkeypatch) -> None:
    udir = _user_dir(top)
    log = _user_log(udir)
    monkeypatch.setattr(evidence, "keep", lambda *a, **k: str(1 / 0))
    monkeypatch.setattr(evidence, "_create_exclusive", lambda *a: str(1 / 0))
    r, spooled = _epilog(top, monkeypatch, log)
    line = r.summary()
    assert "evidence not kept" in line and "user copy of the evidence" in line
    assert r.evidence_files == [] and r.cause == "gpu-oom"
    assert codec.decode(spooled[0]).attempts[-1].oom.cause == "gpu-oom"  # type: ignore[union-attr]


# ------------------------------------------------------- logs it could not scan ---


@needs_u1
def test_a_fifo_stdout_is_named_in_the_log_and_the_record(top, monkeypatch) -> None:
    udir = _user_dir(top)
    fifo = udir / "job.out"
    os.mkfifo(fifo, 0o600)
    os.chown(fifo, _u1().pw_uid, _u1().pw_gid)
    r, spooled = _epilog(top, monkeypatch, fifo)
    assert r.cause == "none"
    assert r.unscanned == [f"{fifo}: FIFO, not read"]
    assert f"cannot scan {fifo}: FIFO, not read" in r.summary()
    att = codec.decode(spooled[0]).attempts[-1]
    assert att.unscanned == (f"{fifo}: FIFO, not read",) and att.oom is None


@needs_u1
def test_a_deleted_and_an_unreadable_log_are_named(top, monkeypatch) -> None:
    udir = _user_dir(top)
    gone = udir / "gone.out"
    locked = _user_log(udir, "job.err", "nothing\n")
    os.chmod(locked, 0o000)  # its owner cannot read it either
    r, spooled = _epilog(top, monkeypatch, gone, locked)
    assert r.unscanned == [f"{locked}: unreadable (Permission denied)",
                           f"{gone}: missing (deleted?), not read"]
    att = codec.decode(spooled[0]).attempts[-1]
    assert att.unscanned == tuple(r.unscanned)


@needs_u1
def test_an_oom_in_one_log_is_found_while_the_other_is_named(top, monkeypatch) -> None:
    udir = _user_dir(top)
    err = _user_log(udir, "job.err")
    r, _ = _epilog(top, monkeypatch, udir / "deleted.out", err)
    assert r.cause == "gpu-oom"
    assert r.unscanned == [f"{udir / 'deleted.out'}: missing (deleted?), not read"]


@pytest.mark.parametrize(
    ("status", "error", "said"),
    [
        ("refused", "/x: not a regular file (mode prw-r--r--)", "FIFO, not read"),
        ("refused", "/x: not a regular file (mode crw-rw-rw-)", "character device, not read"),
        ("refused", "/x: is a symlink", "a symlink, not followed"),
        ("refused", "/x: owned by uid 0, not the job's uid 5", "not the job user's file, not read"),
        ("missing", "No such file or directory", "missing (deleted?), not read"),
        ("unreadable", "Permission denied", "unreadable (Permission denied)"),
    ],
)
def test_why_a_log_was_not_scanned(status: str, error: str, said: str) -> None:
    r = ScanResult("/x", "none", status=status, error=error)  # type: ignore[arg-type]
    assert unscanned.why(r) == said
    assert unscanned.named([r, ScanResult("/y", "none")]) == [f"/x: {said}"]


def test_named_is_bounded_and_printable() -> None:
    rs = [ScanResult(f"/l\x1b{i}" + "a" * 400, "none", status="missing") for i in range(5)]
    out = unscanned.named(rs)
    assert len(out) == unscanned.MAX_LOGS
    assert all(len(x) <= unscanned.MAX_CHARS and "\x1b" not in x for x in out)


# --------------------------------------------------------------------- the codec ---


def test_unscanned_round_trips_and_old_records_decode() -> None:
    a = Attempt(attempt=0, node="n1", oom=OomInfo("none"),
                unscanned=("/h/u/77.out: FIFO, not read",))
    assert codec.decode(codec.encode(JobRecord((a,)))).attempts[0].unscanned == a.unscanned
    old = codec.encode(JobRecord((replace(a, unscanned=()),)))
    assert codec.decode(old).attempts[0].unscanned == ()
    assert codec._attempt_to_json(a)["ul"] == list(a.unscanned)  # compact key
    assert "ul" not in codec._attempt_to_json(replace(a, unscanned=()))


@pytest.mark.parametrize("bad", [["x"] * 5, [1], "x", ["y" * 241], {"a": 1}])
def test_a_malformed_unscanned_list_is_dropped_not_the_record(bad: Any) -> None:
    d = codec._attempt_to_json(Attempt(attempt=3, node="n1"))
    d["ul"] = bad
    att = codec._attempt_from_json(d)
    assert att.attempt == 3 and att.unscanned == ()


# -------------------------------------------------------------------- the report ---


def test_the_report_says_the_output_could_not_be_scanned() -> None:
    from rich.console import Console

    from slurm_colloc.report import model, text

    a = Attempt(attempt=0, node="n1", unscanned=("/h/u/77.out: FIFO, not read",))
    v = model._view(a, "FAILED")
    assert v.unscanned == ["/h/u/77.out: FIFO, not read"]
    rep = model.JobReport(job_id="77", name="j", user="u", state="FAILED", exit_code="1:0",
                          node="n1", elapsed_s=3, colloc=True, submitted=None, attempts=[v])
    con = Console(width=200, record=True)
    con.print(text.render(rep))
    out = con.export_text()
    assert ("Attempt 0: the job's output could not be scanned: /h/u/77.out: FIFO, not read"
            in out)


# ----------------------------------------------------------------- the promise ---

INFO = GpuInfo(index=0, uuid="GPU-00000000-0000-0000-0000-0000000000a1", name="sim",
               memory_total_mib=40960, minor_number=0)


def _job(job_id: int, shards: int, uid: int = 1001) -> JobContext:
    return JobContext(
        job_id=job_id, uid=uid, user="alice", node="n1", gpus=(0,), shards=shards,
        gpu_count=0, stdout=None, stderr=None, restarts=0, admin_comment="", exit_code="",
        state="RUNNING",
    )


def _register(t: Tenancy, ctx: JobContext) -> None:
    t.add_job(0, ctx.uid, ctx.job_id)
    t.write_job_context(ctx.job_id, context_to_json(ctx))


def _snap(**states: str) -> dict[int, Any]:
    from slurm_colloc.slurm.squeue_json import ACTIVE_STATES

    return {int(k[1:]): SimpleNamespace(state=s, active=s in ACTIVE_STATES)
            for k, s in states.items()}


@pytest.fixture
def gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[CollocConfig, Tenancy, int]:
    """A 40 GiB simulated GPU under prolog.run: no metrics, no hard limit, no real daemon."""
    cfg = CollocConfig(mps_root=str(tmp_path / "mps"), metrics_dir=str(tmp_path / "metrics"),
                       evidence_dir=str(tmp_path / "ev"), gpu_hard_limit=False)
    monkeypatch.setattr(prolog, "node_gpu_map", lambda c: GpuMap.from_gpus([INFO]))
    monkeypatch.setattr(prolog, "node_protocol", lambda c: 2)
    monkeypatch.setattr(prolog, "start_metrics", lambda ctx, c: None)
    monkeypatch.setattr(prolog.pwd, "getpwuid", lambda uid: SimpleNamespace(pw_gid=uid))

    class Daemon:  # already running: nothing is started, the cap is accepted
        def running(self) -> bool:
            return True

        def cap_user(self, total: int) -> None:
            pass

    monkeypatch.setattr(prolog, "daemon_for", lambda *a, **k: Daemon())
    return cfg, Tenancy(Path(cfg.mps_root)), budget_of(cfg, INFO).shards_per_gpu


def test_an_over_promise_requeues_the_newcomer_without_holding_it(gpu) -> None:
    """The issue's case: recovered 3-shard jobs, then a rerun asking the whole GPU."""
    cfg, t, cap = gpu
    for j in (11, 12, 13, 14):
        _register(t, _job(j, 3))
    adapter = FakeSlurm()
    d = prolog.run(_job(20, cap), cfg, adapter, _snap(j11="RUNNING", j12="RUNNING",  # type: ignore[arg-type]
                   j13="RUNNING", j14="RUNNING", j20="CONFIGURING"), taken=None)
    assert d.mode == "refused" and adapter.calls == [("requeue", 20, False)]
    assert f"{12 + cap} shards promised" in d.detail and "11:3" in d.detail
    assert t.jobs_of(0, 1001) == [11, 12, 13, 14]  # not registered; the others untouched
    assert t.read_job_limits(20) is None  # nothing for the TaskProlog to export
    assert promise.refusals(t, 20) == 1


def test_a_fitting_newcomer_and_a_completing_neighbour_are_fine(gpu) -> None:
    cfg, t, cap = gpu
    _register(t, _job(11, 3))
    _register(t, _job(12, cap))  # over: its epilog has not released MPS yet
    adapter = FakeSlurm()
    d = prolog.run(_job(20, cap - 3), cfg, adapter,  # type: ignore[arg-type]
                   _snap(j11="RUNNING", j12="COMPLETING"), taken=None)
    assert d.mode == "shared" and adapter.calls == []
    assert 20 in t.jobs_of(0, 1001)


def test_a_neighbour_registered_after_the_snapshot_counts(gpu) -> None:
    cfg, t, cap = gpu
    _register(t, _job(11, cap))  # another prolog got the lock first: not in the snapshot
    adapter = FakeSlurm()
    d = prolog.run(_job(20, 1), cfg, adapter, _snap(), taken=0.0)  # type: ignore[arg-type]
    assert d.mode == "refused" and adapter.calls == [("requeue", 20, False)]


def test_refusals_are_bounded_then_the_job_runs_co_located(gpu) -> None:
    cfg, t, cap = gpu
    _register(t, _job(11, cap))
    snap = _snap(j11="RUNNING")
    for _ in range(promise.MAX_REFUSALS):
        assert prolog.run(_job(20, 2), cfg, FakeSlurm(), snap).mode == "refused"  # type: ignore[arg-type]
    adapter = FakeSlurm()
    d = prolog.run(_job(20, 2), cfg, adapter, snap)  # type: ignore[arg-type]
    assert d.mode == "shared" and adapter.calls == []
    assert f"already requeued {promise.MAX_REFUSALS} times: runs co-located" in d.detail
    assert 20 in t.jobs_of(0, 1001) and promise.refusals(t, 20) == 0


def test_a_failed_requeue_leaves_the_job_running_co_located(gpu) -> None:
    cfg, t, cap = gpu
    _register(t, _job(11, cap))
    adapter = FakeSlurm(fail=SlurmError("slurm_requeue error: Socket timed out"))
    d = prolog.run(_job(20, 2), cfg, adapter, _snap(j11="RUNNING"))  # type: ignore[arg-type]
    assert d.mode == "shared" and "requeue refused" in d.detail and "WARNING" in d.detail
    assert 20 in t.jobs_of(0, 1001)


def test_without_a_controller_snapshot_nothing_is_refused(gpu) -> None:
    cfg, t, cap = gpu
    _register(t, _job(11, cap))
    adapter = FakeSlurm()
    assert prolog.run(_job(20, 2), cfg, adapter, None).mode == "shared"  # type: ignore[arg-type]
    assert adapter.calls == []


def test_a_registered_job_without_context_counts_by_its_limits(tmp_path: Path) -> None:
    t = Tenancy(tmp_path / "mps")
    t.add_job(0, 1001, 11)
    t.write_job_env(11, {"COLLOC_LIMIT_MIB": str(5 * 1024)}, 1001, 1001)
    assert promise.job_shards(t, 11, 1024) == 5
    assert promise.job_shards(t, 12, 1024) == 0


# ---------------------------------------------------------------- pipe directories ---


def test_a_job_without_marker_still_takes_its_gpus_empty_pipe_dir(tmp_path: Path,
                                                                     monkeypatch) -> None:
    """MPS was withdrawn from the job (its marker removed) after its pipe directory was
    made: its epilog found no GPU and left the directory until another job came by."""
    cfg = CollocConfig(mps_root=str(tmp_path / "mps"), metrics_dir=str(tmp_path / "m"))
    t = Tenancy(Path(cfg.mps_root))
    with t.locked(0):
        pipe, _ = t.prepare_user_dirs(0, 1001)
    t.write_job_context(30, context_to_json(_job(30, 2)))

    class Stopped:
        def identity(self) -> None:
            return None

    monkeypatch.setattr(epilog, "daemon_for", lambda *a, **k: Stopped())
    r = epilog.release_first(30, cfg)
    assert not os.path.lexists(pipe), r.errors
    q = t.quarantine_dir
    assert not q.is_dir() or os.listdir(q) == []


def test_an_entry_quarantined_during_a_purge_is_not_left_behind(tmp_path: Path,
                                                                 monkeypatch) -> None:
    """Another epilog renames its pipe dir in after the purger's last look; its own
    purge found the lock held and went away. The purger looks again after unlocking."""
    from slurm_colloc import safe_tree

    q = safe_tree.private_dir(tmp_path / "quarantine")
    (q / "pipe-gpu0-uid1.1.a").mkdir()
    run = safe_tree._Walk.run
    arrived: list[str] = []

    def run_then_arrive(self: Any) -> None:
        run(self)
        if not arrived:  # after this pass's last look, before its lock is gone
            arrived.append("pipe-gpu0-uid2.2.b")
            (q / arrived[0]).mkdir()
            assert safe_tree.purge(q).busy  # the latecomer's own purge: lock held

    monkeypatch.setattr(safe_tree._Walk, "run", run_then_arrive)
    done = safe_tree.purge(q)
    assert os.listdir(q) == [] and not done.left and done.removed == 2
