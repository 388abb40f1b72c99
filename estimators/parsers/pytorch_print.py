"""Parser for ``print(model)`` text, optionally with a ``, N params`` suffix per line.

This is what users of Hugging Face models usually have::

    BertModel(
      (embeddings): BertEmbeddings(
        (word_embeddings): Embedding(30522, 768, padding_idx=0), 23,440,896 params
        ...
        (layer): ModuleList(
          (0-11): 12 x BertLayer(

There are no output shapes. Leaf layers get a per-token ``width`` from their
constructor arguments (``out_features``, ``embedding_dim``, normalized shape, output
channels); the estimators multiply by the sequence length. Parameters come from the
suffix when present, else from the constructor arguments of the common layers.
``(0-11): 12 x Block(`` repeats a child (PyTorch >= 2.1 prints repeats that way).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from estimators.errors import SummaryParseError
from estimators.model import Layer, ModelSummary
from estimators.parsers._common import parse_count

_SUFFIX = re.compile(r",?\s*(?P<n>[\d,_.]+\s*[KMBG]?)\s+params\s*$", re.IGNORECASE)
_OPEN = re.compile(
    r"^(?:\((?P<name>[^)]*)\):\s*)?(?:(?P<rep>\d+)\s+x\s+)?(?P<type>[A-Za-z_][\w.]*)\($"
)
_LEAF = re.compile(
    r"^(?:\((?P<name>[^)]*)\):\s*)?(?:(?P<rep>\d+)\s+x\s+)?(?P<type>[A-Za-z_][\w.]*)"
    r"\((?P<args>.*)\)$"
)
_CLOSE = re.compile(r"^\)$")


def looks_like(text: str) -> bool:
    """``Name(`` on the first non-empty line and ``(child): Type(`` lines below."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return bool(lines) and bool(re.match(r"^[A-Za-z_][\w.]*\($", _SUFFIX.sub("", lines[0]))) \
        and any(ln.startswith("(") for ln in lines[1:4])


@dataclass
class _Node:
    type: str
    rep: int
    params: int | None = None
    width: int | None = None
    children: list[_Node] = field(default_factory=list)
    leaf: bool = False


def _kwargs(args: str) -> tuple[list[str], dict[str, str]]:
    pos: list[str] = []
    kw: dict[str, str] = {}
    depth, cur = 0, ""
    parts = []
    for ch in args:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    for p in parts:
        p = p.strip()
        if "=" in p and not p.startswith("("):
            k, v = p.split("=", 1)
            kw[k.strip()] = v.strip()
        else:
            pos.append(p)
    return pos, kw


def _int(s: str | None) -> int | None:
    if s is None:
        return None
    m = re.match(r"^\(?\s*(\d+)", s.strip())
    return int(m.group(1)) if m else None


def _leaf_info(typ: str, args: str) -> tuple[int | None, int | None]:
    """(params, width) from a leaf's constructor arguments, for the common layers."""
    pos, kw = _kwargs(args)
    bias = kw.get("bias", "True") != "False"
    t = typ.lower()
    if t in {"linear", "nondynamicallyquantizablelinear"}:
        fin, fout = _int(kw.get("in_features")), _int(kw.get("out_features"))
        if fin and fout:
            return fin * fout + (fout if bias else 0), fout
    if t == "embedding" and len(pos) >= 2:
        n, d = _int(pos[0]), _int(pos[1])
        if n and d:
            return n * d, d
    if "norm" in t:
        width = _int(pos[0]) if pos else None
        affine = kw.get("elementwise_affine", kw.get("affine", "True")) != "False"
        if width:
            return (2 * width if affine else 0), width
    if t.startswith("conv") and len(pos) >= 3:
        cin, cout = _int(pos[0]), _int(pos[1])
        ks = re.findall(r"\d+", pos[2])
        groups = _int(kw.get("groups")) or 1
        if cin and cout and ks:
            k = 1
            for d in ks:
                k *= int(d)
            return cin // groups * cout * k + (cout if bias else 0), cout
    if t == "conv1d" or t == "conv1d_hf":
        return None, None
    return None, None


def parse(text: str) -> ModelSummary:
    """Parse ``print(model)`` output into a :class:`ModelSummary`."""
    lines = text.splitlines()
    root: _Node | None = None
    stack: list[_Node] = []
    for i, raw in enumerate(lines):
        line = raw.strip()
        if not line:
            continue
        suffix = _SUFFIX.search(line)
        count = parse_count(suffix.group("n").replace(" ", ""), i + 1, raw) if suffix else None
        body = _SUFFIX.sub("", line).rstrip(",").strip() if suffix else line
        if _CLOSE.match(body) or body == "),":
            if not stack:
                raise SummaryParseError("print(model): ')' closes nothing", line_no=i + 1,
                                        line=raw)
            node = stack.pop()
            if count is not None:
                node.params = count
            continue
        m = _OPEN.match(body)
        if m:
            node = _Node(type=m.group("type"), rep=int(m.group("rep") or 1), params=count)
            if stack:
                stack[-1].children.append(node)
            elif root is None:
                root = node
            else:
                raise SummaryParseError("print(model): a second top-level module",
                                        line_no=i + 1, line=raw)
            stack.append(node)
            continue
        m = _LEAF.match(body)
        if m and stack:
            params, width = _leaf_info(m.group("type"), m.group("args"))
            node = _Node(type=m.group("type"), rep=int(m.group("rep") or 1),
                         params=count if count is not None else params, width=width, leaf=True)
            stack[-1].children.append(node)
            continue
        if root is not None and not stack:
            break  # trailing text after the model
        raise SummaryParseError("print(model): not a module line", line_no=i + 1, line=raw)
    if root is None:
        raise SummaryParseError("print(model): no 'Model(' line")
    if stack:
        raise SummaryParseError(f"print(model): {len(stack)} unclosed module(s) at end of text")

    layers: list[Layer] = []
    prev_width: list[int | None] = [None]

    def walk(node: _Node, depth: int) -> int:
        """Flatten to leaves (repeats expanded); returns the node's parameter total."""
        if node.leaf:
            width = node.width if node.width is not None else prev_width[0]
            prev_width[0] = width
            p = node.params or 0
            for _ in range(node.rep):
                layers.append(Layer(type=node.type, params=p, width=width, depth=depth))
            return p * node.rep
        total = 0
        for _ in range(node.rep):
            sub = 0
            for child in node.children:
                sub += walk(child, depth + 1)
            total += sub
        return total

    computed = walk(root, 0)
    total = root.params if root.params is not None else computed
    seq = _max_positions(lines)
    meta = {"max_positions": str(seq)} if seq else {}
    return ModelSummary(format="pytorch-print", layers=tuple(layers), total_params=total,
                        trainable_params=total, meta=meta)


def _max_positions(lines: list[str]) -> int | None:
    """A position-embedding table bounds the sequence length (a safe default)."""
    for line in lines:
        m = re.search(r"\(\w*position\w*\):\s*Embedding\((\d+),", line)
        if m:
            return int(m.group(1))
    return None
