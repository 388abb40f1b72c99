"""The demo's site scene: the same recovery on a three-host cluster, read from the login host.

``colloc devcluster up --nodes 3`` (a separate devcluster from the one-node demo): the
host this runs on is the login node and controller; three compute hosts run in their
own namespaces. An unprivileged user with a home directory submits from the login
host:

* two long ``--colloc`` jobs fill part of both GPUs of colloc-node0 (40 GB);
* a job whose guess is too small runs next to one of them there, runs out of GPU
  memory, and comes back as a whole 40 GB GPU's worth of shards, which only
  colloc-node1 (80 GB) still has: it completes there;
* a plain ``--gres=gpu:1`` job is left as submitted and runs on colloc-node2, the host
  whose GPUs carry no shards;
* ``colloc-report``, run as the user on the login host, shows both attempts, with plots
  and the evidence, from Slurm's accounting alone.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from slurm_colloc.devcluster import hosts
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.devcluster.layout import Layout, Spec
from slurm_colloc.slurm.adapter import TERMINAL_STATES, SlurmCli, job_state

SITE_ROOT = Path("/var/lib/colloc-devcluster-site")
SITE_SPEC = Spec(nodes=3, gpus=2, ctld_port=17817, slurmd_port=17818, dbd_port=17819,
                 mysql_port=14306)
USER = "colloc-demo"


def _ensure_user(cluster: Cluster) -> Path:
    try:
        pw = pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--home-dir", f"/home/{USER}", "--shell",
                        "/bin/bash", USER], check=True)
        pw = pwd.getpwnam(USER)
    cluster.add_user(USER)
    home = Path(pw.pw_dir) / "site-demo"
    subprocess.run(["runuser", "-u", USER, "--", "mkdir", "-p", str(home)], check=True)
    return home


def _as_user(cluster: Cluster, argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["runuser", "-u", USER, "--", *argv], env=cluster.env(),
                          capture_output=True, text=True, check=False, cwd="/")


def _submit(cluster: Cluster, home: Path, name: str, body: str, *opts: str) -> int:
    script = home / f"{name}.sbatch"
    script.write_text(f"#!/bin/bash\n#SBATCH --job-name={name}\n{body}\n")
    os.chown(script, pwd.getpwnam(USER).pw_uid, -1)
    cp = _as_user(cluster, ["sbatch", "--parsable", f"--chdir={home}",
                            f"--output={home}/{name}-%j.out", *opts, str(script)])
    if cp.returncode != 0:
        raise RuntimeError(f"sbatch {name} failed: {cp.stderr.strip()}")
    return int(cp.stdout.strip().split(";")[0])


def _host(slurm: SlurmCli, job: int) -> str:
    return str((slurm.show_job(job) or {}).get("BatchHost") or "-")


def run(console: Console, root: Path = SITE_ROOT) -> bool:
    """Play the site scene; True when it showed what it should."""
    cluster = Cluster(Layout(root), SITE_SPEC)
    console.rule("Scene 6: a site - login host, controller, three compute hosts")
    secs = cluster.up()
    console.print(f"[green]three-host cluster up[/] in {secs:.1f}s (root {root}); this shell "
                  f"is the login host and controller ({SITE_SPEC.controller_addr()}):")
    console.print(hosts.describe(SITE_SPEC))
    console.print("Each compute host has its own network address, hostname, /var/lib/colloc, "
                  "/tmp and MPS directories; /home is shared, as on a site.\n")
    slurm = SlurmCli(env=cluster.env())
    home = _ensure_user(cluster)
    # a rerun starts from an empty cluster (an interrupted run may have left jobs)
    subprocess.run(["scancel", "-u", USER], env=cluster.env(), capture_output=True, check=False)
    time.sleep(2)
    n0, n1, n2 = (n.name for n in SITE_SPEC.node_plans())
    fillers = [_submit(cluster, home, f"long-{i}", "sleep 300", "--colloc-mem=20G")
               for i in range(2)]
    time.sleep(3)
    victim = _submit(cluster, home, "guessed-3g",
                     "colloc-simjob --mem 2G --peak 6G --peak-at 0.5 --seconds 8",
                     "--colloc-mem=3G")
    plain = _submit(cluster, home, "plain-gpu", "echo GPU $CUDA_VISIBLE_DEVICES", "--gres=gpu:1")
    console.print(f"As {USER}: two long --colloc-mem=20G jobs, a job guessed at 3 GiB that "
                  "needs 6, and a plain --gres=gpu:1 job (no --colloc).")
    seen: dict[int, list[str]] = {victim: []}
    states: dict[str, str] = {}
    deadline = time.monotonic() + 180
    try:
        while time.monotonic() < deadline:
            h = _host(slurm, victim)
            if h != "-" and (not seen[victim] or seen[victim][-1] != h):
                seen[victim].append(h)
            states = {str(j): job_state(slurm, j) for j in (victim, plain)}
            if all(s in TERMINAL_STATES for s in states.values()):
                break
            time.sleep(1)
    finally:
        slurm.cancel(fillers)
    table = Table("job", "id", "asked", "ran on", "state")
    table.add_row("long-0/1", f"{fillers[0]},{fillers[1]}", "--colloc-mem=20G",
                  f"{_host(slurm, fillers[0])}, {_host(slurm, fillers[1])}", "cancelled (demo)")
    table.add_row("guessed-3g", str(victim), "--colloc-mem=3G",
                  " then ".join(seen[victim]) or "-", states.get(str(victim), "?"))
    table.add_row("plain-gpu", str(plain), "--gres=gpu:1 (left as is)", _host(slurm, plain),
                  states.get(str(plain), "?"))
    console.print(table)
    # the last attempt's record lands in slurmdbd just after the job's end record
    report: dict[str, object] = {}
    for _ in range(30):
        cp = _as_user(cluster, ["colloc-report", str(victim), "--json"])
        report = json.loads(cp.stdout) if cp.returncode == 0 else {}
        attempts = report.get("attempts") or []
        if isinstance(attempts, list) and len(attempts) >= 2 and attempts[-1].get("samples"):
            break
        time.sleep(2)
    console.rule(f"colloc-report {victim}, run by {USER} on the login host")
    cp = _as_user(cluster, ["colloc-report", str(victim)])
    console.print(cp.stdout.rstrip() or cp.stderr.rstrip(), markup=False, highlight=False)
    attempts = report.get("attempts") or []
    nodes = [a.get("node") for a in attempts] if isinstance(attempts, list) else []
    ok = (nodes[:1] == [n0] and nodes[-1:] == [n1] and _host(slurm, plain) == n2
          and states.get(str(victim)) == "COMPLETED")
    verdict = ("[bold green]the OOM on one host was recovered on another, the plain GPU job "
               "kept its GPU to itself, and the login host saw it all from accounting[/]"
               if ok else f"[bold red]the site scene did not go as planned[/]: attempts on "
               f"{nodes}, plain job on {_host(slurm, plain)}")
    console.print(verdict)
    console.print(f"Explore it: eval \"$(.venv/bin/colloc devcluster env --root {root})\"; "
                  f"colloc devcluster exec {n0} -- ls {cluster.layout.colloc_var}/evidence\n"
                  f"Stop it:    .venv/bin/colloc devcluster down --root {root}")
    return ok
