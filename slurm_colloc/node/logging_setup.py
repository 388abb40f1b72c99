"""Logging for node scripts: one prefix per component with the job id.

``colloc: epilog: job 1234: requeued on a whole GPU (gpu-oom, torch-oom-new)``.
Goes to ``CollocConfig.log_file`` (reopened after rotation), to syslog where the host
has ``/dev/log`` (:mod:`slurm_colloc.log_handlers`) and, for Slurm's own log, to stderr.

**One record, one line** (issue 23). Root logs text the user chose: output and
error paths, job names, comments, the matched line of a log. A newline in
``--output`` reached root's log unescaped, so a user could forge a whole line
(``... colloc: epilog: job 1: requeued``) in root's log and in slurmd's. Every
message is therefore escaped by :class:`slurm_colloc.log_escape.EscapingFormatter`
after its arguments are filled in (the collector uses the same formatter).
"""

from __future__ import annotations

import logging
import logging.handlers
import sys

from slurm_colloc.log_escape import EscapingFormatter, escape_controls
from slurm_colloc.log_handlers import file_handler, syslog_handler

__all__ = ["EscapingFormatter", "JobAdapter", "escape_controls", "node_logger"]


class JobAdapter(logging.LoggerAdapter[logging.Logger]):
    """Prefixes every message with the component and the job id."""

    def process(self, msg: str, kwargs):  # type: ignore[no-untyped-def]
        extra = self.extra or {}
        return f"{extra.get('component')}: job {extra.get('job_id')}: {msg}", kwargs


def node_logger(component: str, job_id: object, log_file: str | None) -> JobAdapter:
    """A logger for one node script invocation (never raises on a bad log path)."""
    logger = logging.getLogger(f"colloc.node.{component}")
    fmt = EscapingFormatter("%(asctime)s colloc: %(message)s")
    if not logger.handlers:
        logger.setLevel(logging.INFO)
        err = logging.StreamHandler(sys.stderr)
        err.setFormatter(fmt)
        logger.addHandler(err)
        logger.propagate = False
    has_file = any(isinstance(h, logging.FileHandler) for h in logger.handlers)
    if log_file and not has_file:
        try:
            logger.addHandler(file_handler(log_file, fmt))
        except OSError as e:
            logger.warning("cannot open log file %s: %s", log_file, e)
    if not any(isinstance(h, logging.handlers.SysLogHandler) for h in logger.handlers):
        sl = syslog_handler()
        if sl is not None:
            logger.addHandler(sl)
    return JobAdapter(logger, {"component": component, "job_id": job_id})
