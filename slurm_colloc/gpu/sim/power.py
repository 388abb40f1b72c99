"""Power drawn by a simulated GPU as a function of its SM and DRAM activity.

Why a model at all: collocation is sold partly on energy (fewer GPUs busy, less idle
power), so the simulated GPUs must burn energy in a way that rewards or punishes
sharing the way real ones do. The earlier model was linear in SM activity from idle to
the board limit; with SM-work conserved under co-location no policy could then save
more than the idle floor of the GPUs it frees (issue 24).

Real GPUs are not linear. As soon as a context runs kernels an A100 leaves its idle
performance state and holds boost clocks between kernels, so a lightly loaded GPU draws
well above idle and a second tenant adds less than the first: the model has an *active
floor* (:data:`ACTIVE_FLOOR`) paid once per busy GPU, then a term in SM activity; the
DRAM term (:data:`K_DRAM`) is kept in the formula but weighs nothing since an H100
measured none:

``P = idle``                                  with no activity,
``P = idle + (max - idle) * min(1, floor + k_sm * s + k_dram * d)``  otherwise,

``s``, ``d`` fractions (DCGM SMACT and DRAMA). Anchors (``benchmarks/power_fit.py``
prints each with its error): idle 50-58 W on idle A100-SXM4-40GB boards (nvidia-smi;
e.g. 52.5-54.3 W on four boards in a public log), and the SXM4 board limit, 400 W
(NVIDIA A100 datasheet), reached by a saturating training job (SMACT ~0.92, DRAM
activity ~0.7: Lucid's BERT rows measure 62-74 % memory utilisation at 99.7 % GPU
utilisation). The floor is an assumption for the A100, close to what an H100 measured
(0.08 with idle contexts); the H100's runs (``benchmarks/hw_check.py``) are the held-out
check of the shape: median error 7 % on GEMM and small-kernel workloads, but copies
(memory-bound, high SM activity, low power) are overstated by about 80 %, and the
H100's tensor-core GEMMs reach the board limit near 60 % SM activity, not 92 %: power
per SM activity depends on the kernel mix, which the traces do not give.

When a GPU's DRAM activity is not known the simulation takes it proportional to SM
activity (:data:`DRAM_PER_SM`, the median ratio of memory to GPU utilisation of Lucid's
single jobs).
"""

from __future__ import annotations

A100_IDLE_W = 55.0
"""Idle board power of an A100 40 GB (nvidia-smi reads 50-58 W with no process)."""
A100_SXM_MAX_W = 400.0
"""A100 SXM4 40 GB board power limit; use 250 W for the PCIe card."""
ACTIVE_FLOOR = 0.10
"""Share of (max - idle) drawn by any busy GPU (boost clocks held between kernels). An
H100 holding four idle CUDA contexts drew 0.08 of its range (121 W, idle 71 W, limit
700 W; ``benchmarks/results/hardware``)."""
K_DRAM = 0.0
"""Share of (max - idle) drawn at 100 % DRAM activity, on top of the SM term: none. It
was an assumed 0.25 until an H100 was measured (``benchmarks/hw_check.py``): copy
kernels at 98 % SM and 89 % DRAM activity drew half the range, GEMMs at 95 % SM and
25 % DRAM the whole; DRAM traffic did not add power, and the SM term alone halved the
error on the compute workloads (median 13 % -> 7 %)."""
SATURATED_SMACT = 0.92
SATURATED_DRAM = 0.70
K_SM = (1.0 - ACTIVE_FLOOR - K_DRAM * SATURATED_DRAM) / SATURATED_SMACT
"""Chosen so that a saturating job (SMACT 0.92) reaches the board limit."""
DRAM_PER_SM = 0.49
"""DRAM activity per unit of SM activity when the former is not known (Lucid's median
gmem_util / gpu_util over its 66 single jobs)."""


def power_w(
    sm_activity_pct: float, idle_w: float, max_w: float, dram_pct: float | None = None,
) -> float:
    """Board power at a given SM (and DRAM) activity, % (clamped to 0..100)."""
    s = min(1.0, max(0.0, sm_activity_pct / 100.0))
    d = s * DRAM_PER_SM if dram_pct is None else min(1.0, max(0.0, dram_pct / 100.0))
    if s <= 0.0 and d <= 0.0:
        return idle_w
    load = min(1.0, ACTIVE_FLOOR + K_SM * s + K_DRAM * d)
    return idle_w + (max_w - idle_w) * load
