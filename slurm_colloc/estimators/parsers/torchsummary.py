"""Parser for ``torchsummary.summary(model, input_size)`` tables.

Rows are ``Conv2d-1   [-1, 64, 112, 112]   9,408`` in forward-hook order (a container's
row comes after its children's). There is no depth column, so containers are told
apart by type name (see :mod:`slurm_colloc.estimators.layers`); its "MB" is 2^20 bytes. The batch
column is ``-1`` unless an explicit ``batch_size`` was passed.
"""

from __future__ import annotations

import re
from collections import Counter

from slurm_colloc.estimators.errors import SummaryParseError
from slurm_colloc.estimators.layers import is_container_type
from slurm_colloc.estimators.model import Layer, ModelSummary
from slurm_colloc.estimators.parsers._common import (
    footer_count,
    parse_count,
    parse_shapes,
    per_sample,
    split_brackets,
)

_HEADER = re.compile(r"^\s*Layer \(type\)\s+Output Shape\s+Param #\s*$")
_ROW = re.compile(r"^\s*(?P<type>[A-Za-z_][\w.]*)-(?P<idx>\d+)\s+(?P<rest>.+)$")


def looks_like(text: str) -> bool:
    """torchsummary's header has no depth-idx and rows end in ``-<index>``."""
    return any(_HEADER.match(line) for line in text.splitlines()[:40])


def parse(text: str) -> ModelSummary:
    """Parse a torchsummary table into a :class:`ModelSummary`."""
    lines = text.splitlines()
    head = next((i for i, line in enumerate(lines) if _HEADER.match(line)), None)
    if head is None:
        raise SummaryParseError("torchsummary: no 'Layer (type) Output Shape Param #' header")
    raw: list[tuple[str, list[list[int | None]] | None, int]] = []
    started = False
    for i in range(head + 1, len(lines)):
        line = lines[i]
        stripped = line.strip()
        if not stripped:
            continue
        if set(stripped) <= {"=", "-"}:
            if started:
                break
            continue
        started = True
        m = _ROW.match(line)
        if m is None:
            raise SummaryParseError("torchsummary: unreadable layer row", line_no=i + 1, line=line)
        try:
            toks = split_brackets(m.group("rest"))
        except ValueError as e:
            raise SummaryParseError(f"torchsummary: {e}", line_no=i + 1, line=line) from None
        if len(toks) != 2:
            raise SummaryParseError("torchsummary: expected an output shape and a parameter "
                                    "count", line_no=i + 1, line=line)
        raw.append((m.group("type"), parse_shapes(toks[0], i + 1, line),
                    parse_count(toks[1], i + 1, line)))
    if not raw:
        raise SummaryParseError("torchsummary: table has no layer rows", line_no=head + 1)
    firsts = [s[0][0] for _, s, _ in raw if s and s[0] and s[0][0] not in (None, -1)]
    batch = Counter(firsts).most_common(1)[0][0] if firsts else None
    layers = tuple(
        Layer(type=t, params=p, output_shape=per_sample(s, batch), leaf=not is_container_type(t))
        for t, s, p in raw
    )
    footer = lines[head:]
    total = footer_count("Total params:", footer)
    if total is None:
        total = sum(layer.params for layer in layers)
    trainable = footer_count("Trainable params:", footer)
    meta = {}
    mm = re.search(r"Forward/backward pass size \(MB\):\s*([\d.]+)", text)
    if mm:
        meta["fwd_bwd_mib"] = mm.group(1)
    return ModelSummary(format="torchsummary", layers=layers, total_params=total,
                        trainable_params=trainable if trainable is not None else total, meta=meta)
