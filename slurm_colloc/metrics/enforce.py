"""Root enforcement of the per-job GPU memory allocation, from the node collector.

MPS's pinned memory limit binds only clients that connect with it (or under a server
whose default sets it); a job can leave MPS altogether (``unset
CUDA_MPS_PIPE_DIRECTORY``, ``env -i``, ``apptainer --cleanenv``: on a GPU in DEFAULT
compute mode CUDA then runs without MPS). Where the driver can put a hard limit on the
job's cgroup (r615+, see :meth:`slurm_colloc.gpu.backend.GpuBackend.set_job_memory_limit`)
the kernel/driver holds it; everywhere, the collector checks each sample:

* **over limit**: the job's memory on a GPU (the sum over its processes, attributed by
  :mod:`.attribution`) exceeds its allocation (``limit_mib`` of the prolog's meta:
  shards x shard_mib) by more than ``enforce_tolerance_mib``;
* **outside MPS**: a GPU process of a shard job that is not an MPS client
  (:attr:`slurm_colloc.gpu.backend.GpuProcess.mps_client` is False; the NVML backend
  knows it from ``nvmlDeviceGetMPSComputeRunningProcesses``, the sim from the
  process's record). ``None`` (the backend cannot tell) never counts.

After ``enforce_samples`` samples in a row the configured action runs (``kill``:
SIGKILL the job's processes on that GPU; ``flag``: record only; ``off``). A job over
its limit is recorded at once (action ``observed``) so that a co-tenant's OOM in the
same second can already be blamed on it; ``outside MPS`` needs the full streak (the
two NVML lists are not read atomically).

Which meta: the newest attempt the prolog recorded for the job on this node, not the
attempt a process claims (``SLURM_RESTART_COUNT`` is the user's environment).

Signals: only to processes attributed to the offending job in this sample, only if
``/proc/<pid>`` still has the start time the attribution was made for (through a
pidfd, so the pid cannot be recycled between the check and the signal), only if the
process belongs to the job's uid, and never to root's processes.

Verdicts: ``metrics_dir/verdicts/<job>-<attempt>.json``, directory 0700 and files
0600 owned by the collector's user (root), written by ``O_EXCL|O_NOFOLLOW`` temp file
and atomic rename; read back only if regular, ours, and within a size bound. The
epilog calls :func:`culprits_on_gpu` (blame a victim's OOM on a co-tenant found over
its limit: a job only outside MPS is flagged, never blamed) and :func:`verdict_for`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import signal
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu.backend import GpuProcess
from slurm_colloc.metrics import store
from slurm_colloc.metrics.attribution import JobTag, start_ticks

log = logging.getLogger("colloc.metrics.enforce")

VERDICTS_DIR = "verdicts"
VERDICT_VERSION = 1
MAX_VERDICT_BYTES = 8 * 1024
OVER_LIMIT = "over_limit"
OUTSIDE_MPS = "outside_mps"
REWRITE_EVERY_S = 5.0
"""An unchanged verdict's ``last_seen`` is refreshed at most this often."""
META_TTL_S = 30.0
"""Cached meta is re-read after this long (and whenever the job leaves the GPUs)."""

# actions recorded in a verdict
OBSERVED = "observed"
FLAGGED = "flagged"
KILLED = "killed"
KILL_REFUSED = "kill-refused"
"""Kill was due, but no process passed the identity checks (pid reused, owner...)."""


