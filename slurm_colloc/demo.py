"""The ``make demo`` story: collocated training jobs on a local Slurm with simulated GPUs.

Scenes (each uses the real sbatch/slurmctld/slurmd/slurmdbd and colloc's node scripts):
1. Three training jobs are submitted with ``sbatch --colloc``: two with a model summary
   (the estimator sizes them at submit time), one with a user's guess. job_submit
   turns each size into shards; Slurm packs them onto one GPU and colloc runs them
   under MPS, each capped at its share. We watch GPU memory live.
2. The guessed job outgrows its share: it crashes with PyTorch's CUDA OOM, the epilog
   keeps its log and requeues it on a whole GPU, it completes; its neighbours are
   untouched. Accounting (sacct) shows every attempt.
2b. What the site's monitoring sees: the per-job lines of the collector's
   node_exporter textfile while the jobs share GPUs, and each job's fraction of a GPU
   (``colloc admin gpu-shares``) for jobstats-style accounting.
3. ``colloc-report`` for a collocated job and for the recovered one.
4. The estimate for the next runs of the resnet50 job at three batch sizes, from its
   summary alone and with the peak the epilog filed in the estimator history.
5. Safety: an unprivileged user tries the two attacks of issue 11 (a forged
   AdminComment in ``--comment``; another user's pid planted in the MPS pipe
   directory). The job stays capped, the other user's process lives.
5b. Faults (:mod:`slurm_colloc.demo_faults`): the collector's supervisor and slurmdbd
   are SIGKILLed under a job; sampling is back within seconds and the job's record,
   held in root's spool meanwhile, reaches accounting after slurmdbd restarts.
6. A site: login host, controller and three compute hosts in their own namespaces
   (:mod:`slurm_colloc.demo_site`): an OOM on one host recovered on another, a plain
   GPU job left alone, the report read from the login host.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from slurm_colloc import config as cfgmod
from slurm_colloc import demo_monitoring
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.gpu.budget import GpuBudget
from slurm_colloc.gpu.sim.backend import SimBackend
from slurm_colloc.slurm.adapter import SlurmCli, job_state


@dataclass(frozen=True)
class DemoJob:
    """One job of the demo mix, submitted the way a user would."""

    name: str
    options: tuple[str, ...]
    command: str
    story: str


SUMMARIES = Path(__file__).resolve().parents[1] / "sbatch_templates" / "summaries"

MIX = (
    DemoJob("resnet50-imagenet",
            (f"--colloc={SUMMARIES / 'resnet50_torchinfo.txt'}", "--colloc-batch-size=32",
             "--colloc-optimizer=sgd"),
            "colloc-simjob --mem 5G --peak 6G --peak-at 0.2 --sm-activity 45 --seconds 25",
            "torchinfo summary, batch 32: estimated at submit time"),
    DemoJob("bert-base-finetune",
            (f"--colloc={SUMMARIES / 'bert_base_print.txt'}", "--colloc-batch-size=16",
             "--colloc-seq-len=128", "--colloc-optimizer=adamw", "--colloc-precision=amp-bf16"),
            "colloc-simjob --mem 3G --peak 4G --peak-at 0.2 --sm-activity 40 --seconds 25",
            "print(model) summary, AdamW + bf16: estimated at submit time"),
    DemoJob("gpt2-guess",
            ("--colloc-mem=6G",),
            "colloc-simjob --mem 4G --peak 14G --peak-at 0.3 --sm-activity 50 --seconds 20",
            "user guessed 6 GiB; the model really peaks at 14 GiB"),
)
RECOVERED = "gpt2-guess"


def _sbatch(cluster: Cluster, workdir: Path, job: DemoJob) -> int:
    script = workdir / f"{job.name}.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        f"#SBATCH --job-name={job.name}\n"
        f"#SBATCH --output={workdir}/{job.name}-%j.out\n"
        'echo "attempt ${SLURM_RESTART_COUNT:-0} on GPU $CUDA_VISIBLE_DEVICES, '
        'MPS limit $CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"\n'
        f"{job.command}\n"
    )
    cp = subprocess.run(["sbatch", "--parsable", *job.options, str(script)], env=cluster.env(),
                        capture_output=True, text=True, check=False)
    if cp.returncode != 0:
        raise RuntimeError(f"sbatch {job.name} failed: {cp.stderr.strip()}")
    return int(cp.stdout.strip().split(";")[0])


def _submit_table(slurm: SlurmCli, ids: dict[str, int], budget: GpuBudget) -> Table:
    """Estimate, memory asked for, shards and MPS limit per job, from job_submit's record."""
    from slurm_colloc.accounting.submit_record import parse_record

    table = Table("job", "id", "how the size was set", "estimate (incl. margin)", "asked",
                  "shards", "MPS limit")
    for job in MIX:
        info = slurm.show_job(ids[job.name]) or {}
        rec = parse_record(str(info.get("AdminComment", "")))
        if rec is None:
            table.add_row(job.name, str(ids[job.name]), "?", "-", "-", "-", "-")
            continue
        how = {"estimate": f"estimator {rec.estimator}", "explicit": "--colloc-mem"}.get(
            rec.mode, rec.mode)
        est = f"{rec.est_mib / 1024:.1f} GiB" if rec.est_mib else "-"
        table.add_row(job.name, str(ids[job.name]), how, est, f"{rec.need_mib / 1024:.1f} GiB",
                      str(rec.shards), f"{budget.pinned_limit_mib(rec.shards) / 1024:.1f} GiB")
    return table


