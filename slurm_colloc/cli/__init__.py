"""The ``colloc`` command: a thin click group whose subcommands load lazily.

Lazy loading matters: ``sbatch --colloc`` runs ``colloc estimate`` through the
cli_filter on every submission, so importing pandas or torch for unrelated
subcommands would add hundreds of milliseconds to each sbatch.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import click

from slurm_colloc.cli import lab

EXIT_ERROR = 2
"""Exit status of every CLI error (bad input, missing file, unknown job, broken config)."""


def run_cli(main: Callable[..., Any], prog: str, *args: Any, **kwargs: Any) -> Any:
    """Run a click ``main`` so that every error is one line on stderr and exit 2.

    Click's own errors (usage, bad option values, ``ClickException``) and any other
    exception become ``PROG: error: MESSAGE``; no traceback unless ``COLLOC_DEBUG=1``.
    Commands that choose their own exit status (``sys.exit``) keep it.
    """
    kwargs["standalone_mode"] = False
    try:
        return main(*args, **kwargs)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:
        where = getattr(getattr(e, "ctx", None), "command_path", None) or prog
        hint = f" (see {where} -h)" if isinstance(e, click.UsageError) else ""
        click.echo(f"{where}: error: {_one_line(e.format_message())}{hint}", err=True)
        sys.exit(EXIT_ERROR)
    except click.Abort:
        click.echo(f"{prog}: aborted", err=True)
        sys.exit(EXIT_ERROR)
    except KeyboardInterrupt:
        sys.exit(130)
    except (SystemExit, MemoryError):
        raise
    except Exception as e:  # the CLI's last line of defence: one line
        if os.environ.get("COLLOC_DEBUG") == "1":
            raise
        msg = _one_line(str(e)) or type(e).__name__
        if isinstance(e, OSError) and e.filename is not None and str(e.filename) not in msg:
            msg = f"{e.filename}: {msg}"
        click.echo(f"{prog}: error: {msg} ({type(e).__name__}; COLLOC_DEBUG=1 shows the "
                   "traceback)", err=True)
        sys.exit(EXIT_ERROR)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())

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
        if cmd_name in lab.LAB_COMMANDS:  # the lab: only with its extra, never a traceback
            lab.require(f"colloc {cmd_name}")
            try:
                mod = importlib.import_module(module)
            except ImportError as e:
                raise lab.refusal(f"colloc {cmd_name}", f"cannot import {e.name}") from e
        else:
            mod = importlib.import_module(module)
        cmd = getattr(mod, attr)
        assert isinstance(cmd, click.Command)
        return cmd

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """As click's, but the lab's commands are listed from :data:`lab.LAB_COMMANDS`:
        ``colloc --help`` imports no lab code (and works where the lab is left out)."""
        rows = []
        for name in self.list_commands(ctx):
            if name in lab.LAB_COMMANDS:
                rows.append((name, lab.LAB_COMMANDS[name]))
                continue
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                rows.append((name, cmd.get_short_help_str(formatter.width - 6 - len(name))))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def main(self, *args: Any, **kwargs: Any) -> Any:
        """As click's, with every error one line and exit 2 (:func:`run_cli`)."""
        return run_cli(super().main, kwargs.get("prog_name") or "colloc", *args, **kwargs)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="slurm-colloc")
def main() -> None:
    """slurm-colloc: safe GPU sharing for Slurm (estimate, devcluster, report, admin)."""


def report_main() -> Any:
    """Entry point of ``colloc-report`` (same as ``colloc report``)."""
    cmd = main.get_command(click.Context(main), "report")
    if cmd is None:
        raise SystemExit("colloc-report: the report command is not installed yet")
    if not any(p.name == "version" for p in cmd.params):  # colloc's version, same source
        click.version_option(package_name="slurm-colloc", prog_name="colloc-report")(cmd)
    return run_cli(cmd.main, "colloc-report", prog_name="colloc-report")
