"""The ``make demo`` story: collocated training jobs on a local Slurm with simulated GPUs.

Scenes (each uses the real sbatch/slurmctld/slurmd/slurmdbd and colloc's node scripts):
1. Three training jobs ask for shards of a GPU; Slurm packs them onto one GPU and
   colloc runs them under MPS, each capped at its share. We watch GPU memory live.
2. One of them outgrows its share: it crashes with PyTorch's CUDA OOM, the epilog
   keeps its log and requeues it on a whole GPU, it completes; its neighbours are
   untouched.
3. Accounting (sacct) shows every attempt.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from slurm_colloc import config as cfgmod
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.gpu.sim.backend import SimBackend
from slurm_colloc.slurm.adapter import SlurmCli, job_state


@dataclass(frozen=True)
class DemoJob:
    """One job of the demo mix."""

    name: str
    shards: int
    command: str
    story: str


MIX = (
    DemoJob("resnet18-cifar", 8, "colloc-simjob --mem 5G --sm-activity 45 --seconds 25",
            "steady 5 GiB, fits its 8-shard share"),
    DemoJob("mobilenet-imagenet", 10, "colloc-simjob --mem 7G --sm-activity 40 --seconds 25",
            "steady 7 GiB, fits its 10-shard share"),
    DemoJob("bert-finetune", 6,
            "colloc-simjob --mem 4G --peak 14G --peak-at 0.3 --sm-activity 50 --seconds 20",
            "estimated 6 GiB but grows to 14 GiB: will hit its MPS limit"),
)


def _sbatch(cluster: Cluster, workdir: Path, job: DemoJob) -> int:
    script = workdir / f"{job.name}.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        f"#SBATCH --job-name={job.name}\n"
        f"#SBATCH --gres=shard:{job.shards}\n"
        f"#SBATCH --output={workdir}/{job.name}-%j.out\n"
        'echo "attempt ${SLURM_RESTART_COUNT:-0} on GPU $CUDA_VISIBLE_DEVICES, '
        'MPS limit $CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"\n'
        f"{job.command}\n"
    )
    cp = subprocess.run(["sbatch", "--parsable", str(script)], env=cluster.env(),
                        capture_output=True, text=True, check=True)
    return int(cp.stdout.strip().split(";")[0])


def run(console: Console, root: Path | None = None) -> int:
    """Bring the devcluster up and play the scenes; return a process exit code."""
    cluster = Cluster.at(root) if root else Cluster.at()
    console.rule("[bold]slurm-colloc demo: GPU sharing on a local Slurm cluster")
    console.print("Bringing up munged, MariaDB, slurmdbd, slurmctld, slurmd "
                  "(4 simulated A100 40 GB GPUs, 40 shards of 1 GiB each)...")
    secs = cluster.up()
    console.print(f"[green]cluster up[/] in {secs:.1f}s (root {cluster.layout.root})\n")
    slurm = SlurmCli(env=cluster.env())
    cfg = cfgmod.load(cluster.layout.colloc_conf)
    backend = SimBackend(Path(cfg.sim_state_dir))
    workdir = cluster.layout.root / "demo"
    workdir.mkdir(exist_ok=True)

    console.rule("Scene 1: three training jobs share one GPU under MPS")
    ids = {}
    for job in MIX:
        ids[job.name] = _sbatch(cluster, workdir, job)
        console.print(f"  sbatch --gres=shard:{job.shards} {job.name:20s} -> job "
                      f"{ids[job.name]}  ({job.story})")
    console.print()
    seen_oom = False
    deadline = time.monotonic() + 240
    last_print = 0.0
    while time.monotonic() < deadline:
        states = {n: job_state(slurm, j) for n, j in ids.items()}
        if time.monotonic() - last_print > 3:
            last_print = time.monotonic()
            samples = [s for s in backend.sample_all() if s.memory_used_mib or s.processes]
            line = "  ".join(
                f"GPU{s.index}: {s.memory_used_mib / 1024:4.1f} GiB "
                f"{len(s.processes)} proc SM {s.sm_activity_pct or 0:3.0f}%" for s in samples
            ) or "GPUs idle"
            st = " ".join(f"{n.split('-')[0]}={v}" for n, v in states.items())
            console.print(f"  [dim]{time.strftime('%H:%M:%S')}[/] {line:60s} | {st}")
        bert = (slurm.show_job(ids["bert-finetune"]) or {})
        if bert.get("Restarts", "0") != "0" and not seen_oom:
            seen_oom = True
            console.print("  [yellow]bert-finetune ran out of GPU memory[/]: the epilog kept "
                          "its log and requeued it on a whole GPU (40 shards)")
        if all(v in ("COMPLETED", "FAILED", "CANCELLED") for v in states.values()) and (
            bert.get("JobState") == states["bert-finetune"]
        ):
            break
        time.sleep(1)

    console.rule("Scene 2: what happened to each job (from sacct)")
    table = Table("job", "id", "attempt", "state", "GPU request", "exit")
    for name, jid in ids.items():
        for i, rec in enumerate(slurm.accounting([jid])):
            tres = rec.fields.get("AllocTRES", "")
            share = next((t for t in tres.split(",") if t.startswith("gres/")), "-")
            table.add_row(name, str(jid), str(i), rec.state, share, rec.exit_code)
    console.print(table)
    bert_id = ids["bert-finetune"]
    evidence = Path(cfg.evidence_dir) / str(bert_id) / "attempt0"
    if evidence.is_dir():
        console.print(f"\nThe first attempt's output was kept in {evidence}:")
        for p in sorted(evidence.iterdir()):
            oom = [ln for ln in p.read_text(errors="replace").splitlines() if "OutOfMemory" in ln]
            for ln in oom[:1]:
                console.print(f"  [red]{ln[:150]}[/]")
    final = {n: job_state(slurm, j) for n, j in ids.items()}
    ok = all(v == "COMPLETED" for v in final.values())
    console.print()
    if ok:
        console.print("[bold green]All jobs completed[/]: three jobs shared one GPU, and the one "
                      "that outgrew its share was recovered on a GPU of its own. No work lost.")
    else:
        console.print(f"[bold red]Not every job completed[/]: {final}; "
                      f"see {cluster.layout.log}/colloc.log")
    _final_reports(console, cluster, cfg, ids)
    console.print("\nUse the cluster yourself:  eval \"$(.venv/bin/colloc devcluster env)\"; "
                  "squeue; sacct\nStop it:                   .venv/bin/colloc devcluster down")
    return 0 if ok else 1


def _final_reports(console: Console, cluster: Cluster, cfg: cfgmod.CollocConfig,
                   ids: dict[str, int]) -> None:
    """Scene 3: colloc-report of one collocated job and of the recovered job."""
    from slurm_colloc.node.record_writer import TRIES
    from slurm_colloc.report import model, text
    from slurm_colloc.report.inquirer import SlurmInquirer

    inquirer = SlurmInquirer(SlurmCli(env=cluster.env()), cfg.metrics_dir)
    for name in ("resnet18-cifar", "bert-finetune"):
        jid = ids[name]
        console.rule(f"Scene 3: colloc-report {jid}  ({name})")
        rep = model.build(str(jid), inquirer, cfg)
        deadline = time.monotonic() + TRIES * 2
        # the epilog's record reaches slurmdbd about a second after the job ends
        while not (rep.attempts and rep.attempts[-1].samples) and time.monotonic() < deadline:
            time.sleep(1)
            rep = model.build(str(jid), inquirer, cfg)
        console.print(text.render(rep))
    console.print(f"\nHTML with plots: colloc-report {ids['bert-finetune']} --html report.html")
