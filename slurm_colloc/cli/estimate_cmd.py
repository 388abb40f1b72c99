"""``colloc estimate``: GPU memory of a training job from its model summary.

Contract (the cli_filter and sbatch templates depend on it):

    colloc estimate --summary FILE --batch-size N [--seq-len L]
        [--optimizer sgd|momentum|adam|adamw] [--precision fp32|amp-fp16|amp-bf16]
        [--attention eager|sdpa|flash] [--estimator NAME] [--json]

* ``--json``: exactly one JSON object on stdout with ``estimate_mib`` (int),
  ``estimator``, ``breakdown`` (MiB per component), ``margin_mib`` (int),
  ``fingerprint`` (lowercase hex of the normalised summary), ``uncertainty`` and
  ``history_source`` (where measured peaks were looked for: ``accounting``,
  ``sqlite`` or ``none`` with ``--no-history``); with the accounting history also
  ``history_runs``: which of the user's runs of the model the estimate came from and
  which were not used and why (:class:`slurm_colloc.accounting.history_runs.Provenance`).
* Exit 0 on success; exit 2 with one line on stderr for bad input (unreadable,
  unparseable or oversized file, out-of-range batch size, unknown option value).

History (measured peaks of earlier runs) is read for the calling user only: the
cli_filter runs this as the submitting user, so ``os.getuid()`` is whose jobs count
(security issue 11, H3; policy in ``slurm_colloc/estimators/history.py``). The fingerprint is
computed here from the summary file's contents, never taken from the environment or
an argument. ``history_source`` (config) picks the store: ``accounting`` (default)
asks slurmdbd for the user's completed jobs of the last ``history_days`` days and
reads their records (:mod:`slurm_colloc.accounting.history`; slurmdbd down or slow is
a warning on stderr and no history, never a failure); ``sqlite`` reads ``history_db``.

It runs inside every ``sbatch --colloc``, so it must stay fast: no torch, no pandas,
nothing imported that the default estimator does not need.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from slurm_colloc.estimators.physics import OPTIMIZERS, PRECISIONS

if TYPE_CHECKING:
    from slurm_colloc.accounting.history_runs import Provenance
    from slurm_colloc.config import CollocConfig
    from slurm_colloc.estimators import HistoryStore


def _fail(message: str) -> None:
    click.echo(f"colloc estimate: error: {' '.join(message.split())}", err=True)
    sys.exit(2)


def _warn(message: str) -> None:
    click.echo(f"colloc estimate: warning: {' '.join(message.split())}", err=True)


@click.command()
@click.option("--summary", "summary_path", required=True, metavar="FILE",
              help="Model summary: torchinfo, torchsummary, print(model), Keras or colloc JSON.")
@click.option("--batch-size", required=True, type=int, metavar="N", help="Per-GPU batch size.")
@click.option("--seq-len", type=int, default=None, metavar="L",
              help="Sequence length (token models).")
@click.option("--optimizer", type=click.Choice(OPTIMIZERS), default="adam", show_default=True)
@click.option("--precision", type=click.Choice(PRECISIONS), default="fp32", show_default=True)
@click.option("--attention", type=click.Choice(("eager", "sdpa", "flash")), default=None,
              help="Attention implementation of the job (default: what the summary shows, "
                   "else eager).")
@click.option("--estimator", "estimator_name", default=None, metavar="NAME",
              help="Estimator (default: the site's configured one, normally layer-aware).")
@click.option("--model-factory", default=None, metavar="MODULE:FUNC",
              help="For --estimator tracing: returns (model, example_input).")
@click.option("--no-history", is_flag=True, help="Ignore measured peaks of earlier runs.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def estimate(summary_path: str, batch_size: int, seq_len: int | None, optimizer: str,
             precision: str, attention: str | None, estimator_name: str | None,
             model_factory: str | None, no_history: bool, as_json: bool) -> None:
    """Estimate the peak GPU memory (MiB, as nvidia-smi shows it) of a training job."""
    from slurm_colloc.config import ConfigError, load
    from slurm_colloc.estimators import EstimatorInputError, read_summary_file
    from slurm_colloc.estimators import estimate as run_estimate

    try:
        cfg = load()
    except ConfigError as e:
        _fail(str(e))
        return
    history, source = _history(cfg, no_history)
    try:
        summary = read_summary_file(Path(summary_path))
        result = run_estimate(
            summary,
            batch_size=batch_size,
            seq_len=seq_len,
            optimizer=optimizer,
            precision=precision,
            estimator=estimator_name or cfg.estimator,
            history=history,
            model_factory=model_factory,
            attention=attention,
        )
    except EstimatorInputError as e:
        _fail(str(e))
        return
    runs = _provenance(history, result.fingerprint, batch_size, seq_len, optimizer, precision)
    if as_json:
        extra = {"history_runs": runs.to_json()} if runs is not None else {}
        click.echo(json.dumps({**result.to_json(), "history_source": source, **extra},
                              sort_keys=True))
        return
    click.echo(f"{result.estimate_mib} MiB ({result.estimator}, margin {result.margin_mib} MiB, "
               f"fingerprint {result.fingerprint})")
    for k, v in result.breakdown.items():
        click.echo(f"  {k:<16} {v:>10.0f} MiB")
    notes = result.uncertainty.get("notes")
    if isinstance(notes, list):
        for note in notes:
            click.echo(f"  note: {note}")
    if runs is not None and (runs.used or runs.bounds or runs.ignored):
        click.echo(f"  history: {runs.line()}")


def _history(cfg: CollocConfig, no_history: bool) -> tuple[HistoryStore | None, str]:
    """The caller's history store and its ``history_source`` name."""
    from slurm_colloc.estimators import SqliteHistory

    if no_history:
        return None, "none"
    if cfg.history_source == "sqlite":
        return SqliteHistory(cfg.history_db, uid=os.getuid()), "sqlite"
    from slurm_colloc.accounting.history import AccountingHistory

    return AccountingHistory(uid=os.getuid(), days=cfg.history_days, warn=_warn,
                             prefer=cfg.record_field), "accounting"


def _provenance(history: object, fingerprint: str, batch_size: int, seq_len: int | None,
                optimizer: str, precision: str) -> Provenance | None:
    """Which of the user's runs the estimate came from (accounting history only)."""
    from slurm_colloc.accounting.history import AccountingHistory

    if not isinstance(history, AccountingHistory):
        return None
    return history.provenance(fingerprint, batch_size, seq_len, optimizer, precision)
