#!/usr/bin/env python3
"""Co-location measured on a real GPU: throughput, power and SM activity of 1-4 tenants.

The replay's interference and power models (``slurm_colloc/gpu/sim``) are fitted on
published pair measurements and extrapolated to crowded GPUs (issue 24). This script
measures what they predict, on the GPU of the node it runs on, so the models can be
checked against hardware rather than against each other:

- ``ts``: no MPS, each tenant its own context: the driver time-slices them;
- ``mps1``: one MPS server for every tenant (one user's jobs under colloc);
- ``mps2``: two MPS control daemons, tenants alternating between them (two users'
  jobs under colloc's one-server-per-(GPU, user) layout: the servers are time-sliced).

Each tenant is a PyTorch process running a synthetic training step: a fixed amount of
GPU work, then a fixed CPU pause that sets its solo duty cycle (as a data loader
would). Under contention only the GPU part stretches, as in the replay's model.
Per run: each tenant's step rate, GPU energy (NVML's total-energy counter), NVML
utilisation (share of time any kernel runs) and, on Hopper and newer, GPM's SM
activity, SM occupancy and DRAM bandwidth: the metrics the replay conflates.

Needs root (MPS control), torch with CUDA, nvidia-ml-py and nvidia-cuda-mps-control.
``--dry-run`` runs the orchestration on the CPU without NVML or MPS (for testing
the script itself). Imports nothing from colloc so it runs on a bare GPU node:

    python3 benchmarks/hw_colocation.py --out hw_colocation.json
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

# name: (kernel, size, kernels per step, solo duty cycle)
WORKLOADS: dict[str, tuple[str, int, int, float]] = {
    "H": ("mm_bf16", 8192, 4, 1.0),    # compute-bound, always busy
    "M": ("mm_bf16", 8192, 4, 0.5),    # compute-bound, busy half the time
    "L": ("mm_bf16", 8192, 4, 0.25),   # compute-bound, a quarter of the time
    "S": ("mm_fp32", 1024, 40, 1.0),   # small kernels: always running, few SMs
    "B": ("copy", 1 << 28, 4, 1.0),    # memory-bound: 1 GiB fp32 copies
}
MIXES = ["HL", "ML", "HS", "HB", "MLLS"]


# ----------------------------------------------------------------------------- worker
def worker_main(device: str) -> None:
    """One tenant: answers ``calibrate``, ``run W SECONDS T0`` and ``exit`` on stdin."""
    import torch

    dev = torch.device(device)
    bufs: dict[str, Any] = {}
    sleep_s: dict[str, float] = {}

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def step_fn(name: str) -> Any:
        kernel, n, k, _ = WORKLOADS[name]
        if dev.type == "cpu":   # dry run: small and quick
            n = min(n, 128) if kernel != "copy" else 1 << 16
        if name not in bufs:
            if kernel == "copy":
                bufs[name] = (torch.empty(n, device=dev), torch.empty(n, device=dev))
            else:
                dt = torch.bfloat16 if kernel == "mm_bf16" and dev.type == "cuda" else torch.float32
                bufs[name] = (torch.randn(n, n, device=dev, dtype=dt),
                              torch.randn(n, n, device=dev, dtype=dt),
                              torch.empty(n, n, device=dev, dtype=dt))
        b = bufs[name]

        def step() -> None:
            for _ in range(k):
                if kernel == "copy":
                    b[1].copy_(b[0])
                else:
                    torch.mm(b[0], b[1], out=b[2])
            sync()
        return step

    def out(**kw: Any) -> None:
        print(json.dumps(kw), flush=True)

    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "exit":
            break
        if cmd[0] == "calibrate":   # solo GPU time per step, sets each workload's pause
            for name, (_, _, _, duty) in WORKLOADS.items():
                step = step_fn(name)
                for _ in range(3):
                    step()
                t = time.perf_counter()
                for _ in range(10):
                    step()
                gpu = (time.perf_counter() - t) / 10
                sleep_s[name] = gpu * (1 - duty) / duty
            out(calibrated={k: round(v, 6) for k, v in sleep_s.items()})
        elif cmd[0] == "run":
            name, seconds, t0 = cmd[1], float(cmd[2]), float(cmd[3])
            step, pause = step_fn(name), sleep_s[name]
            while time.time() < t0:
                pass
            end, steps, gpu_s = t0 + seconds, 0, 0.0
            while True:
                a = time.perf_counter()
                step()
                gpu_s += time.perf_counter() - a
                steps += 1
                if time.time() >= end:
                    break
                if pause:
                    time.sleep(pause)
            out(workload=name, steps=steps, elapsed=time.time() - t0, gpu_s=gpu_s)


# ----------------------------------------------------------------------------- controller
@dataclass
class Tenant:
    proc: subprocess.Popen[str]
    lines: queue.Queue[str]

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float) -> dict[str, Any]:
        deadline = time.time() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.time()))
            except queue.Empty:
                raise TimeoutError(f"tenant {self.proc.pid} silent for {timeout} s") from None
            if line.startswith("{"):
                return json.loads(line)  # type: ignore[no-any-return]
            if time.time() > deadline:
                raise TimeoutError(f"tenant {self.proc.pid}: no answer")


def spawn(python: str, device: str, env: dict[str, str]) -> Tenant:
    p = subprocess.Popen([python, os.path.abspath(__file__), "--worker", device],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env=env)
    q: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert p.stdout is not None
        for line in p.stdout:
            q.put(line)
            if not line.startswith("{"):
                sys.stderr.write(f"[tenant {p.pid}] {line}")
    threading.Thread(target=pump, daemon=True).start()
    return Tenant(p, q)


class Gpu:
    """NVML readings over a window (none in a dry run)."""

    def __init__(self, dry: bool) -> None:
        self.nv: Any = None
        self.gpm = False
        if dry:
            return
        import pynvml as nv
        nv.nvmlInit()
        self.nv = nv
        self.h = nv.nvmlDeviceGetHandleByIndex(0)
        try:
            self.gpm = bool(nv.nvmlGpmQueryDeviceSupport(self.h).isSupportedDevice)
        except nv.NVMLError:
            self.gpm = False

    def info(self) -> dict[str, Any]:
        if self.nv is None:
            return {"dry_run": True}
        nv, h = self.nv, self.h
        name = nv.nvmlDeviceGetName(h)
        return {"name": name if isinstance(name, str) else name.decode(),
                "driver": str(nv.nvmlSystemGetDriverVersion()),
                "power_limit_w": nv.nvmlDeviceGetPowerManagementLimit(h) / 1000,
                "memory_mib": nv.nvmlDeviceGetMemoryInfo(h).total // 2**20,
                "gpm": self.gpm}

    def window(self, t0: float, seconds: float) -> dict[str, Any]:
        """Sample from ``t0`` for ``seconds``: energy, power, utilisation, GPM metrics."""
        while time.time() < t0:
            time.sleep(0.001)
        if self.nv is None:
            time.sleep(seconds)
            return {}
        nv, h = self.nv, self.h
        e0 = nv.nvmlDeviceGetTotalEnergyConsumption(h)
        s1 = s2 = None
        if self.gpm:
            s1, s2 = nv.nvmlGpmSampleAlloc(), nv.nvmlGpmSampleAlloc()
            nv.nvmlGpmSampleGet(h, s1)
        a = time.time()
        util, mem_util, power, clock = [], [], [], []
        while time.time() < t0 + seconds:
            r = nv.nvmlDeviceGetUtilizationRates(h)
            util.append(r.gpu)
            mem_util.append(r.memory)
            power.append(nv.nvmlDeviceGetPowerUsage(h) / 1000)
            clock.append(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
            time.sleep(0.05)
        e1 = nv.nvmlDeviceGetTotalEnergyConsumption(h)
        dt = time.time() - a
        row: dict[str, Any] = {
            "energy_j": (e1 - e0) / 1000, "window_s": dt, "power_w": (e1 - e0) / 1000 / dt,
            "power_sampled_w": sum(power) / len(power), "nvml_util_pct": sum(util) / len(util),
            "nvml_mem_util_pct": sum(mem_util) / len(mem_util),
            "sm_clock_mhz": sum(clock) / len(clock),
        }
        if s1 is not None and s2 is not None:
            nv.nvmlGpmSampleGet(h, s2)
            ids = {"sm_active_pct": nv.NVML_GPM_METRIC_SM_UTIL,
                   "sm_occupancy_pct": nv.NVML_GPM_METRIC_SM_OCCUPANCY,
                   "gr_active_pct": nv.NVML_GPM_METRIC_GRAPHICS_UTIL,
                   "dram_bw_pct": nv.NVML_GPM_METRIC_DRAM_BW_UTIL,
                   "tensor_active_pct": nv.NVML_GPM_METRIC_ANY_TENSOR_UTIL}
            mg = nv.c_nvmlGpmMetricsGet_t()
            mg.version = nv.NVML_GPM_METRICS_GET_VERSION
            mg.numMetrics = len(ids)
            mg.sample1, mg.sample2 = s1, s2
            for i, mid in enumerate(ids.values()):
                mg.metrics[i].metricId = mid
            try:
                nv.nvmlGpmMetricsGet(mg)
                for i, key in enumerate(ids):
                    row[key] = mg.metrics[i].value if mg.metrics[i].nvmlReturn == 0 else None
            except nv.NVMLError as e:
                row["gpm_error"] = str(e)
            nv.nvmlGpmSampleFree(s1)
            nv.nvmlGpmSampleFree(s2)
        return row


def mps_control() -> str | None:
    for d in ("", "/usr/local/nvidia/bin", "/usr/bin", "/usr/local/cuda/bin"):
        p = shutil.which("nvidia-cuda-mps-control", path=d or None)
        if p:
            return p
    return None


class Mode:
    """Starts the mode's MPS daemons and gives each tenant its environment."""

    def __init__(self, name: str, dry: bool, base: str) -> None:
        self.name, self.dry, self.dirs = name, dry, []
        n = {"ts": 0, "mps1": 1, "mps2": 2}[name]
        self.ctl = mps_control()
        for i in range(n):
            d = os.path.join(base, f"{name}-{i}")
            os.makedirs(d + "/pipe", exist_ok=True)
            os.makedirs(d + "/log", exist_ok=True)
            self.dirs.append(d)
            if not dry:
                if self.ctl is None:
                    raise RuntimeError("nvidia-cuda-mps-control not found")
                subprocess.run([self.ctl, "-d"], env=self._env(d), check=True, timeout=20)

    @staticmethod
    def _env(d: str) -> dict[str, str]:
        return {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": d + "/pipe",
                "CUDA_MPS_LOG_DIRECTORY": d + "/log"}

    def tenant_env(self, i: int) -> dict[str, str]:
        return self._env(self.dirs[i % len(self.dirs)]) if self.dirs else dict(os.environ)

    def servers(self) -> list[str]:
        if self.dry or self.ctl is None:
            return []
        return [subprocess.run([self.ctl], input="get_server_list\n", env=self._env(d),
                               capture_output=True, text=True, timeout=10).stdout.strip()
                for d in self.dirs]

    def stop(self) -> None:
        if self.dry or self.ctl is None:
            return
        for d in self.dirs:
            subprocess.run([self.ctl], input="quit\n", env=self._env(d), capture_output=True,
                           text=True, timeout=20, check=False)


