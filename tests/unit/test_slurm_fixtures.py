"""The parsers on what Slurm 24.11 and 26.05 really print (data_parser v0.0.42).

The fixtures are captured by ``tools/capture_slurm_fixtures.py`` in each release's
lab (``tests/unit/data/slurm/<release>/``, one job per file): the shapes 22.05 did not
have (state lists, exit code objects, shard ``used/total`` gres, numbers as objects)
are asserted here as typed values, for every release.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from slurm_colloc.slurm import adapter as ad
from slurm_colloc.slurm import sacct_json
from slurm_colloc.slurm.squeue_json import parse_job, parse_jobs

DATA = Path(__file__).parent / "data" / "slurm"
RELEASES = ("24.11", "26.05")


def _load(release: str, name: str) -> str:
    return (DATA / release / name).read_text()


def _ids(release: str) -> dict[str, int]:
    ids: dict[str, int] = json.loads(_load(release, "manifest.json"))["jobs"]
    return ids


def _job(release: str, tool: str, kind: str, base: str | None = None) -> Any:
    jid = _ids(release)[base or kind.split("-")[0]]
    job = parse_job(_load(release, f"{tool}-{kind}.json"), jid)
    assert job is not None and job.job_id == jid
    return job


def _sacct(release: str, kind: str) -> list[ad.AccountingRecord]:
    warnings: list[str] = []
    recs = sacct_json.parse(_load(release, f"sacct-{kind}.json"), warn=warnings.append)
    assert warnings == []  # every real record is read
    return ad.by_start(recs)


@pytest.fixture(params=RELEASES)
def release(request: pytest.FixtureRequest) -> str:
    assert (DATA / request.param / "manifest.json").exists(), request.param
    return str(request.param)


TOOLS = ("squeue", "scontrol")


@pytest.mark.parametrize("tool", TOOLS)
def test_the_fixtures_are_the_release_they_claim(release: str, tool: str) -> None:
    doc = json.loads(_load(release, f"{tool}-plain.json"))
    assert doc["meta"]["slurm"]["release"].startswith(release)
    assert doc["meta"]["plugin"]["data_parser"] == "data_parser/v0.0.42"


@pytest.mark.parametrize("tool", TOOLS)
def test_plain_and_failed_and_killed_jobs(release: str, tool: str) -> None:
    plain = _job(release, tool, "plain")
    assert plain.state == "COMPLETED" and plain.exit_status == (0, 0)
    assert plain.allocated_gpus is None and plain.restarts == 0 and plain.user_name == "root"
    assert plain.stdout is not None and plain.stdout.endswith(f"cap-plain-{plain.job_id}.out")
    failed = _job(release, tool, "failed")
    assert failed.state == "FAILED" and failed.exit_code.return_code == 3
    assert failed.exit_code.text == "3:0" and failed.exit_code.signal is None
    killed = _job(release, tool, "killed")  # the script's own kill -KILL $$
    assert killed.state == "FAILED" and killed.exit_status == (0, 9)
    assert killed.exit_code.signal_name == "KILL" and "SIGNALED" in killed.exit_code.status
    signalled = _job(release, tool, "signalled")  # scancel --signal=KILL
    assert signalled.state == "CANCELLED" and not signalled.active


@pytest.mark.parametrize("tool", TOOLS)
def test_a_shard_job_has_its_gpu_again(release: str, tool: str) -> None:
    """``shard:2(2/39,0/39,...)``: the GPU whose used count is > 0. None here would
    skip the prolog's check of slurmd's GPUs against the controller's."""
    job = _job(release, tool, "shard-running")
    assert job.state == "RUNNING" and job.active
    (detail,) = job.gres_detail
    per_gpu = re.fullmatch(r"shard:2\((.*)\)", detail)
    assert per_gpu is not None, detail
    used = [int(p.split("/")[0]) for p in per_gpu.group(1).split(",")]
    assert job.allocated_gpus == (used.index(2),)
    view = ad.scontrol_view(job)
    assert view["GRES"] == f"shard:2(IDX:{used.index(2)})" and view["JobState"] == "RUNNING"
    assert "shard" in job.tres_per_node


