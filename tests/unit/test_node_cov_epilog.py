"""The epilog library (slurm_colloc.node.epilog) with a fake Slurm adapter and a faked
log scan: the release of MPS state, the fallbacks that must never cancel a requeue,
the order of Slurm calls in a requeue, the spooled record, and each error path ending
up in ``EpilogResult.errors`` instead of an exception."""

from __future__ import annotations

import logging
import os
import stat
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest

from slurm_colloc.config import CollocConfig
from slurm_colloc.mps.tenancy import Tenancy
from slurm_colloc.node import epilog, evidence, requeue_policy
from slurm_colloc.node.job import JobContext
from slurm_colloc.oom import detector
from slurm_colloc.oom.detector import Evidence, ScanResult, ScanSummary
from slurm_colloc.slurm.adapter import SlurmError

SHARD_REC = "colloc1:mode=estimate,need_mib=8000,est_mib=7000,shards=8,shard_mib=1024,alloc_mib=8192"
WHOLE_REC = "colloc1:mode=whole,need_mib=40960,shards=40,shard_mib=1024,alloc_mib=40960"
LOG = logging.LoggerAdapter(logging.getLogger("test-node-cov-epilog"), {})


class FakeSlurm:
    """Duck-typed SlurmAdapter recording the epilog's calls; each can be made to fail."""

    def __init__(self, *, fail: dict[str, Exception] | None = None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail = fail or {}

    def _maybe(self, what: str) -> None:
        if what in self.fail:
            raise self.fail[what]

    def jobs_among(self, job_ids: Any) -> dict[int, Any]:
        """The prolog's query (issue 28); the epilog asks nothing of it."""
        return {}

    def requeue(self, job_id: int, *, hold: bool = False) -> None:
        self.calls.append(("requeue", job_id, hold))
        self._maybe("requeue")

    def update_job(self, job_id: int, **settings: str) -> None:
        key = next(iter(settings))
        self.calls.append(("update", job_id, key, settings[key]))
        self._maybe(key)

    def release(self, job_id: int) -> None:
        self.calls.append(("release", job_id))

    def kinds(self) -> list[str]:
        return [c[0] if c[0] != "update" else f"update:{c[2]}" for c in self.calls]


def cfg_of(tmp: Path, **kw: Any) -> CollocConfig:
    base: dict[str, Any] = dict(
        gpu_backend="sim", sim_state_dir=str(tmp / "sim"), mps_root=str(tmp / "mps"),
        evidence_dir=str(tmp / "var" / "evidence"), metrics_dir=str(tmp / "var" / "metrics"),
        history_db=str(tmp / "var" / "history.sqlite"), log_file=str(tmp / "colloc.log"),
        log_scan_tail_mib=1,
    )
    base.update(kw)
    return CollocConfig(**base)


def ctx_of(**kw: Any) -> JobContext:
    base: dict[str, Any] = dict(
        job_id=77, uid=os.getuid(), user="u", node="n1", gpus=(0,), shards=8, gpu_count=0,
        stdout="/logs/77.out", stderr="/logs/77.err", restarts=0, admin_comment=SHARD_REC,
        exit_code="1:0", state="FAILED",
    )
    base.update(kw)
    return JobContext(**base)


def ev(cause: str = "gpu-oom") -> Evidence:
    return Evidence(pattern_id="torch-oom", cause=cause, framework="torch",  # type: ignore[arg-type]
                    confidence="high", offset=0, line="CUDA out of memory")


@pytest.fixture
def scan(monkeypatch):
    """scan_files replaced: the cause and which logs were readable are the test's."""
    state: dict[str, Any] = {"cause": "gpu-oom", "ok": ["/logs/77.out", "/logs/77.err"],
                             "calls": []}

    def fake_scan(paths, *, tail_bytes, uid, gid):  # type: ignore[no-untyped-def]
        paths = list(paths)
        state["calls"].append((paths, tail_bytes, uid, gid))
        cause = state["cause"]
        results = tuple(ScanResult(p, cause if p in state["ok"] else "none",
                                   "ok" if p in state["ok"] else "refused") for p in paths)
        e = ev(cause) if cause != "none" else None
        return ScanSummary(cause, e, state["ok"][0] if e and state["ok"] else None, results)

    monkeypatch.setattr(detector, "scan_files", fake_scan)
    return state


@pytest.fixture
def quiet(monkeypatch):
    """No metrics, no history, no spawned writer, 40 shards per GPU; records kept."""
    seen: dict[str, Any] = {"spooled": [], "history": [], "kept": []}
    monkeypatch.setattr(epilog, "_metrics", lambda ctx, cfg: (None, ()))
    monkeypatch.setattr(epilog, "_record_history",
                        lambda ctx, cfg, m, r: seen["history"].append(r.cause))
    monkeypatch.setattr(epilog, "_spool_record",
                        lambda ctx, cfg, text, r: seen["spooled"].append(text))
    monkeypatch.setattr(epilog, "shards_per_gpu", lambda cfg, gpu: 40)
    monkeypatch.setattr(epilog, "_culprit", lambda ctx, cfg, r: None)

    def keep(evidence_dir, job_id, attempt, uid, gid, sources, max_bytes, *, errors):  # type: ignore[no-untyped-def]
        seen["kept"].append(list(sources))
        return [f"{evidence_dir}/{job_id}/attempt{attempt}/{i}-x" for i in range(len(sources))]

    monkeypatch.setattr(evidence, "keep", keep)
    return seen


# ------------------------------------------------------------- summary ---


def test_summary_lists_what_happened() -> None:
    r = epilog.EpilogResult(5)
    assert r.summary() == "cause=none"
    r.cause, r.pattern, r.culprit = "gpu-oom", "torch-oom", "12"
    r.decision = requeue_policy.RequeueDecision(True, 40, "whole GPU")
    r.requeued = True
    r.evidence_files = ["/a", "/b"]
    r.stopped_daemons = [(0, 1001)]
    r.errors = ["e1", "e2"]
    assert r.summary() == ("cause=gpu-oom pattern=torch-oom culprit=job 12 requeue=yes "
                           "(whole GPU) evidence=/a,/b stopped MPS daemons [(0, 1001)] "
                           "errors: e1; e2")
    r.requeued = False
    assert "requeue=no (whole GPU)" in r.summary()


# ------------------------------------------------------------- release ---


class FakeDaemon:
    stopped: ClassVar[list[tuple[int, int]]] = []

    def __init__(self, gpu: int, uid: int, running: bool) -> None:
        self.gpu, self.uid, self.running = gpu, uid, running

    def identity(self) -> object | None:
        return object() if self.running else None

    def stop(self) -> None:
        FakeDaemon.stopped.append((self.gpu, self.uid))


def test_release_stops_only_daemons_left_without_jobs(tmp_path, monkeypatch) -> None:
    cfg = cfg_of(tmp_path)
    t = Tenancy(Path(cfg.mps_root))
    t.add_job(0, 1001, 77)
    t.add_job(0, 1001, 78)  # same user, same GPU: the daemon stays for it
    t.add_job(1, 1002, 77)
    t.add_job(1, 1003, 79)
    t.write_job_env(77, {"COLLOC_GPU": "0"})
    FakeDaemon.stopped = []
    running = {(1, 1002): True, (1, 1003): True, (0, 1001): True}
    monkeypatch.setattr(epilog, "daemon_for",
                        lambda cfg, ten, gpu, uid: FakeDaemon(gpu, uid, running[(gpu, uid)]))
    r = epilog.release_first(77, cfg)
    assert sorted(r.released) == [(0, 1001), (1, 1002)]
    assert r.stopped_daemons == [(1, 1002)] and FakeDaemon.stopped == [(1, 1002)]
    assert r.errors == []
    assert t.jobs_of(0, 1001) == [78] and t.jobs_of(1, 1003) == [79]
    assert not t.job_env_file(77).exists()
    # a daemon already gone is not stopped again
    running[(0, 1001)] = False
    r2 = epilog.release_first(78, cfg)
    assert r2.released == [(0, 1001)] and r2.stopped_daemons == []


def test_release_failure_is_recorded_not_raised(tmp_path, monkeypatch) -> None:
    def broken(job_id: int, cfg: CollocConfig, result: epilog.EpilogResult) -> None:
        raise PermissionError("mps_root is not root's")

    monkeypatch.setattr(epilog, "release_mps", broken)
    r = epilog.release_first(3, cfg_of(tmp_path))
    assert r.errors == ["MPS release failed: mps_root is not root's"]


class FakeV3:
    def __init__(self, known: bool, outcome: str | Exception) -> None:
        self.known, self.outcome = known, outcome
        self.removed: list[int] = []

    def job(self, job_id: int) -> object | None:
        return object() if self.known else None

    def remove_job(self, job_id: int) -> str:
        self.removed.append(job_id)
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


@pytest.mark.parametrize(
    ("known", "outcome", "errors"),
    [(False, "deleted", []), (True, "deleted", []), (True, "absent", []),
     (True, "forced", ["MPS v3 namespace of job 77 still had clients: deleted with --force"]),
     (True, OSError("EIO"), ["MPS v3 namespace of job 77 not deleted: EIO"])],
    ids=["not-v3", "deleted", "absent", "forced", "error"],
)
def test_release_v3(tmp_path, monkeypatch, known, outcome, errors) -> None:
    from slurm_colloc.node import mps_protocol

    cfg = cfg_of(tmp_path)
    t = Tenancy(Path(cfg.mps_root))
    node = FakeV3(known, outcome)
    monkeypatch.setattr(mps_protocol, "v3_node", lambda cfg: node)
    r = epilog.EpilogResult(77)
    epilog.release_v3(77, cfg, t, r)  # no v3 directory: nothing asked
    assert node.removed == [] and r.errors == []
    (Path(cfg.mps_root) / mps_protocol.V3_DIR).mkdir(parents=True)
    epilog.release_v3(77, cfg, t, r)
    assert node.removed == ([77] if known else [])
    assert r.errors == errors


# ------------------------------------------------------------ helpers ---


def test_estimate_of_prefers_the_estimate() -> None:
    assert epilog.estimate_of(ctx_of()) == 7000
    assert epilog.estimate_of(ctx_of(admin_comment=WHOLE_REC)) == 40960
    assert epilog.estimate_of(ctx_of(admin_comment="")) is None


def test_user_gid() -> None:
    assert epilog._user_gid(0) == 0
    assert epilog._user_gid(54321) is None  # no passwd entry


def test_shards_per_gpu_from_the_node_map(tmp_path, monkeypatch) -> None:
    from slurm_colloc.gpu.backend import GpuInfo
    from slurm_colloc.node import gpus

    seen: list[int] = []

    class Map:
        def by_slurm_index(self, i: int) -> GpuInfo:
            seen.append(i)
            return GpuInfo(index=i, uuid=f"GPU-{i}", name="A100", memory_total_mib=40960)

    monkeypatch.setattr(gpus, "node_gpu_map", lambda cfg: Map())
    cfg = cfg_of(tmp_path, shard_mib=1024)
    n = epilog.shards_per_gpu(cfg, None)
    assert seen == [0] and 30 <= n < 40  # 40 GiB less what MPS servers need


@pytest.mark.parametrize(
    ("rec", "kw", "want", "error"),
    [(WHOLE_REC, {}, 40, None),
     ("colloc1:mode=whole,need_mib=1,shards=12,shard_mib=0,alloc_mib=0", {}, 12, None),
     (SHARD_REC, {"gpu_memory_mib": 40960}, 39, None),
     (SHARD_REC, {}, None, "shards per GPU unknown"),
     ("", {}, None, "shards per GPU unknown")],
    ids=["whole-record", "whole-shards-only", "site-config", "nothing", "no-record"],
)
def test_shards_per_gpu_fallbacks(tmp_path, monkeypatch, rec, kw, want, error) -> None:
    def lost(cfg: CollocConfig, gpu: int | None) -> int:
        raise RuntimeError("NVML_ERROR_GPU_IS_LOST")

    monkeypatch.setattr(epilog, "shards_per_gpu", lost)
    r = epilog.EpilogResult(77)
    assert epilog._shards_per_gpu_or_fallback(ctx_of(admin_comment=rec), cfg_of(tmp_path, **kw),
                                              r) == want
    assert r.errors[0] == "shards per GPU from the sim backend failed: NVML_ERROR_GPU_IS_LOST"
    assert (error is None) == (len(r.errors) == 1)
    if error:
        assert error in r.errors[1]


def test_metrics_without_the_metrics_package(monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "slurm_colloc.metrics.summary", None)
    assert epilog._metrics(ctx_of(), cfg_of(tmp_path)) == (None, ())


def test_metrics_returns_summary_and_tenants(monkeypatch, tmp_path) -> None:
    from slurm_colloc.metrics import summary

    monkeypatch.setattr(summary, "job_summary", lambda cfg, j, a: ("S", ["80", "81"]))
    assert epilog._metrics(ctx_of(), cfg_of(tmp_path)) == ("S", ("80", "81"))


@pytest.mark.parametrize(
    ("exit_code", "cause", "outcome", "succeeded", "errors"),
    [("0:0", "none", "recorded", True, []),
     ("1:0", "none", "recorded", False, []),
     ("0:0", "gpu-oom", "recorded", False, []),
     ("0:0", "none", "not recorded: unsafe history db", True,
      ["history not recorded: unsafe history db"]),
     ("0:0", "none", "skipped: fingerprint differs", True,
      ["history skipped: fingerprint differs"]),
     ("0:0", "none", RuntimeError("locked"), True, ["history not recorded: locked"])],
)
def test_record_history(monkeypatch, tmp_path, exit_code, cause, outcome, succeeded,
                        errors) -> None:
    from slurm_colloc.metrics import summary

    got: list[dict[str, Any]] = []

    def record(cfg, job_id, attempt, metrics, *, succeeded, uid):  # type: ignore[no-untyped-def]
        got.append({"succeeded": succeeded, "uid": uid, "attempt": attempt})
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(summary, "record_history", record)
    r = epilog.EpilogResult(77, cause=cause)
    epilog._record_history(ctx_of(exit_code=exit_code, restarts=2, uid=1001), cfg_of(tmp_path),
                           None, r)
    assert got == [{"succeeded": succeeded, "uid": 1001, "attempt": 2}]
    assert r.errors == errors


# ------------------------------------------------------------ requeue ---


def test_requeue_holds_updates_then_releases() -> None:
    s = FakeSlurm()
    assert epilog.requeue(ctx_of(), s, 40, admin_comment="cl1:rec") == []
    assert s.kinds() == ["requeue", "update:TresPerNode", "update:AdminComment", "release"]
    assert s.calls[0] == ("requeue", 77, True)
    assert s.calls[1][3] == "gres/shard:40"


def test_requeue_same_request_of_a_shared_job_updates_nothing() -> None:
    s = FakeSlurm()
    epilog.requeue(ctx_of(), s, 8)
    assert s.kinds() == ["requeue", "release"]


def test_requeue_whole_gpu_job_resets_its_request() -> None:
    """A mode=whole job is not 'shared': its request is written even when unchanged."""
    s = FakeSlurm()
    epilog.requeue(ctx_of(admin_comment=WHOLE_REC, shards=40), s, 40)
    assert s.kinds() == ["requeue", "update:TresPerNode", "release"]


def test_requeue_refused_admin_comment_is_returned_not_raised() -> None:
    s = FakeSlurm(fail={"AdminComment": SlurmError("Job has already finished")})
    msg = epilog.requeue(ctx_of(), s, 40, admin_comment="cl1:rec")
    assert msg == ["AdminComment not updated after the requeue: Job has already finished"]
    assert s.kinds()[-1] == "release"


def test_requeue_boosts_the_recovery_after_resizing_it() -> None:
    """issue 25 item 4: the requeued job goes back with Nice=-N (root only), after the
    shard update that is the requeue itself, and before the release lets it run."""
    s = FakeSlurm()
    assert epilog.requeue(ctx_of(), s, 40, admin_comment="cl1:rec", nice=10000) == []
    assert s.kinds() == ["requeue", "update:TresPerNode", "update:Nice", "update:AdminComment",
                         "release"]
    assert s.calls[2][3] == "-10000"


def test_requeue_without_a_boost_leaves_the_priority_alone() -> None:
    s = FakeSlurm()
    epilog.requeue(ctx_of(), s, 40, nice=0)
    assert "update:Nice" not in s.kinds()


def test_a_refused_boost_keeps_the_requeue_and_says_so() -> None:
    s = FakeSlurm(fail={"Nice": SlurmError("Access/permission denied")})
    msg = epilog.requeue(ctx_of(), s, 40, admin_comment="cl1:rec", nice=500)
    assert msg == ["recovery priority not raised after the requeue: Access/permission denied"]
    assert s.kinds() == ["requeue", "update:TresPerNode", "update:Nice", "update:AdminComment",
                         "release"]


def test_requeue_failed_update_still_releases() -> None:
    """The job is held: whatever fails after the hold, it must be released again."""
    s = FakeSlurm(fail={"TresPerNode": SlurmError("Invalid generic resource")})
    with pytest.raises(SlurmError, match="Invalid generic resource"):
        epilog.requeue(ctx_of(), s, 40)
    assert s.kinds() == ["requeue", "update:TresPerNode", "release"]


@pytest.mark.parametrize(
    ("over", "shards", "match"),
    [({"gpu_count": 1}, 40, "not placed by colloc"), ({"foreign_shards": 4}, 40, "not placed"),
     ({"shards": 0}, 40, "not placed"), ({}, 0, "refusing a request of 0 shards"),
     ({}, -3, "refusing a request of -3 shards")],
)
def test_requeue_refusals_ask_slurm_nothing(over, shards, match) -> None:
    s = FakeSlurm()
    with pytest.raises(ValueError, match=match):
        epilog.requeue(ctx_of(**over), s, shards)
    assert s.calls == []


# ---------------------------------------------------------------- run ---


def test_run_without_gpu_only_releases(tmp_path, scan, quiet) -> None:
    r = epilog.run(ctx_of(gpus=()), cfg_of(tmp_path), FakeSlurm(), LOG)
    assert scan["calls"] == [] and quiet["history"] == [] and quiet["spooled"] == []
    assert r.cause == "none" and r.errors == []


def test_run_successful_job_is_not_scanned_but_recorded(tmp_path, scan, quiet) -> None:
    s = FakeSlurm()
    r = epilog.run(ctx_of(exit_code="0:0"), cfg_of(tmp_path), s, LOG)
    assert scan["calls"] == [] and s.calls == []
    assert quiet["history"] == ["none"] and len(quiet["spooled"]) == 1
    assert r.record_spooled is None  # the fake spool records the text only


def test_run_no_logs_known(tmp_path, scan, quiet) -> None:
    epilog.run(ctx_of(stdout=None, stderr=""), cfg_of(tmp_path), FakeSlurm(), LOG)
    assert scan["calls"] == []


def test_run_gpu_oom_requeues_with_evidence(tmp_path, scan, quiet) -> None:
    s = FakeSlurm()
    cfg = cfg_of(tmp_path, evidence_user_copy=False)
    r = epilog.run(ctx_of(uid=0), cfg, s, LOG)
    paths, tail, uid, gid = scan["calls"][0]
    # stderr first (on a tie the scanner's first file wins; frameworks print errors there)
    assert paths == ["/logs/77.err", "/logs/77.out"] and tail == 1 << 20 and (uid, gid) == (0, 0)
    assert r.cause == "gpu-oom" and r.pattern == "torch-oom"
    assert r.evidence_line == "CUDA out of memory"
    assert sorted(quiet["kept"][0]) == ["/logs/77.err", "/logs/77.out"]
    assert r.decision is not None and r.decision.requeue and r.requeued
    assert s.kinds() == ["requeue", "update:TresPerNode", "update:Nice", "update:AdminComment",
                         "release"]
    assert ("update", 77, "Nice", f"-{cfg.recovery_nice}") in s.calls  # the default boost
    assert quiet["spooled"] == []  # the record went with the requeue
    assert r.shards_per_gpu == 40


def test_run_keeps_only_logs_the_scan_could_read(tmp_path, scan, quiet) -> None:
    scan["ok"] = ["/logs/77.err"]
    epilog.run(ctx_of(uid=0), cfg_of(tmp_path, evidence_user_copy=False), FakeSlurm(), LOG)
    assert quiet["kept"] == [["/logs/77.err"]]


def test_run_user_unknown_to_the_node_keeps_no_evidence(tmp_path, scan, quiet) -> None:
    r = epilog.run(ctx_of(uid=54321), cfg_of(tmp_path), FakeSlurm(), LOG)
    assert scan["calls"][0][3] is None  # no gid: the scan gets none
    assert quiet["kept"] == [] and r.evidence_files == []
    assert r.requeued  # the requeue does not depend on evidence


def test_run_evidence_failure_does_not_cancel_the_requeue(tmp_path, scan, quiet,
                                                          monkeypatch) -> None:
    def broken(*a: Any, **k: Any) -> list[str]:
        raise FileExistsError("attempt0 already exists")

    monkeypatch.setattr(evidence, "keep", broken)
    r = epilog.run(ctx_of(uid=0), cfg_of(tmp_path), FakeSlurm(), LOG)
    assert r.requeued and "evidence not kept: attempt0 already exists" in r.errors


def test_run_no_oom_in_the_logs(tmp_path, scan, quiet) -> None:
    scan["cause"] = "none"
    s = FakeSlurm()
    r = epilog.run(ctx_of(uid=0), cfg_of(tmp_path), s, LOG)
    assert r.decision is None and not r.requeued and s.calls == []
    assert quiet["kept"] == [] and len(quiet["spooled"]) == 1


def test_run_users_own_gpu_job_is_never_requeued(tmp_path, scan, quiet, monkeypatch) -> None:
    monkeypatch.setattr(epilog, "shards_per_gpu",
                        lambda cfg, gpu: pytest.fail("not needed for a job colloc did not place"))
    s = FakeSlurm()
    r = epilog.run(ctx_of(uid=0, shards=0, gpu_count=1, admin_comment=""),
                   cfg_of(tmp_path, evidence_user_copy=False), s, LOG)
    assert r.cause == "gpu-oom" and r.decision is not None and not r.decision.requeue
    assert r.shards_per_gpu is None and s.calls == []
    assert len(quiet["spooled"]) == 1  # the attempt is still recorded


def test_run_user_copy_goes_first(tmp_path, scan, quiet, monkeypatch) -> None:
    got: dict[str, Any] = {}

    def user_copy(log, job_id, attempt, uid, gid, **kw):  # type: ignore[no-untyped-def]
        got.update(log=log, kw=kw)
        return "/logs/colloc-evidence-77-0.txt"

    monkeypatch.setattr(evidence, "keep_user_copy", user_copy)
    r = epilog.run(ctx_of(uid=0), cfg_of(tmp_path), FakeSlurm(), LOG)
    assert got["log"] == "/logs/77.out" and got["kw"]["cause"] == "gpu-oom"
    assert r.evidence_files[0] == "/logs/colloc-evidence-77-0.txt"
    assert len(r.evidence_files) == 3


def test_run_user_copy_next_to_stderr_when_stdout_unreadable(tmp_path, scan, quiet,
                                                             monkeypatch) -> None:
    scan["ok"] = ["/logs/77.err"]
    logs: list[str] = []
    monkeypatch.setattr(evidence, "keep_user_copy",
                        lambda log, *a, **k: logs.append(log) or None)
    r = epilog.run(ctx_of(uid=0), cfg_of(tmp_path), FakeSlurm(), LOG)
    assert logs == ["/logs/77.err"] and len(r.evidence_files) == 1


def test_run_long_user_copy_path_is_not_the_records_evidence(tmp_path, scan, quiet,
                                                             monkeypatch) -> None:
    long = "/" + "d" * evidence.USER_COPY_MAX_PATH + "/c.txt"
    monkeypatch.setattr(evidence, "keep_user_copy", lambda *a, **k: long)
    r = epilog.run(ctx_of(uid=0), cfg_of(tmp_path), FakeSlurm(), LOG)
    assert r.evidence_files[-1] == long and r.evidence_files[0] != long


def test_keep_user_copy_needs_a_log_the_scan_read(monkeypatch) -> None:
    monkeypatch.setattr(evidence, "keep_user_copy", lambda *a, **k: pytest.fail("no log"))
    r = epilog.EpilogResult(77)
    epilog._keep_user_copy(ctx_of(), r, ["/elsewhere.log"], 0)
    assert r.evidence_files == []


def test_run_scan_failure_is_recorded(tmp_path, quiet, monkeypatch) -> None:
    def broken(*a: Any, **k: Any) -> ScanSummary:
        raise RuntimeError("scan blew up")

    monkeypatch.setattr(detector, "scan_files", broken)
    r = epilog.run(ctx_of(uid=0), cfg_of(tmp_path), FakeSlurm(), LOG)
    assert r.errors == ["log scan or requeue decision failed: scan blew up"]
    assert not r.requeued and len(quiet["spooled"]) == 1


def test_run_metrics_failure_is_recorded(tmp_path, scan, quiet, monkeypatch) -> None:
    monkeypatch.setattr(epilog, "_metrics",
                        lambda ctx, cfg: (_ for _ in ()).throw(ValueError("bad series")))
    r = epilog.run(ctx_of(uid=0), cfg_of(tmp_path, evidence_user_copy=False), FakeSlurm(), LOG)
    assert "metrics summary failed: bad series" in r.errors and r.requeued


def test_run_record_failure_never_cancels_the_requeue(tmp_path, scan, quiet,
                                                      monkeypatch) -> None:
    monkeypatch.setattr(epilog, "_record_text",
                        lambda *a: (_ for _ in ()).throw(ValueError("record too large")))
    s = FakeSlurm()
    r = epilog.run(ctx_of(uid=0), cfg_of(tmp_path, evidence_user_copy=False), s, LOG)
    assert r.requeued and "accounting record not built: record too large" in r.errors
    assert "update:AdminComment" not in s.kinds()
    assert quiet["spooled"] == []


def test_run_requeue_failure_spools_the_record(tmp_path, scan, quiet) -> None:
    s = FakeSlurm(fail={"requeue": SlurmError("Job is no longer pending execution")})
    r = epilog.run(ctx_of(uid=0), cfg_of(tmp_path, evidence_user_copy=False), s, LOG)
    assert not r.requeued
    assert r.errors == ["requeue failed: Job is no longer pending execution"]
    assert len(quiet["spooled"]) == 1  # the record still reaches the accounting


def test_run_comment_refused_after_requeue(tmp_path, scan, quiet) -> None:
    s = FakeSlurm(fail={"AdminComment": SlurmError("denied")})
    r = epilog.run(ctx_of(uid=0), cfg_of(tmp_path, evidence_user_copy=False), s, LOG)
    assert r.requeued and r.errors == ["AdminComment not updated after the requeue: denied"]


def test_run_non_colloc_job_has_no_record(tmp_path, scan, quiet) -> None:
    scan["cause"] = "none"
    r = epilog.run(ctx_of(uid=0, admin_comment="", shards=0, gpu_count=1),
                   cfg_of(tmp_path), FakeSlurm(), LOG)
    assert r.cause == "none" and quiet["spooled"] == []


def test_run_without_result_releases_itself(tmp_path, scan, quiet, monkeypatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(epilog, "release_mps", lambda job_id, cfg, r: calls.append(job_id))
    epilog.run(ctx_of(gpus=()), cfg_of(tmp_path), FakeSlurm(), LOG)
    assert calls == [77]
    epilog.run(ctx_of(gpus=()), cfg_of(tmp_path), FakeSlurm(), LOG, epilog.EpilogResult(77))
    assert calls == [77]  # a result from release_first: not released twice


# ------------------------------------------------------------ culprit ---


def test_culprit_found_changes_the_decision(tmp_path, scan, quiet, monkeypatch) -> None:
    from slurm_colloc.metrics import enforce, summary

    monkeypatch.undo()  # the real _culprit, but keep the scan fake
    monkeypatch.setattr(detector, "scan_files", lambda *a, **k: ScanSummary(
        "gpu-oom", ev(), "/logs/77.out", (ScanResult("/logs/77.out", "gpu-oom"),)))
    monkeypatch.setattr(epilog, "_metrics", lambda ctx, cfg: (None, ()))
    monkeypatch.setattr(epilog, "_record_history", lambda *a: None)
    monkeypatch.setattr(epilog, "_spool_record", lambda *a: None)
    monkeypatch.setattr(epilog, "shards_per_gpu", lambda cfg, gpu: 40)
    monkeypatch.setattr(evidence, "keep", lambda *a, **k: [])
    monkeypatch.setattr(summary, "job_summary", lambda cfg, j, a: (None, ["80"]))
    waits: list[float] = []

    def culprits(cfg, gpu, since, exclude_job=None, *, wait_s=0.0):  # type: ignore[no-untyped-def]
        waits.append(wait_s)
        assert exclude_job == 77 and gpu == 0
        return [enforce.Verdict(job_id="80", attempt=0, uid=1002, gpu=0, kind="over_limit",
                                peak_mib=9000, limit_mib=4096, first_seen=1.0, last_seen=2.0,
                                action="killed")]

    monkeypatch.setattr(enforce, "culprits_on_gpu", culprits)
    s = FakeSlurm()
    r = epilog.run(ctx_of(uid=0), cfg_of(tmp_path), s, LOG)
    assert r.culprit == "80" and waits == [enforce.detection_window_s(cfg_of(tmp_path))]
    assert r.decision is not None and r.decision.new_shards == 8  # same request, not whole
    assert "job 80" in r.decision.reason and "culprit=job 80" in r.summary()
    assert [k for k in s.kinds() if k.startswith("update:Tres")] == []


def test_culprit_none_and_errors(tmp_path, monkeypatch) -> None:
    from slurm_colloc.metrics import enforce, summary

    monkeypatch.setattr(summary, "job_summary", lambda cfg, j, a: (None, []))
    waits: list[float] = []
    monkeypatch.setattr(enforce, "culprits_on_gpu",
                        lambda cfg, gpu, since, exclude_job=None, wait_s=0.0:
                        waits.append(wait_s) or [])
    r = epilog.EpilogResult(77)
    assert epilog._culprit(ctx_of(), cfg_of(tmp_path), r) is None
    assert waits == [0.0]  # ran alone: nobody to wait for
    monkeypatch.setattr(enforce, "culprits_on_gpu",
                        lambda *a, **k: (_ for _ in ()).throw(OSError("verdicts unreadable")))
    assert epilog._culprit(ctx_of(), cfg_of(tmp_path), r) is None
    assert r.errors == ["co-tenant verdicts unreadable: verdicts unreadable"]


# --------------------------------------------------------- the spool ---


def test_spool_record_writes_root_only_and_spawns(tmp_path, monkeypatch) -> None:
    from slurm_colloc.node import record_writer

    spawned: list[tuple[Any, ...]] = []
    monkeypatch.setattr(record_writer, "spawn", lambda *a: spawned.append(a))
    monkeypatch.setenv("SLURM_CONF", "/etc/slurm/slurm.conf")
    monkeypatch.setenv("PYTHONPATH", "/home/u")
    cfg = cfg_of(tmp_path)
    r = epilog.EpilogResult(77)
    epilog._spool_record(ctx_of(), cfg, "cl1:rec", r)
    spool = Path(cfg.evidence_dir).parent / "spool"
    assert stat.S_IMODE(spool.stat().st_mode) == 0o700
    # issue 28: one entry per (job, attempt)
    assert r.record_spooled == str(spool / "77.0.adminc")
    assert (spool / "77.0.adminc").read_text() == "cl1:rec"
    (job, path, env), = spawned
    assert job == 77 and path == spool / "77.0.adminc"
    assert env["SLURM_CONF"] == "/etc/slurm/slurm.conf" and "PYTHONPATH" not in env


def test_spool_record_failure_is_an_error_line(tmp_path, monkeypatch) -> None:
    """Issue 28: a record the spool cannot take goes to an in-memory writer, loudly."""
    from slurm_colloc.node import record_writer

    direct: list[tuple[Any, ...]] = []
    monkeypatch.setattr(record_writer, "spawn_direct", lambda *a: direct.append(a))
    cfg = cfg_of(tmp_path)
    parent = Path(cfg.evidence_dir).parent
    parent.mkdir(parents=True)
    (parent / "spool").symlink_to(tmp_path)  # never write through a link
    r = epilog.EpilogResult(77)
    epilog._spool_record(ctx_of(), cfg, "cl1:rec", r)
    assert r.record_spooled is None
    assert r.errors and r.errors[0].startswith("RECORD NOT SPOOLED (")
    assert "in-memory writer" in r.errors[0]
    assert not list(tmp_path.glob("77*.adminc"))
    assert [(a[0], a[1]) for a in direct] == [(77, "cl1:rec")]