@dataclass(frozen=True)
class Verdict:
    """What the collector found about one attempt of a job (one file per attempt)."""

    job_id: str
    attempt: int
    uid: int
    gpu: int
    kind: str
    """``over_limit`` or ``outside_mps`` (over_limit wins when both hold)."""
    peak_mib: int
    """Highest memory of the job on ``gpu`` seen while in violation."""
    limit_mib: int
    first_seen: float
    last_seen: float
    action: str
    """``observed``, ``flagged``, ``killed`` or ``kill-refused``."""
    outside_mps: bool = False
    """A process of the job was seen outside MPS (whatever ``kind`` is)."""
    pids: tuple[int, ...] = ()
    """Processes signalled (``killed``)."""
    detail: str = ""
    version: int = VERDICT_VERSION

    def to_json(self) -> str:
        """Serialised form (what the file holds)."""
        d = asdict(self)
        d["pids"] = list(self.pids)
        return json.dumps(d, separators=(",", ":"), sort_keys=True)

    @staticmethod
    def from_json(raw: bytes) -> Verdict | None:
        """Parse a verdict file; None when malformed."""
        try:
            d = json.loads(raw)
            if not isinstance(d, dict) or d.get("version") != VERDICT_VERSION:
                return None
            v = Verdict(
                job_id=str(d["job_id"]), attempt=int(d["attempt"]), uid=int(d["uid"]),
                gpu=int(d["gpu"]), kind=str(d["kind"]), peak_mib=int(d["peak_mib"]),
                limit_mib=int(d["limit_mib"]), first_seen=float(d["first_seen"]),
                last_seen=float(d["last_seen"]), action=str(d["action"]),
                outside_mps=bool(d.get("outside_mps", False)),
                pids=tuple(int(p) for p in d.get("pids", ())), detail=str(d.get("detail", "")),
            )
        except (ValueError, KeyError, TypeError):
            return None
        if not v.job_id.isdigit() or v.kind not in (OVER_LIMIT, OUTSIDE_MPS):
            return None
        return v


# ------------------------------------------------------------------ files ---


def verdicts_dir(metrics_dir: str | os.PathLike[str]) -> Path:
    """Where verdict files live."""
    return Path(metrics_dir) / VERDICTS_DIR


def verdict_path(metrics_dir: str | os.PathLike[str], job_id: int | str, attempt: int) -> Path:
    """The verdict file of one attempt (job ids are validated: digits only)."""
    jid = str(job_id)
    if not jid.isdigit() or len(jid) > 12:
        raise ValueError(f"not a job id: {job_id!r}")
    return verdicts_dir(metrics_dir) / f"{jid}-{int(attempt)}.json"


def _ensure_private_dir(path: Path) -> Path:
    """Create ``path`` 0700; refuse a symlink, a non-directory or a foreign owner."""
    store.ensure_dir(path.parent)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(errno.ENOTDIR, f"{path}: not a directory (symlink?)")
    if st.st_uid != os.geteuid():
        raise OSError(errno.EPERM, f"{path}: owned by uid {st.st_uid}, not by us")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def write_verdict(metrics_dir: str | os.PathLike[str], v: Verdict) -> Path:
    """Store a verdict: 0600, ours, via an exclusive temp file and an atomic rename."""
    d = _ensure_private_dir(verdicts_dir(metrics_dir))
    path = verdict_path(metrics_dir, v.job_id, v.attempt)
    tmp = d / f".{path.name}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # left by a crash of an earlier collector with our pid
    fd = os.open(
        tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
    )
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, v.to_json().encode())
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)  # rename replaces a symlink there, never writes through it
    return path


def _read_verdict_file(path: Path) -> Verdict | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return None
        raw = os.read(fd, MAX_VERDICT_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) > MAX_VERDICT_BYTES:
        return None
    return Verdict.from_json(raw)


def _dir_is_ours(d: Path) -> bool:
    try:
        st = os.lstat(d)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


def read_verdicts(metrics_dir: str | os.PathLike[str]) -> list[Verdict]:
    """Every readable verdict on this node (unordered)."""
    d = verdicts_dir(metrics_dir)
    if not _dir_is_ours(d):
        return []
    try:
        names = os.listdir(d)
    except OSError:
        return []
    out = []
    for name in names:
        if name.startswith(".") or not name.endswith(".json"):
            continue
        v = _read_verdict_file(d / name)
        if v is not None and name == f"{v.job_id}-{v.attempt}.json":
            out.append(v)
    return out


