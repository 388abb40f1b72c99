"""Which MPS a node runs for colloc: legacy per-(GPU, user) daemons or one MPS v3 daemon.

``mps_protocol`` in colloc.conf decides: ``2``, ``3``, or ``auto`` (v3 where the control
program offers it: :func:`slurm_colloc.mps.v3.detect`). Detection runs the program, so
``auto`` keeps its answer in root-owned state (``mps_root/protocol.json``, 0600) for
the boot and the binary it was made for (path, size, mtime): a driver upgrade changes
the binary and is detected again. One node never mixes the two for running jobs: a
job's env file records the protocol its prolog used (``COLLOC_MPS_PROTOCOL``), and the
epilog releases by what is recorded, not by what the config says now.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

from slurm_colloc.config import CollocConfig
from slurm_colloc.mps.control import read_small_file
from slurm_colloc.mps.tenancy import ensure_root_dir
from slurm_colloc.mps.v3 import V3_DIR, MpsV3Node, detect
from slurm_colloc.node.gpus import boot_id

CACHE_FILE = "protocol.json"


def _binary_key(binary: str) -> str:
    path = shutil.which(binary) or binary
    try:
        st = os.stat(path)
    except OSError:
        return f"{path}:missing"
    return f"{os.path.realpath(path)}:{st.st_size}:{int(st.st_mtime)}"


def node_protocol(cfg: CollocConfig) -> int:
    """2 or 3: what this node's prolog uses for a new shard job."""
    if cfg.mps_protocol != "auto":
        return int(cfg.mps_protocol)
    root = Path(cfg.mps_root)
    path = root / CACHE_FILE
    key = f"{boot_id()}|{_binary_key(cfg.mps_control)}"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        data = json.loads(read_small_file(path, owner=os.geteuid(), limit=4096))
        if data["key"] == key and data["protocol"] in (2, 3):
            return int(data["protocol"])
    cap = detect(cfg.mps_control)
    protocol = 3 if cap.protocol == 3 and cap.multiuser else 2
    with contextlib.suppress(OSError):
        ensure_root_dir(root)
        tmp = path.with_name(f"{CACHE_FILE}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"key": key, "protocol": protocol, "detail": cap.detail}))
        os.replace(tmp, path)
    return protocol


def v3_node(cfg: CollocConfig) -> MpsV3Node:
    """Handle on the node's MPS v3 daemon (its directories under ``mps_root/v3``)."""
    base = ensure_root_dir(Path(cfg.mps_root) / V3_DIR)
    extra = {"COLLOC_SIM_STATE": cfg.sim_state_dir} if cfg.gpu_backend == "sim" else None
    return MpsV3Node(cfg.mps_control, base / "pipe", base / "log", base / "state",
                     extra_env=extra)