def plan(mode: str) -> list[str]:
    solos = [] if mode == "mps2" else list(WORKLOADS)
    homog = [w * k for w in WORKLOADS for k in (2, 3, 4)]
    return solos + homog + MIXES


def run_mode(mode: str, args: argparse.Namespace, gpu: Gpu, base: str,
             deadline: float) -> dict[str, Any]:
    device = "cpu" if args.dry_run else "cuda"
    m = Mode(mode, args.dry_run, base)
    tenants: list[Tenant] = []
    res: dict[str, Any] = {"mode": mode, "runs": []}
    try:
        tenants = [spawn(args.python, device, m.tenant_env(i)) for i in range(4)]
        for t in tenants:     # one at a time: each calibrates alone on the GPU
            t.send("calibrate")
            res.setdefault("calibration", []).append(t.recv(120)["calibrated"])
        res["servers"] = m.servers()
        res["idle_with_contexts"] = gpu.window(time.time() + 0.2, args.seconds)
        for combo in plan(mode):
            if time.time() > deadline:
                res["cut_short"] = combo
                break
            t0 = time.time() + 0.3
            for i, w in enumerate(combo):
                tenants[i].send(f"run {w} {args.seconds} {t0}")
            # the window opens 0.2 s into the run: everyone's first step is under way
            row = gpu.window(t0 + 0.2, args.seconds - 0.3)
            row["combo"] = combo
            row["tenants"] = [tenants[i].recv(60 + args.seconds) for i in range(len(combo))]
            res["runs"].append(row)
            print(f"{mode:5s} {combo:5s} " + " ".join(
                f"{t['steps'] / t['elapsed']:8.2f}/s" for t in row["tenants"])
                + (f"  {row.get('power_w', 0):6.1f} W util {row.get('nvml_util_pct', 0):5.1f}"
                   f" sm {row.get('sm_active_pct') or 0:5.1f}" if row.get("power_w") else ""),
                flush=True)
    except Exception as e:  # noqa: BLE001 - a mode that cannot run (MPS refused) must not lose the others
        res["error"] = f"{type(e).__name__}: {e}"
        print(f"{mode}: {res['error']}", flush=True)
    finally:
        for t in tenants:
            try:
                t.send("exit")
                t.proc.wait(timeout=20)
            except Exception:  # noqa: BLE001 - a stuck tenant is killed
                t.proc.kill()
        m.stop()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", metavar="DEVICE", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="hw_colocation.json")
    ap.add_argument("--seconds", type=float, default=2.5, help="length of each run")
    ap.add_argument("--modes", default="ts,mps1,mps2")
    ap.add_argument("--budget-s", type=float, default=400, help="stop starting runs after this")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--dry-run", action="store_true", help="CPU, no NVML, no MPS")
    args = ap.parse_args()
    if args.worker:
        worker_main(args.worker)
        return
    deadline = time.time() + args.budget_s
    gpu = Gpu(args.dry_run)
    result: dict[str, Any] = {"schema": "colloc-hw-colocation/1", "gpu": gpu.info(),
                              "workloads": WORKLOADS, "seconds": args.seconds,
                              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    result["idle"] = gpu.window(time.time(), args.seconds)
    with tempfile.TemporaryDirectory(prefix="colloc-hw-") as base:
        os.chmod(base, 0o755)
        result["modes"] = [run_mode(m, args, gpu, base, deadline)
                           for m in args.modes.split(",")]
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
