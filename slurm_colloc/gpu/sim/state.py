"""The node-local state directory that *is* the simulated GPUs.

Everything about the simulated GPUs lives in one directory (``sim_state_dir``) so
that processes of any user (simjobs run as the job's user; the sidecar and prolog as
root) share one view without a daemon:

``spec.json``
    The GPUs: count, memory, name, idle/max power, time scale, and the memory no job
    can have (driver reserve, MPS server, CUDA context). Written once by
    :func:`init_state` (the devcluster runs it as root).
``gpus/gpu<i>.ledger``
    Per-GPU energy ledger *and* the lock for that GPU (``flock``). Mode 0666 because
    every user's simjob must advance it; sim only, never on a real node.
``procs/`` (mode 1777, like /tmp)
    One JSON record per process holding memory on a GPU,
    ``gpu<i>.<pid>.json``. Written by atomic rename so readers never see half a
    record; the sticky bit stops users from deleting each other's records.

A record whose process is gone (pid not alive, or the pid reused by another
process, detected through the start time in ``/proc/<pid>/stat``) is ignored by
every reader and deleted when the reader is allowed to.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from slurm_colloc.gpu.backend import GpuBackendError
from slurm_colloc.gpu.sim.activity import combined_pct, util_from_sm_activity
from slurm_colloc.gpu.sim.power import A100_IDLE_W, A100_SXM_MAX_W, power_w

SPEC_FILE = "spec.json"
GPUS_DIR = "gpus"
PROCS_DIR = "procs"
SPEC_VERSION = 2
"""Version 2 added ``reserved_mib``, ``context_mib`` and ``server_mib``; a version 1
spec (an old state dir) loads with the defaults below, so that a devcluster that was
initialised before them stops being kinder than a real GPU without a re-init."""
DEFAULT_RESERVED_MIB = 512
"""Memory the driver and firmware keep on each GPU (NVML's ``reserved``): an estimate of
the same order as an A100's, and the figure ``colloc`` budgets when told nothing."""
DEFAULT_CONTEXT_MIB = 512
"""Device memory of one CUDA context: ``CollocConfig.cuda_context_mib``'s default."""
DEFAULT_SERVER_MIB = 64
"""Device memory of one MPS server on a GPU: ``CollocConfig.mps_server_mib``'s default."""
TIME_SCALE_ENV = "COLLOC_SIM_TIME_SCALE"
"""Overrides the spec's time scale (sim seconds per wall second) for one process."""
MAX_RECORD_BYTES = 64 * 1024
LEDGER_BYTES = 128


@dataclass(frozen=True)
class SimSpec:
    """What the simulated GPUs are; the same for every GPU of the node."""

    gpu_count: int
    memory_mib: int
    name: str
    idle_power_w: float
    max_power_w: float
    time_scale: float
    node_id: str
    """Random id chosen at init; makes GPU UUIDs unique per state dir."""
    reserved_mib: int = DEFAULT_RESERVED_MIB
    """Kept by the driver: no process can allocate it, NVML counts it as used."""
    context_mib: int = DEFAULT_CONTEXT_MIB
    """What a process's CUDA context holds on the GPU, outside any MPS pinned limit."""
    server_mib: int = DEFAULT_SERVER_MIB
    """What each MPS server with clients on the GPU holds, outside every client's limit."""

    @property
    def allocatable_mib(self) -> int:
        """What ``cudaMemGetInfo`` calls the total: the memory less the driver's reserve."""
        return self.memory_mib - self.reserved_mib

    def pci_bus_id(self, index: int) -> str:
        """A stable fake PCI bus id, in NVML's format, for GPU ``index``."""
        return f"00000000:{0x10 + index:02x}:00.0"

    def uuid(self, index: int) -> str:
        """A stable NVML-style UUID (``GPU-...``) for GPU ``index``."""
        return "GPU-" + str(uuid.uuid5(uuid.UUID(self.node_id), f"gpu{index}"))


@dataclass(frozen=True)
class ProcRecord:
    """One process's footprint on one simulated GPU."""

    pid: int
    gpu: int
    uid: int
    used_mib: int
    sm_pct: float
    """SM activity the job would reach alone on the GPU (its demand)."""
    start_ticks: int
    """Process start time (``/proc/<pid>/stat`` field 22) to detect pid reuse."""
    job_id: str = ""
    started: float = 0.0
    mps_server: int = 0
    """PID of the MPS server the process is a client of; 0: it reached the GPU
    without MPS (no reachable daemon, e.g. ``CUDA_MPS_PIPE_DIRECTORY`` unset). The
    sim backend reports this as :attr:`GpuProcess.mps_client`, as NVML's MPS process
    list does on a real node."""


def _default_name(memory_mib: int) -> str:
    return f"NVIDIA A100-SXM4-{round(memory_mib / 1024)}GB (simulated)"


def init_state(
    state_dir: str | os.PathLike[str],
    gpu_count: int = 4,
    memory_mib: int = 40960,
    name: str | None = None,
    idle_power_w: float = A100_IDLE_W,
    max_power_w: float = A100_SXM_MAX_W,
    time_scale: float = 1.0,
    *,
    reserved_mib: int = DEFAULT_RESERVED_MIB,
    context_mib: int = DEFAULT_CONTEXT_MIB,
    server_mib: int = DEFAULT_SERVER_MIB,
) -> SimSpec:
    """Create or refresh the state directory of ``gpu_count`` simulated GPUs.

    Idempotent: an existing directory keeps its energy ledgers (energy counters are
    monotonic, like NVML's) and the records of live processes. Directory modes are
    set explicitly (not left to the umask) because root runs this and job processes
    of every user must be able to register on the GPUs. The overheads default to
    non-zero values on purpose: a simulation where every MiB is the jobs' would let
    a budget that over-commits real GPUs pass its tests.
    """
    if gpu_count < 1:
        raise ValueError(f"gpu_count must be at least 1, got {gpu_count}")
    if memory_mib < 1:
        raise ValueError(f"memory_mib must be positive, got {memory_mib}")
    if not 0 <= idle_power_w <= max_power_w:
        raise ValueError(f"need 0 <= idle_power_w ({idle_power_w}) <= max_power_w ({max_power_w})")
    if time_scale <= 0:
        raise ValueError(f"time_scale must be positive, got {time_scale}")
    for what, value in (
        ("reserved_mib", reserved_mib),
        ("context_mib", context_mib),
        ("server_mib", server_mib),
    ):
        if value < 0:
            raise ValueError(f"{what} must not be negative, got {value}")
    if reserved_mib + server_mib + context_mib >= memory_mib:
        raise ValueError(
            f"reserved_mib + server_mib + context_mib ({reserved_mib} + {server_mib} + "
            f"{context_mib}) leave nothing of memory_mib ({memory_mib}) for a job"
        )
    root = Path(state_dir)
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o755)  # noqa: S103 - readable by every job
    old_node_id = None
    with contextlib.suppress(GpuBackendError):
        old_node_id = load_spec(root).node_id
    spec = SimSpec(
        gpu_count=gpu_count,
        memory_mib=memory_mib,
        name=name or _default_name(memory_mib),
        idle_power_w=float(idle_power_w),
        max_power_w=float(max_power_w),
        time_scale=float(time_scale),
        node_id=old_node_id or str(uuid.uuid4()),
        reserved_mib=int(reserved_mib),
        context_mib=int(context_mib),
        server_mib=int(server_mib),
    )
    (root / GPUS_DIR).mkdir(exist_ok=True)
    os.chmod(root / GPUS_DIR, 0o755)  # noqa: S103 - readable by every job
    (root / PROCS_DIR).mkdir(exist_ok=True)
    os.chmod(root / PROCS_DIR, 0o1777)  # noqa: S103 - sticky, like /tmp
    for i in range(gpu_count):
        ledger = _ledger_path(root, i)
        if not ledger.exists():
            _atomic_write(
                ledger, json.dumps({"t": time.time(), "energy_j": 0.0}).ljust(LEDGER_BYTES)
            )
        os.chmod(ledger, 0o666)  # noqa: S103 - every job advances it (sim only)
    _atomic_write(root / SPEC_FILE, json.dumps({"version": SPEC_VERSION, **asdict(spec)}, indent=1))
    os.chmod(root / SPEC_FILE, 0o644)
    return spec


