"""The per-job accounting record (AdminComment): typed record and its codec."""

from slurm_colloc.accounting.codec import (
    DEFAULT_MAX_BYTES,
    PREFIX,
    RecordDecodeError,
    RecordTooLargeError,
    UnsupportedVersionError,
    append_attempt,
    decode,
    encode,
    try_decode,
)
from slurm_colloc.accounting.record import (
    Attempt,
    Estimate,
    JobRecord,
    MetricsSummary,
    OomInfo,
    Requeue,
)

__all__ = [
    "DEFAULT_MAX_BYTES",
    "PREFIX",
    "Attempt",
    "Estimate",
    "JobRecord",
    "MetricsSummary",
    "OomInfo",
    "RecordDecodeError",
    "RecordTooLargeError",
    "Requeue",
    "UnsupportedVersionError",
    "append_attempt",
    "decode",
    "encode",
    "try_decode",
]
