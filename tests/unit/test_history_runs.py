"""Issue 27 item 2: history takes only complete measurements; incomplete runs only raise.

A run sampled with gaps, killed (enforcement, a signal, OOM), requeued, or whose job
reported more than we sampled never lowers the next estimate (its peak is a lower
bound); a complete run can. The provenance says which runs the estimate came from.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_colloc.accounting import Attempt, Estimate, JobRecord, MetricsSummary, OomInfo, Requeue
from slurm_colloc.accounting.history import AccountingHistory, attempt_peak, user_jobs
from slurm_colloc.accounting.history_runs import (
    UserJob,
    classify,
    provenance,
    reported_mib,
    runs_of,
)
from slurm_colloc.accounting.record import Enforcement
from slurm_colloc.estimators import estimate, parse_summary
from slurm_colloc.slurm import adapter as ad
from slurm_colloc.slurm import sacct_json
from slurm_colloc.slurm.records import AccountingRecord, ExitCode
from tests.unit.test_accounting_history import ME, FakeRun, _comment, _job, _sacct

SUMMARY = parse_summary(
    (Path(__file__).parent / "data" / "summaries" / "resnet50_torchinfo.txt").read_text())
FP = SUMMARY.fingerprint()


def _a(peak: int, *, batch: int = 32, n: int = 0, gap_s: int = 0, oom: bool = False,
       requeued: bool = False, alloc: int | None = None, samples: int = 50) -> Attempt:
    gaps = ((4, gap_s, "collector"),) if gap_s else ()
    o = None
    if oom or alloc is not None:
        o = OomInfo("gpu-oom" if oom else "none", "torch-cuda-oom", alloc_mib=alloc)
    return Attempt(
        attempt=n, estimate=Estimate(12000, "layer-aware", 1000, FP, batch_size=batch,
                                     optimizer="sgd"),
        oom=o, requeue=Requeue(True, "gpu-oom") if requeued else None,
        metrics=MetricsSummary(peak_mib=peak, samples=samples, gaps=gaps,
                               span_s=16 if gap_s else 20))


def _job_of(jid: int, *attempts: Attempt, state: str = "COMPLETED", signal: int = 0) -> UserJob:
    return UserJob(str(jid), state, JobRecord(attempts=attempts), signal)


class Store:
    """The accounting history's classification over in-memory jobs (no sacct)."""

    def __init__(self, jobs: list[UserJob]) -> None:
        self.h = AccountingHistory(uid=os.getuid())
        self.h._runs = runs_of(jobs)
        from slurm_colloc.accounting.history_runs import peaks_of
        self.h._peaks = peaks_of(self.h._runs)
        self.h._bounds = peaks_of(self.h._runs, "bound")

    def estimate(self, batch: int = 32) -> int:
        return estimate(SUMMARY, batch, optimizer="sgd", history=self.h).estimate_mib


def _incomplete(kind: str, peak: int, batch: int, jid: int) -> UserJob:
    if kind == "gaps":
        return _job_of(jid, _a(peak, batch=batch, gap_s=8))
    if kind == "signal":
        return _job_of(jid, _a(peak, batch=batch), state="FAILED", signal=9)
    if kind == "oom":
        return _job_of(jid, _a(peak, batch=batch, oom=True))
    if kind == "requeued":
        return _job_of(jid, _a(peak, batch=batch, requeued=True), _a(1, batch=batch, n=1,
                                                                        samples=0))
    if kind == "cancelled":
        return _job_of(jid, _a(peak, batch=batch), state="CANCELLED")
    return _job_of(jid, _a(peak, batch=batch, alloc=peak * 2))  # printed more than sampled


KINDS = ("gaps", "signal", "oom", "requeued", "cancelled", "reported")
peaks = st.integers(min_value=100, max_value=60_000)
batches = st.sampled_from([8, 16, 32, 64])


@settings(max_examples=80, deadline=None)
@given(complete=st.lists(st.tuples(peaks, batches), max_size=4),
       partial=st.lists(st.tuples(st.sampled_from(KINDS), peaks, batches), min_size=1,
                        max_size=3),
       batch=batches)
def test_an_incomplete_run_never_lowers_the_estimate(
        complete: list[tuple[int, int]], partial: list[tuple[str, int, int]], batch: int) -> None:
    before = [_job_of(100 + i, _a(p, batch=b)) for i, (p, b) in enumerate(complete)]
    after = before + [_incomplete(k, p, b, 200 + i) for i, (k, p, b) in enumerate(partial)]
    assert Store(after).estimate(batch) >= Store(before).estimate(batch)


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(KINDS), peak=peaks)
def test_an_incomplete_run_is_a_lower_bound_never_a_measurement(kind: str, peak: int) -> None:
    job = _incomplete(kind, peak, 32, 7)
    runs = runs_of([job])
    assert all(r.use != "measured" for r in runs)
    assert attempt_peak(job.record.attempts[0]) is None or kind in ("signal", "cancelled")
    assert Store([job]).estimate(32) >= peak * 1.05 - 1  # at least the bound + margin


