"""Parser for ``torchinfo.summary(...)`` tables (torchinfo 1.5 - 1.8).

The table is a tree: ``├─Conv2d: 1-1``, ``│    └─Bottleneck: 2-1``; depth comes from
the ``d-i`` tag, so a row is a leaf when the next row is not deeper. Columns follow
the header (``Output Shape``, ``Param #`` by default; ``Input Shape``, ``Kernel Shape``,
``Mult-Adds``, ``Param %``, ``Trainable`` optionally). torchinfo's "MB" is 10^6 bytes;
its 1.8 release prints ``Units.MEGABYTES`` instead of ``M`` on Python 3.11 (both read).

Other settings users pass, all read: ``row_settings`` without ``"depth"`` (no ``d-i``
tags: the depth is the tree prefix's), ``"var_names"`` (``Conv2d (conv1): 1-1``),
``"ascii_only"`` (``|    + Conv2d``); frozen parameters (``(9,408)``: the layer is
not trainable); ``verbose=2`` (a ``└─weight ... ├─9,408`` row per parameter tensor
under its layer: skipped, the layer row has the sum).
"""

from __future__ import annotations

import re
from collections import Counter

from slurm_colloc.estimators.errors import SummaryParseError
from slurm_colloc.estimators.model import Layer, ModelSummary
from slurm_colloc.estimators.parsers._common import (
    footer_count,
    parse_count,
    parse_shapes,
    per_sample,
    split_brackets,
    to_int,
)

_HEADER = re.compile(r"^\s*Layer \(type(?: \(var_name\))?(?::depth-idx)?\)")
_ROW = re.compile(
    r"^(?P<tree>[\s│├└─|`+\\-]*)(?P<type>[A-Za-z_][\w.]*)(?:\s+\((?P<var>[^)]*)\))?"
    r"(?::\s*(?P<depth>\d+)-(?P<idx>\d+))?(?P<rest>.*)$"
)
_PARAM_ROW = re.compile(r"^[\s│|]*(?:[├└]─|\+ )\S+\s+[├└]─[\d,]+(?:\s|$)")
"""``verbose=2``: a parameter tensor's row (``│    └─0.conv1.weight   ├─36,864``): its
name, then its count tree-marked in ``Param #`` (box characters also under
``ascii_only``), no depth tag and no output shape."""
_FROZEN = re.compile(r"^\(([\d,]+)\)$")
"""torchinfo puts a count in parentheses when none of the layer's parameters train."""
# A childless row with parameters but no output shape is a container torchinfo never
# saw called: a ModuleList / ModuleDict, or a Sequential whose blocks the model loops
# over itself (timm's Swin-V2-CR). Cut off by the depth limit (the default depth=3 does
# this to the encoder of Hugging Face ``*ForSequenceClassification`` models), the
# layers it hides ran and produced the enclosing row's shape, which it gets; it then
# counts as a hidden block like any container shown without children (otherwise the
# whole encoder had no activations).
_COLUMNS = ("Input Shape", "Output Shape", "Kernel Shape", "Param #", "Param %",
            "Mult-Adds", "Trainable")


def looks_like(text: str) -> bool:
    """torchinfo's header names the depth-idx column."""
    return "(type:depth-idx)" in text or (
        "Layer (type" in text and "====" in text and ("├─" in text or "└─" in text)
    )


def _columns(header: str) -> list[str]:
    found = [(header.find(c), c) for c in _COLUMNS if c in header]
    return [c for _, c in sorted(found)]


