"""``colloc estimate --attention`` and the refusals with exit 2 (issue 15)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_colloc.cli.estimate_cmd import estimate

CORPUS = Path(__file__).resolve().parents[2] / "slurm_colloc" / "estimators" / "data" / "corpus"
SAMPLES = Path(__file__).resolve().parents[2] / "sbatch_templates" / "summaries"


@pytest.fixture(autouse=True)
def _no_site_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conf = tmp_path / "colloc.conf"
    conf.write_text(f'history_db = "{tmp_path / "history.sqlite"}"\nhistory_source = "sqlite"\n')
    monkeypatch.setenv("COLLOC_CONF", str(conf))


def run(*args: str) -> tuple[int, str, str]:
    try:
        runner = CliRunner(mix_stderr=False)  # type: ignore[call-arg,unused-ignore]
    except TypeError:
        runner = CliRunner()
    r = runner.invoke(estimate, list(args))
    return r.exit_code, r.stdout, r.stderr


@pytest.mark.parametrize("impl", ["eager", "sdpa", "flash"])
def test_attention_option(impl: str) -> None:
    code, out, _ = run("--summary", str(CORPUS / "bert_base_mlm.print_params.txt"),
                       "--batch-size", "8", "--seq-len", "512", "--attention", impl, "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["uncertainty"]["attention"]["implementation"] == impl
    assert doc["uncertainty"]["attention"]["implementation_source"] == "option"
    assert doc["uncertainty"]["architecture"]["family"] == "bert"
    assert abs(sum(doc["breakdown"].values()) - doc["estimate_mib"]) <= 1


def test_eager_default_is_the_largest() -> None:
    mib = {}
    for impl in (None, "eager", "sdpa"):
        args = ["--summary", str(CORPUS / "gpt2_lm.print.txt"), "--batch-size", "8",
                "--seq-len", "1024", "--json"]
        if impl:
            args += ["--attention", impl]
        code, out, _ = run(*args)
        assert code == 0
        mib[impl] = json.loads(out)["estimate_mib"]
    assert mib[None] == mib["eager"] > mib["sdpa"]


def test_unknown_attention_is_exit_2() -> None:
    code, out, _ = run("--summary", str(CORPUS / "gpt2_lm.print.txt"), "--batch-size", "8",
                         "--attention", "xformers")
    assert code == 2 and out == ""


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("colloc estimate: error: ")
    return lines[0]


def test_torchinfo_without_shapes_is_exit_2(tmp_path: Path) -> None:
    src = (SAMPLES / "resnet50_torchinfo.txt").read_text().splitlines()
    cut = [ln[:41] + ln[67:] if len(ln) > 67 else ln for ln in src]
    p = tmp_path / "noshape.txt"
    p.write_text("\n".join(cut) + "\n")
    code, out, err = run("--summary", str(p), "--batch-size", "128", "--json")
    assert code == 2 and out == ""
    assert "Output Shape" in _one_error_line(err)


def test_absurd_size_is_exit_2(tmp_path: Path) -> None:
    p = tmp_path / "huge.txt"
    p.write_text("Net(\n  (fc): Linear(in_features=8, out_features=8), 1" + "0" * 30
                 + " params\n)\n")
    code, out, err = run("--summary", str(p), "--batch-size", "8")
    assert code == 2 and out == ""
    assert "implausibly large" in _one_error_line(err)


def test_unknown_format_and_fifo_are_exit_2(tmp_path: Path) -> None:
    p = tmp_path / "log.txt"
    p.write_text("epoch 1 loss 0.3\n")
    code, _, err = run("--summary", str(p), "--batch-size", "8")
    assert code == 2
    _one_error_line(err)
    import os

    fifo = tmp_path / "f.fifo"
    os.mkfifo(fifo)
    code, _, err = run("--summary", str(fifo), "--batch-size", "8")
    assert code == 2
    assert "not a regular file" in _one_error_line(err)


def test_keras_and_flax_samples_estimate() -> None:
    for name in ("keras3_text_encoder.summary.txt", "flax_vit_tiny.tabulate.txt",
                 "flax_cnn.tabulate.txt"):
        code, out, _ = run("--summary", str(CORPUS / name), "--batch-size", "16", "--json")
        assert code == 0, name
        assert json.loads(out)["estimate_mib"] > 1000
