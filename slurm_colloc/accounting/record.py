"""The typed per-job record colloc keeps in Slurm's AdminComment.

One :class:`JobRecord` per job, one :class:`Attempt` per run of it (a GPU-OOM requeue
starts a new attempt). Everything ``colloc-report`` explains comes from here: what was
estimated, what was granted, where it ran and with whom, what it really used, why it
died and what was asked for next. Field names are spelled out here; the codec maps
them to short keys on the wire (:mod:`slurm_colloc.accounting.codec`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slurm_colloc.oom.patterns import AttemptCause


@dataclass(frozen=True)
class Estimate:
    """The submit-time memory estimate the job's shards were derived from."""

    mib: int
    estimator: str
    margin_mib: int | None = None
    """Safety margin the estimator added, in MiB (included in ``mib``)."""
    fingerprint: str | None = None
    """Model-summary fingerprint: the key of the estimator's measured history."""
    batch_size: int | None = None
    """The rest of the history key (what changes memory besides the model), as the
    job's ``--colloc-*`` options gave it: with the fingerprint and the attempt's
    measured peak, the accounting record alone can serve as estimator history."""
    seq_len: int | None = None
    optimizer: str | None = None
    precision: str | None = None


@dataclass(frozen=True)
class OomInfo:
    """Why the attempt died, as the epilog's log scan saw it."""

    cause: AttemptCause
    """``gpu-oom``, ``mps-fault``, ``cuda-fatal``, ``host-oom`` or ``none``
    (:data:`slurm_colloc.oom.patterns.AttemptCause`: the scanner's type, end to end)."""
    pattern_id: str | None = None
    evidence_path: str | None = None
    """Where the epilog kept the failed attempt's log."""
    whole_gpu: bool = False
    """The attempt already had a GPU to itself (so the OOM is the job's own)."""
    alloc_mib: int | None = None
    """The allocation that failed, as the OOM line says (``Tried to allocate 10.00
    GiB``; :mod:`slurm_colloc.oom.alloc`): a measured peak never includes it."""
    in_use_mib: int | None = None
    """What the process held when the allocation failed, if the line says."""
    culprit: str | None = None
    """The co-tenant job the collector caught over its allocation on this GPU while
    this attempt ran out of memory (the victim's OOM was not its own fault)."""


@dataclass(frozen=True)
class Enforcement:
    """The collector's verdict on the attempt (:class:`slurm_colloc.metrics.enforce.Verdict`,
    kept by the epilog so the report can say colloc stopped the job, from any host)."""

    kind: str
    """``over_limit`` or ``outside_mps``."""
    action: str
    """``observed``, ``flagged``, ``killed`` or ``kill-refused``."""
    peak_mib: int | None = None
    limit_mib: int | None = None
    outside_mps: bool = False
    """A process of the job was seen outside MPS (whatever ``kind`` is)."""


@dataclass(frozen=True)
class Requeue:
    """The epilog's requeue decision after this attempt."""

    requeued: bool
    reason: str
    new_request: str | None = None
    """The new TRES request, e.g. ``gres/shard:40``."""
    new_limit_mib: int | None = None


@dataclass(frozen=True)
class MetricsSummary:
    """What the sidecar measured for this attempt (None where not measured)."""

    peak_mib: int | None = None
    mean_mib: float | None = None
    mean_sm_activity: float | None = None
    """0..1, from DCGM profiling (or NVML utilization when ``dcgm`` is False)."""
    energy_j: float | None = None
    samples: int = 0
    dcgm: bool = False
    series: tuple[tuple[int, int, int | None], ...] = ()
    """Downsampled time series for plots from any host: (seconds since the attempt's
    start, device memory MiB (max over the interval), SM activity % (mean) or None),
    at most ``series_points`` points, oldest first."""
    gaps: tuple[tuple[int, int, str], ...] = ()
    """Stretches of the attempt with no sample: (seconds from the attempt's start,
    length in seconds, cause: ``collector`` (it was not running: nothing sampled or
    enforced) or ``job`` (no process of the job on its GPU)), oldest first
    (:mod:`slurm_colloc.metrics.gaps`). Empty: none, or a record written before gaps
    were kept (``span_s`` None)."""
    span_s: int | None = None
    """Seconds the gaps are counted against (prolog to epilog); None: not computed."""


@dataclass(frozen=True)
class Attempt:
    """One run of the job."""

    attempt: int
    """0 for the first run; Slurm's ``SLURM_RESTART_COUNT`` after that."""
    estimate: Estimate | None = None
    shards: int | None = None
    shard_mib: int | None = None
    limit_mib: int | None = None
    """The MPS pinned device memory limit the job ran with."""
    gpu: int | None = None
    node: str | None = None
    co_tenants: tuple[str, ...] = ()
    """Job ids that shared the GPU at some time during this attempt."""
    oom: OomInfo | None = None
    requeue: Requeue | None = None
    metrics: MetricsSummary | None = None
    start: int | None = None
    """Unix time (s) the attempt started."""
    end: int | None = None
    enforcement: Enforcement | None = None
    """What the node's collector found and did about this attempt (None: nothing)."""
    unscanned: tuple[str, ...] = ()
    """Job logs the epilog could not scan, each ``"<path>: <why>"`` (a FIFO, a deleted
    file, ...: :mod:`slurm_colloc.node.unscanned`). With any, a cause of ``none`` means
    "not seen", not "no error" (issue 28)."""


@dataclass(frozen=True)
class JobRecord:
    """All attempts of a job, oldest first."""

    attempts: tuple[Attempt, ...] = ()
    truncated: bool = False
    """Details were dropped to fit ``admin_comment_max_bytes``."""
    dropped_attempts: int = 0
    """Attempts removed entirely by truncation (their numbers are gone too)."""
    extra: dict[str, str] = field(default_factory=dict)
    """Small free-form notes (site use); dropped first when over the cap."""
