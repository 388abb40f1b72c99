"""``colloc-simjob``: a stand-in deep-learning training job for simulated GPUs.

It behaves, as far as Slurm, MPS and the colloc node scripts can tell, like a
PyTorch training run: it takes the GPU named by ``CUDA_VISIBLE_DEVICES``, connects to
MPS when ``CUDA_MPS_PIPE_DIRECTORY`` names a running daemon (and waits, saying so,
while another user's MPS server is busy), holds ``--mem`` on the GPU and grows to
``--peak`` at ``--peak-at`` of its work, prints training-loop progress, slows down
when co-located jobs saturate the GPU (:mod:`.interference`), and dies with
PyTorch's OOM text when an allocation exceeds its MPS limit or the GPU's free memory.

With ``--fault-at`` it hits a fatal GPU exception (an illegal memory access) at that
fraction of its work. Under MPS it tells the daemon, which reports the exception to
every other client of the same server, as Volta+ MPS does: those jobs die with the
same PyTorch error, and the server refuses new clients of that user until all of
them have exited (:mod:`.mps_protocol`).

Exit codes: 0 done; 1 a CUDA error, as PyTorch exits on an uncaught exception: out
of memory, an illegal memory access (its own ``--fault-at``, or another client's
reported by MPS), or an MPS server not ready to accept new clients (recovering from
such a fault); 2 bad input or environment (unparseable size, negative memory, no or
non-existent GPU, missing state dir); killed by SIGTERM (scancel) after removing its
records. Every exit path removes its records and releases its memory.
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
from slurm_colloc.gpu.sim import mps_client
from slurm_colloc.gpu.sim.cuda_errors import (
    ILLEGAL_ADDRESS,
    MPS_SERVER_NOT_READY,
    torch_cuda_error,
)
from slurm_colloc.gpu.sim.interference import DEFAULT_MODEL, InterferenceModel
from slurm_colloc.gpu.sim.mps_protocol import (
    FATAL,
    FAULT,
    LIMIT_ENV,
    MAX_LINE,
    PIPE_ENV,
    THREADS_ENV,
    MpsError,
    ServerNotReady,
)
from slurm_colloc.gpu.sim.oom import torch_oom_message, torch_traceback
from slurm_colloc.gpu.sim.sizes import SizeError, limit_for, parse_device_limits, parse_size_mib
from slurm_colloc.gpu.sim.state import (
    ProcRecord,
    SimSpec,
    advance_energy,
    effective_time_scale,
    gpu_lock,
    load_spec,
    process_start_ticks,
    read_records,
    remove_record,
    write_record,
)

STATE_ENV = "COLLOC_SIM_STATE"
EXIT_CUDA = 1  # any CUDA error, as PyTorch exits on an uncaught RuntimeError
EXIT_OOM = EXIT_CUDA
EXIT_USAGE = 2
TICK_S = 0.1


class UsageError(Exception):
    """Bad input or environment: exit 2, never confused with an OOM (exit 1)."""


class OutOfMemory(Exception):
    """An allocation did not fit; carries the PyTorch message."""


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


def _size(text: str, what: str) -> int:
    try:
        return parse_size_mib(text)
    except SizeError as e:
        raise UsageError(f"{what}: {e}") from None


def parse_args(argv: list[str] | None) -> JobSpec:
    """Parse and validate the command line; every problem is a :class:`UsageError`."""
    p = argparse.ArgumentParser(prog="colloc-simjob", description=__doc__.split("\n\n")[0])
    p.add_argument("--mem", required=True, help="steady GPU memory, e.g. 8G, 8192M")
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
    return JobSpec(
        mem,
        peak,
        a.peak_at,
        a.sm_activity,
        a.seconds,
        _state_dir(a.gpu_state),
        a.time_scale,
        a.fault_at,
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


def visible_gpu(spec: SimSpec, env: dict[str, str]) -> int:
    """Physical index of the first GPU in ``CUDA_VISIBLE_DEVICES`` (index or UUID)."""
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None or not raw.strip():
        raise UsageError(
            "no CUDA-capable device is visible: CUDA_VISIBLE_DEVICES is "
            + ("unset" if raw is None else "empty")
            + " (request a GPU with --gres=gpu:1 or --gres=shard:N)"
        )
    first = raw.split(",")[0].strip()
    if first.startswith("GPU-"):
        for i in range(spec.gpu_count):
            if spec.uuid(i) == first:
                return i
        raise UsageError(f"CUDA_VISIBLE_DEVICES={raw}: no simulated GPU has UUID {first}")
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


class SimJob:
    """One running simjob: its GPU footprint, MPS connection and progress."""

    def __init__(
        self,
        job: JobSpec,
        spec: SimSpec,
        gpu: int,
        out: TextIO,
        err: TextIO,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """Prepare; nothing is registered on the GPU until :meth:`run`."""
        self.job, self.spec, self.gpu, self.out, self.err = job, spec, gpu, out, err
        self.env: Mapping[str, str] = os.environ if env is None else env
        self.model: InterferenceModel = DEFAULT_MODEL
        self.stop = False
        self.limit_mib: int | None = None
        self.sm_pct = job.sm_pct
        self.used_mib = 0
        self.mps: socket.socket | None = None
        self.mps_server = 0  # pid of our MPS server; 0 = running outside MPS
        self.mps_buf = b""  # a partial line from the daemon
        self.mps_eof = False  # the daemon went away: nothing more to hear
        self.pid = os.getpid()
        self.start_ticks = process_start_ticks(self.pid) or 0

    # --- MPS --------------------------------------------------------------------
    def connect_mps(self, env: dict[str, str]) -> None:
        """Join MPS if a daemon is configured; apply its and the env's limits."""
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

        try:
            self.mps, grant = mps_client.request_server(Path(pipe), 0, on_wait, lambda: self.stop)
        except ServerNotReady:
            raise CudaRuntimeError(torch_cuda_error(MPS_SERVER_NOT_READY, self.env)) from None
        except MpsError as e:
            raise UsageError(f"MPS: {e}") from None
        if waited:
            self._say_err(f"MPS server {grant.server_pid} ready for uid {os.getuid()}")
        self.mps_server = grant.server_pid
        # The server's pinned limit (set_default_device_pinned_mem_limit, or
        # set_device_pinned_mem_limit on the running server) binds: the client's own
        # variable can only lower it, never raise it.
        own = limit_for(limits, 0)
        caps = [x for x in (own, grant.limit_mib) if x is not None]
        self.limit_mib = min(caps) if caps else None
        self.sm_pct = min(self.job.sm_pct, pct, grant.active_thread_pct)

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
    def allocate(self, extra_mib: int) -> None:
        """Grow this process's GPU memory by ``extra_mib`` or raise :class:`OutOfMemory`."""
        with gpu_lock(self.job.state_dir, self.gpu) as fd:
            others = [r for r in read_records(self.job.state_dir, self.gpu) if r.pid != self.pid]
            gpu_free = self.spec.memory_mib - sum(r.used_mib for r in others) - self.used_mib
            total, free = self.spec.memory_mib, gpu_free
            if self.limit_mib is not None:
                total = min(self.limit_mib, self.spec.memory_mib)
                free = min(gpu_free, self.limit_mib - self.used_mib)
            if extra_mib > free:
                raise OutOfMemory(
                    torch_oom_message(
                        extra_mib,
                        0,
                        total,
                        free,
                        self.used_mib,
                        [(r.pid, r.used_mib) for r in others],
                    )
                )
            advance_energy(self.job.state_dir, self.spec, self.gpu, fd)
            self.used_mib += extra_mib
            write_record(
                self.job.state_dir,
                ProcRecord(
                    pid=self.pid,
                    gpu=self.gpu,
                    uid=os.getuid(),
                    used_mib=self.used_mib,
                    sm_pct=self.sm_pct,
                    start_ticks=self.start_ticks,
                    job_id=os.environ.get("SLURM_JOB_ID", ""),
                    started=time.time(),
                    mps_server=self.mps_server if self.mps is not None else 0,
                ),
            )

    def release(self) -> None:
        """Remove our record (energy folded in first); safe to call twice."""
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
        work, done, wall0 = self.job.seconds, 0.0, time.monotonic()
        peak_pending = self.job.peak_mib > self.job.mem_mib
        fault_at = self.job.fault_at
        next_report, last = 1, time.monotonic()
        while done < work:
            if self.stop:
                return False
            self.check_mps()
            if fault_at is not None and done >= fault_at * work:
                self.fault()
            if peak_pending and done >= self.job.peak_at * work:
                self.allocate(self.job.peak_mib - self.job.mem_mib)
                peak_pending = False
            time.sleep(min(TICK_S, max(0.001, (work - done) / scale)))
            now = time.monotonic()
            tenants = read_records(self.job.state_dir, self.gpu)
            rate = self.model.rate(r.sm_pct for r in tenants)
            done = min(work, done + (now - last) * scale * rate)
            last = now
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
            self.allocate(self.job.peak_mib - self.job.mem_mib)
        wall = time.monotonic() - wall0
        self._say(
            f"done: {work:g} s of work in {wall:.1f} s wall (x{scale:g} time scale, "
            f"mean speed {work / (wall * scale):.2f}x), peak {self.used_mib} MiB on GPU {self.gpu}"
        )
        return True

    def _say(self, msg: str) -> None:
        print(f"[colloc-simjob] {msg}", file=self.out, flush=True)

    def _say_err(self, msg: str) -> None:
        print(f"colloc-simjob: {msg}", file=self.err, flush=True)


def run(job: JobSpec, env: dict[str, str], out: TextIO, err: TextIO) -> int:
    """Run a validated job; returns the exit code (SIGTERM re-raises after cleanup)."""
    try:
        spec = load_spec(job.state_dir)
        gpu = visible_gpu(spec, env)
        scale = job.time_scale or effective_time_scale(spec)
    except (GpuBackendError, ValueError) as e:
        raise UsageError(str(e)) from None
    sim = SimJob(job, spec, gpu, out, err, env)
    got: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        sim.stop = True
        got.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        sim.connect_mps(env)
        sim.allocate(job.mem_mib)
        finished = sim.train(scale)
    except mps_client.Stopped:
        finished = False
    except (OutOfMemory, CudaRuntimeError) as e:
        err.write(torch_traceback(str(e)))
        err.flush()
        return EXIT_CUDA
    finally:
        sim.release()
        for s, h in old.items():
            signal.signal(s, h)
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
