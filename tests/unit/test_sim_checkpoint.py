"""colloc-simjob with a checkpoint directory: it saves its progress, and a rerun (a
requeue) resumes from the last save, says how much work it resumed from and does only
the rest; without a directory nothing changes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_colloc.gpu.sim import init_state, sim_checkpoint

ROOT = Path(__file__).resolve().parents[2]
WORK = re.compile(r"work this attempt: ([\d.]+) s \(from ([\d.]+) to ([\d.]+) of 4 s\)")


@pytest.fixture
def state(tmp_path: Path) -> Path:
    init_state(tmp_path / "state", gpu_count=1, memory_mib=40960)
    return tmp_path / "state"


def _run(state: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "COLLOC_"))}
    e.update(PYTHONPATH=str(ROOT), COLLOC_SIM_STATE=str(state), CUDA_VISIBLE_DEVICES="0", **env)
    return subprocess.run(
        [sys.executable, "-m", "slurm_colloc.gpu.sim.simjob", "--mem", "2G", "--seconds", "4",
         "--time-scale", "2", *args], env=e, capture_output=True, text=True, timeout=30)


def test_an_oom_then_a_rerun_resumes_from_the_last_checkpoint(state: Path, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    # the first attempt dies of OOM at 70 % of its work, having saved every 0.5 s of work
    first = _run(state, "--peak", "100G", "--peak-at", "0.7", "--checkpoint-every", "0.5",
                 COLLOC_CHECKPOINT_DIR=str(ck))
    assert first.returncode == 1 and "torch.OutOfMemoryError" in first.stderr
    assert f"no checkpoint in {ck}: starting from zero" in first.stdout
    w1 = WORK.search(first.stdout)
    assert w1 and float(w1[2]) == 0.0 and 2.8 <= float(w1[1]) < 4.0, first.stdout
    saved = json.loads(sim_checkpoint.path_in(ck).read_text())
    assert saved["work_s"] == 4.0 and 0.5 <= saved["done_s"] <= float(w1[3])
    # the rerun (its peak now fits) starts where the checkpoint left off
    second = _run(state, "--peak", "3G", "--peak-at", "0.7", "--checkpoint-dir", str(ck))
    assert second.returncode == 0, second.stderr
    assert (f"resumed from checkpoint {ck}/colloc-simjob.ckpt: {saved['done_s']:.1f} of 4 s "
            "of work already done") in second.stdout
    w2 = WORK.search(second.stdout)
    assert w2 and float(w2[2]) == pytest.approx(saved["done_s"], abs=0.05)
    assert float(w2[3]) == 4.0 and float(w2[1]) < float(w1[1])
    epochs = re.findall(r"epoch (\d+)/10", second.stdout)
    assert epochs and int(epochs[0]) > 1  # no epoch reported twice for work not redone


def test_another_jobs_or_a_broken_checkpoint_is_ignored(state: Path, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    ck.mkdir()
    sim_checkpoint.save(ck, 9.0, 5.0)
    r = _run(state, "--checkpoint-dir", str(ck))
    assert r.returncode == 0 and "is for another job (5 of 9 s): starting from zero" in r.stdout
    assert WORK.search(r.stdout)[1] == "4.0"  # type: ignore[index]
    sim_checkpoint.path_in(ck).write_text("{not json")
    assert sim_checkpoint.load(ck, 4.0).done_s == 0.0
    assert "unreadable" in sim_checkpoint.load(ck, 4.0).note


def test_without_a_directory_nothing_is_saved_or_said(state: Path, tmp_path: Path) -> None:
    r = _run(state)
    assert r.returncode == 0
    assert "checkpoint" not in r.stdout and "work this attempt" not in r.stdout


def test_negative_interval_is_bad_input(state: Path) -> None:
    r = _run(state, "--checkpoint-every", "-1")
    assert r.returncode == 2 and "--checkpoint-every -1.0: must not be negative" in r.stderr
