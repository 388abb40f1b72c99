"""Architecture recognition: what kind of model a summary shows, by class-name and
structure rules, for Hugging Face and common research code.

The margin and the attention memory depend on it: a transformer keeps
``batch x heads x seq^2`` tensors per attention layer under eager attention, a plain
CNN keeps none, and a model the rules cannot place gets the most conservative margin.

Rules, in order (every row counts: leaves and containers, which ``print(model)``
lists in :attr:`~slurm_colloc.estimators.model.ModelSummary.containers`):

* **Family** by class-name prefix (``Bert*``, ``Roberta*``, ``XLNet*``, ``GPT2*``,
  ``GPTNeo*``, ``GPTJ*``, ``T5*``, LLaMA-style ``Llama*`` / ``Mistral*`` / ``Qwen*`` /
  ``Gemma*`` / ``Phi*``, ``ViT*``, ``Swin*``, ``DeiT*``, ``Whisper*``; timm's and
  Flax's ``VisionTransformer`` and PyTorch's ``Transformer*Layer`` are families too,
  but not Hugging Face ones: their tables keep the bucket model calibrated on timm's
  measured peaks, where attention is fused).
* **Attention cores**: the innermost rows whose class name says attention
  (``BertSelfAttention``, ``GPT2Attention``, ``XLNetRelativeAttention``,
  ``MultiheadAttention``, ``Attention``, ``*Attn``), or, by structure, a module whose
  children are query / key / value projections (``query``/``key``/``value``,
  ``q_proj``/``k_proj``/``v_proj``, ``q``/``k``/``v``, ``c_attn``, ``qkv``, ``Wqkv``)
  whatever its class is called. An attention module holding its parameters directly
  (XLNet's relative attention has no Linear children) is still a core by its name.
  Channel / squeeze-excite / pooling "attention" (``SqueezeExcite``, ``CBAM``,
  ``AttentionPool``) builds no token x token tensor and is not a core.
  A whole transformer layer shown as one row (``TransformerBlock``,
  ``TransformerEncoderLayer``) counts as one attention layer.
* **Cross attention**: a core named ``crossattention`` / ``encoder_attn`` /
  ``EncDecAttention`` or of a ``*CrossAttention`` class (queries from the decoder,
  keys from the encoder). **Relative position**: ``*Relative*`` classes, T5's
  ``relative_attention_bias``, XLNet. **Windowed**: Swin's window attention (scores
  per window, not per image).
* **Implementation shown**: a class name with ``Sdpa`` / ``FlashAttention`` tells it
  (older Hugging Face releases named them so); explicit ``heads x N x N`` probability
  rows (a softmax / dropout output) mean eager.
* **Kind**: ``transformer`` (attention cores and at most a convolutional stem: ViT's
  patch embedding, Whisper's two Conv1d), ``hybrid`` (convolution stages holding over
  10% of the weights and attention: CoAtNet, EfficientFormer; the timm calibration
  covers them), ``cnn``, ``rnn``, ``mlp``; ``mixed`` when recurrent layers meet
  attention or convolutions (nothing calibrated covers them); ``unknown`` when most
  parameters sit in layers of unknown types. Hugging
  Face's ``Conv1D`` (``nf``/``nx``: GPT-2's transposed linear) is a linear layer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from slurm_colloc.estimators.layers import category, is_composite, is_primitive, leaf_category
from slurm_colloc.estimators.model import Layer, ModelSummary

FAMILIES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (name, re.compile(rx))
    for name, rx in (
        ("roberta", r"^(Roberta|XLMRoberta|Camembert)"),
        ("xlnet", r"^XLNet"),
        ("bert", r"^(Bert|DistilBert|Albert|Electra|Deberta)"),
        ("gpt_neo", r"^GPTNeo(?!X)"),
        ("gpt_neox", r"^GPTNeoX"),
        ("gptj", r"^GPTJ"),
        ("gpt2", r"^(GPT2|OpenAIGPT)"),
        ("t5", r"^(T5|MT5|UMT5|LongT5)"),
        ("llama", r"^(Llama|Mistral|Mixtral|Qwen\d*|Gemma\d*|Phi\d*|Olmo\d*|Falcon)"),
        ("whisper", r"^Whisper"),
        ("swin", r"^Swin"),
        ("deit", r"^DeiT"),
        ("vit", r"^(ViT|Dinov2|BEiT|Beit)"),
        ("vit_generic", r"^VisionTransformer$"),
        ("bart", r"^(Bart|MBart|Pegasus|Marian)"),
        ("torch_transformer", r"^(Transformer(Encoder|Decoder)(Layer)?|Transformer)$"),
    )
)
"""Class-name prefixes of model families (first match wins: XLNet before BERT)."""

_HF_CLASS = re.compile(r"[A-Za-z0-9](Model|For[A-Z]\w*|LMHeadModel|Embeddings|PreTrainedModel)$")
"""Class names only Hugging Face's modelling code uses (``BertForMaskedLM``,
``SwinEmbeddings``); timm's ``SwinTransformer`` or ``Beit`` have none."""
ENC_DEC = frozenset({"t5", "whisper", "bart"})
"""Encoder-decoder families (decoder self-attention and cross-attention layers)."""
HF_FAMILIES = frozenset({"bert", "roberta", "xlnet", "gpt2", "gpt_neo", "gpt_neox", "gptj",
                         "t5", "llama", "whisper", "swin", "deit", "vit", "bart"})
