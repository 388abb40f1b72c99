"""Node path on the devcluster: MPS limits, GPU-OOM requeue, evidence, failure safety."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_colloc import config as cfgmod
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.devcluster.slurm_release import installed_version
from slurm_colloc.mps.tenancy import Tenancy
from slurm_colloc.node.prolog import ABSENT_GRACE_S
from slurm_colloc.slurm.adapter import SlurmCli, wait_for_jobs
from tests.e2e.conftest import ensure_user, node_state, sbatch

pytestmark = pytest.mark.devcluster

SHOW_ENV = 'echo "LIMIT=$CUDA_MPS_PINNED_DEVICE_MEM_LIMIT PIPE=$CUDA_MPS_PIPE_DIRECTORY GPU=$CUDA_VISIBLE_DEVICES"'


def _cfg(cluster: Cluster) -> cfgmod.CollocConfig:
    return cfgmod.load(cluster.layout.colloc_conf)


def _wait_final(slurm: SlurmCli, job: int, timeout: float = 120) -> str:
    """Wait through requeues: terminal state with no pending restart."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = wait_for_jobs(slurm, [job], timeout=timeout)[str(job)]
        time.sleep(1.5)  # an epilog may requeue right after the state turns final
        info = slurm.show_job(job) or {}
        if info.get("JobState") == state:
            return state
    raise TimeoutError(f"job {job} did not settle")


def _story_causes(cluster: Cluster, job: int) -> list[str | None]:
    """Each attempt's cause word in ``colloc-report --json`` (issue 27's story)."""
    out = subprocess.run([str(cluster.venv_bin / "colloc-report"), str(job), "--json"],
                         env=cluster.env(), capture_output=True, text=True, check=False,
                         timeout=60).stdout
    d = json.loads(out) if out.strip().startswith("{") else {}
    return [(a.get("story") or {}).get("cause") for a in d.get("attempts") or []]


def _wait_causes(cluster: Cluster, job: int, want: list[str], timeout: float = 90) -> None:
    """Until the job's report tells ``want`` (its record is written by a detached writer)."""
    deadline, got = time.monotonic() + timeout, _story_causes(cluster, job)
    while got != want and time.monotonic() < deadline:
        time.sleep(2)
        got = _story_causes(cluster, job)
    assert got == want, f"job {job}: report causes {got}, expected {want}"


def _gpu_of(slurm: SlurmCli, job: int) -> int | None:
    """The GPU index the controller gave a running job (typed JSON, any release)."""
    j = slurm.job(job)
    gpus = j.allocated_gpus if j is not None else None
    return sorted(gpus)[0] if gpus else None


