"""Small helpers shared by the summary parsers (numbers, shapes, totals)."""

from __future__ import annotations

import re

from estimators.errors import SummaryParseError

_NUM = re.compile(r"^[+-]?\d[\d,_]*$")
_SUFFIXED = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMBG])$", re.IGNORECASE)
_SCALE = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9}


def parse_count(tok: str, line_no: int, line: str) -> int:
    """A parameter count as printed: ``9,408``, ``1_000``, ``--``, ``(recursive)``, ``1.2M``."""
    t = tok.strip()
    if t in {"--", "-", "", "(recursive)", "0"}:
        return 0
    if _NUM.match(t):
        value = int(t.replace(",", "").replace("_", ""))
        if value < 0:
            raise SummaryParseError("negative parameter count", line_no=line_no, line=line)
        return value
    m = _SUFFIXED.match(t)
    if m:
        return round(float(m.group(1)) * _SCALE[m.group(2).lower()])
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
            dims.append(None if p in {"None", "?"} else int(p))
        shapes.append(dims)
    return shapes


def footer_count(pattern: str, text_lines: list[str]) -> int | None:
    """The integer after ``pattern`` (e.g. ``Total params:``) in a footer, if present."""
    rx = re.compile(re.escape(pattern) + r"\s*([\d,_]+)", re.IGNORECASE)
    for line in text_lines:
        m = rx.search(line)
        if m:
            return int(m.group(1).replace(",", "").replace("_", ""))
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
    p = 1
    for x in xs:
        p *= x
    return p
