"""Parser for Keras ``model.summary()`` text (tf.keras 2.x and Keras 3 box tables).

Rows are ``name (Type)   (None, 26, 26, 32)   320`` (plus ``Connected to`` for
functional models); long names wrap onto a continuation row that has no shape.
Keras 3 draws the same table with box characters (``│``). Shapes start with ``None``
(the batch). Keras lists only leaves, so every row is a leaf.
"""

from __future__ import annotations

import re

from estimators.errors import SummaryParseError
from estimators.model import Layer, ModelSummary
from estimators.parsers._common import footer_count, parse_count, parse_shapes, per_sample

_HEADER = re.compile(r"Layer \(type\)\s*[┃│|]?\s*Output Shape\s*[┃│|]?\s*Param #")
_ROW = re.compile(
    r"^\s*(?P<name>\S+)\s+\((?P<type>[A-Za-z_][\w.]*)\)?\s+"
    r"(?P<shape>\((?:None|\d+)[^)]*\)|\[\((?:None|\d+)[^\]]*\]|multiple)\s+(?P<params>[\d,]+)"
)


def looks_like(text: str) -> bool:
    """Keras prints ``Model: "name"`` and a header without depth-idx."""
    return bool(_HEADER.search(text)) and ("Model:" in text or "(None," in text)


def _clean(line: str) -> str:
    return re.sub(r"[┃│|]", " ", line)


def parse(text: str) -> ModelSummary:
    """Parse a Keras summary into a :class:`ModelSummary`."""
    lines = text.splitlines()
    head = next((i for i, line in enumerate(lines) if _HEADER.search(line)), None)
    if head is None:
        raise SummaryParseError("keras: no 'Layer (type) Output Shape Param #' header")
    layers: list[Layer] = []
    for i in range(head + 1, len(lines)):
        raw = lines[i]
        line = _clean(raw)
        s = line.strip()
        if not s or set(s) <= set("=_-━─┡┩╇┏┓┗┛┳┻└┘┴┼├┤╌ "):
            continue
        if re.match(r"^(Total|Trainable|Non-trainable|Optimizer) params", s):
            break
        m = _ROW.match(line)
        if m is None:
            if "(" not in s or re.match(r"^[\w)\s]*\)?\s*$", s) or s.startswith(("[", "'")):
                continue  # a wrapped name or "Connected to" continuation
            raise SummaryParseError("keras: unreadable layer row", line_no=i + 1, line=raw)
        shape_tok = m.group("shape")
        shapes = None if shape_tok == "multiple" else parse_shapes(
            shape_tok.strip("[]") if shape_tok.startswith("[") else shape_tok, i + 1, raw)
        layers.append(Layer(type=m.group("type").rstrip(")"),
                            params=parse_count(m.group("params"), i + 1, raw),
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
