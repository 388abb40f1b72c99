"""Memory sizes as people and CUDA write them, and as PyTorch prints them.

Shared by the runtime (MPS v3 limits) and the simulation, so it lives outside both.

Sizes reach the simulation from three places that each have their own habits: the
``colloc-simjob --mem`` flag (``8G``, ``8192M``, ``1.5GiB``), MPS limits
(``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=8G"``, ``set_default_device_pinned_mem_limit 0
8G``) and the OOM text we must print exactly like PyTorch does, because the epilog's
OOM detector is tested against that text.
"""

from __future__ import annotations

import re

MIB = 1024 * 1024

_UNITS = {
    "": MIB,  # a bare number is MiB: the unit every colloc component speaks
    "B": 1,
    "K": 1024,
    "KB": 1024,
    "KIB": 1024,
    "M": MIB,
    "MB": MIB,
    "MIB": MIB,
    "G": 1024 * MIB,
    "GB": 1024 * MIB,
    "GIB": 1024 * MIB,
    "T": 1024 * 1024 * MIB,
    "TB": 1024 * 1024 * MIB,
    "TIB": 1024 * 1024 * MIB,
}
_SIZE_RE = re.compile(r"^\s*([+-]?\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


class SizeError(ValueError):
    """A size that cannot be read; the message names the text and the accepted forms."""


def parse_size_bytes(text: str) -> int:
    """Parse ``8G``, ``8192M``, ``1.5GiB``, ``512`` (MiB) into bytes.

    Binary units throughout (``G`` = GiB), as CUDA/MPS do. Negative sizes are rejected
    here so every caller reports them the same way.
    """
    m = _SIZE_RE.match(text)
    if not m:
        raise SizeError(
            f"cannot read size {text!r}: use a number with a unit like 8G, 8192M, 512MiB"
        )
    number, unit = m.group(1), m.group(2).upper()
    if unit not in _UNITS:
        raise SizeError(
            f"cannot read size {text!r}: unknown unit {m.group(2)!r} (use B, K, M, G, T)"
        )
    value = float(number) * _UNITS[unit]
    if value < 0:
        raise SizeError(f"size {text!r} is negative")
    return int(value)


def parse_size_mib(text: str) -> int:
    """Like :func:`parse_size_bytes`, rounded up to whole MiB (the simulation's unit)."""
    return -(-parse_size_bytes(text) // MIB)


def parse_device_limits(text: str) -> dict[int | None, int]:
    """Parse an MPS pinned-memory limit list into ``{device: MiB}``.

    Accepts the forms the CUDA documentation gives for
    ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``: ``"0=8G,1=4G"``, and the bare ``"8G"`` that
    applies to every device (key ``None``).
    """
    limits: dict[int | None, int] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "=" in part:
            dev_text, size_text = part.split("=", 1)
            try:
                dev = int(dev_text.strip())
            except ValueError:
                raise SizeError(f"cannot read device index {dev_text!r} in {text!r}") from None
            if dev < 0:
                raise SizeError(f"device index {dev} in {text!r} is negative")
            limits[dev] = parse_size_mib(size_text)
        else:
            limits[None] = parse_size_mib(part)
    if not limits:
        raise SizeError(f"empty memory limit {text!r}")
    return limits


def limit_for(limits: dict[int | None, int], device: int) -> int | None:
    """The limit that applies to ``device``: its own entry, else the all-devices one."""
    if device in limits:
        return limits[device]
    return limits.get(None)


def torch_format_size(nbytes: int) -> str:
    """Format bytes exactly as PyTorch's CUDA caching allocator does in OOM messages.

    Mirrors ``format_size`` in c10/cuda/CUDACachingAllocator.cpp: ``N bytes`` up to
    1 KiB, then KiB / MiB / GiB with two decimals (each unit up to and including 1024
    of the previous one).
    """
    if nbytes <= 1024:
        return f"{nbytes} bytes"
    if nbytes <= MIB:
        return f"{nbytes / 1024:.2f} KiB"
    if nbytes <= 1024 * MIB:
        return f"{nbytes / MIB:.2f} MiB"
    return f"{nbytes / (1024 * MIB):.2f} GiB"