"""Families whose eager attention keeps ``heads x seq^2`` tensors unless the job
selects SDPA/flash (Hugging Face's eager path: softmax, dropout mask and output)."""

_ATTN_NAME = re.compile(r"(attention|attn|^mhsa\w*$|^\w*selfatt\w*$)", re.IGNORECASE)
_NOT_CORE = re.compile(
    r"(squeeze|excite|^se(_?module|_?block|_?layer)?$|cbam|^eca|channel|spatialatt|pool|"
    r"output$|gate|"
    r"layernorm|norm$|dropout|drop$|^attn_?(drop|norm|proj|out)|linear|conv1d|conv2d)",
    re.IGNORECASE)
"""Attention-named rows that build no token x token tensor (channel / pooling
attention) or are a part of an attention block (its output projection, its norm)."""
_QKV_NAMES = (
    frozenset({"query", "key", "value"}), frozenset({"q_proj", "k_proj", "v_proj"}),
    frozenset({"q", "k", "v"}), frozenset({"q_lin", "k_lin", "v_lin"}),
)
_FUSED_QKV = re.compile(r"^(c_attn|qkv|wqkv|query_key_value|in_proj|qkv_proj)$", re.IGNORECASE)
_RESID_DROP = re.compile(r"(resid|hidden|output|proj)", re.IGNORECASE)
"""Dropouts of an attention block that act on its output, not on its probabilities."""
_CROSS = re.compile(r"(cross|encoder_attn|encdec|enc_dec)", re.IGNORECASE)
_RELATIVE = re.compile(r"(relative|rel_?pos|relative_attention_bias)", re.IGNORECASE)
_WINDOW = re.compile(r"(window|^swin)", re.IGNORECASE)
_IMPL_SDPA = re.compile(r"sdpa", re.IGNORECASE)
_IMPL_FLASH = re.compile(r"flash", re.IGNORECASE)
_HF_CONV1D = "Conv1D"
_TRANSFORMER_LAYER = re.compile(
    r"(transformer\w*(block|layer)|^(transformer)?(encoder|decoder)(layer|block)|"
    r"^(vit|bert|gpt\w*)(block|layer))$", re.IGNORECASE)
"""A whole transformer layer shown as one row (Keras' custom ``TransformerBlock``,
PyTorch's ``TransformerEncoderLayer`` in a shallow table): one attention layer."""
_RNN = re.compile(r"^(lstm|gru|rnn|lstmcell|grucell|rnncell|bidirectional|simplernn)$",
                  re.IGNORECASE)

BARE_ATTENTION_MATRICES = 5
"""Width x width matrices of an attention module without Linear children (XLNet's
q, k, v, o and r)."""
STEM_CONVS = 2
"""Convolutions a transformer may have as its stem (ViT's patch embedding, Whisper's
two Conv1d) without being a conv/attention hybrid."""
UNKNOWN_SHARE = 0.5
"""A model with more than this share of its parameters in layers of unknown types is
``unknown`` (the rules cannot tell what it keeps)."""


