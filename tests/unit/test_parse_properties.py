"""Property-based tests of the parsers: what a tool prints for a model, we read back."""

from __future__ import annotations

import contextlib
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_colloc.estimators import EstimatorInputError, ModelSummary, parse_summary

TYPES = ["Conv2d", "Linear", "BatchNorm2d", "ReLU", "GELU", "Dropout", "MaxPool2d", "LayerNorm"]

layer_st = st.tuples(
    st.sampled_from(TYPES),
    st.lists(st.integers(1, 4096), min_size=1, max_size=3),
    st.integers(0, 50_000_000),
)
model_st = st.lists(layer_st, min_size=1, max_size=30)
batch_st = st.integers(1, 512)


def _fmt_shape(batch: str, dims: list[int]) -> str:
    return "[" + ", ".join([batch, *map(str, dims)]) + "]"


def torchinfo_text(layers: list[tuple[str, list[int], int]], batch: int) -> str:
    rows = [f"{'Net':<40} {_fmt_shape(str(batch), [10]):<25} --"]
    for i, (t, dims, p) in enumerate(layers, 1):
        params = f"{p:,}" if p else "--"
        rows.append(f"{'├─' + t + f': 1-{i}':<40} {_fmt_shape(str(batch), dims):<25} {params}")
    total = sum(p for _, _, p in layers)
    bar = "=" * 90
    return "\n".join([bar, f"{'Layer (type:depth-idx)':<40} {'Output Shape':<25} Param #", bar,
                      *rows, bar, f"Total params: {total:,}", f"Trainable params: {total:,}",
                      "Non-trainable params: 0", bar]) + "\n"


def torchsummary_text(layers: list[tuple[str, list[int], int]], batch: int | None) -> str:
    b = "-1" if batch is None else str(batch)
    rows = [f"{t + '-' + str(i):>20} {_fmt_shape(b, dims):>25} {p:>15,}"
            for i, (t, dims, p) in enumerate(layers, 1)]
    total = sum(p for _, _, p in layers)
    return "\n".join(["-" * 64, f"{'Layer (type)':>20} {'Output Shape':>25} {'Param #':>15}",
                      "=" * 64, *rows, "=" * 64, f"Total params: {total:,}",
                      f"Trainable params: {total:,}", "Non-trainable params: 0", "-" * 64]) + "\n"


def keras_text(layers: list[tuple[str, list[int], int]]) -> str:
    rows = []
    for i, (t, dims, p) in enumerate(layers):
        shape = "(None, " + ", ".join(map(str, dims)) + ")"
        rows += [f" {f'l{i} ({t})':<28}{shape:<26}{p:<10}", ""]
    total = sum(p for _, _, p in layers)
    return "\n".join(['Model: "m"', "_" * 65, " Layer (type)                Output Shape              Param #",
                      "=" * 65, *rows, "=" * 65, f"Total params: {total:,}",
                      f"Trainable params: {total:,}", "Non-trainable params: 0", "_" * 65]) + "\n"


def json_text(layers: list[tuple[str, list[int], int]]) -> str:
    return json.dumps({"format": "colloc-summary/1", "layers": [
        {"type": t, "output_shape": dims, "params": p} for t, dims, p in layers]})


def _check(s: ModelSummary, layers: list[tuple[str, list[int], int]]) -> None:
    assert [(la.type, list(la.output_shape or ()), la.params) for la in s.leaves] == [
        (t, dims, p) for t, dims, p in layers]
    assert s.total_params == sum(p for _, _, p in layers)


@given(model_st, batch_st)
def test_torchinfo_roundtrip(layers: list[tuple[str, list[int], int]], batch: int) -> None:
    s = parse_summary(torchinfo_text(layers, batch))
    assert s.format == "torchinfo"
    _check(s, layers)


@given(model_st, st.one_of(st.none(), batch_st))
def test_torchsummary_roundtrip(layers: list[tuple[str, list[int], int]], batch: int | None) -> None:
    s = parse_summary(torchsummary_text(layers, batch))
    assert s.format == "torchsummary"
    _check(s, layers)


@given(model_st)
def test_keras_roundtrip(layers: list[tuple[str, list[int], int]]) -> None:
    s = parse_summary(keras_text(layers))
    assert s.format == "keras"
    _check(s, layers)


@given(model_st)
def test_json_roundtrip(layers: list[tuple[str, list[int], int]]) -> None:
    _check(parse_summary(json_text(layers)), layers)


