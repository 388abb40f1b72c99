"""Fuzz tests, one per parser: any text built from the format's own pieces gives a
summary or one clear input error, in bounded time and memory; hostile nesting and
repeats are refused, not expanded; only regular files are read."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_colloc.estimators import EstimatorInputError, ModelSummary, estimate, parse_summary
from slurm_colloc.estimators.parsers import ALL_FORMATS, read_summary_file

TIME_BOUND_S = 1.0
"""Per fuzzed input (each is at most a few kB; real parses take milliseconds)."""

PIECES: dict[str, list[str]] = {
    "torchinfo": [
        "=" * 40 + "\n", "Layer (type:depth-idx)   Output Shape   Param #\n",
        "Layer (type (var_name):depth-idx)   Input Shape   Output Shape   Param #\n",
        "├─Conv2d: 1-1   [1, 64, 112, 112]   9,408\n", "│    └─ReLU: 2-1   [1, 64]   --\n",
        "│    │    └─Linear: 3-1   [1, 197, 768]   (590,592)\n", "├─ModuleList: 1-2   --   85,054\n",
        "Total params: 25,557,032\n", "Trainable params: 1\n", "[[1, 2], [1, 3]]", " -- ", "\n",
        "Forward/backward pass size (MB): 3.2\n", "1" * 30, "[", "]", "│", "└─", ": 99-9",
    ],
    "torchsummary": [
        "-" * 40 + "\n", "        Layer (type)               Output Shape         Param #\n",
        "=" * 40 + "\n", "            Conv2d-1         [-1, 64, 112, 112]           9,408\n",
        "       Bottleneck-12          [-1, 256, 56, 56]               0\n",
        "Total params: 25,557,032\n", "[-1, ", "]", "1" * 20, "\n", " ", "-3",
    ],
    "keras": [
        'Model: "m"\n', "_" * 40 + "\n", " Layer (type)    Output Shape    Param #\n",
        "=" * 40 + "\n", " dense (Dense)   (None, 512)     401920\n",
        " multi_head_attention (MultiHeadAttention)  (None, 200, 32)  8416\n",
        " max_pooling2d (MaxPooling2D  (None, 13, 13, 32)  0\n", " )\n", "│", "┃", "(None, ",
        ")", "Total params: 1,024\n", "[(None, 200)]", "multiple", "\n",
    ],
    "flax": [
        "┏━━━┳━━━┓\n", "┃ path ┃ module ┃ inputs ┃ outputs ┃ params ┃\n",
        "┃ path ┃ module ┃ outputs ┃ batch_stats ┃ params ┃\n", "┡━━━╇━━━┩\n",
        "│ Conv_0 │ Conv │ float32[1,28,28,1] │ float32[1,26,26,32] │ bias: float32[32] │\n",
        "│  │  │  │  │ 320 (1.3 KB) │\n", "│ a/b/c │ Dense │ x │ float32[8,10] │ 1,000 │\n",
        "├───┼───┤\n", "│  │  │  │ Total │ 9 │\n", "Total Parameters: 330\n", "float32[",
        "]", "│", "\n", "9" * 20,
    ],
    "pytorch-print": [
        "Net(\n", "  (fc): Linear(in_features=8, out_features=8, bias=True)\n",
        "  (0-11): 12 x Block(\n", "  (0-999): 1000 x Layer(\n", ")\n", "), 1,024 params\n",
        "  (conv): Conv2d(3, 64, kernel_size=(7, 7), stride=(2, 2))\n",
        "  (attn): BertSelfAttention(\n", "  (c_attn): Conv1D(nf=2304, nx=768)\n",
        "  (emb): Embedding(30522, 768, padding_idx=0)\n",
        "  (0): Parameter containing: [torch.float32 of size 10x32]\n", ", 1,024 params",
        "(", ")", "1" * 20, "\n", "  (x): Frob(a=1)\n", "32, eps=1e-05\n",
    ],
    "json": [
        '{"format": "colloc-summary/1", "layers": [', '{"type": "Linear", ',
        '"output_shape": [1024], ', '"params": 803840}', '"width": 768', "]", "}", ",",
        '"total_params": 1e30', '"seq_len": 512', "[", "{", '"', ":", "null", "1" * 20,
    ],
}


def _run_bounded(text: str, fmt: str) -> ModelSummary | None:
    t0 = time.perf_counter()
    try:
        s: ModelSummary | None = parse_summary(text, fmt=fmt)
    except EstimatorInputError as e:
        assert str(e) and "\n" not in str(e).strip()
        s = None
    took = time.perf_counter() - t0
    assert took < TIME_BOUND_S, f"{fmt}: {took:.2f} s on a {len(text)}-char input"
    return s


def _fuzz(fmt: str) -> None:
    @settings(max_examples=150, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(st.lists(st.sampled_from(PIECES[fmt]), min_size=1, max_size=60))
    def run(parts: list[str]) -> None:
        text = "".join(parts)
        s = _run_bounded(text, fmt)
        if s is not None:
            # anything that parses can be estimated, or is refused with one line
            try:
                e = estimate(s, batch_size=8, seq_len=128)
            except EstimatorInputError:
                return
            assert 0 < e.estimate_mib < 10**12
            # the auto-detected path gives the same or a clear error
            _run_bounded(text, fmt)

    run()


@pytest.mark.parametrize("fmt", sorted(PIECES))
def test_fuzz_each_parser(fmt: str) -> None:
    assert fmt in ALL_FORMATS
    _fuzz(fmt)


FLAX_HEAD = ("┏━━━┓\n┃ path ┃ module ┃ inputs ┃ outputs ┃ params ┃\n┡━━━┩\n")


@pytest.mark.parametrize("line", [
    "1" * (1 << 20), "│" * (1 << 20), "│ a │ B │ x │ float32[" + "1," * (1 << 19) + " │ 1 │",
    "│ a │ B │ x │ " + "float32[" * (1 << 17) + " │ 1 │", "[" * (1 << 20), "Total Parameters: "
    + "9" * (1 << 20),
])
def test_flax_hostile_megabyte_line_parses_fast(line: str) -> None:
    """As the security tests do for the other formats: a 1 MiB hostile line is
    parsed or refused in linear time."""
    t0 = time.perf_counter()
    with contextlib.suppress(EstimatorInputError):
        parse_summary(FLAX_HEAD + line + "\n", fmt="flax")
    assert time.perf_counter() - t0 < 2.0


def test_nested_repeats_are_counted_not_expanded() -> None:
    """A 181-byte print(model) of nested ``N x`` repeats ran > 10 s into a MemoryError:
    the expansion is counted bottom-up and refused above the layer cap."""
    text = "M(\n" + "(a): 999999999 x B(\n" * 8 + "(l): Linear(in_features=9, out_features=9)\n" \
        + ")\n" * 9
    t0 = time.perf_counter()
    with pytest.raises(EstimatorInputError, match="too many layers"):
        parse_summary(text)
    assert time.perf_counter() - t0 < 0.5


def test_deep_nesting_is_refused_without_recursion() -> None:
    for depth in (1_000, 20_000):
        text = "M(\n" + "(a): B(\n" * depth + ")\n" * (depth + 1)
        with pytest.raises(EstimatorInputError, match="nested"):
            parse_summary(text)


def test_absurd_sizes_are_refused() -> None:
    text = "M(\n  (fc): Linear(in_features=8, out_features=8), " + "1" + "0" * 30 + " params\n)\n"
    with pytest.raises(EstimatorInputError, match="implausibly large"):
        parse_summary(text)
    doc = ('{"format": "colloc-summary/1", "total_params": 1000000000000000000000000000000,'
           ' "layers": [{"type": "Linear", "output_shape": [8], "params": 72}]}')
    with pytest.raises(EstimatorInputError):
        parse_summary(doc)


def test_torchinfo_without_output_shape_is_refused() -> None:
    text = ("=" * 60 + "\nLayer (type:depth-idx)                   Param #\n" + "=" * 60 + "\n"
            "ResNet                                   --\n"
            "├─Conv2d: 1-1                            9,408\n"
            "├─Linear: 1-2                            2,049,000\n" + "=" * 60 + "\n"
            "Total params: 25,557,032\n")
    with pytest.raises(EstimatorInputError, match="no 'Output Shape' column"):
        parse_summary(text)


def test_unknown_format_is_refused() -> None:
    with pytest.raises(EstimatorInputError, match="not a recognised model summary"):
        parse_summary("hello world\nthis is a log file\n")


def test_fifo_is_refused_without_hanging(tmp_path: Path) -> None:
    fifo = tmp_path / "summary.fifo"
    os.mkfifo(fifo)
    result: list[BaseException | None] = []

    def read() -> None:
        try:
            read_summary_file(fifo)
            result.append(None)
        except EstimatorInputError as e:
            result.append(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(5)
    if t.is_alive():  # unblock the reader before failing
        with open(fifo, "w"):
            pass
        pytest.fail("reading a FIFO hung")
    assert isinstance(result[0], EstimatorInputError)
    assert "not a regular file" in str(result[0])


def test_directory_and_device_are_refused(tmp_path: Path) -> None:
    with pytest.raises(EstimatorInputError):
        read_summary_file(tmp_path)
    with pytest.raises(EstimatorInputError, match="not a regular file"):
        read_summary_file("/dev/null")
