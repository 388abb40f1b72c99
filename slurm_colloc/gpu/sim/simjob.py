"""``colloc-simjob``: a stand-in deep-learning training job for simulated GPUs.

It behaves, as far as Slurm, MPS and the colloc node scripts can tell, like a
PyTorch training run: it connects to MPS when ``CUDA_MPS_PIPE_DIRECTORY`` names a
running daemon (and waits, saying so, while another user's MPS server is busy),
takes the GPU named by ``CUDA_VISIBLE_DEVICES`` (under MPS among the devices its
server sees, numbered by the server), holds ``--mem`` on the GPU and grows to
``--peak`` at ``--peak-at`` of its work, prints training-loop progress, slows down
when co-located jobs saturate the GPU (:mod:`.interference`) or when MPS confines it
to fewer SMs than it would use, and dies with PyTorch's OOM text when an allocation
exceeds its MPS limit or the GPU's free memory.

Memory, as a real node has it: ``--mem`` and ``--peak`` are the process's footprint
as NVML shows it, CUDA context included (what the estimator predicts), and never
less than one context. MPS's pinned limit binds the allocations only, not the
context, so a job fits its limit while ``footprint - context_mib <= limit``. The GPU
holds the driver's reserve, one ``server_mib`` per live MPS server with clients on
it, and every process's footprint; an allocation beyond the rest fails. The context
is created first: if even it does not fit, CUDA's generic out-of-memory error.

With ``--fault-at`` it hits a fatal GPU exception (an illegal memory access) at that
fraction of its work. Under MPS it tells the daemon, which reports the exception to
every other client of the same server, as Volta+ MPS does: those jobs die with the
same PyTorch error, and the server refuses new clients of that user until all of
them have exited (:mod:`.mps_protocol`).

With a checkpoint directory (``--checkpoint-dir``, by default ``COLLOC_CHECKPOINT_DIR``,
which colloc's TaskProlog exports) it saves its progress every ``--checkpoint-every``
seconds of work and, started again (a requeue), resumes from the last save, printing
how much work it resumed from and, on every exit, how much work this attempt did
(:mod:`.sim_checkpoint`).

Exit codes: 0 done; 1 a CUDA error, as PyTorch exits on an uncaught exception: out
of memory, an illegal memory access (its own ``--fault-at``, or another client's
reported by MPS), an MPS server not ready to accept new clients (recovering from
such a fault), or, under MPS, no device: ``CUDA_VISIBLE_DEVICES`` names none of the
server's devices; 2 bad input or environment (unparseable size, negative memory, no
or non-existent GPU outside MPS, missing state dir); killed by SIGTERM (scancel)
after removing its records. Every exit path removes its records and releases its
memory.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from slurm_colloc.gpu.backend import GpuBackendError
from slurm_colloc.gpu.sim import mps_client, sim_checkpoint
from slurm_colloc.gpu.sim.cuda_errors import (
    ILLEGAL_ADDRESS,
    MEMORY_ALLOCATION,
    MPS_SERVER_NOT_READY,
    NO_GPUS,
    torch_cuda_error,
)
from slurm_colloc.gpu.sim.interference import rate_for, thread_cap
from slurm_colloc.gpu.sim.mps_protocol import (
    FATAL,
    FAULT,
    LIMIT_ENV,
    MAX_LINE,
    PIPE_ENV,
    THREADS_ENV,
    VISIBLE_ENV,
    LineReader,
    MpsError,
    ServerGrant,
    ServerNotReady,
    connect,
    ui_command,
)
from slurm_colloc.gpu.sim.oom import torch_oom_message, torch_traceback
from slurm_colloc.gpu.sim.state import (
    ProcRecord,
    SimSpec,
    advance_energy,
    effective_time_scale,
    gpu_lock,
    gpu_used_mib,
    load_spec,
    mps_servers,
    process_start_ticks,
    read_records,
    remove_record,
    write_record,
)
from slurm_colloc.units import SizeError, limit_for, parse_device_limits, parse_size_mib

STATE_ENV = "COLLOC_SIM_STATE"
EXIT_CUDA = 1  # any CUDA error, as PyTorch exits on an uncaught RuntimeError
EXIT_OOM = EXIT_CUDA
EXIT_USAGE = 2
TICK_S = 0.1


class UsageError(Exception):
    """Bad input or environment: exit 2, never confused with an OOM (exit 1)."""


class OutOfMemory(Exception):
    """An allocation did not fit; carries the PyTorch message and, as ``detail``, what
    bound it (the GPU's free memory or the MPS limit), for whoever reads the job's
    stderr after a replay."""

    def __init__(self, message: str, detail: str = "") -> None:
        """``message``: PyTorch's text; ``detail``: the sim's own account of the bound."""
        super().__init__(message)
        self.detail = detail


class CudaRuntimeError(Exception):
    """Another CUDA error (illegal address, MPS server not ready); carries PyTorch's text."""


@dataclass(frozen=True)
class JobSpec:
    """The validated command line."""

    mem_mib: int
    peak_mib: int
    peak_at: float
    sm_pct: float
    seconds: float
    state_dir: Path
    time_scale: float | None
    fault_at: float | None = None
    checkpoint_dir: Path | None = None
    """Where progress is saved and resumed from (:mod:`.sim_checkpoint`); None: nowhere."""
    checkpoint_every: float = 0.0
    """Seconds of work between saves (0 with a directory: a tenth of the work)."""


def _size(text: str, what: str) -> int:
    try:
        return parse_size_mib(text)
    except SizeError as e:
        raise UsageError(f"{what}: {e}") from None


def parse_args(argv: list[str] | None) -> JobSpec:
    """Parse and validate the command line; every problem is a :class:`UsageError`."""
    p = argparse.ArgumentParser(prog="colloc-simjob", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--mem",
        required=True,
        help="steady GPU memory as NVML shows it (CUDA context included), e.g. 8G, 8192M",
    )
    p.add_argument("--peak", help="peak memory it grows to (default: --mem)")
    p.add_argument(
        "--peak-at", type=float, default=0.5, help="fraction of work at which the peak is reached"
    )
    p.add_argument(
        "--fault-at",
        type=float,
        metavar="FRAC",
        help="fraction of work at which it hits a fatal GPU exception (illegal memory access)",
    )
    p.add_argument(
        "--sm-activity", type=float, default=80.0, help="SM activity alone on the GPU, %%"
    )
    p.add_argument("--seconds", type=float, default=10.0, help="work, in seconds on an idle GPU")
    p.add_argument("--gpu-state", help="sim state dir (default $COLLOC_SIM_STATE, then config)")
    p.add_argument(
        "--checkpoint-dir",
        help="save progress here and resume from it after a requeue "
        f"(default ${sim_checkpoint.ENV_DIR}; empty: none)",
    )
    p.add_argument(
        "--checkpoint-every", type=float, default=0.0, metavar="SECONDS",
        help="seconds of work between checkpoints (default: a tenth of --seconds)",
    )
    p.add_argument(
        "--time-scale", type=float, help="sim seconds per wall second (default: state/env)"
    )
    argv = _glue_negative_values(sys.argv[1:] if argv is None else argv)
    try:
        a = p.parse_args(argv)
    except SystemExit as e:  # argparse already printed its message
        if e.code:
            raise UsageError("") from None
        raise  # --help
    mem = _size(a.mem, "--mem")
    peak = _size(a.peak, "--peak") if a.peak is not None else mem
    if peak < mem:
        raise UsageError(f"--peak ({peak} MiB) is smaller than --mem ({mem} MiB)")
    if not 0.0 <= a.peak_at <= 1.0:
        raise UsageError(f"--peak-at {a.peak_at}: must be a fraction between 0 and 1")
    if a.fault_at is not None and not 0.0 <= a.fault_at <= 1.0:
        raise UsageError(f"--fault-at {a.fault_at}: must be a fraction between 0 and 1")
    if not 0.0 <= a.sm_activity <= 100.0:
        raise UsageError(f"--sm-activity {a.sm_activity}: must be a percentage 0..100")
    if not a.seconds > 0:
        raise UsageError(f"--seconds {a.seconds}: must be positive")
    if a.time_scale is not None and not a.time_scale > 0:
        raise UsageError(f"--time-scale {a.time_scale}: must be positive")
    if a.checkpoint_every < 0:
        raise UsageError(f"--checkpoint-every {a.checkpoint_every}: must not be negative")
    ckpt = a.checkpoint_dir
    if ckpt is None:
        ckpt = os.environ.get(sim_checkpoint.ENV_DIR, "")
    return JobSpec(
        mem,
        peak,
        a.peak_at,
        a.sm_activity,
        a.seconds,
        _state_dir(a.gpu_state),
        a.time_scale,
        a.fault_at,
        Path(ckpt) if ckpt else None,
        a.checkpoint_every or a.seconds / 10,
    )


def _glue_negative_values(argv: list[str]) -> list[str]:
    """Turn ``--mem -5G`` into ``--mem=-5G`` so the size check, not argparse, reports it."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if out and out[-1] in ("--mem", "--peak") and arg.startswith("-") and i > 0:
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _state_dir(flag: str | None) -> Path:
    if flag:
        return Path(flag)
    if os.environ.get(STATE_ENV):
        return Path(os.environ[STATE_ENV])
    from slurm_colloc.config import ConfigError, load

    try:
        return Path(load().sim_state_dir)
    except ConfigError as e:
        raise UsageError(f"cannot find the sim state dir: {e}") from None


def _no_device(raw: str | None) -> UsageError:
    return UsageError(
        "no CUDA-capable device is visible: CUDA_VISIBLE_DEVICES is "
        + ("unset" if raw is None else "empty")
        + " (request a GPU with --gres=gpu:1 or --gres=shard:N)"
    )


def visible_gpu(spec: SimSpec, env: Mapping[str, str]) -> int:
    """Physical index of the first GPU in ``CUDA_VISIBLE_DEVICES`` (index or UUID).

    Outside MPS only; nonsense is bad input (exit 2) rather than PyTorch's error
    because nothing but a broken environment produces it there.
    """
    raw = env.get(VISIBLE_ENV)
    if raw is None or not raw.strip():
        raise _no_device(raw)
    first = raw.split(",")[0].strip()
    if first.startswith("GPU-"):
        found = _pick(spec, list(range(spec.gpu_count)), first)
        if found is None:
            raise UsageError(f"CUDA_VISIBLE_DEVICES={raw}: no simulated GPU has UUID {first}")
        return found
    try:
        index = int(first)
    except ValueError:
        raise UsageError(
            f"CUDA_VISIBLE_DEVICES={raw}: {first!r} is not a GPU index or UUID"
        ) from None
    if not 0 <= index < spec.gpu_count:
        raise UsageError(
            f"CUDA_VISIBLE_DEVICES={raw}: GPU {index} does not exist "
            f"(this node has {spec.gpu_count} simulated GPUs, 0..{spec.gpu_count - 1})"
        )
    return index


def _pick(spec: SimSpec, devices: list[int], entry: str) -> int | None:
    """The GPU of ``devices`` one ``CUDA_VISIBLE_DEVICES`` entry names, or None.

    An integer is a position in ``devices``; ``GPU-...`` is a UUID or a prefix of
    one (``GPU-`` included) that must name exactly one of them, as CUDA accepts.
    """
    if entry.startswith("GPU-"):
        matches = [g for g in devices if spec.uuid(g).startswith(entry)]
        return matches[0] if len(matches) == 1 else None
    try:
        k = int(entry)
    except ValueError:
        return None
    return devices[k] if 0 <= k < len(devices) else None


def select_devices(spec: SimSpec, devices: list[int], raw: str | None) -> list[int]:
    """The physical GPUs, in order, that ``CUDA_VISIBLE_DEVICES=raw`` leaves of ``devices``.

    CUDA's rule: entries are read in order and the first one that names no device
    (out of range, unknown UUID, a repeat, anything else) ends the list, so a bad
    first entry leaves nothing. Unset leaves every device.
    """
    if raw is None:
        return list(devices)
    out: list[int] = []
    for entry in raw.split(","):
        g = _pick(spec, devices, entry.strip())
        if g is None or g in out:
            break
        out.append(g)
    return out


def server_devices(spec: SimSpec, grant: ServerGrant) -> list[int]:
    """Physical GPUs an MPS server sees: its daemon's ``CUDA_VISIBLE_DEVICES`` on the node."""
    return select_devices(spec, list(range(spec.gpu_count)), grant.visible_devices)


def _requested_device(raw: str | None) -> int:
    """The server-side device number to ask MPS for before the server's list is known.

    Under MPS an integer entry is already the server's number; a UUID is resolved
    only after the grant (see :meth:`SimJob.connect_mps`).
    """
    first = (raw or "").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


def room(
    spec: SimSpec, others_used_mib: int, used_mib: int, limit_mib: int | None
) -> tuple[int, int, int]:
    """(total, GPU free, free to allocate) for a process holding ``used_mib``.

    ``others_used_mib``: the GPU's memory in use without this process
    (:func:`~.state.gpu_used_mib`: reserve, servers, other footprints). The pinned
    limit binds allocations only (footprint less one context); what may be allocated
    is the smaller of the GPU's free memory and what the limit leaves. ``total`` is
    what PyTorch's message calls the capacity (``cudaMemGetInfo``'s total: the
    allocatable memory, or the MPS limit if smaller). Pure, so the property tests
    check the very arithmetic the simjob applies.
    """
    gpu_free = spec.memory_mib - others_used_mib - used_mib
    if limit_mib is None:
        return spec.allocatable_mib, gpu_free, gpu_free
    allocated = used_mib - spec.context_mib
    return (
        min(limit_mib, spec.allocatable_mib), gpu_free, min(gpu_free, limit_mib - allocated)
    )


class SimJob:
    """One running simjob: its GPU footprint, MPS connection and progress."""

    def __init__(
        self,
        job: JobSpec,
        spec: SimSpec,
        gpu: int | None,
        out: TextIO,
        err: TextIO,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """Prepare; nothing is registered on the GPU until :meth:`run`.

        ``gpu`` None: decided by :meth:`connect_mps` (under MPS the server's devices
        decide what ``CUDA_VISIBLE_DEVICES`` means) or, without MPS, by
        :func:`visible_gpu`.
        """
        self.job, self.spec, self.gpu, self.out, self.err = job, spec, gpu, out, err
        self.env: Mapping[str, str] = os.environ if env is None else env
        self.stop = False
        self.limit_mib: int | None = None
        self.own_limit_mib: int | None = None  # CUDA_MPS_PINNED_DEVICE_MEM_LIMIT's
        self.server_limit_mib: int | None = None  # the MPS server's, at connect
        self.sm_pct = job.sm_pct
        self.thread_pct = 100.0  # CUDA_MPS_ACTIVE_THREAD_PERCENTAGE in force
        self.mem_mib = max(job.mem_mib, spec.context_mib)  # footprints: a context at least
        self.peak_mib = max(job.peak_mib, spec.context_mib)
        self.used_mib = 0
        self.mps: socket.socket | None = None
        self.mps_server = 0  # pid of our MPS server; 0 = running outside MPS
        self.mps_buf = b""  # a partial line from the daemon
        self.mps_eof = False  # the daemon went away: nothing more to hear
        self.pid = os.getpid()
        self.start_ticks = process_start_ticks(self.pid) or 0
        self.resumed_s = 0.0  # work a checkpoint said was done before this attempt
        self.done_s = 0.0  # work done, this attempt's and the resumed

    @property
    def device(self) -> int:
        """The physical GPU, once decided."""
        if self.gpu is None:
            raise RuntimeError("the simjob has no GPU yet")
        return self.gpu

    # --- MPS --------------------------------------------------------------------
    def connect_mps(self, env: Mapping[str, str]) -> None:
        """Join MPS if a daemon is configured; pick the GPU; apply limits.

        The GPU is chosen after the grant because only then is it known which
        devices the server sees, and hence what the job's own
        ``CUDA_VISIBLE_DEVICES`` means.
        """
        pipe = env.get(PIPE_ENV)
        env_limit = env.get(LIMIT_ENV)
        if not pipe or not mps_client.daemon_present(Path(pipe)):
            if pipe:
                self._say_err(f"warning: no MPS control daemon in {pipe}; running without MPS")
            if env_limit:
                self._say_err(f"warning: {LIMIT_ENV} has no effect without MPS (as in CUDA)")
            return
        try:
            limits = parse_device_limits(env_limit) if env_limit else {}
        except SizeError as e:
            raise UsageError(f"{LIMIT_ENV}={env_limit}: {e}") from None
        pct_env = env.get(THREADS_ENV)
        try:
            pct = float(pct_env) if pct_env else 100.0
        except ValueError:
            raise UsageError(f"{THREADS_ENV}={pct_env}: not a number") from None
        waited: list[tuple[int, int]] = []

        def on_wait(uid: int, server_pid: int, n: int) -> None:
            if (uid, n) not in waited:
                waited.append((uid, n))
                self._say_err(
                    f"waiting for MPS: the server of uid {uid} (pid {server_pid}) still has "
                    f"{n} client(s); MPS runs one server per user per GPU, so uid "
                    f"{os.getuid()} starts when they are gone"
                )

        raw = env.get(VISIBLE_ENV)
        if raw is not None and not raw.strip():
            raise _no_device(raw)  # as without MPS: hides every device
        asked = _requested_device(raw)
        try:
            self.mps, grant = mps_client.request_server(
                Path(pipe), asked, on_wait, lambda: self.stop
            )
        except ServerNotReady:
            raise CudaRuntimeError(torch_cuda_error(MPS_SERVER_NOT_READY, self.env)) from None
        except MpsError as e:
            raise UsageError(f"MPS: {e}") from None
        if waited:
            self._say_err(f"MPS server {grant.server_pid} ready for uid {os.getuid()}")
        self.mps_server = grant.server_pid
        theirs = server_devices(self.spec, grant)
        mine = select_devices(self.spec, theirs, raw)
        if not mine:
            seen = ", ".join(f"GPU {g} ({self.spec.uuid(g)})" for g in theirs) or "none"
            self._say_err(
                f"CUDA_VISIBLE_DEVICES={raw} names no device of MPS server "
                f"{grant.server_pid}, which sees {seen} as devices 0..{len(theirs) - 1}: "
                "under MPS device numbers are the server's (a UUID avoids the ambiguity)"
            )
            raise CudaRuntimeError(NO_GPUS)
        self.gpu = mine[0]
        position = theirs.index(self.gpu)
        server_limit = grant.limit_mib
        if position != asked:
            server_limit = self._server_limit(Path(pipe), grant, position)
        # The server's pinned limit (set_default_device_pinned_mem_limit, or
        # set_device_pinned_mem_limit on the running server) binds: the client's own
        # variable can only lower it, never raise it. The client numbers its devices
        # from 0 among its own visible ones.
        own = limit_for(limits, 0)
        caps = [x for x in (own, server_limit) if x is not None]
        self.limit_mib = min(caps) if caps else None
        self.own_limit_mib, self.server_limit_mib = own, server_limit
        if own is not None and server_limit is not None and server_limit < own:
            self._say_err(
                f"MPS server {grant.server_pid}'s pinned limit ({server_limit} MiB) is "
                f"below this job's own {LIMIT_ENV} ({own} MiB): the server's binds"
            )
        self.thread_pct = min(pct, grant.active_thread_pct)
        self.sm_pct = min(self.job.sm_pct, self.thread_pct)

    def _server_limit(self, pipe: Path, grant: ServerGrant, device: int) -> int | None:
        """The server's limit for ``device`` when the grant was for another device.

        Asked with the ``get_`` command any user may run; if that fails the grant's
        limit stands (a limit, never none).
        """
        try:
            with connect(pipe) as sock:
                sock.sendall(b"UI\n")
                command = f"get_device_pinned_mem_limit {grant.server_pid} {device}"
                answer = ui_command(sock, LineReader(sock), command).strip()
            return None if answer == "0" else parse_size_mib(answer)
        except (MpsError, OSError, SizeError):
            return grant.limit_mib

    def check_mps(self) -> None:
        """Without blocking, look for ``FATAL`` from the daemon; raise if it came.

        ``FATAL``: another client of our MPS server hit a fatal GPU exception, which
        MPS reports to every client as the same error. EOF (the daemon stopped) is
        ignored: the job keeps running.
        """
        sock = self.mps
        if sock is None or self.mps_eof:
            return
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            data = sock.recv(4096) if readable else None
        except OSError:
            data = b""
        if data is None:
            return
        if not data:
            self.mps_eof = True
            return
        self.mps_buf += data
        while b"\n" in self.mps_buf:
            raw, self.mps_buf = self.mps_buf.split(b"\n", 1)
            if raw.decode("utf-8", "replace").split() == [FATAL]:
                raise CudaRuntimeError(torch_cuda_error(ILLEGAL_ADDRESS, self.env))
        if len(self.mps_buf) > MAX_LINE:
            self.mps_buf = b""

    def fault(self) -> None:
        """Hit a fatal GPU exception: tell MPS (it tells the other clients) and die."""
        if self.mps is not None:
            with contextlib.suppress(OSError):
                self.mps.sendall(f"{FAULT}\n".encode())
        raise CudaRuntimeError(torch_cuda_error(ILLEGAL_ADDRESS, self.env))

    # --- memory -----------------------------------------------------------------
    def create_context(self) -> None:
        """Take the CUDA context's memory, or raise CUDA's generic out-of-memory error.

        Outside every MPS limit; a first client of its server on this GPU also
        brings the server's memory (:func:`~.state.gpu_used_mib`).
        """
        self._grow(self.spec.context_mib, context=True)

    def allocate(self, extra_mib: int) -> None:
        """Grow this process's GPU memory by ``extra_mib`` or raise :class:`OutOfMemory`."""
        self._grow(extra_mib, context=False)

    def _grow(self, extra_mib: int, *, context: bool) -> None:
        gpu = self.device
        with gpu_lock(self.job.state_dir, gpu) as fd:
            others = [r for r in read_records(self.job.state_dir, gpu) if r.pid != self.pid]
            servers = mps_servers(others) | ({self.mps_server} if self.mps_server else set())
            total, gpu_free, free = room(
                self.spec, gpu_used_mib(self.spec, others, len(servers)), self.used_mib,
                self.limit_mib,
            )
            if context:
                if extra_mib > gpu_free:
                    raise CudaRuntimeError(torch_cuda_error(MEMORY_ALLOCATION, self.env))
            else:
                allocated = self.used_mib - self.spec.context_mib  # what the limit counts
                if extra_mib > free:
                    raise OutOfMemory(
                        torch_oom_message(
                            extra_mib,
                            0,
                            total,
                            free,
                            self.used_mib,
                            [(r.pid, r.used_mib) for r in others],
                            torch_mib=allocated,
                        ),
                        self._bound(extra_mib, gpu_free, free, others),
                    )
            advance_energy(self.job.state_dir, self.spec, gpu, fd)
            self.used_mib += extra_mib
            write_record(
                self.job.state_dir,
                ProcRecord(
                    pid=self.pid,
                    gpu=gpu,
                    uid=os.getuid(),
                    used_mib=self.used_mib,
                    sm_pct=self.sm_pct,
                    start_ticks=self.start_ticks,
                    job_id=os.environ.get("SLURM_JOB_ID", ""),
                    started=time.time(),
                    mps_server=self.mps_server if self.mps is not None else 0,
                ),
            )

    def _bound(self, extra_mib: int, gpu_free: int, free: int, others: list[ProcRecord]) -> str:
        """One line saying which bound refused ``extra_mib``, with the figures."""
        users = len({r.uid for r in others} | {os.getuid()})
        where = (
            f"the MPS limit ({self.limit_mib} MiB{self._limit_origin()})"
            if free < gpu_free else "the GPU's free memory"
        )
        return (
            f"allocation of {extra_mib} MiB refused by {where}: GPU {self.gpu} free "
            f"{gpu_free} MiB, limit leaves {free} MiB; {len(others)} other process(es) of "
            f"{users} user(s) hold {sum(r.used_mib for r in others)} MiB"
        )

    def _limit_origin(self) -> str:
        own, server = self.own_limit_mib, self.server_limit_mib
        if server is not None and (own is None or server < own):
            return f", the server's; this job's own is {own} MiB" if own else ", the server's"
        return ""

    def release(self) -> None:
        """Remove our record (energy folded in first); safe to call twice."""
        if self.gpu is not None and self.used_mib:
            with (
                contextlib.suppress(GpuBackendError, OSError),
                gpu_lock(self.job.state_dir, self.gpu) as fd,
            ):
                advance_energy(self.job.state_dir, self.spec, self.gpu, fd)
                remove_record(self.job.state_dir, self.gpu, self.pid)
        if self.mps is not None:
            self.mps.close()
            self.mps = None

    # --- the training loop --------------------------------------------------------
    def train(self, scale: float) -> bool:
        """Do the work; returns False if stopped by a signal."""
        work, done, wall0 = self.job.seconds, self.resume(), time.monotonic()
        peak_pending = self.peak_mib > self.mem_mib
        # fewer SMs than it would use: slower even alone, on top of any co-tenants
        cap = thread_cap(self.job.sm_pct, self.thread_pct)
        fault_at = self.job.fault_at
        next_report, last = int(done * 10 // work) + 1, time.monotonic()
        saved = done
        while done < work:
            if self.stop:
                return False
            self.check_mps()
            if fault_at is not None and done >= fault_at * work:
                self.fault()
            if peak_pending and done >= self.job.peak_at * work:
                self.allocate(self.peak_mib - self.mem_mib)
                peak_pending = False
            time.sleep(min(TICK_S, max(0.001, (work - done) / scale)))
            now = time.monotonic()
            tenants = read_records(self.job.state_dir, self.device)
            rate = rate_for(tenants, self.pid) * cap
            done = self.done_s = min(work, done + (now - last) * scale * rate)
            last = now
            if self.job.checkpoint_dir is not None and done - saved >= self.job.checkpoint_every:
                self.checkpoint(done)
                saved = done
            while next_report <= 10 and done >= work * next_report / 10:
                self._say(
                    f"epoch {next_report}/10 {next_report * 10:3d}% | work {done:.1f}/{work:g} s"
                    f" | wall {now - wall0:.1f} s | speed {rate:.2f}x | mem {self.used_mib} MiB"
                    f" | GPU {self.gpu} co-tenants {len(tenants) - 1}"
                )
                next_report += 1
        if fault_at is not None:  # --fault-at 1: at the very end
            self.fault()
        if peak_pending:
            self.allocate(self.peak_mib - self.mem_mib)
        wall = time.monotonic() - wall0
        self._say(
            f"done: {work:g} s of work in {wall:.1f} s wall (x{scale:g} time scale, "
            f"mean speed {(work - self.resumed_s) / max(wall * scale, 1e-9):.2f}x), "
            f"peak {self.used_mib} MiB on GPU {self.gpu}"
        )
        return True

    def resume(self) -> float:
        """The work done before this attempt per its checkpoint (0: none), said."""
        d = self.job.checkpoint_dir
        if d is None:
            return 0.0
        try:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            self._say_err(f"checkpoint directory {d}: {e}")
        got = sim_checkpoint.load(d, self.job.seconds)
        self._say(got.note)
        self.resumed_s = self.done_s = got.done_s
        return got.done_s

    def checkpoint(self, done: float) -> None:
        """Save ``done``; a failure is said once per save and the job goes on."""
        assert self.job.checkpoint_dir is not None
        try:
            sim_checkpoint.save(self.job.checkpoint_dir, self.job.seconds, done)
        except OSError as e:
            self._say_err(f"checkpoint not saved in {self.job.checkpoint_dir}: {e}")
            return
        self._say(f"checkpoint saved: {done:.1f}/{self.job.seconds:g} s of work")

    def work_line(self) -> str:
        """How much work this attempt did, and from where (the requeue tests read it)."""
        return (f"work this attempt: {self.done_s - self.resumed_s:.1f} s "
                f"(from {self.resumed_s:.1f} to {self.done_s:.1f} of {self.job.seconds:g} s)")

    def _say(self, msg: str) -> None:
        print(f"[colloc-simjob] {msg}", file=self.out, flush=True)

    def _say_err(self, msg: str) -> None:
        print(f"colloc-simjob: {msg}", file=self.err, flush=True)


def run(job: JobSpec, env: dict[str, str], out: TextIO, err: TextIO) -> int:
    """Run a validated job; returns the exit code (SIGTERM re-raises after cleanup)."""
    try:
        spec = load_spec(job.state_dir)
        scale = job.time_scale or effective_time_scale(spec)
    except (GpuBackendError, ValueError) as e:
        raise UsageError(str(e)) from None
    sim = SimJob(job, spec, None, out, err, env)
    got: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        sim.stop = True
        got.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        sim.connect_mps(env)
        if sim.gpu is None:  # no MPS: the node's numbering
            sim.gpu = visible_gpu(spec, env)
        sim.create_context()
        if sim.mem_mib > sim.used_mib:
            sim.allocate(sim.mem_mib - sim.used_mib)
        finished = sim.train(scale)
    except mps_client.Stopped:
        finished = False
    except (OutOfMemory, CudaRuntimeError) as e:
        err.write(torch_traceback(str(e)))
        err.flush()
        if isinstance(e, OutOfMemory) and e.detail:
            sim._say_err(e.detail)
        return EXIT_CUDA
    finally:
        sim.release()
        for s, h in old.items():
            signal.signal(s, h)
        if job.checkpoint_dir is not None:
            sim._say(sim.work_line())
    if not finished and got:
        sim._say_err(f"stopped by signal {got[0]}; GPU memory released")
        os.kill(os.getpid(), got[0])  # die of the signal, as a real job does
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``colloc-simjob``."""
    try:
        job = parse_args(argv)
        return run(job, dict(os.environ), sys.stdout, sys.stderr)
    except UsageError as e:
        if str(e):  # an empty message: argparse has already explained
            print(f"colloc-simjob: error: {e}", file=sys.stderr)  # noqa: T201 - it is a CLI
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