@given(model_st, batch_st, batch_st)
def test_fingerprint_ignores_format_and_summary_batch(
        layers: list[tuple[str, list[int], int]], b1: int, b2: int) -> None:
    fps = {parse_summary(torchinfo_text(layers, b1)).fingerprint(),
           parse_summary(torchinfo_text(layers, b2)).fingerprint(),
           parse_summary(torchsummary_text(layers, None)).fingerprint(),
           parse_summary(json_text(layers)).fingerprint()}
    assert len(fps) == 1


@given(model_st, st.integers(0, 29), st.integers(1, 10**6))
def test_fingerprint_changes_with_content(layers: list[tuple[str, list[int], int]], k: int,
                                          delta: int) -> None:
    changed = list(layers)
    t, dims, p = changed[k % len(changed)]
    changed[k % len(changed)] = (t, dims, p + delta)
    assert parse_summary(json_text(layers)).fingerprint() != \
        parse_summary(json_text(changed)).fingerprint()


@settings(max_examples=300)
@given(st.text(max_size=2000))
def test_arbitrary_text_fails_only_with_our_error(text: str) -> None:
    with contextlib.suppress(EstimatorInputError):
        parse_summary(text)


@settings(max_examples=200)
@given(model_st, batch_st, st.data())
def test_truncated_or_corrupted_tables_fail_cleanly(layers: list[tuple[str, list[int], int]],
                                                    batch: int, data: st.DataObject) -> None:
    text = torchinfo_text(layers, batch)
    cut = data.draw(st.integers(0, len(text)))
    junk = data.draw(st.text(max_size=20))
    for variant in (text[:cut], text[:cut] + junk + text[cut:]):
        with contextlib.suppress(EstimatorInputError):
            parse_summary(variant)


# --- security issue 11: parser robustness (hostile summaries) --------------------------
# Every parser, given any text, returns a ModelSummary or raises SummaryParseError /
# EstimatorInputError (the documented input errors) in bounded time: no RecursionError,
# OverflowError, plain ValueError, or a regex that backtracks for seconds.

import re  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

from slurm_colloc.estimators import SummaryParseError  # noqa: E402
from slurm_colloc.estimators.parsers import FORMATS, pytorch_print  # noqa: E402

MIB = 1 << 20
SLOW_S = 2.0
"""Generous bound for a 1 MiB hostile input on a slow, loaded machine (the linear
parsers take well under 0.5 s; the old suffix regex took 24 s on 32 KiB)."""

OLD_SUFFIX = re.compile(r",?\s*(?P<n>[\d,_.]+\s*[KMBG]?)\s+params\s*$", re.IGNORECASE)
"""The quadratic ``pytorch_print._SUFFIX`` this replaces: the reference semantics."""

