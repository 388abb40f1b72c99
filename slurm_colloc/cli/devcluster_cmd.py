"""``colloc devcluster up|down|status|env``: the local Slurm cluster with simulated GPUs."""

from __future__ import annotations

import logging
from pathlib import Path

import click

from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.devcluster.daemons import DaemonError
from slurm_colloc.devcluster.layout import DEFAULT_ROOT, Spec
from slurm_colloc.devcluster.packages import PackageError

root_option = click.option(
    "--root", type=click.Path(path_type=Path), default=DEFAULT_ROOT, show_default=True,
    envvar="COLLOC_DEVCLUSTER_ROOT", help="Directory holding all of the cluster's files.",
)


@click.group()
def devcluster() -> None:
    """A private one-node Slurm cluster (real daemons) with simulated GPUs. Needs root."""
    logging.basicConfig(level=logging.INFO, format="colloc: devcluster: %(message)s")


@devcluster.command()
@root_option
@click.option("--gpus", default=4, show_default=True, help="Number of simulated GPUs.")
@click.option("--gpu-memory", "gpu_memory_mib", default=40960, show_default=True,
              help="Memory per simulated GPU in MiB (40960 = A100 40 GB).")
@click.option("--shard-mib", default=1024, show_default=True, help="GPU memory per gres/shard.")
@click.option("--no-node-scripts", is_flag=True, help="Plain Slurm: no colloc Prolog/Epilog.")
@click.option("--no-install", is_flag=True, help="Do not apt-get install missing packages.")
@click.option("--timeout", default=60.0, show_default=True, help="Seconds to wait per daemon.")
def up(root: Path, gpus: int, gpu_memory_mib: int, shard_mib: int, no_node_scripts: bool,
       no_install: bool, timeout: float) -> None:
    """Install what is missing, start munged, MariaDB, slurmdbd, slurmctld, slurmd."""
    spec = Spec(gpus=gpus, gpu_memory_mib=gpu_memory_mib, shard_mib=shard_mib,
                node_scripts=not no_node_scripts)
    cluster = Cluster(Cluster.at(root).layout, spec)
    try:
        secs = cluster.up(install=not no_install, timeout=timeout)
    except (DaemonError, PackageError, ValueError) as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"devcluster up in {secs:.1f}s: {gpus} simulated GPUs x {gpu_memory_mib} MiB, "
               f"{spec.shards_per_gpu} shards each. Use it with:")
    click.echo(cluster.export_lines(), nl=False)


@devcluster.command()
@root_option
@click.option("--keep-logs", type=click.Path(path_type=Path), default=None,
              help="Copy the daemons' logs here before removing the cluster.")
def down(root: Path, keep_logs: Path | None) -> None:
    """Stop the daemons this cluster started and remove its files."""
    stopped = Cluster.at(root).down(keep_logs=keep_logs)
    click.echo(f"devcluster down: stopped {', '.join(stopped) or 'nothing'}; removed {root}")


@devcluster.command()
@root_option
def status(root: Path) -> None:
    """Show which daemons run; exit 1 unless all do."""
    cluster = Cluster.at(root)
    st = cluster.status()
    for name, pid in st.items():
        click.echo(f"{name:10s} {'running pid ' + str(pid) if pid else 'stopped'}")
    if not all(st.values()):
        raise SystemExit(1)


@devcluster.command()
@root_option
def env(root: Path) -> None:
    """Print export lines for a shell: eval "$(colloc devcluster env)"."""
    click.echo(Cluster.at(root).export_lines(), nl=False)
