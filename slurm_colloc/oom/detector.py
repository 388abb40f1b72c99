"""Scan a job's logs for the reason it died: GPU OOM, MPS fault, host OOM, or none.

The epilog calls :func:`scan_files` on the job's stdout/stderr. Its budget is
bounded whatever the user wrote:

* **Only the tail.** The last ``tail_bytes`` of each file (config
  ``log_scan_tail_mib``, 64 MiB): a crash message is at the end of the log.
* **Backwards, in chunks, with early exit.** Chunks are read from the end with
  ``pread`` (``chunk_bytes`` plus a ``max_line_bytes`` margin either side, so memory
  stays at a few MiB whatever the file size). The scan stops at the first (= latest)
  GPU-OOM line, the highest-priority cause; otherwise it covers the whole tail.
* **Needles first, regexes second.** Each pattern names literal needles; a chunk is
  searched with ``bytes.find`` and only the lines around a hit meet a regex, so time
  is linear in the bytes read even on adversarial logs.
* **Lines are capped** at ``max_line_bytes`` either side of a hit: a 1 GB line with no
  newline costs the same as many short ones. A message split by that cap can be
  missed; real messages are far shorter than the 64 KiB default.
* **Never raises on I/O.** Missing, unreadable, refused (symlink, FIFO, device, wrong
  owner) or vanishing files give a :class:`ScanResult` whose ``status`` says so.

Which cause wins when a log shows several: ``gpu-oom`` > ``mps-fault`` > ``cuda-fatal`` >
``host-oom``
(see :data:`~slurm_colloc.oom.patterns.CAUSE_PRIORITY`); the evidence is the latest
line of the winning cause. Other causes seen in the scanned part are listed in
``also_seen``. A match says what the log *shows*; whether the job failed because of
it is for the caller to combine with the job's exit state (a framework may catch an
OOM and retry with a smaller batch).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from slurm_colloc.config import CollocConfig
from slurm_colloc.oom.patterns import CAUSE_PRIORITY, PATTERNS, AttemptCause, Cause, OomPattern
from slurm_colloc.oom.safe_open import RefusedPath, open_log

ScanCause = AttemptCause
ScanStatus = Literal["ok", "missing", "refused", "unreadable"]

MIB = 1 << 20
DEFAULT_TAIL_BYTES = CollocConfig().log_scan_tail_mib * MIB
DEFAULT_CHUNK_BYTES = 4 * MIB
DEFAULT_MAX_LINE_BYTES = 64 * 1024
DEFAULT_MAX_CANDIDATES = 200_000
CONTEXT_LINES = 3
CONTEXT_WINDOW = 16 * 1024
MAX_EVIDENCE_CHARS = 600


def tail_bytes_from_config(cfg: CollocConfig) -> int:
    """``log_scan_tail_mib`` in bytes (the default of every scan function)."""
    return cfg.log_scan_tail_mib * MIB


@dataclass(frozen=True)
class Evidence:
    """One matched line, printable as is (control characters replaced, length capped)."""

    pattern_id: str
    cause: Cause
    framework: str
    confidence: str
    offset: int
    """Byte offset of the start of the matched line in the file."""
    line: str
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Plain data for logs, JSON and the accounting record."""
        return {
            "pattern_id": self.pattern_id,
            "cause": self.cause,
            "framework": self.framework,
            "confidence": self.confidence,
            "offset": self.offset,
            "line": self.line,
            "before": list(self.before),
            "after": list(self.after),
        }


@dataclass(frozen=True)
class ScanResult:
    """What one file showed, or why it could not be read."""

    path: str
    cause: ScanCause
    status: ScanStatus = "ok"
    evidence: Evidence | None = None
    also_seen: tuple[Evidence, ...] = ()
    error: str | None = None
    file_size: int = 0
    bytes_scanned: int = 0
    complete: bool = True
    """False when the scan did not cover the whole file (tail, line or candidate cap,
    or early exit on a GPU OOM)."""

    @property
    def pattern_id(self) -> str | None:
        """Id of the pattern that decided :attr:`cause`."""
        return self.evidence.pattern_id if self.evidence else None

    def to_dict(self) -> dict[str, Any]:
        """Plain data for logs and JSON."""
        return {
            "path": self.path,
            "cause": self.cause,
            "status": self.status,
            "pattern_id": self.pattern_id,
            "evidence": self.evidence.to_dict() if self.evidence else None,
            "also_seen": [e.to_dict() for e in self.also_seen],
            "error": self.error,
            "file_size": self.file_size,
            "bytes_scanned": self.bytes_scanned,
            "complete": self.complete,
        }


