"""Read what job_submit.lua recorded about a colloc job (its AdminComment).

job_submit writes ``colloc1:key=value,key=value`` with lowercase-safe characters
only (see slurm_colloc/site and docs/admin.md). Unknown or malformed text yields an
empty dict: node scripts must cope with jobs submitted before colloc was enabled.
"""

from __future__ import annotations

import re

PREFIX = "colloc1:"
_PAIR = re.compile(r"^([a-z_]{1,32})=([a-z0-9._:-]{0,128})$")
INT_KEYS = frozenset({"estimate_mib", "margin_mib", "shards", "shard_mib", "mem_mib"})


def parse(admin_comment: str) -> dict[str, int | str]:
    """Key/values of a ``colloc1:`` record; {} for anything else."""
    text = admin_comment.strip()
    if not text.lower().startswith(PREFIX):
        return {}
    out: dict[str, int | str] = {}
    for pair in text[len(PREFIX):].split(","):
        m = _PAIR.match(pair.strip().lower())
        if not m:
            continue
        key, value = m.groups()
        if key in INT_KEYS:
            try:
                out[key] = int(value)
            except ValueError:
                continue
        else:
            out[key] = value
    return out
