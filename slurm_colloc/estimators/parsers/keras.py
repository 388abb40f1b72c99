"""Parser for Keras ``model.summary()`` text (tf.keras 2.x and Keras 3 box tables).

Rows are ``name (Type)   (None, 26, 26, 32)   320`` (plus ``Connected to`` for
functional models); long names wrap onto a continuation row that has no shape.
Keras 3 draws the same table with box characters (``│``). Shapes start with ``None``
(the batch). Keras lists only leaves, so every row is a leaf.
"""

from __future__ import annotations

import re

from slurm_colloc.estimators.errors import SummaryParseError
from slurm_colloc.estimators.model import Layer, ModelSummary
from slurm_colloc.estimators.parsers._common import (
    footer_count,
    parse_count,
    parse_shapes,
    per_sample,
)

_HEADER = re.compile(r"Layer \(type\)\s*[┃│|]?\s*Output Shape\s*[┃│|]?\s*Param #")
_SHAPE = re.compile(r"(\((?:None|\d+)[^()]*\)|\[\((?:None|\d+)[^\[\]]*\]|multiple)")
"""A shape cell. The body excludes the opening bracket too, so a failed attempt stops
at the next bracket: ``[^)]*`` rescanned the rest of the line from every ``(1``
(quadratic; security issue 11). Real shapes have no nested brackets."""


def name_type(cell: str) -> tuple[str, str] | None:
    r"""``(name, type)`` of a ``name (Type)`` cell (the closing ``)`` may be cut off by
    wrapping), else None. Reads exactly what ``^(\S+)\s*\(([^)]*)\)?\s*$`` matched,
    in one linear pass (the regex backtracked quadratically on ``((((...)x``)."""
    s = cell
    t = s.rstrip()
    closed = t.endswith(")")
    u = t[:-1] if closed else s
    lo = max(u.rfind(")") + 1, 1)  # the "(" comes after any ")" and after the name
    fw = 0
    while fw < len(s) and not s[fw].isspace():
        fw += 1
    if fw == 0:
        return None
    nw = fw
    while nw < len(s) and s[nw].isspace():
        nw += 1
    if nw > fw and nw < len(u) and s[nw] == "(" and nw >= lo:
        p = nw
    else:
        p = u.rfind("(", lo, fw)
        if p < 0:
            return None
    return s[:p].rstrip(), s[p + 1:len(t) - 1] if closed else s[p + 1:]


def looks_like(text: str) -> bool:
    """Keras prints ``Model: "name"`` and a header without depth-idx."""
    return bool(_HEADER.search(text)) and ("Model:" in text or "(None," in text)


def _rows(lines: list[str], start: int) -> list[tuple[int, str, str, str]]:
    """(line number, name cell, shape cell, params cell) with wrapped names merged.

    A row is a line with a shape; a line without one continues the previous row's
    name (Keras cuts long ``name (Type)`` cells onto the next line)."""
    rows: list[tuple[int, str, str, str]] = []
    boxed = any("│" in ln for ln in lines[start:start + 5])
    for i in range(start, len(lines)):
        raw = lines[i]
        s = raw.strip()
        if not s or set(s) <= set("=_-━─┡┩╇┏┓┗┛┳┻└┘┴┼├┤╌│ "):
            continue
        if re.match(r"^(Total|Trainable|Non-trainable|Optimizer) params", s):
            break
        if boxed:
            cells = [c.strip() for c in raw.strip().strip("│").split("│")]
            name = cells[0] if cells else ""
            shape = cells[1] if len(cells) > 1 else ""
            params = cells[2] if len(cells) > 2 else ""
        else:
            m = _SHAPE.search(raw)
            if m is None:
                name, shape, params = s, "", ""
            else:
                name = raw[: m.start()].strip()
                shape = m.group(1)
                params = raw[m.end():].split()[0] if raw[m.end():].split() else ""
        if not shape:
            if not rows:
                raise SummaryParseError("keras: row without an output shape", line_no=i + 1,
                                        line=raw)
            n, nm, sh, pa = rows[-1]
            if name and not name.startswith(("[", "'")):
                nm = nm + (" " if boxed else "") + name
            rows[-1] = (n, nm, sh, pa)
            continue
        rows.append((i + 1, name, shape, params))
    return rows


def parse(text: str) -> ModelSummary:
    """Parse a Keras summary into a :class:`ModelSummary`."""
    lines = text.splitlines()
    head = next((i for i, line in enumerate(lines) if _HEADER.search(line)), None)
    if head is None:
        raise SummaryParseError("keras: no 'Layer (type) Output Shape Param #' header")
    layers: list[Layer] = []
    for line_no, name, shape_tok, params in _rows(lines, head + 1):
        raw = lines[line_no - 1]
        nt = name_type(name)
        if nt is None or not nt[1]:
            raise SummaryParseError("keras: layer cell is not 'name (Type)'", line_no=line_no,
                                    line=raw)
        shapes = None if shape_tok == "multiple" else parse_shapes(
            shape_tok.strip("[]") if shape_tok.startswith("[") else shape_tok, line_no, raw)
        layers.append(Layer(type=re.sub(r"\s+", "", nt[1]),
                            params=parse_count(params or "0", line_no, raw),
                            output_shape=per_sample(shapes, None)))
    if not layers:
        raise SummaryParseError("keras: table has no layer rows", line_no=head + 1)
    footer = lines[head:]
    total = footer_count("Total params:", footer)
    if total is None:
        total = sum(layer.params for layer in layers)
    trainable = footer_count("Trainable params:", footer)
    return ModelSummary(format="keras", layers=tuple(layers), total_params=total,
                        trainable_params=trainable if trainable is not None else total)
