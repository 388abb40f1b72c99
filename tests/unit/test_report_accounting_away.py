"""Issue 28 item 1: ``colloc-report`` while slurmdbd (or MariaDB) is away.

It used to stop with sacct's raw error. Now it builds the report from what it can
reach (the controller's view of the job, this node's store) and says in one line
that accounting is unreachable, and why."""

from __future__ import annotations

from typing import Any

import pytest
from rich.console import Console

from slurm_colloc.accounting import codec
from slurm_colloc.accounting.record import Attempt, JobRecord, OomInfo, Requeue
from slurm_colloc.config import CollocConfig
from slurm_colloc.report import job as job_report
from slurm_colloc.report import model, text
from slurm_colloc.report.inquirer import SlurmInquirer
from slurm_colloc.slurm.adapter import SlurmError

SACCT_ERR = ("sacct: error: slurm_persist_conn_open_without_init: failed to open persistent "
             "connection to host:localhost:6819: Connection refused\n"
             "sacct: error: Problem talking to the database: Connection refused")
RECORD = codec.encode(JobRecord(attempts=(
    Attempt(0, shards=4, oom=OomInfo("gpu-oom"), requeue=Requeue(True, "gpu-oom")),
    Attempt(1, shards=12))))


class AwayDbd:
    """slurmdbd down; the controller still has the job (MinJobAge) unless ``gone``."""

    def __init__(self, gone: bool = False) -> None:
        self.gone = gone

    def accounting(self, job_ids: Any) -> list[Any]:
        raise SlurmError(SACCT_ERR)

    def show_job(self, job_id: str) -> dict[str, Any] | None:
        if self.gone:
            return None
        return {"JobId": job_id, "JobName": "train", "UserId": "alice(1000)",
                "JobState": "COMPLETED", "Restarts": "1", "NodeList": "n1",
                "AdminComment": RECORD, "ExitCode": "0:0"}

    def jobs(self) -> dict[int, Any]:
        raise SlurmError("slurmctld: no answer")

    def jobs_among(self, job_ids: Any) -> dict[int, Any]:
        raise SlurmError("slurmctld: no answer")


def test_the_report_says_accounting_is_away_and_shows_the_controllers_view() -> None:
    rep = job_report.build("501", SlurmInquirer(AwayDbd(), None), CollocConfig())  # type: ignore[arg-type]
    assert rep.accounting is not None
    assert rep.accounting.startswith(
        "accounting unreachable: sacct: error: Problem talking to the database")
    assert "the controller's view of the job" in rep.accounting
    assert [a.attempt for a in rep.attempts] == [0, 1]  # from the live AdminComment
    assert rep.to_json()["accounting"] == rep.accounting
    console = Console(width=200, record=True)
    console.print(text.render(rep))
    out = console.export_text()
    assert "accounting unreachable: sacct: error: Problem talking" in out
    assert "persistent connection" not in out  # one line, not sacct's raw output


def test_a_job_only_accounting_knew_names_the_outage() -> None:
    with pytest.raises(model.UnknownJobError, match=r"accounting unreachable: .*Connection "
                       r"refused; the controller no longer has the job"):
        job_report.build("501", SlurmInquirer(AwayDbd(gone=True), None), CollocConfig())  # type: ignore[arg-type]


def test_accounting_that_answers_adds_no_line() -> None:
    class Up(AwayDbd):
        def accounting(self, job_ids: Any) -> list[Any]:
            return []

    rep = job_report.build("501", SlurmInquirer(Up(), None), CollocConfig())  # type: ignore[arg-type]
    assert rep.accounting is None
