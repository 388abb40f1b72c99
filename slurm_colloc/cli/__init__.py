"""The ``colloc`` command: a thin click group whose subcommands load lazily.

Lazy loading matters: ``sbatch --colloc`` runs ``colloc estimate`` through the
cli_filter on every submission, so importing pandas or torch for unrelated
subcommands would add hundreds of milliseconds to each sbatch.
"""

from __future__ import annotations

import importlib
from typing import Any

import click

# subcommand name -> "module:attribute" (a click.Command)
SUBCOMMANDS: dict[str, str] = {
    "admin": "slurm_colloc.cli.admin_cmd:admin",
    "config": "slurm_colloc.cli.config_cmd:config",
    "demo": "slurm_colloc.cli.demo_cmd:demo",
    "devcluster": "slurm_colloc.cli.devcluster_cmd:devcluster",
    "estimate": "slurm_colloc.cli.estimate_cmd:estimate",
    "report": "slurm_colloc.cli.report_cmd:report",
    "selftest": "slurm_colloc.cli.selftest_cmd:selftest",
}


class LazyGroup(click.Group):
    """A click group that imports a subcommand's module only when it is run."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = SUBCOMMANDS.get(cmd_name)
        if target is None:
            return None
        module, attr = target.split(":")
        cmd = getattr(importlib.import_module(module), attr)
        assert isinstance(cmd, click.Command)
        return cmd


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="slurm-colloc")
def main() -> None:
    """slurm-colloc: safe GPU sharing for Slurm (estimate, devcluster, report, admin)."""


def report_main() -> Any:
    """Entry point of ``colloc-report`` (same as ``colloc report``)."""
    cmd = main.get_command(click.Context(main), "report")
    if cmd is None:
        raise SystemExit("colloc-report: the report command is not installed yet")
    return cmd.main(prog_name="colloc-report")
