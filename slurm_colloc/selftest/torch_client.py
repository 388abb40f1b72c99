"""The test client of ``colloc selftest --gpu``: a PyTorch process the kit steers.

The kit starts one of these per test job, as that job's user, with the environment
Slurm's TaskProlog would give the job, and keeps it alive while it samples NVML and
nvidia-smi: a one-shot script would be gone before anyone could see its memory. So
the client answers commands on stdin with one JSON object per line on stdout::

    alloc MIB            one tensor of MIB MiB (kept); an OOM is answered, not fatal
    fill CHUNK MAX       CHUNK MiB tensors until an OOM or MAX MiB held in all
    free                 drop every tensor and empty PyTorch's cache
    report               memory figures (held, allocated, reserved)
    hold                 an acknowledgement: the client holds what it has
    bench SECONDS N [T]  N x N fp16 matmuls for SECONDS, starting at epoch time T
    exit                 leave (exit status 0)

At start it prints a ``ready`` line: what CUDA shows this process (device count, the
device's UUID) after it made its CUDA context, or the error that prevented it.

It imports nothing from slurm_colloc, so that the kit can copy it somewhere any
user can read and run it with an interpreter that has torch but not colloc, and it
imports torch only when run, to say plainly when torch is missing. ``probe`` as the
only argument prints one line about the torch installation and exits.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

MIB = 1 << 20
INSTALL_HINT = "pip install torch"


def emit(obj: dict[str, Any]) -> None:
    """One JSON line, flushed at once: the kit is waiting on it."""
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


def error_text(e: BaseException) -> str:
    """The exception as a traceback's last line prints it (what the epilog scans)."""
    cls = type(e)
    module = cls.__module__
    name = cls.__qualname__
    if module not in ("builtins", "__main__"):
        name = f"{module}.{name}"
    return f"{name}: {e}".strip()


