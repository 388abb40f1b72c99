"""Issue 28: a worker whose supervisor is SIGKILLed starts a new collector, then exits.

Before, the orphaned worker just exited and nothing sampled or enforced until the next
GPU job's prolog (82 s measured; unbounded with no new job). The decision is pure
(:func:`slurm_colloc.metrics.spawn.respawn_decision`); the last test runs the real
pair in ``tmp_path`` and kills its supervisor.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest

from slurm_colloc.metrics import collector, liveness, spawn
from tests.unit.test_metrics_collector import make

PARENT = 4242


@pytest.mark.parametrize(("parent", "ppid", "stopping", "env", "left", "want"), [
    (PARENT, PARENT, False, {}, None, "run"),          # its supervisor lives
    (None, 1, False, {}, None, "run"),                 # --no-supervisor: no parent to lose
    (PARENT, 1, True, {}, None, "run"),                # SIGTERM: a meant stop, no respawn
    (PARENT, 1, False, {}, None, "respawn"),           # supervisor killed: hand over
    (PARENT, 77, False, {}, 30.0, "respawn"),          # reparented to a subreaper, time left
    (PARENT, 1, False, {"INVOCATION_ID": "ab12"}, None, "exit"),  # systemd restarts the unit
    (PARENT, 1, False, {}, 0.5, "exit"),               # its --seconds are (nearly) up
])
def test_the_respawn_decision(parent: int | None, ppid: int, stopping: bool,
                              env: dict[str, str], left: float | None, want: str) -> None:
    assert spawn.respawn_decision(parent=parent, ppid=ppid, stopping=stopping, env=env,
                                  seconds_left=left) == want


def test_the_new_supervisor_keeps_the_old_ones_flags() -> None:
    assert spawn.supervisor_args(conf=None, stay=False, seconds_left=None) == []
    assert spawn.supervisor_args(conf="/etc/c.conf", stay=True, seconds_left=12.34) == [
        "--conf", "/etc/c.conf", "--stay", "--seconds", "12.3"]
    assert spawn.supervisor_args(conf=None, stay=False, seconds_left=-3) == [
        "--seconds", f"{spawn.MIN_SECONDS_LEFT:.1f}"]


def test_the_detached_start_passes_only_a_fixed_path_and_the_configs() -> None:
    env = spawn.collector_env({"PATH": "/home/u/bin", "COLLOC_CONF": "/c", "SLURM_CONF": "/s",
                               "LD_PRELOAD": "/x.so", "INVOCATION_ID": "x"})
    assert env == {"PATH": spawn.PATH, "COLLOC_CONF": "/c", "SLURM_CONF": "/s"}
    assert not spawn.under_systemd(env)  # a respawned collector is never taken for systemd's


def test_hand_over_records_the_gap_and_starts_a_supervisor(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics"
    liveness.open_private_dir(metrics, create=True)
    started: list[tuple[dict[str, str], list[str]]] = []

    def fake(env: Mapping[str, str], args: Sequence[str]) -> None:
        started.append((dict(env), list(args)))

    assert spawn.hand_over(str(metrics), PARENT, ["--stay"], env={"COLLOC_CONF": "/c"},
                           spawn=fake)
    assert started == [({"COLLOC_CONF": "/c"}, ["--stay"])]
    ev = liveness.read_events(metrics)
    assert [e.kind for e in ev] == ["down"] and ev[0].pid == os.getpid()
    assert f"supervisor {PARENT} gone" in ev[0].detail


def test_a_failed_start_is_logged_not_raised(tmp_path: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    def broken(env: Mapping[str, str], args: Sequence[str]) -> None:
        raise OSError("fork: no memory")

    assert not spawn.hand_over(str(tmp_path / "metrics"), PARENT, [], env={}, spawn=broken)
    assert "cannot start a new collector" in caplog.text


def test_serve_stops_before_sampling_when_orphaned(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A pid that is not our parent: :data:`collector.ORPHANED` (the caller hands over);
    under systemd a plain 0 (systemd restarts the unit)."""
    cfg, backend, _ = make(tmp_path)
    monkeypatch.delenv("INVOCATION_ID", raising=False)
    assert collector.serve(cfg, backend, parent=os.getppid() + 1) == collector.ORPHANED
    monkeypatch.setenv("INVOCATION_ID", "ab12")
    assert collector.serve(cfg, backend, parent=os.getppid() + 1) == 0


# ------------------------------------------------------------- real processes ---


def _wait(pred: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _collectors(conf: Path) -> list[int]:
    """Live processes of this test's collector (their environment names our conf)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
            env = (d / "environ").read_bytes()
        except OSError:
            continue
        if b"slurm_colloc.metrics.collector" in cmd and str(conf).encode() in env \
                and _alive(int(d.name)):
            out.append(int(d.name))
    return out


def _conf(tmp_path: Path) -> tuple[Path, Path, Path]:
    cfg, _backend, _state = make(tmp_path)
    logf = tmp_path / "colloc.log"
    conf = tmp_path / "colloc.conf"
    conf.write_text(f'gpu_backend = "sim"\nsim_state_dir = "{cfg.sim_state_dir}"\n'
                    f'metrics_dir = "{cfg.metrics_dir}"\nlog_file = "{logf}"\n'
                    f'mps_root = "{tmp_path / "mps"}"\nsample_interval_s = 0.2\n'
                    f'evidence_dir = "{tmp_path / "evidence"}"\n'
                    "collector_idle_exit_s = 600\n")
    return conf, Path(cfg.metrics_dir), logf


def _stop_all(conf: Path) -> None:
    for pid in _collectors(conf):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def test_a_killed_supervisor_is_replaced_by_its_worker(tmp_path: Path) -> None:
    conf, metrics, logf = _conf(tmp_path)
    env = {"PATH": os.environ["PATH"], "COLLOC_CONF": str(conf)}
    first = subprocess.Popen([sys.executable, "-m", "slurm_colloc.metrics.collector"], env=env,
                             cwd=str(Path(__file__).resolve().parents[2]))
    try:
        _wait(lambda: liveness.read_pids(metrics)[1] is not None
              and liveness.heartbeat_age(metrics) is not None)
        sup, worker = liveness.read_pids(metrics)
        assert sup == first.pid and worker is not None
        t0 = time.time()
        first.kill()
        first.wait()
        _wait(lambda: liveness.read_pids(metrics)[0] not in (None, sup)
              and liveness.read_pids(metrics)[1] is not None)
        _wait(lambda: (liveness.heartbeat_age(metrics) or 99) < time.time() - t0)
        took = time.time() - t0
        assert took < 10, took
        assert liveness.collector_running(metrics)
        _wait(lambda: not _alive(worker))  # the orphan is gone: one pair samples
        new_sup, _new_worker = liveness.read_pids(metrics)
        assert new_sup is not None and len(_collectors(conf)) == 2
        os.kill(new_sup, signal.SIGTERM)  # a meant stop: no respawn
        _wait(lambda: not _collectors(conf))
        time.sleep(1.0)
        assert not _collectors(conf) and not liveness.collector_running(metrics)
    finally:
        _stop_all(conf)
    kinds = [e.kind for e in liveness.read_events(metrics)]
    assert kinds == ["up", "down", "up", "stop"], kinds
    down = liveness.read_events(metrics)[1]
    assert down.pid == worker and f"supervisor {sup} gone" in down.detail
    assert "starts a new one" in logf.read_text()
