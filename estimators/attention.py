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
  keys from the encoder; with one ``--seq-len`` both are that length (the safe side
  for a decoder shorter than its encoder).
* **Relative position** (XLNet's two-stream relative attention, T5's bias): XLNet
  builds a second ``heads x Sq x 2 Sk`` position score and shifts it (``rel_factor``
  extra score-sized tensors, fitted on the XLNet runs); T5 adds a bias tensor.
* **Windowed** attention (Swin) scores within ``WINDOW_TOKENS``-token windows.

Heads are ``width / HEAD_DIM`` (print(model) never shows the head count; 64 is BERT's,
GPT-2's, ViT's and T5's, and LLaMA's 128 makes this count twice the heads: safe).
"""

from __future__ import annotations

from dataclasses import dataclass

from estimators.physics import MIB
from estimators.recognition import Recognition

IMPLEMENTATIONS = ("eager", "sdpa", "flash")
HEAD_DIM = 64
WINDOW_TOKENS = 49
"""Swin's default 7 x 7 window (print(model) does not show the window size)."""

PRIOR = {"score_bytes": 9.0, "rel_factor": 1.0, "token_bytes": 4.0, "lse_bytes": 4.0}
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
    """Sum over attention layers of ``B x H x Sq x Sk`` (eager only; 0 for fused)."""
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
             + c["token_bytes"] * self.token_elems) * bytes_scale
        return (b + c["lse_bytes"] * self.lse_elems) / MIB


def resolve_impl(rec: Recognition, requested: str | None) -> tuple[str, str]:
    """(implementation, source): the option wins, then what the summary shows, then
    eager."""
    if requested:
        return requested, "option"
    if rec.impl_shown:
        return rec.impl_shown, "summary"
    return "eager", "default"


def attention_memory(rec: Recognition, batch: int, seq: int, impl: str,
                     source: str) -> AttentionMemory:
    """Element counts of the attention tensors (see the module docstring)."""
    score = rel = tok = lse = 0.0
    for core in rec.cores:
        width = core.width or HEAD_DIM
        heads = max(1, width // HEAD_DIM)
        sq = sk = seq
        if core.windowed:
            sk = min(seq, WINDOW_TOKENS)
        tok += batch * sq * width
        if impl == "eager":
            n = float(batch) * heads * sq * sk
            score += n
            if core.relative:
                rel += n
        else:
            lse += batch * heads * sq
    return AttentionMemory(impl=impl, source=source, score_elems=score, rel_elems=rel,
                           token_elems=tok, lse_elems=lse)
