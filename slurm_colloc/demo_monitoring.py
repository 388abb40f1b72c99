"""Demo scene: what a site's monitoring sees of shared GPUs (issue 26).

Two views an admin already has, fed by colloc: node_exporter's textfile that the
collector writes while jobs run (``prometheus_textfile``; Prometheus scrapes it and
contrib/grafana/colloc-dashboard.json draws it), and each finished job's fraction of a
GPU (``colloc admin gpu-shares``) for jobstats-style accounting, which would otherwise
credit a whole GPU to every job on a shared one.
"""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from slurm_colloc.config import CollocConfig
from slurm_colloc.report.gpu_shares import shares
from slurm_colloc.slurm.adapter import SlurmCli

SHOWN = ("colloc_job_shards", "colloc_job_memory_limit_bytes", "colloc_job_memory_used_bytes")


def textfile_rows(path: Path) -> list[tuple[str, str, str, dict[str, float]]]:
    """(jobid, user, gpu, {metric: value}) per job and GPU in the exporter's textfile.

    Read with prometheus-client's own parser, as Prometheus would; an absent or
    half-written file gives no rows (the writer renames atomically, so it is whole).
    """
    try:
        text = path.read_text()
    except OSError:
        return []
    rows: dict[tuple[str, str, str], dict[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in SHOWN:
                key = (s.labels.get("jobid", ""), s.labels.get("user", ""),
                       s.labels.get("gpu", ""))
                rows.setdefault(key, {})[s.name] = s.value
    return [(*k, v) for k, v in sorted(rows.items())]


def snapshot_table(path: Path) -> Table | None:
    """The textfile's per-job lines as a table (None when no job is in it yet)."""
    rows = textfile_rows(path)
    if not rows:
        return None
    t = Table("jobid", "user", "GPU", "shards", "limit GiB", "used GiB",
              title=f"node_exporter textfile {path.name}, as Prometheus scrapes it")
    gib = 1024 ** 3
    for jobid, user, gpu, v in rows:
        t.add_row(jobid, user, gpu, f"{v.get('colloc_job_shards', 0):.0f}",
                  f"{v.get('colloc_job_memory_limit_bytes', 0) / gib:.1f}",
                  f"{v.get('colloc_job_memory_used_bytes', 0) / gib:.1f}")
    return t


def shares_table(slurm: SlurmCli, cfg: CollocConfig, ids: list[int]) -> Table:
    """Each job's fraction of a GPU from sacct (what ``colloc admin gpu-shares`` prints)."""
    t = Table("jobid", "user", "GPU", "shards", "of", "fraction of a GPU",
              title="colloc admin gpu-shares: GPU credit per job for jobstats-style accounting")
    for s in shares(slurm.accounting(ids), cfg):
        t.add_row(s.jobid, s.user, "-" if s.gpu is None else str(s.gpu), str(s.shards),
                  "-" if s.shards_per_gpu is None else str(s.shards_per_gpu),
                  "-" if s.fraction is None else f"{s.fraction:.3f}")
    return t


def print_scene(console: Console, snapshot: Table | None, slurm: SlurmCli,
                cfg: CollocConfig, ids: list[int]) -> None:
    """The scene: the snapshot taken while jobs shared GPUs, then the finished jobs' shares."""
    console.rule("Scene 2b: what the site's monitoring sees (Prometheus, jobstats)")
    if snapshot is not None:
        console.print(snapshot)
    else:
        console.print("  [yellow]no textfile snapshot was taken while the jobs ran[/] "
                      f"(prometheus_textfile = {cfg.prometheus_textfile!r})")
    console.print(shares_table(slurm, cfg, ids))