@dataclass(frozen=True)
class AttentionCore:
    """One attention layer (the innermost attention module)."""

    type: str
    name: str
    width: int | None
    """Model width at that layer (output width of its projections), if shown."""
    cross: bool = False
    relative: bool = False
    windowed: bool = False
    tokens: int | None = None
    """Tokens per sample its output shows (tables with shapes), if any."""
    decoder: bool = False
    """In the decoder of an encoder-decoder model (its queries are decoder tokens)."""
    dropout: bool = True
    """Whether its probabilities go through dropout (a mask and a copy kept): False
    only when the summary shows ``p=0`` (ViT) or the family has none (LLaMA-style)."""


@dataclass(frozen=True)
class Recognition:
    """What the rules found (see the module docstring)."""

    kind: str
    """``transformer``, ``hybrid``, ``cnn``, ``rnn``, ``mlp``, ``mixed`` or ``unknown``."""
    family: str | None
    cores: tuple[AttentionCore, ...] = ()
    unshown_params: int = 0
    """Parameters print(model) cannot show: attention modules that hold their
    projections as bare parameters (XLNet's relative attention: q, k, v, o and the
    position projection r, ``5 x width^2``), when no ``, N params`` counts are given."""
    decoder_start: int | None = None
    """Index in ``summary.layers`` of the first layer of the decoder of an
    encoder-decoder model (its layers and head see decoder tokens), if any."""
    hf: bool = False
    """Hugging Face classes (``BertModel``, ``GPT2LMHeadModel``, ``SwinEmbeddings``):
    their eager attention path is the default assumption. timm's ``SwinTransformer``
    or ``Beit`` share a family prefix but not these class names."""
    impl_shown: str | None = None
    """``eager``, ``sdpa`` or ``flash`` when the summary shows which, else None."""
    evidence: tuple[str, ...] = field(default=())

    @property
    def attention(self) -> bool:
        """Whether the model has token x token attention layers."""
        return bool(self.cores)

    @property
    def recognised(self) -> bool:
        """Whether the rules placed the model (not ``unknown`` nor ``mixed``)."""
        return self.kind not in ("unknown", "mixed")

    def to_json(self) -> dict[str, object]:
        """The part of the estimate's JSON that says what was recognised."""
        return {
            "kind": self.kind, "family": self.family, "recognised": self.recognised,
            "hugging_face": self.hf,
            "attention_layers": sum(not c.cross for c in self.cores),
            "cross_attention_layers": sum(c.cross for c in self.cores),
            "relative_position": any(c.relative for c in self.cores),
            "windowed": any(c.windowed for c in self.cores),
            "attention_shown": self.impl_shown,
            "evidence": list(self.evidence),
        }


def is_hf_conv1d(layer: Layer) -> bool:
    """Hugging Face's ``Conv1D`` (a transposed linear layer; torch's is ``Conv1d``)."""
    return layer.type == _HF_CONV1D


def _family(rows: tuple[Layer, ...]) -> str | None:
    counts: dict[str, int] = {}
    for row in rows[:64] + rows[-8:]:
        for name, rx in FAMILIES:
            if rx.search(row.type):
                counts[name] = counts.get(name, 0) + (4 if row.depth == 0 else 1)
                break
    return max(counts, key=lambda k: counts[k]) if counts else None


def _children(rows: tuple[Layer, ...]) -> list[list[int]]:
    """Indices of each row's direct children (rows in pre-order with depths)."""
    kids: list[list[int]] = [[] for _ in rows]
    stack: list[int] = []
    for i, row in enumerate(rows):
        while stack and rows[stack[-1]].depth >= row.depth:
            stack.pop()
        if stack:
            kids[stack[-1]].append(i)
        stack.append(i)
    return kids


def _ordered_rows(summary: ModelSummary) -> tuple[Layer, ...]:
    """All rows in tree order. ``print(model)`` keeps containers apart; they are merged
    back by their depth-first order (containers precede their children)."""
    if not summary.containers:
        return summary.layers
    # both lists are in pre-order of one walk; merge by the recorded positions
    order = summary.meta.get("row_order")
    if order and len(order) == len(summary.layers) + len(summary.containers):
        li, ci = iter(summary.layers), iter(summary.containers)
        return tuple(next(ci) if ch == "c" else next(li) for ch in order)
    return summary.containers + summary.layers


