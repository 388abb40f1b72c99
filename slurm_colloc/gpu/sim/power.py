"""Power drawn by a simulated GPU as a function of its SM activity.

Why a model at all: collocation is sold partly on energy (fewer GPUs busy, less idle
power), so the simulated GPUs must burn energy in a way that rewards or punishes
sharing the way real ones do. An A100 draws about 50-60 W idle and approaches its
board limit (400 W SXM4, 250 W PCIe) only when its SMs are saturated; between the
two, board power rises roughly linearly with SM activity (DCGM's SMACT) for
training workloads. A linear model between ``idle_w`` and ``max_w`` is therefore the
simplest one that keeps the property that matters here: two half-busy jobs on one
GPU cost one idle floor less than the same jobs on two GPUs.
"""

from __future__ import annotations

A100_IDLE_W = 55.0
"""Idle board power of an A100 40 GB (nvidia-smi reads 50-60 W with no process)."""
A100_SXM_MAX_W = 400.0
"""A100 SXM4 40 GB board power limit; use 250 W for the PCIe card."""


def power_w(sm_activity_pct: float, idle_w: float, max_w: float) -> float:
    """Board power at a given SM activity (clamped to 0..100 %)."""
    act = min(100.0, max(0.0, sm_activity_pct))
    return idle_w + (max_w - idle_w) * act / 100.0
