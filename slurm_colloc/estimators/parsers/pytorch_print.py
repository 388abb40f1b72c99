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

from slurm_colloc.estimators.errors import SummaryParseError
from slurm_colloc.estimators.model import Layer, ModelSummary
from slurm_colloc.estimators.parsers._common import (
    MAX_DIGITS,
    MAX_ELEMS,
    MAX_LAYERS,
    MAX_NESTING,
    implausible,
    parse_count,
    sat_prod,
    to_int,
)

_COUNT_CHARS = frozenset(",_.")


def split_suffix(line: str) -> tuple[str, str] | None:
    r"""``(body, count text)`` of a line ending in ``, N params`` (``N`` may carry a
    K/M/B/G unit), else None.

    One backwards scan, linear in the line by construction. It reads exactly what the
    regex ``,?\s*(?P<n>[\d,_.]+\s*[KMBG]?)\s+params\s*$`` (case-insensitive)
    searched for, which was quadratic: every start inside a run of digits rescanned
    the run (a 32 KiB line of digits took 24 s; security issue 11).
    """
    end = len(line.rstrip())
    if end < 6 or line[end - 6:end].lower() != "params":
        return None
    j = end - 6
    k = j
    while k > 0 and line[k - 1].isspace():
        k -= 1
    if k == j:
        return None  # \s+ before "params"
    n_end = j - 1  # the count text keeps the blanks before "params" but the last
    if k > 0 and line[k - 1] in "KMBGkmbg":
        n_end = k
        k -= 1
        while k > 0 and line[k - 1].isspace():
            k -= 1
    run_end = k
    while k > 0 and (line[k - 1].isdecimal() or line[k - 1] in _COUNT_CHARS):
        k -= 1
    if k == run_end:
        return None  # no count before the unit / "params"
    start = k
    while start > 0 and line[start - 1].isspace():
        start -= 1
    if start < k:  # whitespace before the count: ",?" may take a comma before it
        if start > 0 and line[start - 1] == ",":
            start -= 1
        return line[:start], line[k:n_end]
    if line[k] == "," and k + 1 < run_end:
        return line[:k], line[k + 1:n_end]  # ",?" takes the run's leading comma
    return line[:k], line[k:n_end]

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
    first = split_suffix(lines[0]) if lines else None
    head = first[0] if first else (lines[0] if lines else "")
    return bool(lines) and bool(re.match(r"^[A-Za-z_][\w.]*\($", head)) \
        and any(ln.startswith("(") for ln in lines[1:4])


@dataclass
class _Node:
    type: str
    rep: int
    name: str = ""
    dropout_p: float | None = None
    params: int | None = None
    width: int | None = None
    children: list[_Node] = field(default_factory=list)
    leaf: bool = False
    args: str = ""
    """A container's own extra_repr (printed above its children), if any."""
    own: int = 0
    """Parameters the container holds itself that print shows (ParameterList entries,
    MultiheadAttention's input projection)."""
    op_params: int | None = None
    op_width: int | None = None


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
    return to_int(m.group(1), "constructor argument") if m else None


def _dims(s: str) -> int | None:
    """Product of the integers in a size argument: ``(3, 3)`` -> 9, ``(768,)`` -> 768."""
    ds = [to_int(d, "size argument") for d in re.findall(r"\d+", s)]
    if not ds:
        return None
    n = sat_prod(ds)
    if n > MAX_ELEMS:
        raise implausible("size argument")
    return n


def _rnn_params(typ: str, pos: list[str], kw: dict[str, str]) -> tuple[int | None, int | None]:
    """``LSTM(64, 128, num_layers=2, bidirectional=True, proj_size=32)``: PyTorch's
    ``weight_ih/hh_l{k}``, ``bias_ih/hh_l{k}`` (and LSTM's ``weight_hr``) per layer and
    direction; the output width is ``hidden (or proj) x directions``."""
    fin = _int(pos[0]) if pos else _int(kw.get("input_size"))
    hid = _int(pos[1]) if len(pos) > 1 else _int(kw.get("hidden_size"))
    if not fin or not hid:
        return None, None
    gates = {"lstm": 4, "gru": 3}.get(typ, 1)
    layers = _int(kw.get("num_layers")) or 1
    dirs = 2 if kw.get("bidirectional") == "True" else 1
    proj = _int(kw.get("proj_size")) or 0
    out = proj or hid
    bias = kw.get("bias", "True") != "False"
    total = 0
    for k in range(layers):
        x = fin if k == 0 else out * dirs
        per_dir = gates * hid * (x + out) + (2 * gates * hid if bias else 0)
        total += dirs * (per_dir + (proj * hid if proj else 0))
    return total, out * dirs


