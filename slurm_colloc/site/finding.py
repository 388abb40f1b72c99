"""One doctor check's verdict (shared by the doctor and its per-part checks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Level = Literal["ok", "warn", "fail"]


@dataclass(frozen=True)
class Finding:
    """One check's verdict."""

    level: Level
    what: str
    detail: str = ""