def parse(text: str) -> ModelSummary:
    """Parse a torchinfo summary table into a :class:`ModelSummary`."""
    lines = text.splitlines()
    head = next((i for i, line in enumerate(lines) if _HEADER.match(line)), None)
    if head is None:
        raise SummaryParseError("torchinfo: no 'Layer (type:depth-idx)' header line")
    cols = _columns(lines[head])
    if "Output Shape" not in cols:
        # without output shapes no activation can be sized: estimating from the
        # parameters alone underestimates every job (ResNet-50 at batch 128: 2.1 GiB
        # for a 20 GiB run), so this is refused, never answered
        raise SummaryParseError(
            "torchinfo: the table has no 'Output Shape' column, so activations cannot be "
            "estimated; re-run torchinfo.summary with the default col_names (or include "
            "\"output_size\")", line_no=head + 1, line=lines[head])
    rows: list[tuple[int, str, list[list[int | None]] | None, int, bool, int]] = []
    body_started = False
    for i in range(head + 1, len(lines)):
        line = lines[i]
        if set(line.strip()) <= {"=", "-"}:
            if body_started:
                break
            continue
        if not line.strip():
            continue
        body_started = True
        if _PARAM_ROW.match(line):
            continue  # verbose=2: one parameter tensor of the layer above
        m = _ROW.match(line)
        if m is None:
            raise SummaryParseError("torchinfo: unreadable layer row", line_no=i + 1, line=line)
        depth = (to_int(m.group("depth"), "depth", i + 1, line) if m.group("depth")
                 else _tree_depth(m.group("tree")))
        try:
            toks = split_brackets(m.group("rest"))
        except ValueError as e:
            raise SummaryParseError(f"torchinfo: {e}", line_no=i + 1, line=line) from None
        if len(toks) != len(cols):
            raise SummaryParseError(
                f"torchinfo: expected {len(cols)} columns ({', '.join(cols)}), found {len(toks)}",
                line_no=i + 1, line=line,
            )
        vals = dict(zip(cols, toks, strict=True))
        shapes = parse_shapes(vals["Output Shape"], i + 1, line) if "Output Shape" in vals else None
        count = vals.get("Param #", "--")
        frozen = _FROZEN.match(count)
        params = parse_count(frozen.group(1) if frozen else count, i + 1, line)
        trainable = vals.get("Trainable", "True") != "False" and not frozen
        rows.append((depth, m.group("type"), shapes, params, trainable, i + 1))
    if not rows:
        raise SummaryParseError("torchinfo: table has no layer rows", line_no=head + 1)
    if len(rows) == 1 and rows[0][3] > 0:
        # depth=0: the model row alone, its layers hidden. Counted as one hidden block
        # it would size activations from the model's output (logits) only: far too low.
        raise SummaryParseError(
            "torchinfo: only the model row is shown (depth=0), no layers to size the "
            "activations from; re-run torchinfo.summary with depth >= 1 (default 3)",
            line_no=rows[0][5], line=lines[rows[0][5] - 1])

    firsts = [s[0][0] for _, _, s, _, _, _ in rows if s and s[0] and s[0][0] is not None]
    batch = Counter(firsts).most_common(1)[0][0] if firsts else None
    layers = []
    enclosing: list[tuple[int, list[list[int | None]] | None]] = []  # (depth, shapes)
    for k, (depth, typ, shapes, params, trainable, _) in enumerate(rows):
        nxt = rows[k + 1][0] if k + 1 < len(rows) else -1
        leaf = nxt <= depth
        if k == 0 and len(rows) > 1 and depth == 0:
            leaf = False  # the model row itself
        while enclosing and enclosing[-1][0] >= depth:
            enclosing.pop()
        if leaf and shapes is None and params > 0:
            shapes = next((sh for _, sh in reversed(enclosing) if sh), None)
        enclosing.append((depth, shapes))
        layers.append(Layer(type=typ, params=params, output_shape=per_sample(shapes, batch),
                            depth=depth, leaf=leaf, trainable=trainable))
    footer = lines[head:]
    total = footer_count("Total params:", footer)
    if total is None:
        total = sum(layer.params for layer in layers)
    trainable_total = footer_count("Trainable params:", footer)
    meta = {}
    for key, label in (("fwd_bwd_mb", "Forward/backward pass size"), ("input_mb", "Input size")):
        mm = re.search(re.escape(label) + r" \((?:MB|Units\.MEGABYTES)\):\s*([\d.]+)", text)
        if mm:
            meta[key] = mm.group(1)
    if batch is not None:
        meta["summary_batch"] = str(batch)
    return ModelSummary(
        format="torchinfo",
        layers=tuple(layers),
        total_params=total,
        trainable_params=trainable_total if trainable_total is not None else total,
        seq_len=_seq_len(layers),
        meta=meta,
    )


def _tree_depth(prefix: str) -> int:
    """Depth from the tree drawing, for tables without ``d-i`` tags (``row_settings``
    without ``"depth"``): torchinfo draws depth ``d >= 1`` as ``d - 1`` ``│    ``
    (``|    ``) groups then ``└─`` (``├─`` / ``+ `` at depth 1), the model row bare."""
    if not prefix.strip():
        return 0
    return prefix.count("│") + prefix.count("|") + 1


def _seq_len(layers: list[Layer]) -> int | None:
    """Token models: the sequence length is the first dim of an Embedding's output."""
    for layer in layers:
        shape = layer.output_shape
        if "embedding" in layer.type.lower() and shape and len(shape) == 2:
            return shape[0]
    return None
