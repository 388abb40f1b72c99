"""Fit the layer-aware constants and the safety margin on measured peaks.

Used by ``benchmarks/estimator_accuracy.py --calibrate`` (never at estimate time; it
needs numpy). The fit is a relative-error least squares with non-negative
coefficients, pulled towards the physics prior (1.0 = "every kept output counted
once", "every parameter byte counted once") so that layer categories the data barely
contains keep their physical value instead of an arbitrary one. The margin is then
the smallest one that keeps ``coverage`` of the *training* rows from being
underestimated, chosen among (relative, absolute) pairs for the lowest median
overestimate; the held-out split is never looked at here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from estimators.features import Features
from estimators.layer_aware import PRIOR, Calibration, base_breakdown
from estimators.layers import CATEGORIES

COLUMNS = ("context", "params", *(f"act_{c}" for c in CATEGORIES), "attn_scores", "largest")


@dataclass(frozen=True)
class Row:
    """One measured job: its features and its measured peak (MiB)."""

    features: Features
    measured: float
    group: str


def design(f: Features) -> list[float]:
    """The row of the design matrix (same order as :data:`COLUMNS`)."""
    return [1.0, sum(f.params.values()), *(f.act[c] for c in CATEGORIES),
            f.attn_scores, f.largest]


def _nnls_ridge(x: np.ndarray, y: np.ndarray, prior: np.ndarray, lam: np.ndarray,
                iters: int = 4000) -> np.ndarray:
    """min |x c - y|^2 + sum lam (c - prior)^2 subject to c >= 0 (coordinate descent)."""
    g = x.T @ x + np.diag(lam)
    h = x.T @ y + lam * prior
    c = np.maximum(prior.astype(float), 0.0)
    for _ in range(iters):
        old = c.copy()
        for j in range(len(c)):
            if g[j, j] <= 0:
                continue
            r = h[j] - g[j] @ c + g[j, j] * c[j]
            c[j] = max(0.0, r / g[j, j])
        if np.max(np.abs(c - old)) < 1e-9:
            break
    return c


def fit(rows: Sequence[Row], *, coverage: float = 0.975, ridge: float = 0.05) -> Calibration:
    """Fit constants and margin on ``rows`` (the calibration split only)."""
    x = np.array([design(r.features) for r in rows])
    y = np.array([r.measured for r in rows])
    w = 1.0 / y  # relative errors: a 100 MiB miss on a 2 GiB job matters more
    xw, yw = x * w[:, None], y * w
    prior = np.array([PRIOR.context_mib, 1.0] + [1.0] * len(CATEGORIES) + [1.0, 1.0])
    lam = np.full(len(prior), ridge * len(rows) / 100.0)
    lam[0] = 0.0  # the context is fitted freely
    lam[1] = lam[1] * 10  # parameter bytes are exact physics: pull harder
    c = _nnls_ridge(xw, yw, prior, lam)
    k = dict(zip(COLUMNS, c, strict=True))
    cal = Calibration(
        context_mib=float(k["context"]), k_params=float(k["params"]),
        k_act={cat: float(k[f"act_{cat}"]) for cat in CATEGORIES},
        k_scores=float(k["attn_scores"]), k_workspace=float(k["largest"]),
        margin_rel=0.0, margin_abs_mib=0.0, interval=(1.0, 1.0),
    )
    base = np.array([sum(base_breakdown(r.features, cal).values()) for r in rows])
    ratio = y / base
    interval = (float(np.quantile(ratio, 0.05)), float(np.quantile(ratio, 0.95)))
    best: tuple[float, float, float] | None = None
    var = base - cal.context_mib
    for m_abs in np.arange(0.0, 513.0, 16.0):
        # smallest relative margin with the wanted coverage at this absolute margin
        need = (y - base - m_abs) / np.maximum(var, 1e-9)
        m_rel = max(0.0, float(np.quantile(need, coverage)))
        est = base + var * m_rel + m_abs
        med_over = float(np.median((est - y) / y))
        if best is None or med_over < best[0]:
            best = (med_over, m_rel, float(m_abs))
    assert best is not None
    return Calibration(
        context_mib=cal.context_mib, k_params=cal.k_params, k_act=cal.k_act,
        k_scores=cal.k_scores, k_workspace=cal.k_workspace,
        margin_rel=round(best[1], 4), margin_abs_mib=best[2], interval=interval,
    )
