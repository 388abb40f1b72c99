"""``colloc devcluster up|down|restart|status|env``: the local Slurm cluster with simulated GPUs."""

from __future__ import annotations

import logging
from pathlib import Path

import click

from slurm_colloc.devcluster import hosts, rootfs
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.devcluster.daemons import DaemonError
from slurm_colloc.devcluster.layout import DEFAULT_ROOT, Spec
from slurm_colloc.devcluster.packages import PackageError

root_option = click.option(
    "--root", type=click.Path(path_type=Path), default=DEFAULT_ROOT, show_default=True,
    envvar="COLLOC_DEVCLUSTER_ROOT", help="Directory holding all of the cluster's files.",
)


def _strip_slurm(argv: list[str]) -> list[str]:
    """``argv`` without its ``--slurm VERSION`` (the command inside runs natively)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--slurm":
            skip = True
        elif not a.startswith("--slurm="):
            out.append(a)
    return out


def _on_release(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
    """Run this command in the Slurm release asked for: here when this process is
    already in it (or ``native``: the host's own packages), else re-run inside that
    release's root filesystem (built on first use) and exit with its status."""
    import sys

    here = rootfs.current()
    want = value or here or rootfs.DEFAULT_RELEASE
    if want == "native" or want == here:
        return
    try:
        rc = rootfs.reexec(want, _strip_slurm(sys.argv[1:]))
    except rootfs.RootfsError as e:
        raise click.ClickException(str(e)) from e
    ctx.exit(rc)


slurm_option = click.option(
    "--slurm", default=None, envvar="COLLOC_SLURM", expose_value=False, is_eager=True,
    callback=_on_release, metavar="VERSION",
    help=f"Slurm release: {', '.join(rootfs.RELEASES)} (Debian's packages in a root "
         f"filesystem under {rootfs.BASE}, built on first use) or 'native' (this host's "
         f"packages). [default: the release this runs in, else {rootfs.DEFAULT_RELEASE}]",
)


@click.group()
def devcluster() -> None:
    """A private Slurm cluster (real daemons) with simulated GPUs. Needs root.

    One node by default; --nodes N gives a login host (this shell), the controller and
    N compute hosts in their own network and mount namespaces."""
    logging.basicConfig(level=logging.INFO, format="colloc: devcluster: %(message)s")


SHAPE_OPTIONS = ("gpus", "gpu_memory_mib", "shard_mib", "no_node_scripts", "nodes", "uniform")


@devcluster.command()
@slurm_option
@root_option
@click.option("--nodes", default=1, show_default=True,
              help="Compute hosts; 2 or more: each in its own namespaces, GPUs of two sizes, "
                   "partitions 'shared' (shards) and, from 3, 'gpu' (whole GPUs, default); "
                   "all alike with --uniform.")
@click.option("--uniform", is_flag=True,
              help="With --nodes: every host alike, one partition 'gpu' with shards "
                   "(a replay's cluster).")
@click.option("--gpus", default=None, type=int,
              help="Simulated GPUs per host [default: 4 on one node, 2 per host with --nodes].")
@click.option("--gpu-memory", "gpu_memory_mib", default=40960, show_default=True,
              help="Memory per simulated GPU in MiB (40960 = A100 40 GB).")
@click.option("--shard-mib", default=1024, show_default=True, help="GPU memory per gres/shard.")
@click.option("--no-node-scripts", is_flag=True, help="Plain Slurm: no colloc Prolog/Epilog.")
@click.option("--no-install", is_flag=True, help="Do not apt-get install missing packages.")
@click.option("--timeout", default=60.0, show_default=True, help="Seconds to wait per daemon.")
@click.option("--fresh", is_flag=True,
              help="Rebuild from scratch: wipes running jobs, Slurm state and accounting.")
@click.pass_context
def up(ctx: click.Context, root: Path, nodes: int, uniform: bool, gpus: int | None,
       gpu_memory_mib: int,
       shard_mib: int, no_node_scripts: bool, no_install: bool, timeout: float,
       fresh: bool) -> None:
    """Start munged, MariaDB, slurmdbd, slurmctld, slurmd: only those that are down.

    An existing cluster keeps its jobs, Slurm state and accounting; --fresh rebuilds.
    """
    existing = Cluster.at(root)
    given = any(ctx.get_parameter_source(p) is not click.core.ParameterSource.DEFAULT
                for p in SHAPE_OPTIONS)
    if existing.saved_spec() is not None and not given:
        spec = existing.spec  # keep the shape there (and its ports, which only the API sets)
    else:
        spec = Spec(gpus=gpus if gpus is not None else (4 if nodes == 1 else 2),
                    gpu_memory_mib=gpu_memory_mib, shard_mib=shard_mib,
                    node_scripts=not no_node_scripts, nodes=nodes, uniform=uniform)
    cluster = Cluster(existing.layout, spec)
    try:
        secs = cluster.up(install=not no_install, timeout=timeout, fresh=fresh)
    except (DaemonError, PackageError, ValueError) as e:
        raise click.ClickException(str(e)) from e
    if spec.multi_node:
        click.echo(f"devcluster up in {secs:.1f}s: login host and controller here "
                   f"({spec.controller_addr()}), {spec.nodes} compute hosts:")
        click.echo(hosts.describe(spec))
        click.echo("Run a command on a host: colloc devcluster exec HOST -- CMD. Use it with:")
    else:
        click.echo(f"devcluster up in {secs:.1f}s: {spec.gpus} simulated GPUs x "
                   f"{spec.gpu_memory_mib} MiB, {spec.shards_per_gpu} shards each. Use it with:")
    click.echo(cluster.export_lines(), nl=False)


@devcluster.command()
@slurm_option
@root_option
@click.argument("daemon")
@click.option("--timeout", default=60.0, show_default=True, help="Seconds to wait per daemon.")
def restart(root: Path, daemon: str, timeout: float) -> None:
    """Stop DAEMON if it runs (TERM, then KILL) and start it again; jobs keep running.

    DAEMON: munged, mariadb, slurmdbd, slurmctld, slurmd (every host's), slurmd-HOST
    (one host of a multi-node cluster) or all."""
    try:
        secs = Cluster.at(root).restart(daemon, timeout=timeout)
    except DaemonError as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"devcluster: {daemon} restarted in {secs:.1f}s")