def _leaf_info(typ: str, args: str) -> tuple[int | None, int | None]:
    """(params, width) from a leaf's constructor arguments, for the common layers.

    What ``repr`` shows, per layer: ``Conv2d(3, 64, kernel_size=(7, 7), ...)`` (the
    kernel is a keyword), Hugging Face's ``Conv1D(nf=2304, nx=768)`` (GPT-2's
    transposed linear), ``LayerNorm((768,), ..., bias=False)`` and RMSNorm (weight
    only), ``GroupNorm(groups, channels)``, recurrent layers (see :func:`_rnn_params`).
    Unknown types give ``(None, None)``: no parameters, the previous layer's width.
    """
    pos, kw = _kwargs(args)
    bias = kw.get("bias", "True") != "False"
    t = typ.lower()
    if t in {"linear", "nondynamicallyquantizablelinear"}:
        fin, fout = _int(kw.get("in_features")), _int(kw.get("out_features"))
        if fin and fout:
            return fin * fout + (fout if bias else 0), fout
    if t in {"embedding", "embeddingbag"} and len(pos) >= 2:
        n, d = _int(pos[0]), _int(pos[1])
        if n and d:
            return n * d, d
    if t == "conv1d" and "nf" in kw and "nx" in kw:  # transformers.pytorch_utils.Conv1D
        nf, nx = _int(kw["nf"]), _int(kw["nx"])
        if nf and nx:
            return nx * nf + nf, nf
    if t in {"lstm", "gru", "rnn"}:
        return _rnn_params(t, pos, kw)
    if t == "prelu":
        n = _int(kw.get("num_parameters")) or 1
        return n, None
    if t == "bilinear":
        f1, f2 = _int(kw.get("in1_features")), _int(kw.get("in2_features"))
        fout = _int(kw.get("out_features"))
        if f1 and f2 and fout:
            return f1 * f2 * fout + (fout if bias else 0), fout
    if "norm" in t:
        if t == "groupnorm":
            width = _int(pos[1]) if len(pos) > 1 else _int(kw.get("num_channels"))
        else:
            width = _dims(pos[0]) if pos else None
        affine = kw.get("elementwise_affine", kw.get("affine", "True")) != "False"
        if width:
            per = 1 if "rms" in t or not bias else 2  # RMSNorm has a weight, no bias
            return (per * width if affine else 0), width
    if t.startswith("conv") and len(pos) >= 2:
        cin, cout = _int(pos[0]), _int(pos[1])
        k = _dims(kw["kernel_size"]) if "kernel_size" in kw else (
            _dims(pos[2]) if len(pos) >= 3 else None)
        groups = _int(kw.get("groups")) or 1
        if cin and cout and k:
            return cin // groups * cout * k + (cout if bias else 0), cout
    return None, None


_PARAM_LINE = re.compile(
    r"^(?:\([^)]*\):\s*)?(?:Parameter|Tensor) containing:\s*\[\S+ of size (?P<size>[\dx]*)"
)
"""A ``ParameterList`` / ``ParameterDict`` entry: ``(0): Parameter containing:
[torch.float32 of size 10x32]`` (a 0-d parameter has an empty size)."""
_OBJECT_LINE = re.compile(r"^(?:\([^)]*\):\s*)?Object of type: \S+$")


def _mha_in_proj(node: _Node) -> int:
    """``MultiheadAttention`` owns its packed ``in_proj_weight`` (3E x E) and bias; print
    shows only its ``out_proj`` child (E x E). Assumes ``kdim = vdim = E`` (the default)."""
    out = next((c for c in node.children if c.leaf and c.width), None)
    if out is None or out.width is None:
        return 0
    e = out.width
    bias = out.params is not None and out.params > e * e
    return 3 * e * e + (3 * e if bias else 0)


