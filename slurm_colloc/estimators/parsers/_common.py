"""Small helpers shared by the summary parsers (numbers, shapes, totals), and the
plausibility limits every parsed summary must meet.

Summaries are user input (security issue 11): every regex here runs in linear time
on any line, numbers are refused before they are converted when they have more
digits than any real model needs (Python's ``int(str)`` is quadratic and refuses
more than 4,300 digits), and :func:`check_plausible` refuses sizes no GPU job can
have, so nothing downstream computes with 10^30 parameters.
"""

from __future__ import annotations

import math
import re

from slurm_colloc.estimators.errors import SummaryParseError
from slurm_colloc.estimators.model import ModelSummary

MAX_PARAMS = 10**13
"""Parameters of a model (or one layer): 10 trillion, 40 TB of fp32 weights alone;
the largest trained models have about 2 x 10^12."""
MAX_ELEMS = 10**12
"""Output elements per sample of one layer, and per-token width."""
MAX_LAYERS = 200_000
"""Layers after ``print(model)`` repeats are expanded (the largest real summaries have
a few thousand)."""
MAX_NESTING = 200
"""Module nesting in ``print(model)`` (real models: under 20)."""
MAX_DIGITS = 15
"""Digits of any one number in a summary (without separators)."""


def implausible(what: str, line_no: int | None = None, line: str | None = None
                ) -> SummaryParseError:
    """The error for a size no real model has."""
    return SummaryParseError(f"implausibly large {what}: not a real model summary",
                             line_no=line_no, line=line)


def to_int(digits: str, what: str, line_no: int | None = None, line: str | None = None) -> int:
    """``int(digits)`` for a string of ASCII/Unicode decimal digits, refusing more than
    :data:`MAX_DIGITS` digits before converting."""
    if len(digits) > MAX_DIGITS:
        raise implausible(what, line_no, line)
    return int(digits)


def sat_prod(xs: list[int], cap: int = MAX_ELEMS) -> int:
    """Product of non-negative ints, saturating just above ``cap`` (no huge ints)."""
    p = 1
    for x in xs:
        p *= x
        if p > cap:
            return cap + 1
    return p


def check_plausible(s: ModelSummary) -> ModelSummary:
    """``s`` unchanged, or :class:`SummaryParseError` when a size is beyond any GPU job."""
    if len(s.layers) > MAX_LAYERS:
        raise SummaryParseError(f"{s.format}: too many layers ({len(s.layers)} > {MAX_LAYERS}):"
                                " not a real model summary")
    if not 0 <= s.total_params <= MAX_PARAMS:
        raise implausible(f"parameter count ({s.total_params})")
    if not 0 <= s.trainable_params <= MAX_PARAMS:
        raise implausible(f"trainable parameter count ({s.trainable_params})")
    for la in s.layers:
        if not 0 <= la.params <= MAX_PARAMS:
            raise implausible(f"parameter count of a {la.type[:40]} layer ({la.params})")
        if la.output_shape is not None and (
                any(d < 0 for d in la.output_shape)
                or sat_prod(list(la.output_shape)) > MAX_ELEMS):
            raise implausible(f"output of a {la.type[:40]} layer")
        if la.width is not None and not 0 <= la.width <= MAX_ELEMS:
            raise implausible(f"width of a {la.type[:40]} layer ({la.width})")
    for v in (s.seq_len,):
        if v is not None and not 0 <= v <= MAX_ELEMS:
            raise implausible(f"sequence length ({v})")
    return s

_NUM = re.compile(r"^[+-]?\d[\d,_]*$")
_SUFFIXED = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMBG])$", re.IGNORECASE)
_SCALE = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9}


def parse_count(tok: str, line_no: int, line: str) -> int:
    """A parameter count as printed: ``9,408``, ``1_000``, ``--``, ``(recursive)``, ``1.2M``."""
    t = tok.strip()
    if t in {"--", "-", "", "(recursive)", "0"}:
        return 0
    if _NUM.match(t):
        value = to_int(t.replace(",", "").replace("_", ""), "parameter count", line_no, line)
        if value < 0:
            raise SummaryParseError("negative parameter count", line_no=line_no, line=line)
        return value
    m = _SUFFIXED.match(t)
    if m:
        if len(m.group(1)) > MAX_DIGITS + 1:
            raise implausible("parameter count", line_no, line)
        value_f = float(m.group(1)) * _SCALE[m.group(2).lower()]
        if not math.isfinite(value_f) or value_f > MAX_PARAMS:
            raise implausible("parameter count", line_no, line)
        return round(value_f)
    raise SummaryParseError(f"not a parameter count ({t!r})", line_no=line_no, line=line)


