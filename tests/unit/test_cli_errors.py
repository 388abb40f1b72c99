"""Every CLI error is one clear line on stderr and exit 2, never a traceback.

Each ``colloc`` subcommand (and ``colloc-report``) runs with bad input: missing
files, ``--html`` into a missing directory, unknown or malformed job ids, a broken or
missing configuration, NVML missing for ``colloc admin gres-conf``/``install`` on a
host without GPUs (``gpu_memory_mib = 0`` means "ask NVML"). Slurm is a stand-in
``sacct``/``squeue`` on PATH that knows no job, so nothing here needs a cluster.
Also: ``colloc config --check`` semantics, ``multi_user_policy`` deprecation, and
docs/configuration.md equal to what ``colloc config --defaults --markdown`` prints.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_colloc import config as cfgmod
from slurm_colloc.cli import main
from slurm_colloc.cli.config_cmd import markdown

REPO = Path(__file__).resolve().parents[2]
EMPTY_JSON = '{"meta": {}, "errors": [], "jobs": []}'


@pytest.fixture()
def env(tmp_path: Path) -> dict[str, str]:
    """A PATH whose sacct/squeue know no job, and a valid colloc.conf."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for tool in ("sacct", "squeue"):
        p = bin_ / tool
        p.write_text(f"#!/bin/sh\necho '{EMPTY_JSON}'\n")
        p.chmod(0o755)
    # sinfo --version: a supported release here, Debian 12's in OLDSLURM
    old = tmp_path / "old-slurm"
    old.mkdir()
    for d, line in ((bin_, "slurm 24.11.5"), (old, "slurm-wlm 22.05.8")):
        (d / "sinfo").write_text(f"#!/bin/sh\necho '{line}'\n")
        (d / "sinfo").chmod(0o755)
    conf = tmp_path / "colloc.conf"
    conf.write_text(f'metrics_dir = "{tmp_path / "metrics"}"\nhistory_source = "sqlite"\n'
                    f'history_db = "{tmp_path / "h.sqlite"}"\n')
    broken = tmp_path / "broken.conf"
    broken.write_text("shard_mib = \n")
    summary = tmp_path / "s.txt"
    summary.write_text("not a model summary\n")
    return {"PATH": f"{bin_}:{os.environ['PATH']}", "OLDSLURM": str(old),
            "COLLOC_CONF": str(conf),
            "BROKEN": str(broken), "SUMMARY": str(summary), "TMP": str(tmp_path)}


def _fill(argv: list[str], env: dict[str, str]) -> list[str]:
    return [a.format(**env) for a in argv]


CASES: list[tuple[str, list[str], dict[str, str]]] = [
    ("estimate: missing summary", ["estimate", "--summary", "{TMP}/none.txt",
                                   "--batch-size", "8"], {}),
    ("estimate: unreadable summary", ["estimate", "--summary", "{SUMMARY}", "--batch-size",
                                      "8", "--no-history"], {}),
    ("estimate: bad batch size", ["estimate", "--summary", "{SUMMARY}", "--batch-size", "x"],
     {}),
    ("estimate: broken config", ["estimate", "--summary", "{SUMMARY}", "--batch-size", "8"],
     {"COLLOC_CONF": "{BROKEN}"}),
    ("report: unknown job", ["report", "987654"], {}),
    ("report: unknown array task", ["report", "987654_3"], {}),
    ("report: malformed job id", ["report", "12;rm"], {}),
    ("report: no job and no filter", ["report"], {}),
    ("report: html into a missing dir", ["report", "1", "--html", "{TMP}/no/dir/r.html"], {}),
    ("report: bad state", ["report", "--user", "alice", "--state", "NOPE"], {}),
    ("report: unknown jobs in a table", ["report", "987654", "987655"], {}),
    ("report: broken config", ["report", "1"], {"COLLOC_CONF": "{BROKEN}"}),
    ("report: missing config", ["report", "1"], {"COLLOC_CONF": "{TMP}/missing.conf"}),
    ("config: broken", ["config", "--check"], {"COLLOC_CONF": "{BROKEN}"}),
    ("config: missing explicit", ["config", "--check"], {"COLLOC_CONF": "{TMP}/missing.conf"}),
    ("config: missing --file", ["config", "--check", "--file", "{TMP}/missing.conf"], {}),
    ("config: markdown without defaults", ["config", "--markdown"], {}),
    ("admin gres-conf: NVML missing", ["admin", "gres-conf"], {}),
    ("admin install: NVML missing", ["admin", "install", "--slurm-conf",
                                     "{TMP}/slurm.conf"], {}),
    ("admin doctor: broken config", ["admin", "doctor", "--offline"],
     {"COLLOC_CONF": "{BROKEN}"}),
    ("admin install: Slurm 22.05", ["admin", "install", "--slurm-conf", "{TMP}/slurm.conf",
                                    "--gpu-memory-mib", "40960"],
     {"PATH": "{OLDSLURM}:{PATH}"}),
    ("admin doctor: Slurm 22.05", ["admin", "doctor", "--offline"], {"PATH": "{OLDSLURM}:{PATH}"}),
    ("selftest: not --gpu", ["selftest"], {}),
    ("unknown subcommand", ["nope"], {}),
    ("unknown option", ["report", "--bogus"], {}),
]