def parse(text: str) -> ModelSummary:
    """Parse ``print(model)`` output into a :class:`ModelSummary`.

    Besides ``(name): Type(args)`` leaves and ``(name): Type(`` ... ``)`` containers,
    ``repr`` prints a module's own ``extra_repr`` lines at the top of its body when it
    also has children (timm's ``BatchNormAct2d(`` / ``32, eps=1e-05, ...`` / ``(act):
    SiLU()`` / ``)``) or when the extra_repr spans several lines (then the body is the
    arguments of a leaf); ``ParameterList`` entries are ``(0): Parameter containing:
    [torch.float32 of size 10]`` lines. All three are read, not rejected.
    """
    lines = text.splitlines()
    root: _Node | None = None
    stack: list[_Node] = []
    for i, raw in enumerate(lines):
        line = raw.strip()
        if not line:
            continue
        suffix = split_suffix(line)
        count = parse_count("".join(suffix[1].split()), i + 1, raw) if suffix else None
        body = suffix[0].rstrip(",").strip() if suffix else line
        if _CLOSE.match(body) or body == "),":
            if not stack:
                raise SummaryParseError("print(model): ')' closes nothing", line_no=i + 1,
                                        line=raw)
            node = stack.pop()
            _close(node)
            if count is not None:
                node.params = count
            continue
        m = _OPEN.match(body)
        if m:
            if len(stack) >= MAX_NESTING:
                raise SummaryParseError(f"print(model): modules nested more than {MAX_NESTING} "
                                        "deep; not a real model", line_no=i + 1, line=raw)
            node = _Node(type=m.group("type"), rep=_rep(m.group("rep"), i + 1, raw),
                         params=count, name=m.group("name") or "")
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
            node = _Node(type=m.group("type"), rep=_rep(m.group("rep"), i + 1, raw),
                         params=count if count is not None else params, width=width, leaf=True,
                         name=m.group("name") or "", dropout_p=_dropout_p(m.group("args")))
            stack[-1].children.append(node)
            continue
        pm = _PARAM_LINE.match(body)
        if pm and stack:
            sizes = [to_int(d, "parameter size", i + 1, raw)
                     for d in pm.group("size").split("x") if d] if pm.group("size") else []
            n = sat_prod(sizes)
            if n > MAX_ELEMS:
                raise implausible("parameter size", i + 1, raw)
            stack[-1].own += n
            continue
        if _OBJECT_LINE.match(body) and stack:
            continue
        if stack and not stack[-1].children and not re.match(r"^\([^)]*\):", body):
            # the module's own extra_repr, printed above its children
            stack[-1].args = f"{stack[-1].args}, {body}" if stack[-1].args else body
            continue
        if root is not None and not stack:
            break  # trailing text after the model
        raise SummaryParseError("print(model): not a module line", line_no=i + 1, line=raw)
    if root is None:
        raise SummaryParseError("print(model): no 'Model(' line")
    if stack:
        raise SummaryParseError(f"print(model): {len(stack)} unclosed module(s) at end of text")

    if _expanded(root) > MAX_LAYERS:
        raise SummaryParseError(f"print(model): too many layers once repeats are expanded "
                                f"(> {MAX_LAYERS}); not a real model")
    computed = _totals(root)
    rows = _flatten(root)
    layers = [r for r in rows if r.leaf]

    total = root.params if root.params is not None else computed
    seq = _max_positions(lines)
    meta = {"max_positions": str(seq)} if seq else {}
    if any(split_suffix(ln.strip()) for ln in lines[:3]):
        meta["param_counts"] = "shown"  # the `, N params` suffix: counts are exact
    # how leaves and containers interleave (recognition rebuilds the tree from it)
    meta["row_order"] = "".join("l" if r.leaf else "c" for r in rows)
    return ModelSummary(format="pytorch-print", layers=tuple(layers), total_params=total,
                        trainable_params=total, meta=meta,
                        containers=tuple(r for r in rows if not r.leaf))


_DROPOUT_P = re.compile(r"^p=(\d{1,3}(?:\.\d{1,12})?)(?:,|$)")


def _dropout_p(args: str) -> float | None:
    """``p`` of ``Dropout(p=0.1, inplace=False)``, if the arguments start with it."""
    m = _DROPOUT_P.match(args.strip())
    return float(m.group(1)) if m else None


