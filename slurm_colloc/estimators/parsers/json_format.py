"""Our own JSON summary format, for tools that can emit structured data.

Documented in ``docs/estimators.md``::

    {"format": "colloc-summary/1",
     "name": "resnet50",                      (optional)
     "seq_len": null,                         (optional, token models)
     "total_params": 25557032,                (optional: sum of layer params)
     "trainable_params": 25557032,            (optional: = total_params)
     "layers": [
        {"type": "Conv2d", "output_shape": [64, 112, 112], "params": 9408},
        {"type": "Linear", "width": 768, "params": 590592},   (per-token width)
        ...]}

``output_shape`` is per sample (no batch dimension). Every listed layer is a leaf.
"""

from __future__ import annotations

import json
from typing import Any

from slurm_colloc.estimators.errors import SummaryParseError
from slurm_colloc.estimators.model import Layer, ModelSummary

FORMAT_TAG = "colloc-summary/1"


def looks_like(text: str) -> bool:
    """A JSON object (first non-space character ``{``)."""
    return text.lstrip().startswith("{")


def _nonneg_int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise SummaryParseError(f"json: {what} must be a non-negative integer, got {v!r}")
    return v


def parse(text: str) -> ModelSummary:
    """Parse the JSON summary format (strictly: unknown keys are errors)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise SummaryParseError(f"json: {e.msg}", line_no=e.lineno) from None
    except RecursionError:
        raise SummaryParseError("json: nested too deeply; not a model summary") from None
    except ValueError as e:  # an integer with more digits than int() converts
        raise SummaryParseError(f"json: {str(e)[:80]}") from None
    if not isinstance(doc, dict):
        raise SummaryParseError("json: top level must be an object")
    if doc.get("format") != FORMAT_TAG:
        raise SummaryParseError(f"json: 'format' must be {FORMAT_TAG!r}")
    unknown = set(doc) - {"format", "name", "seq_len", "total_params", "trainable_params",
                          "layers", "input_shape"}
    if unknown:
        raise SummaryParseError(f"json: unknown key(s) {', '.join(sorted(unknown))}")
    raw_layers = doc.get("layers")
    if not isinstance(raw_layers, list) or not raw_layers:
        raise SummaryParseError("json: 'layers' must be a non-empty list")
    layers = []
    for k, lay in enumerate(raw_layers):
        if not isinstance(lay, dict) or not isinstance(lay.get("type"), str) or not lay["type"]:
            raise SummaryParseError(f"json: layers[{k}] needs a non-empty string 'type'")
        extra = set(lay) - {"type", "output_shape", "params", "width", "trainable"}
        if extra:
            raise SummaryParseError(f"json: layers[{k}]: unknown key(s) {', '.join(sorted(extra))}")
        shape = lay.get("output_shape")
        if shape is not None:
            if not isinstance(shape, list):
                raise SummaryParseError(f"json: layers[{k}].output_shape must be a list")
            shape = tuple(_nonneg_int(d, f"layers[{k}].output_shape") for d in shape)
        width = lay.get("width")
        layers.append(Layer(
            type=lay["type"],
            params=_nonneg_int(lay.get("params", 0), f"layers[{k}].params"),
            output_shape=shape,
            width=None if width is None else _nonneg_int(width, f"layers[{k}].width"),
            trainable=bool(lay.get("trainable", True)),
        ))
    total = doc.get("total_params")
    total = sum(la.params for la in layers) if total is None else _nonneg_int(total, "total_params")
    trainable = doc.get("trainable_params")
    trainable = total if trainable is None else _nonneg_int(trainable, "trainable_params")
    seq = doc.get("seq_len")
    seq = None if seq is None else _nonneg_int(seq, "seq_len")
    return ModelSummary(format="json", layers=tuple(layers), total_params=total,
                        trainable_params=trainable, seq_len=seq or None,
                        meta={"name": str(doc.get("name", ""))})
