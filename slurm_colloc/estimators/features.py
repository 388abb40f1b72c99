"""From a parsed summary and a job (batch, sequence, optimizer, precision) to the
physical quantities the estimators combine: bytes kept per layer category (after the
allocator's rounding), attention score tensors, the largest single activation
(a proxy for cuDNN/cuBLAS workspaces and backward temporaries) and parameter bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from slurm_colloc.estimators.layers import (
    CATEGORIES,
    category,
    has_token_scores,
    is_composite,
    is_primitive,
    leaf_category,
)
from slurm_colloc.estimators.model import Layer, ModelSummary
from slurm_colloc.estimators.physics import (
    MIB,
    SegmentPacker,
    activation_bytes_per_elem,
    param_bytes,
)

DEFAULT_SEQ_LEN = 512
"""Sequence length assumed for a shape-less summary (``print(model)``) with no
``--seq-len`` and no position-embedding table to bound it."""

HEAD_DIM = 64
"""Attention head width assumed when counting score tensors (``heads = width / 64``,
the common choice of BERT, GPT-2, ViT)."""


@dataclass(frozen=True)
class Features:
    """Per-job physical quantities, all in MiB (activations already times the batch)."""

    act: dict[str, float]
    """Reserved MiB of each category's outputs, as if every output were kept once."""
    attn_scores: float
    """MiB of one ``heads x N x N`` score tensor per attention layer, summed."""
    largest: float
    """MiB of the largest single layer output (workspace / temporary proxy)."""
    params: dict[str, float]
    """Weights, gradients, optimizer state, optimizer step temporaries (MiB)."""
    seq_len: int | None
    seq_assumed: bool
    attention_rows: int = 0
    """Rows (leaves or containers) of an attention type: the summary shows attention
    even when its parameters sit in child layers (then no row is counted as such)."""
    hidden_share: float = 0.0
    """Share of the parameters inside blocks shown without their children."""
    hidden_containers: int = 0
    """Hidden rows that are containers by name (blocks, attention modules, composites),
    as opposed to big unknown layers."""
    table_depth: int = 0
    """Deepest row of the table (torchinfo's ``depth``)."""
    conv_layers: int = 0
    """Convolution leaves (a stem of one or two is not a convolutional network)."""
    custom_params: bool = False
    """Some leaf of an unknown type holds parameters (ResMLP's ``Affine``)."""
    std_conv: bool = False
    """Weight-standardised convolutions (NF-nets' ``ScaledStdConv2d``): their gains and
    standardisation are functions the summary hides."""


MARGIN_BUCKETS = ("mlp", "cnn", "normfree", "attn_explicit", "attn_hidden")
"""Architecture buckets the safety margin is calibrated per (see :func:`margin_bucket`)."""
HIDDEN_KINDS = ("hidden_map", "hidden_tok")
"""Margin keys of blocks shown without their children (feature-map and token blocks):
their own relative margins apply to their activations only (the rest of the model
keeps its bucket's)."""


def hidden_kind(f: Features) -> str | None:
    """Which hidden-block margin dominates this job (None: the summary hides nothing)."""
    hc, ht = f.act["hidden_conv"], f.act["hidden_tok"]
    if not hc and not ht:
        return None
    return "hidden_map" if hc >= ht else "hidden_tok"


