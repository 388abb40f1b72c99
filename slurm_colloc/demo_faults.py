"""Demo scene 5b: parts of the cluster die under a job, and nothing is lost (issue 28).

A collocated job runs while the collector's supervisor is SIGKILLed (its orphaned
worker starts a new one: sampling and enforcement are back within seconds), and
slurmdbd is SIGKILLed before the job ends: the job's record waits in root's spool
(``colloc admin records`` lists it) and reaches accounting after slurmdbd is started
again, the way ``colloc devcluster restart slurmdbd`` does. The whole table of faults
is ``benchmarks/faults.py`` (docs/benchmarks.md, "Faults").
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from slurm_colloc import config as cfgmod
from slurm_colloc.accounting.field import record_in
from slurm_colloc.devcluster import daemons
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.metrics import liveness
from slurm_colloc.slurm.adapter import SlurmCli, SlurmError, by_start, job_state

JOB = "#!/bin/bash\ncolloc-simjob --mem 2G --seconds 25\n"


def _wait(cond: Callable[[], bool], timeout: float, step: float = 0.2) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        time.sleep(step)
    return None


def _sampling_after(metrics_dir: str, t_wall: float) -> bool:
    age = liveness.heartbeat_age(metrics_dir)
    return (liveness.collector_running(metrics_dir) and age is not None
            and age < time.time() - t_wall)


def _kill_supervisor(console: Console, metrics_dir: str) -> bool:
    if _wait(lambda: _sampling_after(metrics_dir, time.time() - 3), 60) is None:
        console.print("  [red]the collector never sampled the job[/]")
        return False
    sup, _ = liveness.read_pids(metrics_dir)
    if sup is None:
        console.print("  [red]no collector supervisor to kill[/]")
        return False
    killed = time.time()
    os.kill(sup, signal.SIGKILL)
    back = _wait(lambda: _sampling_after(metrics_dir, killed), 30, 0.1)
    ok = back is not None and back <= 10
    console.print(f"  SIGKILL of the collector's supervisor (pid {sup}): sampling and "
                  f"enforcement back after [{'green' if ok else 'red'}]"
                  f"{'never' if back is None else f'{back:.1f} s'}[/] (target 10 s; "
                  "the orphaned worker starts a new supervisor)")
    return ok


def _recorded(slurm: SlurmCli, job: int, cfg: cfgmod.CollocConfig) -> bool:
    try:
        rows = by_start(slurm.accounting([job]))
    except SlurmError:
        return False
    return any(record_in(r.fields, cfg.record_field) for r in rows)


def _records_listing(cluster: Cluster) -> str:
    cp = subprocess.run([str(cluster.venv_bin / "colloc"), "admin", "records"], env=cluster.env(),
                        capture_output=True, text=True, check=False, timeout=60)
    return (cp.stdout or cp.stderr).strip()


def _accounting_outage(console: Console, cluster: Cluster, slurm: SlurmCli, job: int,
                       cfg: cfgmod.CollocConfig) -> bool:
    dbd = next(d for d in cluster.daemons() if d.name == "slurmdbd")
    pid = daemons.read_pid(dbd.pid_file)
    if pid is None:
        console.print("  [red]slurmdbd is not running[/]")
        return False
    os.kill(pid, signal.SIGKILL)
    console.print(f"  SIGKILL of slurmdbd (pid {pid}) while job {job} runs")
    _wait(lambda: job_state(slurm, job) not in ("RUNNING", "PENDING", "COMPLETING"), 120, 1)
    _wait(lambda: f"{job}" in _records_listing(cluster), 60, 1)
    for line in _records_listing(cluster).splitlines()[:4]:
        short = line if len(line) <= 100 else line[:97] + "..."
        console.print(f"    [dim]colloc admin records:[/] {short}", overflow="ellipsis",
                      no_wrap=True)
    cluster.restart("slurmdbd", timeout=120)
    took = _wait(lambda: _recorded(slurm, job, cfg), 180, 2)
    ok = took is not None and took <= 120
    console.print(f"  slurmdbd started again: job {job}'s record reached accounting after "
                  f"[{'green' if ok else 'red'}]{'never' if took is None else f'{took:.1f} s'}"
                  "[/] (target 2 minutes; nothing lost)")
    return ok


def fault_scene(console: Console, cluster: Cluster, slurm: SlurmCli, workdir: Path) -> bool:
    """Scene 5b; True when sampling came back and the record reached accounting."""
    console.rule("Scene 5b: daemons die under a job; nothing is lost")
    cfg = cfgmod.load(cluster.layout.colloc_conf)
    script = workdir / "fault-demo.sh"
    script.write_text(JOB)
    script.chmod(0o755)
    cp = subprocess.run(["sbatch", "--parsable", "--colloc-mem=2G", f"--chdir={workdir}",
                         f"--output={workdir}/%j.out", str(script)], env=cluster.env(),
                        capture_output=True, text=True, check=False, timeout=60)
    if cp.returncode != 0:
        console.print(f"  [red]sbatch failed: {cp.stderr.strip()}[/]")
        return False
    job = int(cp.stdout.strip().split(";")[0])
    console.print(f"  job {job}: colloc-simjob --mem 2G --seconds 25 (sbatch --colloc-mem=2G)")
    ok = _kill_supervisor(console, cfg.metrics_dir)
    try:
        ok = _accounting_outage(console, cluster, slurm, job, cfg) and ok
    finally:
        cluster.up(install=False, timeout=120)  # whatever the scene left down
    return ok