def test_a_complete_run_can_lower_the_estimate() -> None:
    cold = Store([]).estimate(32)
    small = cold // 3
    assert Store([_job_of(1, _a(small))]).estimate(32) < cold
    # the same peak sampled with a gap is only a bound: the summary's estimate stands
    assert Store([_job_of(1, _a(small, gap_s=8))]).estimate(32) == cold


def test_a_gapped_run_raises_the_estimate_above_a_smaller_complete_one() -> None:
    """The issue's case: 5.0 GiB sampled with the collector down for half the run;
    the history must not size the next run below what that run already reached."""
    complete = Store([_job_of(1, _a(3000))]).estimate(32)
    both = Store([_job_of(1, _a(3000)), _job_of(2, _a(5120, gap_s=8))]).estimate(32)
    assert complete < 5120 < both and both == 5376  # ceil(5120 * 1.05)


def test_classify_names_the_reason() -> None:
    assert classify(_a(5000, gap_s=8)).reason == "sampling gaps (collector down 8 s of 16 s)"
    assert classify(_a(5000, oom=True)).reason == "ended by gpu-oom"
    assert classify(_a(5000, requeued=True)).reason == "requeued"
    r = classify(_a(5000), _job_of(9, _a(5000), state="FAILED", signal=9))
    assert (r.use, r.reason, r.peak_mib) == ("bound", "killed by signal 9 (job FAILED)", 5000)
    r = classify(_a(5000, alloc=2048))  # not an OOM, but the job said it held 2 GiB: less
    assert r.use == "measured"
    r = classify(_a(4096, oom=True, alloc=10240))
    assert (r.use, r.peak_mib, r.reason) == (
        "bound", 10240, "ended by gpu-oom; the job's OOM message asked for 10240 MiB, "
        "4096 MiB sampled")
    held = dataclasses.replace(_a(4096, oom=True), oom=OomInfo("gpu-oom", alloc_mib=10240,
                                                                  in_use_mib=4000))
    assert classify(held).peak_mib == 14240  # what it held + what it was refused
    assert reported_mib(_a(100)) is None
    assert classify(_a(5000, samples=0)).use == "ignored"
    # a job's gap that is its own (no process on the GPU) is no sampling failure
    a = _a(5000)
    a = Attempt(0, a.estimate, metrics=MetricsSummary(peak_mib=5000, samples=9,
                                                      gaps=((2, 30, "job"),), span_s=60))
    assert classify(a).use == "measured"


def test_enforcement_kill_is_a_bound() -> None:
    a = dataclasses.replace(_a(30000), enforcement=Enforcement("over_limit", "killed",
                                                                peak_mib=31000, limit_mib=2048))
    r = classify(a)
    assert r.use == "bound" and r.peak_mib == 31000
    assert r.reason == ("killed by colloc's enforcement (over_limit); the collector's verdict "
                        "saw 31000 MiB, 30000 MiB sampled")
    flagged = dataclasses.replace(a, enforcement=Enforcement("outside_mps", "flagged",
                                                             peak_mib=20000))
    assert classify(flagged).use == "measured"  # flagged only, ran to its end


def test_provenance_lists_used_and_set_aside_runs() -> None:
    runs = runs_of([
        _job_of(105, _a(5120, gap_s=8)),
        _job_of(104, _a(6000)),
        _job_of(103, _a(9000, batch=64)),
        _job_of(102, _a(7000), state="FAILED", signal=9),
        _job_of(101, _a(6400)),
        _job_of(99, Attempt(0, Estimate(1, "x", fingerprint="cd" * 8, batch_size=32),
                            metrics=MetricsSummary(peak_mib=1, samples=3))),  # another model
    ])
    p = provenance(runs, FP.upper(), 32, None, "sgd", "fp32")
    assert [r.job_id for r in p.used] == ["104", "101"]
    assert [(r.job_id, r.reason) for r in p.ignored] == [("103", "batch 64; measured at batch 32")]
    assert [(r.job_id, r.reason) for r in p.bounds] == [
        ("105", "sampling gaps (collector down 8 s of 16 s)"),
        ("102", "killed by signal 9 (job FAILED)")]
    assert p.method == "exact" and p.history_mib == 6720  # ceil(6400 * 1.05)
    assert p.floor_mib == 7350 and p.next_mib == 7350  # the killed run reached 7000
    line = p.line()
    assert line.startswith(
        "7.2 GiB from jobs 104, 101, raised to at least 7.2 GiB by incomplete runs (")
    assert "105 not used: sampling gaps (collector down 8 s of 16 s)" in line
    assert "102 not used: killed by signal 9 (job FAILED)" in line
    d = json.loads(json.dumps(p.to_json()))
    assert d["next_mib"] == 7350 and d["used"][0] == {"job": "104", "attempt": 0,
                                                       "peak_mib": 6000}
    assert {n["job"] for n in d["not_used"]} == {"105", "102", "103"}
    # two measured batch sizes: a line through them (no summary needed)
    p = provenance(runs, FP, 48, None, "sgd", "fp32")
    assert p.method == "fit" and [r.job_id for r in p.used] == ["104", "103", "101"]
    # a bound at a larger batch says nothing about this one
    p = provenance(runs, FP, 16, None, "sgd", "fp32")
    assert p.floor_mib is None and p.bounds == []
    assert ("105", "sampling gaps (collector down 8 s of 16 s), at the larger batch 32") in [
        (r.job_id, r.reason) for r in p.ignored]
    # one measured batch size elsewhere: the figure needs the summary estimator
    p = provenance(runs_of([_job_of(103, _a(9000, batch=64))]), FP, 32, None, "sgd", "fp32")
    assert (p.history_mib, p.method, p.next_mib) == (None, "anchored", None)
    assert p.line() == "from the model summary scaled by job 103"
    none = provenance(runs_of([_job_of(105, _a(5120, gap_s=8))]), FP, 32, None, "sgd", "fp32")
    assert none.next_mib is None and none.line().startswith(
        "from the model summary (no complete measurement), at least 5.3 GiB (105 not used")


