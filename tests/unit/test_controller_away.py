"""Issue 28 item 3: a controller that does not answer is never "no jobs".

squeue/scontrol ``--json`` may exit 0 with an ``errors`` list and no jobs when
slurmctld is away (issue 28's fault runs): ``*-unreachable.json`` are each release's
captured document (meta, release) with that list and no jobs; those raise. (With
slurmctld stopped, 26.05's squeue exited 1 after 20 s instead, on stderr: the e2e
test checks that real answer.) The
prolog's wait for the controller is one budget (an injected clock) and its fallback
one log line; no other job's MPS registration is touched meanwhile.
"""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path
from typing import Any

import pytest

from slurm_colloc.mps.tenancy import Tenancy
from slurm_colloc.node import controller_wait, entry, prolog
from slurm_colloc.report.inquirer import SlurmInquirer
from slurm_colloc.slurm import adapter as ad
from slurm_colloc.slurm.squeue_json import SqueueJsonError, parse_job, parse_jobs

DATA = Path(__file__).parent / "data" / "slurm"
ENV = {"SLURM_JOB_ID": "7", "SLURM_JOB_UID": "1001", "SLURM_JOB_GPUS": "0",
       "SLURM_JOB_USER": "alice", "SLURMD_NODENAME": "n1"}


@pytest.fixture(params=("24.11", "26.05"))
def release(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _load(release: str, name: str) -> str:
    return (DATA / release / name).read_text()


class FakeTime:
    """monotonic() and sleep() of one fake clock: every Slurm call costs ``cost`` s."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


class FakeRun:
    """subprocess.run for the adapter: each call takes ``cost`` s of the fake clock."""

    def __init__(self, clock: FakeTime, out: str, cost: float = 5.0) -> None:
        self.clock, self.out, self.cost = clock, out, cost
        self.timeouts: list[float] = []

    def __call__(self, argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        self.timeouts.append(kw["timeout"])
        self.clock.now += min(self.cost, kw["timeout"])
        if self.cost > kw["timeout"]:
            raise subprocess.TimeoutExpired(argv, kw["timeout"])
        return subprocess.CompletedProcess(argv, 0, self.out, "")


def _cli(timeout: float = 20) -> ad.SlurmCli:
    return ad.SlurmCli(env={"PATH": "/usr/bin"}, bindir="/usr/bin", timeout=timeout)


# ------------------------------------------------------- errors, no jobs ---


def test_errors_with_no_jobs_raise_on_every_release(release: str) -> None:
    for tool, parse in (("squeue", parse_jobs), ("scontrol", lambda t: parse_job(t, 25))):
        text = _load(release, f"{tool}-unreachable.json")
        doc = json.loads(text)
        assert doc["jobs"] == [] and doc["errors"], "the fixture is the unreachable shape"
        assert doc["meta"]["slurm"]["release"].startswith(release)
        with pytest.raises(SqueueJsonError, match="Communication connection failure"):
            parse(text)


def test_the_adapter_raises_its_error_and_it_reads_as_away(
        release: str, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeTime()
    monkeypatch.setattr(ad.subprocess, "run",
                        FakeRun(clock, _load(release, "squeue-unreachable.json"), cost=0.1))
    with pytest.raises(ad.SlurmError) as e:
        _cli().jobs()
    assert controller_wait.controller_away(e.value)
    monkeypatch.setattr(ad.subprocess, "run",
                        FakeRun(clock, _load(release, "scontrol-unreachable.json"), cost=0.1))
    with pytest.raises(ad.SlurmError) as e:
        _cli().job(25)
    assert controller_wait.controller_away(e.value)


def test_an_error_entry_without_description_still_names_the_error() -> None:
    doc = {"jobs": [], "errors": [{"description": "", "error_number": 1007,
                                   "error": "Communication connection failure"}]}
    with pytest.raises(SqueueJsonError, match=r"reported: Communication connection failure$"):
        parse_jobs(json.dumps(doc))


@pytest.mark.parametrize(("msg", "away"), [
    ("squeue: timed out after 20s", True),
    ("scontrol: exit 1: slurm_load_jobs error: Unable to contact slurm controller "
     "(connect failure)", True),
    ("scontrol requeuehold 5: exit 1: Socket timed out on send/recv operation", True),
    # 24.11's scontrol requeuehold with slurmctld stopped (the e2e test, 24.11)
    ("/usr/bin/scontrol requeuehold 1: exit 1: Unexpected message received for job 1", True),
    ("scontrol requeuehold 5: exit 1: Invalid job id specified", False),
    ("squeue --json: job 12: job_id/user_id out of range", False),
])
def test_away_is_told_from_an_answer(msg: str, away: bool) -> None:
    assert controller_wait.controller_away(ad.SlurmError(msg)) is away


# ------------------------------------------------------------- the budget ---


def test_tries_share_one_budget_and_never_run_past_it() -> None:
    clock = FakeTime()
    budget = controller_wait.Budget(15, clock=clock.monotonic)
    timeouts: list[float] = []

    def call(t: float) -> None:
        timeouts.append(t)
        clock.now += min(t, 4.0)
        raise ad.SlurmError("Unable to contact slurm controller (connect failure)")

    with pytest.raises(controller_wait.Unanswered) as e:
        controller_wait.ask(call, budget, sleep=clock.sleep)
    assert budget.spent() <= 15.0
    assert e.value.tries == len(timeouts) == 3
    assert timeouts == sorted(timeouts, reverse=True) and timeouts[0] == 15
    assert all(t >= controller_wait.MIN_TRY_S for t in timeouts)
    assert "did not answer in" in str(e.value)


def test_a_controller_that_comes_back_within_the_budget_answers() -> None:
    clock = FakeTime()
    answers: list[Any] = [ad.SlurmError("Communication connection failure"), {"ok": 1}]

    def call(t: float) -> Any:
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    assert controller_wait.ask(call, controller_wait.Budget(15, clock=clock.monotonic),
                               sleep=clock.sleep) == {"ok": 1}


def test_an_answer_is_raised_at_once_not_retried() -> None:
    clock = FakeTime()
    calls: list[float] = []

    def call(t: float) -> None:
        calls.append(t)
        raise ad.SlurmError("squeue --json: no 'jobs' list in the answer")

    with pytest.raises(ad.SlurmError, match="no 'jobs' list"):
        controller_wait.ask(call, controller_wait.Budget(15, clock=clock.monotonic),
                            sleep=clock.sleep)
    assert len(calls) == 1


# ------------------------------------------------------------- the prolog ---


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    conf = tmp_path / "colloc.conf"
    conf.write_text(
        f'mps_root = "{tmp_path / "mps"}"\nlog_file = "{tmp_path / "colloc.log"}"\n'
        f'evidence_dir = "{tmp_path / "ev"}"\nmetrics_dir = "{tmp_path / "metrics"}"\n'
        f'gpu_backend = "sim"\nsim_state_dir = "{tmp_path / "sim"}"\n'
        "prolog_controller_s = 12\n")
    monkeypatch.setenv("COLLOC_CONF", str(conf))
    monkeypatch.setattr(entry, "_slurm", lambda env, timeout=20: _cli(timeout))
    lg = logging.getLogger("colloc.node.prolog")
    for h in list(lg.handlers):
        lg.removeHandler(h)
        h.close()
    clock = FakeTime()
    monkeypatch.setattr(controller_wait, "time", clock)
    return tmp_path, clock


@pytest.mark.parametrize("shape", ["errors", "hang"])
def test_prolog_fallback_is_one_line_bounded_and_touches_no_other_job(
        node: Any, release: str, monkeypatch: pytest.MonkeyPatch, shape: str) -> None:
    """squeue exits 0 with errors (a fast answer) or hangs (each try runs to its
    timeout): either way the prolog's whole wait is prolog_controller_s, its log says
    what the job runs without, and job 99's MPS registration stays."""
    tmp, clock = node
    tenancy = Tenancy(tmp / "mps")
    tenancy.add_job(0, 1002, 99)
    run = FakeRun(clock, _load(release, "squeue-unreachable.json"),
                  cost=0.5 if shape == "errors" else 1000)
    monkeypatch.setattr(ad.subprocess, "run", run)
    monkeypatch.setattr(prolog, "run", lambda *a: pytest.fail("prolog.run without the job"))
    start = clock.now
    assert entry.prolog_main(dict(ENV)) == 0
    assert clock.now - start <= 12.0
    assert len(run.timeouts) >= 1 and sum(min(t, run.cost) for t in run.timeouts) <= 12.0
    lines = [ln for ln in (tmp / "colloc.log").read_text().splitlines() if "job 7" in ln]
    assert len(lines) == 1, lines
    assert entry.PROLOG_WITHOUT in lines[0] and "did not answer in" in lines[0]
    assert "internal error" not in lines[0]
    assert tenancy.jobs_of(0, 1002) == [99]


def test_prolog_answer_that_is_not_unreachable_is_still_an_error(
        node: Any, release: str, monkeypatch: pytest.MonkeyPatch) -> None:
    tmp, clock = node
    monkeypatch.setattr(ad.subprocess, "run", FakeRun(clock, "{not json", cost=0.1))
    assert entry.prolog_main(dict(ENV)) == 0
    log = (tmp / "colloc.log").read_text()
    assert "internal error, job runs without MPS: SlurmError: squeue --json: not JSON" in log


# ------------------------------------------------------------- the report ---


class AwayAdapter:
    def jobs(self) -> dict[int, Any]:
        raise ad.SlurmError("squeue --json: the controller reported: Communication "
                            "connection failure")

    def jobs_among(self, job_ids: Any) -> dict[int, Any]:
        return self.jobs()

    def show_job(self, job_id: str) -> Any:
        raise ad.SlurmError("scontrol: timed out after 30s")

    def accounting(self, ids: Any) -> list[Any]:
        return []


def test_the_report_says_what_it_could_not_see() -> None:
    inq = SlurmInquirer(AwayAdapter(), None)  # type: ignore[arg-type]
    assert inq.live("5") is None
    assert inq.live("5_1") is None
    assert inq.array_tasks("5") == []
    w = inq.warnings()
    assert len(w) == 3 and all(x.startswith("slurmctld did not answer") for x in w)
