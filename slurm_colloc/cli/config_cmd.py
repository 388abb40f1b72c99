"""``colloc config``: show the effective configuration or the documented defaults."""

from __future__ import annotations

import dataclasses

import click

from slurm_colloc import config as cfgmod


@click.command()
@click.option("--defaults", is_flag=True, help="Print the default configuration instead.")
@click.option("--check", is_flag=True, help="Only validate the file; exit 2 if it is broken.")
def config(defaults: bool, check: bool) -> None:
    """Print the configuration colloc would use (from $COLLOC_CONF or /etc/slurm/colloc.conf)."""
    if defaults:
        click.echo(cfgmod.dump(cfgmod.CollocConfig()), nl=False)
        return
    try:
        cfg = cfgmod.load()
    except cfgmod.ConfigError as e:
        raise click.ClickException(str(e)) from e
    if check:
        click.echo(f"{cfgmod.config_path()}: ok ({len(dataclasses.fields(cfg))} keys known)")
        return
    click.echo(f"# {cfgmod.config_path()}")
    click.echo(cfgmod.dump(cfg), nl=False)
