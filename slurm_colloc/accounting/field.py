"""Which Slurm job field holds colloc's ``cl1:`` record, and reading it from either.

Why two fields: Princeton jobstats' slurmctld epilog replaces a finished job's whole
AdminComment with its ``JS1:`` summary (``sacctmgr -i modify job ... set
AdminComment=``), so a site that runs it keeps colloc's record in SystemComment
instead (config ``record_field``). The writer uses the configured field only; every
reader looks there first and then in the other field, so records written before a
site switched (or by a node whose config had not changed yet) still read.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from slurm_colloc.accounting.codec import find_token, try_decode
from slurm_colloc.accounting.record import JobRecord
from slurm_colloc.config import RecordField

SLURM_NAME: dict[RecordField, str] = {
    "admin_comment": "AdminComment",
    "system_comment": "SystemComment",
}
"""The field's name for ``scontrol update``, ``sacctmgr modify job`` and sacct's
``--format`` (also the keys of :attr:`AccountingRecord.fields`)."""


def slurm_name(field: RecordField) -> str:
    """``AdminComment`` or ``SystemComment``."""
    return SLURM_NAME[field]


def read_order(prefer: RecordField) -> tuple[str, str]:
    """Slurm names of both fields, the configured one first."""
    other: RecordField = "system_comment" if prefer == "admin_comment" else "admin_comment"
    return SLURM_NAME[prefer], SLURM_NAME[other]


def record_in(fields: Mapping[str, str], prefer: RecordField = "admin_comment") -> JobRecord | None:
    """The colloc record in one job's fields (sacct names), the preferred field first;
    None when neither holds a readable one (foreign text such as ``JS1:`` is ignored)."""
    for name in read_order(prefer):
        rec = try_decode(fields.get(name))
        if rec is not None:
            return rec
    return None


def record_texts(fields: Mapping[str, str], prefer: RecordField = "admin_comment") -> list[str]:
    """Both fields' texts, the preferred first (empty ones left out)."""
    return [t for t in (str(fields.get(n, "") or "") for n in read_order(prefer)) if t]


_WHOLE_FIELD = re.compile(r"\s*JS\d+:")
"""Foreign records that must be their field's whole text: jobstats' ``JS1:`` summary
(its decoders and reportseff's base64-decode everything after the prefix, so any
text beside it breaks them)."""


def holds_whole_field_record(text: str | None) -> bool:
    """Whether ``text`` starts with a record that tolerates no neighbour (``JS1:``)."""
    return bool(text) and _WHOLE_FIELD.match(str(text)) is not None


def placement(current: Iterable[Mapping[str, str]], prefer: RecordField,
              text: str) -> tuple[str, str] | None:
    """Where and what to write: (Slurm field name, text), given the job's accounting
    rows as they are now (sacct names). The configured field, unless it already
    holds a jobstats summary: then colloc's token goes to the other field (beside
    any text there that is not a colloc record), so neither tool's record is lost
    whichever writes first. None when both fields hold such a summary."""
    rows = list(current)
    first, second = read_order(prefer)
    if not any(holds_whole_field_record(r.get(first)) for r in rows):
        return first, text
    if any(holds_whole_field_record(r.get(second)) for r in rows):
        return None
    m = find_token(text)
    token = m.group(0) if m else text
    there = next((str(r.get(second) or "") for r in reversed(rows) if r.get(second)), "")
    t = find_token(there)
    rest = (there[: t.start()] + " " + there[t.end():]).strip() if t else there.strip()
    return second, f"{rest} {token}" if rest else token


def carry_in_admin_comment(admin_comment: str, record: str) -> str:
    """The live job's AdminComment with ``record``'s ``cl1:`` token in place of its own.

    At a requeue the next attempt must find this one's record, and only AdminComment
    can be set on a pending job (``scontrol update SystemComment`` is refused on 24.11
    and 26.05), so the token travels there whatever ``record_field`` says; the rest of
    AdminComment (job_submit's ``colloc1:`` decision the next prolog reads) is kept.
    """
    new = find_token(record)
    if new is None:
        return admin_comment
    old = find_token(admin_comment)
    rest = (admin_comment[: old.start()] + " " + admin_comment[old.end():]
            if old else admin_comment).strip()
    return f"{rest} {new.group(0)}" if rest else new.group(0)