def _row(jid: int, state: str, sig: int = 0) -> AccountingRecord:
    rec = sacct_json.parse(_sacct(_job(jid, ME, _comment(_a(5000)), state=state)))[0]
    if not sig:
        return rec
    return dataclasses.replace(rec, exit=ExitCode(frozenset({"SIGNALED"}), None, sig))


def test_user_jobs_keeps_ended_jobs_with_their_state() -> None:
    rows = [_row(1, "COMPLETED"), _row(2, "FAILED", 9), _row(3, "RUNNING"),
            _row(4, "REQUEUED"), _row(5, "CANCELLED")]
    jobs = user_jobs(rows, ME)
    assert [(j.job_id, j.state, j.signal) for j in jobs] == [
        ("5", "CANCELLED", 0), ("2", "FAILED", 9), ("1", "COMPLETED", 0)]
    assert user_jobs(rows, ME + "x") == []


def test_accounting_history_floors_from_sacct(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeRun(_sacct(
        _job(50, ME, _comment(_a(6000))),
        _job(51, ME, _comment(_a(8000, gap_s=8))),
        _job(52, ME, _comment(_a(9000)), state="FAILED"),
    ))
    monkeypatch.setattr(subprocess, "run", fake)
    h = AccountingHistory(ad.SlurmCli(env={"PATH": "/usr/bin"}, bindir="/usr/bin"),
                          warn=lambda m: None)
    assert h.peaks(FP, None, "sgd", "fp32") == {32: 6000}
    assert h.floors(FP, None, "sgd", "fp32") == {32: 9000}
    e = estimate(SUMMARY, 32, optimizer="sgd", history=h)
    assert e.estimate_mib == 9450 and e.estimator == "history"
    assert sum(e.breakdown.values()) == pytest.approx(e.estimate_mib)
    assert any("incomplete run" in n for n in e.notes)
    assert len(fake.calls) == 1


def _cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fake: FakeRun, *extra: str) -> str:
    from click.testing import CliRunner

    from slurm_colloc.cli.estimate_cmd import estimate as estimate_cmd

    conf = tmp_path / "colloc.conf"
    conf.write_text('history_source = "accounting"\n')
    monkeypatch.setenv("COLLOC_CONF", str(conf))
    monkeypatch.setattr(subprocess, "run", fake)
    monkeypatch.setattr("shutil.which", lambda name, path=None: f"/usr/bin/{name}")
    summary = Path(__file__).parent / "data" / "summaries" / "resnet50_torchinfo.txt"
    r = CliRunner().invoke(estimate_cmd, ["--summary", str(summary), "--batch-size", "32",
                                          "--optimizer", "sgd", *extra])
    assert r.exit_code == 0, r.output
    return r.stdout


