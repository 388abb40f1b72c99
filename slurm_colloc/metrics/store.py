"""The node-local per-job metrics store: one directory per job under ``metrics_dir``.

Layout (root-owned)::

    metrics_dir/collector/             root 0700: the collector's lock, pid, heartbeat
    metrics_dir/collector-events.tsv   when the collector ran (see :mod:`.liveness`)
    metrics_dir/jobs/<job>/meta-<n>.json    written by the prolog for attempt n (0600)
    metrics_dir/jobs/<job>/series-<n>.tsv   appended by the collector, one row per stride
                                            (0644: GPU metrics are what jobstats shows
                                            everyone)

Meta files are root's alone (0600, security issue 11): they carry the job's uid, SLUID
(the collector's key to 26.05's SLUID-named job cgroups: :class:`SluidIndex`), model
fingerprint, batch size, optimizer and estimate, which ``PrivateData=jobs`` hides from
other users. Only root reads them (collector, epilog summary). ``colloc-report`` run by
the job's owner does not need them: the limit and start they would add come from the
job's accounting record, and an unreadable meta is simply absent from the report. They
are not given to the job's user either: a user-owned file could be rewritten by its
owner and is then read by root, and the job's group is often everyone's group.

A series row aggregates ``n`` raw samples: mean and max of the job's memory (so the
peak survives any compaction), the GPU's memory, utilisation, SM activity/occupancy,
DRAM activity and power, the energy attributed to the job in those samples, and the
other jobs seen on the GPU. Rows are written with one ``write`` on an ``O_APPEND``
descriptor, so a reader sees whole rows (a torn last line is skipped).

Everything here may run as root on paths under ``metrics_dir``: files are opened
with ``O_NOFOLLOW`` and reads are bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from slurm_colloc import procfs

HEADER = "# colloc-metrics v1"
COLUMNS = (
    "t", "gpu", "mem_mib", "mem_max_mib", "gpu_mem_mib", "util_pct", "sm_pct", "occ_pct",
    "dram_pct", "power_w", "energy_j", "tenants", "n",
)
MAX_META_BYTES = 16 * 1024
META_MODE = 0o600
"""Meta files are root's alone (see the module docstring)."""
MAX_SERIES_BYTES = 16 << 20
"""Read cap of one series file (10,000 rows are about 1 MB)."""
_JOB = re.compile(r"^\d{1,12}$")


@dataclass(frozen=True)
class JobMeta:
    """What the prolog knew about an attempt (the collector and epilog read it)."""

    job_id: int
    attempt: int
    uid: int
    gpus: tuple[int, ...]
    limit_mib: int | None = None
    shards: int = 0
    start: float = 0.0
    estimate_mib: int | None = None
    estimator: str | None = None
    fingerprint: str | None = None
    batch_size: int | None = None
    seq_len: int | None = None
    optimizer: str | None = None
    precision: str | None = None
    sluid: str | None = None
    """slurmd's ``SLURM_JOB_SLUID`` (25.11+): on 26.05 the name of the job's cgroup, by
    which the collector finds the job of a process (:class:`SluidIndex`)."""


@dataclass
class Row:
    """One series row (see module docstring); None = not measured."""

    t: float
    gpu: int
    mem_mib: float
    mem_max_mib: int
    gpu_mem_mib: int
    util_pct: float | None = None
    sm_pct: float | None = None
    occ_pct: float | None = None
    dram_pct: float | None = None
    power_w: float | None = None
    energy_j: float = 0.0
    tenants: tuple[str, ...] = ()
    n: int = 1

    def line(self) -> str:
        """The TSV line for this row."""

        def f(v: float | None, nd: int = 1) -> str:
            return "" if v is None else f"{v:.{nd}f}"

        return "\t".join(
            (
                f"{self.t:.1f}", str(self.gpu), f(self.mem_mib), str(self.mem_max_mib),
                str(self.gpu_mem_mib), f(self.util_pct), f(self.sm_pct), f(self.occ_pct),
                f(self.dram_pct), f(self.power_w), f(self.energy_j, 2),
                ",".join(self.tenants) or "-", str(self.n),
            )
        ) + "\n"


