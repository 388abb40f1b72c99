"""Fit the transformer constants on the exact tensor accounting of Hugging Face models
(``estimators/data/attention_measurements.csv``, made by
``estimators/data/make_attention_data.py``).

Used by ``benchmarks/estimator_accuracy.py --calibrate`` (never at estimate time; it
needs numpy). Each measured run is one training step's traced peak (MiB) of a model
whose ``print(model)`` is in ``attention_summaries.jsonl``; the design has one column
per physical term the estimator computes from that summary:

    traced = k_p x parameter bytes + k_leaf x shown outputs (but the last)
           + k_head x the last output (logits, which the loss copies)
           + score_bytes x eager score elements (attention dropout)
           + nodrop_bytes x eager score elements (no attention dropout)
           + rel_bytes x relative score elements
           + token_bytes x attention context elements + lse_bytes x fused log-sum-exp

Relative-error least squares with non-negative coefficients, pulled weakly towards
the physics prior. The margin is split-conformal **by model family**: each family's
runs are predicted by a fit on the other families (leave one family out), and the
relative margin on the activation part is the ``coverage`` quantile of what those
held-out runs needed (all depths: a two-layer language model is mostly its logits,
which matter in a full GPT-2 too; restricted to six layers and more, the margin was
17% and nested leave-one-family-out coverage 90.7%, against 95.4% this way).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from slurm_colloc.estimators.attention import PRIOR as PHYSICS
from slurm_colloc.estimators.attention import (
    attention_memory,
    encoder_tokens,
    head_mib,
    resolve_impl,
)
from slurm_colloc.estimators.calibration import _nnls_ridge
from slurm_colloc.estimators.features import compute
from slurm_colloc.estimators.model import ModelSummary
from slurm_colloc.estimators.parsers import parse_summary
from slurm_colloc.estimators.physics import MIB
from slurm_colloc.estimators.recognition import recognise

DATA = Path(__file__).resolve().parent / "data"
CSV_PATH = DATA / "attention_measurements.csv"
SUMMARIES_PATH = DATA / "attention_summaries.jsonl"
COLUMNS = ("params", "leaf", "head", "score", "nodrop", "rel", "token", "lse")
PRIOR = np.array([1.0, 1.0, 3.0, PHYSICS["score_bytes"], PHYSICS["nodrop_bytes"],
                  PHYSICS["score_bytes"] * PHYSICS["rel_factor"], PHYSICS["token_bytes"],
                  PHYSICS["lse_bytes"]])
FIXED = (6, 7)
"""Columns held at their physical value (the context tensor and the fused kernels'
log-sum-exp are exact; the data cannot separate them from the shown outputs)."""


@dataclass(frozen=True)
class TracedRun:
    """One traced training step."""

    family: str
    impl: str
    batch: int
    seq: int
    layers: int
    traced_mib: float
    x: tuple[float, ...]
    """Design row (MiB per unit coefficient, :data:`COLUMNS`) with the run's real
    attention dropout: what the fit sees."""
    x_est: tuple[float, ...]
    """The same as the estimator computes it from the summary alone (attention dropout
    assumed where the summary does not show it): what the held-out checks predict."""


ATTENTION_DROPOUT = {"bert": True, "roberta": True, "gpt2": True, "t5": True, "xlnet": True,
                     "vit": False, "deit": False, "whisper": False, "llama": False,
                     "gpt_neo": False, "gptj": False}
"""Whether the measured models' attention probabilities go through dropout (the
Hugging Face configuration defaults ``make_attention_data.py`` builds them with).
print(model) shows it for some (``attn_dropout``: ``Dropout(p=0.0)``), not for others
(ViT, Whisper use functional dropout): the estimator then assumes dropout, the fit
uses what the runs had."""


def design(summary: ModelSummary, batch: int, seq: int, impl: str,
           dropout: bool | None = None) -> tuple[float, ...]:
    """The design row of one run (see the module docstring), computed exactly as the
    estimator computes it for ``--seq-len seq``."""
    rec = recognise(summary)
    impl = resolve_impl(rec, impl)[0]
    enc = encoder_tokens(summary, rec, seq)
    f = compute(summary, batch, max(seq, enc or 0), "adam", "fp32", decoder_seq=seq,
                decoder_start=rec.decoder_start)
    am = attention_memory(rec, batch, seq, impl, "option", enc_seq=enc, dropout=dropout)
    head = head_mib(summary, batch, seq, "fp32")
    return (sum(f.params.values()), sum(f.act.values()) - head, head, am.score_elems / MIB,
            am.nodrop_elems / MIB, am.rel_elems / MIB, am.token_elems / MIB,
            am.lse_elems / MIB)


def load(csv_path: Path = CSV_PATH, summaries_path: Path = SUMMARIES_PATH) -> list[TracedRun]:
    """The measured runs with their design rows."""
    summaries: dict[tuple[str, str, int], ModelSummary] = {}
    for line in summaries_path.read_text().splitlines():
        rec = json.loads(line)
        key = (rec["family"], rec["impl"], int(rec.get("layers", 2)))
        summaries[key] = parse_summary(rec["summary"])
    runs = []
    with csv_path.open() as f:
        for r in csv.DictReader(f):
            key = (r["family"], r["impl"], int(r["layers"]))
            if key not in summaries:
                continue
            b = int(r["batch"])
            # the length the job names: the decoder's in an encoder-decoder model
            s = int(r["dec_seq"]) if int(r["dec_seq"] or 0) else int(r["seq"])
            runs.append(TracedRun(r["family"], r["impl"], b, s, int(r["layers"]),
                                  float(r["traced_peak_mib"]),
                                  design(summaries[key], b, s, r["impl"],
                                         ATTENTION_DROPOUT.get(r["family"])),
                                  design(summaries[key], b, s, r["impl"])))
    return runs


def fit_coefficients(runs: Sequence[TracedRun], ridge: float = 1e-3,
                     irls_iters: int = 8) -> np.ndarray:
    """Coefficients of :data:`COLUMNS` (relative least squares, IRLS towards L1; the
    :data:`FIXED` columns stay at their physical values)."""
    x = np.array([r.x for r in runs])
    y_all = np.array([r.traced_mib for r in runs])
    y = y_all - sum(PRIOR[j] * x[:, j] for j in FIXED)
    x = x.copy()
    x[:, list(FIXED)] = 0.0
    w = 1.0 / y_all
    # scale columns so that the ridge pull is comparable across units
    lam = np.full(len(COLUMNS), ridge) * (np.square(x * w[:, None]).sum(axis=0) + 1e-12)
    c = _nnls_ridge(x * w[:, None], y * w, PRIOR, lam)
    for _ in range(irls_iters):
        res = np.abs(y - x @ c) / y_all
        wr = w / np.sqrt(np.maximum(res, 0.02))
        c = _nnls_ridge(x * wr[:, None], y * wr, PRIOR, lam, init=c)
    for j in FIXED:
        c[j] = PRIOR[j]
    return c


def split_parts(c: np.ndarray, x: Sequence[float]) -> tuple[float, float]:
    """(parameter part, activation part) of a prediction."""
    xs = np.asarray(x)
    return float(c[0] * xs[0]), float(c[1:] @ xs[1:])


def held_out_by_family(runs: Sequence[TracedRun]) -> list[tuple[TracedRun, float, float]]:
    """Every run predicted by a fit on the other families, from what its summary shows
    (as the estimator sees it): (run, parameter part, activation part)."""
    out = []
    for fam in sorted({r.family for r in runs}):
        train = [r for r in runs if r.family != fam]
        c = fit_coefficients(train)
        out += [(r, *split_parts(c, r.x_est)) for r in runs if r.family == fam]
    return out


def margin(held: Sequence[tuple[TracedRun, float, float]], coverage: float = 0.96,
           k_params: float | None = None) -> float:
    """Relative margin on the activation part that keeps ``coverage`` of the held-out
    runs from being underestimated. With ``k_params`` the parameter part is the
    estimator's (the measured-peak calibration's coefficient on the parameter bytes),
    not the traced fit's."""
    need = [(r.traced_mib - (p if k_params is None else k_params * r.x_est[0])) / a - 1.0
            for r, p, a in held if a > 0]
    return max(0.0, float(np.quantile(need, coverage)))


