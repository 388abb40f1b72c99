"""Slurm hostlist expressions (``gpu[01-04,07],login1``), expanded without Slurm.

colloc.conf names nodes the way slurm.conf does (``[nodes."gpu[01-04]"]``), so an
admin can copy a ``NodeName=`` expression. The config loader runs on login hosts,
in prologs and in tests, and must not call ``scontrol show hostnames``: this module
is the small part of Slurm's syntax that node names need:

* a comma list at the top level: ``a,b[1-2],c``;
* brackets holding a comma list of numbers and ranges: ``node[1-3,7,10-11]``;
* several brackets in one name: ``rack[1-2]-gpu[01-02]`` (every combination);
* zero padding taken from the range's first number, as Slurm does: ``[01-10]`` gives
  ``01`` .. ``10``, ``[1-10]`` gives ``1`` .. ``10``.

An expression that would name more than :data:`MAX_HOSTS` hosts is refused: a typo
like ``[0-99999999]`` must be an error, not a 100-million-entry set in a prolog.
"""

from __future__ import annotations

import itertools
import re

MAX_HOSTS = 65536
"""The most names one expression may expand to."""

_NAME_CHARS = re.compile(r"[A-Za-z0-9._-]*")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


class HostlistError(ValueError):
    """An expression that is not a valid hostlist."""


def _split_top(expr: str) -> list[str]:
    """Split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(expr):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise HostlistError(f"{expr!r}: nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"{expr!r}: ']' without '['")
        elif ch == "," and depth == 0:
            parts.append(expr[start:i])
            start = i + 1
    if depth:
        raise HostlistError(f"{expr!r}: '[' without ']'")
    parts.append(expr[start:])
    return parts


def _numbers(expr: str, body: str) -> list[str]:
    """The numbers of one bracket's body (``01-04,07``), padded as written."""
    out: list[str] = []
    for item in body.split(","):
        m = _RANGE.fullmatch(item.strip())
        if not m:
            raise HostlistError(f"{expr!r}: [{body}]: {item!r} is not N or N-M")
        lo_s, hi_s = m.group(1), m.group(2) or m.group(1)
        lo, hi = int(lo_s), int(hi_s)
        if hi < lo:
            raise HostlistError(f"{expr!r}: [{body}]: range {item!r} goes backwards")
        if len(out) + hi - lo + 1 > MAX_HOSTS:
            raise HostlistError(f"{expr!r}: more than {MAX_HOSTS} hosts")
        width = len(lo_s)
        out += [str(n).zfill(width) for n in range(lo, hi + 1)]
    return out


def _expand_one(expr: str, item: str) -> list[str]:
    """The names of one top-level item: literal text and bracket groups, combined."""
    pieces: list[list[str]] = []
    for m in re.finditer(r"([^\[]*)(?:\[([^\]]*)\])?", item):
        literal, body = m.group(1), m.group(2)
        if not _NAME_CHARS.fullmatch(literal):
            raise HostlistError(f"{expr!r}: {literal!r}: a host name has letters, digits, "
                                "'.', '_' and '-' only")
        if literal:
            pieces.append([literal])
        if body is not None:
            if not body.strip():
                raise HostlistError(f"{expr!r}: empty brackets")
            pieces.append(_numbers(expr, body))
    count = 1
    for p in pieces:
        count *= len(p)
        if count > MAX_HOSTS:
            raise HostlistError(f"{expr!r}: more than {MAX_HOSTS} hosts")
    return ["".join(combo) for combo in itertools.product(*pieces)] if pieces else []


def expand(expr: str) -> list[str]:
    """Every host name ``expr`` names, in order, without repeats.

    Raises :class:`HostlistError` for a malformed expression, an empty one, or one
    naming more than :data:`MAX_HOSTS` hosts.
    """
    if not isinstance(expr, str) or not expr.strip():
        raise HostlistError(f"{expr!r}: an empty hostlist")
    names: dict[str, None] = {}
    for item in _split_top(expr.strip()):
        item = item.strip()
        if not item:
            raise HostlistError(f"{expr!r}: an empty entry in the comma list")
        for name in _expand_one(expr, item):
            names[name] = None
            if len(names) > MAX_HOSTS:
                raise HostlistError(f"{expr!r}: more than {MAX_HOSTS} hosts")
    return list(names)


def contains(expr: str, host: str) -> bool:
    """Whether ``expr`` names ``host`` (exactly; Slurm node names are case-sensitive)."""
    return host in expand(expr)
