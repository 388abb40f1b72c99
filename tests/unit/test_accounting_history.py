"""Issue 13: the estimator's history from Slurm's accounting (AdminComment via sacct)."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from slurm_colloc.accounting import (
    Attempt,
    Estimate,
    MetricsSummary,
    OomInfo,
    Requeue,
    append_attempt,
    decode,
)
from slurm_colloc.accounting.history import AccountingHistory, user_records
from slurm_colloc.config import CollocConfig
from slurm_colloc.estimators import estimate, parse_summary
from slurm_colloc.metrics import store
from slurm_colloc.node.attempt_record import build_attempt
from slurm_colloc.node.job import context_from_record
from slurm_colloc.node.metrics_launch import SPANK, meta_for
from slurm_colloc.slurm import adapter as ad
from slurm_colloc.slurm import sacct_json

DATA = Path(__file__).parent / "data" / "summaries"
SUMMARY = DATA / "resnet50_torchinfo.txt"
ME = pwd.getpwuid(os.getuid()).pw_name
OTHER = ME + "x"  # another user (any other name)
FP = "ab" * 16


def _attempt(n: int = 0, peak: int = 9000, *, fp: str = FP, batch: int = 32,
             samples: int = 100, oom: bool = False, requeued: bool = False,
             seq_len: int | None = None, optimizer: str | None = None) -> Attempt:
    return Attempt(
        attempt=n,
        estimate=Estimate(12000, "layer-aware", 2000, fp, batch_size=batch, seq_len=seq_len,
                          optimizer=optimizer, precision=None),
        oom=OomInfo("gpu-oom", "torch-cuda-oom") if oom else None,
        requeue=Requeue(True, "gpu-oom", "gres:shard:24", 24576) if requeued else None,
        metrics=MetricsSummary(peak_mib=peak, samples=samples, series=((0, peak, 50),)),
    )


def _comment(*attempts: Attempt) -> str:
    s: str | None = "colloc1:mode=estimate,need_mib=12000,shards=12"  # job_submit's text
    for a in attempts:
        s = append_attempt(s, a)
    assert s is not None
    return s.lower()  # sacctmgr lowercases it


def _job(job_id: int, user: str, comment: str | None, state: str = "COMPLETED") -> dict[str, Any]:
    current = ["PENDING", "REQUEUED"] if state == "REQUEUED" else [state]  # data_parser v0.0.42
    return {"job_id": job_id, "name": "train", "user": user, "state": {"current": current},
            "comment": {"administrator": comment}, "time": {"start": 1795000000 + job_id}}


def _sacct(*jobs: dict[str, Any]) -> str:
    return json.dumps({"meta": {}, "errors": [], "jobs": list(jobs)})


class FakeRun:
    """subprocess.run for SlurmCli: a canned sacct answer, or an exception."""

    def __init__(self, out: str = "", rc: int = 0, exc: BaseException | None = None) -> None:
        self.out, self.rc, self.exc = out, rc, exc
        self.calls: list[list[str]] = []
        self.timeouts: list[float | None] = []

    def __call__(self, argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append(argv)
        self.timeouts.append(kw.get("timeout"))
        if self.exc is not None:
            raise self.exc
        return subprocess.CompletedProcess(argv, self.rc, self.out, "sacct: error: x")


def _history(monkeypatch: pytest.MonkeyPatch, fake: FakeRun,
             **kw: Any) -> tuple[AccountingHistory, list[str]]:
    monkeypatch.setattr(subprocess, "run", fake)
    warnings: list[str] = []
    h = AccountingHistory(ad.SlurmCli(env={"PATH": "/usr/bin"}, bindir="/usr/bin"),
                          warn=warnings.append, **kw)
    return h, warnings


def test_asks_sacct_for_the_callers_ended_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeRun(_sacct(_job(10, ME, _comment(_attempt()))))
    h, warnings = _history(monkeypatch, fake, days=30, timeout=7)
    assert h.peaks(FP, None, "adam", "fp32") == {32: 9000}
    assert h.lookup(FP.upper(), 32, None, "adam", "fp32") == 9000
    assert h.lookup(FP, 16, None, "adam", "fp32") is None
    assert warnings == [] and h.jobs_read == 1
    (argv,) = fake.calls  # asked once, however many lookups; sacct --json honours --user
    assert argv[0] == "/usr/bin/sacct" and ad.JSON_FLAG in argv and "--jobs" not in argv
    assert f"--user={ME}" in argv and "--starttime=now-30days" in argv
    # every ended state: incomplete runs are lower bounds (issue 27)
    assert "--state=CD,F,CA,TO,OOM,NF,PR,DL" in argv
    assert fake.timeouts == [7]


def test_another_users_job_with_the_same_fingerprint_is_ignored(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Another user's rows (a sacct that ignored --user, as 22.05's did) must not
    count, whether smaller (would lower the estimate) or larger (would raise it)."""
    fake = FakeRun(_sacct(
        _job(11, OTHER, _comment(_attempt(peak=700))),
        _job(12, OTHER, _comment(_attempt(peak=80000, batch=64))),
        _job(13, ME, _comment(_attempt(peak=9000))),
        _job(14, "", _comment(_attempt(peak=600))),
    ))
    h, _ = _history(monkeypatch, fake)
    assert h.peaks(FP, None, "adam", "fp32") == {32: 9000}
    fake = FakeRun(_sacct(_job(11, OTHER, _comment(_attempt(peak=700)))))
    h, _ = _history(monkeypatch, fake)
    assert h.peaks(FP, None, "adam", "fp32") == {}