ALLOCATOR_OVERHEAD = 1.05
"""Reserved over exact tensor bytes for a transformer step (large, regular tensors:
the caching allocator's rounding and fragmentation; no cuDNN workspaces). Modelled,
not measured here (no GPU): the margin covers the spread around it."""


def fit(runs: Sequence[TracedRun], coverage: float = 0.96,
        k_params: float | None = None) -> dict[str, float]:
    """The ``attention`` section of calibration.json (``k_params``: the estimator's
    coefficient on the parameter bytes, from the measured-peak calibration)."""
    c = fit_coefficients(runs)
    held = held_out_by_family(runs)
    rel = margin(held, coverage, k_params)
    ratios = sorted((p + a) / r.traced_mib for r, p, a in held)
    score = float(c[3])
    return {
        "k_params_traced": round(float(c[0]), 4),
        "k_leaf": round(float(c[1]), 4),
        "k_head": round(float(c[2]), 4),
        "score_bytes": round(score, 4),
        "nodrop_bytes": round(float(c[4]), 4),
        "rel_factor": round(float(c[5]) / score, 4) if score > 0 else 1.0,
        "token_bytes": round(float(c[6]), 4),
        "lse_bytes": round(float(c[7]), 4),
        "k_alloc": ALLOCATOR_OVERHEAD,
        "margin_rel": round(rel, 4),
        "margin_abs_mib": 64.0,
        "interval_lo": round(float(np.quantile([1 / x for x in ratios], 0.05)), 4),
        "interval_hi": round(float(np.quantile([1 / x for x in ratios], 0.95)), 4),
        "runs": float(len(runs)),
        "families": float(len({r.family for r in runs})),
    }
