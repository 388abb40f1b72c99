"""``colloc estimate``: the contract the submit path relies on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_colloc.cli.estimate_cmd import estimate

DATA = Path(__file__).parent / "data" / "summaries"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_site_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conf = tmp_path / "colloc.conf"
    conf.write_text(f'history_db = "{tmp_path / "history.sqlite"}"\nhistory_source = "sqlite"\n')
    monkeypatch.setenv("COLLOC_CONF", str(conf))


def _runner() -> CliRunner:
    """stdout and stderr apart (click 8.1 needs ``mix_stderr=False``; 8.2 removed it)."""
    try:
        return CliRunner(mix_stderr=False)  # type: ignore[call-arg,unused-ignore]
    except TypeError:
        return CliRunner()


def run(*args: str) -> tuple[int, str, str]:
    r = _runner().invoke(estimate, list(args))
    return r.exit_code, r.stdout, r.stderr


def test_json_is_one_object_with_the_contract_keys() -> None:
    code, out, _ = run("--summary", str(DATA / "resnet50_torchinfo.txt"), "--batch-size", "32",
                       "--json")
    assert code == 0
    doc = json.loads(out)
    assert isinstance(doc["estimate_mib"], int)
    assert doc["estimator"] == "layer-aware"
    assert isinstance(doc["breakdown"], dict) and isinstance(doc["margin_mib"], int)
    assert doc["fingerprint"] == doc["fingerprint"].lower()
    assert int(doc["fingerprint"], 16) >= 0
    assert "uncertainty" in doc
    assert out.count("\n") == 1


@pytest.mark.parametrize("opt", ["sgd", "momentum", "adam", "adamw"])
@pytest.mark.parametrize("prec", ["fp32", "amp-fp16", "amp-bf16"])
def test_all_optimizers_and_precisions(opt: str, prec: str) -> None:
    code, out, _ = run("--summary", str(DATA / "bert_base_print.txt"), "--batch-size", "8",
                       "--seq-len", "128", "--optimizer", opt, "--precision", prec, "--json")
    assert code == 0 and json.loads(out)["estimate_mib"] > 0


def test_estimator_option_and_text_output() -> None:
    code, out, _ = run("--summary", str(DATA / "keras2_cnn.txt"), "--batch-size", "8",
                       "--estimator", "horus")
    assert code == 0 and "horus" in out


@pytest.mark.parametrize(
    ("setup", "args", "needle"),
    [
        (None, ["--summary", "/nonexistent/model.txt", "--batch-size", "8"], "cannot read"),
        ("garbage", ["--batch-size", "8"], "line 1"),
        ("torchinfo-bad", ["--batch-size", "8"], "line 4"),
        ("ok", ["--batch-size", "0"], "batch size"),
        ("ok", ["--batch-size", "99999999"], "batch size"),
        ("huge", ["--batch-size", "8"], "larger than"),
        ("ok", ["--batch-size", "8", "--estimator", "nope"], "unknown estimator"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path: Path, setup: str | None, args: list[str],
                                         needle: str) -> None:
    if setup is not None:
        f = tmp_path / "s.txt"
        content = {
            "garbage": "not a summary at all\n",
            "torchinfo-bad": "=====\nLayer (type:depth-idx)   Output Shape   Param #\n=====\n"
                             "├─Conv2d: 1-1   [1, 3]   many\n=====\n",
            "ok": (DATA / "keras2_cnn.txt").read_text(),
            "huge": "x" * (5 * 1024 * 1024),
        }[setup]
        f.write_text(content)
        args = ["--summary", str(f), *args]
    code, out, err = run(*args)
    assert code == 2
    assert out == ""
    assert needle in err
    assert err.count("\n") == 1 and err.startswith("colloc estimate: error:")


def test_history_hook_through_cli(tmp_path: Path) -> None:
    from slurm_colloc.estimators import SqliteHistory, read_summary_file

    fp = read_summary_file(DATA / "keras2_cnn.txt").fingerprint()
    SqliteHistory(tmp_path / "history.sqlite").record(fp, 8, None, "adam", "fp32", 1234)
    _, out, _ = run("--summary", str(DATA / "keras2_cnn.txt"), "--batch-size", "8", "--json")
    assert json.loads(out)["estimator"] == "history"
    _code, out, _ = run("--summary", str(DATA / "keras2_cnn.txt"), "--batch-size", "8", "--json",
                       "--no-history")
    assert json.loads(out)["estimator"] == "layer-aware"


def test_cli_is_fast_and_imports_nothing_heavy() -> None:
    """A fresh process, as cli_filter runs it: generous bound for a loaded CI machine;
    the benchmark reports the real figure (well under 200 ms)."""
    code = ("import sys; from slurm_colloc.cli import main; "
            "sys.argv = ['colloc', 'estimate', '--summary', "
            f"{str(DATA / 'resnet50_torchinfo.txt')!r}, '--batch-size', '8', '--json']\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "bad = [m for m in ('torch', 'pandas', 'numpy') if m in sys.modules]\n"
            "sys.exit(3 if bad else 0)")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["estimate_mib"] > 0
    assert wall < 1.0
