"""Parser for JAX/Flax ``nn.tabulate(model, rngs)(x)`` tables (flax.linen) and
``nnx.tabulate``.

The table is drawn with box characters (``rich``)::

    ┃ path      ┃ module ┃ inputs             ┃ outputs             ┃ params                    ┃
    ┡━━━━━━━━━━━╇━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━━━━┩
    │           │ CNN    │ float32[1,28,28,1] │ float32[1,10]       │                           │
    ├───────────┼────────┼────────────────────┼─────────────────────┼───────────────────────────┤
    │ Conv_0    │ Conv   │ float32[1,28,28,1] │ float32[1,26,26,32] │ bias: float32[32]         │
    │           │        │                    │                     │ kernel: float32[3,3,1,32] │
    │           │        │                    │                     │                           │
    │           │        │                    │                     │ 320 (1.3 KB)              │

One module call per row, several lines per row (one per variable, then its count);
``path`` is ``Block_0/Dense_1`` for nested modules (the root's is empty), so the depth
is the number of path parts and a row is a leaf when the next row is not deeper.
Extra variable collections (``batch_stats``, ``cache``) are further columns before
``params``; their counts are not parameters. A ``depth=`` limit shows a module
without its children, its count summing theirs. The footer says ``Total Parameters:
N``. Shapes include the batch (the first input dimension of the root row).
"""

from __future__ import annotations

import re
from collections import Counter

from slurm_colloc.estimators.errors import SummaryParseError
from slurm_colloc.estimators.model import Layer, ModelSummary
from slurm_colloc.estimators.parsers._common import (
    MAX_ELEMS,
    footer_count,
    implausible,
    parse_count,
    per_sample,
    sat_prod,
    to_int,
)

_HEADER = re.compile(r"[┃│|]\s*path\s*[┃│|]\s*module\s*[┃│|]")
_SHAPE = re.compile(r"\b[a-z]+\d*\[([\d,\s]*)\]")
"""``float32[1,26,26,32]``, ``bfloat16[8,128]``, ``int32[1,16]`` (no nested brackets:
the body is digits, commas and blanks, so a failed match stops at once)."""
_COUNT = re.compile(r"^([\d,]+)(?:\s*\([^()]*\))?$")
_BOX = str.maketrans({"┃": "│", "|": "│"})


def looks_like(text: str) -> bool:
    """A header cell row ``┃ path ┃ module ┃`` (rich's table)."""
    return bool(_HEADER.search(text[:20000]))


def _cells(line: str) -> list[str] | None:
    s = line.strip().translate(_BOX)
    if not s.startswith("│"):
        return None
    return [c.strip() for c in s.strip("│").split("│")]


def _shapes(cell: str, line_no: int, line: str) -> list[list[int | None]]:
    out: list[list[int | None]] = []
    for m in _SHAPE.finditer(cell):
        dims: list[int | None] = [to_int(d.strip(), "shape", line_no, line)
                                  for d in m.group(1).split(",") if d.strip()]
        out.append(dims)
    return out


def parse(text: str) -> ModelSummary:
    """Parse a Flax tabulate table into a :class:`ModelSummary`."""
    lines = text.splitlines()
    head = next((i for i, ln in enumerate(lines) if _HEADER.search(ln)), None)
    if head is None:
        raise SummaryParseError("flax: no '┃ path ┃ module ┃' header")
    cols = [c.lower() for c in (_cells(lines[head]) or [])]
    if "outputs" not in cols or "params" not in cols:
        raise SummaryParseError("flax: the table has no 'outputs' or 'params' column, so "
                                "activations cannot be estimated", line_no=head + 1,
                                line=lines[head])
    ip, im, io, ipar = (cols.index("path"), cols.index("module"), cols.index("outputs"),
                        cols.index("params"))
    # rows: (line number, path, module, outputs text, params lines)
    rows: list[tuple[int, str, str, list[str], list[str]]] = []
    for i in range(head + 1, len(lines)):
        raw = lines[i]
        cells = _cells(raw)
        if cells is None:
            if rows and raw.strip() and not set(raw.strip()) <= set("━─┡┩╇├┤┼└┘┴╰╯ "):
                break  # the footer ("Total Parameters: ...")
            continue
        if len(cells) != len(cols):
            raise SummaryParseError(f"flax: expected {len(cols)} columns, found {len(cells)}",
                                    line_no=i + 1, line=raw)
        if cells[io] == "Total" or cells[io].startswith("Total"):
            break
        if cells[im]:
            rows.append((i + 1, cells[ip], cells[im], [cells[io]], [cells[ipar]]))
        elif rows:
            rows[-1][3].append(cells[io])
            rows[-1][4].append(cells[ipar])
        else:
            raise SummaryParseError("flax: continuation line before any module row",
                                    line_no=i + 1, line=raw)
    if not rows:
        raise SummaryParseError("flax: table has no module rows", line_no=head + 1)
    parsed: list[tuple[int, str, list[list[int | None]], int]] = []
    for line_no, path, module, outs, pars in rows:
        raw = lines[line_no - 1]
        depth = 0 if not path else path.count("/") + 1
        shapes = _shapes(" ".join(outs), line_no, raw)
        count: int | None = None
        var_elems = 0
        for p in pars:
            m = _COUNT.match(p)
            if m:
                count = parse_count(m.group(1), line_no, raw)
            for dims in _shapes(p, line_no, raw):
                n = sat_prod([d or 1 for d in dims])
                if n > MAX_ELEMS:
                    raise implausible("parameter shape", line_no, raw)
                var_elems += n
        parsed.append((depth, module, shapes, count if count is not None else var_elems))
    firsts = [s[0][0] for _, _, s, _ in parsed if s and s[0]]
    batch = Counter(firsts).most_common(1)[0][0] if firsts else None
    layers = []
    for k, (depth, module, shapes, params) in enumerate(parsed):
        nxt = parsed[k + 1][0] if k + 1 < len(parsed) else -1
        leaf = nxt <= depth and not (k == 0 and depth == 0 and len(parsed) > 1)
        layers.append(Layer(type=module, params=params,
                            output_shape=per_sample(shapes or None, batch),
                            depth=depth, leaf=leaf))
    total = footer_count("Total Parameters:", lines[head:])
    if total is None:
        total = sum(la.params for la in layers)
    meta = {"summary_batch": str(batch)} if batch is not None else {}
    return ModelSummary(format="flax", layers=tuple(layers), total_params=total,
                        trainable_params=total, meta=meta)
