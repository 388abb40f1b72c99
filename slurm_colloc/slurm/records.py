"""The records the Slurm adapter hands out, in a module of their own so that the
parsers of Slurm's output (``sacct_json``) and the adapter can both use them without
importing each other."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

SACCT_FIELDS = (  # the names AccountingRecord.fields carries (sacct --format names)
    "JobIDRaw",
    "JobName",
    "User",
    "State",
    "ExitCode",
    "Submit",
    "Start",
    "End",
    "Elapsed",
    "AllocTRES",
    "ReqTRES",
    "NodeList",
    "AdminComment",
    "Comment",
    "JobID",
    "Account",
)



class SlurmError(RuntimeError):
    """A Slurm command failed; the message carries the command and its stderr."""


@dataclass(frozen=True)
class AccountingRecord:
    """One job (not step) record from ``sacct --json``, by its ``--format`` names.

    ``fields`` has every name of :data:`SACCT_FIELDS` in sacct's text formats (local
    ISO times or ``Unknown``, ``[D-]HH:MM:SS``, ``N:S``, ``type/name=count`` TRES);
    see :mod:`slurm_colloc.slurm.sacct_json` for the mapping.
    """

    job_id: str
    state: str
    fields: Mapping[str, str] = field(default_factory=dict)

    @property
    def exit_code(self) -> str:
        """``N:S`` (exit status : signal) as sacct prints it."""
        return self.fields.get("ExitCode", "")
