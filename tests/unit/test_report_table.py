"""The multi-job table is right (issue 27 item 3): users without an association,
"shared a GPU" only when a job did, GPU-hours that add up, ``--format``,
``--partition`` and ``--state`` as sacct's own filters."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_colloc.accounting.record import Attempt, Estimate
from slurm_colloc.cli.report_cmd import ReportParams, report, run
from slurm_colloc.report import admin, jobs
from slurm_colloc.report.inquirer import JobQuery, JobRow, SlurmInquirer
from slurm_colloc.report.usage import period_usage
from slurm_colloc.slurm import adapter as ad
from slurm_colloc.slurm import sacct_json
from slurm_colloc.slurm.records import AccountingRecord

from .test_report_build import CFG, Fake, comment, row

DATA = Path(__file__).parent / "data" / "slurm"
SPG = 40


# ---------------------------------------------------- users without an association ---

@pytest.mark.parametrize("release", ["24.11", "26.05"])
def test_a_job_without_association_names_its_user_from_the_query(
        release: str, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = json.loads((DATA / release / "sacct-plain.json").read_text())
    job = doc["jobs"][0]
    assert sacct_json.user_of(job) == "root"  # the captured job has an association
    orphan = copy.deepcopy(job)
    orphan["user"] = None  # what slurmdbd gives for a job without an association
    orphan["association"]["user"] = None
    orphan["job_id"] = 77
    halfway = copy.deepcopy(orphan)
    halfway["association"]["user"] = "u1"
    halfway["job_id"] = 78
    other = copy.deepcopy(job)
    other["user"], other["job_id"] = "mallory", 79
    assert sacct_json.user_of(orphan) == "" and sacct_json.user_of(halfway) == "u1"
    doc["jobs"] = [orphan, halfway, other]
    calls: list[list[str]] = []

    def fake(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, json.dumps(doc), "")

    monkeypatch.setattr(subprocess, "run", fake)
    cli = ad.SlurmCli(env={"PATH": "/usr/bin"}, bindir="/usr/bin")
    recs = cli.accounting_period("now-1day", user="u1", states=("COMPLETED", "FAILED"),
                                 partitions=("gpu",))
    # sacct chose the orphan by u1's uid; a record naming someone else is dropped
    assert [(r.job_id, r.fields["User"]) for r in recs] == [("77", "u1"), ("78", "u1")]
    argv = calls[0]
    assert "--user=u1" in argv and "--state=COMPLETED,FAILED" in argv
    assert "--partition=gpu" in argv and "--allusers" not in argv
    assert "--endtime=now" in argv  # with --state and no end, sacct looks at 1 s
    assert recs[0].fields["Partition"] == "gpu"
    everyone = cli.accounting_period("now-1day")
    assert {r.fields["User"] for r in everyone} == {"", "u1", "mallory"}


class _Slurm:
    """The adapter's period query, recording what it was asked."""

    def __init__(self, recs: list[AccountingRecord]) -> None:
        self.recs = recs
        self.kw: dict[str, Any] = {}

    def accounting_period(self, since: str, until: str | None, user: str | None,
                          **kw: Any) -> list[AccountingRecord]:
        self.kw = {"since": since, "user": user, **kw}
        return self.recs


def _rec(raw: str, state: str, user: str = "u1", part: str = "gpu") -> AccountingRecord:
    f = {"JobIDRaw": raw, "JobID": raw, "JobName": "t", "User": user, "State": state,
         "ExitCode": "0:0", "Start": "2026-11-20T10:00:00", "End": "2026-11-20T10:01:00",
         "Elapsed": "00:01:00", "AdminComment": "", "SystemComment": "", "Account": "lab",
         "Submit": "", "AllocTRES": "", "ReqTRES": "", "NodeList": "n0", "Comment": "",
         "Partition": part}
    return AccountingRecord(raw, state, f)


def test_state_and_partition_go_to_sacct_and_its_answer_is_kept() -> None:
    # sacct -s R lists jobs that ran during the period, whatever their state now:
    # the table counts what sacct lists instead of re-filtering by the final state
    slurm = _Slurm([_rec("5", "COMPLETED"), _rec("6", "RUNNING")])
    inq = SlurmInquirer(slurm, None)  # type: ignore[arg-type]
    q = JobQuery(user="u1", since="now-1day", states=("RUNNING",), partitions=("gpu",))
    rows = inq.query(q)
    assert [r.job_id for r in rows] == ["5", "6"]
    assert slurm.kw["states"] == ("RUNNING",) and slurm.kw["partitions"] == ("gpu",)
    assert slurm.kw["user"] == "u1"