def load_spec(state_dir: str | os.PathLike[str]) -> SimSpec:
    """Read the spec; a clear error names the directory when it is not initialised."""
    path = Path(state_dir) / SPEC_FILE
    try:
        data = json.loads(_bounded_read(path))
    except FileNotFoundError:
        raise GpuBackendError(
            f"{state_dir}: no simulated GPUs here ({SPEC_FILE} missing); "
            "initialise it with slurm_colloc.gpu.sim.init_state() (the devcluster does)"
        ) from None
    except (OSError, ValueError) as e:
        raise GpuBackendError(f"{path}: unreadable simulated GPU spec: {e}") from e
    if data.get("version") not in (1, SPEC_VERSION):
        raise GpuBackendError(
            f"{path}: spec version {data.get('version')!r}, expected 1 or {SPEC_VERSION}"
        )
    try:
        return SimSpec(
            gpu_count=int(data["gpu_count"]),
            memory_mib=int(data["memory_mib"]),
            name=str(data["name"]),
            idle_power_w=float(data["idle_power_w"]),
            max_power_w=float(data["max_power_w"]),
            time_scale=float(data["time_scale"]),
            node_id=str(data["node_id"]),
            reserved_mib=int(data.get("reserved_mib", DEFAULT_RESERVED_MIB)),
            context_mib=int(data.get("context_mib", DEFAULT_CONTEXT_MIB)),
            server_mib=int(data.get("server_mib", DEFAULT_SERVER_MIB)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise GpuBackendError(f"{path}: malformed simulated GPU spec: {e}") from e


def effective_time_scale(spec: SimSpec) -> float:
    """Sim seconds per wall second: ``$COLLOC_SIM_TIME_SCALE`` if set, else the spec's."""
    raw = os.environ.get(TIME_SCALE_ENV, "").strip()
    if not raw:
        return spec.time_scale
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{TIME_SCALE_ENV}={raw!r} is not a number") from None
    if value <= 0:
        raise ValueError(f"{TIME_SCALE_ENV}={raw!r} must be positive")
    return value


# --- process liveness ---------------------------------------------------------------


def process_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None if it does not exist."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after it.
    rest = raw[raw.rfind(")") + 2 :].split()
    try:
        return int(rest[19])  # field 22 overall; rest starts at field 3
    except (IndexError, ValueError):
        return None


def record_alive(rec: ProcRecord) -> bool:
    """True if the record's process still exists and is the same process."""
    ticks = process_start_ticks(rec.pid)
    return ticks is not None and ticks == rec.start_ticks


# --- records ----------------------------------------------------------------------


def _record_path(root: Path, gpu: int, pid: int) -> Path:
    return root / PROCS_DIR / f"gpu{gpu}.{pid}.json"


def _ledger_path(root: Path, gpu: int) -> Path:
    return root / GPUS_DIR / f"gpu{gpu}.ledger"


def _bounded_read(path: Path) -> str:
    with open(path, "rb") as f:
        data = f.read(MAX_RECORD_BYTES + 1)
    if len(data) > MAX_RECORD_BYTES:
        raise ValueError(f"{path}: larger than {MAX_RECORD_BYTES} bytes")
    return data.decode("utf-8")


def _atomic_write(path: Path, text: str) -> None:
    """Write via a temp file in the same directory and rename: readers see old or new."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_record(state_dir: str | os.PathLike[str], rec: ProcRecord) -> None:
    """Create or replace a process record atomically."""
    _atomic_write(_record_path(Path(state_dir), rec.gpu, rec.pid), json.dumps(asdict(rec)))


def remove_record(state_dir: str | os.PathLike[str], gpu: int, pid: int) -> None:
    """Delete a record; already gone is fine (cleanup must be idempotent)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_record_path(Path(state_dir), gpu, pid))


def _parse_record(data: dict[str, Any]) -> ProcRecord:
    return ProcRecord(
        pid=int(data["pid"]),
        gpu=int(data["gpu"]),
        uid=int(data["uid"]),
        used_mib=int(data["used_mib"]),
        sm_pct=float(data["sm_pct"]),
        start_ticks=int(data["start_ticks"]),
        job_id=str(data.get("job_id", "")),
        started=float(data.get("started", 0.0)),
        mps_server=int(data.get("mps_server", 0)),
    )


def read_records(
    state_dir: str | os.PathLike[str], gpu: int | None = None, *, clean: bool = True
) -> list[ProcRecord]:
    """Live process records (of one GPU, or all), sorted by GPU and pid.

    Records of dead processes are skipped and, with ``clean``, deleted where our
    permissions allow (a user cannot delete another user's record in the sticky
    directory; root and the owner can). Unreadable or malformed records are skipped
    too: one broken writer must not blind the sidecar to every other job.
    """
    procs = Path(state_dir) / PROCS_DIR
    prefix = "gpu" if gpu is None else f"gpu{gpu}."
    out: list[ProcRecord] = []
    try:
        names = os.listdir(procs)
    except FileNotFoundError:
        raise GpuBackendError(
            f"{procs}: missing; is {state_dir} an initialised sim state dir?"
        ) from None
    for name in names:
        if not name.startswith(prefix) or not name.endswith(".json"):
            continue
        path = procs / name
        try:
            rec = _parse_record(json.loads(_bounded_read(path)))
        except FileNotFoundError:
            continue  # removed between listdir and open
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not record_alive(rec):
            if clean:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            continue
        out.append(rec)
    out.sort(key=lambda r: (r.gpu, r.pid))
    return out


# --- per-GPU lock and energy ledger -------------------------------------------------


@contextlib.contextmanager
def gpu_lock(state_dir: str | os.PathLike[str], gpu: int, *, shared: bool = False) -> Iterator[int]:
    """Hold GPU ``gpu``'s lock (``flock`` on its ledger); yields the open fd.

    Every change of a GPU's records (allocation checks, register, remove) happens
    under this lock so two jobs cannot both take the last free gigabyte, and so the
    energy ledger is advanced before the activity it integrates changes.
    """
    path = _ledger_path(Path(state_dir), gpu)
    try:
        fd = os.open(path, os.O_RDWR)
    except PermissionError:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise GpuBackendError(f"{path}: missing; GPU {gpu} is not a simulated GPU here") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)