def margin_bucket(f: Features) -> str:
    """Which margin bucket a job falls in, by what its summary can and cannot show.

    * ``attn_hidden``: attention layers whose token x token probabilities the summary
      does not show (fused kernels keep none, explicit ones keep ``heads x N x N``:
      the summary cannot tell which, so the residuals are wide);
    * ``attn_explicit``: attention with its probabilities visible as a layer output;
    * ``normfree``: convolutional nets without a fused normalisation (NF-nets' scaled
      weight-standardised convolutions and gains, EvoNorm / FRN composites): their
      elementwise ops are functions, not modules, so the summary hides kept tensors;
    * ``cnn``: convolutional nets with BatchNorm / LayerNorm / GroupNorm modules, or
      plain ones without any normalisation (VGG, AlexNet: nothing hidden);
    * ``mlp``: everything else (linear layers, activations, norms, dropout).

    Blocks shown without their children do not decide the bucket: their activations
    carry the :data:`HIDDEN_KINDS` margins instead.
    """
    a = f.act
    if a["attention"] > 0 or a["attn_probs"] > 0 or f.attn_scores > 0 or f.attention_rows:
        return "attn_explicit" if a["attn_probs"] > 0 else "attn_hidden"
    if a["conv"] > 0:
        if (a["norm_composite"] > 0 or f.std_conv
                or (a["norm"] == 0 and f.conv_layers <= STEM_CONVS and f.custom_params)):
            return "normfree"
        return "cnn"
    return "mlp"


STEM_CONVS = 2
"""A network with at most this many convolutions, no normalisation module and layers
of unknown types holding parameters is not a plain CNN (ResMLP: a patch stem, then
``Affine`` ops whose elementwise work the summary hides)."""
_STD_CONV = re.compile(r"(std|scaled|ws)\w*conv|conv\w*(std|ws)\d?d?$", re.IGNORECASE)


def seq_scale(summary: ModelSummary, seq_len: int | None) -> tuple[float, int | None, bool]:
    """Activation scale for a requested sequence length, the effective length, and
    whether it was assumed rather than given."""
    if summary.has_shapes:
        if seq_len and summary.seq_len:
            return seq_len / summary.seq_len, seq_len, False
        return 1.0, summary.seq_len, False
    if seq_len:
        return 1.0, seq_len, False
    bound = summary.meta.get("max_positions")
    return 1.0, int(bound) if bound else DEFAULT_SEQ_LEN, True


def compute(summary: ModelSummary, batch_size: int, seq_len: int | None, optimizer: str,
            precision: str, *, decoder_seq: int | None = None,
            decoder_start: int | None = None) -> Features:
    """Compute the features of one job. For an encoder-decoder model whose decoder
    sees another length than its encoder (Whisper), ``seq_len`` is the encoder's and
    the layers from index ``decoder_start`` on (the decoder and its head) use
    ``decoder_seq``."""
    scale, eff_seq, assumed = seq_scale(summary, seq_len)
    # only torchinfo cuts blocks off, and only at the table's deepest level
    table_depth = max((la.depth for la in summary.layers), default=0)
    walk = _Walk(batch_size=batch_size, bpe=activation_bytes_per_elem(precision),
                 scale=scale, cut_depth=table_depth if summary.format == "torchinfo" else -1)
    parents: list[str] = []  # type of the enclosing row at each depth
    for index, layer in enumerate(summary.layers):
        if decoder_start is not None and index == decoder_start and decoder_seq:
            eff_seq = decoder_seq
        walk.row(layer, _enclosing_type(parents, layer), eff_seq)
    pb = param_bytes(summary.total_params, summary.trainable_params, optimizer, precision)
    return Features(
        act={c: p.reserved() / MIB for c, p in walk.packers.items()},
        attn_scores=walk.scores,
        largest=walk.largest / MIB,
        params={k: v / MIB for k, v in pb.items()},
        seq_len=eff_seq,
        seq_assumed=assumed,
        attention_rows=walk.attention_rows,
        hidden_share=(walk.hidden_params / summary.total_params
                      if summary.total_params else 0.0),
        hidden_containers=walk.hidden_containers,
        table_depth=table_depth,
        conv_layers=walk.conv_layers,
        std_conv=walk.std_conv,
        custom_params=walk.custom_params,
    )


def _enclosing_type(parents: list[str], layer: Layer) -> str:
    """Type of the row enclosing ``layer`` ("" at the top), keeping ``parents`` (the
    type of the enclosing row at each depth) in step with the pre-order walk: tables
    give depths, not parent links, and ``attn_probs`` needs to know the parent."""
    del parents[layer.depth:]
    parent = parents[-1] if parents else ""
    parents.extend([layer.type] * (layer.depth + 1 - len(parents)))
    return parent


