"""History hook: measured peaks of the same model beat any estimate from its summary.

The metrics sidecar (another component) calls :meth:`SqliteHistory.record` after a
job; ``colloc estimate`` calls :meth:`peaks` before estimating, and
:mod:`estimators.history_scaling` turns peaks at other batch sizes into this one's. Keys are the
summary fingerprint plus the job parameters that change memory. The store keeps the
largest peak seen (a job that once needed more may need it again).
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Protocol

from estimators.history_scaling import HISTORY_MARGIN

__all__ = ["HISTORY_MARGIN", "HistoryStore", "SqliteHistory"]


class HistoryStore(Protocol):
    """Where measured peaks are looked up (and recorded, by the metrics side)."""

    def lookup(self, fingerprint: str, batch_size: int, seq_len: int | None, optimizer: str,
               precision: str) -> int | None:
        """Measured peak MiB of an earlier run with the same key, or None."""
        ...

    def peaks(self, fingerprint: str, seq_len: int | None, optimizer: str,
              precision: str) -> dict[int, int]:
        """Measured peak MiB by batch size for the key without the batch size."""
        ...

    def record(self, fingerprint: str, batch_size: int, seq_len: int | None, optimizer: str,
               precision: str, peak_mib: int, job_id: str | None = None) -> None:
        """Remember a measured peak."""
        ...


_SCHEMA = """
CREATE TABLE IF NOT EXISTS peaks (
    fingerprint TEXT NOT NULL,
    batch_size INTEGER NOT NULL,
    seq_len INTEGER NOT NULL,
    optimizer TEXT NOT NULL,
    precision TEXT NOT NULL,
    peak_mib INTEGER NOT NULL,
    runs INTEGER NOT NULL DEFAULT 1,
    last_job TEXT,
    updated REAL NOT NULL,
    PRIMARY KEY (fingerprint, batch_size, seq_len, optimizer, precision)
)
"""


class SqliteHistory:
    """A :class:`HistoryStore` in one sqlite file (``CollocConfig.history_db``).

    A missing database is an empty history for lookups (login nodes may not have it);
    it is created on the first :meth:`record`.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def _connect(self, create: bool) -> sqlite3.Connection | None:
        if not create and not self.path.exists():
            return None
        if create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        uri = f"file:{self.path}?mode={'rwc' if create else 'ro'}"
        con = sqlite3.connect(uri, uri=True, timeout=2.0)
        if create:
            con.execute(_SCHEMA)
        return con

    def lookup(self, fingerprint: str, batch_size: int, seq_len: int | None, optimizer: str,
               precision: str) -> int | None:
        """Largest measured peak for the key, or None (also when the db is absent)."""
        try:
            con = self._connect(create=False)
        except sqlite3.Error:
            return None
        if con is None:
            return None
        try:
            row = con.execute(
                "SELECT peak_mib FROM peaks WHERE fingerprint=? AND batch_size=? AND seq_len=?"
                " AND optimizer=? AND precision=?",
                (fingerprint.lower(), batch_size, seq_len or 0, optimizer, precision),
            ).fetchone()
        except sqlite3.Error:
            return None  # no table yet, or a db of another version: no history
        finally:
            con.close()
        return int(row[0]) if row else None

    def peaks(self, fingerprint: str, seq_len: int | None, optimizer: str,
              precision: str) -> dict[int, int]:
        """Largest measured peak per batch size ({} when nothing or no db)."""
        try:
            con = self._connect(create=False)
        except sqlite3.Error:
            return {}
        if con is None:
            return {}
        try:
            rows = con.execute(
                "SELECT batch_size, peak_mib FROM peaks WHERE fingerprint=? AND seq_len=?"
                " AND optimizer=? AND precision=?",
                (fingerprint.lower(), seq_len or 0, optimizer, precision),
            ).fetchall()
        except sqlite3.Error:
            return {}
        finally:
            con.close()
        return {int(b): int(p) for b, p in rows}

    def record(self, fingerprint: str, batch_size: int, seq_len: int | None, optimizer: str,
               precision: str, peak_mib: int, job_id: str | None = None) -> None:
        """Insert or raise the stored peak for the key."""
        con = self._connect(create=True)
        assert con is not None
        with con:
            con.execute(
                "INSERT INTO peaks VALUES (?,?,?,?,?,?,1,?,?) ON CONFLICT DO UPDATE SET "
                "peak_mib=max(peak_mib, excluded.peak_mib), runs=runs+1, "
                "last_job=excluded.last_job, updated=excluded.updated",
                (fingerprint.lower(), batch_size, seq_len or 0, optimizer, precision,
                 int(peak_mib), job_id, time.time()),
            )
        con.close()
