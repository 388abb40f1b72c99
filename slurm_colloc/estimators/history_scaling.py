"""From measured peaks of the same model at other batch sizes to a peak at this one.

Users rerun the same model with a different batch size all the time (a small debug
run, then the real one; a sweep). A measured peak of the same model is worth more than
any summary: across architectures the summary explains activation memory only to
within about 2.5x (5th-95th percentile on timm), while one model's peaks lie close to
a straight line in the batch size (activations grow linearly; the CUDA context,
weights and optimizer state do not). So:

* **exact**: a run with this batch size was measured -> that peak + ``HISTORY_MARGIN``
  (or a larger one measured at a smaller batch);
* **fit** (two or more other batch sizes measured): the least-squares line through
  them, slope clamped at >= 0, times ``1 + FIT_MARGIN``; never below a measured peak
  at a batch size <= this one (peaks do not shrink with the batch), nor, below the
  smallest measured batch, below that peak scaled in proportion to the batch;
* **anchored** (one other batch size ``b0`` with peak ``m0``): for ``b > b0`` the
  measured peak plus the estimator's own growth ``E(b) - E(b0)`` (its margin makes the
  growth an upper bound for most models); for ``b < b0``, ``m0`` bounds the peak from
  above, so the answer is ``min(E(b), m0 x (1 + HISTORY_MARGIN))``.

The margins were chosen on the calibration split of the timm A100 data and are
checked on its held-out split by ``benchmarks/estimator_accuracy.py`` (section
"history"): held-out, fit 96.8% not underestimated at a median +10% overestimate;
anchored 97.8% at +26% (the cold estimator: 97.5% at +32%).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

HISTORY_MARGIN = 0.05
"""Margin on a peak measured at the same batch size: run-to-run variation of cuDNN
algorithm choice and allocator caching is a few percent."""
FIT_MARGIN = 0.10
"""Margin on a peak interpolated / extrapolated from two or more other batch sizes:
96% of calibration-split timm runs lie below the line x 1.10 (benchmark, "history")."""


@dataclass(frozen=True)
class Scaled:
    """A history-based answer before it becomes an
    :class:`~slurm_colloc.estimators.base.Estimate`."""

    method: str
    """``exact``, ``fit`` or ``anchored``."""
    peak_mib: float
    """The measured or inferred peak, without margin."""
    estimate_mib: int
    """With margin (and the monotonicity floor)."""
    basis: str
    """What was measured, for the notes."""

    @property
    def estimator(self) -> str:
        """The estimator name reported (``history``, ``history-fit``, ``history-anchored``)."""
        return "history" if self.method == "exact" else f"history-{self.method}"


def _line(points: Mapping[int, float]) -> tuple[float, float]:
    """Least-squares intercept and slope (slope >= 0) through (batch, peak) points."""
    n = len(points)
    xs = list(points)
    ys = [points[x] for x in xs]
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    slope = max(slope, 0.0)
    return my - slope * mx, slope


def scale_history(points: Mapping[int, int], batch_size: int,
                  cold: Callable[[int], int]) -> Scaled | None:
    """The history answer for ``batch_size`` from measured ``{batch: peak MiB}``.

    ``cold(b)`` is the summary estimator's figure (margin included) at batch ``b``;
    it is called only for the one-point rule. None when there are no points.
    """
    pts = {int(b): float(p) for b, p in points.items() if b > 0 and p > 0}
    if not pts:
        return None
    if batch_size in pts:
        # a larger peak measured at a smaller batch was a transient (cuDNN benchmark
        # trials) that can come back: it is kept as a floor, as for the fit
        peak = max(p for b, p in pts.items() if b <= batch_size)
        return Scaled("exact", peak, math.ceil(peak * (1 + HISTORY_MARGIN)),
                      f"measured at batch {batch_size}")
    listed = ", ".join(f"{b}: {pts[b]:.0f} MiB" for b in sorted(pts))
    if len(pts) >= 2:
        icpt, slope = _line(pts)
        peak = icpt + slope * batch_size
        # peaks never shrink with the batch, and never shrink faster than in proportion
        # to it (the fixed part stays): both bound a line fitted through noisy points
        below = [p for b, p in pts.items() if b <= batch_size]
        b_min = min(pts)
        floor = max(below) if below else pts[b_min] * batch_size / b_min
        est = max(peak * (1 + FIT_MARGIN), floor * (1 + HISTORY_MARGIN))
        return Scaled("fit", max(peak, floor), math.ceil(est),
                      f"line through peaks measured at batch {listed} "
                      f"({icpt:.0f} MiB + {slope:.1f} MiB per sample)")
    (b0, m0), = pts.items()
    cold_b = cold(batch_size)
    if batch_size > b0:
        growth = max(0, cold_b - cold(b0))
        return Scaled("anchored", m0 + growth, math.ceil(m0 * (1 + HISTORY_MARGIN) + growth),
                      f"measured at batch {b0} ({m0:.0f} MiB) plus the estimated growth "
                      f"to batch {batch_size} ({growth} MiB)")
    est = max(min(cold_b, math.ceil(m0 * (1 + HISTORY_MARGIN))),
              math.ceil(m0 * batch_size / b0 * (1 + HISTORY_MARGIN)))
    return Scaled("anchored", min(cold_b, m0), est,
                  f"at most the peak measured at the larger batch {b0} ({m0:.0f} MiB)")
