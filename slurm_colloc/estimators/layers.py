"""Layer taxonomy: which layer types keep what for the backward pass.

Autograd keeps, per layer, the tensors its backward needs. Consecutive layers share
tensors (a convolution saves its input, which is the previous ReLU's saved output),
so to first order every leaf's *output* is kept once, in the activation dtype. The
exceptions are what this module encodes: views and identities keep nothing, dropout
adds a one-byte mask, max-pooling adds int64 indices, attention blocks hide their
q/k/v and (unless fused) score tensors behind a single output shape, and containers
shown without their children (a truncated torchinfo depth) hide a whole block.

Names come from PyTorch, timm, Hugging Face and Keras; matching is on the class name
only, so a custom layer falls into ``other`` (counted like an ordinary layer).
"""

from __future__ import annotations

import functools
import re

CATEGORIES = (
    "conv", "linear", "norm", "norm_composite", "act", "softmax", "dropout", "pool_max", "pool",
    "embedding", "attention", "attn_probs", "block", "free", "other", "container",
    "hidden_conv", "hidden_tok",
)
"""``norm_composite``: normalisations written as several elementwise ops (EvoNorm,
filter/global response norm, RMSNorm) keep several input-sized tensors, where a fused
BatchNorm/LayerNorm kernel keeps one.
``attn_probs``: a token x token tensor inside an attention layer (its softmax or
dropout row is shown only when the attention is computed explicitly, not fused).
``hidden_conv`` / ``hidden_tok``: blocks shown without their children (torchinfo's
``depth`` cut them off; its default of 3 hides every transformer layer), feature-map
and token blocks. Each counts its output ``params / width^2`` times, the number of
width x width matrices its parameters pay for (12 for a standard transformer layer);
what they really keep is a guess, so they have their own coefficients and margins.
``container``: outputs of containers whose children are shown; a residual add's
result is such an output and is kept by the next normalisation, but is never a
leaf's output (overlaps are why its coefficient is fitted, not assumed)."""

_RULES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (cat, re.compile(rx, re.IGNORECASE))
    for cat, rx in (
        ("free", r"^(identity|flatten|unflatten|reshape|permute|inputlayer|view|"
                 r"zeropadding\dd|cropping\dd|add|concatenate|multiply|lambda|"
                 r"stochasticdepth|droppath|layerscale\w*|scale(\dd)?)$"),
        ("dropout", r"dropout"),
        ("attention", r"(attention|attn|^(mhsa|gpsa|mhsa\w*|\w*mla)$)"),
        ("softmax", r"^(log|radix)?softmax\d?d?$"),
        ("norm_composite", r"(evonorm|filterresponse|frn|globalresponse|grn|rmsnorm)"),
        ("norm", r"(norm(?!free)|normalization)"),
        ("embedding", r"embedding(bag)?$"),
        ("pool_max", r"max_?pool"),
        ("pool", r"(pool|pooling)"),
        ("conv", r"(conv|conv\dd|convtranspose\dd)"),
        ("linear", r"^(linear|dense|lazylinear|nondynamicallyquantizablelinear|"
                   r"conv1d_hf|einsumdense|bilinear)$"),
        ("act", r"^(relu6?|gelu\w*|silu|swish|mish|elu|selu|celu|leakyrelu|prelu|rrelu|"
                r"sigmoid|tanh|softplus|softsign|hardswish|hardsigmoid|hardtanh|"
                r"quickgelu|\w*activation|glu|swiglu|logsigmoid|tanhshrink|threshold|\w+act)$"),
    )
)

_CONTAINERS = re.compile(
    r"^(sequential|modulelist|moduledict|\w*(block|layer|stage|stem|encoder|decoder|"
    r"embeddings|model|net|module|mlp|ffn|feedforward|bottleneck|head|neck|pooler|"
    r"transformer|backbone|features|cell|unit|branch))$",
    re.IGNORECASE,
)


_NO_SCORES = re.compile(r"(split|channel|squeeze|eca|cbam|gather|linearself|excite|gate|mla$)",
                        re.IGNORECASE)


_COMPOSITE = re.compile(
    r"(conv\w*(norm|bn|act|pool|residual|block|mlp)|norm\w*act|bn\w*act|separable|"
    r"depthwise|residual|mbconv|stridedconv|posenc)",
    re.IGNORECASE,
)


_PRIMITIVE_WITH_MATRICES = re.compile(
    r"^(lstm|gru|rnn|lstmcell|grucell|rnncell|multiheadattention|transformerencoderlayer|"
    r"transformerdecoderlayer)$", re.IGNORECASE)


def is_primitive(type_name: str) -> bool:
    """PyTorch layers that hold several matrices but are one module with no children
    (recurrent layers): a childless row of this type is complete, not cut off."""
    return bool(_PRIMITIVE_WITH_MATRICES.match(type_name))


def is_composite(type_name: str) -> bool:
    """Whether a type name is a module made of several layers (conv + norm + activation,
    separable convolutions, residual wrappers): shown without children, it hides them
    (timm's ConvNormAct, BatchNormAct2d, DepthwiseSeparableConv at torchinfo's depth 3)."""
    return bool(_COMPOSITE.search(type_name))


def has_token_scores(type_name: str) -> bool:
    """Whether an attention layer builds token x token score tensors (channel, split
    and linear attention do not)."""
    return category(type_name) == "attention" and not _NO_SCORES.search(type_name)


def is_container_type(type_name: str) -> bool:
    """Whether a type name is a container (for formats that list containers and children
    without depth, such as torchsummary, whose rows must then not be counted twice)."""
    if type_name.lower() in {"linear", "dense"}:
        return False
    return bool(_CONTAINERS.match(type_name)) and category(type_name) == "other"


@functools.lru_cache(maxsize=4096)
def category(type_name: str) -> str:
    """The backward-memory category of a layer type name (``other`` if unknown).

    Hugging Face's ``Conv1D`` (exact case; GPT-2's ``c_attn``, ``c_fc``, ``c_proj``) is
    a transposed linear layer, not a convolution (torch's is ``Conv1d``)."""
    if type_name == "Conv1D":
        return "linear"
    for cat, rx in _RULES:
        if rx.search(type_name):
            return cat
    return "other"


@functools.lru_cache(maxsize=4096)
def leaf_category(type_name: str, params: int) -> str:
    """Category of a leaf row: an unknown type that owns parameters is a hidden block."""
    cat = category(type_name)
    if cat == "other" and (params > 0 and _CONTAINERS.match(type_name)):
        return "block"
    if cat == "other" and _CONTAINERS.match(type_name):
        return "block"
    return cat