@dataclass(frozen=True)
class ScanSummary:
    """The verdict over all of a job's logs (:func:`scan_files`)."""

    cause: ScanCause
    evidence: Evidence | None
    evidence_path: str | None
    results: tuple[ScanResult, ...] = field(default_factory=tuple)

    @property
    def pattern_id(self) -> str | None:
        """Id of the pattern that decided :attr:`cause`."""
        return self.evidence.pattern_id if self.evidence else None

    def to_dict(self) -> dict[str, Any]:
        """Plain data for logs and JSON."""
        return {
            "cause": self.cause,
            "pattern_id": self.pattern_id,
            "evidence_path": self.evidence_path,
            "evidence": self.evidence.to_dict() if self.evidence else None,
            "results": [r.to_dict() for r in self.results],
        }


def _clean(raw: bytes) -> str:
    """Bytes of one line -> printable text: safe to log, store and show."""
    text = raw.rstrip(b"\r").decode("utf-8", errors="replace")
    text = "".join(c if c.isprintable() or c == "\t" else "?" for c in text)
    if len(text) > MAX_EVIDENCE_CHARS:
        text = text[: MAX_EVIDENCE_CHARS - 1] + "…"
    return text


class _Library:
    """Patterns indexed by needle, in library order."""

    def __init__(self, patterns: Sequence[OomPattern]) -> None:
        self.patterns = tuple(patterns)
        needles: dict[bytes, list[OomPattern]] = {}
        for p in self.patterns:
            for n in p.needles:
                needles.setdefault(n, []).append(p)
        self.needles = needles
        self.max_needle = max((len(n) for n in needles), default=1)

    def classify(self, line: bytes) -> OomPattern | None:
        """First pattern (library order) that matches ``line``."""
        for p in self.patterns:
            if any(n in line for n in p.needles) and p.regex.search(line):
                return p
        return None


_DEFAULT_LIBRARY = _Library(PATTERNS)