def _read_ledger(fd: int) -> tuple[float, float]:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 4096)
    try:
        data = json.loads(raw)
        return float(data["t"]), float(data["energy_j"])
    except (ValueError, KeyError, TypeError) as e:
        raise GpuBackendError(f"corrupt energy ledger: {e}") from e


def mps_servers(records: list[ProcRecord]) -> set[int]:
    """The live MPS servers that have clients among ``records`` (pids).

    A server holds memory on a GPU once a client uses it there; one that died under
    its clients (the stand-in's clients outlive it) holds nothing any more.
    """
    return {
        r.mps_server
        for r in records
        if r.mps_server > 0 and process_start_ticks(r.mps_server) is not None
    }


def gpu_used_mib(spec: SimSpec, records: list[ProcRecord], servers: int | None = None) -> int:
    """Memory in use on a GPU running ``records``, as NVML reports it.

    The driver's reserve counts as used (what nvidia-smi shows on recent drivers,
    whose ``nvmlDeviceGetMemoryInfo`` v1 ``used`` includes it: the sim's choice), then
    one ``server_mib`` per live MPS server with clients here, then every process's
    footprint. ``servers`` overrides the server count (an allocation that is about
    to add its own server).
    """
    n = len(mps_servers(records)) if servers is None else servers
    return spec.reserved_mib + n * spec.server_mib + sum(r.used_mib for r in records)


