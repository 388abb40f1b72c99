"""The bodies of the node executables in prolog/ and epilog/ (kept here to be testable).

Each ``*_main`` loads the configuration, builds the context, calls the library and
logs the decision with the job id. Errors are logged and swallowed: the return value
is always 0 because a non-zero Prolog/Epilog drains the node.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

from slurm_colloc import config as cfgmod
from slurm_colloc.node import job as jobmod
from slurm_colloc.node.logging_setup import node_logger
from slurm_colloc.slurm.adapter import SlurmCli

FAULT_KEY = "test_fault_inject"
"""``[extra] test_fault_inject = "prolog,epilog"`` in colloc.conf makes the named
scripts raise an internal error: used by the tests that prove a node never drains."""


class InjectedFault(RuntimeError):
    """Raised on purpose (see FAULT_KEY)."""


def _setup(component: str, env: Mapping[str, str]):  # type: ignore[no-untyped-def]
    job_id = env.get("SLURM_JOB_ID", "?")
    try:
        cfg = cfgmod.load()
    except cfgmod.ConfigError as e:
        log = node_logger(component, job_id, None)
        log.error("broken configuration, doing nothing: %s", e)
        return None, log
    log = node_logger(component, job_id, cfg.log_file)
    if component in cfg.extra.get(FAULT_KEY, "").split(","):
        raise InjectedFault(f"{component}: injected fault ({FAULT_KEY})")
    return cfg, log


def _slurm(env: Mapping[str, str]) -> SlurmCli:
    from slurm_colloc.node.prolog import main_env

    return SlurmCli(env=main_env(env), timeout=20)


def _run_root_script(
    component: str, env: Mapping[str, str], body: Callable[..., str], on_error: str
) -> int:
    """Shared frame of Prolog and Epilog: config, context, body, log; never raise.

    ``body(ctx, cfg, adapter, log)`` returns the line to log. Any error is logged with
    ``on_error`` (what the safe path means for the job) and the exit status stays 0.
    """
    log = node_logger(component, env.get("SLURM_JOB_ID", "?"), None)
    try:
        cfg, log = _setup(component, env)
        if cfg is None:
            return 0
        adapter = _slurm(env)
        ctx = jobmod.from_slurm(env, adapter)
        log.info("%s", body(ctx, cfg, adapter, log))
    except Exception as e:  # noqa: BLE001 - policy: log, take the safe path, never drain
        log.error("internal error, %s: %s: %s", on_error, type(e).__name__, e)
    return 0


def prolog_main(env: Mapping[str, str]) -> int:
    """Prolog: see :mod:`slurm_colloc.node.prolog`."""
    from slurm_colloc.node import prolog

    def body(ctx: jobmod.JobContext, cfg: cfgmod.CollocConfig, adapter: SlurmCli,
             log: object) -> str:
        d = prolog.run(ctx, cfg, adapter)
        return f"{d.mode} gpu={d.gpu} limit_mib={d.limit_mib} {d.detail}"

    return _run_root_script("prolog", env, body, "job runs without MPS")


def task_prolog_main(env: Mapping[str, str]) -> int:
    """TaskProlog: print the export lines the prolog prepared."""
    from slurm_colloc.node.task_prolog import export_lines

    try:
        cfg = cfgmod.load()
        if "task_prolog" in cfg.extra.get(FAULT_KEY, "").split(","):
            raise InjectedFault("task_prolog: injected fault")
        lines = export_lines(cfg.mps_root, int(env["SLURM_JOB_ID"]))
        sys.stdout.write("".join(f"{ln}\n" for ln in lines))
    except Exception as e:  # noqa: BLE001 - a TaskProlog error must not fail the task
        sys.stdout.write(f"print colloc: task prolog: internal error, no MPS settings: {e}\n")
    return 0


def epilog_main(env: Mapping[str, str]) -> int:
    """Epilog: see :mod:`slurm_colloc.node.epilog`."""
    from slurm_colloc.node import epilog

    def body(ctx: jobmod.JobContext, cfg: cfgmod.CollocConfig, adapter: SlurmCli,
             log: Any) -> str:
        return epilog.run(ctx, cfg, adapter, log).summary()

    return _run_root_script("epilog", env, body, "nothing requeued")