def _wait_running(slurm: SlurmCli, jobs: list[int], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(str((slurm.show_job(j) or {}).get("JobState")) == "RUNNING" for j in jobs):
            return
        time.sleep(0.5)
    raise TimeoutError(f"jobs {jobs} did not all start")


@contextlib.contextmanager
def _one_gpu_with_room(cluster: Cluster, slurm: SlurmCli, workdir: Path) -> Iterator[None]:
    """Fill three of the four GPUs to 35 of 39 shards while the body submits, so that
    least-loaded placement (LL_SHARED_GRES) puts the body's jobs on the fourth GPU
    together; the fillers are cancelled when the body is done (its jobs running)."""
    fillers = [sbatch(cluster, workdir, "sleep 300", "--gres=shard:35") for _ in range(3)]
    try:
        _wait_running(slurm, fillers)
        yield
    finally:
        slurm.cancel(fillers)
        wait_for_jobs(slurm, fillers, timeout=60)


def test_shard_jobs_spread_over_idle_gpus(
    cluster: Cluster, slurm: SlurmCli, workdir: Path
) -> None:
    """LL_SHARED_GRES (23.11+, in the generated slurm.conf): each shard job goes to the
    GPU with the most shards free, so four jobs on four idle GPUs take one GPU each
    (22.05's first fit put them all on GPU 0)."""
    jobs = [sbatch(cluster, workdir, "sleep 20", "--gres=shard:4") for _ in range(4)]
    try:
        _wait_running(slurm, jobs)
        gpus = [_gpu_of(slurm, j) for j in jobs]
        assert None not in gpus and len(set(gpus)) == 4, gpus
    finally:
        slurm.cancel(jobs)
        wait_for_jobs(slurm, jobs, timeout=60)


def test_collocated_jobs_share_one_gpu_within_their_limits(
    cluster: Cluster, slurm: SlurmCli, workdir: Path
) -> None:
    with _one_gpu_with_room(cluster, slurm, workdir):
        jobs = [
            sbatch(cluster, workdir, f"{SHOW_ENV}\ncolloc-simjob --mem {mem}G --seconds 10",
                   f"--gres=shard:{shards}")
            for mem, shards in ((6, 8), (10, 12), (3, 4))
        ]
        _wait_running(slurm, jobs)
    gpus = [_gpu_of(slurm, j) for j in jobs]
    states = wait_for_jobs(slurm, jobs, timeout=90)
    assert set(states.values()) == {"COMPLETED"}, states
    assert None not in gpus and len(set(gpus)) == 1, gpus  # one GPU, shared
    outs = [(workdir / f"{j}.out").read_text() for j in jobs]
    # pinned limits: shards less one CUDA context (512 MiB), which MPS does not count
    assert "LIMIT=0=7680M" in outs[0] and "LIMIT=0=11776M" in outs[1]
    # the client names its GPU by UUID, never by the index MPS would remap
    assert all("GPU=GPU-" in o for o in outs), outs
    assert all("co-tenants 2" in o for o in outs), "the three jobs ran side by side"
    tenancy = Tenancy(Path(_cfg(cluster).mps_root))
    assert tenancy.all_jobs() == {}, "every epilog released its MPS registration"


def test_oom_over_limit_is_requeued_on_a_whole_gpu_and_completes(
    cluster: Cluster, slurm: SlurmCli, workdir: Path
) -> None:
    job = sbatch(cluster, workdir,
                 f"{SHOW_ENV}\necho attempt=${{SLURM_RESTART_COUNT:-0}}\n"
                 "colloc-simjob --mem 3G --peak 9G --peak-at 0.3 --seconds 2",
                 "--gres=shard:6")
    assert _wait_final(slurm, job) == "COMPLETED"
    info = slurm.show_job(job) or {}
    assert info["Restarts"] == "1"
    assert "gres/shard:39" in info["TresPerNode"]  # all a 40 GiB GPU has for jobs
    final = (workdir / f"{job}.out").read_text()
    assert "attempt=1" in final and "LIMIT=0=39424M" in final
    evidence = Path(_cfg(cluster).evidence_dir) / str(job) / "attempt0"
    kept = "".join(p.read_text() for p in evidence.iterdir())
    assert "torch.OutOfMemoryError: CUDA out of memory" in kept  # first attempt survives
    assert "attempt=0" in kept
    recs = slurm.accounting([job])
    # the OOM'd attempt: 24.11 files a requeued finished job's attempt as REQUEUED,
    # 26.05 as the state it ended in (the requeue came from the epilog, after the end)
    first = "REQUEUED" if installed_version() < (26, 5) else "FAILED"
    assert [r.state for r in recs] == [first, "COMPLETED"], recs


def test_an_oom_recovery_runs_ahead_of_jobs_queued_before_it(
    cluster: Cluster, slurm: SlurmCli, workdir: Path
) -> None:
    """issue 25 item 4: the requeued job goes back with Nice=-recovery_nice, so when
    its GPU comes wholly free it starts before three jobs that were queued for that
    room before its OOM (Slurm's own priority; no private queue). Without the boost the
    requeue's new submit time puts it behind them, and a 30-shard job takes the GPU."""
    blockers = [sbatch(cluster, workdir, "sleep 300", "--gres=shard:35") for _ in range(3)]
    jobs = list(blockers)
    try:
        _wait_running(slurm, blockers)
        # it OOMs about 5 s in: long enough for the holder to start beside it and the
        # queued jobs to be submitted first (at 0.6 s in, CI on 24.11 saw the holder
        # start only after the OOM)
        oom = sbatch(cluster, workdir, "colloc-simjob --mem 2G --peak 9G --peak-at 0.6 --seconds 8",
                     "--gres=shard:6")
        holder = sbatch(cluster, workdir, "sleep 25", "--gres=shard:30")
        jobs += [oom, holder]
        _wait_running(slurm, [oom, holder])
        queued = [sbatch(cluster, workdir, "sleep 300", "--gres=shard:30") for _ in range(3)]
        jobs += queued
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            info = slurm.show_job(oom) or {}
            if info.get("Restarts") == "1" and info.get("JobState") == "RUNNING":
                break
            time.sleep(1)
        info = slurm.show_job(oom) or {}
        assert info.get("Restarts") == "1" and info.get("JobState") == "RUNNING", info
        assert info["Nice"] == f"-{_cfg(cluster).recovery_nice}", info
        assert "gres/shard:39" in info["TresPerNode"]
        waiting = [(slurm.show_job(q) or {}).get("JobState") for q in queued]
        assert waiting == ["PENDING"] * 3, f"a queued job took the GPU first: {waiting}"
    finally:
        slurm.cancel(jobs)
        wait_for_jobs(slurm, jobs, timeout=60)


def test_oom_on_a_whole_gpu_is_not_requeued(
    cluster: Cluster, slurm: SlurmCli, workdir: Path
) -> None:
    job = sbatch(cluster, workdir, "colloc-simjob --mem 2G --peak 50G --seconds 1", "--gres=gpu:1")
    assert _wait_final(slurm, job) == "FAILED"
    assert (slurm.show_job(job) or {})["Restarts"] == "0"
    log = (cluster.layout.log / "colloc.log").read_text()
    assert f"job {job}: cause=gpu-oom" in log and "not requeued" in log


def test_host_oom_is_not_mistaken_for_gpu_oom(
    cluster: Cluster, slurm: SlurmCli, workdir: Path
) -> None:
    body = ("echo 'RuntimeError: DataLoader worker (pid 4242) is killed by signal: Killed.'\n"
            "echo 'slurmstepd: error: Detected 1 oom_kill event in StepId=1.batch.' >&2\nexit 1")
    job = sbatch(cluster, workdir, body, "--gres=shard:4")
    assert _wait_final(slurm, job) == "FAILED"
    assert (slurm.show_job(job) or {})["Restarts"] == "0"
    assert not (Path(_cfg(cluster).evidence_dir) / str(job) / "attempt0" / "x").exists()
    log = (cluster.layout.log / "colloc.log").read_text()
    assert f"job {job}: cause=host-oom" in log


@pytest.mark.parametrize("script", ["prolog", "task_prolog", "epilog"])
def test_internal_error_never_drains_the_node(
    cluster: Cluster, slurm: SlurmCli, workdir: Path, script: str
) -> None:
    conf = cluster.layout.colloc_conf
    original = conf.read_text()
    conf.write_text(original + f'\n[extra]\ntest_fault_inject = "{script}"\n')
    try:
        job = sbatch(cluster, workdir, "colloc-simjob --mem 1G --seconds 1", "--gres=shard:2")
        assert _wait_final(slurm, job) == "COMPLETED"
    finally:
        conf.write_text(original)
    assert node_state(cluster) in ("idle", "mix"), node_state(cluster)
    if script != "task_prolog":
        log = (cluster.layout.log / "colloc.log").read_text()
        assert f"job {job}: internal error" in log


def test_two_users_on_one_gpu_never_stall_each_other(
    cluster: Cluster, slurm: SlurmCli, workdir: Path
) -> None:
    for u in ("colloc-u1", "colloc-u2"):
        ensure_user(cluster, u)
    t0 = time.monotonic()
    with _one_gpu_with_room(cluster, slurm, workdir):
        jobs = [
            sbatch(cluster, workdir, "colloc-simjob --mem 4G --seconds 5", "--gres=shard:6",
                   user=u)
            for u in ("colloc-u1", "colloc-u2")
        ]
        _wait_running(slurm, jobs)
    gres = [_gpu_of(slurm, j) for j in jobs]
    states = wait_for_jobs(slurm, jobs, timeout=60)
    outs = [(workdir / f"{j}.out").read_text() for j in jobs]
    assert set(states.values()) == {"COMPLETED"}, (states, outs)
    assert None not in gres and len(set(gres)) == 1, gres
    assert time.monotonic() - t0 < 30, "neither job waited for the other user's MPS server"
    assert all("co-tenants 1" in o for o in outs), "both ran on the GPU at the same time"


def test_twenty_jobs_ending_together_are_all_handled(
    cluster: Cluster, slurm: SlurmCli, workdir: Path
) -> None:
    jobs = [sbatch(cluster, workdir, "colloc-simjob --mem 1G --seconds 3", "--gres=shard:2")
            for _ in range(20)]
    states = wait_for_jobs(slurm, jobs, timeout=180)
    assert list(states.values()).count("COMPLETED") == 20, states
    time.sleep(2)
    tenancy = Tenancy(Path(_cfg(cluster).mps_root))
    assert tenancy.all_jobs() == {}
    for gpu in range(cluster.spec.gpus):
        for uid in tenancy.users_on(gpu):
            pid_file = tenancy.pipe_dir(gpu, uid) / "nvidia-cuda-mps-control.pid"
            assert not pid_file.exists(), f"MPS daemon left running on GPU {gpu}"
    assert node_state(cluster) in ("idle", "mix")


def test_whole_gpu_jobs_never_land_next_to_shared_jobs(
    cluster: Cluster, slurm: SlurmCli, workdir: Path
) -> None:
    """Slurm 22.05 alone would give a --gres=gpu:1 job a GPU that shard jobs are using."""
    shared = [sbatch(cluster, workdir, "colloc-simjob --mem 2G --seconds 20", "--gres=shard:5")
              for _ in range(3)]
    time.sleep(2)
    whole = [sbatch(cluster, workdir, f"{SHOW_ENV}\ncolloc-simjob --mem 30G --seconds 2",
                    "--gres=gpu:1") for _ in range(4)]
    # poll (a loaded machine schedules late) while the shared jobs surely still run
    deadline = time.monotonic() + 15
    while True:
        gpu_of = {j: _gpu_of(slurm, j) for j in shared + whole}
        running_whole = [j for j in whole if gpu_of[j] is not None]
        if running_whole or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    shared_gpus = {gpu_of[j] for j in shared if gpu_of[j] is not None}
    assert running_whole, gpu_of
    assert not shared_gpus & {gpu_of[j] for j in running_whole}, gpu_of
    states = wait_for_jobs(slurm, shared + whole, timeout=120)
    assert set(states.values()) == {"COMPLETED"}, states
    out = (workdir / f"{whole[0]}.out").read_text()
    assert "LIMIT= PIPE=" in out  # a whole GPU runs without MPS


def test_stale_registrations_from_a_crashed_epilog_are_reaped(
    cluster: Cluster, slurm: SlurmCli, workdir: Path
) -> None:
    tenancy = Tenancy(Path(_cfg(cluster).mps_root))
    for gpu in range(cluster.spec.gpus):  # as if an epilog died before releasing job 999999
        tenancy.prepare_user_dirs(gpu, 0)
        tenancy.add_job(gpu, 0, 999999)
        # and an earlier prolog already found it missing from the controller's list
        # (written, not absent_since(): a prolog of the previous test's jobs may have
        # just recorded a fresh time, which absent_since would keep)
        absent = tenancy.user_dir(gpu, 0) / "absent"
        absent.mkdir(exist_ok=True)
        (absent / "999999").write_text(f"{time.time() - 2 * ABSENT_GRACE_S}\n")
    job = sbatch(cluster, workdir, 'echo "GPU=$COLLOC_GPU"', "--gres=shard:2")
    assert wait_for_jobs(slurm, [job], timeout=60)[str(job)] == "COMPLETED"
    gpu = int((workdir / f"{job}.out").read_text().split("GPU=")[1].split()[0])
    assert 999999 not in tenancy.jobs_of(gpu, 0)  # reaped by the prolog of the GPU's next job
    tenancy.remove_job(999999)  # tidy the GPUs no job visited


def test_mps_fault_kills_every_client_victim_recovers_culprit_stops(
    cluster: Cluster, slurm: SlurmCli, workdir: Path
) -> None:
    """One client's fatal fault reaches every client of the GPU's MPS server (simulated
    as Volta+ MPS does it). Both jobs show the same illegal-address error; both are
    requeued on a GPU of their own; the culprit faults again alone and stops there,
    the victim completes."""
    # each attempt's environment in a file of its own: the job's output file is shared
    # by stdout and stderr, and the kept evidence is its tail (CI on 24.11 once kept no
    # LIMIT= line)
    env_file = f"{workdir}/env-$SLURM_JOB_ID-${{SLURM_RESTART_COUNT:-0}}.txt"
    body = (f"{SHOW_ENV}\n{SHOW_ENV} > {env_file}\n"
            "echo attempt=${SLURM_RESTART_COUNT:-0}\n")
    with _one_gpu_with_room(cluster, slurm, workdir):
        victim = sbatch(cluster, workdir, body + "colloc-simjob --mem 2G --seconds 12",
                        "--gres=shard:8")
        time.sleep(1)
        culprit = sbatch(cluster, workdir,
                         body + "colloc-simjob --mem 2G --seconds 12 --fault-at 0.4",
                         "--gres=shard:8")
        _wait_running(slurm, [victim, culprit])
    assert _wait_final(slurm, culprit, timeout=180) == "FAILED"
    assert _wait_final(slurm, victim, timeout=180) == "COMPLETED"
    v, c = slurm.show_job(victim) or {}, slurm.show_job(culprit) or {}
    assert v["Restarts"] == "1" and "gres/shard:39" in v["TresPerNode"]
    assert c["Restarts"] == "1" and "gres/shard:39" in c["TresPerNode"]
    cfg = _cfg(cluster)
    servers = set()
    for job in (victim, culprit):
        kept = "".join(p.read_text() for p in (Path(cfg.evidence_dir) / str(job) / "attempt0")
                       .iterdir())
        assert "CUDA error: an illegal memory access was encountered" in kept, job
        env = (workdir / f"env-{job}-0.txt").read_text().strip()
        servers.add(env.split(" ", 1)[1])  # "PIPE=<dir of the GPU's MPS daemon> GPU=<n>"
    assert len(servers) == 1, servers  # both were clients of one MPS server
    log = (cluster.layout.log / "colloc.log").read_text()
    assert f"job {victim}: cause=cuda-fatal" in log
    assert f"job {culprit}: cause=cuda-fatal" in log and "fatal CUDA error on a GPU of its own" in log
    assert "attempt=1" in (workdir / f"{victim}.out").read_text()
    # issue 27: the victim's report says the fault was most likely a co-tenant's (its
    # attempt on a GPU of its own completed); the culprit's stays its own fatal error
    _wait_causes(cluster, victim, ["co-tenant", "completed"])
    _wait_causes(cluster, culprit, ["cuda-fatal", "cuda-fatal"])


def _script_servers(cluster: Cluster) -> list[int]:
    """Pids of this cluster's script server (its env names this cluster's config)."""
    needle = f"COLLOC_CONF={cluster.layout.colloc_conf}".encode()
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes()
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"slurm_colloc.node.script_server" in cmd and needle in env:
            out.append(int(entry.name))
    return out


def test_prologs_are_served_and_a_killed_server_costs_nothing(
    cluster: Cluster, slurm: SlurmCli, workdir: Path
) -> None:
    """Issue 28 (burst): the node's script server runs the Prolog and Epilog; SIGKILLed,
    the next job's scripts run themselves, start another server, and the job still gets
    MPS and its limit."""
    log = cluster.layout.log / "colloc.log"
    first = sbatch(cluster, workdir, "colloc-simjob --mem 1G --seconds 1", "--gres=shard:2")
    assert _wait_final(slurm, first) == "COMPLETED"
    servers = _script_servers(cluster)
    assert servers, "no script server after a job's prolog"
    assert "script-server: job -: serving " in log.read_text()
    for pid in servers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    served_before = log.read_text().count("script-server: job -: serving ")
    job = sbatch(cluster, workdir, SHOW_ENV + "; colloc-simjob --mem 1G --seconds 1",
                 "--gres=shard:2")
    assert _wait_final(slurm, job) == "COMPLETED"
    out = (workdir / f"{job}.out").read_text()
    assert "LIMIT=0=" in out and "PIPE=/" in out, out
    text = log.read_text()
    assert f"prolog: job {job}: shared " in text
    deadline = time.monotonic() + 30
    while log.read_text().count("script-server: job -: serving ") <= served_before:
        assert time.monotonic() < deadline, "no new script server after the kill"
        time.sleep(0.5)
    assert node_state(cluster) in ("idle", "mix"), node_state(cluster)