@pytest.mark.parametrize("tool", TOOLS)
def test_a_gpu_job_has_its_gpus(release: str, tool: str) -> None:
    job = _job(release, tool, "gpu2-running")
    m = re.fullmatch(r"gpu:(\d+)\(IDX:(\d+)-(\d+)\)", job.gres_detail[0])
    assert m is not None, job.gres_detail
    assert job.allocated_gpus == tuple(range(int(m.group(2)), int(m.group(3)) + 1))
    assert len(job.allocated_gpus) == int(m.group(1)) >= 2


@pytest.mark.parametrize("tool", TOOLS)
def test_requeued_jobs_on_the_controller(release: str, tool: str) -> None:
    now = _job(release, tool, "requeued_running-now")  # right after scontrol requeue
    assert now.job_state.base == "PENDING" and now.restarts == 1
    assert now.job_state.flags and now.state in now.job_state.flags
    assert now.active  # still completing the attempt: holds its resources
    for kind, base in (("requeued-pending", "requeued"),
                       ("requeued_running-pending", "requeued_running")):
        job = _job(release, tool, kind, base)
        assert job.state == "PENDING" and job.restarts == 1 and not job.active
    done = _job(release, tool, "requeued_running-done", "requeued_running")
    assert done.state == "COMPLETED" and done.restarts == 1


@pytest.mark.parametrize("tool", TOOLS)
def test_array_tasks_and_held_jobs(release: str, tool: str) -> None:
    jobs = parse_jobs(_load(release, f"{tool}-array.json"))
    master = _ids(release)["array"]
    assert len(jobs) == 3 and {j.array_job_id for j in jobs.values()} == {master}
    assert sorted(j.array_task_id for j in jobs.values()) == [0, 1, 2]  # type: ignore[type-var]
    held = _job(release, tool, "held-pending", "held")
    assert held.state == "PENDING" and held.reason == "JobHeldUser"
    assert held.exit_code.text in ("0:0", "")


def test_a_job_the_controller_does_not_hold_is_none(release: str) -> None:
    assert parse_job(_load(release, "scontrol-unknown.json"), 999999999) is None


def test_sacct_requeued_attempt_reads_requeued(release: str) -> None:
    """``state.current = ["PENDING", "REQUEUED"]`` is the attempt a requeue ended:
    REQUEUED, as sacct's text says (22.05's code read "PENDING")."""
    first, second = _sacct(release, "requeued_running-done")
    assert first.state == "REQUEUED" and first.fields["State"] == "REQUEUED"
    assert first.job_state is not None and first.job_state.base == "PENDING"
    assert first.job_state.flags == {"REQUEUED"}
    assert second.state == "COMPLETED" and first.job_id == second.job_id
    # a finished job requeued afterwards: 24.11 records its first attempt as requeued,
    # 26.05 keeps that attempt's own end state (both seen in the labs)
    first_state = {"24.11": "REQUEUED", "26.05": "COMPLETED"}[release]
    assert [r.state for r in _sacct(release, "requeued-done")] == [first_state, "COMPLETED"]


def test_sacct_exit_codes_keep_the_signal(release: str) -> None:
    (killed,) = _sacct(release, "killed")
    assert killed.state == "FAILED" and killed.exit_code == "0:9"
    assert killed.exit.signal == 9 and killed.exit.signal_name == "KILL"
    (failed,) = _sacct(release, "failed")
    assert failed.exit_code == "3:0" and failed.exit.return_code == 3


def test_sacct_tres(release: str) -> None:
    """``energy`` -2 (not gathered) is left out; ``mem`` is MiB without a unit."""
    (shard,) = _sacct(release, "shard")
    assert shard.alloc_tres["gres/shard"] == 2 and "energy" not in shard.alloc_tres
    assert shard.alloc_tres["mem"] == 256 and shard.alloc_tres["cpu"] >= 1
    assert "mem=256M" in shard.fields["AllocTRES"]
    assert "gres/shard=2" in shard.fields["AllocTRES"]
    assert "energy" not in shard.fields["AllocTRES"]
    (gpu,) = _sacct(release, "gpu2")
    assert gpu.alloc_tres["gres/gpu"] >= 2 and "gres/shard" not in gpu.alloc_tres


