"""GPU out-of-memory detection in job logs (pattern library + bounded scanner)."""

from slurm_colloc.oom.detector import (
    DEFAULT_TAIL_BYTES,
    Evidence,
    ScanResult,
    ScanSummary,
    scan_file,
    scan_files,
    tail_bytes_from_config,
)
from slurm_colloc.oom.patterns import BY_ID, CAUSE_PRIORITY, PATTERNS, OomPattern
from slurm_colloc.oom.safe_open import RefusedPath, open_as_user, open_log

__all__ = [
    "BY_ID",
    "CAUSE_PRIORITY",
    "DEFAULT_TAIL_BYTES",
    "PATTERNS",
    "Evidence",
    "OomPattern",
    "RefusedPath",
    "ScanResult",
    "ScanSummary",
    "open_as_user",
    "open_log",
    "scan_file",
    "scan_files",
    "tail_bytes_from_config",
]
