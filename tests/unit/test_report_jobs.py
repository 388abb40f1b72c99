"""The job table (``colloc report -u U -S DATE``), array ids, ``colloc-report -h`` and the
JSON schema version, over fake inquirers (no Slurm)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from slurm_colloc.cli.report_cmd import ReportParams, parse_states, run
from slurm_colloc.report import job as job_report
from slurm_colloc.report import jobs, model
from slurm_colloc.report.inquirer import JobQuery, JobRow, SlurmInquirer
from slurm_colloc.slurm.adapter import AccountingRecord
from slurm_colloc.slurm.records import NO_EXIT
from slurm_colloc.slurm.squeue_json import SlurmJob

from .test_report_build import CFG, COLLOCATED, OOM0, OOM1, Fake, comment, row, world


def _table(w: Fake, **q: Any) -> jobs.JobTable:
    query = JobQuery(**q)
    return jobs.build_table(w.query(query), CFG, query)


def test_table_has_efficiency_accuracy_ooms_and_savings() -> None:
    t = _table(world(), user="alice", since="now-1day")
    by = {j.job_id: j for j in t.jobs}
    assert list(by) == ["10", "13", "20", "30"]
    ten = by["10"]
    assert ten.colloc and ten.peak_mib == 2100 and ten.limit_mib == 6144
    assert ten.mem_efficiency == pytest.approx(2100 / 6144, abs=1e-3)
    assert ten.estimate_error_pct == pytest.approx((6144 - 2100) / 2100 * 100, abs=0.1)
    assert ten.gpu_hours_saved == pytest.approx(60 / 3600 * (1 - 6 / 40), abs=1e-4)
    rec = by["13"]  # OOM, requeued onto a whole GPU
    assert rec.ooms == 1 and rec.attempts == 2 and rec.limit_mib == 40960
    assert rec.estimate_error_pct is not None and rec.estimate_error_pct < 0  # under-asked
    assert not by["20"].colloc and by["20"].mem_efficiency is None
    tot = t.totals
    assert tot["ooms"] == 1 and tot["colloc_jobs"] == 3 and tot["gpu_hours_saved"] > 0


def test_filters_by_state_account_and_user() -> None:
    w = world()
    w.rows["41"] = [row("41", "FAILED", comment(COLLOCATED), user="bob", account="physics")]
    assert [j.job_id for j in _table(w, states=("FAILED",)).jobs] == ["41"]
    assert [j.job_id for j in _table(w, account="physics").jobs] == ["41"]
    assert _table(w, user="carol").jobs == []
    assert parse_states("cd,F,running") == ("COMPLETED", "FAILED", "RUNNING")


def test_table_json_has_schema_version_period_figures_and_rows(
        capsys: pytest.CaptureFixture[str]) -> None:
    p = ReportParams(None, True, None, "now-1hour", None, None)
    assert run(p, CFG, world()) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["schema_version"] == model.SCHEMA_VERSION
    assert d["oom_crashes"] == 1 and d["recovered"] == 1 and d["gpu_hours_saved"] > 0
    assert d["jobs"] == 4 and len(d["table"]) == 4
    assert {"job_id", "mem_efficiency", "estimate_error_pct", "ooms", "gpu_hours_saved"} \
        <= set(d["table"][0])
    assert d["totals"]["colloc_jobs"] == 3
    one = ReportParams("10", True, None, None, None, None)
    assert run(one, CFG, world()) == 0
    assert json.loads(capsys.readouterr().out)["schema_version"] == model.SCHEMA_VERSION


def test_table_text_names_the_columns(capsys: pytest.CaptureFixture[str]) -> None:
    p = ReportParams(None, False, None, None, None, "alice", states=("COMPLETED",))
    assert run(p, CFG, world()) == 0
    out = capsys.readouterr().out
    assert "MemEff" in out and "Saved GPU-h" in out and "Est. err" in out
    assert "13" in out and "30" not in out.split("MemEff")[1].split("jobs,")[0].split()[:1]


def test_several_ids_make_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    p = ReportParams("10", True, None, None, None, None, job_ids=("10", "13"))
    assert run(p, CFG, world()) == 0
    d = json.loads(capsys.readouterr().out)
    assert [j["job_id"] for j in d["table"]] == ["10", "13"]


# ------------------------------------------------------------------- array jobs ---

class _Slurm:
    """The adapter methods the SlurmInquirer uses, answering like sacct --json."""

    def __init__(self, recs: list[AccountingRecord], live: dict[int, SlurmJob]) -> None:
        self.recs, self.live, self.asked = recs, live, []  # type: list[str]

    def accounting(self, ids: list[str]) -> list[AccountingRecord]:
        self.asked += ids
        (j,) = ids
        if "_" in j:
            return [r for r in self.recs if r.fields["JobID"] == j]
        return [r for r in self.recs if r.job_id == j or r.fields["JobID"].startswith(j + "_")]

    def jobs(self) -> dict[int, SlurmJob]:
        return self.live

    def jobs_among(self, job_ids: Any) -> dict[int, SlurmJob]:
        return {j: v for j, v in self.live.items() if j in set(job_ids)}

    def show_job(self, job_id: str) -> dict[str, Any] | None:
        return None


def _rec(raw: str, shown: str, state: str, adminc: str = "") -> AccountingRecord:
    f = {"JobIDRaw": raw, "JobID": shown, "JobName": "arr", "User": "alice", "State": state,
         "ExitCode": "0:0", "Start": "2026-11-20T10:00:00", "End": "2026-11-20T10:01:00",
         "Elapsed": "00:01:00", "AdminComment": adminc, "Account": "lab", "Submit": "",
         "AllocTRES": "", "ReqTRES": "gres/shard=6", "NodeList": "n0", "Comment": ""}
    return AccountingRecord(raw, state, f)


def test_array_task_ids_are_resolved_by_asking_slurm(capsys: pytest.CaptureFixture[str]) -> None:
    slurm = _Slurm([_rec("130", "123_0", "COMPLETED", comment(COLLOCATED)),
                    _rec("123", "123_1", "COMPLETED", comment(OOM0, OOM1))], {})
    inq = SlurmInquirer(slurm, None)  # type: ignore[arg-type]
    assert inq.array_tasks("123") == ["123_0", "123_1"]
    rows = inq.job_rows("123_0")
    assert [r.job_id for r in rows] == ["130"] and rows[0].shown_id == "123_0"
    rep = job_report.build("123_0", inq, CFG)
    assert rep.job_id == "123_0" and rep.attempts[0].peak_mib == 2100
    # the array's own id: the table of its tasks
    assert run(ReportParams("123", True, None, None, None, None), CFG, inq) == 0
    d = json.loads(capsys.readouterr().out)
    assert [j["job_id"] for j in d["table"]] == ["123_0", "123_1"]
    assert d["table"][1]["ooms"] == 1 and d["table"][0]["account"] == "lab"


def test_running_array_task_is_found_in_the_controller() -> None:
    from dataclasses import fields

    base = {f.name: "" for f in fields(SlurmJob)}
    base.update(job_id=140, user_id=1000, restarts=0, gres_detail=(), exit_code=NO_EXIT,
                stdout=None, stderr=None, array_job_id=123, array_task_id=2, state="RUNNING",
                name="arr", admin_comment="colloc1:mode=explicit,need_mib=4096,shards=4,"
                "shard_mib=1024,alloc_mib=4096")
    job = SlurmJob(**base)  # type: ignore[arg-type]
    inq = SlurmInquirer(_Slurm([], {140: job}), None)  # type: ignore[arg-type]
    assert inq.array_tasks("123") == ["123_2"]
    live = inq.live("123_2")
    assert live is not None and live["JobId"] == "140"
    rep = job_report.build("123_2", inq, CFG)
    assert rep.running and rep.attempts[-1].limit_mib == 4096  # from the submit record


def test_colloc_report_dash_h_works_like_colloc_report_dash_h() -> None:
    for argv in (["-c", "from slurm_colloc.cli import report_main; report_main()", "-h"],
                 ["-c", "from slurm_colloc.cli import main; main()", "report", "-h"]):
        cp = subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                            timeout=60, check=False)
        assert cp.returncode == 0, cp.stderr
        assert "--user" in cp.stdout and "--account" in cp.stdout and "--state" in cp.stdout


def test_job_row_keeps_array_id_and_account() -> None:
    r = JobRow.from_fields(_rec("130", "123_4", "COMPLETED").fields)
    assert (r.job_id, r.shown_id, r.account) == ("130", "123_4", "lab")
