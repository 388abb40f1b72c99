"""The one typed configuration object of slurm-colloc.

Every component (prolog, epilog, sidecar, CLI, devcluster) reads its settings from
one TOML file, ``/etc/slurm/colloc.conf`` or the file named by ``$COLLOC_CONF``.
Defaults live here and only here; ``docs/configuration.md`` is generated from the
field docstrings (``colloc config --defaults --markdown``; a unit test keeps the
checked-in file equal to what it prints). Keys colloc no longer reads
(:data:`DEPRECATED`) still load, with a :class:`ConfigWarning`. Unknown keys and wrong types are
rejected with a message naming the key, because a misspelt key that silently falls
back to a default is how a site ends up running something it did not ask for.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import string
import tomllib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_type_hints

from slurm_colloc.hostlist import MAX_HOSTS, HostlistError, expand

DEFAULT_PATH = Path("/etc/slurm/colloc.conf")
MAX_RECOVERY_NICE = 1_000_000
MAX_SM_CAPACITY_PCT = 400
ENV_VAR = "COLLOC_CONF"
_UNIT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9:_.@-]{0,239}\.service")
"""A systemd service name ``collector_unit`` may hold (no path, no option, no space)."""

GpuBackendName = Literal["nvml", "sim"]
HistorySource = Literal["accounting", "sqlite"]
StepUpPolicy = Literal["whole-gpu", "step"]
EnforceAction = Literal["kill", "flag", "off"]
MpsProtocol = Literal["2", "3", "auto"]
RecordField = Literal["admin_comment", "system_comment"]


class ConfigError(ValueError):
    """A configuration file that cannot be used as written."""


class ConfigWarning(UserWarning):
    """A configuration file that loads, but sets something colloc no longer reads."""


DEPRECATED: dict[str, str] = {
    "multi_user_policy": "it was never read: jobs of different users share a GPU as "
                         "mps_protocol says (docs/node.md); remove the line",
}
"""Keys colloc no longer knows: a file that sets one still loads, with a warning."""


OVERRIDABLE = ("cuda_context_mib", "mps_server_mib", "gpu_reserved_mib", "gpu_memory_mib")
"""Keys a ``[gpu_types."MODEL"]`` or ``[nodes."HOSTLIST"]`` table may set (``gpu_memory_mib``
in node tables only: a GPU model's memory is what the backend reports)."""


@dataclass(frozen=True)
class GpuOverride:
    """The GPU overhead keys one ``gpu_types`` or ``nodes`` table sets; None: not set
    there (the next table in precedence, or the global key, decides)."""

    cuda_context_mib: int | None = None
    mps_server_mib: int | None = None
    gpu_reserved_mib: int | None = None
    gpu_memory_mib: int | None = None

    def values(self) -> dict[str, int]:
        """The keys this table sets, with their values."""
        return {k: v for k in OVERRIDABLE if (v := getattr(self, k)) is not None}


@dataclass(frozen=True)
class CollocConfig:
    """Site configuration. Field comments are the documentation of each key."""

    # --- GPU access -------------------------------------------------------------
    gpu_backend: GpuBackendName = "nvml"
    """Where GPU state comes from. ``nvml`` on real nodes; ``sim`` only for the
    devcluster, tests and demos. There is no fallback from one to the other."""
    sim_state_dir: str = "/var/lib/colloc/sim"
    """State directory of the simulated GPUs (``gpu_backend = "sim"`` only)."""

    # --- Shards: the memory currency ----------------------------------------------
    shard_mib: int = 1024
    """GPU memory one gres/shard stands for. Per-GPU shard count = memory // shard."""
    default_colloc_mib: int = 0
    """Memory given to a ``--colloc`` job that arrives without an estimate.
    0 means a whole GPU's worth of shards (the safe choice)."""
    shared_partitions: tuple[str, ...] = ()
    """Partitions whose GPUs are shared (their nodes' gres.conf offers shards): entries
    ``NAME`` or ``NAME:GPU_MIB`` (GPU_MIB: memory of that partition's smallest GPU;
    default ``gpu_memory_mib``). Empty (the default): colloc is opt-in per job; only
    ``--colloc`` and ``--gres=shard`` jobs are touched and every other GPU job is left
    as submitted. Listed: ``--colloc`` jobs without a partition go to every listed one
    whose GPU holds them (Slurm takes the first with room), a
    ``--colloc`` job in another partition is refused, and a one-GPU job submitted to a
    listed partition becomes all the shards of one GPU (Slurm 22.05 does not keep
    gres/gpu and gres/shard apart on a GPU); other partitions are never touched."""
    gpu_memory_mib: int = 0
    """Memory of one GPU of the colloc partitions (the smallest, if they differ).
    job_submit.lua sizes the whole-GPU default from it and refuses larger needs.
    0: ``colloc admin install`` asks the GPU backend (NVML or sim) at install time."""

    cuda_context_mib: int = 512
    """Device memory of one CUDA context (one client process), which MPS's pinned limit
    does not count. A job's pinned limit is its shards' memory minus this, so that
    what NVML shows for the job (allocations + context) stays within its shards.
    Measure it on your GPUs with ``colloc selftest --gpu`` (docs/node.md)."""
    mps_server_mib: int = 64
    """Device memory one MPS server holds outside every client's limit."""
    mps_servers_per_gpu: int = 2
    """The most MPS servers that share one GPU, budgeted when sizing shards (legacy MPS
    runs one per user on the GPU; MPS v3 one for all users). 0: no bound, one server
    per shard job (the worst case of legacy MPS; docs/node.md, the budget rule)."""
    gpu_reserved_mib: int = 0
    """Memory the driver keeps on each GPU. 0: what the backend reports (NVML's
    ``nvmlDeviceGetMemoryInfo_v2`` reserved, the sim's spec); set it to override."""
    gpu_types: dict[str, GpuOverride] = field(default_factory=dict)
    """Per GPU model overrides of ``cuda_context_mib``, ``mps_server_mib`` and
    ``gpu_reserved_mib``, one table per model, named as the GPU backend reports it
    (NVML's ``nvmlDeviceGetName``, ``nvidia-smi --query-gpu=name``; the sim's spec
    name), compared without regard to case or repeated spaces::

        [gpu_types."NVIDIA H100 80GB HBM3"]
        cuda_context_mib = 608
        gpu_reserved_mib = 480

    A site with mixed GPUs measures each model with ``colloc selftest --gpu`` and puts
    its figures here. Precedence, per key: the node's table (``nodes``) over the GPU
    model's table over the global key. Applied on the node (prolog pinned limits,
    ``colloc admin gres-conf`` shard counts, epilog, doctor, selftest);
    job_submit.lua runs in slurmctld before a node is chosen and sizes with the
    global keys, so set those for the most demanding model (docs/admin.md)."""
    nodes: dict[str, GpuOverride] = field(default_factory=dict)
    """Per node overrides of ``cuda_context_mib``, ``mps_server_mib``,
    ``gpu_reserved_mib`` and ``gpu_memory_mib``, one table per Slurm hostlist
    (``gpu[01-04,07]``, as in slurm.conf), matched against the node's name
    (``SLURMD_NODENAME``, else the short host name)::

        [nodes."gpu[01-04]"]
        cuda_context_mib = 640

    A node named by two tables is refused (which one wins would be a guess). A node
    table wins over its GPUs' ``gpu_types`` table, which wins over the global key."""

    # --- Compute admission: SM activity as a second dimension of shards --------------
    sm_capacity_pct: int = 0
    """Summed SM activity (DCGM SMACT, %) one GPU's jobs may be expected to have.
    job_submit.lua gives a ``--colloc`` job at least ``ceil(sm / sm_capacity_pct *
    shards_per_gpu)`` shards, ``sm`` being its expected SM activity (below), so Slurm
    never puts more expected compute on a GPU than this, with shards the one currency
    (docs/admin.md, section 14). 0 (the default): memory alone sizes shards. At most
    400. What it costs, measured on the replay (docs/benchmarks.md): co-located jobs ran
    at 1.04-1.08x their solo time instead of 1.18-1.37x, but heavy jobs waited for
    nearly free GPUs, and makespan and mean JCT grew (0.80x -> 0.84x of whole GPUs
    under MPS v3 at 108; 0.82x -> 0.89x under legacy MPS at 100). Turn it on where
    predictable job times matter more than throughput (tight time limits)."""
    sm_prior_pct: int = 0
    """Expected SM activity (%) of a job whose user has no measured run of the same
    model in ``compute_history_file``. 0: such a job is sized by memory alone."""
    compute_history_file: str = "/var/lib/colloc/compute-history"
    """Root-owned table of expected SM activity per (uid, model fingerprint), written by
    ``colloc admin compute-history --write`` (a root timer) from the accounting records
    the epilog leaves, read by job_submit.lua inside slurmctld (reloaded every minute).
    Missing or unreadable: every job gets ``sm_prior_pct``."""

    # --- Estimation ----------------------------------------------------------------
    estimator: str = "layer-aware"
    """Estimator used by ``sbatch --colloc`` when the user names none."""
    estimator_command: str = ""
    """Absolute path of the ``colloc`` command cli_filter.lua runs (as the user, on
    login nodes) to estimate. Empty: the ``colloc`` next to the Python that ran
    ``colloc admin install``. Written into cli_filter.lua at install time."""
    estimate_timeout_s: float = 30.0
    """cli_filter.lua gives the estimator this long before failing the sbatch."""
    history_db: str = "/var/lib/colloc/history.sqlite"
    """Node-local measured peaks per model fingerprint (sqlite, written by the epilog).
    Read at submit time only with ``history_source = "sqlite"``."""
    history_source: HistorySource = "accounting"
    """Where ``colloc estimate`` (the cli_filter, on the login host) finds the user's
    measured peaks: ``accounting`` asks slurmdbd (``sacct``) for the user's own finished
    jobs, whose records carry the peak and its key, so every host sees the same history
    and no node-local file has to be shared; ``sqlite`` reads ``history_db`` (a one-node
    site, or tests)."""
    history_days: int = 90
    """How far back (days) the accounting history looks for the user's earlier runs."""

    # --- MPS on the node ------------------------------------------------------------
    mps_control: str = "nvidia-cuda-mps-control"
    """Path or name of the MPS control binary (the sim backend uses its stand-in)."""
    mps_root: str = "/run/colloc/mps"
    """Per-GPU pipe and log directories are created under here (0700, root)."""
    active_thread_percentage: int = 0
    """MPS active thread percentage per client; 0 leaves SM sharing dynamic."""
    mps_protocol: MpsProtocol = "2"
    """``2``: legacy MPS, one control daemon per (GPU, user) (jobs of different users on
    a GPU are separate servers, time-sliced). ``3``: MPS v3 (driver r615+), one root
    multi-user daemon per node, a server per GPU, a namespace per job (docs/mps-v3.md).
    ``auto``: 3 where ``mps_control -p 3 -h`` offers it, else 2. The default stays 2
    until ``colloc selftest --gpu`` has passed on the site's r615 nodes: v3 support is
    written against NVIDIA's documentation only."""
    chain_task_prolog: str = ""
    """The site's own TaskProlog, run by colloc's (slurm.conf takes one TaskProlog):
    absolute path of a root-owned executable no one else may write. It runs first, as
    the job's user; its ``export``/``unset``/``print`` lines reach Slurm before colloc's
    and its non-zero exit status fails the task as it would alone. Empty: none."""

    # --- OOM recovery ------------------------------------------------------------------
    requeue_on_oom: bool = True
    """Requeue a collocated job that died of GPU OOM onto a GPU of its own."""
    step_up_policy: StepUpPolicy = "whole-gpu"
    """``whole-gpu``: straight to all shards of one GPU. ``step``: first estimate +
    max(5 GiB, 50%), then a whole GPU."""
    max_requeues: int = 2
    """Cap on OOM requeues per job."""
    recovery_nice: int = 10000
    """Priority boost of a job requeued after a GPU OOM: it goes back with
    ``Nice=-N`` (only root may lower a nice value, so the epilog can and a user cannot),
    ahead of every job without a boost, so recovery costs the job's own run time and
    not the queue's (the thesis's recovery queue, done with Slurm's priority). 0 leaves
    its priority alone. Slurm keeps a GPU free for the boosted job only if backfill can
    plan, which needs time limits on jobs (a partition ``DefaultTime``); without them
    the boost still puts it first whenever a GPU is wholly free. At most 1,000,000."""
    requeue_retry_s: int = 3600
    """How long a decided requeue is retried while slurmctld does not answer (a
    detached helper, pauses doubling to 30 s, counted from the decision). Once
    slurmctld answers the retry ends either way (a job it no longer knows, past
    ``MinJobAge``, is refused); this caps the wait for one that stays away. The record
    says "requeued" only when Slurm accepted the requeue."""
    prolog_controller_s: float = 15.0
    """The prolog's whole budget for asking slurmctld about the job (every try
    together; "did not answer" is retried within it). When it is spent the job runs
    without MPS, a memory limit, metrics or enforcement, and the log says so in one
    line; no other job's MPS registration is touched. Keep it well under
    ``PrologEpilogTimeout``."""
    checkpoint_dir: str = ""
    """Per-job checkpoint directory the TaskProlog makes (as the job's user, mode 0700)
    and exports as ``COLLOC_CHECKPOINT_DIR``, with ``COLLOC_RESTART_COUNT``: a requeued
    job (after a GPU OOM or a node failure) keeps its job id, so it finds the same
    directory and resumes from its last checkpoint instead of from zero (the templates
    in sbatch_templates/ do), and the report tells how much work an OOM cost. A template
    with ``{jobid}`` and optionally ``{home}``, ``{user}``, ``{uid}``, absolute or
    starting with ``{home}``, e.g. ``"{home}/.colloc/checkpoints/{jobid}"`` or
    ``"/scratch/{user}/colloc-ckpt/{jobid}"`` (each directory on the way must be root's or
    the user's, writable by no one else unless sticky). colloc never deletes it. Empty:
    off (nothing made, nothing exported)."""
    log_scan_tail_mib: int = 64
    """How much of the end of each job log the epilog reads when looking for OOM."""
    evidence_dir: str = "/var/lib/colloc/evidence"
    """Where the epilog keeps copies of failed attempts' logs (root's node-local copy)."""
    evidence_user_copy: bool = True
    """Also keep the evidence next to the job's output file, written as the job's user
    (so the user can read it from the login host); never written as root there."""

    # --- Metrics and accounting ---------------------------------------------------------
    sample_interval_s: float = 1.0
    """Sidecar sampling interval."""
    metrics_dir: str = "/var/lib/colloc/metrics"
    """Node-local per-job time series."""
    metrics_retention_days: int = 14
    """Per-job time series older than this are deleted."""
    admin_comment_max_bytes: int = 4096
    """Size cap of the encoded record written to AdminComment (or ``record_field``)."""
    record_field: RecordField = "admin_comment"
    """The job field the epilog keeps colloc's per-attempt ``cl1:`` record in:
    ``admin_comment`` (AdminComment) or ``system_comment`` (SystemComment). Sites that
    run Princeton jobstats set ``system_comment``: jobstats' slurmctld epilog replaces
    the whole AdminComment with its ``JS1:`` summary, which would erase colloc's record
    (and colloc's would sit beside jobstats' text). Like AdminComment, SystemComment is
    out of users' reach (``sacctmgr`` refuses them; users may set Comment that way, so
    Comment is no place for data the estimator's history trusts); Slurm itself only
    appends burst-buffer errors to it; ``sacctmgr modify job`` sets it after the end,
    case kept (24.11, 26.05; docs/admin.md, "jobstats sites").
    ``scontrol`` cannot set it, so between the attempts of a requeued job the record
    still travels in the live job's AdminComment. Readers look in this field first and
    then in the other one, so records written before a switch still read. job_submit's
    ``colloc1:`` decision stays in AdminComment either way."""
    series_points: int = 48
    """Points of each attempt's downsampled memory/SM series kept in the accounting
    record, so ``colloc-report`` can plot it from any host (0: none)."""
    metrics_max_rows: int = 10000
    """Cap on rows of one attempt's time series; past it, rows are merged pairwise
    (peaks kept) and the sampling stride doubles, so a long job stays bounded."""
    collector_idle_exit_s: float = 600.0
    """The node collector exits after this long without any GPU job on the node
    (the next prolog starts it again). It stays while root's spool holds records
    accounting has not confirmed (at most a week old) or a job's epilog is owed, so
    they are replayed once slurmdbd or slurmctld is back (issue 28)."""
    stuck_prolog_grace_s: float = 120.0
    """How long after this node's slurmd (re)started a job may still wait for a prolog
    that began before that start. slurmd killed while a Prolog runs never finishes it
    once restarted, and Slurm keeps the job RUNNING with ``Reason=Prolog`` for good;
    past this grace the collector's check requeues it (``stuck-prolog:`` log lines,
    issue 28). 10..3600 seconds."""
    script_server_idle_s: int = 3600
    """The node's script server (a root process holding colloc's code, which forks a
    worker per Prolog/Epilog instead of each paying an interpreter and its imports,
    ~0.25 s of CPU: issue 28, prolog p99 under a burst) exits after this long without
    a request; the next script runs itself and starts it again. 0: no server, every
    script runs in its own process as before. 0..604800 seconds."""
    collector_unit: str = ""
    """Name of the systemd unit that runs the node collector (``colloc admin
    collector-unit --install`` writes ``colloc-collector.service``), or empty: no unit.
    When set, a prolog that finds no collector running asks systemd to start it
    (``systemctl start --no-block``): systemd then restarts it when it dies and it does
    not exit when idle. Where there is no systemd, or ``systemctl`` fails, the prolog
    starts the collector detached itself (as with an empty value) and logs why."""
    prometheus_textfile: str = ""
    """Where the node collector writes its per-job GPU metrics in Prometheus's text
    format after every sample (``.prom`` file in the directory of node_exporter's
    ``--collector.textfile.directory``), atomically, 0644, in a root-owned directory
    no one else may write. Empty (the default): no export. Names and labels:
    docs/admin.md, "Prometheus and Grafana"."""

    # --- Memory cap enforcement by the collector (see docs/node.md) ------------------------
    enforce_over_limit: EnforceAction = "kill"
    """What the node collector (root) does to a shard job whose GPU memory on a GPU
    exceeds its allocation (shards x shard_mib) by more than ``enforce_tolerance_mib``
    for ``enforce_samples`` samples in a row: ``kill`` (SIGKILL its GPU processes,
    identity checked), ``flag`` (only record a verdict), ``off``. A verdict is recorded
    under ``metrics_dir/verdicts`` unless ``off``; the epilog uses it to blame an OOM
    on the co-tenant at fault instead of the victims."""
    enforce_outside_mps: EnforceAction = "flag"
    """What the collector does to a shard job with a GPU process that is not an MPS
    client (it bypassed MPS, so the pinned memory limit does not bind it): ``flag``
    records a verdict (its memory is still held to the allocation by
    ``enforce_over_limit``); ``kill`` also kills it; ``off`` ignores it."""
    enforce_tolerance_mib: int = 512
    """Slack above a job's allocation before it counts as over its limit: NVML's
    per-process figure includes the CUDA context, which MPS's pinned limit does not
    count."""
    gpu_hard_limit: bool = True
    """Prolog: where the driver supports it (NVIDIA r615+, cgroup v2, not MIG), also put
    a hard GPU memory limit (the job's allocation) on the job's cgroup, which holds even
    for a process that bypasses MPS. Needs Slurm's cgroup/v2 with
    ``PrologFlags=Contain`` so that the job's cgroup exists when the prolog runs.
    Elsewhere nothing happens (the MPS + collector caps apply)."""
    enforce_samples: int = 2
    """Consecutive samples a job must be over its limit (or outside MPS) before the
    collector acts: detection takes this many ``sample_interval_s``."""

    # --- Logging ---------------------------------------------------------------------
    log_file: str = "/var/log/slurm/colloc.log"
    """Where node scripts log (also to syslog when available)."""

    extra: dict[str, str] = field(default_factory=dict)
    """Site-specific key/values for site plugins; never read by colloc itself."""


def _check_value(name: str, hint: Any, value: Any) -> Any:
    origin = getattr(hint, "__origin__", None)
    if origin is Literal:
        allowed = get_args(hint)
        if value not in allowed:
            raise ConfigError(f"{name} = {value!r}: must be one of {', '.join(map(repr, allowed))}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name} = {value!r}: must be true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name} = {value!r}: must be an integer")
        if value < 0:
            raise ConfigError(f"{name} = {value!r}: must not be negative")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{name} = {value!r}: must be a number")
        if value <= 0:
            raise ConfigError(f"{name} = {value!r}: must be positive")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name} = {value!r}: must be a string")
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple) or not all(
            isinstance(v, str) and v and len(v) <= 200 for v in value
        ) or len(value) > 256:
            raise ConfigError(f"{name}: must be a list of (at most 256) non-empty strings")
        return tuple(value)
    if origin is dict:
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise ConfigError(f"{name}: must be a table of string values")
        return dict(value)
    raise ConfigError(f"{name}: unsupported type {hint!r}")  # pragma: no cover