def verdict_for(cfg: CollocConfig, job_id: int | str, attempt: int) -> Verdict | None:
    """The collector's verdict on one attempt of a job, or None (nothing found)."""
    try:
        path = verdict_path(cfg.metrics_dir, job_id, attempt)
    except ValueError:
        return None
    if not _dir_is_ours(path.parent):
        return None
    v = _read_verdict_file(path)
    if v is None or v.job_id != str(job_id) or v.attempt != int(attempt):
        return None
    return v


def culprits_on_gpu(
    cfg: CollocConfig, gpu: int, since: float, exclude_job: int | str | None = None,
    *, wait_s: float = 0.0,
) -> list[Verdict]:
    """Co-tenants of ``gpu`` found over their limit at or after ``since``.

    For the epilog of a job that died of GPU OOM: ``since`` = the victim attempt's
    start (its meta), ``exclude_job`` = the victim. Non-empty: the OOM is attributed
    to these jobs (by peak), and the victim deserves a requeue with the same request.
    A job only seen outside MPS while within its allocation took nobody's memory and
    is no culprit: blaming it requeued a victim's genuine OOM with the same request
    until its requeues ran out (issue 23). ``wait_s`` polls that long for a verdict
    still being reached (the collector needs up to :func:`detection_window_s`); it
    returns as soon as one is found.
    """
    deadline = time.monotonic() + max(0.0, wait_s)
    excl = None if exclude_job is None else str(exclude_job)
    while True:
        found = [
            v for v in read_verdicts(cfg.metrics_dir)
            if v.kind == OVER_LIMIT and v.gpu == int(gpu) and v.last_seen >= since
            and v.job_id != excl
        ]
        if found or time.monotonic() >= deadline:
            found.sort(key=lambda v: (-v.peak_mib, v.job_id))
            return found
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def detection_window_s(cfg: CollocConfig) -> float:
    """How long after an offence the collector may take to record it."""
    return (max(1, cfg.enforce_samples) + 1) * cfg.sample_interval_s


def prune_verdicts(
    metrics_dir: str | os.PathLike[str], retention_days: int, now: float | None = None
) -> int:
    """Delete verdict files older than the retention; returns how many."""
    d = verdicts_dir(metrics_dir)
    if not _dir_is_ours(d):
        return 0
    cutoff = (time.time() if now is None else now) - retention_days * 86400
    n = 0
    with contextlib.suppress(OSError):
        for name in os.listdir(d):
            p = d / name
            with contextlib.suppress(OSError):
                st = os.lstat(p)
                if st.st_mtime < cutoff:
                    os.unlink(p)
                    n += 1
    return n


# ------------------------------------------------------------------ signals ---


def kill_verified(
    pid: int, ticks: int, uid: int, proc: str = "/proc", sig: int = signal.SIGKILL
) -> tuple[bool, str]:
    """Signal ``pid`` only if it is still the process attributed (same start time,
    owned by ``uid``, not root). Returns (signalled, why not)."""
    if uid == 0:
        return False, "refused: the job's uid is root"
    try:
        pidfd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        return False, "gone"
    except OSError:
        pidfd = None  # kernel without pidfd (< 5.3): the start-time check still stands
    try:
        now_ticks = start_ticks(pid, proc)
        if now_ticks is None:
            return False, "gone"
        if now_ticks != ticks:
            return False, "refused: start time changed (pid reused)"
        try:
            owner = os.stat(f"{proc}/{pid}").st_uid
        except OSError:
            return False, "gone"
        if owner == 0:
            return False, "refused: process belongs to root"
        if owner != uid:
            return False, f"refused: process belongs to uid {owner}, job to uid {uid}"
        try:
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, sig)
            else:
                os.kill(pid, sig)
        except ProcessLookupError:
            return False, "gone"
        except OSError as e:
            return False, f"signal failed: {e.strerror}"
        return True, "signalled"
    finally:
        if pidfd is not None:
            os.close(pidfd)


# ------------------------------------------------------------------ enforcer ---

Entry = tuple[GpuProcess, int, JobTag]
"""One GPU process of a sample with its start ticks and its job."""


