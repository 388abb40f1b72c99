"""The ``colloc1:`` AdminComment record job_submit.lua writes, and its parser.

Only ``[a-z0-9._=,:-]`` characters, so it survives slurmdbd's lowercasing. Unknown
keys are kept (``extra``) so a newer job_submit.lua does not break older readers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal, cast

RECORD_PREFIX = "colloc1:"
Mode = Literal["estimate", "explicit", "default", "shards", "whole"]
_MODES = ("estimate", "explicit", "default", "shards", "whole")
_PAIR = re.compile(r"^([a-z0-9_]+)=([a-z0-9._-]*)$")
_INTS = ("need_mib", "shards", "shard_mib", "alloc_mib", "est_mib", "margin_mib", "sm_pct",
         "mem_shards")


@dataclass(frozen=True)
class CollocRecord:
    """What job_submit decided for one job."""

    mode: Mode
    need_mib: int
    shards: int
    shard_mib: int
    alloc_mib: int
    estimator: str | None = None
    est_mib: int | None = None
    margin_mib: int | None = None
    fingerprint: str | None = None
    why: str | None = None
    sm_pct: int | None = None
    """Expected SM activity (%) compute admission sized the job by (None: it was off)."""
    sm_source: str | None = None
    """``history`` (the user's measured runs of the model) or ``prior``."""
    mem_shards: int | None = None
    """Shards memory alone asked for (``shards`` is larger when compute decided)."""
    extra: dict[str, str] = field(default_factory=dict)


def parse_record(text: str | None) -> CollocRecord | None:
    """Parse an AdminComment; None when it is not (or not entirely) a colloc1 record.

    The record may be followed by other data after a ``;`` or whitespace (a later
    writer appending to AdminComment); only the first token is read.
    """
    if not text or not text.startswith(RECORD_PREFIX):
        return None
    body = re.split(r"[;\s]", text[len(RECORD_PREFIX):], maxsplit=1)[0]
    values: dict[str, str] = {}
    for pair in body.split(","):
        m = _PAIR.match(pair)
        if not m:
            return None
        values[m.group(1)] = m.group(2)
    try:
        ints = {k: int(values.pop(k)) for k in _INTS if k in values}
    except ValueError:
        return None
    mode = values.pop("mode", "")
    if mode not in _MODES or not all(k in ints for k in _INTS[:3]):
        return None
    return CollocRecord(
        mode=cast(Mode, mode),
        need_mib=ints["need_mib"],
        shards=ints["shards"],
        shard_mib=ints["shard_mib"],
        alloc_mib=ints.get("alloc_mib", ints["shards"] * ints["shard_mib"]),
        estimator=values.pop("est", None),
        est_mib=ints.get("est_mib"),
        margin_mib=ints.get("margin_mib"),
        fingerprint=values.pop("fp", None),
        why=values.pop("why", None),
        sm_pct=ints.get("sm_pct"),
        sm_source=values.pop("sm_src", None),
        mem_shards=ints.get("mem_shards"),
        extra=values,
    )
