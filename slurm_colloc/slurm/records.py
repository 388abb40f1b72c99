"""The records the Slurm adapter hands out, in a module of their own so that the
parsers of Slurm's output (``sacct_json``) and the adapter can both use them without
importing each other."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

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
    "SystemComment",
    "Comment",
    "JobID",
    "Account",
    "Partition",
)


class SlurmError(RuntimeError):
    """A Slurm command failed; the message carries the command and its stderr."""


@dataclass(frozen=True)
class JobState:
    """A job state as data_parser v0.0.42 prints it: one base state plus flags.

    ``["PENDING", "REQUEUED"]`` is base PENDING with flag REQUEUED; the one word
    Slurm's text tools print for it (``REQUEUED``) is what ``SlurmJob.state`` and
    ``AccountingRecord.state`` carry (``data_parser.state_name``).
    """

    base: str
    flags: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ExitCode:
    """An exit code as v0.0.42 prints it (``status`` list, return code, signal).

    The signal is kept: a job killed by SIGKILL is ``0:9`` here as in sacct's text,
    never "exit 0".
    """

    status: frozenset[str]
    """SUCCESS, ERROR, SIGNALED, CORE_DUMPED, PENDING or INVALID (Slurm's names)."""
    return_code: int | None
    """The exit status (None where Slurm has none, e.g. killed by a signal)."""
    signal: int | None
    """The signal number that ended it (None: not set)."""
    signal_name: str = ""

    @property
    def pair(self) -> tuple[int, int]:
        """(exit status, signal) as sacct's ``N:S``."""
        return (self.return_code or 0, self.signal or 0)

    @property
    def text(self) -> str:
        """sacct's ``N:S``; '' while the job has not ended (status PENDING only)."""
        if self.status == frozenset({"PENDING"}):
            return ""
        return "{}:{}".format(*self.pair)


NO_EXIT = ExitCode(frozenset({"PENDING"}), None, None)
"""What a record carries when Slurm gave no exit code (yet)."""


@dataclass(frozen=True)
class AccountingRecord:
    """One job (not step) record from ``sacct --json``, by its ``--format`` names.

    ``fields`` has every name of :data:`SACCT_FIELDS` in sacct's text formats (local
    ISO times or ``Unknown``, ``[D-]HH:MM:SS``, ``N:S``, ``type/name=count`` TRES);
    see :mod:`slurm_colloc.slurm.sacct_json` for the mapping.
    """

    job_id: str
    state: str
    """One word, as sacct's text prints it (``REQUEUED`` for ``["PENDING","REQUEUED"]``)."""
    fields: Mapping[str, str] = field(default_factory=dict)
    job_state: JobState | None = None
    """The typed state (base and flags); None for records not read from JSON."""
    exit: ExitCode = NO_EXIT
    """The typed exit code, signal kept (``fields["ExitCode"]`` is its ``N:S``)."""
    alloc_tres: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    """Allocated TRES by name (``mem`` in MiB, ``gres/shard``); unknown counts left out."""

    @property
    def exit_code(self) -> str:
        """``N:S`` (exit status : signal) as sacct prints it."""
        return self.fields.get("ExitCode", "")