HEADERS = {
    "torchinfo": "=" * 60 + "\nLayer (type:depth-idx)   Output Shape   Param #\n" + "=" * 60 + "\n",
    "torchsummary": "-" * 60 + "\n        Layer (type)      Output Shape     Param #\n" + "=" * 60
                    + "\n",
    "keras": 'Model: "m"\n' + "_" * 60 + "\n Layer (type)   Output Shape   Param #\n" + "=" * 60
             + "\n",
    "pytorch-print": "Net(\n",
    "json": "",
}
HOSTILE_LINES = {
    "digits": "1" * MIB,
    "digits-params": "1" * MIB + "x params",
    "commas": "1," * (MIB // 2),
    "spaces": "a" + " " * MIB + "b",
    "spaces-params": "a" + " " * MIB + "1",
    "open-brackets": "[" * MIB,
    "brackets": "[1, " * (MIB // 4),
    "parens": "(" * MIB,
    "paren-args": "Linear(" + "(" * MIB,
    "name": "(a): " + "A" * MIB,
    "repeat": "(0): " + "1 " * (MIB // 2),
    "tree": "│ " * (MIB // 2) + "x",
    "position": "(" + "position" * (MIB // 8),
    "keras-shape": "(1" * (MIB // 2),
    "keras-multi": "[(1" * (MIB // 3),
    "keras-name": "(" * MIB + ")y (None, 1) 0",
    "shape": "x (T) (None, " + "1," * (MIB // 2),
    "row": "Conv2d-1 " + "[-1, " * (MIB // 5),
}


def _parse_timed(text: str, fmt: str) -> float:
    t0 = time.perf_counter()
    with contextlib.suppress(EstimatorInputError):
        parse_summary(text, fmt=fmt)
    return time.perf_counter() - t0


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("kind", list(HOSTILE_LINES))
def test_low_hostile_megabyte_line_parses_fast(fmt: str, kind: str) -> None:
    """Security issue 11 (Low, ReDoS): ``pytorch_print._SUFFIX`` was quadratic (a 32 KiB
    line of digits took 24 s); no parser may be super-linear on a 1 MiB line."""
    line = HOSTILE_LINES[kind]
    text = HEADERS[fmt] + line + "\n"
    if fmt == "json":
        text = '{"format": "colloc-summary/1", "layers": [{"type": "' + line + '"}]}'
    took = _parse_timed(text, fmt)
    assert took < SLOW_S, f"{fmt} took {took:.1f} s on a 1 MiB {kind} line"


def test_low_suffix_scan_does_not_backtrack() -> None:
    """The ``, N params`` suffix is found by one backwards scan (no regex search), so
    its cost is linear by construction: 1 MiB and 4 MiB lines of digits cost in
    proportion (a quadratic scan would take 16x as long)."""
    assert not isinstance(getattr(pytorch_print, "_SUFFIX", None), re.Pattern)
    t1 = time.perf_counter()
    for _ in range(5):
        pytorch_print.split_suffix("1" * MIB)
    t1 = time.perf_counter() - t1
    t4 = time.perf_counter()
    for _ in range(5):
        pytorch_print.split_suffix("1" * (4 * MIB))
    t4 = time.perf_counter() - t4
    assert t4 < SLOW_S and t4 < 10 * t1 + 0.05


_suffix_alphabet = st.sampled_from([*"0123456789,_. \tkKmMbBgGxp", "params", "PARAMS", "Params",
                                    ")", "a", "\u0663", "\u00a0"])


@settings(max_examples=2000)
@given(st.lists(_suffix_alphabet, max_size=14).map("".join))
def test_low_suffix_scan_matches_the_old_regex(line: str) -> None:
    """The linear suffix scan reads exactly what the old regex read (same count text,
    same remaining body), so no summary parses differently."""
    m = OLD_SUFFIX.search(line)
    got = pytorch_print.split_suffix(line)
    if m is None:
        assert got is None
    else:
        assert got == (line[: m.start()], m.group("n"))


def _deep_print(levels: int) -> str:
    return ("Net(\n" + "(m): Sequential(\n" * levels
            + "(fc): Linear(in_features=8, out_features=8, bias=True)\n"
            + ")\n" * (levels + 1))


def test_low_deeply_nested_print_model_is_an_input_error() -> None:
    """Security issue 11 (Low): 10,000 nested modules in ``print(model)`` ended in a
    RecursionError traceback; it is a clear parse error now."""
    with pytest.raises(SummaryParseError, match="nested"):
        parse_summary(_deep_print(10_000))
    assert parse_summary(_deep_print(50)).total_params == 72  # real models still parse


def test_low_deeply_nested_json_is_an_input_error() -> None:
    """Security issue 11 (Low): deeply nested JSON made json.loads raise RecursionError."""
    for text in ('{"format": "colloc-summary/1", "layers": ' + "[" * 100_000 + "]" * 100_000
                 + "}", "{" * 200_000):
        with pytest.raises(SummaryParseError):
            parse_summary(text)


BIG = 10**30
ABSURD_SUMMARIES = {
    "torchinfo-row": HEADERS["torchinfo"] + f"Net   [1, 10]   --\n├─Linear: 1-1   [1, 10]   {BIG}\n"
                     + "=" * 60 + "\n",
    "torchinfo-footer": HEADERS["torchinfo"] + "Net   [1, 10]   --\n├─Linear: 1-1   [1, 10]   "
                        "110\n" + "=" * 60 + f"\nTotal params: {BIG:,}\n",
    "torchinfo-shape": HEADERS["torchinfo"] + "Net   [1, 10]   --\n├─Linear: 1-1   "
                       f"[1, {10**20}, {10**20}]   110\n" + "=" * 60 + "\n",
    "torchinfo-suffixed": HEADERS["torchinfo"] + "Net   [1, 10]   --\n├─Linear: 1-1   [1, 10]   "
                          + "9" * 400 + "M\n" + "=" * 60 + "\n",
    "torchinfo-many-digits": HEADERS["torchinfo"] + "Net   [1, 10]   --\n├─Linear: 1-1   "
                             "[1, 10]   " + "9" * 5000 + "\n" + "=" * 60 + "\n",
    "torchsummary": HEADERS["torchsummary"] + f"Linear-1   [-1, 10]   {BIG:,}\n" + "=" * 60
                    + "\n",
    "keras": HEADERS["keras"] + f" d (Dense)   (None, 10)   {BIG}\n" + "=" * 60 + "\n",
    "json": json.dumps({"format": "colloc-summary/1", "layers": [{"type": "L", "params": BIG}]}),
    "json-shape": json.dumps({"format": "colloc-summary/1",
                              "layers": [{"type": "L", "output_shape": [10**20, 10**20]}]}),
    "print-suffix": f"Net(\n  (fc): Linear(in_features=8, out_features=8), {BIG} params\n)\n",
    "print-args": f"Net(\n  (fc): Linear(in_features={10**15}, out_features={10**15})\n)\n",
    "print-dims": "Net(\n  (n): LayerNorm((" + "9999, " * 20_000 + "), eps=1e-05)\n)\n",
    "print-repeat": "Net(\n  (0-9): 1000000000 x Linear(in_features=8, out_features=8)\n)\n",
    "print-repeat-nested": "Net(\n" + "".join(f"(b{k}): 1000 x Seq(\n" for k in range(4))
                           + "(fc): Linear(in_features=8, out_features=8)\n" + ")\n" * 5,
}


@pytest.mark.parametrize("name", list(ABSURD_SUMMARIES))
def test_low_absurd_sizes_are_refused(name: str) -> None:
    """Security issue 11 (Low): 10^30 parameters (or 10^40-element outputs, or a
    billion repeats) were answered with an estimate, or crashed with OverflowError /
    ValueError; they are a clear input error, quickly."""
    t0 = time.perf_counter()
    with pytest.raises(SummaryParseError, match=r"implausibly|too many|too large|nested"):
        parse_summary(ABSURD_SUMMARIES[name])
    assert time.perf_counter() - t0 < SLOW_S


@pytest.mark.parametrize("fmt", list(FORMATS))
@settings(max_examples=150, deadline=None)
@given(text=st.text(st.characters(codec="utf-8"), max_size=3000))
def test_fuzz_every_parser_fails_only_with_the_parse_error(fmt: str, text: str) -> None:
    """Arbitrary text after each format's header: a summary or the documented error."""
    for variant in (text, HEADERS[fmt] + text, HEADERS[fmt] + text + "\n" + "=" * 60 + "\n"):
        t0 = time.perf_counter()
        try:
            s = parse_summary(variant, fmt=fmt)
        except EstimatorInputError:
            continue
        assert isinstance(s, ModelSummary)
        assert time.perf_counter() - t0 < SLOW_S


_table_alphabet = st.sampled_from(
    [*"0123456789[](),-_.: =x│├└─|+\n", "None", "params", "Linear", "Conv2d-1", "├─Linear: 1-1",
     " 1,024 ", "(None, ", "M"])


@pytest.mark.parametrize("fmt", list(FORMATS))
@settings(max_examples=150, deadline=None)
@given(body=st.lists(_table_alphabet, max_size=200).map("".join))
def test_fuzz_table_like_text_fails_only_with_the_parse_error(fmt: str, body: str) -> None:
    """Text made of the tables' own tokens reaches deeper into each parser."""
    try:
        s = parse_summary(HEADERS[fmt] + body, fmt=fmt)
    except EstimatorInputError:
        return
    assert isinstance(s, ModelSummary)


OLD_KERAS_NAME = re.compile(r"^(?P<name>\S+)\s*\((?P<type>[^)]*)\)?\s*$")
"""The quadratic keras ``_NAME`` regex ``keras.name_type`` replaces."""


@settings(max_examples=2000)
@given(st.lists(st.sampled_from([*"ab()  \t", "\u00a0", "Dense", "conv_1"]), max_size=12
                ).map("".join))
def test_low_keras_name_scan_matches_the_old_regex(cell: str) -> None:
    """Security issue 11 (Low, ReDoS): the keras ``name (Type)`` cell is read by one
    linear scan that reads exactly what the old backtracking regex read."""
    from slurm_colloc.estimators.parsers import keras

    m = OLD_KERAS_NAME.match(cell)
    got = keras.name_type(cell)
    assert got == (None if m is None else (m.group("name"), m.group("type")))