def _is_core_by_name(row: Layer) -> bool:
    return bool(_ATTN_NAME.search(row.type)) and not _NOT_CORE.search(row.type)


def _qkv_children(rows: tuple[Layer, ...], kids: list[int]) -> bool:
    names = {rows[k].name.lower() for k in kids}
    if any(s <= names for s in _QKV_NAMES):
        return True
    return any(_FUSED_QKV.match(n) for n in names) and any(
        category(rows[k].type) == "linear" or is_hf_conv1d(rows[k]) for k in kids)


def recognise(summary: ModelSummary) -> Recognition:
    """Apply the rules to a parsed summary (linear time in its rows)."""
    rows = _ordered_rows(summary)
    kids = _children(rows)
    family = _family(rows)
    evidence: list[str] = []
    if family:
        evidence.append(f"class names of the {family} family")
    parent = _parents(rows)
    inner = _innermost(parent, _core_candidates(rows, kids))
    model_width = _modal_width(summary)
    cores = [_attention_core(rows, kids, parent, i, family, model_width) for i in inner]
    impl = _impl_by_class(rows, inner)
    if not cores and family in HF_FAMILIES and any(_HF_CLASS.search(r.type) for r in rows):
        cores = _hidden_layers(summary, rows, parent, family, model_width)
        if cores:
            evidence.append(f"{len(cores)} transformer layers shown without their children "
                            "(each counted as one attention layer)")
    if cores:
        evidence.append(f"{len(cores)} attention layers ({cores[0].type})")
    if impl is None and _shows_probabilities(summary):
        impl = "eager"
        evidence.append("explicit token x token probability rows (eager attention)")
    hf = family in HF_FAMILIES and any(_HF_CLASS.search(r.type) for r in rows)
    kind = _kind(summary, cores, family if hf else None)
    evidence.append(f"kind {kind}")
    unshown = _unshown_params(summary, rows, kids, inner, model_width)
    if unshown:
        evidence.append(f"{unshown:,} attention parameters print(model) cannot show")
    return Recognition(kind=kind, family=family, cores=tuple(cores), hf=hf, impl_shown=impl,
                       evidence=tuple(evidence), unshown_params=unshown,
                       decoder_start=_decoder_start(rows) if family in ENC_DEC else None)


def _core_candidates(rows: tuple[Layer, ...], kids: list[list[int]]) -> list[int]:
    """Rows that may be attention cores: by class name, by query / key / value
    children, or a whole transformer layer shown as one row. The model row itself is
    never one (a bare attention module summarised alone is its own model)."""
    return [i for i, r in enumerate(rows)
            if (_is_core_by_name(r) or (kids[i] and _qkv_children(rows, kids[i]))
                or (r.leaf and r.params > 0 and _TRANSFORMER_LAYER.search(r.type)))
            and not (r.depth == 0 and not r.leaf)]


def _innermost(parent: list[int], cand: list[int]) -> list[int]:
    """The candidates with no candidate below them. A candidate with a candidate below
    it is a wrapper (BertAttention around BertSelfAttention): counting both would
    count one attention layer twice. One reverse pass marks every row above a
    candidate, so this stays linear."""
    cset = set(cand)
    above = [False] * len(parent)
    for i in range(len(parent) - 1, -1, -1):
        if (i in cset or above[i]) and parent[i] >= 0:
            above[parent[i]] = True
    return [i for i in cand if not above[i]]


def _attention_core(rows: tuple[Layer, ...], kids: list[list[int]], parent: list[int],
                    i: int, family: str | None, model_width: int | None) -> AttentionCore:
    """The attention core at row ``i``: its width, tokens and the traits that change
    its memory (cross, relative position, windows, dropout on the probabilities),
    read from its own row, its children and its nearest ancestors."""
    r = rows[i]
    sub = [rows[k] for k in kids[i]]
    width = _core_width(r, sub) or model_width
    ancestry = _ancestry(rows, parent, i)
    rel = bool(_RELATIVE.search(f"{r.name} {r.type}")) or family in ("xlnet", "t5") or any(
        _RELATIVE.search(x.name) for x in sub)
    cross = bool(_CROSS.search(ancestry))
    drops = [x.dropout_p for x in sub if category(x.type) == "dropout"
             and x.dropout_p is not None and not _RESID_DROP.search(x.name)]
    dropout = (max(drops) > 0) if drops else family != "llama"
    return AttentionCore(
        dropout=dropout,
        type=r.type, name=r.name, width=width, tokens=_tokens_of(r),
        decoder=cross or (family in ENC_DEC and _in_decoder(rows, parent, i)),
        cross=cross, relative=rel,
        windowed=bool(_WINDOW.search(r.type)) or family == "swin")