def _opt(text: str) -> float | None:
    return float(text) if text else None


def parse_row(line: str) -> Row | None:
    """A row from a TSV line; None for comments and malformed lines."""
    if not line or line[0] == "#":
        return None
    parts = line.rstrip("\n").split("\t")
    if len(parts) != len(COLUMNS):
        return None
    try:
        tenants = () if parts[11] in ("-", "") else tuple(parts[11].split(","))
        return Row(
            t=float(parts[0]), gpu=int(parts[1]), mem_mib=float(parts[2]),
            mem_max_mib=int(parts[3]), gpu_mem_mib=int(parts[4]), util_pct=_opt(parts[5]),
            sm_pct=_opt(parts[6]), occ_pct=_opt(parts[7]), dram_pct=_opt(parts[8]),
            power_w=_opt(parts[9]), energy_j=float(parts[10] or 0), tenants=tenants,
            n=max(1, int(parts[12])),
        )
    except ValueError:
        return None


def merge_rows(a: Row, b: Row) -> Row:
    """Two consecutive rows as one (weighted means; peaks and energy kept exactly)."""
    n = a.n + b.n

    def wmean(x: float | None, y: float | None) -> float | None:
        if x is None or y is None:
            return x if y is None else y
        return (x * a.n + y * b.n) / n

    return Row(
        t=a.t, gpu=a.gpu, mem_mib=wmean(a.mem_mib, b.mem_mib) or 0.0,
        mem_max_mib=max(a.mem_max_mib, b.mem_max_mib),
        gpu_mem_mib=max(a.gpu_mem_mib, b.gpu_mem_mib), util_pct=wmean(a.util_pct, b.util_pct),
        sm_pct=wmean(a.sm_pct, b.sm_pct), occ_pct=wmean(a.occ_pct, b.occ_pct),
        dram_pct=wmean(a.dram_pct, b.dram_pct), power_w=wmean(a.power_w, b.power_w),
        energy_j=a.energy_j + b.energy_j,
        tenants=tuple(sorted(set(a.tenants) | set(b.tenants), key=_job_key)), n=n,
    )


def _job_key(j: str) -> tuple[int, str]:
    return (int(j), j) if j.isdigit() else (1 << 62, j)


# ------------------------------------------------------------------ paths ---


def job_dir(metrics_dir: str | os.PathLike[str], job_id: int | str) -> Path:
    """The job's directory (job ids are validated: digits only)."""
    if not _JOB.match(str(job_id)):
        raise ValueError(f"not a job id: {job_id!r}")
    return Path(metrics_dir) / "jobs" / str(job_id)


def series_path(metrics_dir: str | os.PathLike[str], job_id: int | str, attempt: int) -> Path:
    """Series file of one attempt."""
    return job_dir(metrics_dir, job_id) / f"series-{int(attempt)}.tsv"


def meta_path(metrics_dir: str | os.PathLike[str], job_id: int | str, attempt: int) -> Path:
    """Prolog's meta file of one attempt."""
    return job_dir(metrics_dir, job_id) / f"meta-{int(attempt)}.json"


def ensure_dir(path: Path, mode: int = 0o755) -> Path:
    """Create ``path`` (and parents) and refuse a symlink or a non-directory there."""
    path.mkdir(parents=True, exist_ok=True, mode=mode)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(f"{path}: not a directory (symlink?)")
    return path


def read_bounded(path: Path, limit: int) -> bytes:
    """Read at most ``limit`` bytes, never through a symlink; the tail if larger."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            os.lseek(fd, size - limit, os.SEEK_SET)
        chunks = []
        left = limit
        while left > 0:
            b = os.read(fd, min(left, 1 << 20))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    """Write via a temp file + rename (readers see old or new, never half).

    The file gets exactly ``mode``, whatever the umask or a stale temp file's mode.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


