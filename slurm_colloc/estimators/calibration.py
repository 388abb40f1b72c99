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
from dataclasses import dataclass, replace

import numpy as np

from slurm_colloc.estimators.features import (
    HIDDEN_KINDS,
    MARGIN_BUCKETS,
    Features,
    hidden_kind,
    margin_bucket,
)
from slurm_colloc.estimators.layer_aware import (
    PRIOR,
    Calibration,
    base_breakdown,
    hidden_part,
    margin_basis,
    margin_mib,
)
from slurm_colloc.estimators.layers import CATEGORIES

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
                iters: int = 4000, init: np.ndarray | None = None) -> np.ndarray:
    """min |x c - y|^2 + sum lam (c - prior)^2 subject to c >= 0 (coordinate descent)."""
    g = x.T @ x + np.diag(lam)
    h = x.T @ y + lam * prior
    c: np.ndarray = np.maximum((prior if init is None else init).astype(float), 0.0)
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


def fit(rows: Sequence[Row], *, coverage: float = 0.96, ridge: float = 0.002,
        irls_iters: int = 20) -> Calibration:
    """Fit constants and margin on ``rows`` (the calibration split only).

    Each data set gets its own context intercept (they were measured with different
    software stacks, and the CUDA context is a property of the stack, not of the
    model); the layer and parameter coefficients are shared. The shipped context is
    the largest fitted one: on an unknown stack the larger context is the safe side.
    """
    full = [r for r in rows if not hides_blocks(r.features)]
    c, names = _fit_linear(full, ridge=ridge, irls_iters=irls_iters)
    contexts = dict(zip(names, c[: len(names)], strict=True))
    k = dict(zip(COLUMNS[1:], c[len(names):], strict=True))
    k.update(_fit_hidden([r for r in rows if hides_blocks(r.features)], contexts, k,
                         irls_iters=irls_iters))
    cal = Calibration(
        context_mib=float(max(contexts.values())), k_params=float(k["params"]),
        k_act={cat: float(k[f"act_{cat}"]) for cat in CATEGORIES},
        k_scores=float(k["attn_scores"]), k_workspace=float(k["largest"]),
        margin_rel=0.0, margin_abs_mib=0.0, interval=(1.0, 1.0),
        context_by_dataset={n: round(float(v), 1) for n, v in contexts.items()},
    )
    return with_margin(rows, cal, coverage=coverage)


HIDDEN_COLUMNS = ("act_hidden_conv", "act_hidden_tok")


def hides_blocks(f: Features) -> bool:
    """Whether the summary showed some blocks without their children."""
    return any(f.act[c.removeprefix("act_")] > 0 for c in HIDDEN_COLUMNS)


