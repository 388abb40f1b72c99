"""Issue 23 item 1: no job can switch the node collector off.

Each test replays one way a user's job stopped enforcement for the whole node: a value
in its environment the collector could not parse, a file name it could not write, a
lock it could take. The collector must go on sampling (and enforcing) every other job.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu.backend import GpuBackendError
from slurm_colloc.metrics import enforce, store
from slurm_colloc.metrics.attribution import Attributor, restart_count, tag_of
from slurm_colloc.metrics.collector import Collector, serve
from tests.unit.conftest import Clock
from tests.unit.test_metrics_collector import make, register, spawn

HUGE = "7" * 5000  # past Python's int digit limit (4300): int() raises ValueError
LONG = "7" * 300  # parses, but series-777...7.tsv is too long a file name


@pytest.mark.parametrize("value,attempt", [
    ("2", 2), ("0", 0), ("9999", 9999), (HUGE, 0), (LONG, 0), ("10000", 0), ("-1", 0),
    ("+3", 0), (" 3", 0), ("3\n", 0), ("\u0663", 0), ("", 0), (None, 0), ("0x10", 0),
])
def test_restart_count_is_bounded_before_it_is_parsed(value: str | None, attempt: int) -> None:
    assert restart_count(value) == attempt


def test_huge_restart_count_in_a_jobs_environment_is_attempt_zero(
    procs: list[subprocess.Popen[bytes]],
) -> None:
    pid = spawn(procs, {"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": HUGE})
    tag = tag_of(pid)
    assert tag is not None and (tag.job_id, tag.attempt) == ("4242", 0)


def _meta(cfg: CollocConfig, job: int, gpu: int, limit: int) -> None:
    store.write_meta(cfg.metrics_dir, store.JobMeta(
        job_id=job, attempt=0, uid=os.getuid(), gpus=(gpu,), limit_mib=limit, shards=2))


@pytest.mark.parametrize("restarts", [HUGE, LONG])
def test_one_jobs_environment_does_not_stop_the_sample(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]], restarts: str
) -> None:
    """Live: 5,000 digits killed the collector (ValueError in int()); 300 digits made
    every step abort at the series file (name too long) before the next GPU."""
    cfg, backend, state = make(tmp_path)
    cfg = replace(cfg, enforce_over_limit="flag")
    bad = spawn(procs, {"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": restarts})
    over = spawn(procs, {"SLURM_JOB_ID": "43"})
    register(state, bad, 0, 1000)
    register(state, over, 1, 6000)  # on the GPU sampled after the attacker's
    _meta(cfg, 41, 0, 2048)
    _meta(cfg, 43, 1, 2048)
    clock = Clock(1_000_000.0)
    col = Collector(cfg, backend, clock=clock)
    for _ in range(3):
        seen = col.step()
        clock.t += 1
    col.close()
    assert seen.get(("43", 0)) == 6000
    v = enforce.verdict_for(cfg, 43, 0)
    assert v is not None and v.action == enforce.FLAGGED


class _Boom(Attributor):
    """An attribution that raises for one pid (any bug a process could trigger)."""

    def __init__(self, bad: int, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.bad = bad

    def identity(self, pid: int):  # type: ignore[no-untyped-def]
        if pid == self.bad:
            raise RuntimeError("a bug one process triggers")
        return super().identity(pid)


def test_a_process_that_breaks_attribution_is_skipped_not_fatal(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    cfg, backend, state = make(tmp_path)
    bad = spawn(procs, {"SLURM_JOB_ID": "51"})
    good = spawn(procs, {"SLURM_JOB_ID": "52"})
    register(state, bad, 0, 1000)
    register(state, good, 0, 3000)
    clock = Clock(1_000_000.0)
    col = Collector(cfg, backend, clock=clock, attributor=_Boom(bad))
    for _ in range(20):
        assert col.step() == {("52", 0): 3000}
        clock.t += 1
    col.close()
    errors = [r for r in caplog.records if "a bug one process triggers" in r.getMessage()
              or (r.exc_info and "a bug one process" in str(r.exc_info[1]))]
    assert 1 <= len(errors) <= 2, "logged once (rate limited), not 20 times"


def test_a_gpu_that_fails_does_not_stop_the_others(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """An exception on one GPU's rows (here: its series cannot be written) is that
    GPU's alone."""
    cfg, backend, state = make(tmp_path)
    a = spawn(procs, {"SLURM_JOB_ID": "61"})
    b = spawn(procs, {"SLURM_JOB_ID": "62"})
    register(state, a, 0, 1000)
    register(state, b, 1, 2000)
    # job 61's directory is a file: its series cannot be opened
    (Path(cfg.metrics_dir) / "jobs").mkdir(parents=True)
    (Path(cfg.metrics_dir) / "jobs" / "61").write_text("")
    col = Collector(cfg, backend, clock=Clock(1_000_000.0))
    seen = col.step()
    col.close()
    assert seen.get(("62", 0)) == 2000
    assert store.read_series(cfg.metrics_dir, 62, 0).rows


