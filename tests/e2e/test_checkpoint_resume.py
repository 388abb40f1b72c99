"""Requeue that loses little work (issue 27 item 4), and the user's guide run as written
(item 5).

A template-style job (``--requeue``, ``--open-mode=append``, colloc-simjob saving
checkpoints in the ``COLLOC_CHECKPOINT_DIR`` the TaskProlog made for it as its user)
runs out of GPU memory, colloc requeues it on a whole GPU, and the rerun resumes from
the checkpoint: it does less work than the first attempt (measured from the job's own
output, both attempts in one file). Then every command of docs/user.md that needs a
cluster runs against this one, exactly as the guide writes it (in E2E_CORE, so on
24.11 too: the guide says its sacct lines work on both).
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest

from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.slurm.adapter import SlurmCli, wait_for_jobs
from tests.e2e.conftest import ensure_user, sbatch
from tests.unit.test_user_doc_commands import E2E, SUMMARY, doc_commands, kind

pytestmark = pytest.mark.devcluster

USER = "colloc-ckpt"
WORK = re.compile(r"work this attempt: ([\d.]+) s \(from ([\d.]+) to ([\d.]+) of 8 s\)")


def _wait_final(slurm: SlurmCli, job: int, timeout: float = 120) -> str:
    """Wait through requeues: a final state the controller still shows a while later."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = wait_for_jobs(slurm, [job], timeout=timeout)[str(job)]
        time.sleep(1.5)  # the epilog may requeue right after the state turns final
        if (slurm.show_job(job) or {}).get("JobState") == state:
            return state
    raise TimeoutError(f"job {job} did not settle")


def test_an_oom_requeue_resumes_from_the_checkpoint_and_does_less_work(
    cluster: Cluster, slurm: SlurmCli, workdir: Path
) -> None:
    ensure_user(cluster, USER)
    scratch = workdir / "scratch"  # a shared scratch: root's, sticky, anyone may write
    scratch.mkdir(exist_ok=True)
    scratch.chmod(0o1777)
    conf = cluster.layout.colloc_conf
    original = conf.read_text()
    conf.write_text(original + f'\ncheckpoint_dir = "{scratch}/{{user}}/{{jobid}}"\n')
    try:
        job = sbatch(
            cluster, workdir,
            'echo "attempt $((${SLURM_RESTART_COUNT:-0} + 1)) '
            'restarts=${COLLOC_RESTART_COUNT:-unset} dir=${COLLOC_CHECKPOINT_DIR:-unset}"\n'
            "exec colloc-simjob --mem 1G --peak 9G --peak-at 0.7 --seconds 8 "
            "--checkpoint-every 1",
            "--gres=shard:4", "--requeue", "--open-mode=append", user=USER)
        assert _wait_final(slurm, job) == "COMPLETED"
    finally:
        conf.write_text(original)
    assert (slurm.show_job(job) or {}).get("Restarts") == "1"
    ckpt = scratch / USER / str(job)
    st = ckpt.stat()
    assert st.st_uid == pwd.getpwnam(USER).pw_uid and stat.S_IMODE(st.st_mode) == 0o700
    out = (workdir / f"{job}.out").read_text()
    # both attempts in one file (appended), each told its directory and restart count
    assert out.count(f"attempt 1 restarts=0 dir={ckpt}\n") == 1, out
    assert out.count(f"attempt 2 restarts=1 dir={ckpt}\n") == 1, out
    assert out.index("attempt 1 ") < out.index("torch.OutOfMemoryError") < out.index("attempt 2 ")
    assert f"no checkpoint in {ckpt}: starting from zero" in out
    assert f"resumed from checkpoint {ckpt}/colloc-simjob.ckpt" in out
    (w1, f1, t1), (w2, f2, t2) = [tuple(map(float, m)) for m in WORK.findall(out)]
    assert f1 == 0.0 and t1 >= 0.7 * 8  # the first attempt ran up to its OOM
    assert 0.0 < f2 <= t1 and t2 == 8.0  # the second went on from its last checkpoint
    assert w2 < w1, f"the rerun did {w2} s of work, the first attempt {w1} s"
    print(f"work: first attempt {w1} s (OOM at {t1} s), rerun {w2} s from {f2} s")
    # the guide's sacct lines on this requeued job
    rows = _run(cluster, workdir, E2E["sacct_duplicates"].replace("<jobid>", str(job)))
    assert [ln.split()[0] for ln in rows.splitlines()
            if ln.split() and ln.split()[0] == str(job)] == [str(job)] * 2, rows
    restarts = _run(cluster, workdir, E2E["sacct_restarts"].replace("<jobid>", str(job)))
    assert "Restarts" in restarts and re.search(rf"^{job} +COMPLETED +1 ", restarts, re.M), \
        restarts


def _run(cluster: Cluster, cwd: Path, cmd: str) -> str:
    env = {**cluster.env(), "USER": "root"}
    cp = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=120, check=False)
    assert cp.returncode == 0, f"{cmd}: exit {cp.returncode}: {cp.stderr}"
    assert cp.stdout.strip() or cmd.endswith("r.html"), f"{cmd}: no output"
    return cp.stdout


def _submitted(text: str) -> int:
    m = re.fullmatch(r"Submitted batch job (\d+)\s*", text)
    assert m, text
    return int(m.group(1))


def test_the_users_guide_commands_run_as_written(
    cluster: Cluster, slurm: SlurmCli, workdir: Path
) -> None:
    shutil.copy(SUMMARY, workdir / "resnet50.txt")
    train = workdir / "train.sh"
    train.write_text("#!/bin/bash\ncolloc-simjob --mem 2G --seconds 2\n")
    train.chmod(0o755)
    cmds = {kind(c)[1]: c for c in doc_commands() if kind(c)[0] == "e2e"}
    assert sorted(cmds) == sorted(E2E)
    job = _submitted(_run(cluster, workdir, cmds["sbatch_colloc"]))
    mem = _submitted(_run(cluster, workdir, cmds["sbatch_mem"]))
    array = _submitted(_run(cluster, workdir, "sbatch --array=7 --colloc-mem=2G train.sh"))
    states = wait_for_jobs(slurm, [job, mem, f"{array}_7"], timeout=90)
    assert set(states.values()) == {"COMPLETED"}, states
    jid = str(job)
    assert f"job {jid}" in _run(cluster, workdir, cmds["report"].replace("<jobid>", jid))
    _run(cluster, workdir, cmds["report_html"].replace("<jobid>", jid))
    assert (workdir / "r.html").read_text().startswith("<!DOCTYPE html>")
    # The job's record reaches accounting after its epilog, from root's record writer in
    # the background: the report shows its attempts once the record is there.
    deadline = time.monotonic() + 120
    while True:
        d = json.loads(_run(cluster, workdir, cmds["report_json"].replace("<jobid>", jid)))
        if d["attempts"] or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert d["job_id"] == jid and d["attempts"], d
    assert f"{array}_7" in _run(cluster, workdir, cmds["report_array"].replace("1234", str(array)))
    table = _run(cluster, workdir, cmds["table"])
    assert jid in table and str(mem) in table
    rows = json.loads(_run(cluster, workdir, cmds["table_states"]))
    assert jid in json.dumps(rows)
    for key in ("sacct_restarts", "sacct_duplicates"):
        assert jid in _run(cluster, workdir, cmds[key].replace("<jobid>", jid))
    assert os.access(workdir / "r.html", os.R_OK)