def test_sacct_array_ids_and_users(release: str) -> None:
    recs = _sacct(release, "array")
    master = _ids(release)["array"]
    assert sorted(r.fields["JobID"] for r in recs) == [f"{master}_{i}" for i in range(3)]
    assert {r.fields["User"] for r in recs} == {"root"}
    assert all(r.fields["Start"] != "Unknown" for r in recs)


# ------------------------------------------------------- the adapter's calls ---


class Fake:
    def __init__(self, out: str, rc: int = 0, err: str = "") -> None:
        self.out, self.rc, self.err = out, rc, err
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append(argv)
        return subprocess.CompletedProcess(argv, self.rc, self.out, self.err)


def _cli(monkeypatch: pytest.MonkeyPatch, fake: Fake) -> ad.SlurmCli:
    monkeypatch.setattr(ad.subprocess, "run", fake)
    return ad.SlurmCli(env={"PATH": "/usr/bin"}, bindir="/usr/bin")


def test_adapter_job_asks_scontrol_for_one_job(release: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    jid = _ids(release)["shard"]
    fake = Fake(_load(release, "scontrol-shard-running.json"))
    job = _cli(monkeypatch, fake).job(jid)
    assert job is not None and job.job_id == jid and job.allocated_gpus is not None
    assert fake.calls == [["/usr/bin/scontrol", ad.JSON_FLAG, "show", "job", str(jid)]]
    fake = Fake(_load(release, "scontrol-unknown.json"))
    assert _cli(monkeypatch, fake).job(999999999) is None
    assert _cli(monkeypatch, fake).show_job("12_3") is None  # not a controller id
    assert len(fake.calls) == 1


def test_adapter_job_errors_are_errors_not_no_job(release: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    doc = json.loads(_load(release, "scontrol-unknown.json"))
    doc["errors"] = [{"description": "Unable to contact slurm controller",
                      "error_number": 1007, "error": "Communication connection failure"}]
    with pytest.raises(ad.SlurmError, match="controller reported"):
        _cli(monkeypatch, Fake(json.dumps(doc))).job(5)
    with pytest.raises(ad.SlurmError, match="exit 1"):
        _cli(monkeypatch, Fake("", rc=1, err="slurm_load_jobs error: timeout")).job(5)
    with pytest.raises(ad.SlurmError, match="too large"):
        _cli(monkeypatch, Fake(" " * (65 << 20))).job(5)


def test_adapter_jobs_asks_for_finished_jobs_too(release: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """squeue hides finished jobs unless asked: the reaper must see them as finished,
    not as absent."""
    fake = Fake(_load(release, "squeue-failed.json"))
    jobs = _cli(monkeypatch, fake).jobs()
    assert [j.state for j in jobs.values()] == ["FAILED"]
    assert fake.calls[0][1:] == [ad.JSON_FLAG, "--states=all"]


def test_adapter_accounting_uses_the_pinned_data_parser(
        release: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = Fake(_load(release, "sacct-killed.json"))
    (rec,) = _cli(monkeypatch, fake).accounting([_ids(release)["killed"]])
    assert rec.exit_code == "0:9" and fake.calls[0][1] == ad.JSON_FLAG
    assert ad.job_state(_cli(monkeypatch, Fake(_load(release, "scontrol-unknown.json"))),
                        1) in ("UNKNOWN", "FAILED")


@pytest.mark.parametrize("tool", TOOLS)
def test_the_nice_value_is_read_signed(release: str, tool: str) -> None:
    """The report and the e2e recovery test read Nice from the JSON (issue 25 item 4):
    the real documents carry 0, and a boosted job's negative value stays negative."""
    jid = _ids(release)["requeued"]
    text = _load(release, f"{tool}-requeued-pending.json")
    assert parse_job(text, jid).nice == 0  # type: ignore[union-attr]
    doc = json.loads(text)
    for j in doc["jobs"]:
        j["nice"] = -10000
    job = parse_job(json.dumps(doc), jid)
    assert job is not None and job.nice == -10000
    assert ad.scontrol_view(job)["Nice"] == "-10000"