def test_only_the_callers_uid_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeRun(_sacct(_job(13, ME, _comment(_attempt(peak=9000)))))
    monkeypatch.setattr(subprocess, "run", fake)
    cli = ad.SlurmCli(env={"PATH": "/usr/bin"}, bindir="/usr/bin")
    other_uid = next(p.pw_uid for p in pwd.getpwall() if p.pw_name != ME)
    h = AccountingHistory(cli, uid=other_uid, warn=lambda _m: None)
    assert h.peaks(FP, None, "adam", "fp32") == {}  # the rows are ME's, not theirs
    seen: list[str] = []
    unknown = AccountingHistory(cli, uid=2**31 - 7, warn=seen.append)
    assert unknown.peaks(FP, None, "adam", "fp32") == {} and "no user name" in seen[0]


def test_failed_oom_and_unmeasured_attempts_are_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeRun(_sacct(
        # the OOM-killed attempt shows the limit it hit (30000), not what it needed
        _job(20, ME, _comment(_attempt(0, 30000, oom=True, requeued=True), _attempt(1, 9000))),
        _job(21, ME, _comment(_attempt(peak=50000)), state="FAILED"),
        _job(22, ME, _comment(_attempt(peak=60000, samples=0))),
        _job(23, ME, _comment(_attempt(peak=0))),
        _job(24, ME, _comment(_attempt(peak=70000, requeued=True))),
        _job(25, ME, _comment(_attempt(peak=80000, oom=True))),
        _job(26, ME, _comment(_attempt(peak=90000, fp="not-hex"))),
        _job(27, ME, _comment(_attempt(peak=90000)), state="CANCELLED"),
    ))
    h, warnings = _history(monkeypatch, fake)
    assert h.peaks(FP, None, "adam", "fp32") == {32: 9000}
    assert warnings == []