def test_estimate_cli_prints_where_the_estimate_came_from(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = FakeRun(_sacct(_job(60, ME, _comment(_a(6000))),
                          _job(61, ME, _comment(_a(5000, gap_s=8)))))
    out = _cli(monkeypatch, tmp_path, fake)
    assert "history: 6.2 GiB from job 60 (61 not used: sampling gaps (collector down 8 s " \
           "of 16 s))" in out
    d = json.loads(_cli(monkeypatch, tmp_path, fake, "--json"))
    assert d["history_runs"]["used"] == [{"job": "60", "attempt": 0, "peak_mib": 6000}]
    assert d["history_runs"]["not_used"][0]["reason"].startswith("sampling gaps")
    assert d["estimate_mib"] == 6300
    out = _cli(monkeypatch, tmp_path, fake, "--no-history")
    assert "history:" not in out


def test_sqlite_history_leaves_out_a_gapped_attempt(tmp_path: Path) -> None:
    """The one-node store keeps one largest peak per key: a gapped attempt's partial
    peak is not filed (it could only be mistaken for a measurement there)."""
    from slurm_colloc.config import CollocConfig
    from slurm_colloc.estimators import SqliteHistory
    from slurm_colloc.metrics import store
    from slurm_colloc.metrics.summary import record_history
    from slurm_colloc.node.job import context_from_record
    from slurm_colloc.node.metrics_launch import SPANK, meta_for

    cfg = CollocConfig(metrics_dir=str(tmp_path / "m"), history_db=str(tmp_path / "h.sqlite"))
    rec = {"TresPerNode": "gres:shard:20", "GRES": "shard:20(IDX:1)",
           "AdminComment": "colloc1:mode=estimate,need_mib=9000,shards=20,shard_mib=1024,"
                           f"est=layer-aware,est_mib=9000,fp={FP}"}
    store.write_meta(cfg.metrics_dir, meta_for(context_from_record(78, 1000, {}, rec), cfg,
                                               {SPANK + "batch_size": "32"}))
    gapped = MetricsSummary(peak_mib=5120, samples=8, gaps=((8, 8, "collector"),), span_s=16)
    out = record_history(cfg, 78, 0, gapped, succeeded=True)
    assert out == "not recorded: sampling gaps (collector down 8 s)"
    assert SqliteHistory(cfg.history_db, uid=1000).lookup(FP, 32, None, "adam", "fp32") is None
    own_gap = MetricsSummary(peak_mib=5120, samples=8, gaps=((8, 8, "job"),), span_s=16)
    assert record_history(cfg, 78, 0, own_gap, succeeded=True).startswith("recorded")


def test_report_says_which_runs_the_next_estimate_comes_from() -> None:
    """The per-job report (JSON, text, HTML) carries one "next estimate" line over the
    owner's accounting history, with the run it reports on set aside when gapped."""
    from html import escape

    from rich.console import Console

    from slurm_colloc.config import CollocConfig
    from slurm_colloc.report import html, text
    from slurm_colloc.report import job as job_report
    from tests.unit.test_report_build import Fake, row
    from tests.unit.test_report_build import comment as rcomment

    class WithHistory(Fake):
        hist: list[AccountingRecord] | None = None

        def history_rows(self, user: str, days: int) -> list[AccountingRecord] | None:
            assert user == ME and days == 90
            return self.hist

    gapped = _a(5120, gap_s=8)
    fake = WithHistory(rows={"105": [row("105", "COMPLETED", rcomment(gapped), user=ME)]})
    cfg = CollocConfig(gpu_memory_mib=40960, shard_mib=1024)
    assert job_report.build("105", fake, cfg).next_estimate is None  # no history known
    fake.hist = sacct_json.parse(_sacct(_job(104, ME, _comment(_a(6000))),
                                        _job(105, ME, _comment(gapped))))
    rep = job_report.build("105", fake, cfg)
    want = "6.2 GiB from job 104 (105 not used: sampling gaps (collector down 8 s of 16 s))"
    assert rep.next_estimate is not None and rep.next_estimate["summary"] == want
    d = json.loads(json.dumps(rep.to_json()))["next_estimate"]
    assert d["used"] == [{"job": "104", "attempt": 0, "peak_mib": 6000}]
    assert d["next_mib"] == 6300 and d["fingerprint"] == FP
    c = Console(width=200, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    c.print(text.render(rep))
    assert f"Next estimate for this model: {want}" in c.export_text()
    assert f"Next estimate for this model: {escape(want)}</p>" in html.render(rep)
    # a job without a model key has no line
    fake.rows["106"] = [row("106", "COMPLETED", rcomment(Attempt(0, Estimate(1, "x"))),
                            user=ME)]
    assert job_report.build("106", fake, cfg).next_estimate is None


def test_compute_table_takes_no_gapped_attempt() -> None:
    """The SM-activity table (job_submit's compute side) uses the same rule: a mean
    over part of the attempt is no measurement of the job."""
    from slurm_colloc.accounting.compute_history import attempt_sm_pct

    whole = dataclasses.replace(_a(5000), metrics=MetricsSummary(
        peak_mib=5000, samples=50, mean_sm_activity=0.6, span_s=20))
    gapped = dataclasses.replace(whole, metrics=dataclasses.replace(
        whole.metrics, gaps=((4, 8, "collector"),)))
    assert attempt_sm_pct(whole) == pytest.approx(60.0)
    assert attempt_sm_pct(gapped) is None