@dataclass
class _JobMetaCache:
    meta: store.JobMeta
    """Only found records are cached: a job with none is asked again each sample."""
    read_at: float


@dataclass
class _State:
    streak: dict[str, int] = field(default_factory=dict)
    seen_step: int = 0


class Enforcer:
    """Per-sample decisions; one instance lives in the collector."""

    def __init__(
        self, cfg: CollocConfig, clock: Callable[[], float] = time.time, proc: str = "/proc",
        kill: Callable[[int, int, int], tuple[bool, str]] | None = None,
    ) -> None:
        """``kill(pid, ticks, uid)`` defaults to :func:`kill_verified` on ``proc``."""
        self.cfg = cfg
        self.clock = clock
        self.proc = proc
        self._kill = kill or (lambda pid, ticks, uid: kill_verified(pid, ticks, uid, proc))
        self._meta: dict[str, _JobMetaCache] = {}
        self._state: dict[tuple[str, int], _State] = {}
        self._written: dict[tuple[str, int], tuple[Verdict, float]] = {}
        self._step = 0
        self._jobs_seen: set[str] = set()

    @property
    def active(self) -> bool:
        """False when both checks are off (the collector then skips us)."""
        return self.cfg.enforce_over_limit != "off" or self.cfg.enforce_outside_mps != "off"

    def begin_step(self) -> None:
        """Call before the GPUs of one collector step are observed."""
        self._step += 1
        self._jobs_seen = set()

    def end_step(self) -> None:
        """Streaks of jobs not in violation this step restart; gone jobs are forgotten."""
        for k in [k for k, s in self._state.items() if s.seen_step != self._step]:
            del self._state[k]
        for job in [j for j in self._meta if j not in self._jobs_seen]:
            del self._meta[job]  # gone from the GPUs: a next attempt brings a new meta
        if len(self._written) > 4096:
            self._written.clear()

    def _meta_of(self, job: str, fresh: bool = False) -> store.JobMeta | None:
        """The job's newest meta on this node; a missing one is asked again next time.

        A job seen before its meta exists (the prolog has not written it yet) must be
        held to its limit from the first sample after it appears, not after a cached
        "no record" expires (issue 23: no negative caching of what root has not seen).
        """
        now = self.clock()
        hit = self._meta.get(job)
        if hit is not None and not fresh and 0 <= now - hit.read_at < META_TTL_S:
            return hit.meta
        found = None
        for a in reversed(store.attempts_on_node(self.cfg.metrics_dir, job)):
            found = store.read_meta(self.cfg.metrics_dir, job, a)
            if found is not None:
                break
        if found is None:
            self._meta.pop(job, None)
            return None
        self._meta[job] = _JobMetaCache(found, now)
        return found

    def observe(self, gpu: int, entries: Iterable[Entry]) -> list[Verdict]:
        """Check one GPU's sample; returns the verdicts written for it."""
        by_job: dict[str, list[Entry]] = {}
        for e in entries:
            by_job.setdefault(e[2].job_id, []).append(e)
        self._jobs_seen.update(by_job)
        out = []
        for job, procs in by_job.items():
            v = self._check(job, gpu, procs)
            if v is not None:
                out.append(v)
        return out

    def _check(self, job: str, gpu: int, procs: list[Entry]) -> Verdict | None:
        cfg = self.cfg
        meta = self._meta_of(job)
        if meta is None or meta.limit_mib is None:
            return None  # not a shard job (whole GPU), or no prolog record: no limit
        # a process of another uid attributed to the job is an attribution error,
        # never the job's memory (and never a reason to kill the job's processes)
        procs = [e for e in procs if e[2].uid in (meta.uid, 0)]
        used = sum(p.used_mib for p, _, _ in procs)
        over = cfg.enforce_over_limit != "off" and (
            used > meta.limit_mib + cfg.enforce_tolerance_mib
        )
        outside = cfg.enforce_outside_mps != "off" and any(
            p.mps_client is False for p, _, _ in procs
        )
        key = (job, gpu)
        st = self._state.setdefault(key, _State())
        st.seen_step = self._step
        for kind, now_bad in ((OVER_LIMIT, over), (OUTSIDE_MPS, outside)):
            st.streak[kind] = st.streak.get(kind, 0) + 1 if now_bad else 0
        if not over and not outside:
            return None
        need = max(1, cfg.enforce_samples)
        due_over = over and st.streak[OVER_LIMIT] >= need
        due_out = outside and st.streak[OUTSIDE_MPS] >= need
        if not due_over and not due_out and not over:
            return None  # outside MPS, streak not reached yet: not recorded
        kind = OVER_LIMIT if over else OUTSIDE_MPS
        action, detail = OBSERVED, ""
        pids: tuple[int, ...] = ()
        if due_over or due_out:
            kill = (due_over and cfg.enforce_over_limit == "kill") or (
                due_out and cfg.enforce_outside_mps == "kill"
            )
            action = FLAGGED
            if kill:
                action, pids, detail = self._kill_job(job, procs)
        return self._record(job, gpu, meta, kind, used, outside, action, pids, detail)

    def _kill_job(self, job: str, procs: list[Entry]) -> tuple[str, tuple[int, ...], str]:
        meta = self._meta_of(job, fresh=True)  # the uid to check comes from root's record
        if meta is None:
            return KILL_REFUSED, (), "no prolog record"
        killed, why = [], []
        for p, ticks, tag in procs:
            if tag.job_id != job:
                continue
            ok, reason = self._kill(p.pid, ticks, meta.uid)
            if ok:
                killed.append(p.pid)
            else:
                why.append(f"{p.pid}: {reason}")
        detail = "; ".join(why)[:500]
        if killed:
            log.warning("job %s: SIGKILL sent to %s (GPU memory allocation enforced)%s", job,
                        ",".join(map(str, killed)), f"; not signalled {detail}" if why else "")
            return KILLED, tuple(killed), detail
        log.warning("job %s: over its GPU allocation but nothing signalled: %s", job, detail)
        return KILL_REFUSED, (), detail

    def _record(
        self, job: str, gpu: int, meta: store.JobMeta, kind: str, used: int, outside: bool,
        action: str, pids: tuple[int, ...], detail: str,
    ) -> Verdict | None:
        now = self.clock()
        k = (job, meta.attempt)
        prev_w = self._written.get(k)
        prev = prev_w[0] if prev_w else verdict_for(self.cfg, job, meta.attempt)
        rank = {OBSERVED: 0, FLAGGED: 1, KILL_REFUSED: 2, KILLED: 3}
        if prev is not None:
            if prev.kind == OVER_LIMIT:
                kind = OVER_LIMIT  # once over the limit, the record says so
            if rank.get(prev.action, 0) > rank.get(action, 0):
                action, pids, detail = prev.action, prev.pids, prev.detail
            v = replace(
                prev, kind=kind, peak_mib=max(prev.peak_mib, used), last_seen=now,
                action=action, outside_mps=prev.outside_mps or outside,
                pids=tuple(sorted(set(prev.pids) | set(pids))), detail=detail or prev.detail,
            )
            unchanged = replace(v, last_seen=prev.last_seen) == prev
            if unchanged and prev_w is not None and now - prev_w[1] < REWRITE_EVERY_S:
                return None
        else:
            v = Verdict(
                job_id=job, attempt=meta.attempt, uid=meta.uid, gpu=gpu, kind=kind,
                peak_mib=used, limit_mib=meta.limit_mib or 0, first_seen=now, last_seen=now,
                action=action, outside_mps=outside, pids=pids, detail=detail,
            )
            log.warning(
                "job %s attempt %d: %s on GPU %d: %d MiB, allocation %s MiB%s (%s)", job,
                meta.attempt, kind.replace("_", " "), gpu, used, meta.limit_mib,
                ", a process outside MPS" if outside else "", action,
            )
        write_verdict(self.cfg.metrics_dir, v)
        self._written[k] = (v, now)
        return v