# ------------------------------------------------------------------ meta ---


def write_meta(metrics_dir: str | os.PathLike[str], meta: JobMeta) -> Path:
    """Store the prolog's meta for an attempt."""
    d = ensure_dir(job_dir(metrics_dir, meta.job_id))
    p = meta_path(metrics_dir, meta.job_id, meta.attempt)
    data = asdict(meta)
    data["gpus"] = list(meta.gpus)
    write_atomic(p, json.dumps(data, separators=(",", ":")), mode=META_MODE)
    os.utime(d)
    return p


def read_meta(
    metrics_dir: str | os.PathLike[str], job_id: int | str, attempt: int
) -> JobMeta | None:
    """The prolog's meta for an attempt, or None (missing or malformed)."""
    try:
        raw = read_bounded(meta_path(metrics_dir, job_id, attempt), MAX_META_BYTES)
        d = json.loads(raw)
        fields = {k: d[k] for k in JobMeta.__dataclass_fields__ if k in d}
        fields["gpus"] = tuple(int(g) for g in fields.get("gpus", ()))
        return JobMeta(**fields)
    except (OSError, ValueError, TypeError):
        return None


class SluidIndex:
    """SLUID -> job id, from the prolog's metas on this node.

    Slurm 26.05 names a job's cgroup by its SLUID (``CgroupJobIdPaths=no``), so a
    process's ``/proc/<pid>/cgroup`` no longer carries the job id. The prolog records
    the SLUID slurmd gave it in the attempt's meta, which is root's alone (0600): a
    user cannot add or change a mapping. :meth:`refresh` rereads only the job
    directories whose mtime changed since it last looked (a meta write renames into
    the directory); dropped directories (pruned jobs) drop their SLUIDs. A SLUID that
    two jobs claim maps to neither.
    """

    def __init__(self, metrics_dir: str | os.PathLike[str]) -> None:
        """Empty until the first :meth:`refresh`."""
        self.metrics_dir = metrics_dir
        self._dirs: dict[str, tuple[int, frozenset[str]]] = {}
        self._jobs: dict[str, str] = {}

    def job_of(self, sluid: str) -> str | None:
        """The job id the prolog recorded with ``sluid``, as of the last refresh."""
        return self._jobs.get(sluid)

    def refresh(self) -> None:
        """Reread the metas of job directories that changed (bounded reads, no links)."""
        root = Path(self.metrics_dir) / "jobs"
        try:
            names = [n for n in os.listdir(root) if _JOB.match(n)]
        except OSError:
            names = []
        dirs: dict[str, tuple[int, frozenset[str]]] = {}
        for name in names:
            try:
                st = os.lstat(root / name)
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode):
                continue  # never through a link
            mtime = st.st_mtime_ns
            old = self._dirs.get(name)
            dirs[name] = old if old is not None and old[0] == mtime else (
                mtime, self._sluids_of(name))
        self._dirs = dirs
        jobs: dict[str, str] = {}
        claimed_twice: set[str] = set()
        for name, (_, sluids) in dirs.items():
            for s in sluids:
                if jobs.setdefault(s, name) != name:
                    claimed_twice.add(s)
        for s in claimed_twice:
            del jobs[s]
        self._jobs = jobs

    def _sluids_of(self, job: str) -> frozenset[str]:
        """The valid SLUIDs in this job's metas (each attempt's, of this job only)."""
        out = set()
        for a in attempts_on_node(self.metrics_dir, job):
            meta = read_meta(self.metrics_dir, job, a)
            sluid = procfs.sluid(meta.sluid) if meta is not None else None
            if sluid is not None and meta is not None and str(meta.job_id) == job:
                out.add(sluid)
        return frozenset(out)


# ------------------------------------------------------------------ series ---


@dataclass
class Series:
    """An attempt's rows, oldest first."""

    job_id: str
    attempt: int
    rows: list[Row] = field(default_factory=list)


