"""The default estimator: physics of what training keeps, with calibrated constants.

peak = context + k_p x (weights + gradients + optimizer state + step temporaries)
       + sum over layer categories of k_c x (kept outputs, allocator-rounded)
       + k_s x attention scores + k_w x largest activation (workspace)
       + margin

The parameter terms and the per-layer bytes come from :mod:`slurm_colloc.estimators.physics` and
:mod:`slurm_colloc.estimators.features`; the constants (context, the k's) and the margin were
fitted on measured A100 peaks by :mod:`slurm_colloc.estimators.calibration` and live in
``estimators/data/calibration.json`` with the residual statistics they produced.
The relative margin scales activations and workspace only: the context and the
parameter bytes are the best known terms, the activations the least.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_colloc.estimators.attention import PRIOR as ATTENTION_PHYSICS
from slurm_colloc.estimators.attention import (
    AttentionMemory,
    attention_memory,
    encoder_tokens,
    head_mib,
    resolve_impl,
)
from slurm_colloc.estimators.base import Estimate, Job
from slurm_colloc.estimators.errors import EstimatorInputError
from slurm_colloc.estimators.features import (
    DEFAULT_SEQ_LEN,
    Features,
    compute,
    hidden_kind,
    margin_bucket,
)
from slurm_colloc.estimators.layers import CATEGORIES
from slurm_colloc.estimators.model import ModelSummary
from slurm_colloc.estimators.physics import activation_bytes_per_elem
from slurm_colloc.estimators.recognition import Recognition, recognise

CALIBRATION_FILE = Path(__file__).resolve().parent / "data" / "calibration.json"


TRACING_PRIOR = {"context_mib": 1500.0, "k": 1.2, "margin_rel": 0.5}
ATTENTION_PRIOR = {**ATTENTION_PHYSICS, "k_leaf": 1.0, "k_head": 3.0, "k_alloc": 1.05,
                   "margin_rel": 0.25, "margin_abs_mib": 256.0}
"""Transformer constants when none were fitted: every shown output kept once, the
last (logits) three times (the loss's log-softmax and the gradients), 5% allocator
overhead, a 25% margin."""
"""Tracing constants when none were fitted: a typical context, 20% allocator overhead,
a wide margin."""


@dataclass(frozen=True)
class Calibration:
    """Fitted constants of the layer-aware model (see ``calibration.json``)."""

    context_mib: float
    k_params: float
    k_act: dict[str, float]
    k_scores: float
    k_workspace: float
    margin_rel: float
    margin_abs_mib: float
    interval: tuple[float, float]
    """Ratio measured / unmargined estimate at the 5th and 95th percentile (training)."""
    context_by_dataset: dict[str, float] = field(default_factory=dict)
    """Context fitted per calibration data set (for the record)."""
    margin_rel_by_bucket: dict[str, float] = field(default_factory=dict)
    """Relative margin per architecture bucket
    (:func:`slurm_colloc.estimators.features.margin_bucket`);
    a bucket not listed gets :attr:`margin_rel` (the largest)."""
    margin_abs_by_bucket: dict[str, float] = field(default_factory=dict)
    """Absolute margin (MiB) per bucket; a bucket not listed gets :attr:`margin_abs_mib`."""
    interval_by_bucket: dict[str, tuple[float, float]] = field(default_factory=dict)
    tracing: dict[str, float] = field(default_factory=lambda: dict(TRACING_PRIOR))
    """The tracing estimator's constants: ``context_mib``, ``k`` (reserved / traced
    bytes) and ``margin_rel`` (on the traced part)."""
    attention: dict[str, float] = field(default_factory=lambda: dict(ATTENTION_PRIOR))
    """Transformer constants (:mod:`slurm_colloc.estimators.attention`), fitted on the exact tensor
    accounting of Hugging Face models (``attention_measurements.csv``): bytes per
    score / relative-score / context element, ``k_leaf`` and ``k_largest`` (the shown
    layers' outputs and the largest one: logits and their loss copies), ``k_alloc``
    (allocator overhead over exact tensors) and the margin (``margin_rel`` on the
    activation part, ``margin_abs_mib``)."""

    def conservative_margin(self) -> tuple[float, float]:
        """The largest relative and absolute margins of any bucket: what a model the
        rules cannot place (``unknown``, ``mixed``) gets."""
        rels = [self.margin_rel, *self.margin_rel_by_bucket.values(),
                self.attention.get("margin_rel", 0.0)]
        abss = [self.margin_abs_mib, *self.margin_abs_by_bucket.values(),
                self.attention.get("margin_abs_mib", 0.0)]
        return max(rels), max(abss)

    def rel_margin(self, bucket: str) -> float:
        """The relative margin for an architecture bucket (``unknown``: the largest)."""
        if bucket == "unknown":
            return self.conservative_margin()[0]
        return self.margin_rel_by_bucket.get(bucket, self.margin_rel)

    def abs_margin(self, bucket: str) -> float:
        """The absolute margin (MiB) for an architecture bucket (``unknown``: the largest)."""
        if bucket == "unknown":
            return self.conservative_margin()[1]
        return self.margin_abs_by_bucket.get(bucket, self.margin_abs_mib)

    def ratio_interval(self, bucket: str) -> tuple[float, float]:
        """5th-95th percentile of measured / unmargined estimate for a bucket."""
        return self.interval_by_bucket.get(bucket, self.interval)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        """Build from the JSON document written by :mod:`slurm_colloc.estimators.calibration`."""
        k = d["coefficients"]
        return cls(
            context_mib=float(d["context_mib"]),
            k_params=float(k["params"]),
            k_act={c: float(k.get(f"act_{c}", 1.0)) for c in CATEGORIES},
            k_scores=float(k["attn_scores"]),
            k_workspace=float(k["largest"]),
            margin_rel=float(d["margin"]["rel"]),
            margin_abs_mib=float(d["margin"]["abs_mib"]),
            interval=(float(d["interval"][0]), float(d["interval"][1])),
            context_by_dataset={
                str(a): float(b) for a, b in d.get("context_by_dataset", {}).items()},
            margin_rel_by_bucket={
                str(a): float(b) for a, b in d["margin"].get("rel_by_bucket", {}).items()},
            margin_abs_by_bucket={
                str(a): float(b) for a, b in d["margin"].get("abs_mib_by_bucket", {}).items()},
            interval_by_bucket={
                str(a): (float(b[0]), float(b[1]))
                for a, b in d.get("interval_by_bucket", {}).items()},
            tracing={**TRACING_PRIOR,
                     **{str(a): float(b) for a, b in d.get("tracing", {}).items()}},
            attention={**ATTENTION_PRIOR,
                       **{str(a): float(b) for a, b in d.get("attention", {}).items()
                          if isinstance(b, int | float)}},
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON document (inverse of :meth:`from_dict`)."""
        coef = {"params": self.k_params, "attn_scores": self.k_scores,
                "largest": self.k_workspace}
        coef.update({f"act_{c}": v for c, v in self.k_act.items()})
        return {"context_mib": self.context_mib, "coefficients": coef,
                "margin": {"rel": self.margin_rel, "abs_mib": self.margin_abs_mib,
                           "rel_by_bucket": self.margin_rel_by_bucket,
                           "abs_mib_by_bucket": self.margin_abs_by_bucket},
                "interval": list(self.interval),
                "interval_by_bucket": {b: list(v) for b, v in self.interval_by_bucket.items()},
                "context_by_dataset": self.context_by_dataset,
                "tracing": self.tracing,
                "attention": self.attention}


PRIOR = Calibration(
    context_mib=1500.0, k_params=1.0, k_act=dict.fromkeys(CATEGORIES, 1.0), k_scores=1.0,
    k_workspace=1.0, margin_rel=0.25, margin_abs_mib=0.0, interval=(0.7, 1.3),
)
"""Uncalibrated physics: every kept output counted once, a typical context. Used only
when no calibration file is present (and reported as such)."""

_cached: Calibration | None = None


def load_calibration(path: Path | None = None) -> Calibration:
    """The shipped calibration (cached), or :data:`PRIOR` if none is shipped."""
    global _cached
    if path is None and _cached is not None:
        return _cached
    p = path or CALIBRATION_FILE
    try:
        cal = Calibration.from_dict(json.loads(p.read_text()))
    except FileNotFoundError:
        cal = PRIOR
    if path is None:
        _cached = cal
    return cal


def _fixed_terms(f: Features, cal: Calibration) -> dict[str, float]:
    """Context, weights, gradients and optimizer state: the same in every breakdown."""
    return {
        "cuda_context": cal.context_mib,
        "weights": cal.k_params * f.params["weights"],
        "gradients": cal.k_params * f.params["gradients"],
        "optimizer_state": cal.k_params * (f.params["optimizer_state"]
                                           + f.params["optimizer_step"]),
    }


def base_breakdown(f: Features, cal: Calibration) -> dict[str, float]:
    """Unmargined MiB per component."""
    acts = sum(cal.k_act[c] * v for c, v in f.act.items())
    return {
        **_fixed_terms(f, cal),
        "activations": acts,
        "attention": cal.k_scores * f.attn_scores,
        "workspace": cal.k_workspace * f.largest,
    }


def transformer_path(summary: ModelSummary, rec: Recognition, job: Job) -> bool:
    """Whether the transformer model applies: attention layers recognised in a Hugging
    Face family or a ``print(model)``, Keras, Flax or JSON summary, or any attention
    model when the job
    names its attention implementation. Other tables with attention (timm models'
    torchinfo tables, the calibration data, where timm uses fused attention) keep the
    bucket model fitted on their measured peaks."""
    if not rec.attention:
        return False
    return (rec.hf or summary.format in TRANSFORMER_FORMATS
            or job.attention is not None)


TRANSFORMER_FORMATS = ("pytorch-print", "keras", "flax", "json")
"""Formats whose attention models take the transformer model whatever their family:
none of them is in the timm calibration data (torchinfo tables)."""


def transformer_breakdown(f: Features, am: AttentionMemory, head: float, cal: Calibration,
                          precision: str) -> dict[str, float]:
    """Unmargined MiB per component for a recognised transformer: the shown layers'
    outputs, the attention tensors no row shows (first principles, bytes per element
    fitted on exact tensor accounting) and the last output's copies (a language
    model's logits, the loss's log-softmax and their gradients: ``workspace``), each
    times the allocator overhead."""
    a = cal.attention
    k = a["k_alloc"]
    hmap, htok = hidden_parts(f, cal)
    visible = sum(f.act.values()) - f.act["hidden_conv"] - f.act["hidden_tok"]
    return {
        **_fixed_terms(f, cal),
        # blocks a shallow table shows whole keep their own calibrated coefficients
        "activations": k * a["k_leaf"] * max(0.0, visible - head) + hmap + htok,
        "attention": k * am.mib(a, activation_bytes_per_elem(precision) / 4.0),
        "workspace": k * a["k_head"] * head,
    }


def margin_basis(parts: dict[str, float]) -> float:
    """The part of an estimate the relative margin scales: activations, attention and
    workspace, the terms that depend on what the summary cannot show."""
    return parts["activations"] + parts.get("attention", 0.0) + parts["workspace"]


def hidden_parts(f: Features, cal: Calibration) -> tuple[float, float]:
    """MiB of activations estimated for feature-map and token blocks shown without
    their children."""
    return (cal.k_act["hidden_conv"] * f.act["hidden_conv"],
            cal.k_act["hidden_tok"] * f.act["hidden_tok"])


def hidden_part(f: Features, cal: Calibration) -> float:
    """MiB of activations estimated for blocks shown without their children."""
    return sum(hidden_parts(f, cal))


def margin_mib(f: Features, parts: dict[str, float], cal: Calibration,
               bucket: str | None = None) -> float:
    """The safety margin: the bucket's relative margin on the visible activations and
    workspace plus its absolute part, and the hidden-block margin on hidden blocks."""
    hmap, htok = hidden_parts(f, cal)
    bucket = bucket or margin_bucket(f)
    visible = max(0.0, margin_basis(parts) - hmap - htok)
    return (visible * cal.rel_margin(bucket) + cal.abs_margin(bucket)
            + hmap * cal.rel_margin("hidden_map") + htok * cal.rel_margin("hidden_tok"))


MIN_TABLE_DEPTH = 2
"""A torchinfo table whose rows stop above this depth while hiding blocks is refused:
on held-out timm models depth-1 tables left 65% of the jobs underestimated even with
the hidden-block margin (depth 2: 12%, depth 3: 6%). Parameter share is no guide
there: a VGG's visible classifier holds most parameters, its hidden convolutions
most activations."""


def _refuse_if_too_shallow(summary: ModelSummary, f: Features) -> None:
    # only cut-off containers count: a big primitive (an LSTM) is a complete layer
    if summary.format != "torchinfo" or not f.hidden_containers:
        return
    if f.table_depth >= MIN_TABLE_DEPTH:
        return
    raise EstimatorInputError(
        f"this torchinfo table stops at depth 1 and hides blocks ({f.hidden_share:.0%} of "
        "the parameters) without their layers, so their activations cannot be "
        "estimated; re-run torchinfo.summary(model, input_size=..., depth=10), or give "
        "the size with --colloc-mem")


@dataclass
class _Sized:
    """What one of the two models (transformer or per-bucket) makes of a job: the
    breakdown without the margin, the margin, and what the uncertainty reports."""

    f: Features
    """The features the breakdown used (the transformer model may recompute them
    with the encoder's length)."""
    parts: dict[str, float]
    bucket: str
    margin: float
    interval: tuple[float, float]
    """Measured/estimated ratio interval the 90% peak range is read from."""
    attention: dict[str, object] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _with_unshown_params(summary: ModelSummary, rec: Recognition) -> ModelSummary:
    """The summary with the parameters print(model) cannot show (XLNet's bare
    attention projections) added, so weights, gradients and optimizer state pay for
    them."""
    if not rec.unshown_params:
        return summary
    total = summary.total_params + rec.unshown_params
    return dataclasses.replace(summary, total_params=total, trainable_params=total)


def _size_transformer(summary: ModelSummary, rec: Recognition, job: Job, f: Features,
                      cal: Calibration) -> _Sized:
    """The transformer model: attention memory from the recognised cores at the job's
    implementation, the head's logits, the margin of the ``transformer`` bucket."""
    impl, source = resolve_impl(rec, job.attention)
    seq = f.seq_len or next((c.tokens for c in rec.cores if c.tokens), None) \
        or DEFAULT_SEQ_LEN
    enc = encoder_tokens(summary, rec, seq)
    if enc and enc > seq:  # Whisper: the encoder's layers see 1500 frames
        f = compute(summary, job.batch_size, enc, job.optimizer, job.precision,
                    decoder_seq=seq, decoder_start=rec.decoder_start)
    am = attention_memory(rec, job.batch_size, seq, impl, source, enc_seq=enc)
    head = head_mib(summary, job.batch_size, seq, job.precision)
    parts = transformer_breakdown(f, am, head, cal, job.precision)
    bucket, margin = _transformer_margin(f, parts, rec, cal)
    interval = (cal.attention.get("interval_lo", 0.8), cal.attention.get("interval_hi", 1.25))
    return _Sized(f=f, parts=parts, bucket=bucket, margin=margin, interval=interval,
                  attention={"implementation": impl, "implementation_source": source,
                             "seq_len": seq, "layers": len(rec.cores)},
                  notes=_implementation_notes(source))


def _transformer_margin(f: Features, parts: dict[str, float], rec: Recognition,
                        cal: Calibration) -> tuple[str, float]:
    """(bucket, margin MiB) of the transformer model: the attention margin, or the
    most conservative one for an unrecognised architecture; blocks shown without
    their children keep their own relative margins on their activations."""
    bucket = "transformer"
    rel, abs_mib = cal.attention["margin_rel"], cal.attention["margin_abs_mib"]
    if not rec.recognised:
        bucket = "unknown"
        rel, abs_mib = cal.conservative_margin()
    hmap, htok = hidden_parts(f, cal)
    margin = (max(0.0, margin_basis(parts) - hmap - htok) * rel + abs_mib
              + hmap * cal.rel_margin("hidden_map") + htok * cal.rel_margin("hidden_tok"))
    return bucket, margin


def _implementation_notes(source: str) -> list[str]:
    """Notes on where the attention implementation came from, when it was not shown
    or given: the assumption changes the score tensors by ``heads x seq^2``."""
    notes = []
    if source == "family":
        notes.append("T5's attention adds its relative position bias to an explicit "
                     "score matrix whatever attn_implementation says: eager-size "
                     "tensors counted")
    if source == "default":
        notes.append("attention implementation not shown: eager assumed (keeps "
                     "batch x heads x seq^2 tensors per layer); pass --attention "
                     "sdpa or flash if the job uses fused attention")
    return notes


def _size_by_bucket(rec: Recognition, f: Features, cal: Calibration) -> _Sized:
    """The per-bucket model (tables the transformer model does not take): the margin
    and interval of the architecture bucket the summary falls in."""
    parts = base_breakdown(f, cal)
    bucket = margin_bucket(f)
    if rec.attention and not bucket.startswith("attn_"):
        bucket = "attn_hidden"  # attention the rows do not show as such
    if not rec.recognised:
        bucket = "unknown"
    margin = margin_mib(f, parts, cal, bucket) if rec.recognised else (
        margin_basis(parts) * cal.rel_margin("unknown") + cal.abs_margin("unknown"))
    interval = cal.ratio_interval(hidden_kind(f) or bucket)
    return _Sized(f=f, parts=parts, bucket=bucket, margin=margin, interval=interval)


def _notes(rec: Recognition, job: Job, cal: Calibration, sized: _Sized) -> list[str]:
    """The caveats of one estimate, in the order users read them: what was added or
    assumed about the model, then what the calibration does not cover."""
    notes = []
    if rec.unshown_params:
        notes.append(f"{rec.unshown_params:,} parameters of attention modules that hold "
                     "them directly are not in print(model) and were added (XLNet)")
    notes += sized.notes
    if not rec.recognised:
        notes.append(f"architecture not recognised ({rec.kind}): the most conservative "
                     "margin applies")
    f = sized.f
    if f.seq_assumed:
        notes.append(f"summary has no shapes and no --seq-len: assumed {f.seq_len} tokens")
    if job.precision != "fp32":
        notes.append("mixed precision is modelled, not calibrated (no measured AMP data)")
    if job.optimizer not in ("adam", "adamw"):
        notes.append("calibrated on Adam runs; other optimizers change only exact terms")
    if f.hidden_share > 0:
        share = f"{f.hidden_share:.0%}" if f.hidden_share >= 0.005 else "under 1%"
        notes.append(f"{share} of the parameters sit in blocks the summary "
                     "shows without their layers (torchinfo's depth cut them off): what "
                     "they keep is estimated from their size, with a wider margin; "
                     "torchinfo.summary(..., depth=10) gives a tighter estimate")
    if cal is PRIOR:
        notes.append("no calibration file: uncalibrated physics priors")
    return notes


class LayerAwareEstimator:
    """Default estimator (see the module docstring)."""

    name = "layer-aware"

    def __init__(self, calibration: Calibration | None = None, name: str | None = None):
        self._cal = calibration
        if name:
            self.name = name

    @property
    def calibration(self) -> Calibration:
        """The constants in use (loaded lazily so import stays cheap)."""
        if self._cal is None:
            self._cal = load_calibration()
        return self._cal

    def estimate(self, summary: ModelSummary, job: Job) -> Estimate:
        """Estimate from the summary; see the module docstring for the formula."""
        cal = self.calibration
        rec = recognise(summary)
        fingerprint = summary.fingerprint()  # of the summary as given (the history key)
        summary = _with_unshown_params(summary, rec)
        f = compute(summary, job.batch_size, job.seq_len, job.optimizer, job.precision)
        _refuse_if_too_shallow(summary, f)
        if transformer_path(summary, rec, job):
            sized = _size_transformer(summary, rec, job, f, cal)
        else:
            sized = _size_by_bucket(rec, f, cal)
        parts, margin = sized.parts, sized.margin
        base = sum(parts.values())
        total = math.ceil(base + margin)
        parts["margin"] = margin
        lo, hi = sized.interval
        uncertainty: dict[str, object] = {
            "peak_90pct_mib": [math.floor(base * lo), math.ceil(base * hi)],
            "basis": ("5th-95th percentile of measured/estimated on the calibration split, "
                      f"architecture bucket {sized.bucket!r}"),
            "bucket": sized.bucket,
            "architecture": rec.to_json(),
            "notes": _notes(rec, job, cal, sized),
        }
        if sized.attention:
            uncertainty["attention"] = sized.attention
        return Estimate(
            estimate_mib=total,
            estimator=self.name,
            breakdown=parts,
            margin_mib=math.ceil(margin),
            fingerprint=fingerprint,
            uncertainty=uncertainty,
        )
