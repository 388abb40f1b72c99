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
def demo(root: Path) -> None:
    """Bring up the devcluster and run collocated jobs end to end (root)."""
    from slurm_colloc import demo as demo_mod

    try:
        code = demo_mod.run(Console(width=110), root)
    except (DaemonError, PackageError) as e:
        raise click.ClickException(str(e)) from e
    raise SystemExit(code)
