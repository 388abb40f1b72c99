"""Issue 23 item 1: a collector that dies is restarted promptly and visibly.

The supervisor restarts a worker that exits with an error, is killed, or stops
completing samples; each death is logged with its cause (the traceback in root's log)
and recorded in the events file, from which ``doctor`` and the report tell when the
node ran without enforcement.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from slurm_colloc.metrics import liveness
from slurm_colloc.metrics.supervisor import Supervisor, describe_exit
from tests.unit.test_metrics_collector import make

FLAKY = r"""
import os, sys
from pathlib import Path
runs = Path(sys.argv[1])
n = int(runs.read_text()) if runs.exists() else 0
runs.write_text(str(n + 1))
if n == 0:
    raise RuntimeError("the first run dies")
if n == 1:
    os.kill(os.getpid(), 9)
sys.exit(0)
"""


def _kinds(metrics: Path) -> list[str]:
    return [e.kind for e in liveness.read_events(metrics)]


def test_a_worker_that_dies_is_restarted_and_each_death_is_recorded(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics"
    fd = liveness.acquire_lock(metrics)
    assert fd is not None
    logf = tmp_path / "colloc.log"
    sup = Supervisor(str(metrics), [sys.executable, "-c", FLAKY, str(tmp_path / "runs")],
                     log_file=str(logf), backoff=(0.05,), poll_s=0.05)
    t0 = time.monotonic()
    assert sup.run() == 0
    assert time.monotonic() - t0 < 10
    os.close(fd)
    assert (tmp_path / "runs").read_text() == "3"
    assert _kinds(metrics) == ["up", "down", "up", "down", "up", "stop"]
    ev = liveness.read_events(metrics)
    assert ev[1].detail == "exit 1" and ev[3].detail == "signal 9 (SIGKILL)"
    assert ev[2].detail == "restart" and ev[5].detail == "idle"
    log = logf.read_text()
    assert "Traceback" in log and "the first run dies" in log  # the worker's stderr
    assert os.stat(metrics / liveness.EVENTS).st_mode & 0o777 == 0o644


def test_a_worker_that_stops_sampling_is_killed_and_restarted(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics"
    runs = tmp_path / "runs"
    hang = ("import sys, time\nfrom pathlib import Path\nr = Path(sys.argv[1])\n"
            "n = int(r.read_text()) if r.exists() else 0\nr.write_text(str(n + 1))\n"
            "time.sleep(60 if n == 0 else 0)\n")
    sup = Supervisor(str(metrics), [sys.executable, "-c", hang, str(runs)], stall_s=0.5,
                     backoff=(0.05,), poll_s=0.05)
    liveness.open_private_dir(metrics, create=True)
    t0 = time.monotonic()
    assert sup.run() == 0
    assert time.monotonic() - t0 < 10
    assert _kinds(metrics) == ["up", "stalled", "up", "stop"]


def test_backoff_grows_and_is_capped(tmp_path: Path) -> None:
    sup = Supervisor(str(tmp_path), ["true"], backoff=(0.01, 0.02))
    t0 = time.monotonic()
    sup._pause(5)  # past the table: the last (largest) delay
    assert 0.015 < time.monotonic() - t0 < 1
    assert describe_exit(-15) == "signal 15 (SIGTERM)" and describe_exit(3) == "exit 3"


def _wait(pred, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_the_real_collector_worker_is_restarted_after_sigkill(tmp_path: Path) -> None:
    """The process the prolog starts: kill its worker, a new one samples again."""
    cfg, _backend, _state = make(tmp_path)
    logf = tmp_path / "colloc.log"
    conf = tmp_path / "colloc.conf"
    conf.write_text(f'gpu_backend = "sim"\nsim_state_dir = "{cfg.sim_state_dir}"\n'
                    f'metrics_dir = "{cfg.metrics_dir}"\nlog_file = "{logf}"\n'
                    f'mps_root = "{tmp_path / "mps"}"\nsample_interval_s = 0.2\n'
                    "collector_idle_exit_s = 600\n")
    metrics = Path(cfg.metrics_dir)
    env = {"PATH": os.environ["PATH"], "COLLOC_CONF": str(conf)}
    sup = subprocess.Popen([sys.executable, "-m", "slurm_colloc.metrics.collector"], env=env,
                           cwd=str(Path(__file__).resolve().parents[2]))
    try:
        _wait(lambda: liveness.read_pids(metrics)[1] is not None
              and liveness.heartbeat_age(metrics) is not None)
        first = liveness.read_pids(metrics)[1]
        assert first is not None and liveness.collector_running(metrics)
        os.kill(first, signal.SIGKILL)
        _wait(lambda: liveness.read_pids(metrics)[1] not in (None, first))
        beat = os.stat(metrics / liveness.PRIVATE_DIR / liveness.HEARTBEAT).st_mtime
        _wait(lambda: os.stat(metrics / liveness.PRIVATE_DIR / liveness.HEARTBEAT).st_mtime
              > beat)  # the new worker samples
        assert liveness.collector_running(metrics)
    finally:
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(20) == 0
    kinds = _kinds(metrics)
    assert kinds[:3] == ["up", "down", "up"] and kinds[-1] == "stop", kinds
    assert "signal 9" in liveness.read_events(metrics)[1].detail
    assert not liveness.collector_running(metrics)
    assert "died (signal 9 (SIGKILL))" in logf.read_text()


def test_a_worker_exception_is_logged_with_its_traceback(tmp_path: Path) -> None:
    """Nothing goes to /dev/null: the worker's last exception reaches root's log and
    the events file names it."""
    cfg, _b, _s = make(tmp_path)
    logf = tmp_path / "colloc.log"
    conf = tmp_path / "colloc.conf"
    conf.write_text(f'gpu_backend = "sim"\nsim_state_dir = "{tmp_path / "no-such-state"}"\n'
                    f'metrics_dir = "{cfg.metrics_dir}"\nlog_file = "{logf}"\n')
    metrics = Path(cfg.metrics_dir)
    env = {"PATH": os.environ["PATH"], "COLLOC_CONF": str(conf)}
    sup = subprocess.Popen([sys.executable, "-m", "slurm_colloc.metrics.collector"], env=env,
                           cwd=str(Path(__file__).resolve().parents[2]))
    try:
        _wait(lambda: "down" in _kinds(metrics))
    finally:
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(20) == 0
    down = next(e for e in liveness.read_events(metrics) if e.kind == "down")
    assert down.detail.startswith("exit 1: "), down
    assert "collector worker failed" in logf.read_text() and "Traceback" in logf.read_text()


def test_a_collector_gone_without_a_word_is_closed_by_the_next(tmp_path: Path) -> None:
    """Its supervisor was SIGKILLed: the next one records the end at the last sample."""
    metrics = tmp_path / "metrics"
    hb = liveness.Heartbeat(metrics)
    hb.beat()
    hb.close()
    beat = os.stat(metrics / liveness.PRIVATE_DIR / liveness.HEARTBEAT).st_mtime
    liveness.append_event(metrics, liveness.UP, 11, now=beat - 40)
    liveness.append_event(metrics, liveness.ALIVE, 11, now=beat - 10)
    sup = Supervisor(str(metrics), [sys.executable, "-c", "pass"], poll_s=0.05)
    assert sup.run() == 0
    ev = liveness.read_events(metrics)
    assert [e.kind for e in ev] == ["up", "alive", "down", "up", "stop"]
    assert abs(ev[2].t - beat) < 0.2 and "without a stop" in ev[2].detail
    gap = liveness.gaps(ev, beat - 40, ev[3].t + 1, now=ev[3].t + 1)
    assert gap is not None and (not gap or gap[0][0] == ev[2].t)
