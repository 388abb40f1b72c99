"""sbatch_templates/: one per framework (PyTorch/torchinfo, Hugging Face, Keras,
JAX/Flax, explicit memory). Each is valid bash, runs a real training command (the
simulator only with COLLOC_DEMO set), its inline Python compiles, and the summary its
``--colloc`` names is read by ``colloc estimate`` without a depth complaint."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_colloc.cli import main

TEMPLATES = Path(__file__).resolve().parents[2] / "sbatch_templates"
NAMES = ("pytorch_torchinfo", "hf_finetune", "keras_summary", "jax_flax", "explicit_mem")
PENDING = {  # summaries the estimators work adds (sbatch_templates/summaries/)
    "keras_resnet50.txt": "the Keras parser's sample",
    "flax_cnn.txt": "the JAX/Flax parser's sample",
    "resnet50_torchinfo_depth10.txt": "the depth-10 torchinfo sample",
}


def _text(name: str) -> str:
    return (TEMPLATES / f"{name}.sbatch").read_text()


def _option(text: str, key: str) -> str | None:
    m = re.search(rf"^#SBATCH --{key}=(\S+)$", text, re.M)
    return m.group(1) if m else None


@pytest.mark.parametrize("name", NAMES)
def test_template_is_bash_with_a_real_command_and_the_demo_optional(name: str) -> None:
    path = TEMPLATES / f"{name}.sbatch"
    assert subprocess.run(["bash", "-n", str(path)], check=False).returncode == 0
    text = path.read_text()
    assert _option(text, "job-name") and (_option(text, "colloc") or _option(text, "colloc-mem"))
    body = text.split('if [ -n "${COLLOC_DEMO:-}" ]; then', 1)
    assert len(body) == 2, "the simulator runs only as the explicit demo alternative"
    demo, real = body[1].split("fi\n", 1)
    assert "colloc-simjob" in demo and "colloc-simjob" not in real
    assert re.search(r"^srun python", real, re.M), "a real training command"
    for block in re.findall(r"<<'PY'\n(.*?)\nPY\n", real, re.S):
        compile(block, f"{name}.sbatch", "exec")


@pytest.mark.parametrize("name", [n for n in NAMES if n != "explicit_mem"])
def test_template_summary_is_estimated(name: str) -> None:
    text = _text(name)
    summary = _option(text, "colloc")
    assert summary is not None
    path = TEMPLATES / summary
    if not path.is_file():
        reason = PENDING.get(path.name)
        assert reason, f"{name}.sbatch names {summary}, which does not exist"
        pytest.skip(f"{summary} ({reason}) is not in sbatch_templates/summaries/ yet")
    args = ["estimate", "--summary", str(path), "--no-history", "--json",
            "--batch-size", _option(text, "colloc-batch-size") or "1"]
    for key in ("seq-len", "optimizer", "precision"):
        if (v := _option(text, f"colloc-{key}")) is not None:
            args += [f"--{key}", v]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert "depth=10" not in res.output  # no "rerun at depth 10" advice


def test_pytorch_template_shows_a_depth_10_table() -> None:
    text = _text("pytorch_torchinfo")
    assert "depth=10" in text and "└─Conv2d: 4-1" in text  # the sample in the text


def test_hf_template_builds_the_model_from_its_config() -> None:
    text = _text("hf_finetune")
    assert "from_config" in text and "BertConfig()" in text
    assert not re.search(r"M\.from_pretrained|Model\w*\.from_pretrained", text)