def _no_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """This host has no NVIDIA driver (whatever the machine running the test has)."""
    try:
        import pynvml
    except ImportError:
        return

    def init() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", init)


@pytest.mark.parametrize(("what", "argv", "extra"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(
        what: str, argv: list[str], extra: dict[str, str], env: dict[str, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    _no_nvml(monkeypatch)
    for k, v in {"PATH": env["PATH"], "COLLOC_CONF": env["COLLOC_CONF"],
                 **{k: v.format(**env) for k, v in extra.items()}}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("COLLOC_DEBUG", raising=False)
    res = CliRunner().invoke(main, _fill(argv, env), prog_name="colloc")
    err = res.stderr
    assert res.exit_code == 2, (what, res.exit_code, res.output, res.exception)
    assert "Traceback" not in res.output and not isinstance(res.exception, AssertionError)
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, (what, err)
    assert "error" in lines[0].lower(), lines[0]


@pytest.mark.parametrize("argv", [["987654"], ["x y"], ["1", "--html", "/nonexistent/d/r.html"],
                                  ["--state", "bogus", "-u", "a"]])
def test_colloc_report_entry_point_is_one_line_exit_2(argv: list[str],
                                                      env: dict[str, str]) -> None:
    cp = subprocess.run(
        [sys.executable, "-c", "from slurm_colloc.cli import report_main; report_main()", *argv],
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "PATH": env["PATH"], "COLLOC_CONF": env["COLLOC_CONF"]})
    assert cp.returncode == 2, (cp.stdout, cp.stderr)
    assert "Traceback" not in cp.stderr
    assert len([ln for ln in cp.stderr.splitlines() if ln.strip()]) == 1, cp.stderr


def test_config_check_reports_ok_and_a_missing_default(monkeypatch: pytest.MonkeyPatch,
                                                       env: dict[str, str]) -> None:
    monkeypatch.setenv("COLLOC_CONF", env["COLLOC_CONF"])
    res = CliRunner().invoke(main, ["config", "--check"])
    assert res.exit_code == 0 and "ok" in res.output
    monkeypatch.delenv("COLLOC_CONF")
    monkeypatch.setattr(cfgmod, "DEFAULT_PATH", Path(env["TMP"]) / "absent.conf")
    monkeypatch.setattr("slurm_colloc.cli.config_cmd.cfgmod.DEFAULT_PATH",
                        Path(env["TMP"]) / "absent.conf")
    res = CliRunner().invoke(main, ["config", "--check"])
    assert res.exit_code == 0 and "not found" in res.output and ": ok" not in res.output


def test_multi_user_policy_loads_with_a_warning(tmp_path: Path) -> None:
    p = tmp_path / "old.conf"
    p.write_text('multi_user_policy = "one-user-per-gpu"\nshard_mib = 512\n')
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cfg = cfgmod.load(p)
    assert cfg.shard_mib == 512 and not hasattr(cfg, "multi_user_policy")
    assert any(issubclass(w.category, cfgmod.ConfigWarning)
               and "multi_user_policy" in str(w.message) for w in seen)


def test_configuration_md_is_generated_from_the_dataclass() -> None:
    """docs/configuration.md must equal `colloc config --defaults --markdown`; after
    changing slurm_colloc/config.py run:
    .venv/bin/colloc config --defaults --markdown > docs/configuration.md"""
    checked_in = (REPO / "docs" / "configuration.md").read_text()
    assert checked_in == markdown(), (
        "docs/configuration.md is stale: regenerate it with "
        "`colloc config --defaults --markdown > docs/configuration.md`")
    import dataclasses

    for f in dataclasses.fields(cfgmod.CollocConfig):
        assert f"## {f.name}\n" in checked_in
    assert "(not documented)" not in checked_in
