"""``colloc report`` / ``colloc-report``: a thin click layer over slurm_colloc.report.

Options become a :class:`ReportParams`; :func:`run` returns (exit code, output);
only this module prints. Exit codes: 0 report shown; 2 unknown job (as seff);
3 the job has no colloc data (basic facts still shown); 1 Slurm or usage error.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import click

from slurm_colloc import config as cfgmod

EXIT_UNKNOWN = 2
EXIT_NO_DATA = 3


@dataclass(frozen=True)
class ReportParams:
    """What the user asked for."""

    job_id: str | None
    as_json: bool
    html: Path | None
    since: str | None
    until: str | None
    user: str | None


def _inquirer(cfg: cfgmod.CollocConfig):  # type: ignore[no-untyped-def]
    from slurm_colloc.report.inquirer import SlurmInquirer
    from slurm_colloc.slurm.adapter import SlurmCli

    return SlurmInquirer(SlurmCli(timeout=30), cfg.metrics_dir)


@click.command("report")
@click.argument("job_id", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--html", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write a self-contained HTML page with plots to FILE.")
@click.option("--since", envvar="COLLOC_REPORT_SINCE",
              help="Admin view: all jobs since DATE (sacct format, e.g. 2026-11-01 or now-7days).")
@click.option("--until", help="Admin view: end of the period (default now).")
@click.option("--user", "-u", help="Admin view: only this user's jobs.")
def report(job_id: str | None, as_json: bool, html: Path | None, since: str | None,
           until: str | None, user: str | None) -> None:
    """Report what the GPU did for JOB_ID (or, with --since, for a period)."""
    params = ReportParams(job_id, as_json, html, since, until, user)
    if (job_id is None) == (since is None):
        raise click.UsageError("give a JOB_ID, or --since DATE for the admin view")
    from slurm_colloc.slurm.adapter import SlurmError

    try:
        cfg = cfgmod.load()
        code = run(params, cfg, _inquirer(cfg))
    except (SlurmError, cfgmod.ConfigError) as e:
        click.echo(f"colloc report: {e}", err=True)
        sys.exit(1)
    sys.exit(code)


def run(params: ReportParams, cfg: cfgmod.CollocConfig, inquirer) -> int:  # type: ignore[no-untyped-def]
    """Build and print the requested report; returns the exit code."""
    from rich.console import Console

    console = Console(highlight=False)
    if params.since is not None:
        from slurm_colloc.report import admin

        rows = inquirer.period_rows(params.since, params.until, params.user)
        summary = admin.summarize_period(rows, cfg, params.since, params.user)
        # entries sacct gave that could not be read: skipped, named, never fatal
        summary.warnings[:0] = inquirer.warnings()
        if params.as_json:
            click.echo(json.dumps(summary.to_json(), indent=1))
        else:
            console.print(admin.render(summary))
        return 0
    from slurm_colloc.report import model, text

    assert params.job_id is not None
    try:
        rep = model.build(params.job_id.strip(), inquirer, cfg)
    except model.UnknownJobError as e:
        click.echo(f"colloc report: {e}", err=True)
        return EXIT_UNKNOWN
    if params.html is not None:
        from slurm_colloc.report import html

        params.html.write_text(html.render(rep))
    if params.as_json:
        click.echo(json.dumps(rep.to_json(), indent=1))
    else:
        console.print(text.render(rep))
        if params.html is not None:
            console.print(f"\nHTML report written to {params.html}", markup=False)
    return 0 if rep.colloc else EXIT_NO_DATA
