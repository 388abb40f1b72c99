"""sbatch_templates/: one per framework (PyTorch/torchinfo, Hugging Face, Keras,
JAX/Flax, Lightning, explicit memory). Each is valid bash, runs a real training command
(the simulator only with COLLOC_DEMO set), its inline Python compiles, and the summary
its ``--colloc`` names is read by ``colloc estimate`` without a depth complaint. Each
may be requeued, appends its output, states the site's partition/account/memory lines,
and resumes from its checkpoint directory (issue 27)."""

from __future__ import annotations

import os
import py_compile
import re
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_colloc.cli import main

TEMPLATES = Path(__file__).resolve().parents[2] / "sbatch_templates"
NAMES = ("pytorch_torchinfo", "hf_finetune", "keras_summary", "jax_flax", "lightning",
         "explicit_mem")
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


def _python(text: str) -> str:
    """The training program: the heredoc of the template's ``srun python -`` line."""
    m = re.search(r"^srun python - <<'PY'\n(.*?)\nPY$", text, re.S | re.M)
    assert m, "an inline training program"
    return m.group(1)


@pytest.mark.parametrize("name", [n for n in NAMES if n != "explicit_mem"])
def test_template_python_py_compiles(name: str, tmp_path: Path) -> None:
    src = tmp_path / f"{name}.py"
    src.write_text(_python(_text(name)) + "\n")
    py_compile.compile(str(src), cfile=str(tmp_path / f"{name}.pyc"), doraise=True)


@pytest.mark.parametrize("name", NAMES)
def test_template_requeues_appends_and_states_the_site_lines(name: str) -> None:
    text = _text(name)
    head = text.split("\nexport CKPT_DIR=", 1)[0]
    assert re.search(r"^#SBATCH --requeue$", head, re.M)
    assert _option(head, "open-mode") == "append"
    assert _option(head, "mem") is not None  # host memory, said to be so
    assert "HOST memory" in head and "not GPU memory" in head
    for key in ("partition", "account"):  # off until the site edits them
        assert re.search(rf"^##SBATCH --{key}=\S+$", head, re.M), key
    # every directive before the first command: sbatch reads no #SBATCH line after it
    first_command = next(i for i, ln in enumerate(text.splitlines()[1:], 1)
                         if ln.strip() and not ln.startswith("#"))
    assert all(not ln.startswith("#SBATCH") for ln in text.splitlines()[first_command:])


MARKERS = {  # how each framework resumes from $CKPT_DIR
    "pytorch_torchinfo": ("torch.load(last", "weights_only=True", "opt.load_state_dict"),
    "hf_finetune": ("get_last_checkpoint(out)", ".train(resume_from_checkpoint=last)"),
    "keras_summary": ("keras.callbacks.BackupAndRestore(", "callbacks=[backup]"),
    "jax_flax": ("ocp.CheckpointManager(", "mngr.restore(latest", "range(start, 300)"),
    "lightning": ("ModelCheckpoint(dirpath=ckpt_dir, save_last=True",
                  "ckpt_path=last if os.path.exists(last) else None"),
}


@pytest.mark.parametrize("name", sorted(MARKERS))
def test_template_resumes_from_its_checkpoint_directory(name: str) -> None:
    code = _python(_text(name))
    assert 'os.environ["CKPT_DIR"]' in code
    for marker in MARKERS[name]:
        assert marker in code, marker


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("exported", [True, False])
def test_demo_uses_the_checkpoint_directory_or_one_under_the_submit_dir(
    name: str, exported: bool, tmp_path: Path,
) -> None:
    """The template's bash, run with a stand-in colloc-simjob that prints its arguments."""
    stub = tmp_path / "bin" / "colloc-simjob"
    stub.parent.mkdir()
    stub.write_text('#!/bin/sh\necho "simjob $*"\n')
    stub.chmod(0o755)
    env = {"PATH": f"{stub.parent}:/usr/bin:/bin", "COLLOC_DEMO": "1", "SLURM_JOB_ID": "77",
           "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_RESTART_COUNT": "1"}
    want = tmp_path / "checkpoints" / "77"
    if exported:
        want = tmp_path / "site" / "77"
        env["COLLOC_CHECKPOINT_DIR"] = str(want)
    r = subprocess.run(["bash", str(TEMPLATES / f"{name}.sbatch")], env=env,
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    assert "job 77 attempt 2: " in r.stdout and f"checkpoints in {want}" in r.stdout
    assert r.stdout.rstrip().endswith(f"--checkpoint-dir {want}")
    assert want.is_dir() and os.access(want, os.W_OK)


def test_pytorch_template_declares_the_optimizer_its_code_uses() -> None:
    text = _text("pytorch_torchinfo")
    assert "momentum=0.9" in _python(text)
    assert _option(text, "colloc-optimizer") == "momentum"
    assert "--optimizer momentum" in text and "--optimizer sgd\n" not in text