def _rep(digits: str | None, line_no: int, raw: str) -> int:
    """The ``N`` of ``N x Block(`` (1 without one)."""
    if digits is None:
        return 1
    if len(digits) > 9:
        raise SummaryParseError("print(model): too many repeats", line_no=line_no, line=raw)
    return int(digits)


def _postorder(root: _Node) -> list[_Node]:
    """Every node once, children before parents (iterative: no recursion limit)."""
    out: list[_Node] = []
    stack = [root]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children)
    out.reverse()
    return out


def _has_op(node: _Node) -> bool:
    return node.op_params is not None or node.op_width is not None


def _expanded(root: _Node) -> int:
    """Rows (leaves, containers and container ops) with repeats expanded, saturating
    above :data:`MAX_LAYERS`: computed bottom-up once per distinct node, so nested
    ``N x`` repeats cost nothing to count however large their product."""
    rows: dict[int, int] = {}
    for node in _postorder(root):
        own = 1 if node.leaf else 1 + _has_op(node) + sum(rows[id(c)] for c in node.children)
        rows[id(node)] = min(node.rep * min(own, MAX_LAYERS + 1), MAX_LAYERS + 1)
    return rows[id(root)]


def _totals(root: _Node) -> int:
    """Parameters of the whole model (one copy of ``root``), bottom-up; stores each
    container's one-copy total in ``node.params`` when print showed none."""
    per_copy: dict[int, int] = {}
    for node in _postorder(root):
        if node.leaf:
            per_copy[id(node)] = node.params or 0
            continue
        sub = node.own + (node.op_params or 0) + sum(
            per_copy[id(c)] * c.rep for c in node.children)
        per_copy[id(node)] = sub
    return per_copy[id(root)]


def _flatten(root: _Node) -> list[Layer]:
    """Rows in print order with repeats expanded (bounded by :func:`_expanded`):
    containers as non-leaf rows holding only the parameters they own themselves (so a
    parameter sum over all rows stays the model's), leaves with their per-token width
    (the previous layer's when the constructor shows none). Iterative, not recursive."""
    layers: list[Layer] = []
    prev_width: int | None = None
    # (node, depth); a repeated node is pushed once per copy
    stack: list[tuple[_Node, int]] = [(root, 0)]
    while stack:
        node, depth = stack.pop()
        if node.leaf:
            width = node.width if node.width is not None else prev_width
            prev_width = width
            layers.append(Layer(type=node.type, params=node.params or 0, width=width,
                                depth=depth, name=node.name, dropout_p=node.dropout_p))
            continue
        layers.append(Layer(type=node.type, params=node.own, depth=depth, leaf=False,
                            name=node.name))
        if _has_op(node):
            # a container that computes itself (BatchNormAct2d): its op is a layer
            width = node.op_width if node.op_width is not None else prev_width
            prev_width = width
            layers.append(Layer(type=node.type, params=node.op_params or 0, width=width,
                                depth=depth + 1, name=node.name))
        for child in reversed(node.children):
            for _ in range(child.rep):
                stack.append((child, depth + 1))
    return layers


def _close(node: _Node) -> None:
    """Finish a node at its ``)``: a body of only arguments is a leaf (multi-line
    extra_repr); a container's own arguments are its op; MultiheadAttention's packed
    input projection is added to what its children show."""
    if node.args and not node.children:
        node.leaf = True
        node.params, node.width = _leaf_info(node.type, node.args)
        return
    if node.args:
        node.op_params, node.op_width = _leaf_info(node.type, node.args)
    if node.type == "MultiheadAttention":
        node.own += _mha_in_proj(node)


def _max_positions(lines: list[str]) -> int | None:
    """A position-embedding table bounds the sequence length (a safe default)."""
    for line in lines:
        if "position" not in line or "Embedding(" not in line:
            continue
        m = _POS_EMBEDDING.search(line)
        if m and "position" in m.group(1) and len(m.group(2)) <= MAX_DIGITS:
            return int(m.group(2))
    return None


_POS_EMBEDDING = re.compile(r"\((\w*)\):\s*Embedding\((\d+),")
r"""``(position_embeddings): Embedding(512, 768)``: the name is checked for "position"
afterwards (``\w*position\w*`` in the pattern backtracked quadratically)."""
