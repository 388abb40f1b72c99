"""``colloc report`` / ``colloc-report``: a thin click layer over slurm_colloc.report.

Options become a :class:`ReportParams`; :func:`run` returns (exit code, output);
only this module prints. What is shown:

- one JOB_ID (``123`` or an array task ``123_4``): the job's report (text, ``--json``,
  ``--html FILE``); an array job's id lists its tasks as a table;
- several JOB_IDs, or ``--user``/``--account``/``--partition``/``--state``/``--since``:
  the job table (reportseff-like: memory efficiency, estimate accuracy, OOMs, whether
  the job shared a GPU, GPU-hours saved; ``--format`` picks the columns) and the
  period's totals (collocated jobs, recoveries, accuracy per estimator). State and
  partition are sacct's own filters for a period (``sacct -s/-r``, so the table
  counts what ``sacct`` lists), and the jobs' final states for named jobs.

Exit codes: 0 report shown; 2 any error, one line on stderr (unknown job, as seff;
bad option, unwritable ``--html``, broken config, Slurm unreachable); 3 the job has
no colloc data (basic facts still shown).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from slurm_colloc import config as cfgmod

EXIT_UNKNOWN = 2
EXIT_ERROR = 2
EXIT_NO_DATA = 3
DEFAULT_SINCE = "now-7days"
"""Start of the period when a filter is given without --since (as reportseff)."""

STATE_CODES = {
    "CD": "COMPLETED", "F": "FAILED", "R": "RUNNING", "PD": "PENDING", "CA": "CANCELLED",
    "TO": "TIMEOUT", "OOM": "OUT_OF_MEMORY", "NF": "NODE_FAIL", "PR": "PREEMPTED",
    "RQ": "REQUEUED", "S": "SUSPENDED", "CG": "COMPLETING", "BF": "BOOT_FAIL",
    "DL": "DEADLINE", "RV": "REVOKED", "SE": "SPECIAL_EXIT", "RS": "RESIZING",
}


@dataclass(frozen=True)
class ReportParams:
    """What the user asked for."""

    job_id: str | None
    as_json: bool
    html: Path | None
    since: str | None
    until: str | None
    user: str | None
    job_ids: tuple[str, ...] = ()
    """Further job ids (the table); ``job_id`` is the first."""
    account: str | None = None
    states: tuple[str, ...] = ()
    partitions: tuple[str, ...] = ()
    columns: tuple[str, ...] = ()
    """Table columns (``--format``; empty: the default)."""

    @property
    def ids(self) -> tuple[str, ...]:
        return ((self.job_id,) if self.job_id else ()) + tuple(
            j for j in self.job_ids if j != self.job_id)

    @property
    def table(self) -> bool:
        """A job table rather than one job's report."""
        return len(self.ids) != 1 or any(
            (self.since, self.user, self.account, self.states, self.partitions))


class ReportError(Exception):
    """Bad input found while reporting: one line, exit 2."""


def _inquirer(cfg: cfgmod.CollocConfig):  # type: ignore[no-untyped-def]
    from slurm_colloc.report.inquirer import SlurmInquirer
    from slurm_colloc.slurm.adapter import SlurmCli

    return SlurmInquirer(SlurmCli(timeout=30), cfg.metrics_dir)


def parse_states(text: str | None) -> tuple[str, ...]:
    """``--state CD,failed,R`` -> ('COMPLETED', 'FAILED', 'RUNNING')."""
    out = []
    for part in (text or "").split(","):
        p = part.strip().upper()
        if not p:
            continue
        name = STATE_CODES.get(p, p)
        if name not in STATE_CODES.values():
            raise click.BadParameter(
                f"{part.strip()!r}: not a Slurm job state (e.g. COMPLETED or CD, FAILED or "
                "F, RUNNING or R, PENDING, CANCELLED, TIMEOUT, OUT_OF_MEMORY)",
                param_hint="--state")
        out.append(name)
    return tuple(dict.fromkeys(out))


def parse_partitions(text: str | None) -> tuple[str, ...]:
    """``--partition gpu,debug`` -> ('gpu', 'debug'); a name is what Slurm allows."""
    out = []
    for part in (text or "").split(","):
        p = part.strip()
        if not p:
            continue
        if len(p) > 64 or not all(c.isalnum() or c in "._-" for c in p):
            raise click.BadParameter(f"{p[:40]!r}: not a partition name",
                                     param_hint="--partition")
        out.append(p)
    return tuple(dict.fromkeys(out))


def _job_id(value: str) -> str:
    from slurm_colloc.report.inquirer import _JOB_ID

    v = value.strip()
    if not _JOB_ID.match(v):
        raise click.BadParameter(f"{value[:40]!r}: not a job id (123, or 123_4 for an array "
                                 "task)", param_hint="JOB_ID")
    return v


@click.command("report", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("job_ids", nargs=-1, metavar="[JOB_ID]...")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--html", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write a self-contained HTML page with plots to FILE (one job).")
@click.option("--since", "-S", envvar="COLLOC_REPORT_SINCE",
              help="Jobs since DATE (sacct format, e.g. 2026-11-01 or now-7days; default "
                   f"{DEFAULT_SINCE} with --user/--account/--state).")
@click.option("--until", "-E", help="End of the period (default now).")
@click.option("--user", "-u", help="Only this user's jobs.")
@click.option("--account", "-A", help="Only this account's jobs.")
@click.option("--state", "-s", "state", metavar="STATES",
              help="Only jobs in these states, comma-separated (COMPLETED,FAILED or "
                   "CD,F,OOM,R; as sacct -s).")
