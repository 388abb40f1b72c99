"""``colloc demo``: the story ``make demo`` tells (see :mod:`slurm_colloc.demo`)."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console

from slurm_colloc.devcluster.daemons import DaemonError
from slurm_colloc.devcluster.layout import DEFAULT_ROOT
from slurm_colloc.devcluster.packages import PackageError


@click.command()
@click.option("--root", type=click.Path(path_type=Path), default=DEFAULT_ROOT, show_default=True,
              help="Devcluster root directory.")
@click.option("--no-site", is_flag=True,
              help="Skip scene 6 (the three-host cluster read from a login host).")
def demo(root: Path, no_site: bool) -> None:
    """Bring up the devcluster and run collocated jobs end to end (root)."""
    from slurm_colloc import demo as demo_mod

    try:
        code = demo_mod.run(Console(width=110), root, site=not no_site)
    except (DaemonError, PackageError) as e:
        raise click.ClickException(str(e)) from e
    raise SystemExit(code)
