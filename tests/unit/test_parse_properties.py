"""Property-based tests of the parsers: what a tool prints for a model, we read back."""

from __future__ import annotations

import contextlib
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from estimators import EstimatorInputError, ModelSummary, parse_summary

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