def test_largest_peak_is_kept_per_key(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeRun(_sacct(
        _job(30, ME, _comment(_attempt(peak=8000))),
        _job(31, ME, _comment(_attempt(peak=9500))),
        _job(32, ME, _comment(_attempt(peak=9100))),
        _job(33, ME, _comment(_attempt(peak=15000, batch=64))),
        _job(34, ME, _comment(_attempt(peak=20000, seq_len=512, optimizer="adamw"))),
    ))
    h, _ = _history(monkeypatch, fake)
    assert h.peaks(FP, None, "adam", "fp32") == {32: 9500, 64: 15000}
    assert h.peaks(FP, 512, "adamw", "fp32") == {32: 20000}
    assert h.lookup(FP, 32, 0, "adam", "fp32") == 9500  # seq len None and 0 are one key
    assert h.peaks(FP, None, "sgd", "fp32") == {}


@pytest.mark.parametrize("fake", [
    FakeRun(exc=subprocess.TimeoutExpired(["sacct"], 10)),  # slurmdbd slow
    FakeRun("", rc=1),  # slurmdbd down
    FakeRun("sacct: error: Problem talking to the database"),  # not JSON
    FakeRun(json.dumps({"jobs": 5})),
    FakeRun(exc=FileNotFoundError("sacct")),
], ids=["timeout", "exit-1", "not-json", "bad-json", "no-sacct"])
def test_slurmdbd_trouble_is_an_empty_history_and_one_warning(
        monkeypatch: pytest.MonkeyPatch, fake: FakeRun) -> None:
    h, warnings = _history(monkeypatch, fake)
    assert h.peaks(FP, None, "adam", "fp32") == {}
    assert h.lookup(FP, 32, None, "adam", "fp32") is None
    assert len(warnings) == 1 and "no history from Slurm accounting" in warnings[0]
    assert len(fake.calls) <= 2  # one id query and one JSON read, not retried per lookup


def test_requeued_job_rows_and_foreign_comments(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeRun(_sacct(
        _job(40, ME, None, state="REQUEUED"),
        _job(40, ME, _comment(_attempt(0, 30000, oom=True, requeued=True), _attempt(1, 9000))),
        _job(41, ME, "jobstats:js1:abcdef"),  # another tool's comment
        _job(42, ME, "cl1:" + "a" * 100),  # an unreadable token
        _job(43, ME, None),
    ))
    h, warnings = _history(monkeypatch, fake)
    assert h.peaks(FP, None, "adam", "fp32") == {32: 9000}
    assert h.jobs_read == 1 and warnings == []


def test_only_the_newest_jobs_are_read() -> None:
    rows = sacct_json.parse(_sacct(*(
        _job(100 + i, ME, _comment(_attempt(peak=1000 + i))) for i in range(5))))
    recs = user_records(rows, ME, max_jobs=2)
    assert [r.attempts[0].metrics.peak_mib for r in recs] == [1004, 1003]  # type: ignore[union-attr]


def test_record_is_not_supported() -> None:
    with pytest.raises(NotImplementedError):
        AccountingHistory(warn=lambda _m: None).record(FP, 32, None, "adam", "fp32", 1)


def test_epilog_record_carries_the_key_and_feeds_the_next_estimate(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole path: the prolog's meta (SPANK options) -> build_attempt -> the
    AdminComment text -> sacct on the login host -> the rerun's estimate."""
    cfg = CollocConfig(metrics_dir=str(tmp_path / "m"), series_points=8)
    text = SUMMARY.read_text()
    fp = parse_summary(text).fingerprint()
    first = estimate(text, batch_size=32)
    rec = {"TresPerNode": "gres:shard:20", "GRES": "shard:20(IDX:1)",
           "AdminComment": f"colloc1:mode=estimate,need_mib={first.estimate_mib},shards=20,"
                           f"shard_mib=1024,est=layer-aware,est_mib={first.estimate_mib},fp={fp}"}
    ctx = context_from_record(77, os.getuid(), {}, rec)
    env = {SPANK + "batch_size": "32", SPANK + "seq_len": "(null)",
           SPANK + "optimizer": "adam", SPANK + "precision": "fp32"}
    meta = meta_for(ctx, cfg, env)
    store.write_meta(cfg.metrics_dir, meta)
    measured = int(first.estimate_mib * 0.8)
    a = build_attempt(ctx, cfg, cause="none", pattern=None, evidence_path=None,
                      requeued=False, reason=None, new_shards=None, shards_per_gpu=None,
                      metrics=MetricsSummary(peak_mib=measured, samples=120))
    assert a.estimate is not None
    assert (a.estimate.fingerprint, a.estimate.batch_size, a.estimate.seq_len,
            a.estimate.optimizer, a.estimate.precision) == (fp, 32, None, "adam", "fp32")
    assert a.start == int(meta.start)
    comment = append_attempt(ctx.admin_comment, a).lower()
    assert decode(comment).attempts == (a,)

    fake = FakeRun(_sacct(_job(77, ME, comment)))
    h, warnings = _history(monkeypatch, fake)
    rerun = estimate(text, batch_size=32, history=h)
    assert rerun.estimator == "history" and warnings == []
    assert measured <= rerun.estimate_mib < first.estimate_mib


def test_build_attempt_ignores_a_meta_of_another_owner(tmp_path: Path) -> None:
    cfg = CollocConfig(metrics_dir=str(tmp_path / "m"))
    rec = {"TresPerNode": "gres:shard:4", "GRES": "shard:4(IDX:0)",
           "AdminComment": f"colloc1:mode=estimate,need_mib=4096,shards=4,shard_mib=1024,"
                           f"est=layer-aware,est_mib=4096,fp={FP}"}
    ctx = context_from_record(78, 4242, {}, rec)
    meta = meta_for(ctx, cfg, {SPANK + "batch_size": "32"})
    store.write_meta(cfg.metrics_dir, meta.__class__(**{**meta.__dict__, "uid": 4343}))
    a = build_attempt(ctx, cfg, cause="none", pattern=None, evidence_path=None,
                      requeued=False, reason=None, new_shards=None, shards_per_gpu=None)
    assert a.estimate is not None and a.estimate.fingerprint == FP
    assert a.estimate.batch_size is None and a.start is None


# ----------------------------------------------------------------- the CLI ---


def _cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: FakeRun,
         *extra: str) -> tuple[dict[str, Any], str]:
    from slurm_colloc.cli.estimate_cmd import estimate as estimate_cmd

    conf = tmp_path / "colloc.conf"
    conf.write_text('history_source = "accounting"\nhistory_days = 14\n'
                    f'history_db = "{tmp_path / "h.sqlite"}"\n')
    monkeypatch.setenv("COLLOC_CONF", str(conf))
    monkeypatch.setattr(subprocess, "run", fake)
    monkeypatch.setattr("shutil.which", lambda name, path=None: f"/usr/bin/{name}")
    try:
        runner = CliRunner(mix_stderr=False)  # type: ignore[call-arg,unused-ignore]
    except TypeError:
        runner = CliRunner()
    r = runner.invoke(estimate_cmd, ["--summary", str(SUMMARY), "--batch-size", "32",
                                     "--json", *extra])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout), r.stderr


def test_cli_uses_the_accounting_history(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    fp = parse_summary(SUMMARY.read_text()).fingerprint()
    fake = FakeRun(_sacct(_job(50, ME, _comment(_attempt(peak=5000, fp=fp))),
                          _job(51, OTHER, _comment(_attempt(peak=900, fp=fp)))))
    out, err = _cli(tmp_path, monkeypatch, fake)
    assert out["estimator"] == "history" and out["history_source"] == "accounting"
    assert out["estimate_mib"] >= 5000 and err == ""
    assert "--starttime=now-14days" in fake.calls[0]
    out, _ = _cli(tmp_path, monkeypatch, fake, "--no-history")
    assert out["history_source"] == "none" and out["estimator"] == "layer-aware"


def test_cli_goes_on_without_history_when_slurmdbd_is_down(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeRun(exc=subprocess.TimeoutExpired(["sacct"], 10))
    out, err = _cli(tmp_path, monkeypatch, fake)
    assert out["estimator"] == "layer-aware" and out["history_source"] == "accounting"
    assert err.startswith("colloc estimate: warning: no history") and err.count("\n") == 1


def test_sacct_side_errors_are_warnings_not_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    doc = json.loads(_sacct(_job(60, ME, _comment(_attempt(peak=4000)))))
    doc["errors"] = [{"error": "slurmdbd: partial answer"}, {"error": "Nothing found"}]
    h, warnings = _history(monkeypatch, FakeRun(json.dumps(doc)))
    assert h.peaks(FP, None, "adam", "fp32") == {32: 4000}
    assert warnings == ["sacct reported: slurmdbd: partial answer"]