def gpu_model_key(name: str) -> str:
    """How ``gpu_types`` names and backend model names are compared."""
    return " ".join(name.split()).casefold()


def _override(where: str, table: Any, *, node: bool) -> GpuOverride:
    """One ``gpu_types``/``nodes`` table: known keys only, non-negative integers."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: must be a table of {', '.join(OVERRIDABLE)}")
    allowed = OVERRIDABLE if node else OVERRIDABLE[:3]
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        why = ("; gpu_memory_mib is what the backend reports for a model (set it per node)"
               if "gpu_memory_mib" in unknown else "")
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known keys: "
                          f"{', '.join(allowed)}{why}")
    return GpuOverride(**{k: _check_value(f"{where}: {k}", int, v) for k, v in table.items()})


def _override_tables(origin: str, key: str, data: Any) -> dict[str, GpuOverride]:
    """``gpu_types`` or ``nodes``: names checked, and no model or node named twice."""
    if not isinstance(data, dict) or len(data) > 1024:
        raise ConfigError(f"{origin}: {key}: must be (at most 1024) tables, e.g. "
                          f'[{key}."NAME"]')
    out: dict[str, GpuOverride] = {}
    seen: dict[str, str] = {}
    for name, table in data.items():
        where = f'{origin}: [{key}."{name}"]'
        if not name.strip() or len(name) > 200:
            raise ConfigError(f"{where}: the name must be 1..200 characters")
        try:
            members = expand(name) if key == "nodes" else [gpu_model_key(name)]
        except HostlistError as e:
            raise ConfigError(f"{where}: not a Slurm hostlist: {e}") from None
        for m in members:
            if m in seen:
                raise ConfigError(f'{where}: {m} is also in [{key}."{seen[m]}"]; name each '
                                  f"{'node' if key == 'nodes' else 'GPU model'} once")
            seen[m] = name
        if len(seen) > MAX_HOSTS:
            raise ConfigError(f"{where}: the {key} tables name more than {MAX_HOSTS} hosts")
        out[name] = _override(where, table, node=key == "nodes")
    return out


def from_mapping(data: dict[str, Any], *, origin: str = "<mapping>") -> CollocConfig:
    """Build a config from parsed TOML, rejecting unknown keys and wrong types."""
    hints = get_type_hints(CollocConfig, include_extras=False)
    known = {f.name for f in dataclasses.fields(CollocConfig)}
    for key in sorted(set(data) & set(DEPRECATED)):
        warnings.warn(f"{origin}: {key} is deprecated and ignored: {DEPRECATED[key]}",
                      ConfigWarning, stacklevel=2)
    data = {k: v for k, v in data.items() if k not in DEPRECATED}  # a copy: popped below
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(
            f"{origin}: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(sorted(known))}"
        )
    tables: dict[str, Any] = {k: _override_tables(origin, k, data.pop(k))
              for k in ("gpu_types", "nodes") if k in data}
    values = {k: _check_value(f"{origin}: {k}", hints[k], v) for k, v in data.items()}
    values.update(tables)
    cfg = CollocConfig(**values)
    if cfg.shard_mib < 64:
        raise ConfigError(f"{origin}: shard_mib = {cfg.shard_mib}: must be at least 64 MiB")
    if not 0 <= cfg.active_thread_percentage <= 100:
        raise ConfigError(f"{origin}: active_thread_percentage must be 0..100")
    if cfg.sm_capacity_pct > MAX_SM_CAPACITY_PCT:
        raise ConfigError(f"{origin}: sm_capacity_pct = {cfg.sm_capacity_pct}: must be at most "
                          f"{MAX_SM_CAPACITY_PCT} (0 turns compute admission off)")
    if cfg.sm_prior_pct > 100:
        raise ConfigError(f"{origin}: sm_prior_pct = {cfg.sm_prior_pct}: must be 0..100")
    if cfg.chain_task_prolog and not os.path.isabs(cfg.chain_task_prolog):
        raise ConfigError(f"{origin}: chain_task_prolog = {cfg.chain_task_prolog!r}: must "
                          "be an absolute path (Slurm runs task prologs without PATH)")
    if (why := _checkpoint_template_error(cfg.checkpoint_dir)) is not None:
        raise ConfigError(f"{origin}: checkpoint_dir = {cfg.checkpoint_dir!r}: {why}")
    if not os.path.isabs(cfg.compute_history_file):
        raise ConfigError(f"{origin}: compute_history_file = {cfg.compute_history_file!r}: "
                          "must be an absolute path (slurmctld reads it)")
    if cfg.prometheus_textfile and not (os.path.isabs(cfg.prometheus_textfile)
                                        and cfg.prometheus_textfile.endswith(".prom")):
        raise ConfigError(f"{origin}: prometheus_textfile = {cfg.prometheus_textfile!r}: "
                          "must be an absolute path ending in .prom (node_exporter reads "
                          "only *.prom files) or empty")
    if cfg.collector_unit and not _UNIT_NAME.fullmatch(cfg.collector_unit):
        raise ConfigError(f"{origin}: collector_unit = {cfg.collector_unit!r}: must be a "
                          "systemd unit name (letters, digits, ':-_.@', ending in "
                          "'.service') or empty")
    if cfg.recovery_nice > MAX_RECOVERY_NICE:
        raise ConfigError(f"{origin}: recovery_nice = {cfg.recovery_nice}: must be at most "
                          f"{MAX_RECOVERY_NICE:,} (a boost, not a wrap-around of Slurm's nice)")
    if not 0 <= cfg.requeue_retry_s <= 7 * 86400:
        raise ConfigError(f"{origin}: requeue_retry_s = {cfg.requeue_retry_s}: must be 0..604800")
    if not 10 <= cfg.stuck_prolog_grace_s <= 3600:
        raise ConfigError(f"{origin}: stuck_prolog_grace_s = {cfg.stuck_prolog_grace_s}: "
                          "must be 10..3600 seconds")
    if not 0 <= cfg.script_server_idle_s <= 7 * 86400:
        raise ConfigError(f"{origin}: script_server_idle_s = {cfg.script_server_idle_s}: "
                          "must be 0..604800 seconds (0: no script server)")
    if not 1 <= cfg.prolog_controller_s <= 600:
        raise ConfigError(f"{origin}: prolog_controller_s = {cfg.prolog_controller_s}: "
                          "must be 1..600 seconds")
    return cfg


def _checkpoint_template_error(template: str) -> str | None:
    """Why ``checkpoint_dir`` cannot name one directory per job (None: fine or empty)."""
    if not template:
        return None
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        return str(e)
    if fields - {"home", "user", "uid", "jobid"}:
        return (f"unknown placeholder(s) {sorted(fields - {'home', 'user', 'uid', 'jobid'})}"
                " (known: {home}, {user}, {uid}, {jobid})")
    if "jobid" not in fields:
        return "must contain {jobid} (one directory per job, the same in each attempt)"
    if not (template.startswith("/") or template.startswith("{home}")):
        return "must be an absolute path or start with {home}"
    return None


def config_path() -> Path:
    """The file :func:`load` reads: ``$COLLOC_CONF`` if set, else the default."""
    return Path(os.environ.get(ENV_VAR) or DEFAULT_PATH)


def load(path: Path | str | None = None, *, missing_ok: bool = True) -> CollocConfig:
    """Load the configuration file.

    A missing default file gives the defaults (a login node may have no colloc.conf);
    a file named explicitly (argument or ``$COLLOC_CONF``) must exist.
    """
    explicit = path is not None or bool(os.environ.get(ENV_VAR))
    p = Path(path) if path is not None else config_path()
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        if explicit or not missing_ok:
            raise ConfigError(f"{p}: configuration file not found") from None
        return CollocConfig()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read configuration: {e.strerror}") from e
    if len(raw) > 1 << 20:
        raise ConfigError(f"{p}: configuration file larger than 1 MiB")
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from e
    return from_mapping(data, origin=str(p))


def dump(cfg: CollocConfig) -> str:
    """Render a config as TOML (only simple scalar types are used)."""
    lines = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if isinstance(v, dict):
            continue
        if isinstance(v, bool):
            lines.append(f"{f.name} = {'true' if v else 'false'}")
        elif isinstance(v, tuple):
            lines.append(f"{f.name} = [{', '.join(repr(x).replace(chr(39), chr(34)) for x in v)}]")
        elif isinstance(v, int | float):
            lines.append(f"{f.name} = {v}")
        else:
            lines.append(f'{f.name} = "{v}"')
    for key in ("gpu_types", "nodes"):
        for name, o in getattr(cfg, key).items():
            lines.append(f"\n[{key}.{json.dumps(name)}]")
            lines.extend(f"{k} = {v}" for k, v in o.values().items())
    if cfg.extra:
        lines.append("\n[extra]")
        lines.extend(f'{k} = "{v}"' for k, v in sorted(cfg.extra.items()))
    return "\n".join(lines) + "\n"
