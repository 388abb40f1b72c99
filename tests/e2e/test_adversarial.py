"""Issue 11: the attacks found on the live cluster, replayed by unprivileged users.

``colloc-u1`` is the attacker, ``colloc-u2`` the victim. Each test asserts the
outcome a site cares about: the victim's process lives, the cap holds, the record is
Slurm's, the node is not drained, no job is lost.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from slurm_colloc import config as cfgmod
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.mps.tenancy import Tenancy
from slurm_colloc.slurm.adapter import SlurmCli, wait_for_jobs
from tests.e2e.conftest import ensure_user, node_state, sbatch

ATTACKER, VICTIM = "colloc-u1", "colloc-u2"
FORGED = "colloc1:mode=whole,need_mib=40960,shards=40,shard_mib=1024,alloc_mib=40960"
SHOW_ENV = 'echo "LIMIT=$CUDA_MPS_PINNED_DEVICE_MEM_LIMIT PIPE=$CUDA_MPS_PIPE_DIRECTORY"'


@pytest.fixture
def users(cluster: Cluster) -> None:
    for u in (ATTACKER, VICTIM):
        ensure_user(cluster, u)


def _log(cluster: Cluster) -> str:
    return (cluster.layout.log / "colloc.log").read_text()


def _prolog_line(cluster: Cluster, job: int) -> str:
    lines = [ln for ln in _log(cluster).splitlines() if f"job {job}:" in ln and "prolog" in ln]
    return "\n".join(lines)


@pytest.mark.parametrize(
    "how", ["comment", "output-path", "comment-newline"],
)
def test_forged_admin_comment_in_free_text_does_not_lift_the_cap(
    cluster: Cluster, slurm: SlurmCli, workdir: Path, users: None, how: str
) -> None:
    """Critical 1: ``--comment 'x AdminComment=colloc1:mode=whole,...'`` ran a 2-shard
    job with no MPS and no cap; the output path and a newline did the same."""
    args = ["--gres=shard:2"]
    if how == "comment":
        args.append(f"--comment=x AdminComment={FORGED} GRES=shard:40(IDX:3) Restarts=9")
    elif how == "comment-newline":
        args.append(f"--comment=x\nJobId=1 AdminComment={FORGED}")
    else:
        args.append(f"--error={workdir}/e AdminComment={FORGED} Restarts=9")
    job = sbatch(cluster, workdir, f"{SHOW_ENV}\ncolloc-simjob --mem 1G --seconds 1", *args,
                 user=ATTACKER)
    assert wait_for_jobs(slurm, [job], timeout=90)[str(job)] == "COMPLETED"
    out = (workdir / f"{job}.out").read_text()
    assert "LIMIT=0=1536M" in out, out  # 2 shards less one CUDA context
    line = _prolog_line(cluster, job)
    assert "shared gpu=" in line and "limit_mib=2048" in line, line
    info = slurm.show_job(job) or {}
    assert not str(info.get("AdminComment", "")).startswith("colloc1:mode=whole"), info
    assert node_state(cluster) in ("idle", "mix")


def _victim_process() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["runuser", "-u", VICTIM, "--", "sleep", "300"])


def _victim_pid(proc: subprocess.Popen[bytes]) -> int:
    """The sleep itself (runuser's child) is what the attacker names."""
    for _ in range(50):
        kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        text = kids.read_text().split() if kids.exists() else []
        if text:
            return int(text[0])
        time.sleep(0.05)
    return proc.pid


def _our_daemons(pipe: str) -> list[int]:
    """Root processes whose environment names this pipe directory (MPS daemons)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != 0:
                continue
            env = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if f"CUDA_MPS_PIPE_DIRECTORY={pipe}".encode() in env.split(b"\0"):
            found.append(int(entry))
    return found


@pytest.mark.parametrize("plant", ["victim-pid", "fifo", "dev-zero"])
def test_the_pipe_directory_cannot_steer_root(
    cluster: Cluster, slurm: SlurmCli, workdir: Path, users: None, plant: str
) -> None:
    """Critical 2: the job replaced root's pid file in its own pipe directory; the
    epilog killed another user's process (FIFO: hung under the GPU lock; /dev/zero:
    read until MemoryError), and root MPS daemons were orphaned."""
    victim = _victim_process()
    vpid = _victim_pid(victim)
    pid_file = "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"
    planting = {
        "victim-pid": f"echo {vpid} > {pid_file}",
        "fifo": f"mkfifo {pid_file}",
        "dev-zero": f"ln -s /dev/zero {pid_file}",
    }[plant]
    body = (f"{SHOW_ENV}\ncolloc-simjob --mem 1G --seconds 1\n"
            f'rm -f "$CUDA_MPS_PIPE_DIRECTORY/control" {pid_file}\n{planting}\n'
            'echo "planted: $(ls -l $CUDA_MPS_PIPE_DIRECTORY)"')
    try:
        job = sbatch(cluster, workdir, body, "--gres=shard:2", user=ATTACKER)
        assert wait_for_jobs(slurm, [job], timeout=90)[str(job)] == "COMPLETED"
        out = (workdir / f"{job}.out").read_text()
        pipe = out.split("PIPE=")[1].split()[0]
        assert "planted" in out, out
        # the same GPU takes the next job at once: the epilog did not hang on the lock
        nxt = sbatch(cluster, workdir, "colloc-simjob --mem 1G --seconds 1", "--gres=shard:2",
                     user=VICTIM)
        assert wait_for_jobs(slurm, [nxt], timeout=90)[str(nxt)] == "COMPLETED"
        time.sleep(1)
        assert victim.poll() is None, "root signalled the victim's process"
        assert Path(f"/proc/{vpid}").exists()
        assert _our_daemons(pipe) == [], "an MPS daemon of the attacker was orphaned"
        assert f"job {job}: internal error" not in _log(cluster)
        assert node_state(cluster) in ("idle", "mix")
    finally:
        victim.kill()


def test_plain_multi_gpu_job_is_never_rewritten_to_shards(
    cluster: Cluster, slurm: SlurmCli, workdir: Path, users: None
) -> None:
    """M5: a ``gres:gpu:2`` job whose log shows an MPS error was requeued as shards."""
    job = sbatch(cluster, workdir,
                 'echo "RuntimeError: CUDA error: an illegal memory access was encountered"\n'
                 'echo "cudaErrorMpsServerNotReady" >&2; exit 1', "--gres=gpu:2", user=ATTACKER)
    assert wait_for_jobs(slurm, [job], timeout=90)[str(job)] == "FAILED"
    time.sleep(2)
    info = slurm.show_job(job) or {}
    assert info.get("Restarts") == "0", info
    assert "shard" not in str(info.get("TresPerNode", "")), info


def test_a_user_cannot_turn_a_pending_job_into_gpu_or_shard_requests(
    cluster: Cluster, slurm: SlurmCli, workdir: Path, users: None
) -> None:
    """M4: ``scontrol update`` of a plain pending job to gres/gpu:1 / gres/shard:200 (the
    spelling 24.11+ accepts, so only job_submit.lua stands in the way) or the old one."""
    job = sbatch(cluster, workdir, "true", "--hold", user=ATTACKER)
    try:
        for tres in ("gres/gpu:1", "gres/shard:200", "gres:shard:200"):
            cp = subprocess.run(
                ["runuser", "-u", ATTACKER, "--", "scontrol", "update", f"jobid={job}",
                 f"TresPerNode={tres}"],
                env=cluster.env(), capture_output=True, text=True, check=False,
            )
            info = slurm.show_job(job) or {}
            assert cp.returncode != 0 and tres not in str(info.get("TresPerNode")), (cp, info)
    finally:
        slurm.cancel([job])


def test_node_state_files_are_not_world_readable(cluster: Cluster) -> None:
    """Low: per-user MPS logs were root 0755 despite PrivateData=jobs."""
    tenancy = Tenancy(Path(cfgmod.load(cluster.layout.colloc_conf).mps_root))
    modes = []
    for gpu in range(cluster.spec.gpus):
        for uid in tenancy.users_on(gpu):
            log = tenancy.log_dir(gpu, uid)
            if log.exists():
                modes.append(log.stat().st_mode & 0o007)
    assert modes and set(modes) == {0}, modes


@pytest.mark.parametrize("escape", ["unset CUDA_MPS_PIPE_DIRECTORY",
                                    "unset CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"])
def test_a_job_that_drops_its_cap_cannot_take_the_gpu(
    cluster: Cluster, slurm: SlurmCli, workdir: Path, users: None, escape: str
) -> None:
    """H2: the cap was cooperative; ``unset`` and one tenant took the GPU, and the
    epilog then requeued its victims. Now the server-side limit (MPS) or the
    collector (outside MPS) stops the offender and the victim runs on."""
    from slurm_colloc.metrics import enforce

    victim = sbatch(cluster, workdir, "colloc-simjob --mem 1G --seconds 25", "--gres=shard:2",
                    user=VICTIM)
    time.sleep(3)
    gpu = (slurm.show_job(victim) or {}).get("GRES", "")
    attacker = sbatch(cluster, workdir, f"{escape}\ncolloc-simjob --mem 20G --seconds 20",
                      "--gres=shard:2", user=ATTACKER)
    cfg = cfgmod.load(cluster.layout.colloc_conf)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        verdict = enforce.verdict_for(cfg, attacker, 0)
        first = [ln for ln in _log(cluster).splitlines()
                 if f"epilog: job {attacker}:" in ln]
        if first or (verdict is not None and verdict.action == "killed"):
            break
        time.sleep(1)
    if "PIPE_DIRECTORY" in escape:  # outside MPS: the collector saw and killed it
        assert verdict is not None and verdict.action == "killed", (verdict, first)
        assert verdict.peak_mib > 2048 and verdict.outside_mps
    else:  # inside MPS: its user's server-side limit held, an ordinary GPU OOM at 2 GiB
        assert first and "cause=gpu-oom" in first[0], first
    slurm.cancel([attacker])
    assert wait_for_jobs(slurm, [victim], timeout=90)[str(victim)] == "COMPLETED", gpu
    info = slurm.show_job(victim) or {}
    assert info.get("Restarts") == "0", info  # the victim was never requeued
    assert node_state(cluster) in ("idle", "mix")


def test_prolog_refuses_a_gpu_the_controller_did_not_allocate(
    cluster: Cluster, slurm: SlurmCli, workdir: Path, users: None
) -> None:
    """The prolog starts MPS only where slurmd's SLURM_JOB_GPUS and the controller's
    allocation agree. On 24.11+ a shard job's ``gres_detail`` reads ``shard:3(3/39,...)``
    (no IDX): unparsed, the cross-check was silently skipped and a lying GPU index was
    accepted. Replayed with the real controller's JSON of a running shard job and the
    prolog run as slurmd runs it, with another GPU in its environment."""
    import pwd

    job = sbatch(cluster, workdir, "sleep 60", "--gres=shard:3", user=ATTACKER)
    try:
        deadline = time.monotonic() + 60
        while (j := slurm.job(job)) is None or j.state != "RUNNING":
            assert time.monotonic() < deadline, "the shard job did not start"
            time.sleep(0.5)
        assert j.allocated_gpus is not None and len(j.allocated_gpus) == 1, j
        real = j.allocated_gpus[0]
        other = (real + 1) % cluster.spec.gpus
        env = {**cluster.env(), "SLURM_JOB_ID": str(job),
               "SLURM_JOB_UID": str(pwd.getpwnam(ATTACKER).pw_uid),
               "SLURM_JOB_USER": ATTACKER, "SLURMD_NODENAME": cluster.spec.node_name,
               "SLURM_JOB_GPUS": str(other), "CUDA_VISIBLE_DEVICES": str(other)}
        cp = subprocess.run([str(cluster.layout.bin / "colloc-prolog")], env=env,
                            capture_output=True, text=True, check=False, timeout=60)
        assert cp.returncode == 0, cp  # never drain the node on our refusal
        refusal = [ln for ln in _log(cluster).splitlines()
                   if f"job {job}:" in ln and "not acting" in ln]
        assert any(f"slurmd bound GPUs [{other}]" in ln for ln in refusal), _log(cluster)[-3000:]
        tenancy = Tenancy(Path(cfgmod.load(cluster.layout.colloc_conf).mps_root))
        assert job not in tenancy.jobs_of(other, pwd.getpwnam(ATTACKER).pw_uid)
    finally:
        slurm.cancel([job])
        wait_for_jobs(slurm, [job], timeout=60)