def _context(
    fd: int, line_start: int, line_end: int, size: int
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Up to :data:`CONTEXT_LINES` lines before and after a match (bounded read)."""
    lo = max(0, line_start - CONTEXT_WINDOW)
    before_raw = os.pread(fd, line_start - lo, lo) if line_start > lo else b""
    after_raw = (
        os.pread(fd, min(CONTEXT_WINDOW, size - line_end), line_end) if line_end < size else b""
    )
    before_lines = before_raw.split(b"\n")
    if before_lines and before_lines[-1] == b"":
        before_lines.pop()
    if lo > 0 and before_lines:
        before_lines = before_lines[1:]  # first one is cut by the window
    after_lines = after_raw.split(b"\n")
    if after_lines and after_lines[0] == b"":
        after_lines = after_lines[1:]  # the newline that ended the matched line
    if line_end + len(after_raw) < size or (after_lines and after_lines[-1] == b""):
        after_lines = after_lines[:-1]  # cut by the window, or the file's final newline
    return (
        tuple(_clean(x) for x in before_lines[-CONTEXT_LINES:]),
        tuple(_clean(x) for x in after_lines[:CONTEXT_LINES]),
    )


@dataclass
class _TailScan:
    """One backwards scan of a file's tail, chunk by chunk, newest lines first.

    State that the chunks share: what was found per cause, the lowest offset already
    examined (hits are processed in descending order, so one line is classified once),
    the line and candidate budgets, and whether the whole tail was seen.
    """

    fd: int
    size: int
    tail_start: int
    max_line_bytes: int
    max_candidates: int
    library: _Library
    lines_left: int | None
    found: dict[str, tuple[OomPattern, int, int]] = field(default_factory=dict)
    floor: int = 0
    candidates: int = 0
    scanned: int = 0
    stop: bool = False
    complete: bool = True

    def run(self, chunk_bytes: int) -> None:
        """Scan chunks from the end until the tail is done or a budget says stop."""
        self.floor = self.size + 1
        self.complete = self.tail_start == 0
        b = self.size
        while b > self.tail_start and not self.stop:
            a = max(self.tail_start, b - chunk_bytes)
            if not self._chunk(a, b):
                break
            b = a

    def _chunk(self, a: int, b: int) -> bool:
        """Examine [a, b) (read with a line's margin on both sides); False: file shrank."""
        buf_start = max(self.tail_start, a - self.max_line_bytes)
        buf_end = min(self.size, b + self.max_line_bytes)
        buf = os.pread(self.fd, buf_end - buf_start, buf_start)
        if len(buf) < buf_end - buf_start:  # file shrank under us: scan what we got
            buf_end = buf_start + len(buf)
            if buf_end <= a:
                return False
        ra, rb = a - buf_start, min(b, buf_end) - buf_start
        ra = self._limit_lines(buf, ra, rb)
        self.scanned += rb - ra
        for p in self._hits(buf, ra, rb):
            if buf_start + p >= self.floor:
                continue  # inside a line (or line window) already examined
            if self._examine(buf, buf_start, p, at_tail_start=a == self.tail_start):
                break
        return True

    def _limit_lines(self, buf: bytes, ra: int, rb: int) -> int:
        """Start of the region once ``max_lines_per_file`` is counted in."""
        if self.lines_left is None:
            return ra
        nl = buf.count(b"\n", ra, rb)
        if nl < self.lines_left:
            self.lines_left -= nl
            return ra
        # keep only the last ``lines_left`` lines of the file in this region
        pos = rb
        for _ in range(self.lines_left + 1):
            pos = buf.rfind(b"\n", ra, pos)
            if pos < 0:
                break
        self.stop = True
        self.complete = False
        return max(ra, pos + 1)

    def _hits(self, buf: bytes, ra: int, rb: int) -> list[int]:
        """Offsets in ``buf`` where a needle starts inside [ra, rb), highest first."""
        hits: list[int] = []
        for needle in self.library.needles:
            limit = min(len(buf), rb + len(needle) - 1)
            p = buf.find(needle, ra, limit)
            while p >= 0:
                hits.append(p)
                p = buf.find(needle, p + 1, limit)
        return sorted(hits, reverse=True)

    def _examine(self, buf: bytes, buf_start: int, p: int, *, at_tail_start: bool) -> bool:
        """Classify the line around hit ``p``; True: stop scanning this chunk."""
        mlb = self.max_line_bytes
        ls = buf.rfind(b"\n", max(0, p - mlb), p) + 1
        if ls == 0:
            ls = max(0, p - mlb)
        self.floor = buf_start + ls
        le = buf.find(b"\n", p, p + mlb)
        if le < 0:
            le = min(len(buf), p + mlb)
        self.candidates += 1
        pat = self.library.classify(buf[ls:le])
        if pat is not None and pat.cause not in self.found:
            self.found[pat.cause] = (pat, buf_start + ls, buf_start + le)
            if pat.cause == "gpu-oom":
                self.stop = True
                self.complete = self.complete and at_tail_start
                return True
        if self.candidates >= self.max_candidates:
            self.stop = True
            self.complete = False
            return True
        return False

    def evidences(self) -> list[Evidence]:
        """What was found, strongest cause first; context lines for the first only."""
        ordered = sorted(self.found.values(), key=lambda t: CAUSE_PRIORITY[t[0].cause],
                         reverse=True)
        out: list[Evidence] = []
        for pat, ls, le in ordered:
            line = os.pread(self.fd, le - ls, ls)
            before, after = _context(self.fd, ls, le, self.size) if not out else ((), ())
            out.append(Evidence(
                pattern_id=pat.id, cause=pat.cause, framework=pat.framework,
                confidence=pat.confidence, offset=ls, line=_clean(line), before=before,
                after=after,
            ))
        return out


def _scan_fd(
    fd: int,
    path: str,
    *,
    tail_bytes: int,
    max_lines_per_file: int | None,
    max_line_bytes: int,
    chunk_bytes: int,
    max_candidates: int,
    library: _Library,
) -> ScanResult:
    size = os.fstat(fd).st_size
    scan = _TailScan(fd, size, max(0, size - tail_bytes), max_line_bytes, max_candidates,
                     library, max_lines_per_file)
    scan.run(chunk_bytes)
    if not scan.found:
        return ScanResult(path, "none", file_size=size, bytes_scanned=scan.scanned,
                          complete=scan.complete)
    top, *rest = scan.evidences()
    cause: ScanCause = top.cause
    return ScanResult(path, cause, evidence=top, also_seen=tuple(rest), file_size=size,
                      bytes_scanned=scan.scanned, complete=scan.complete)


def scan_file(
    path: str | os.PathLike[str],
    *,
    tail_bytes: int = DEFAULT_TAIL_BYTES,
    max_lines_per_file: int | None = None,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    max_candidates: int = DEFAULT_MAX_CANDIDATES,
    uid: int | None = None,
    gid: int | None = None,
    patterns: Sequence[OomPattern] | None = None,
) -> ScanResult:
    """Scan the tail of one log file; never raises on I/O or odd content.

    ``uid``/``gid``: the job's user; the file is then opened with the user's rights
    and must belong to them (see :mod:`slurm_colloc.oom.safe_open`). ``tail_bytes``
    defaults to config ``log_scan_tail_mib``. ``max_lines_per_file`` (None: no
    limit) bounds the scan to the last N lines as well.
    """
    spath = os.fspath(path)
    if tail_bytes <= 0 or max_line_bytes <= 0 or chunk_bytes <= 0:
        raise ValueError("tail_bytes, max_line_bytes and chunk_bytes must be positive")
    library = _DEFAULT_LIBRARY if patterns is None else _Library(patterns)
    try:
        fd = open_log(spath, uid=uid, gid=gid)
    except RefusedPath as e:
        return ScanResult(spath, "none", status="refused", error=str(e), complete=False)
    except FileNotFoundError as e:
        return ScanResult(spath, "none", status="missing", error=e.strerror, complete=False)
    except OSError as e:
        status: ScanStatus = "refused" if e.errno in (errno.ELOOP, errno.ENOTDIR) else "unreadable"
        return ScanResult(spath, "none", status=status, error=e.strerror or str(e), complete=False)
    try:
        return _scan_fd(
            fd,
            spath,
            tail_bytes=tail_bytes,
            max_lines_per_file=max_lines_per_file,
            max_line_bytes=max_line_bytes,
            chunk_bytes=chunk_bytes,
            max_candidates=max_candidates,
            library=library,
        )
    except OSError as e:
        return ScanResult(
            spath, "none", status="unreadable", error=e.strerror or str(e), complete=False
        )
    finally:
        os.close(fd)


def scan_files(
    paths: Iterable[str | os.PathLike[str] | None],
    *,
    tail_bytes: int = DEFAULT_TAIL_BYTES,
    max_lines_per_file: int | None = None,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    uid: int | None = None,
    gid: int | None = None,
    patterns: Sequence[OomPattern] | None = None,
) -> ScanSummary:
    """Scan several logs (stdout, stderr; duplicates and ``None`` skipped).

    The verdict is the highest-priority cause over all files; on a tie the file listed
    first wins (pass stderr first: frameworks print their errors there).
    """
    results: list[ScanResult] = []
    seen: set[str] = set()
    for p in paths:
        if p is None:
            continue
        sp = os.fspath(p)
        if not sp or sp in seen:
            continue
        seen.add(sp)
        results.append(
            scan_file(
                sp,
                tail_bytes=tail_bytes,
                max_lines_per_file=max_lines_per_file,
                max_line_bytes=max_line_bytes,
                uid=uid,
                gid=gid,
                patterns=patterns,
            )
        )
    best: ScanResult | None = None
    for r in results:
        if r.evidence is not None and (
            best is None or CAUSE_PRIORITY[r.cause] > CAUSE_PRIORITY[best.cause]
        ):
            best = r
    if best is None:
        return ScanSummary("none", None, None, tuple(results))
    return ScanSummary(best.cause, best.evidence, best.path, tuple(results))