def test_named_jobs_are_filtered_by_their_final_state_and_partition() -> None:
    w = Fake(rows={
        "1": [row("1", "REQUEUED", "", start=100), row("1", "COMPLETED", "", start=200)],
        "2": [row("2", "FAILED", "", partition="debug")],
        "3": [row("3", "COMPLETED", "", partition="gpu")],
    }, live={}, ser={})
    done = w.query(JobQuery(ids=("1", "2", "3"), states=("COMPLETED",)))
    # a requeued job keeps both attempts: its final state is what counts
    assert [(r.job_id, r.state) for r in done] == [
        ("1", "REQUEUED"), ("1", "COMPLETED"), ("3", "COMPLETED")]
    assert [r.job_id for r in w.query(JobQuery(ids=("1", "2", "3"),
                                               partitions=("debug",)))] == ["2"]


# ----------------------------------------------------------- sharing and GPU-hours ---

def _job(jid: str, start: int, end: int, shards: int = 8, gpu: int = 0, node: str = "n0",
         co: tuple[str, ...] = ()) -> tuple[list[JobRow], tuple[Attempt, ...]]:
    a = Attempt(0, Estimate(8192, "x"), shards=shards, shard_mib=1024, limit_mib=shards * 1024,
                gpu=gpu, node=node, co_tenants=co, start=start, end=end)
    return [JobRow(job_id=jid, state="COMPLETED", start=start, end=end,
                   elapsed_s=end - start)], (a,)


def test_a_job_alone_on_its_gpu_shared_nothing_and_saved_nothing() -> None:
    u = period_usage({"1": _job("1", 0, 3600)}, SPG)["1"]
    assert not u.shared and u.gpu_hours_saved == 0
    assert u.gpu_hours == pytest.approx(1.0) == u.whole_gpu_hours


def test_overlap_on_the_same_gpu_is_sharing_split_by_shards() -> None:
    u = period_usage({
        "1": _job("1", 0, 3600, shards=10),
        "2": _job("2", 1800, 5400, shards=30),  # half of job 1's hour, same GPU
        "3": _job("3", 0, 3600, gpu=1),  # the other GPU: alone
        "4": _job("4", 0, 3600, node="n1"),  # GPU 0 of another node: alone
    }, SPG)
    assert u["1"].shared and u["2"].shared and not u["3"].shared and not u["4"].shared
    assert u["1"].co_tenants == {"2"}
    # job 1: alone 0.5 h (whole GPU), then 0.5 h at 10 of 40 shards held
    assert u["1"].gpu_hours == pytest.approx(0.5 + 0.5 * 10 / 40)
    assert u["1"].gpu_hours_saved == pytest.approx(0.5 * 30 / 40)
    # over the GPU: allocated hours = the 1.5 h it was busy; saved = the 0.5 h overlap
    assert u["1"].gpu_hours + u["2"].gpu_hours == pytest.approx(1.5)
    assert u["1"].gpu_hours_saved + u["2"].gpu_hours_saved == pytest.approx(0.5)


def test_recorded_co_tenants_outside_the_report_count_as_sharing() -> None:
    u = period_usage({"1": _job("1", 0, 3600, shards=10, co=("99",))}, SPG)["1"]
    assert u.shared and u.gpu_hours == pytest.approx(10 / 40)
    assert u.gpu_hours_saved == pytest.approx(30 / 40)


def test_the_period_counts_only_jobs_that_shared(capsys: pytest.CaptureFixture[str]) -> None:
    alone = Attempt(0, Estimate(6144, "x"), shards=6, shard_mib=1024, limit_mib=6144, gpu=0,
                    node="n0", start=1000, end=1060)
    w = Fake(rows={
        "1": [row("1", "COMPLETED", comment(alone), start=1000, end=1060)],
        "2": [row("2", "COMPLETED", comment(Attempt(0, shards=6, gpu=0, node="n1",
                                                    start=1000, end=1060)))],
        "3": [row("3", "COMPLETED", comment(Attempt(0, shards=6, gpu=0, node="n1",
                                                    start=1030, end=1090)))],
    }, live={}, ser={})
    s = admin.summarize_period(w.period_rows("x", None, None), CFG, "x", None)
    assert (s.colloc_jobs, s.collocated) == (3, 2)
    assert s.gpu_hours_used + s.gpu_hours_saved == pytest.approx(s.whole_gpu_hours, abs=2e-3)
    assert s.gpu_hours_saved <= s.gpu_hours_used  # never more than two at once here
    q = JobQuery(since="x")
    t = jobs.build_table(w.query(q), CFG, q)
    assert [j.shared for j in t.jobs] == [False, True, True]
    assert t.totals["shared"] == 2 and t.jobs[0].gpu_hours_saved == 0


_SPAN = st.tuples(st.integers(0, 3), st.integers(0, 1), st.integers(0, 7200),
                  st.integers(1, 7200), st.integers(1, SPG), st.booleans())