def _new_packers() -> dict[str, SegmentPacker]:
    """One allocator-pool packer per category, in :data:`CATEGORIES` order (the order
    of :attr:`Features.act`)."""
    return {c: SegmentPacker() for c in CATEGORIES}


@dataclass
class _Walk:
    """One pass over a summary's rows for one job: the job's scale factors and the
    running totals :class:`Features` is built from. Mutable on purpose: the rows are
    visited once, in order, and each adds to the totals."""

    batch_size: int
    bpe: float
    """Bytes per saved activation element (precision)."""
    scale: float
    """Activation scale of the requested sequence length over the summary's."""
    cut_depth: int
    """Depth at which torchinfo cut blocks off (-1: the format cuts nothing)."""
    packers: dict[str, SegmentPacker] = field(default_factory=_new_packers)
    largest: float = 0.0
    scores: float = 0.0
    attention_rows: int = 0
    conv_layers: int = 0
    std_conv: bool = False
    custom_params: bool = False
    hidden_params: int = 0
    hidden_containers: int = 0

    def row(self, layer: Layer, parent: str, seq: int | None) -> None:
        """Add one row (leaf or container) seen at sequence length ``seq``. Score
        tensors are counted before the model row is skipped: an attention module
        shown as the whole model still keeps them."""
        self.attention_rows += category(layer.type) == "attention"
        n = layer.out_elems(seq)
        if has_token_scores(layer.type) and n:
            self.scores += self._score_mib(layer.output_shape, seq, layer.width)
        if not n or (layer.depth == 0 and not layer.leaf):
            return  # the model row itself (tree formats)
        nbytes = n * (self.batch_size * self.bpe * self.scale)
        if not layer.leaf:
            # a container's outputs are its children's, unless it computes itself
            cat = leaf_category(layer.type, layer.params) if layer.params > 0 else "container"
            self.packers[cat].add(nbytes)
            return
        self._leaf(layer, parent, nbytes, seq)

    def _leaf(self, layer: Layer, parent: str, nbytes: float, seq: int | None) -> None:
        """Add a leaf's output: to its category, to ``attn_probs`` when it is the
        square probability tensor inside an attention module, or, for a block the
        table shows without its children, to the hidden-block pools."""
        cat = leaf_category(layer.type, layer.params)
        self.custom_params = self.custom_params or (cat == "other" and layer.params > 0)
        if cat == "conv":
            self.conv_layers += 1
            self.std_conv = self.std_conv or bool(_STD_CONV.search(layer.type))
        shape = layer.output_shape
        kind, width = _block_geometry(shape, layer.width, layer.params)
        hidden = (layer.depth == self.cut_depth and layer.params > 0
                  and not is_primitive(layer.type))
        if hidden and (cat in ("block", "attention") or is_composite(layer.type)
                       or (cat in ("act", "other") and layer.params >= width**2)):
            # a block shown without its children: attention modules, MLPs, gated
            # activations and unknown modules holding width x width matrices included
            self._hidden_block(layer, cat, nbytes, kind, width, seq)
        else:
            if (category(parent) == "attention"
                    and cat in ("dropout", "softmax", "free", "other")
                    and shape is not None and len(shape) >= 2 and shape[-1] == shape[-2]):
                cat = "attn_probs"
            self.packers[cat].add(nbytes)
        self.largest = max(self.largest, nbytes)

    def _hidden_block(self, layer: Layer, cat: str, nbytes: float, kind: str, width: int,
                      seq: int | None) -> None:
        """Add a block whose children the table cut off. Its parameters stand for what
        it keeps: one output-sized tensor per width x width matrix they pay for (a 3x3
        convolution pays 9: a guess, hence a margin bucket of its own)."""
        self.hidden_params += layer.params
        self.hidden_containers += cat in ("block", "attention") or is_composite(layer.type)
        count = max(1, round(layer.params / width**2))
        if kind == "map":
            self.packers["hidden_conv"].add(nbytes, count=count)
            return
        self.packers["hidden_tok"].add(nbytes, count=count)
        shape = layer.output_shape
        if (count >= TRANSFORMER_LAYER_RATIO and shape is not None and len(shape) >= 2
                and not has_token_scores(layer.type)):
            # parameters of attention + MLP (4 + 8 width^2): its hidden score
            # tensors are counted as for a visible attention layer
            self.scores += self._score_mib(shape, seq, layer.width, heads_width=width)

    def _score_mib(self, shape: tuple[int, ...] | None, seq: int | None,
                   layer_width: int | None, heads_width: int | None = None) -> float:
        """MiB of one ``heads x N x N`` score tensor per group of an attention output,
        times the batch. Visible attention rows and hidden transformer blocks share it
        so both count scores alike; a hidden block passes ``heads_width`` (its width
        read from its parameters) instead of the output's channels."""
        groups, tokens, channels = _attention_geometry(shape, seq, layer_width)
        tokens = int(tokens * self.scale)
        heads = max(1, (channels if heads_width is None else heads_width) // HEAD_DIM)
        return self.batch_size * groups * heads * tokens * tokens * self.bpe / MIB


TRANSFORMER_LAYER_RATIO = 10
"""A hidden token block with at least this many width^2 parameters is taken for a
transformer layer (4 for attention + 8 for a 4x MLP = 12)."""

PLAUSIBLE_MATRICES = (0.25, 64.0)
"""A block's parameters are a few to a few dozen width x width matrices: the range in
which ``params / width^2`` tells which dimension of an ambiguous shape is the width."""


def _block_geometry(shape: tuple[int, ...] | None, width: int | None,
                    params: int = 0) -> tuple[str, int]:
    """(``map`` or ``tokens``, channel width) of a hidden block's output.

    ``[C, H, W]`` with ``H == W`` is a feature map and ``[H, W, C]`` with ``H == W``
    channels-last tokens (Swin); ``[N, C]`` are tokens. Otherwise (non-square images,
    ``[C, D, H, W]`` video, ``[G, N, C]`` token groups as in NesT) the width is the
    first or the last dimension, whichever makes ``params / width^2`` a plausible
    number of matrices; when both do, the PyTorch layout ``[C, ...]`` wins.
    """
    if not shape:
        return "tokens", max(1, width or 1)
    if len(shape) < 3:
        return "tokens", max(1, shape[-1])
    if len(shape) == 3 and shape[1] == shape[2]:
        return "map", max(1, shape[0])
    if len(shape) == 3 and shape[0] == shape[1] != shape[2]:
        return "tokens", max(1, shape[-1])
    lo, hi = PLAUSIBLE_MATRICES
    first, last = max(1, shape[0]), max(1, shape[-1])
    if params <= 0 or lo <= params / first**2 <= hi:
        return "map", first
    if lo <= params / last**2 <= hi:
        return "tokens", last
    # neither plausible: the reading with the fewer matrices is the less absurd one
    return ("map", first) if first >= last else ("tokens", last)


def _attention_geometry(shape: tuple[int, ...] | None, seq: int | None,
                        width: int | None) -> tuple[int, int, int]:
    """(independent groups, tokens per group, channels) of an attention output.

    ``[C, H, W]`` with ``H == W`` is a feature map (tokens = H*W); otherwise the last
    dimension is the channel width, the one before it the tokens, and any leading
    dimensions are independent windows / blocks (attention is within each). A flat
    shape says nothing about tokens: no score tensor is counted for it.
    """
    if shape is None:
        return 1, (seq or 1), (width or HEAD_DIM)
    if len(shape) < 2:
        return 0, 0, 0
    if len(shape) == 3 and shape[1] == shape[2]:
        return 1, shape[1] * shape[2], shape[0]
    return _prod(shape[:-2]), shape[-2], shape[-1]


def _prod(xs: tuple[int, ...]) -> int:
    p = 1
    for x in xs:
        p *= x
    return p