class _Flaky:
    """A backend that fails in ways the collector did not foresee, then works."""

    def __init__(self, real: object, errors: list[BaseException]) -> None:
        self.real = real
        self.errors = errors
        self.calls = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)

    def sample_all(self):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return self.real.sample_all()  # type: ignore[attr-defined]


def test_serve_survives_any_exception_of_a_step(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    cfg, backend, state = make(tmp_path)
    cfg = replace(cfg, sample_interval_s=0.05)
    pid = spawn(procs, {"SLURM_JOB_ID": "71"})
    register(state, pid, 0, 1000)
    flaky = _Flaky(backend, [ValueError("x"), RuntimeError("y"), GpuBackendError("z"),
                             OSError("w"), KeyError("k")])
    assert serve(cfg, flaky, max_seconds=1.0) == 0  # type: ignore[arg-type]
    assert flaky.calls > 5
    assert store.read_series(cfg.metrics_dir, 71, 0).rows


def test_restart_count_parse_never_raises_on_junk() -> None:
    for junk in ("\x00", "9" * 100_000, "\ufffd" * 10, "1e3", "1_000", "٣"):
        assert restart_count(junk) == 0


def test_step_survives_a_process_vanishing_mid_sample(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    cfg, backend, state = make(tmp_path)
    gone = spawn(procs, {"SLURM_JOB_ID": "81"})
    keep = spawn(procs, {"SLURM_JOB_ID": "82"})
    register(state, gone, 0, 1000)
    register(state, keep, 0, 1000)
    procs[0].kill()
    procs[0].wait()
    col = Collector(cfg, backend, clock=Clock(1_000_000.0))
    assert col.step().get(("82", 0)) == 1000
    col.close()



def test_an_unforeseen_error_in_the_gpu_order_costs_no_gpu(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slurm's GPU order is read once; an exception there other than the expected ones
    fell to every GPU of every step (the per-GPU guard) and sampled nothing."""
    from slurm_colloc.gpu import identity

    def broken(backend: object) -> object:
        raise RuntimeError("a driver oddity")

    monkeypatch.setattr(identity.GpuMap, "from_backend", staticmethod(broken))
    cfg, backend, state = make(tmp_path)
    pid = spawn(procs, {"SLURM_JOB_ID": "91"})
    register(state, pid, 1, 1000)
    col = Collector(cfg, backend, clock=Clock(1_000_000.0))
    assert col.step() == {("91", 0): 1000}
    assert col.step() == {("91", 0): 1000}
    col.close()


def test_a_malformed_restart_count_is_logged_once_per_process(
    procs: list[subprocess.Popen[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    pid = spawn(procs, {"SLURM_JOB_ID": "4243", "SLURM_RESTART_COUNT": HUGE})
    for _ in range(5):
        assert tag_of(pid) is not None
    lines = [r for r in caplog.records if f"process {pid}: SLURM_RESTART_COUNT" in r.getMessage()]
    assert len(lines) == 1 and "5000 characters" in lines[0].getMessage()
    assert HUGE not in lines[0].getMessage()