def _problem(rows: Sequence[Row], ridge: float
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """Design matrix (one context column per data set), targets, base weights, prior
    and ridge strengths shared by the least-squares and the quantile fits."""
    groups = [r.group for r in rows]
    names = sorted(set(groups))
    size = {g: groups.count(g) for g in names}
    onehot = np.array([[1.0 if g == n else 0.0 for n in names] for g in groups])
    x = np.hstack([onehot, np.array([design(r.features)[1:] for r in rows])])
    y = np.array([r.measured for r in rows])
    # relative errors (a 100 MiB miss on a 2 GiB job matters more), each data set
    # weighted equally (3,000 near-identical MLPs must not drown 300 timm models)
    w = np.array([1.0 / (r.measured * np.sqrt(size[r.group])) for r in rows])
    prior = np.array([PRIOR.context_mib] * len(names) + [1.0] * (len(COLUMNS) - 1))
    lam = np.full(len(prior), ridge * len(names))
    lam[: len(names)] = 0.0  # contexts are fitted freely
    return x, y, w, prior, lam, names


def _fit_linear(rows: Sequence[Row], *, ridge: float, irls_iters: int
                ) -> tuple[np.ndarray, list[str]]:
    """Coefficients (group contexts first, then :data:`COLUMNS` after the context)."""
    x, y, w, prior, lam, names = _problem(rows, ridge)
    xw, yw = x * w[:, None], y * w
    # iteratively reweighted towards least absolute relative error: a few runs with
    # cuDNN-benchmark spikes (2-6x the steady peak) must not bend every coefficient
    c = _nnls_ridge(xw, yw, prior, lam)
    for _ in range(irls_iters):
        r = np.abs(y - x @ c) / y
        wr = w / np.sqrt(np.maximum(r, 0.02))
        c = _nnls_ridge(x * wr[:, None], y * wr, prior, lam, init=c)
    return c, names


def _fit_hidden(rows: Sequence[Row], contexts: dict[str, float], k: dict[str, float], *,
                irls_iters: int) -> dict[str, float]:
    """The hidden-block coefficients on ``rows``, everything else fixed at ``k``."""
    if not rows:
        return dict.fromkeys(HIDDEN_COLUMNS, 1.0)
    idx = [COLUMNS.index(c) for c in HIDDEN_COLUMNS]
    rest = np.array([0.0 if i in idx else k[c] for i, c in enumerate(COLUMNS) if i > 0])
    d = np.array([design(r.features)[1:] for r in rows])
    known = np.array([contexts.get(r.group, max(contexts.values())) for r in rows]) + d @ rest
    xh = d[:, [i - 1 for i in idx]]
    y = np.array([r.measured for r in rows]) - known
    w = 1.0 / np.array([r.measured for r in rows])
    prior, lam = np.ones(len(idx)), np.full(len(idx), 1e-4)
    c = _nnls_ridge(xh * w[:, None], y * w, prior, lam)
    for _ in range(irls_iters):
        r = np.abs(y - xh @ c) * w
        wr = w / np.sqrt(np.maximum(r, 0.02))
        c = _nnls_ridge(xh * wr[:, None], y * wr, prior, lam, init=c)
    return {col: float(v) for col, v in zip(HIDDEN_COLUMNS, c, strict=True)}


MIN_BUCKET_ROWS = 30
"""A bucket's margin is taken from a data set only where that data set has at least
this many calibration runs of it (fewer give no usable 96th percentile)."""


def with_margin(rows: Sequence[Row], cal: Calibration, *, coverage: float = 0.96) -> Calibration:
    """``cal`` with the margin (and the stated intervals) chosen on ``rows``.

    The relative margin is a split-conformal quantile per architecture bucket
    (:func:`slurm_colloc.estimators.features.margin_bucket`): for each bucket, the ``coverage``
    quantile of the relative margin each calibration run needs, taken per data set
    (so that 3,000 MLPs cannot lower the margin of the timm CNNs) and the largest of
    those. Buckets whose ops the summary hides get wider margins than those it shows.
    The absolute part is shared and chosen for the lowest median overestimate."""
    full = [r for r in rows if not hides_blocks(r.features)]
    rel_by, abs_by, interval, by_interval = _bucket_margins(full, cal, coverage)
    cal = replace(cal, margin_rel_by_bucket=rel_by, margin_abs_by_bucket=abs_by)
    hid = [r for r in rows if hides_blocks(r.features)]
    for kind in HIDDEN_KINDS:
        mine = [r for r in hid if hidden_kind(r.features) == kind]
        if mine:
            rel_by[kind], by_interval[kind] = _hidden_margin(mine, cal, coverage)
    worst = max(rel_by, key=lambda b: rel_by[b] * 1e6 + abs_by.get(b, 0.0))
    return replace(cal, margin_rel=rel_by[worst], margin_abs_mib=abs_by.get(worst, 0.0),
                   margin_rel_by_bucket=rel_by, margin_abs_by_bucket=abs_by,
                   interval=interval, interval_by_bucket=by_interval)


def _bucket_margins(rows: Sequence[Row], cal: Calibration, coverage: float
                    ) -> tuple[dict[str, float], dict[str, float], tuple[float, float],
                               dict[str, tuple[float, float]]]:
    """Per-bucket (relative, absolute) margins and ratio intervals on ``rows``."""
    groups = np.array([r.group for r in rows])
    names = sorted(set(groups.tolist()))
    y = np.array([r.measured for r in rows])
    parts = [base_breakdown(r.features, cal) for r in rows]
    base = np.array([sum(p.values()) for p in parts])
    buckets = np.array([margin_bucket(r.features) for r in rows])
    ratio = y / base
    interval = (float(np.quantile(ratio, 0.05)), float(np.quantile(ratio, 0.95)))
    by_interval = {str(b): (round(float(np.quantile(ratio[buckets == b], 0.05)), 4),
                            round(float(np.quantile(ratio[buckets == b], 0.95)), 4))
                   for b in sorted(set(buckets.tolist()))}
    # the margin scales the uncertain part only: activations and workspace (parameter
    # bytes and the context are exact or nearly so; the MLP data shows it)
    var = np.maximum(np.array([margin_basis(p) for p in parts]), 1e-9)
    # each bucket gets its own (relative, absolute) pair: the smallest relative margin
    # giving the coverage in every data set with enough runs of it, at the absolute
    # part that gives the bucket's lowest median overestimate
    rel_by: dict[str, float] = {}
    abs_by: dict[str, float] = {}
    for b in MARGIN_BUCKETS:
        cells = [(buckets == b) & (groups == n) for n in names]
        cells = [m for m in cells if m.sum() >= MIN_BUCKET_ROWS]
        if not cells:
            continue
        best: tuple[float, float, float] | None = None
        for m_abs in np.arange(0.0, 513.0, 16.0):
            need = (y - base - m_abs) / var
            m_rel = max(0.0, *(float(np.quantile(need[m], coverage)) for m in cells))
            rel = (base + var * m_rel + m_abs - y) / y
            med_over = max(float(np.median(rel[m])) for m in cells)
            if best is None or med_over < best[0]:
                best = (med_over, m_rel, float(m_abs))
        assert best is not None
        rel_by[b], abs_by[b] = round(best[1], 4), best[2]
    return rel_by, abs_by, interval, by_interval


def _hidden_margin(rows: Sequence[Row], cal: Calibration, coverage: float
                   ) -> tuple[float, tuple[float, float]]:
    """Relative margin on the hidden blocks' activations (the visible part keeps its
    bucket's margin), and the ratio interval, on runs whose hidden blocks are mostly
    of one kind (feature maps or tokens: their structure differs, so does the guess)."""
    groups = np.array([r.group for r in rows])
    need, ratio = [], []
    for r in rows:
        parts = base_breakdown(r.features, cal)
        base = sum(parts.values())
        hidden = max(hidden_part(r.features, cal), 1e-9)
        visible = margin_mib(r.features, parts, replace(
            cal, margin_rel_by_bucket={**cal.margin_rel_by_bucket,
                                       **dict.fromkeys(HIDDEN_KINDS, 0.0)}))
        need.append((r.measured - base - visible) / hidden)
        ratio.append(r.measured / base)
    needs, ratios = np.array(need), np.array(ratio)
    cells = [groups == n for n in sorted(set(groups.tolist()))]
    cells = [m for m in cells if m.sum() >= MIN_BUCKET_ROWS] or [groups == groups]
    rel = max(0.0, *(float(np.quantile(needs[m], coverage)) for m in cells))
    return round(rel, 4), (round(float(np.quantile(ratios, 0.05)), 4),
                           round(float(np.quantile(ratios, 0.95)), 4))


def fit_quantile(rows: Sequence[Row], *, tau: float = 0.96, iters: int = 40,
                 ridge: float = 0.002) -> Calibration:
    """A learned alternative: the same features, but fitted directly as the ``tau``
    quantile of the measured peak (check loss by iteratively reweighted least squares),
    with no separate margin. Compared in the benchmark; shipped only if it wins."""
    x, y, w0, prior, lam, names = _problem(rows, ridge)
    c = _nnls_ridge(x * w0[:, None], y * w0, prior, lam)
    for _ in range(iters):
        r = (y - x @ c) / y
        w = w0 * np.sqrt(np.where(r > 0, tau, 1 - tau) / np.maximum(np.abs(r), 0.005))
        c = _nnls_ridge(x * w[:, None], y * w, prior, lam, init=c, iters=500)
    k = dict(zip(COLUMNS[1:], c[len(names):], strict=True))
    contexts = dict(zip(names, c[: len(names)], strict=True))
    return Calibration(
        context_mib=float(max(contexts.values())), k_params=float(k["params"]),
        k_act={cat: float(k[f"act_{cat}"]) for cat in CATEGORIES},
        k_scores=float(k["attn_scores"]), k_workspace=float(k["largest"]),
        margin_rel=0.0, margin_abs_mib=0.0, interval=(1.0, 1.0),
        context_by_dataset={n: round(float(v), 1) for n, v in contexts.items()},
    )
