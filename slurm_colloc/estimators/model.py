"""The one typed structure every summary parser returns.

Parsers differ in what they can see (torchinfo shows a tree with output shapes,
``print(model)`` only constructor arguments), so the structure keeps what is common:
leaf layers with their type, per-sample output shape (batch dimension removed, so the
same model summarised at batch 1 or 32 gives the same structure and the same
fingerprint) and parameter count, plus the totals the tool printed.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Layer:
    """One layer (module) of the model.

    ``output_shape`` is per sample (no batch dimension); ``None`` when the format does
    not show shapes. ``width`` is the per-token feature width for shape-less formats
    (``print(model)``): the output then has ``seq_len x width`` elements per sample.
    ``leaf`` is False for containers whose children are listed too (their outputs
    are the children's, counting them again would double the activations).
    """

    type: str
    params: int = 0
    output_shape: tuple[int, ...] | None = None
    width: int | None = None
    depth: int = 0
    leaf: bool = True
    trainable: bool = True
    dropout_p: float | None = field(default=None, compare=False)
    """A dropout layer's probability when the format shows it (``Dropout(p=0.1)``)."""
    name: str = field(default="", compare=False)
    """The attribute name the format shows (``print(model)``'s ``(query)``), if any: a
    hint for architecture recognition, never part of the fingerprint."""

    def out_elems(self, seq_len: int | None) -> int:
        """Output elements per sample (``seq_len`` used only by shape-less layers)."""
        if self.output_shape is not None:
            return math.prod(self.output_shape) if self.output_shape else 1
        if self.width is not None:
            return self.width * (seq_len or 1)
        return 0


@dataclass(frozen=True)
class ModelSummary:
    """A parsed model summary: layers plus the totals (parameters are authoritative)."""

    format: str
    layers: tuple[Layer, ...]
    total_params: int
    trainable_params: int
    seq_len: int | None = None
    """Sequence length the summary was made at, when it shows one (token models)."""
    input_shape: tuple[int, ...] | None = None
    meta: dict[str, str] = field(default_factory=dict, compare=False)
    containers: tuple[Layer, ...] = field(default=(), compare=False)
    """Container modules a format shows but keeps out of :attr:`layers` (``print(model)``
    lists ``BertSelfAttention(`` above its Linear children): they own no activations
    but tell what the model is (:mod:`slurm_colloc.estimators.recognition`). Tree formats
    (torchinfo) keep their containers in :attr:`layers` as non-leaf rows."""

    @property
    def all_rows(self) -> tuple[Layer, ...]:
        """Every row the summary shows: layers and containers."""
        return self.layers + self.containers if self.containers else self.layers

    @property
    def leaves(self) -> tuple[Layer, ...]:
        """The layers that own activations (containers with listed children excluded)."""
        return tuple(layer for layer in self.layers if layer.leaf)

    @property
    def has_shapes(self) -> bool:
        """Whether output shapes are known (otherwise ``seq_len x width`` is used)."""
        return any(layer.output_shape is not None for layer in self.layers)

    def fingerprint(self) -> str:
        """A stable lowercase hex digest of the normalised content.

        Lowercase hex because Slurm 22.05 lowercases AdminComment; normalised (per
        sample shapes, leaves only, totals) so that whitespace, column widths, the
        batch size the summary was made at and the tool that printed it (where the
        content is the same) do not change it. The history hook keys on it.
        """
        canon = {
            "v": 1,
            "total": self.total_params,
            "trainable": self.trainable_params,
            "seq": self.seq_len,
            "layers": [
                [lay.type.lower(), lay.params, list(lay.output_shape or ()), lay.width or 0]
                for lay in self.leaves
            ],
        }
        blob = json.dumps(canon, separators=(",", ":"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:32]