@devcluster.command()
@slurm_option
@root_option
@click.option("--keep-logs", type=click.Path(path_type=Path), default=None,
              help="Copy the daemons' logs here before removing the cluster.")
def down(root: Path, keep_logs: Path | None) -> None:
    """Stop the daemons this cluster started and remove its files."""
    stopped = Cluster.at(root).down(keep_logs=keep_logs)
    click.echo(f"devcluster down: stopped {', '.join(stopped) or 'nothing'}; removed {root}")


@devcluster.command()
@slurm_option
@root_option
def status(root: Path) -> None:
    """Show which daemons run; exit 1 unless all do."""
    cluster = Cluster.at(root)
    st = cluster.status()
    for name, pid in st.items():
        click.echo(f"{name:10s} {'running pid ' + str(pid) if pid else 'stopped'}")
    if not all(st.values()):
        raise SystemExit(1)


@devcluster.command(name="exec", context_settings={"ignore_unknown_options": True})
@slurm_option
@root_option
@click.argument("host")
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED)
def exec_(root: Path, host: str, argv: tuple[str, ...]) -> None:
    """Run a command on compute HOST (in its namespaces), with the cluster's environment:
    colloc devcluster exec colloc-node1 -- ls /var/lib/..."""
    import os
    import subprocess

    cluster = Cluster.at(root)
    try:
        cmd = cluster.enter_argv(host, list(argv))
    except DaemonError as e:
        raise click.ClickException(str(e)) from e
    env = {**os.environ, **cluster.env()}
    raise SystemExit(subprocess.run(cmd, env=env, check=False).returncode)


@devcluster.command()
@slurm_option
@root_option
def env(root: Path) -> None:
    """Print export lines for a shell: eval "$(colloc devcluster env)"."""
    click.echo(Cluster.at(root).export_lines(), nl=False)


@devcluster.command(context_settings={"ignore_unknown_options": True})
@slurm_option
@root_option
@click.argument("argv", nargs=-1, type=click.UNPROCESSED)
def shell(root: Path, argv: tuple[str, ...]) -> None:
    """Run a command (default: a shell) where the cluster's Slurm clients work, with its
    environment: colloc devcluster shell --slurm 24.11 -- sinfo"""
    import os
    import subprocess

    env = {**os.environ, **Cluster.at(root).env()}
    raise SystemExit(subprocess.run(list(argv) or ["/bin/bash"], env=env,
                                    check=False).returncode)


@devcluster.command(name="rootfs", context_settings={"ignore_unknown_options": True})
@click.option("--release", "version", default=rootfs.DEFAULT_RELEASE, show_default=True,
              type=click.Choice(sorted(rootfs.RELEASES)))
@click.option("--rebuild", is_flag=True, help="Build it again from Debian's archive.")
@click.option("--remove", is_flag=True, help="Unmount and delete it.")
@click.argument("argv", nargs=-1, type=click.UNPROCESSED)
def rootfs_(version: str, rebuild: bool, remove: bool, argv: tuple[str, ...]) -> None:
    """Build (or refresh) the root filesystem of a Slurm release, with the project
    installed in its Python; then run ARGV inside if given (no cluster environment:
    `make test` runs the suite this way). --remove deletes it (never through its
    mounts)."""
    rel = rootfs.release(version)
    try:
        if remove:
            if rootfs.root_of(rel).exists():
                rootfs.remove(rootfs.root_of(rel))
            click.echo(f"removed {rootfs.root_of(rel)}")
            return
        root = rootfs.ensure(version, rebuild=rebuild)
        rootfs.ensure_venv(root)
        if argv:
            raise SystemExit(rootfs.run(root, list(argv), check=False))
    except rootfs.RootfsError as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"Slurm {version} root filesystem ready: {root}")