@click.option("--partition", "-r", "partition", metavar="PARTITIONS",
              help="Only jobs of these partitions, comma-separated (as sacct -r).")
@click.option("--format", "-o", "fmt", metavar="COLUMNS",
              help="Table columns, comma-separated (e.g. JobID,State,MemEff,Saved; "
                   "+Partition adds to the default).")
def report(job_ids: tuple[str, ...], as_json: bool, html: Path | None, since: str | None,
           until: str | None, user: str | None, account: str | None,
           state: str | None, partition: str | None, fmt: str | None) -> None:
    """Report what the GPU did for JOB_ID, or a table of jobs.

    \b
    colloc report 1234                 one job: memory vs limit, co-tenants, OOM, advice
    colloc report 1234 --html r.html   ... and a page with plots
    colloc report 1234_7               one task of an array job (1234 lists them all)
    colloc report -u alice -S now-3days -s CD,F    a table (reportseff-like)
    colloc report -u alice --format JobID,State,MemEff,Saved -r gpu
    """
    from slurm_colloc.report.jobs import FormatError, parse_format

    ids = tuple(_job_id(j) for j in job_ids)
    states = parse_states(state)
    partitions = parse_partitions(partition)
    try:
        columns = parse_format(fmt)
    except FormatError as e:
        raise click.BadParameter(str(e), param_hint="--format") from e
    params = ReportParams(ids[0] if ids else None, as_json, html, since, until, user,
                          job_ids=ids, account=account, states=states,
                          partitions=partitions, columns=columns if fmt else ())
    if not ids and not any((since, user, account, states, partitions)):
        raise click.UsageError("give a JOB_ID, or --user/--account/--partition/--state/"
                               "--since for a table of jobs")
    if html is not None and params.table:
        raise click.UsageError("--html is for the report of one job")
    if html is not None and not html.parent.is_dir():
        raise click.BadParameter(f"{html}: directory {html.parent} does not exist",
                                 param_hint="--html")
    from slurm_colloc.slurm.adapter import SlurmError

    try:
        cfg = cfgmod.load()
        code = run(params, cfg, _inquirer(cfg))
    except (SlurmError, cfgmod.ConfigError, ReportError) as e:
        click.echo(f"colloc report: error: {' '.join(str(e).split())}", err=True)
        sys.exit(EXIT_ERROR)
    sys.exit(code)


def _table(params: ReportParams, cfg: cfgmod.CollocConfig, inquirer: Any,
           ids: tuple[str, ...]) -> int:
    from rich.console import Console

    from slurm_colloc.report import admin, jobs
    from slurm_colloc.report.inquirer import JobQuery
    from slurm_colloc.report.model import SCHEMA_VERSION

    since = params.since or (DEFAULT_SINCE if not ids else None)
    q = JobQuery(ids=ids, user=params.user, account=params.account, since=since,
                 until=params.until, states=params.states, partitions=params.partitions)
    rows = inquirer.query(q)
    if ids and not rows and not any((params.states, params.user, params.account,
                                      params.partitions)):
        raise ReportError(f"job(s) {', '.join(ids)}: not known to Slurm (controller or "
                          "accounting)")
    table = jobs.build_table(rows, cfg, q)
    summary = admin.summarize_period(rows, cfg, since or "-", params.user)
    # entries sacct gave that could not be read: skipped, named, never fatal
    table.warnings[:0] = inquirer.warnings()
    summary.warnings[:0] = inquirer.warnings()
    if params.as_json:
        tj = table.to_json()
        # the period's figures at the top (as the period view always had them; "jobs"
        # is their count), the job table's rows under "table"
        d = {"schema_version": SCHEMA_VERSION, **summary.to_json(),
             "query": tj["query"], "totals": tj["totals"], "table": tj["jobs"],
             "warnings": list(dict.fromkeys(summary.warnings + table.warnings))}
        click.echo(json.dumps(d, indent=1))
        return 0
    # a wide table: never squeezed below 140 columns (a pipe or file reads as 80)
    console = Console(highlight=False, width=max(Console().width, 140))
    console.print(jobs.render(table, params.columns or jobs.DEFAULT_FORMAT))
    if params.since is not None or not ids:
        console.print("")
        console.print(admin.render(summary))
    return 0


def run(params: ReportParams, cfg: cfgmod.CollocConfig, inquirer) -> int:  # type: ignore[no-untyped-def]
    """Build and print the requested report; returns the exit code."""
    from rich.console import Console

    console = Console(highlight=False)
    if params.table:
        return _table(params, cfg, inquirer, params.ids)
    from slurm_colloc.report import job as job_report
    from slurm_colloc.report import model, text

    assert params.job_id is not None
    job_id = params.job_id.strip()
    tasks = inquirer.array_tasks(job_id)
    if tasks and params.html is None:  # an array job: the table of its tasks
        return _table(params, cfg, inquirer, tuple(tasks))
    try:
        rep = job_report.build(job_id, inquirer, cfg)
    except model.UnknownJobError as e:
        click.echo(f"colloc report: error: {e}", err=True)
        return EXIT_UNKNOWN
    if params.html is not None:
        from slurm_colloc.report import html

        try:
            params.html.write_text(html.render(rep))
        except OSError as e:
            raise ReportError(f"cannot write {params.html}: {e.strerror or e}") from e
    if params.as_json:
        click.echo(json.dumps(rep.to_json(), indent=1))
    else:
        console.print(text.render(rep))
        if params.html is not None:
            console.print(f"\nHTML report written to {params.html}", markup=False)
    return 0 if rep.colloc else EXIT_NO_DATA