def read_series(metrics_dir: str | os.PathLike[str], job_id: int | str, attempt: int) -> Series:
    """Rows of one attempt (empty when the node kept none)."""
    s = Series(str(job_id), int(attempt))
    try:
        raw = read_bounded(series_path(metrics_dir, job_id, attempt), MAX_SERIES_BYTES)
    except (OSError, ValueError):
        return s
    text = raw.decode("utf-8", "replace")
    if not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]  # a row being written right now
    for line in text.splitlines():
        r = parse_row(line)
        if r is not None:
            s.rows.append(r)
    return s


def attempts_on_node(metrics_dir: str | os.PathLike[str], job_id: int | str) -> list[int]:
    """Attempt numbers with a series or meta file here."""
    try:
        names = os.listdir(job_dir(metrics_dir, job_id))
    except (OSError, ValueError):
        return []
    out = set()
    for n in names:
        m = re.match(r"^(?:series|meta)-(\d{1,4})\.(?:tsv|json)$", n)
        if m:
            out.add(int(m.group(1)))
    return sorted(out)


class SeriesWriter:
    """Appends rows to one attempt's file; compacts it past ``max_rows``."""

    def __init__(self, path: Path, max_rows: int) -> None:
        """Open (create) the file for appending; count rows already there."""
        self.path = path
        self.max_rows = max(16, max_rows)
        self.stride = 1
        ensure_dir(path.parent)
        self.rows = 0
        if path.exists():
            existing = read_bounded(path, MAX_SERIES_BYTES).decode("utf-8", "replace")
            body = [r for r in map(parse_row, existing.splitlines()) if r is not None]
            self.rows = len(body)
            if body:
                self.stride = max(1, body[-1].n)
        self._fd = self._open()
        if self.rows == 0 and os.fstat(self._fd).st_size == 0:
            os.write(self._fd, (HEADER + "\n" + "#" + "\t".join(COLUMNS) + "\n").encode())

    def _open(self) -> int:
        return os.open(
            self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
        )

    def append(self, row: Row) -> None:
        """Write one row; compact when the cap is reached."""
        os.write(self._fd, row.line().encode())
        self.rows += 1
        if self.rows >= self.max_rows:
            self.compact()

    def compact(self) -> None:
        """Merge rows pairwise (peaks kept) and double the stride."""
        existing = read_bounded(self.path, MAX_SERIES_BYTES).decode("utf-8", "replace")
        rows = [r for r in map(parse_row, existing.splitlines()) if r is not None]
        merged = [merge_rows(rows[i], rows[i + 1]) if i + 1 < len(rows) else rows[i]
                  for i in range(0, len(rows), 2)]
        text = HEADER + "\n#" + "\t".join(COLUMNS) + "\n" + "".join(r.line() for r in merged)
        os.close(self._fd)
        write_atomic(self.path, text)
        self._fd = self._open()
        self.rows = len(merged)
        self.stride *= 2

    def close(self) -> None:
        """Close the file (idempotent)."""
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._fd = -1


def prune(metrics_dir: str | os.PathLike[str], retention_days: int, now: float | None = None,
          keep: Iterable[str] = ()) -> list[str]:
    """Delete job directories not touched for ``retention_days``; returns their ids."""
    now = time.time() if now is None else now
    root = Path(metrics_dir) / "jobs"
    cutoff = now - retention_days * 86400
    keep = set(keep)
    removed: list[str] = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        if not _JOB.match(name) or name in keep:
            continue
        d = root / name
        try:
            st = os.lstat(d)
            newest = max([st.st_mtime] + [os.lstat(d / f).st_mtime for f in os.listdir(d)])
        except OSError:
            continue
        if newest < cutoff:
            for f in _files(d):
                with contextlib.suppress(OSError):
                    os.unlink(d / f)
            with contextlib.suppress(OSError):
                os.rmdir(d)
            removed.append(name)
    return removed


def _files(d: Path) -> Iterator[str]:
    with contextlib.suppress(OSError):
        yield from os.listdir(d)