_TOKENS = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]|[^\s\[\]]+")


def split_brackets(text: str, open_ch: str = "[", close_ch: str = "]") -> list[str]:
    """Tokens of ``text``: balanced bracket groups stay whole, the rest splits on spaces."""
    if open_ch == "[" and text.count("[") == text.count("]"):
        toks = _TOKENS.findall(text)
        if not _TOKENS.sub("", text).strip():
            return toks  # fast path: everything tokenised (nesting at most two deep)
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
            continue
        if c == open_ch:
            depth, j = 0, i
            while j < n:
                if text[j] == open_ch:
                    depth += 1
                elif text[j] == close_ch:
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            if depth != 0:
                raise ValueError(f"unbalanced {open_ch}{close_ch}")
            out.append(text[i : j + 1])
            i = j + 1
            continue
        j = i
        while j < n and not text[j].isspace():
            j += 1
        out.append(text[i:j])
        i = j
    return out


_INTS = re.compile(r"-?\d+|None|\?")


def parse_shapes(tok: str, line_no: int, line: str) -> list[list[int | None]] | None:
    """A shape column: ``[1, 64, 56, 56]``, ``[[1, 2], [1, 3]]``, ``(None, 10)`` or ``--``.

    Returns one list per output; ``None`` entries are unknown (batch) dimensions.
    """
    t = tok.strip()
    if t in {"--", "", "multiple", "[]", "()"}:
        return None
    inner = t
    groups: list[str]
    if inner.count("[") + inner.count("(") > 1:
        groups = re.findall(r"[\[(]([^\[\]()]*)[\])]", inner)
    else:
        groups = [inner.strip("[]()")]
    shapes: list[list[int | None]] = []
    for g in groups:
        parts = [p.strip() for p in g.split(",") if p.strip()]
        dims: list[int | None] = []
        for p in parts:
            if not _INTS.fullmatch(p):
                raise SummaryParseError(f"not a shape ({t!r})", line_no=line_no, line=line)
            dims.append(None if p in {"None", "?"} else to_int(p.lstrip("-"), "shape",
                                                                      line_no, line)
                        * (-1 if p.startswith("-") else 1))
        shapes.append(dims)
    return shapes


def footer_count(pattern: str, text_lines: list[str]) -> int | None:
    """The integer after ``pattern`` (e.g. ``Total params:``) in a footer, if present."""
    rx = re.compile(re.escape(pattern) + r"\s*([\d,_]+)", re.IGNORECASE)
    for line in text_lines:
        m = rx.search(line)
        if m:
            digits = m.group(1).replace(",", "").replace("_", "")
            return to_int(digits, pattern.rstrip(":").lower(), None, line) if digits else None
    return None


def per_sample(shapes: list[list[int | None]] | None, batch: int | None) -> tuple[int, ...] | None:
    """Per-sample output shape: drop the batch dimension (``-1``, ``None`` or ``batch``).

    Several outputs are summed into one flat shape (only the element count matters to
    the estimators). A first dimension that is not the batch (sequence-first tensors)
    is divided out of the element count instead.
    """
    if not shapes:
        return None
    outs: list[tuple[int, ...]] = []
    for dims in shapes:
        if not dims:
            continue
        first, rest = dims[0], [abs(d) if d is not None else 1 for d in dims[1:]]
        if first is None or first == -1 or (batch is not None and first == batch):
            outs.append(tuple(rest))
        else:
            total = abs(first) * _prod(rest)
            outs.append((max(1, total // (batch or 1)),))
    if not outs:
        return None
    if len(outs) == 1:
        return outs[0]
    return (sum(_prod(list(o)) for o in outs),)


def _prod(xs: list[int]) -> int:
    p = sat_prod(xs)
    if p > MAX_ELEMS:
        raise implausible("output shape")
    return p