def _impl_by_class(rows: tuple[Layer, ...], inner: list[int]) -> str | None:
    """The attention implementation the cores' class names tell (older Hugging Face
    releases named ``*SdpaAttention`` / ``*FlashAttention*``): flash wins over sdpa,
    None when no name says."""
    impl: str | None = None
    for i in inner:
        if _IMPL_FLASH.search(rows[i].type):
            impl = "flash"
        elif _IMPL_SDPA.search(rows[i].type) and impl is None:
            impl = "sdpa"
    return impl


def _shows_probabilities(summary: ModelSummary) -> bool:
    """Whether a softmax / dropout leaf outputs a square token x token tensor: explicit
    probabilities, which only eager attention keeps."""
    return any(
        category(r.type) in ("softmax", "dropout") and r.output_shape is not None
        and len(r.output_shape) >= 2 and r.output_shape[-1] == r.output_shape[-2] > 1
        for r in summary.layers)


def _unshown_params(summary: ModelSummary, rows: tuple[Layer, ...], kids: list[list[int]],
                    inner: list[int], model_width: int | None) -> int:
    """Parameters print(model) cannot show: an attention core holding its projections
    directly (XLNet's relative attention, no Linear children) prints none of them, so
    they are counted from its width. Only for a ``print(model)`` without parameter
    counts (``print_params`` tables show them)."""
    unshown = 0
    if summary.format == "pytorch-print" and "param_counts" not in summary.meta:
        for i in inner:
            sub = [rows[k] for k in kids[i]]
            if rows[i].params == 0 and not any(
                    category(x.type) == "linear" or is_hf_conv1d(x) for x in sub):
                w = _core_width(rows[i], sub) or model_width or 0
                unshown += BARE_ATTENTION_MATRICES * w * w
    return unshown


def _parents(rows: tuple[Layer, ...]) -> list[int]:
    """Index of each row's parent (-1 for top-level rows)."""
    out = [-1] * len(rows)
    stack: list[int] = []
    for i, row in enumerate(rows):
        while stack and rows[stack[-1]].depth >= row.depth:
            stack.pop()
        out[i] = stack[-1] if stack else -1
        stack.append(i)
    return out


def _ancestry(rows: tuple[Layer, ...], parent: list[int], i: int, up: int = 3) -> str:
    """Names and types of a row and its nearest ancestors (``crossattention`` may be
    the wrapper's name, ``T5LayerCrossAttention`` the wrapper's type)."""
    parts = []
    j = i
    for _ in range(up + 1):
        if j < 0:
            break
        parts.append(f"{rows[j].name} {rows[j].type}")
        j = parent[j]
    return " ".join(parts)


def _tokens_of(row: Layer) -> int | None:
    shape = row.output_shape
    if shape and len(shape) >= 2:
        return shape[-2]
    return None


def _width_of(row: Layer) -> int | None:
    if row.width:
        return row.width
    if row.output_shape:
        return row.output_shape[-1]
    return None


def _core_width(core: Layer, sub: list[Layer]) -> int | None:
    """The model width at an attention layer: its output projection's width (the last
    linear child: ``o_proj``, ``c_proj``, ``value``), else any child's width (XLNet's
    relative attention shows only its norm), else its own output's."""
    lin = [w for x in sub if (category(x.type) == "linear" or is_hf_conv1d(x))
           and (w := _width_of(x))]
    if lin:
        return lin[-1]
    other = [w for x in sub if (w := _width_of(x))]
    if other:
        return other[-1]
    return _width_of(core)


def _modal_width(summary: ModelSummary) -> int | None:
    counts: dict[int, int] = {}
    for la in summary.leaves:
        w = _width_of(la)
        if w and category(la.type) in ("norm", "norm_composite"):
            counts[w] = counts.get(w, 0) + 1
    return max(counts, key=lambda k: counts[k]) if counts else None