def run(console: Console, root: Path | None = None, *, site: bool = True) -> int:
    """Bring the devcluster up and play the scenes; return a process exit code.

    ``site``: also play scene 6 on a three-host devcluster (:mod:`slurm_colloc.demo_site`).
    """
    cluster = Cluster.at(root) if root else Cluster.at()
    console.rule("[bold]slurm-colloc demo: GPU sharing on a local Slurm cluster")
    b = cluster.spec.budget()
    console.print("Bringing up munged, MariaDB, slurmdbd, slurmctld, slurmd "
                  f"({cluster.spec.gpus} simulated A100 40 GB GPUs; of each GPU's "
                  f"{b.total_mib} MiB the driver keeps {b.reserved_mib} and MPS servers "
                  f"{b.servers} x {b.server_mib}, leaving {b.shards_per_gpu} shards of "
                  f"{b.shard_mib} MiB for jobs; each job's MPS limit leaves "
                  f"{b.context_mib} MiB of its shards for its CUDA context)...")
    secs = cluster.up()
    console.print(f"[green]cluster up[/] in {secs:.1f}s (root {cluster.layout.root})\n")
    slurm = SlurmCli(env=cluster.env())
    cfg = cfgmod.load(cluster.layout.colloc_conf)
    backend = SimBackend(Path(cfg.sim_state_dir))
    workdir = cluster.layout.root / "demo"
    workdir.mkdir(exist_ok=True)

    console.rule("Scene 1: sbatch --colloc: sizes become shards of a GPU")
    ids = {}
    for job in MIX:
        ids[job.name] = _sbatch(cluster, workdir, job)
        opts = " ".join(o.replace(str(SUMMARIES) + "/", "") for o in job.options)
        console.print(f"  sbatch {opts}\n      -> job {ids[job.name]} {job.name}: {job.story}")
    console.print(_submit_table(slurm, ids, cluster.spec.budget()))
    console.print("Slurm places the shards; colloc's prolog runs each job under MPS capped at "
                  "its shards x 1 GiB less its CUDA context, the GPU named by its UUID.\n")
    seen_oom = False
    deadline = time.monotonic() + 240
    last_print = 0.0
    placed: dict[str, tuple[int, ...]] = {}  # each job's first GPUs, as the controller says
    prom = Path(cfg.prometheus_textfile) if cfg.prometheus_textfile else None
    snapshot = None  # the exporter's textfile while the most jobs ran (scene 2b)
    snapshot_jobs = 0
    while time.monotonic() < deadline:
        states = {n: job_state(slurm, j) for n, j in ids.items()}
        for n, j in ids.items():
            if n not in placed and states[n] == "RUNNING":
                sj = slurm.job(j)
                if sj is not None and sj.allocated_gpus:
                    placed[n] = sj.allocated_gpus
        if time.monotonic() - last_print > 3:
            last_print = time.monotonic()
            samples = [s for s in backend.sample_all() if s.processes]  # idle GPUs show the reserve
            line = "  ".join(
                f"GPU{s.index}: {s.memory_used_mib / 1024:4.1f} GiB "
                f"{len(s.processes)} proc SM {s.sm_activity_pct or 0:3.0f}%" for s in samples
            ) or "GPUs idle"
            st = " ".join(f"{n.split('-')[0]}={v}" for n, v in states.items())
            console.print(f"  [dim]{time.strftime('%H:%M:%S')}[/] {line:60s} | {st}")
            running = sum(v == "RUNNING" for v in states.values())
            if prom is not None and running > snapshot_jobs:
                taken = demo_monitoring.snapshot_table(prom)
                if taken is not None:
                    snapshot, snapshot_jobs = taken, running
        rec_job = (slurm.show_job(ids[RECOVERED]) or {})
        if rec_job.get("Restarts", "0") != "0" and not seen_oom:
            seen_oom = True
            console.print(f"  [yellow]{RECOVERED} ran out of GPU memory under its MPS limit[/]: "
                          "the epilog kept its log and requeued it on a whole GPU "
                          f"({cluster.spec.shards_per_gpu} shards)")
        if all(v in ("COMPLETED", "FAILED", "CANCELLED") for v in states.values()) and (
            rec_job.get("JobState") == states[RECOVERED]
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
    evidence = Path(cfg.evidence_dir) / str(ids[RECOVERED]) / "attempt0"
    if evidence.is_dir():
        console.print(f"\nThe first attempt's output was kept in {evidence}:")
        for p in sorted(evidence.iterdir()):
            oom = [ln for ln in p.read_text(errors="replace").splitlines() if "OutOfMemory" in ln]
            for ln in oom[:1]:
                console.print(f"  [red]{ln[:150]}[/]")
    console.print(_node_scripts_line(cfg, list(ids.values())))
    final = {n: job_state(slurm, j) for n, j in ids.items()}
    ok = all(v == "COMPLETED" for v in final.values())
    console.print()
    if ok:
        console.print(f"[bold green]All jobs completed[/]: {_placement(placed)}; the one that "
                      "outgrew its share was recovered on a GPU of its own (from its start:"
                      " this demo job keeps no checkpoint; docs/user.md says what a requeue"
                      " keeps and loses).")
    else:
        console.print(f"[bold red]Not every job completed[/]: {final}; "
                      f"see {cluster.layout.log}/colloc.log")
    demo_monitoring.print_scene(console, snapshot, slurm, cfg, list(ids.values()))
    _final_reports(console, cluster, cfg, ids)
    ok = _safety_scene(console, cluster, slurm, workdir) and ok
    from slurm_colloc import demo_faults

    ok = demo_faults.fault_scene(console, cluster, slurm, workdir) and ok
    if site:
        from slurm_colloc import demo_site

        ok = demo_site.run(console) and ok
    console.print("\nUse the cluster yourself:  eval \"$(.venv/bin/colloc devcluster env)\"; "
                  "squeue; sacct\nStop it:                   .venv/bin/colloc devcluster down"
                  "\nWhat it buys at scale:     .venv/bin/python benchmarks/replay.py --trace "
                  "philly90   (90-job trace through Slurm, whole-GPU vs shards vs colloc, "
                  "about 7 minutes; results in benchmarks/results/)")
    return 0 if ok else 1


def _node_scripts_line(cfg: cfgmod.CollocConfig, jobs: list[int]) -> str:
    """What the jobs' prologs cost, and whether the node's script server ran them
    (issue 28: colloc-prolog is a client of a resident server; docs/node.md)."""
    from slurm_colloc.bench.burst import percentile, prolog_runs

    try:
        lines = Path(cfg.log_file or "").read_text(errors="replace").splitlines()
    except OSError:
        return ""
    runs = prolog_runs(lines, jobs)
    served = sum("script-server: job -: serving" in ln for ln in lines)
    if not runs:
        return ""
    took = percentile([r.wall_s for r in runs], 50)
    again = ", restarted" if served > 1 else ""
    from slurm_colloc.node.script_server import GROUPED

    grouped = next((ln.split(GROUPED, 1)[1].rstrip(")") for ln in lines
                    if "script-server: job -: serving" in ln and GROUPED in ln), None)
    weight = (f", {GROUPED}{grouped} ahead of the jobs'" if grouped else "")
    how = (f"the node's script server (started by the first prolog{again}) ran them in "
           f"forked workers{weight}" if served else "each ran in its own interpreter")
    return (f"\nNode scripts: {len(runs)} prologs, median {took:.2f} s from each one's process "
            f"start (interpreter included); {how}.")


def _placement(placed: dict[str, tuple[int, ...]]) -> str:
    """What Slurm did with the shards, in words: least-loaded placement (LL_SHARED_GRES,
    23.11+) spreads jobs over idle GPUs first and shares a GPU only when it must."""
    gpus = sorted({g for v in placed.values() for g in v})
    if len(placed) > 1 and len(gpus) == 1:
        return f"{len(placed)} jobs shared GPU {gpus[0]} under MPS"
    where = ", ".join(f"{n} on GPU {','.join(map(str, v))}" for n, v in placed.items())
    return (f"Slurm spread the first attempts over GPUs {','.join(map(str, gpus))} "
            f"(least-loaded first: {where}); each ran under MPS capped at its shards")


def _final_reports(console: Console, cluster: Cluster, cfg: cfgmod.CollocConfig,
                   ids: dict[str, int]) -> None:
    """Scene 3: colloc-report of one collocated job and of the recovered job."""
    from slurm_colloc.node.record_writer import TRIES
    from slurm_colloc.report import job as job_report
    from slurm_colloc.report import text
    from slurm_colloc.report.inquirer import SlurmInquirer

    inquirer = SlurmInquirer(SlurmCli(env=cluster.env()), cfg.metrics_dir)
    for name in ("resnet50-imagenet", RECOVERED):
        jid = ids[name]
        console.rule(f"Scene 3: colloc-report {jid}  ({name})")
        rep = job_report.build(str(jid), inquirer, cfg)
        deadline = time.monotonic() + TRIES * 2
        # the epilog's record reaches slurmdbd about a second after the job ends
        while not (rep.attempts and rep.attempts[-1].samples) and time.monotonic() < deadline:
            time.sleep(1)
            rep = job_report.build(str(jid), inquirer, cfg)
        console.print(text.render(rep))
    console.print(f"\nHTML with plots: colloc-report {ids[RECOVERED]} --html report.html")
    _history_scene(console, cfg)


def _history_scene(console: Console, cfg: cfgmod.CollocConfig) -> None:
    """Scene 4: the next submissions of the same model are sized from its measured peak."""
    from slurm_colloc.estimators import SqliteHistory, estimate

    job = MIX[0]
    summary = (SUMMARIES / "resnet50_torchinfo.txt").read_text()
    history = SqliteHistory(cfg.history_db)
    console.rule(f"Scene 4: the next {job.name} runs, sized from its measured peak")
    table = Table("batch", "from the summary", "with history", "estimator", header_style="bold")
    for batch in (32, 64, 16):
        cold = estimate(summary, batch_size=batch, optimizer="sgd")
        warm = estimate(summary, batch_size=batch, optimizer="sgd", history=history)
        table.add_row(str(batch), f"{cold.estimate_mib / 1024:.1f} GiB",
                      f"{warm.estimate_mib / 1024:.1f} GiB", warm.estimator)
    console.print(table)
    console.print("The epilog filed the measured peak under your uid and the summary's "
                  "fingerprint (other users' peaks never count); "
                  "`sbatch --colloc=SUMMARY` at any batch size now asks for that much "
                  "(docs/estimators.md, \"History\").")


FORGED = "colloc1:mode=whole,need_mib=40960,shards=40,shard_mib=1024,alloc_mib=40960"


def _safety_scene(console: Console, cluster: Cluster, slurm: SlurmCli, workdir: Path) -> bool:
    """Scene 5: what an unprivileged user cannot make root do (docs/security.md)."""
    user, other = "colloc-demo-u1", "colloc-demo-u2"
    console.rule("Scene 5: an unprivileged user tries to steer root")
    for u in (user, other):
        subprocess.run(["useradd", "--system", "--no-create-home", u], capture_output=True,
                       check=False)
        cluster.add_user(u)
    victim = subprocess.Popen(["runuser", "-u", other, "--", "sleep", "120"])
    time.sleep(0.3)
    kids = Path(f"/proc/{victim.pid}/task/{victim.pid}/children").read_text().split()
    vpid = int(kids[0]) if kids else victim.pid
    pid_file = "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"
    workdir.chmod(0o755)
    workdir = workdir / "attack"
    workdir.mkdir(exist_ok=True)
    workdir.chmod(0o1777)  # the user's job writes its output here
    script = workdir / "attack.sh"
    script.write_text(
        "#!/bin/bash\n"
        'echo "my MPS memory limit: $CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"\n'
        "colloc-simjob --mem 1G --seconds 2 >/dev/null\n"
        f'rm -f "$CUDA_MPS_PIPE_DIRECTORY/control" {pid_file}; echo {vpid} > {pid_file}\n')
    script.chmod(0o755)
    console.print(f"  {user} submits a 2 GiB job whose comment claims a whole GPU "
                  f"([dim]AdminComment={FORGED}[/]),\n  and which writes {other}'s pid {vpid} "
                  "into root's pid file in its MPS pipe directory.")
    cp = subprocess.run(
        ["runuser", "-u", user, "--", "sbatch", "--parsable", f"--chdir={workdir}",
         f"--output={workdir}/attack-%j.out", "--colloc-mem=2G",
         f"--comment=x AdminComment={FORGED}", str(script)],
        env=cluster.env(), capture_output=True, text=True, check=False)
    try:
        job = int(cp.stdout.strip().split(";")[0])
        deadline = time.monotonic() + 90
        while job_state(slurm, job) not in ("COMPLETED", "FAILED", "CANCELLED"):
            if time.monotonic() > deadline:
                break
            time.sleep(1)
        time.sleep(2)  # the epilog
        out = (workdir / f"attack-{job}.out").read_text().strip()
        alive = victim.poll() is None
    except (ValueError, OSError) as e:
        console.print(f"  [red]the scene could not run: {e} {cp.stderr.strip()}[/]")
        return False
    finally:
        victim.kill()
    capped = f"0={cluster.spec.budget().pinned_limit_mib(2)}M" in out  # 2 GiB less a context
    console.print(f"  job {job}: [{'green' if capped else 'red'}]{out}[/] "
                  "(the prolog read Slurm's JSON record, not the comment's text)")
    console.print(f"  {other}'s process {vpid} after the epilog: "
                  f"[{'green' if alive else 'red'}]{'alive' if alive else 'KILLED'}[/] "
                  "(root signals only the daemon identity it recorded itself)")
    from slurm_colloc.demo_attacks import enforcement_scene

    held = enforcement_scene(console, cluster, slurm, workdir, user)
    return capped and alive and held
