"""The collector's systemd unit (issue 26 item 4): what ships, what `colloc admin
collector-unit` prints and installs, the prolog's start decision (systemd, else the
detached start), the doctor's check of the unit, and ``--stay`` (no idle exit)."""

from __future__ import annotations

import configparser
import logging
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_colloc import config as config_mod
from slurm_colloc.cli import main as cli
from slurm_colloc.config import CollocConfig, ConfigError
from slurm_colloc.metrics.collector import _lock, serve
from slurm_colloc.node import collector_start as cs
from slurm_colloc.site import collector_unit as unit
from slurm_colloc.site.doctor_collector import check_collector_unit


def _parse(text: str) -> configparser.ConfigParser:
    p = configparser.ConfigParser(strict=True, interpolation=None)
    p.optionxform = str  # type: ignore[assignment,method-assign]
    p.read_string(text)
    return p


# ------------------------------------------------------------------ the unit ---


def test_the_fallback_lands_in_the_prolog_log() -> None:
    prolog = logging.getLogger("colloc.node.prolog")
    assert cs.log.parent is prolog


def test_the_rendered_unit_runs_this_install_and_always_restarts() -> None:
    u = _parse(unit.render(python="/opt/colloc/bin/python", conf="/etc/slurm/colloc.conf"))
    svc = u["Service"]
    assert svc["Type"] == "simple"
    assert svc["ExecStart"] == "/opt/colloc/bin/python -I -m slurm_colloc.metrics.collector --stay"
    # always, within a second: a SIGKILLed supervisor (exit by signal) counts too (issue 28)
    assert svc["Restart"] == "always" and svc["RestartSec"] == "1"
    assert svc["StandardError"] == "journal"
    assert "Environment" not in svc  # the default conf needs none
    for breaks_nvml in ("PrivateDevices", "DevicePolicy", "DeviceAllow", "ProtectClock",
                        "PrivateTmp", "ProtectProc", "CapabilityBoundingSet", "User"):
        assert breaks_nvml not in svc
    assert svc["NoNewPrivileges"] == "yes" and svc["ProtectSystem"] == "full"
    assert u["Install"]["WantedBy"] == "multi-user.target"
    assert "@" not in unit.render(python="/p/python")  # every hole filled


def test_a_non_default_conf_goes_into_the_unit_and_odd_paths_are_refused() -> None:
    u = _parse(unit.render(python="/p/python", conf="/srv/colloc.conf"))
    assert u["Service"]["Environment"] == "COLLOC_CONF=/srv/colloc.conf"
    for bad in ("/p/my python", "/p/$x", "/p/a;b", "/p/a\nExecStartPre=/bin/sh"):
        with pytest.raises(ValueError):
            unit.render(python=bad)


def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    """systemd's own check where systemd-analyze exists (the host; the Debian 26.05
    rootfs has no systemd); elsewhere the shipped template must still parse."""
    path = unit.install(tmp_path)
    assert path.stat().st_mode & 0o777 == 0o644
    assert path.read_text() == unit.render()
    tool = shutil.which("systemd-analyze")
    if tool is None:
        assert _parse(unit.template())["Service"]["Restart"] == "always"
        return
    r = subprocess.run([tool, "verify", str(path)], capture_output=True, text=True,
                       timeout=60, check=False)
    assert r.returncode == 0, r.stderr