def gpu_sm_activity_pct(records: list[ProcRecord]) -> float:
    """SM activity (%) of a GPU running ``records``: the tenants' demands combined as
    measured on the Lucid pairs (:func:`~.activity.combined_pct`), not their capped sum."""
    return combined_pct(r.sm_pct for r in records)


def gpu_util_pct(records: list[ProcRecord]) -> float:
    """nvidia-smi utilisation (%) of a GPU running ``records``: each tenant's SM activity
    mapped back to utilisation (:func:`~.activity.util_from_sm_activity`), combined."""
    return combined_pct(util_from_sm_activity(r.sm_pct) for r in records)


def gpu_power_w(spec: SimSpec, records: list[ProcRecord]) -> float:
    """Power of a GPU running ``records`` at its combined SM activity (:mod:`.power`)."""
    return power_w(gpu_sm_activity_pct(records), spec.idle_power_w, spec.max_power_w)


def energy_j(
    state_dir: str | os.PathLike[str], spec: SimSpec, gpu: int, fd: int, now: float | None = None
) -> float:
    """Energy counter of ``gpu`` now, with ``fd`` from :func:`gpu_lock` (any mode).

    The ledger holds the energy up to its last update; the power since then is
    constant (records only change under the lock, after :func:`advance_energy`), so
    the counter is exact up to processes that died without removing their record.
    """
    t_last, e_last = _read_ledger(fd)
    now = time.time() if now is None else now
    dt = max(0.0, now - t_last) * effective_time_scale(spec)
    return e_last + gpu_power_w(spec, read_records(state_dir, gpu, clean=False)) * dt


def advance_energy(
    state_dir: str | os.PathLike[str], spec: SimSpec, gpu: int, fd: int, now: float | None = None
) -> float:
    """Fold the energy since the last update into the ledger; call before changing records.

    Needs ``fd`` opened for writing (0666 ledger); read-only holders skip the update,
    which only delays integration, never loses it.
    """
    now = time.time() if now is None else now
    total = energy_j(state_dir, spec, gpu, fd, now)
    # Fixed width: an in-place rewrite never leaves a longer old tail behind, so a
    # crash mid-write cannot produce a ledger that parses as something else.
    data = json.dumps({"t": now, "energy_j": total}).ljust(LEDGER_BYTES).encode()
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, data)
    except OSError as e:
        if e.errno not in (errno.EBADF, errno.EACCES, errno.EPERM):
            raise
    return total
