"""Demo scene: a job tries to switch enforcement off (issue 23), and fails.

One unprivileged user's job does what switched root's enforcement off before issue 23:
it exports a 5,000-digit ``SLURM_RESTART_COUNT`` (that killed the node collector for
good), plants a 1,500-deep directory tree in its MPS pipe directory (that crashed the
next prolog for that user and GPU), then leaves MPS and takes 20 GiB of a GPU on which
it holds 2. The scene shows the collector still running and killing the job, and the
planted tree gone after the job. docs/security.md has the whole list.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from rich.console import Console

from slurm_colloc import config as cfgmod
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.metrics import enforce, liveness
from slurm_colloc.slurm.adapter import SlurmCli, job_state

ATTACK = r"""#!/bin/bash
export SLURM_RESTART_COUNT=$(printf '7%.0s' $(seq 5000))
PY="$(dirname "$(command -v colloc)")/python"
"$PY" - "$CUDA_MPS_PIPE_DIRECTORY" <<'EOF'
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
os.mkdir("planted", dir_fd=fd)
for name in ["planted"] + ["d"] * 1500:
    if name == "d":
        os.mkdir("d", dir_fd=fd)
    nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
    os.close(fd)
    fd = nfd
print("planted a tree 1,500 deep")
EOF
echo "PIPE=$CUDA_MPS_PIPE_DIRECTORY"
unset CUDA_MPS_PIPE_DIRECTORY
colloc-simjob --mem 20G --seconds 60
"""


def _wait(what: object, timeout: float) -> object:
    """Poll ``what()`` (a callable) until it returns something true or time runs out."""
    deadline = time.monotonic() + timeout
    got = None
    while time.monotonic() < deadline:
        got = what()  # type: ignore[operator]
        if got:
            return got
        time.sleep(1)
    return got


def enforcement_scene(console: Console, cluster: Cluster, slurm: SlurmCli, workdir: Path,
                      user: str) -> bool:
    """Play the scene as ``user`` in ``workdir`` (world-writable); True when it held."""
    cfg = cfgmod.load(cluster.layout.colloc_conf)
    console.print(f"\n  {user} submits a 2 GiB job that exports a 5,000-digit "
                  "SLURM_RESTART_COUNT,\n  plants a 1,500-deep tree in its MPS pipe directory, "
                  "then leaves MPS and takes 20 GiB.")
    script = workdir / "switch-off.sh"
    script.write_text(ATTACK)
    script.chmod(0o755)
    cp = subprocess.run(
        ["runuser", "-u", user, "--", "sbatch", "--parsable", f"--chdir={workdir}",
         f"--output={workdir}/switch-off-%j.out", "--colloc-mem=2G", str(script)],
        env=cluster.env(), capture_output=True, text=True, check=False)
    try:
        job = int(cp.stdout.strip().split(";")[0])
    except ValueError:
        console.print(f"  [red]the scene could not run: {cp.stderr.strip()}[/]")
        return False
    try:
        verdict = _wait(lambda: (v := enforce.verdict_for(cfg, job, 0)) and v.action == "killed"
                        and v, 90)
    finally:
        slurm.cancel([job])
    _wait(lambda: job_state(slurm, job) not in ("PENDING", "RUNNING", "CONFIGURING",
                                                "COMPLETING", "REQUEUED"), 60)
    out = Path(workdir / f"switch-off-{job}.out")
    text = out.read_text(errors="replace") if out.exists() else ""
    pipe = next((ln.split("=", 1)[1] for ln in text.splitlines() if ln.startswith("PIPE=")), "")
    planted = Path(pipe) / "planted" if pipe else None
    gone = bool(_wait(lambda: planted is not None and not os.path.lexists(planted), 60))
    running = liveness.collector_running(cfg.metrics_dir)
    killed = isinstance(verdict, enforce.Verdict)
    if killed:
        assert isinstance(verdict, enforce.Verdict)
        console.print(f"  job {job}: [green]killed by the collector[/] at "
                      f"{verdict.peak_mib / 1024:.1f} GiB of its 2 GiB "
                      f"({'outside MPS' if verdict.outside_mps else 'inside MPS'}); "
                      f"collector {'[green]still running[/]' if running else '[red]gone[/]'}")
    else:
        console.print(f"  job {job}: [red]no kill verdict[/] ({verdict}); "
                      f"see {cluster.layout.log}/colloc.log")
    console.print(f"  the tree it planted under root's MPS tree after the job: "
                  f"{'[green]gone[/]' if gone else '[red]still there[/]'}")
    return killed and running and gone