def import_torch() -> tuple[Any, str | None]:
    """torch, or None and why (the kit turns that into its refusal)."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure means "no usable torch"
        return None, f"{error_text(e)} ({INSTALL_HINT})"
    return torch, None


def probe() -> dict[str, Any]:
    """What the kit needs to know before it starts anything (no CUDA context made)."""
    out: dict[str, Any] = {"event": "probe", "python": sys.executable,
                           "python_version": sys.version.split()[0], "uid": os.getuid()}
    torch, err = import_torch()
    if torch is None:
        out.update(ok=False, torch=None, error=err)
        return out
    out.update(ok=True, torch=str(torch.__version__), cuda=torch.version.cuda)
    try:
        out["cuda_available"] = bool(torch.cuda.is_available())
        out["device_count"] = int(torch.cuda.device_count())
    except Exception as e:  # noqa: BLE001 - reported, the kit decides
        out.update(cuda_available=False, device_count=0, error=error_text(e))
    if not out.get("cuda_available") and "error" not in out:
        out["error"] = (
            "torch.cuda.is_available() is False"
            + ("" if torch.version.cuda else " (a CPU-only build of torch)")
        )
    return out


class Client:
    """One CUDA process under test; every answer is a dict for :func:`emit`."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        self.held: list[Any] = []
        self.held_mib = 0

    def ready(self) -> dict[str, Any]:
        """Device facts after creating the context (a 1-element tensor makes it)."""
        t = self.torch
        out: dict[str, Any] = {
            "event": "ready", "pid": os.getpid(), "uid": os.getuid(), "gid": os.getgid(),
            "torch": str(t.__version__), "cuda": t.version.cuda,
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "pinned_limit": os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"),
        }
        try:
            out["device_count"] = int(t.cuda.device_count())
            self.held.append(t.zeros(1, device="cuda"))
            props = t.cuda.get_device_properties(0)
            out["name"] = props.name
            out["total_mib"] = int(props.total_memory) // MIB
            uuid = getattr(props, "uuid", None)
            out["uuid"] = None if uuid is None else str(uuid)
            for key in ("pci_bus_id", "pci_device_id", "pci_domain_id"):
                if hasattr(props, key):
                    out[key] = getattr(props, key)
            out.update(self.figures())
            out["ok"] = True
        except Exception as e:  # noqa: BLE001 - the negative control expects this
            out.update(ok=False, error=error_text(e))
            out.setdefault("device_count", None)
        return out

    def figures(self) -> dict[str, Any]:
        c = self.torch.cuda
        return {"held_mib": self.held_mib, "allocated_mib": int(c.memory_allocated()) // MIB,
                "reserved_mib": int(c.memory_reserved()) // MIB}

    def _alloc(self, mib: int) -> None:
        t = self.torch
        self.held.append(t.empty(mib * MIB, dtype=t.uint8, device="cuda"))
        t.cuda.synchronize()
        self.held_mib += mib

    def _is_oom(self, e: BaseException) -> bool:
        oom = getattr(self.torch.cuda, "OutOfMemoryError", None)
        return (oom is not None and isinstance(e, oom)) or "out of memory" in str(e)

    def alloc(self, mib: int) -> dict[str, Any]:
        try:
            self._alloc(mib)
        except Exception as e:  # noqa: BLE001 - an OOM is an answer here
            return {"ok": False, "oom": self._is_oom(e), "error": error_text(e),
                    "asked_mib": mib, **self.figures()}
        return {"ok": True, "asked_mib": mib, **self.figures()}

    def fill(self, chunk: int, most: int) -> dict[str, Any]:
        start = self.held_mib
        while self.held_mib + chunk <= most:
            try:
                self._alloc(chunk)
            except Exception as e:  # noqa: BLE001 - the OOM is what fill looks for
                return {"ok": True, "oom": self._is_oom(e), "error": error_text(e),
                        "reached_mib": self.held_mib, "added_mib": self.held_mib - start,
                        **self.figures()}
        return {"ok": True, "oom": False, "reached_mib": self.held_mib,
                "added_mib": self.held_mib - start, **self.figures()}

    def free(self) -> dict[str, Any]:
        self.held = self.held[:1]  # keep the context's tensor
        self.held_mib = 0
        self.torch.cuda.synchronize()
        self.torch.cuda.empty_cache()
        return {"ok": True, **self.figures()}

    def bench(self, seconds: float, n: int, start_at: float | None) -> dict[str, Any]:
        """Matmuls for a fixed time; the kit compares iterations between set-ups."""
        t = self.torch
        a = t.randn(n, n, device="cuda", dtype=t.float16)
        b = t.randn(n, n, device="cuda", dtype=t.float16)
        for _ in range(3):
            a @ b
        t.cuda.synchronize()
        if start_at is not None:
            time.sleep(max(0.0, start_at - time.time()))
        t0 = time.time()
        iters = 0
        while True:
            for _ in range(10):
                a @ b
            t.cuda.synchronize()
            iters += 10
            if time.time() - t0 >= seconds:
                break
        t1 = time.time()
        del a, b
        elapsed = t1 - t0
        return {"ok": True, "n": n, "iters": iters, "t0": t0, "t1": t1, "seconds": elapsed,
                "iters_per_s": iters / elapsed,
                "tflops": 2 * n**3 * iters / elapsed / 1e12}

    def handle(self, line: str) -> tuple[dict[str, Any], bool]:
        """The answer to one command line, and whether to go on."""
        words = line.split()
        cmd, args = (words[0], words[1:]) if words else ("", [])
        try:
            if cmd == "alloc":
                out = self.alloc(int(args[0]))
            elif cmd == "fill":
                out = self.fill(int(args[0]), int(args[1]))
            elif cmd == "free":
                out = self.free()
            elif cmd == "report":
                out = {"ok": True, **self.figures()}
            elif cmd == "hold":
                out = {"ok": True, "held_mib": self.held_mib}
            elif cmd == "bench":
                start = float(args[2]) if len(args) > 2 else None
                out = self.bench(float(args[0]), int(args[1]), start)
            elif cmd == "exit":
                return {"event": "exit", "ok": True}, False
            else:
                out = {"ok": False, "error": f"unknown command {cmd!r}"}
        except Exception as e:  # noqa: BLE001 - every command gets an answer
            out = {"ok": False, "error": error_text(e),
                   "trace": traceback.format_exc(limit=3)[-2000:]}
        return {"event": cmd, **out}, True


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["probe"]:
        emit(probe())
        return 0
    torch, err = import_torch()
    if torch is None:
        emit({"event": "ready", "ok": False, "pid": os.getpid(), "uid": os.getuid(),
              "error": f"PyTorch is not importable: {err}"})
        return 3
    client = Client(torch)
    emit(client.ready())
    for line in sys.stdin:
        if not line.strip():
            continue
        answer, go_on = client.handle(line)
        emit(answer)
        if not go_on:
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
