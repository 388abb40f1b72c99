"""Attention memory from first principles: what each attention layer keeps for the
backward pass beyond the outputs of the layers a summary shows.

Per attention layer with ``H`` heads, ``Sq`` queries and ``Sk`` keys, batch ``B``:

* **eager** (``softmax(q k^T / sqrt(d)) v`` written out, Hugging Face's
  ``eager_attention_forward``): the softmax output (kept by softmax's and the
  ``@ v`` matmul's backward), the dropout mask and the dropped-out probabilities:
  ``B x H x Sq x Sk`` elements of each. With the score matrix itself and the copies
  the batched matmuls make, the exact tensor accounting (``estimators/data/
  attention_measurements.csv``) finds about 12 bytes per score element in fp32 with
  dropout; the fitted bytes per element are ``score_bytes`` in calibration.json.
* **sdpa / flash** (fused kernels): the output and a ``B x H x Sq`` log-sum-exp, no
  ``Sq x Sk`` tensor (CUDA's flash and memory-efficient kernels regenerate dropout
  from a seed).
* Either way the attention's context (its output before the output projection) and
  the per-head query / key / value copies are tensors no module row shows:
  ``token_bytes`` per token and model-width channel, fitted.
* **Cross attention** (encoder-decoder: T5, Whisper, BART): queries from the decoder,
  keys from the encoder; with one ``--seq-len`` both are that length, except that
  Whisper's encoder always sees its 1500 frames (its position table's size).
* **Relative position** (XLNet's two-stream relative attention, T5's bias): XLNet
  builds a second ``heads x Sq x 2 Sk`` position score and shifts it (``rel_factor``
  extra score-sized tensors, fitted on the XLNet runs); T5 adds a bias tensor.
* **Windowed** attention (Swin) scores within ``WINDOW_TOKENS``-token windows.

Heads are ``width / HEAD_DIM`` (print(model) never shows the head count; 64 is BERT's,
GPT-2's, ViT's and T5's, and LLaMA's 128 makes this count twice the heads: safe).
"""

from __future__ import annotations

from dataclasses import dataclass

from slurm_colloc.estimators.model import ModelSummary
from slurm_colloc.estimators.physics import MIB
from slurm_colloc.estimators.recognition import Recognition

IMPLEMENTATIONS = ("eager", "sdpa", "flash")
HEAD_DIM = 64
WINDOW_TOKENS = 49
"""Swin's default 7 x 7 window (print(model) does not show the window size)."""

PRIOR = {"score_bytes": 9.0, "nodrop_bytes": 4.0, "rel_factor": 1.0, "token_bytes": 4.0,
         "lse_bytes": 4.0}
"""Uncalibrated physics (fp32): softmax output 4 B + dropout output 4 B + mask 1 B per
score element; one extra score tensor for relative attention; the context tensor
(4 B per channel); the fp32 log-sum-exp of the fused kernels."""


@dataclass(frozen=True)
class AttentionMemory:
    """MiB of attention tensors of one job, before the calibration's coefficients."""

    impl: str
    source: str
    """``option`` (asked for), ``summary`` (the summary shows it) or ``default``
    (eager: the safe assumption when nothing says otherwise)."""
    score_elems: float
    """Sum over attention layers of ``B x H x Sq x Sk`` (eager only; 0 for fused) whose
    probabilities go through dropout."""
    nodrop_elems: float
    """The same for layers without attention dropout (``p=0``: ViT, LLaMA)."""
    rel_elems: float
    """The part of :attr:`score_elems` in relative-position layers."""
    token_elems: float
    """Sum over attention layers of ``B x Sq x width`` (context and copies)."""
    lse_elems: float
    """Sum over attention layers of ``B x H x Sq`` (fused kernels' log-sum-exp)."""

    def mib(self, coef: dict[str, float], bytes_scale: float = 1.0) -> float:
        """MiB with the fitted bytes per element (``bytes_scale`` 0.625 under AMP:
        half-precision tensors, fp32 softmax statistics kept as a whole)."""
        c = {**PRIOR, **coef}
        b = (c["score_bytes"] * (self.score_elems + c["rel_factor"] * self.rel_elems)
             + c["nodrop_bytes"] * self.nodrop_elems
             + c["token_bytes"] * self.token_elems) * bytes_scale
        return (b + c["lse_bytes"] * self.lse_elems) / MIB


def resolve_impl(rec: Recognition, requested: str | None) -> tuple[str, str]:
    """(implementation, source): T5 always builds its scores (its relative position
    bias is added to them: the measurements show eager-size tensors whatever
    ``attn_implementation`` says); otherwise the option wins, then what the summary
    shows, then eager."""
    if rec.family == "t5":
        return "eager", "family"
    if requested:
        return requested, "option"
    if rec.impl_shown:
        return rec.impl_shown, "summary"
    return "eager", "default"


def attention_memory(rec: Recognition, batch: int, seq: int, impl: str, source: str,
                     *, enc_seq: int | None = None,
                     dropout: bool | None = None) -> AttentionMemory:
    """Element counts of the attention tensors (see the module docstring). ``seq`` is
    the tokens of the model (the decoder's in an encoder-decoder model); ``enc_seq``
    the encoder's when it differs (Whisper's 1500 frames). ``dropout`` overrides what
    the summary shows about attention dropout (the calibration knows its runs')."""
    score = nodrop = rel = tok = lse = 0.0
    enc = enc_seq or seq
    for core in rec.cores:
        width = core.width or HEAD_DIM
        heads = max(1, width // HEAD_DIM)
        sq = seq if core.decoder else enc
        sk = enc if core.cross or not core.decoder else seq
        if core.windowed:
            sk = min(seq, WINDOW_TOKENS)
        tok += batch * sq * width
        if impl == "eager":
            n = float(batch) * heads * sq * sk
            if core.dropout if dropout is None else dropout:
                score += n
            else:
                nodrop += n
            if core.relative:
                rel += n
        else:
            lse += batch * heads * sq
    return AttentionMemory(impl=impl, source=source, score_elems=score, nodrop_elems=nodrop,
                           rel_elems=rel, token_elems=tok, lse_elems=lse)


def encoder_tokens(summary: ModelSummary, rec: Recognition, seq: int) -> int | None:
    """Tokens of the encoder when they do not follow ``--seq-len``: Whisper pads every
    input to 30 s, 1500 frames (the encoder's position table); None otherwise."""
    if rec.family != "whisper":
        return None
    bound = summary.meta.get("max_positions")
    return max(seq, int(bound)) if bound else max(seq, WHISPER_FRAMES)


WHISPER_FRAMES = 1500


def head_mib(summary: ModelSummary, batch: int, seq: int, precision: str) -> float:
    """MiB of the model's last output (a language model's logits: ``batch x seq x
    vocab``), which the loss copies (log-softmax, its gradient, the logits' gradient)
    at the start of the backward pass."""
    leaves = summary.leaves
    if not leaves:
        return 0.0
    bpe = 4.0 if precision == "fp32" else 2.5
    return leaves[-1].out_elems(seq) * batch * bpe / MIB