_LAYER_ROW = re.compile(r"(layer|block)$", re.IGNORECASE)
_STACK_ROW = re.compile(r"^(modulelist|sequential|\w*(encoder|decoder|stack))$", re.IGNORECASE)
LAYER_MATRICES = 12
"""Width x width matrices of one transformer layer (4 for attention, 8 for a 4x MLP;
LLaMA's gated 2.7x MLP: about 12 too)."""


def _hidden_layers(summary: ModelSummary, rows: tuple[Layer, ...], parent: list[int],
                   family: str | None, model_width: int | None) -> list[AttentionCore]:
    """Transformer layers a shallow table shows as one row each (torchinfo's default
    depth cuts ``BertLayer`` / ``T5Block`` off): one attention layer per row, plus a
    cross-attention layer in a decoder of an encoder-decoder family."""
    deepest = max((r.depth for r in rows), default=0)
    out = []
    for i, r in enumerate(rows):
        if not (r.leaf and r.depth == deepest and r.params > 0):
            continue
        width = _width_of(r) or model_width
        if _LAYER_ROW.search(r.type):
            n = 1
        elif _STACK_ROW.match(r.type) and width:
            # a ModuleList of N layers shown as one row: N from its parameters
            n = round(r.params / (LAYER_MATRICES * width * width))
        else:
            continue
        dec = family in ENC_DEC and _in_decoder(rows, parent, i)
        for _ in range(n):
            out.append(AttentionCore(type=r.type, name=r.name, width=width, tokens=_tokens_of(r),
                                     relative=family in ("xlnet", "t5"), decoder=dec,
                                     windowed=family == "swin"))
            if dec:
                out.append(AttentionCore(type=r.type, name=r.name, width=width, cross=True,
                                         relative=False, decoder=True))
    return out


def _decoder_start(rows: tuple[Layer, ...]) -> int | None:
    """Leaf index where the decoder begins: the first leaf under a row named or typed
    ``decoder`` (print(model), torchinfo with names). None when no row says so."""
    leaves = 0
    for r in rows:
        if not r.leaf and "decoder" in f"{r.name} {r.type}".lower():
            return leaves
        leaves += r.leaf
    return None


def _in_decoder(rows: tuple[Layer, ...], parent: list[int], i: int) -> bool:
    """Whether a row sits in a decoder stack: named so, or (tables without names) in
    the second of two stacks of the same type (T5's encoder and decoder ``T5Stack``)."""
    j = parent[i]
    while j >= 0:
        if "decoder" in f"{rows[j].name} {rows[j].type}".lower():
            return True
        if rows[j].depth == 1:
            same = [k for k, r in enumerate(rows) if r.depth == 1 and r.type == rows[j].type]
            return len(same) >= 2 and j == same[-1]
        j = parent[j]
    return False


def _kind(summary: ModelSummary, cores: list[AttentionCore], family: str | None) -> str:
    leaves = summary.leaves
    convs = [la for la in leaves if category(la.type) == "conv" and not is_hf_conv1d(la)]
    rnns = [la for la in leaves if _RNN.match(la.type)]
    total = max(1, sum(la.params for la in leaves))
    # unknown types: neither a known layer nor a block / composite by its name (blocks a
    # shallow table shows whole have their own margin)
    unknown = sum(la.params for la in leaves
                  if leaf_category(la.type, la.params) == "other"
                  and not is_composite(la.type) and not is_primitive(la.type))
    conv_share = sum(la.params for la in convs) / total
    if cores:
        if rnns:
            return "mixed"  # attention and recurrence: no calibration data has both
        if len(convs) > STEM_CONVS and conv_share > 0.1 and family not in HF_FAMILIES:
            return "hybrid"  # convolution stages and attention (CoAtNet, EfficientFormer)
        return "transformer"
    if unknown / total > UNKNOWN_SHARE and not family:
        return "unknown"
    if convs and rnns:
        return "mixed"
    if rnns:
        return "rnn"
    if convs:
        return "cnn"
    if family in HF_FAMILIES:
        return "unknown"  # a transformer family with no attention found: rules missed it
    return "mlp"