@settings(max_examples=150, deadline=None)
@given(st.lists(_SPAN, min_size=1, max_size=8))
def test_gpu_hours_add_up_whatever_the_overlaps(spans: list[tuple[int, ...]]) -> None:
    report = {str(i + 1): _job(str(i + 1), t0, t0 + dt, shards=s, gpu=g, node=f"n{n}",
                               co=("999",) if unseen else ())
              for i, (n, g, t0, dt, s, unseen) in enumerate(spans)}
    u = period_usage(report, SPG)
    for j, (_, (a,)) in report.items():
        x = u[j]
        assert x.gpu_hours >= 0 and x.gpu_hours_saved >= -1e-12
        assert x.gpu_hours + x.gpu_hours_saved == pytest.approx(x.whole_gpu_hours)
        assert a.end is not None and a.start is not None
        assert x.whole_gpu_hours == pytest.approx((a.end - a.start) / 3600)
        if not x.shared:
            assert x.gpu_hours_saved == pytest.approx(0)
        if x.gpu_hours_saved > 1e-9:
            assert x.shared
    # totals: saved never exceeds allocated times (most jobs on a GPU at once - 1),
    # so with at most two at once saved <= allocated (issue 27's 0.08 vs 0.02)
    known = {j: x for j, x in u.items() if not report[j][1][0].co_tenants}
    most = 1
    for _, (a,) in report.values():
        at_once = sum(1 for _, (b,) in report.values() if (b.node, b.gpu) == (a.node, a.gpu)
                      and b.start is not None and b.end is not None and a.start is not None
                      and b.start <= a.start < b.end)
        most = max(most, at_once)
    alloc = sum(x.gpu_hours for x in known.values())
    saved = sum(x.gpu_hours_saved for x in known.values())
    assert saved <= (most - 1) * alloc + 1e-9 or len(known) < len(u)


@settings(max_examples=60, deadline=None)
@given(st.lists(_SPAN, min_size=1, max_size=6))
def test_the_table_and_the_period_agree(spans: list[tuple[int, ...]]) -> None:
    rows = [row(str(i + 1), "COMPLETED", comment(Attempt(
        0, shards=s, gpu=g, node=f"n{n}", co_tenants=("999",) if unseen else (),
        start=1000 + t0, end=1000 + t0 + dt)), start=1000 + t0, end=1000 + t0 + dt, el=dt)
        for i, (n, g, t0, dt, s, unseen) in enumerate(spans)]
    q = JobQuery(since="x")
    t = jobs.build_table(rows, CFG, q)
    p = admin.summarize_period(rows, CFG, "x", None)
    assert t.totals["shared"] == p.collocated
    assert t.totals["gpu_hours_saved"] == pytest.approx(p.gpu_hours_saved, abs=2e-3)
    for j in t.jobs:
        assert j.gpu_hours + j.gpu_hours_saved == pytest.approx(j.whole_gpu_hours)
        assert j.gpu_hours_saved <= j.whole_gpu_hours


# --------------------------------------------------------------------------- --format ---

def test_format_picks_columns_and_adds_with_a_plus() -> None:
    assert jobs.parse_format("JobID,State,MemEff,Saved") == ("JobID", "State", "MemEff",
                                                             "Saved")
    assert jobs.parse_format("jobid, name ,memeff") == ("JobID", "JobName", "MemEff")
    assert jobs.parse_format("+Partition")[-1] == "Partition"
    assert jobs.parse_format(None) == jobs.DEFAULT_FORMAT
    with pytest.raises(jobs.FormatError, match="'Bogus': no such column; valid columns: "
                                               "JobID,User,"):
        jobs.parse_format("JobID,Bogus")


def test_format_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    bad = CliRunner().invoke(report, ["-u", "u1", "--format", "JobID,Effic"])
    assert bad.exit_code == 2 and "valid columns" in bad.output and "MemEff" in bad.output
    w = Fake(rows={"1": [row("1", "COMPLETED", "", partition="gpu")],
                   "2": [row("2", "FAILED", "", partition="debug")]}, live={}, ser={})
    p = ReportParams(None, False, None, None, None, "alice", states=("FAILED",),
                     columns=("JobID", "Partition", "State"))
    assert run(p, CFG, w) == 0
    _, _, rest = capsys.readouterr().out.partition("JobID")
    table = "JobID" + rest.split("jobs,")[0]
    assert "Partition" in table and "MemEff" not in table and "debug" in table
    assert "gpu " not in table and "FAILED" in table


def test_state_codes_and_partitions_on_the_command_line() -> None:
    bad = CliRunner().invoke(report, ["-u", "u1", "-s", "CD,XX"])
    assert bad.exit_code == 2 and "not a Slurm job state" in bad.output
    bad = CliRunner().invoke(report, ["-r", "gpu;rm"])
    assert bad.exit_code == 2 and "not a partition name" in bad.output