def test_admin_collector_unit_prints_and_installs(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("COLLOC_CONF", raising=False)
    r = CliRunner().invoke(cli, ["admin", "collector-unit"])
    assert r.exit_code == 0, r.output
    assert f"ExecStart={sys.executable} -I -m slurm_colloc.metrics.collector --stay" in r.output
    r = CliRunner().invoke(cli, ["admin", "collector-unit", "--install",
                                 "--unit-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert (tmp_path / unit.UNIT_NAME).read_text() == unit.render()
    assert 'collector_unit = "colloc-collector.service"' in r.output
    r = CliRunner().invoke(cli, ["admin", "collector-unit", "--install",
                                 "--unit-dir", str(tmp_path / "missing")])
    assert r.exit_code != 0 and "not written" in r.output


# ---------------------------------------------------------------- the config ---


@pytest.mark.parametrize("name", ["colloc-collector.service", "colloc@gpu0.service"])
def test_collector_unit_accepts_service_names(tmp_path: Path, name: str) -> None:
    f = tmp_path / "c.conf"
    f.write_text(f'collector_unit = "{name}"\n')
    assert config_mod.load(f).collector_unit == name


@pytest.mark.parametrize("name", ["--now.service", "colloc", "a b.service", "/etc/x.service",
                                  "x.timer"])
def test_collector_unit_refuses_what_is_not_a_service_name(tmp_path: Path, name: str) -> None:
    f = tmp_path / "c.conf"
    f.write_text(f'collector_unit = "{name}"\n')
    with pytest.raises(ConfigError, match="collector_unit"):
        config_mod.load(f)


# ------------------------------------------------------- the prolog's decision ---


class FakeSystemctl:
    def __init__(self, rc: int, err: str = "") -> None:
        self.rc, self.err = rc, err
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str]) -> tuple[int, str]:
        self.calls.append(list(argv))
        return self.rc, self.err


def test_no_unit_configured_starts_detached_and_asks_nobody() -> None:
    spawned: list[int] = []
    ctl = FakeSystemctl(0)
    got = cs.start_collector("", lambda: spawned.append(1), systemctl="/usr/bin/systemctl",
                             run=ctl)
    assert got == "collector started" and spawned == [1] and ctl.calls == []


def test_systemd_starts_the_unit_without_blocking_and_nothing_is_spawned() -> None:
    spawned: list[int] = []
    ctl = FakeSystemctl(0)
    got = cs.start_collector("colloc-collector.service", lambda: spawned.append(1),
                             systemctl="/usr/bin/systemctl", run=ctl)
    assert ctl.calls == [["/usr/bin/systemctl", "start", "--no-block", "--",
                          "colloc-collector.service"]]
    assert spawned == [] and "systemd" in got


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def logged() -> Iterator[list[str]]:
    """What start_collector logs (the prolog's logger does not propagate to root)."""
    h = _Lines()
    cs.log.addHandler(h)
    try:
        yield h.lines
    finally:
        cs.log.removeHandler(h)


def test_a_failing_systemctl_falls_back_to_the_detached_start_and_says_so(logged) -> None:
    spawned: list[int] = []
    ctl = FakeSystemctl(5, "Failed to start colloc-collector.service: Unit not found.")
    got = cs.start_collector("colloc-collector.service", lambda: spawned.append(1),
                             systemctl="/bin/systemctl", run=ctl)
    assert spawned == [1] and len(ctl.calls) == 1
    assert "detached" in got and "exit 5" in got and "Unit not found" in got
    assert any("starting the collector detached" in m for m in logged)


def test_no_systemd_falls_back_without_calling_systemctl(tmp_path: Path, monkeypatch,
                                                         logged) -> None:
    spawned: list[int] = []
    ctl = FakeSystemctl(0)
    assert cs.find_systemctl(booted_mark=str(tmp_path / "no-run-systemd")) is None
    monkeypatch.setattr(cs, "find_systemctl", lambda *a, **k: None)
    got = cs.start_collector("colloc-collector.service", lambda: spawned.append(1), run=ctl)
    assert spawned == [1] and ctl.calls == [] and "no systemd" in got
    assert any("no systemd" in m for m in logged)


def test_find_systemctl_needs_a_booted_systemd_and_an_executable(tmp_path: Path) -> None:
    mark = tmp_path / "run-systemd"
    mark.mkdir()
    exe = tmp_path / "systemctl"
    assert cs.find_systemctl([str(exe)], str(mark)) is None
    exe.write_text("#!/bin/sh\n")
    assert cs.find_systemctl([str(exe)], str(mark)) is None  # not executable
    exe.chmod(0o755)
    assert cs.find_systemctl([str(exe)], str(mark)) == str(exe)


def test_run_systemctl_runs_a_real_program(tmp_path: Path) -> None:
    fake = tmp_path / "systemctl"
    fake.write_text("#!/bin/sh\necho \"args: $*\" >&2\nexit 3\n")
    fake.chmod(0o755)
    assert cs.run_systemctl([str(fake), "start", "--no-block", "--", "u.service"]) == (
        3, "args: start --no-block -- u.service")
    assert cs.run_systemctl([str(tmp_path / "absent")])[0] == 127


def test_ensure_collector_uses_the_unit(tmp_path: Path, monkeypatch) -> None:
    from slurm_colloc.node import metrics_launch as ml
    from tests.unit.test_node_cov_launch_gpus import ctx

    spawned: list[dict[str, str]] = []
    monkeypatch.setattr(ml, "spawn_collector", lambda env: spawned.append(dict(env)))
    ctl = FakeSystemctl(0)
    monkeypatch.setattr(cs, "find_systemctl", lambda *a, **k: "/usr/bin/systemctl")
    monkeypatch.setattr(cs, "run_systemctl", ctl)
    monkeypatch.setattr(cs.start_collector, "__kwdefaults__", {"systemctl": None, "run": ctl})
    cfg = CollocConfig(metrics_dir=str(tmp_path / "m"), collector_unit="colloc-collector.service")
    assert "systemd" in ml.ensure_collector(ctx(), cfg, {})
    assert spawned == [] and ctl.calls[0][-1] == "colloc-collector.service"
    ctl.rc = 1
    assert "detached" in ml.ensure_collector(ctx(restarts=3), cfg, {})
    assert spawned == [{}]


# ------------------------------------------------------------------- doctor ---


def _doctor(answers: dict[str, tuple[int, str]], cfg: CollocConfig | None = None):  # type: ignore[no-untyped-def]
    cfg = cfg or CollocConfig(collector_unit="colloc-collector.service")

    def query(argv: Sequence[str]) -> tuple[int, str]:
        return answers[argv[1]]

    return check_collector_unit(cfg, systemctl="/usr/bin/systemctl", query=query)


def test_doctor_unit_enabled_and_active_is_ok() -> None:
    f = _doctor({"is-enabled": (0, "enabled"), "is-active": (0, "active")})
    assert [x.level for x in f] == ["ok"] and "enabled, active" in f[0].detail


@pytest.mark.parametrize(("enabled", "active", "level", "words"), [
    ((1, ""), (3, "inactive"), "fail", "not installed"),
    ((1, "not-found"), (3, "inactive"), "fail", "collector-unit --install"),
    ((0, "enabled"), (3, "failed"), "fail", "journalctl"),
    ((1, "disabled"), (3, "inactive"), "warn", "not enabled"),
    ((0, "enabled"), (3, "inactive"), "warn", "next GPU job's prolog"),
])
def test_doctor_unit_problems(enabled, active, level, words) -> None:  # type: ignore[no-untyped-def]
    f = _doctor({"is-enabled": enabled, "is-active": active})
    assert len(f) == 1 and f[0].level == level and words in f[0].detail


def test_doctor_says_nothing_without_a_unit_and_warns_without_systemd(monkeypatch) -> None:
    assert _doctor({}, CollocConfig()) == []
    monkeypatch.setattr(cs, "find_systemctl", lambda *a, **k: None)
    f = check_collector_unit(CollocConfig(collector_unit="colloc-collector.service"))
    assert f[0].level == "warn" and "does not run systemd" in f[0].detail


# -------------------------------------------------------------------- --stay ---


class _NoGpus:
    name = "none"

    def sample_all(self) -> list[object]:
        return []

    def close(self) -> None:
        pass


def test_stay_keeps_the_collector_up_with_no_jobs(tmp_path: Path) -> None:
    cfg = CollocConfig(metrics_dir=str(tmp_path / "m"), mps_root=str(tmp_path / "mps"),
                       evidence_dir=str(tmp_path / "state" / "evidence"),
                       sample_interval_s=0.05, collector_idle_exit_s=0.0)
    t0 = time.monotonic()
    assert serve(cfg, _NoGpus(), max_seconds=5.0) == 0  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 2.0  # idle: gone at once
    t0 = time.monotonic()
    assert serve(replace(cfg), _NoGpus(), max_seconds=0.6, stay=True) == 0  # type: ignore[arg-type]
    assert time.monotonic() - t0 >= 0.55  # stayed until told


def test_the_collector_stays_while_roots_spool_holds_records(tmp_path: Path) -> None:
    """Issue 28: slurmdbd away past ``collector_idle_exit_s`` with no new job on the node
    left records in root's spool that nothing replayed after slurmdbd came back: the
    collector had idled out. It stays while the spool holds one, and goes once it is
    written (or older than a week)."""
    import os

    from slurm_colloc.accounting import spool

    cfg = CollocConfig(metrics_dir=str(tmp_path / "m"), mps_root=str(tmp_path / "mps"),
                       evidence_dir=str(tmp_path / "state" / "evidence"),
                       sample_interval_s=0.05, collector_idle_exit_s=0.0)
    sdir = spool.spool_dir_of(cfg.evidence_dir)
    sdir.mkdir(parents=True)
    entry = spool.write_entry(sdir, 41, 0, "cl1:abc")
    t0 = time.monotonic()
    assert serve(cfg, _NoGpus(), max_seconds=0.8) == 0  # type: ignore[arg-type]
    assert time.monotonic() - t0 >= 0.75  # stayed for the record
    old = time.time() - spool.STAY_FOR_S - 60
    os.utime(entry, (old, old))
    t0 = time.monotonic()
    assert serve(cfg, _NoGpus(), max_seconds=5.0) == 0  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 2.0  # a week old: left to the next job's scripts
    entry.unlink()
    assert serve(cfg, _NoGpus(), max_seconds=5.0) == 0  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 3.0


def test_the_collector_stays_while_an_epilog_is_owed(tmp_path: Path) -> None:
    """A saved job context no epilog consumed (slurmd killed during the epilog) keeps
    the collector up: its loop starts the late epilog (docs/admin.md 3.9); given up
    (``<job>.gaveup``), it no longer does."""
    import os

    from slurm_colloc.metrics.collector import work_left
    from slurm_colloc.mps import missed_epilogs

    cfg = CollocConfig(metrics_dir=str(tmp_path / "m"), mps_root=str(tmp_path / "mps"),
                       evidence_dir=str(tmp_path / "state" / "evidence"),
                       sample_interval_s=0.05, collector_idle_exit_s=0.0)
    assert work_left(cfg) is None
    ctx = Path(cfg.mps_root) / "ctx" / "77.json"
    ctx.parent.mkdir(parents=True)
    ctx.write_text("{}")
    old = time.time() - missed_epilogs.MIN_CTX_AGE_S - 5
    os.utime(ctx, (old, old))
    assert work_left(cfg) == "an epilog owed"
    t0 = time.monotonic()
    assert serve(cfg, _NoGpus(), max_seconds=0.6) == 0  # type: ignore[arg-type]
    assert time.monotonic() - t0 >= 0.55
    sdir = missed_epilogs.state_dir(cfg.evidence_dir)
    sdir.mkdir(parents=True)
    (sdir / "77.gaveup").write_text(repr(ctx.stat().st_mtime))
    assert work_left(cfg) is None


def test_stay_waits_for_the_lock_a_prolog_started_collector_holds(tmp_path: Path) -> None:
    import os
    import threading

    metrics = str(tmp_path / "m")
    held = _lock(metrics, stay=False)
    assert held is not None
    assert _lock(metrics, stay=False) is None  # the prolog's mode: another runs, exit
    got: list[int | None] = []
    t = threading.Thread(target=lambda: got.append(_lock(metrics, stay=True, poll_s=0.05)))
    t.start()
    time.sleep(0.3)
    assert got == []  # still waiting
    os.close(held)
    t.join(10)
    assert got and got[0] is not None
    os.close(got[0])  # type: ignore[arg-type]


def test_the_real_collector_with_stay_does_not_idle_out(tmp_path: Path) -> None:
    """``python -m slurm_colloc.metrics.collector --stay`` (the unit's ExecStart): with
    ``collector_idle_exit_s = 0.1`` and no job it still runs until told (here --seconds);
    without --stay it is gone at once."""
    import os

    from tests.unit.test_metrics_collector import make

    cfg, _backend, _state = make(tmp_path)
    conf = tmp_path / "colloc.conf"
    conf.write_text(f'gpu_backend = "sim"\nsim_state_dir = "{cfg.sim_state_dir}"\n'
                    f'metrics_dir = "{cfg.metrics_dir}"\nlog_file = "{tmp_path / "c.log"}"\n'
                    f'mps_root = "{tmp_path / "mps"}"\nsample_interval_s = 0.1\n'
                    f'evidence_dir = "{cfg.evidence_dir}"\n'
                    "collector_idle_exit_s = 0.1\n")
    env = {"PATH": os.environ["PATH"], "COLLOC_CONF": str(conf)}
    cwd = str(Path(__file__).resolve().parents[2])
    argv = [sys.executable, "-m", "slurm_colloc.metrics.collector", "--seconds", "3"]
    log = tmp_path / "c.log"
    assert subprocess.run(argv, env=env, cwd=cwd, timeout=60, check=False).returncode == 0
    assert "no GPU jobs for 0s, exiting" in log.read_text()  # idled out
    seen = len(log.read_text())
    t0 = time.monotonic()
    assert subprocess.run([*argv, "--stay"], env=env, cwd=cwd, timeout=60,
                          check=False).returncode == 0
    assert time.monotonic() - t0 >= 3.0  # the worker ran its --seconds
    assert "exiting" not in log.read_text()[seen:]
