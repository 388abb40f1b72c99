"""The allocation that failed, read from an out-of-memory line (issue 27).

Why: the report showed "peak 4.0 GiB (67 %)" next to ``gpu-oom`` while the number that
matters, the 10 GiB the job asked for when it died, was only in the evidence text. A
measured peak never includes the allocation that failed (it was refused), so sizing the
next run from the peak alone repeats the crash. The epilog reads the size from the
matched line and keeps it in the attempt record; the report reads old records' evidence
tails with the same function.

Frameworks and their words (the patterns of :mod:`.patterns`):

* PyTorch >= 2.1: ``Tried to allocate 10.00 GiB. ... this process has 4.00 GiB memory
  in use``; before 2.1: ``Tried to allocate 20.00 MiB (GPU 0; ...; 14.24 GiB already
  allocated; ...)``;
* CuPy: ``Out of memory allocating 1,073,741,824 bytes (allocated so far: N bytes)``;
* JAX/XLA: ``Out of memory while trying to allocate 7406166528 bytes``, ``Failed to
  allocate request for 2.99GiB``;
* TensorFlow's driver line: ``failed to allocate 3.77G (4046333952 bytes)``;
* NCCL: ``Failed to CUDA malloc 123456 bytes``.

Input is the user's log text: only numbers with a unit are taken, bounded (no size over
:data:`MAX_MIB`), and a line that says nothing known gives None.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

MAX_MIB = 1 << 24
"""Largest size believed (16 TiB); a larger figure is not a GPU allocation."""
_UNITS = {"": 1, "b": 1, "bytes": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 1000,
          "m": 1 << 20, "mib": 1 << 20, "mb": 10 ** 6, "g": 1 << 30, "gib": 1 << 30,
          "gb": 10 ** 9, "t": 1 << 40, "tib": 1 << 40, "tb": 10 ** 12}
_SIZE = r"([\d][\d,]{0,20}(?:\.\d{1,6})?)\s?(bytes|[KMGT]i?B|[KMGT]|B)"
_ALLOC = (
    re.compile(r"Tried to allocate " + _SIZE),
    re.compile(r"Out of memory allocating " + _SIZE),
    re.compile(r"Out of memory (?:while trying to allocate|allocating) " + _SIZE),
    re.compile(r"Failed to allocate request for " + _SIZE),
    re.compile(r"failed to allocate [\d.]+[KMGT]? \((\d{1,20}) (bytes)\)"),
    re.compile(r"Failed to CUDA (?:calloc|malloc|host alloc) (\d{1,20}) (bytes)"),
)
_IN_USE = (
    re.compile(r"this process has " + _SIZE + r" memory in use"),
    re.compile(r"; " + _SIZE + r" already allocated"),
    re.compile(r"\(allocated so far: " + _SIZE + r"\)"),
)


@dataclass(frozen=True)
class FailedAllocation:
    """What one OOM line says: the refused request and what the process already held."""

    alloc_mib: int
    """The allocation that failed, MiB (rounded up)."""
    in_use_mib: int | None = None
    """Memory the process held when it failed, MiB, if the message says."""


def _mib(number: str, unit: str) -> int | None:
    try:
        value = float(number.replace(",", ""))
    except ValueError:
        return None
    mult = _UNITS.get(unit.lower())
    if mult is None or not math.isfinite(value):
        return None
    mib = math.ceil(value * mult / (1 << 20))
    return mib if 0 <= mib <= MAX_MIB else None


def _first(patterns: tuple[re.Pattern[str], ...], line: str) -> int | None:
    for p in patterns:
        m = p.search(line)
        if m is not None:
            return _mib(m.group(1), m.group(2))
    return None


def failed_allocation(line: str | None) -> FailedAllocation | None:
    """The failed allocation named in ``line`` (one log line), or None."""
    if not line:
        return None
    line = line[:4096]
    alloc = _first(_ALLOC, line)
    if alloc is None:
        return None
    return FailedAllocation(alloc, _first(_IN_USE, line))


def in_lines(lines: list[str] | tuple[str, ...]) -> FailedAllocation | None:
    """The last failed allocation named in ``lines`` (an evidence tail), or None."""
    for ln in reversed(lines):
        found = failed_allocation(ln)
        if found is not None:
            return found
    return None
