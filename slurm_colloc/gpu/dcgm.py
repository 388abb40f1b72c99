"""Optional DCGM profiling fields: SM activity, SM occupancy, DRAM activity.

NVML cannot say how busy the SMs are (its "utilisation" is the share of time *any*
kernel ran); DCGM's profiling fields can: 1002 ``DCGM_FI_PROF_SM_ACTIVE``, 1003
``DCGM_FI_PROF_SM_OCCUPANCY``, 1005 ``DCGM_FI_PROF_DRAM_ACTIVE`` (ratios 0..1), plus
155 power (W) and 156 total energy (mJ). They are read through DCGM's own Python
bindings (``DcgmReader``/``pydcgm``/``dcgm_fields``), which exist only where the
datacenter-gpu-manager package is installed and ``nv-hostengine`` runs; they are not
on PyPI. So: imported lazily, and :func:`open_profiler` returns ``None`` when absent,
which leaves those sample fields ``None`` ("not measured").

This code cannot be exercised on machines without a GPU and DCGM (like the
development machines of this project); the unit tests run it against a fake
``DcgmReader`` that returns what DCGM documents.
"""

from __future__ import annotations

import importlib
import logging
import sys
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("colloc.gpu.dcgm")

SM_ACTIVE = 1002
SM_OCCUPANCY = 1003
DRAM_ACTIVE = 1005
POWER = 155
TOTAL_ENERGY = 156
FIELDS = (SM_ACTIVE, SM_OCCUPANCY, DRAM_ACTIVE, POWER, TOTAL_ENERGY)

DCGM_PYTHON_DIRS = (
    "/usr/share/datacenter-gpu-manager-4/bindings/python3",
    "/usr/local/dcgm/bindings/python3",
)
"""Where the DCGM packages install their bindings (DCGM 4, then 3)."""
_FP64_BLANK = 140737488355328.0  # DCGM_FP64_BLANK: values >= it mean "no data"
_INT64_BLANK = 9223372036854775792  # DCGM_INT64_BLANK


@dataclass(frozen=True)
class ProfilingFields:
    """One GPU's profiling fields; ``None`` where DCGM had no value."""

    sm_active_pct: float | None
    sm_occupancy_pct: float | None
    dram_active_pct: float | None
    power_w: float | None
    energy_j: float | None


def _value(raw: Any, blank: float) -> float | None:
    if raw is None:
        return None
    value = getattr(raw, "value", raw)  # DcgmReader may hand back value objects
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return None if number >= blank else number


class DcgmProfiler:
    """Latest DCGM profiling values per GPU through a ``DcgmReader``."""

    def __init__(self, reader: Any) -> None:
        """Wrap a started DcgmReader (see :func:`open_profiler`)."""
        self.reader = reader

    def read(self, index: int) -> ProfilingFields | None:
        """Latest values for GPU ``index`` (DCGM GPU ids equal NVML indices on a node)."""
        try:
            values = self.reader.GetLatestGpuValuesAsFieldIdDict()
        except Exception as e:  # noqa: BLE001 - DCGM raises its own error types
            log.warning("colloc: dcgm: reading profiling fields failed: %s", e)
            return None
        gpu = values.get(index)
        if not gpu:
            return None

        def pct(field: int) -> float | None:
            v = _value(gpu.get(field), _FP64_BLANK)
            return None if v is None else 100.0 * v

        energy_mj = _value(gpu.get(TOTAL_ENERGY), _INT64_BLANK)
        return ProfilingFields(
            sm_active_pct=pct(SM_ACTIVE),
            sm_occupancy_pct=pct(SM_OCCUPANCY),
            dram_active_pct=pct(DRAM_ACTIVE),
            power_w=_value(gpu.get(POWER), _FP64_BLANK),
            energy_j=None if energy_mj is None else energy_mj / 1000.0,
        )

    def close(self) -> None:
        """Stop watching the fields."""
        shutdown = getattr(self.reader, "Shutdown", None)
        if callable(shutdown):
            shutdown()


def open_profiler(interval_s: float = 1.0) -> DcgmProfiler | None:
    """A profiler if DCGM's bindings and host engine are available, else ``None``."""
    for d in DCGM_PYTHON_DIRS:
        if d not in sys.path:
            sys.path.append(d)
    try:
        module = importlib.import_module("DcgmReader")
    except ImportError:
        log.info("colloc: dcgm: DCGM Python bindings not installed; SM activity not measured")
        return None
    try:
        reader = module.DcgmReader(fieldIds=list(FIELDS), updateFrequency=int(interval_s * 1e6))
    except Exception as e:  # noqa: BLE001 - no host engine, old GPU, profiling busy...
        log.warning("colloc: dcgm: cannot watch profiling fields (%s); not measured", e)
        return None
    return DcgmProfiler(reader)
