"""Small formatting helpers the text, HTML and table reports share."""

from __future__ import annotations


def hms(seconds: int | float | None, missing: str = "?") -> str:
    """``[D-]HH:MM:SS`` as Slurm prints elapsed times; ``missing`` when unknown."""
    if seconds is None:
        return missing
    d, rem = divmod(int(seconds), 86400)
    h, rem = divmod(rem, 3600)
    m, sec = divmod(rem, 60)
    return (f"{d}-" if d else "") + f"{h:02d}:{m:02d}:{sec:02d}"


def gib(mib: float | None) -> str:
    """MiB as a short GiB figure (``?`` when unknown)."""
    return "?" if mib is None else f"{mib / 1024:.1f} GiB"
