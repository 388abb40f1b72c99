"""The Slurm CLI adapter's parsing, with subprocess replaced by recorded outputs."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from slurm_colloc.slurm import adapter as ad

from .slurm_shapes import v42_job

SHOW_JOB = (
    "JobId=42 JobName=train UserId=alice(1001) GroupId=alice(1001) Priority=1 "
    "JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 "
    "Command=/home/alice/run me.sh WorkDir=/home/alice/my dir TresPerNode=gres:shard:12 "
    "AdminComment=cl1.abc GRES=shard:12(IDX:3)"
)

SACCT_JSON = json.dumps({"jobs": [  # sacct --json=v0.0.42 (24.11 through 26.05), trimmed
    {"job_id": 42, "name": "train", "user": "alice",
     "state": {"current": ["PENDING", "REQUEUED"]},
     "comment": {"administrator": None}, "time": {"start": 1795000005}},
    {"job_id": 42, "name": "train", "user": "alice", "state": {"current": ["COMPLETED"]},
     "comment": {"administrator": "cl1.x"}, "time": {"start": 1795000105}},
]})


class FakeRun:
    def __init__(self, outputs: dict[str, tuple[int, str, str]]) -> None:
        self.outputs = outputs
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append(argv)
        tool = argv[0].rsplit("/", 1)[-1]
        rc, out, err = self.outputs[tool]
        return subprocess.CompletedProcess(argv, rc, out, err)


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch) -> tuple[ad.SlurmCli, FakeRun]:
    fake = FakeRun(
        {
            "scontrol": (0, SHOW_JOB + "\n", ""),
            "sbatch": (0, "123;colloc\n", ""),
            "sacct": (0, SACCT_JSON, ""),
        }
    )
    monkeypatch.setattr(ad.subprocess, "run", fake)
    return ad.SlurmCli(env={"PATH": "/usr/bin"}, bindir="/usr/bin"), fake


SQUEUE_JSON = json.dumps({"jobs": [v42_job(  # squeue/scontrol --json=v0.0.42, trimmed
    {"job_id": 42, "user_id": 1001, "user_name": "alice", "name": "train",
     "job_state": "RUNNING", "restart_cnt": 0, "tres_per_node": "gres/shard:12",
     "gres_detail": ["shard:12(0/39,0/39,0/39,12/39)"], "admin_comment": "cl1.abc",
     "comment": "x AdminComment=colloc1:mode=whole GRES=gpu:4(IDX:0-3)",
     "standard_output": "/home/alice/my dir/42.out", "standard_error": "",
     "current_working_directory": "/home/alice/my dir", "exit_code": 256})]})


def test_show_job_comes_from_json_not_scontrol_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeRun({"scontrol": (0, SQUEUE_JSON, "")})
    monkeypatch.setattr(ad.subprocess, "run", fake)
    job = ad.SlurmCli(bindir="/usr/bin").show_job(42)
    assert job is not None
    assert job["GRES"] == "shard:12(IDX:3)" and job["AdminComment"] == "cl1.abc"
    assert job["StdOut"] == "/home/alice/my dir/42.out" and job["ExitCode"] == "1:0"
    assert job["JobState"] == "RUNNING"
    assert fake.calls == [["/usr/bin/scontrol", ad.JSON_FLAG, "show", "job", "42"]]


def test_submit_parses_cluster_suffix(cli: tuple[ad.SlurmCli, FakeRun]) -> None:
    adapter, fake = cli
    assert adapter.submit("#!/bin/sh\ntrue\n", ["--gres=gpu:1"]) == 123
    assert fake.calls[-1][:3] == ["/usr/bin/sbatch", "--parsable", "--gres=gpu:1"]


def test_accounting_keeps_every_attempt(cli: tuple[ad.SlurmCli, FakeRun]) -> None:
    adapter, _ = cli
    recs = adapter.accounting([42])
    assert [r.state for r in recs] == ["REQUEUED", "COMPLETED"]
    assert recs[1].fields["AdminComment"] == "cl1.x"


def test_failures_carry_the_command_and_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        ad.subprocess, "run", FakeRun({"scontrol": (1, "", "slurm_update error: Job has already finished")})
    )
    with pytest.raises(ad.SlurmError, match="Job has already finished"):
        ad.SlurmCli(bindir="/usr/bin").update_job(7, AdminComment="x")


def test_unknown_job_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ad.subprocess, "run", FakeRun({"scontrol": (0, SQUEUE_JSON, "")}))
    assert ad.SlurmCli(bindir="/usr/bin").show_job(99) is None


def test_a_broken_squeue_answer_is_an_error_not_no_jobs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reaper must never read 'could not ask' as 'every job is gone'."""
    monkeypatch.setattr(ad.subprocess, "run", FakeRun({"squeue": (0, "<html>", "")}))
    with pytest.raises(ad.SlurmError, match="not JSON"):
        ad.SlurmCli(bindir="/usr/bin").jobs()


def test_missing_tool_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ad.SlurmError, match="sacct: not found"):
        ad.SlurmCli(env={"PATH": "/nonexistent"}).accounting([1])


def test_attempts_are_ordered_by_start_not_by_sacct_order() -> None:
    newest = ad.AccountingRecord("24", "COMPLETED", {"Start": "2026-11-22T08:49:10"})
    oldest = ad.AccountingRecord("24", "REQUEUED", {"Start": "2026-11-22T08:42:30"})
    pending = ad.AccountingRecord("24", "PENDING", {"Start": "Unknown"})
    assert [r.state for r in ad.by_start([newest, pending, oldest])] == [
        "REQUEUED", "COMPLETED", "PENDING"]
