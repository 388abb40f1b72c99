"""The bodies of the node executables in prolog/ and epilog/ (kept here to be testable).

Each ``*_main`` loads the configuration, builds the context, calls the library and
logs the decision with the job id. Errors are logged and swallowed: the return value
is always 0 because a non-zero Prolog/Epilog drains the node.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from slurm_colloc import config as cfgmod
from slurm_colloc.node import job as jobmod
from slurm_colloc.node.logging_setup import node_logger
from slurm_colloc.node.task_entry import FAULT_KEY, InjectedFault
from slurm_colloc.node.timing import Stopwatch
from slurm_colloc.slurm.adapter import SlurmCli


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


def _slurm(env: Mapping[str, str], timeout: float = 20) -> SlurmCli:
    from slurm_colloc.node.prolog import main_env

    return SlurmCli(env=main_env(env), timeout=timeout)


PROLOG_WITHOUT = "job runs without MPS, a memory limit, metrics or enforcement"
"""What a job whose prolog could not ask slurmctld goes without (the log says so)."""


def prolog_jobs(env: Mapping[str, str], cfg: cfgmod.CollocConfig,
                budget: Any = None) -> dict[int, Any]:
    """The controller's records of the jobs the prolog judges (:func:`judged_jobs`),
    within the prolog's one budget (``prolog_controller_s``, every try together).
    Raises ``controller_wait.Unanswered`` when it is spent: that is never "no jobs"
    (issue 28 item 3). A job missing from the answer is one the controller no longer
    holds."""
    from slurm_colloc.node import controller_wait

    budget = budget or controller_wait.Budget(cfg.prolog_controller_s)
    ids = judged_jobs(env, cfg)
    return controller_wait.ask(lambda t: _slurm(env, t).jobs_among(ids), budget)


def judged_jobs(env: Mapping[str, str], cfg: cfgmod.CollocConfig) -> list[int]:
    """The prolog's own job and the jobs registered on its GPUs (root's markers):
    the only records it reads (issue 28: under a burst, tens of prologs each parsing
    the whole queue cost the node's CPUs). Every GPU's when SLURM_JOB_GPUS is not an
    index list (the context then refuses the job anyway)."""
    from pathlib import Path

    from slurm_colloc.mps.tenancy import Tenancy
    from slurm_colloc.slurm.squeue_json import parse_indices

    job_id, _ = jobmod.ids_from_env(env)
    try:
        gpus: set[int] | None = set(parse_indices(env.get("SLURM_JOB_GPUS", "")))
    except ValueError:
        gpus = None
    out = {job_id}
    for job, where in Tenancy(Path(cfg.mps_root)).all_jobs().items():
        if gpus is None or any(g in gpus for g, _ in where):
            out.add(job)
    return sorted(out)


def _run_root_script(
    component: str, env: Mapping[str, str], body: Callable[..., str | None], on_error: str,
    watch: Stopwatch | None = None, start_server: bool = False,
) -> int:
    """Shared frame of Prolog and Epilog: config, body, log; never raise.

    ``body(cfg, adapter, log)`` returns the line to log. Any error is logged with
    ``on_error`` (what the safe path means for the job) and the exit status stays 0.
    ``watch``: started at the script's process start (default: now).
    ``start_server``: no script server runs for this node; start one for the scripts
    after this one (:func:`slurm_colloc.node.script_start.start`).
    """
    watch = watch or Stopwatch()
    log = node_logger(component, env.get("SLURM_JOB_ID", "?"), None)
    try:
        cfg, log = _setup(component, env)
        if cfg is None:
            return 0
        if start_server:
            from slurm_colloc.node import script_start

            script_start.start(env, cfg)
        line = body(cfg, _slurm(env), log)
        if line:  # None: the body logged its own line
            log.info("%s %s", line, watch.suffix())
    except Exception as e:  # noqa: BLE001 - policy: log, take the safe path, never drain
        log.error("internal error, %s: %s: %s %s", on_error, type(e).__name__, e,
                  watch.suffix())
    return 0


def prolog_main(env: Mapping[str, str], watch: Stopwatch | None = None,
                start_server: bool = False) -> int:
    """Prolog: see :mod:`slurm_colloc.node.prolog`.

    One controller call: the ``squeue --json`` snapshot gives the job's own record
    and, for reaping, which registered jobs are still alive. It is taken before any
    GPU lock, so a slow controller never holds up other jobs' prologs and epilogs.
    """
    from slurm_colloc.node import controller_wait, prolog

    def body(cfg: cfgmod.CollocConfig, adapter: SlurmCli, log: Any) -> str | None:
        if not env.get("SLURM_JOB_GPUS"):  # slurmd bound no GPU: nothing to ask Slurm
            return prolog.no_gpu(jobmod.bare_context(env), cfg)
        taken = time.time()
        try:
            jobs = prolog_jobs(env, cfg)
        except controller_wait.Unanswered as e:  # stated and bounded (issue 28 item 3)
            log.error("%s: %s; no other job's MPS state touched", PROLOG_WITHOUT, e)
            return None
        ctx = jobmod.from_slurm(env, adapter, jobs)
        d = prolog.run(ctx, cfg, adapter, jobs, taken)
        return f"{d.mode} gpu={d.gpu} limit_mib={d.limit_mib} {d.detail}"

    return _run_root_script("prolog", env, body, "job runs without MPS", watch, start_server)


def epilog_context(
    env: Mapping[str, str], cfg: cfgmod.CollocConfig, adapter: SlurmCli
) -> jobmod.JobContext:
    """The context the prolog saved (root state); the controller only when there is none."""
    from pathlib import Path

    from slurm_colloc.mps.tenancy import Tenancy

    job_id, _ = jobmod.ids_from_env(env)
    tenancy = Tenancy(Path(cfg.mps_root))
    saved = tenancy.read_job_context(job_id)
    tenancy.forget_job_context(job_id)
    if saved is not None:
        return jobmod.context_from_json(saved, env)
    return jobmod.from_slurm(env, adapter)


def epilog_main(env: Mapping[str, str], watch: Stopwatch | None = None,
                start_server: bool = False) -> int:
    """Epilog: see :mod:`slurm_colloc.node.epilog`. It holds the job's lock against a
    late epilog of the same job (:mod:`slurm_colloc.node.epilog_once`, issue 28)."""
    from slurm_colloc.node import epilog, epilog_once

    def body(cfg: cfgmod.CollocConfig, adapter: SlurmCli, log: Any) -> str:
        job_id, _ = jobmod.ids_from_env(env)
        with epilog_once.slurmd_epilog(cfg, job_id) as not_here:
            if not_here is not None:
                return not_here
            released = epilog.release_first(job_id, cfg)  # before any controller call
            ctx = epilog_context(env, cfg, adapter)
            return epilog.run(ctx, cfg, adapter, log, released).summary()

    return _run_root_script("epilog", env, body, "nothing requeued", watch, start_server)
