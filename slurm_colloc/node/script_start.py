"""Start the node's script server (:mod:`slurm_colloc.node.script_server`) for later scripts.

A Prolog or Epilog that found no server runs itself and, on the way, starts one
detached for the scripts after it, handing over the server's lock so that those wait
for it instead of starting their own (:mod:`slurm_colloc.node.script_client`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path

from slurm_colloc import root_lock
from slurm_colloc.config import CollocConfig
from slurm_colloc.detach import spawn_module
from slurm_colloc.node import script_client as client

MODULE = "slurm_colloc.node.script_server"
SERVER_ENV = ("SLURM_CONF", "COLLOC_CONF", "SLURMD_NODENAME")
"""What the server keeps of the environment of the script that starts it."""

log = logging.getLogger("colloc.node.script-server")


def ensure_run_dir(run_dir: Path) -> None:
    """Root's 0700 directory for the sockets; refuses one that is not root's own."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(run_dir, 0o700)
    if not client.private_dir(run_dir):
        raise OSError(f"{run_dir} is not a 0700 directory of uid {os.geteuid()}")


def server_env(env: Mapping[str, str]) -> dict[str, str]:
    """The detached server's environment: a fixed PATH and what names its config and
    node, never a job's variables (a process with one job's ``SLURM_JOB_ID`` would
    pass for that job's)."""
    out = {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"}
    out.update({k: env[k] for k in SERVER_ENV if k in env})
    return out


def start(env: Mapping[str, str], cfg: CollocConfig, run_dir: Path | None = None) -> bool:
    """From a script that found no server: start one detached, unless it is off in
    colloc.conf, the script was not run by slurmd (no ``SLURMD_NODENAME`` or
    ``SLURM_JOB_ID``), or another process holds its lock (one starting). The lock taken here
    is handed to the server, so the scripts after this one wait for it instead of
    starting their own. Never raises; True when one was started."""
    if cfg.script_server_idle_s <= 0:
        return False
    if not env.get("SLURMD_NODENAME") or not env.get("SLURM_JOB_ID"):
        return False  # not run by slurmd (by hand, a test): no node to serve
    run_dir = client.RUN_DIR if run_dir is None else run_dir
    try:
        ensure_run_dir(run_dir)
        fd = root_lock.try_lock(client.lock_path(env, run_dir))
        if fd is None:
            return False
        try:
            spawn_module(MODULE, ("--run-dir", str(run_dir)), server_env(env), pass_fd=fd)
        finally:
            os.close(fd)
        return True
    except OSError as e:
        log.warning("script server not started: %s", e)
        return False
