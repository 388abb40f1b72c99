"""The prolog's (GPU, user) cap against a real MPS control daemon: runs and raw replies.

    PYTHONPATH=. python benchmarks/hw_mps_cap.py [--binary PATH] [--out FILE]

Why (issue 28): ``MpsDaemon.cap_user`` now sends the default and the server listing in
one run of ``nvidia-cuda-mps-control`` and every running server's limit with all the
read-backs in a second, pairing replies line by line only when there is exactly one
per getter (otherwise it falls back to one read-back per run). The stand-in answers
one line per getter; this checks what NVIDIA's daemon prints. As root on a drained GPU
node: starts a daemon of its own (temporary pipe directory), raises the cap with no
server, starts a PyTorch client (so a server runs), raises it again, and prints every
control-program run (its stdin lines and its raw reply) and how many runs each cap took.
``--binary`` a stand-in (``colloc-sim-mps-control``) runs it without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from slurm_colloc.mps.control import MpsDaemon
from slurm_colloc.mps.tenancy import Tenancy

CLIENT = """
import sys, time, torch
x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
print("ok", flush=True)
time.sleep(float(sys.argv[1]))
"""


class Recorder(MpsDaemon):
    """An MpsDaemon that keeps every run's stdin and reply."""

    def command(self, *lines: str, timeout: float = 10) -> str:
        out = super().command(*lines, timeout=timeout)
        self.__dict__.setdefault("_runs", []).append({"stdin": list(lines), "reply": out})
        return out


def _uuid() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.split()[0] if out.split() else None


def _cap(d: Recorder, mib: int) -> dict[str, Any]:
    before = len(d.__dict__.get("_runs", []))
    t0 = time.monotonic()
    err = None
    try:
        d.cap_user(mib)
    except Exception as e:  # noqa: BLE001 - reported, not raised: this is a probe
        err = f"{type(e).__name__}: {e}"
    runs = d.__dict__.get("_runs", [])[before:]
    return {"cap_mib": mib, "runs": len(runs), "seconds": round(time.monotonic() - t0, 3),
            "error": err, "sessions": runs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--binary", default=shutil.which("nvidia-cuda-mps-control") or "")
    ap.add_argument("--python", default=sys.executable, help="the client's interpreter")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="colloc-mps-cap-"))
    t = Tenancy(root / "mps")
    uid = os.getuid()
    pipe, logdir = t.prepare_user_dirs(0, uid)
    sim = "sim" in Path(a.binary).name
    d = Recorder(a.binary, 0, pipe, logdir, t.daemon_state(0, uid),
                 device=None if sim else _uuid())
    result: dict[str, Any] = {"binary": a.binary, "device": d.device}
    d.start()
    client = None
    try:
        result["no_server"] = _cap(d, 2048)
        env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
               "CUDA_MPS_LOG_DIRECTORY": str(logdir)}
        if not sim:
            client = subprocess.Popen([a.python, "-c", CLIENT, "30"], env=env,
                                      stdout=subprocess.PIPE, text=True)
            assert client.stdout is not None
            result["client"] = client.stdout.readline().strip()
        result["servers"] = d.server_pids()
        result["with_server"] = _cap(d, 4096)
        if result["servers"]:
            pid = result["servers"][0]
            result["raw_get_server_limit"] = d.command(f"get_device_pinned_mem_limit {pid} 0")
        result["raw_get_default"] = d.command("get_default_device_pinned_mem_limit 0")
    finally:
        if client is not None:
            client.kill()
            client.wait(30)
        d.stop()
        shutil.rmtree(root, ignore_errors=True)
    text = json.dumps(result, indent=1)
    print(text)
    for k in ("no_server", "with_server"):
        r = result[k]
        print(f"{k}: {r['runs']} runs, {r['seconds']} s, error: {r['error']}")
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0 if not (result["no_server"]["error"] or result["with_server"]["error"]) else 1


if __name__ == "__main__":
    sys.exit(main())
