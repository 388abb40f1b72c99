"""The prolog asks the controller only for the jobs it judges (issue 28).

``SlurmCli.jobs_among`` runs ``squeue --json --states=all --jobs=<ids>``. squeue
exits 1 when it holds none of the ids: those jobs are gone, never an error that
stops the prolog; an unanswered controller is still an error (never "gone"), and
the users' own fields in the answer never decide which.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from slurm_colloc.config import CollocConfig
from slurm_colloc.mps.tenancy import Tenancy
from slurm_colloc.node import controller_wait, entry
from slurm_colloc.slurm import adapter as ad

from .test_node_cov_entry import squeue_job

NONE_KNOWN = "slurm_load_jobs error: Invalid job id specified"


class Squeue:
    """subprocess.run answering squeue with (rc, stdout, stderr); records argv."""

    def __init__(self, rc: int, out: str, err: str = "") -> None:
        self.rc, self.out, self.err = rc, out, err
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append(argv)
        return subprocess.CompletedProcess(argv, self.rc, self.out, self.err)


def _cli(monkeypatch: pytest.MonkeyPatch, fake: Squeue) -> ad.SlurmCli:
    monkeypatch.setattr(ad.subprocess, "run", fake)
    return ad.SlurmCli(env={"PATH": "/usr/bin"}, bindir="/usr/bin")


def _doc(*jobs: dict[str, Any], errors: list[Any] | None = None) -> str:
    return json.dumps({"jobs": list(jobs), "errors": errors or []})


def test_it_asks_for_the_ids_only_and_returns_those(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = Squeue(0, _doc(squeue_job(), squeue_job(job_id=8)))
    got = _cli(monkeypatch, fake).jobs_among([8, 7, 7, "x", -3])  # type: ignore[list-item]
    assert sorted(got) == [7, 8]
    argv = fake.calls[0]
    assert argv[0] == "/usr/bin/squeue" and "--states=all" in argv and "--jobs=7,8" in argv
    assert ad.JSON_FLAG in argv


def test_no_ids_asks_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = Squeue(0, _doc())
    assert _cli(monkeypatch, fake).jobs_among([]) == {}
    assert fake.calls == []


@pytest.mark.parametrize(("rc", "out", "err"), [
    (1, "", NONE_KNOWN),
    (1, _doc(errors=[{"description": "Invalid job id specified", "error": ""}]), ""),
    (1, _doc(errors=[{"description": "", "error": "Invalid job id specified"}]), NONE_KNOWN),
], ids=["stderr", "json-errors", "both"])
def test_none_known_is_gone_not_an_error(monkeypatch: pytest.MonkeyPatch, rc: int, out: str,
                                         err: str) -> None:
    assert _cli(monkeypatch, Squeue(rc, out, err)).jobs_among([7, 8]) == {}


def test_several_unknown_is_an_empty_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """26.05, measured: several unknown ids: exit 0, no jobs, a warning."""
    out = json.dumps({"jobs": [], "errors": [],
                      "warnings": [{"description": "Zero jobs to dump", "source": ""}]})
    assert _cli(monkeypatch, Squeue(0, out)).jobs_among([999998, 999999]) == {}


def test_some_known_with_an_error_entry_for_the_others(
        monkeypatch: pytest.MonkeyPatch) -> None:
    out = _doc(squeue_job(), errors=[{"description": "Invalid job id specified"}])
    assert list(_cli(monkeypatch, Squeue(0, out)).jobs_among([7, 8])) == [7]


@pytest.mark.parametrize(("rc", "out", "err"), [
    (1, "", "slurm_load_jobs error: Unable to contact slurm controller (connect failure)"),
    (0, _doc(errors=[{"description": "", "error": "Communication connection failure"}]), ""),
    (1, "", ""),
    (1, _doc(errors=[{"description": "Invalid job id specified"},
                     {"error": "Communication connection failure"}]), ""),
], ids=["away-stderr", "away-json", "silent", "mixed"])
def test_an_unanswered_controller_stays_an_error(monkeypatch: pytest.MonkeyPatch, rc: int,
                                                 out: str, err: str) -> None:
    with pytest.raises(ad.SlurmError) as e:
        _cli(monkeypatch, Squeue(rc, out, err)).jobs_among([7])
    if err or "Communication" in out:
        assert controller_wait.controller_away(e.value)


def test_a_users_fields_never_make_an_error_read_as_gone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A job name or comment saying "Invalid job id specified" next to a controller
    error: the error stands (only stderr and the errors list are read)."""
    out = _doc(squeue_job(name="Invalid job id specified",
                          comment="Invalid job id specified"),
               errors=[{"error": "Communication connection failure"}])
    with pytest.raises(ad.SlurmError, match="Communication connection failure"):
        _cli(monkeypatch, Squeue(1, out, "")).jobs_among([7])


def test_not_json_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ad.SlurmError, match="not JSON"):
        _cli(monkeypatch, Squeue(0, "{nope")).jobs_among([7])


def test_the_default_reads_jobs() -> None:
    class Only(ad.SlurmAdapter):  # the abstract adapter's default
        def jobs(self) -> dict[int, Any]:
            return {7: "a", 8: "b", 9: "c"}

    Only.__abstractmethods__ = frozenset()
    assert Only().jobs_among([9, 7, 1]) == {7: "a", 9: "c"}  # type: ignore[abstract]


def test_the_prolog_judges_its_own_job_and_its_gpus_registered_ones(tmp_path: Path) -> None:
    cfg = CollocConfig(mps_root=str(tmp_path / "mps"))
    t = Tenancy(tmp_path / "mps")
    t.add_job(0, 1001, 3)
    t.add_job(0, 1002, 4)
    t.add_job(1, 1001, 5)
    t.add_job(2, 1001, 6)
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_UID": "1001", "SLURM_JOB_GPUS": "0,2"}
    assert entry.judged_jobs(env, cfg) == [3, 4, 6, 7]
    assert entry.judged_jobs({**env, "SLURM_JOB_GPUS": "1"}, cfg) == [5, 7]
    assert entry.judged_jobs({**env, "SLURM_JOB_GPUS": "zz"}, cfg) == [3, 4, 5, 6, 7]
    empty = CollocConfig(mps_root=str(tmp_path / "none"))
    assert entry.judged_jobs(env, empty) == [7]
