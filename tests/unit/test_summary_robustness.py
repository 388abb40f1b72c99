"""Parsers and the default estimator on real summaries in the settings users paste.

The corpus (``data/summaries/robustness/``, made by
``benchmarks/make_robustness_summaries.py`` under the torch venv) covers torchinfo with
non-default ``col_names``, ``depth`` 0/1/3/10, ``row_settings`` (var_names with and
without depth tags, ascii_only), ``verbose=2``, frozen layers, several inputs
(``input_data=`` dicts, ``input_size`` lists, ``dtypes=[torch.long]``); torchsummary on
CNNs (explicit batch, two inputs, frozen layers); ``print(model)`` of Hugging Face,
torchvision and timm models, wrapped (DataParallel, torch.compile) and annotated with
``, N params``. ``MANIFEST.json`` holds each file's true parameter counts.

Parameter totals, per format:

* the table states them (torchinfo, torchsummary, ``, N params``): the parsed total
  and trainable count equal what the tool printed, exactly. That is the true count
  except where torchinfo counts a tied weight once per module holding it (GPT-2, T5:
  ``shown_total_params`` in the manifest); a parser cannot undo that from the table.
* plain ``print(model)`` states no totals; the parser adds up the constructor
  arguments. The result must lie between ``true - container_params`` (parameters a
  module with children owns itself, e.g. ViT's cls_token, never printed) and ``true +
  tied_extra_params`` (a tied weight is printed at every module holding it: an
  over-count, the safe side), with a relative slack of ``PRINT_SLACK`` for leaves whose
  repr shows no size at all (T5's ``T5LayerNorm()``: 0.03 % of t5-small).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurm_colloc.estimators import EstimatorInputError, SummaryParseError, estimate, parse_summary

DATA = Path(__file__).parent / "data" / "summaries" / "robustness"
MANIFEST: dict[str, dict[str, object]] = json.loads((DATA / "MANIFEST.json").read_text())
BATCHES = (1, 8, 64)
ABSURD_MIB = 10 * 1024 * 1024  # 10 TiB
PRINT_SLACK = 0.001

EXPECTED_ERRORS: dict[str, tuple[int, str, str]] = {
    # file: (line number named, message part, why it cannot be estimated)
    "ti_resnet18_depth0.txt": (
        4, "only the model row is shown (depth=0)",
        "torchinfo depth=0 shows the model as one row: no layers, so no activations; "
        "counted as one hidden block it would size a resnet18 at batch 64 by its logits",
    ),
}

REFUSED_ESTIMATES: dict[str, tuple[str, str]] = {
    # file: (message part, why): parsed, but too shallow to estimate from
    "ti_mobilenetv3_depth1.txt": (
        "stops at depth 1",
        "a depth-1 table shows the whole feature extractor as one block; on held-out "
        "timm models depth-1 tables left 65% of jobs underestimated (benchmark)",
    ),
}

SAME_MODEL_GROUPS = (
    # the same model and input in different presentations: the same parsed content
    ("ti_resnet18_allcols.txt", "ti_resnet18_varnames.txt", "ti_resnet18_ascii.txt"),
    ("ti_lstm_seqfirst.txt", "ti_lstm_verbose2_ascii.txt"),
    ("pp_resnet50_tv.txt", "pp_params_resnet50.txt"),
    ("pp_llama.txt", "pp_params_llama.txt"),
    ("pp_lstm_lm.txt", "pp_params_lstm_lm.txt"),
    ("pp_misc_layers.txt", "pp_params_misc_layers.txt"),
    # (not pp_timm_efficientnet_b0 / pp_params_efficientnet_b0: timm overrides
    # SelectAdaptivePool2d.__repr__, so the two texts really show different modules)
)


def _int(entry: dict[str, object], key: str, default: int | None = None) -> int:
    v = entry.get(key, default)
    assert isinstance(v, int), (key, v)
    return v


def test_corpus_is_complete() -> None:
    files = {p.name for p in DATA.glob("*.txt")}
    assert files == set(MANIFEST), "every corpus file has a manifest entry and back"
    formats = {str(e["format"]) for e in MANIFEST.values()}
    assert formats == {"torchinfo", "torchsummary", "pytorch-print"}
    assert all((DATA / f).stat().st_size < 64_000 for f in files)


@pytest.mark.parametrize("fname",
                         sorted(set(MANIFEST) - set(EXPECTED_ERRORS) - set(REFUSED_ESTIMATES)))
def test_corpus_file_parses_and_estimates(fname: str) -> None:
    entry = MANIFEST[fname]
    s = parse_summary((DATA / fname).read_text())
    assert s.format == entry["format"]
    assert s.layers and s.leaves

    total, trainable = _int(entry, "total_params"), _int(entry, "trainable_params")
    if entry["shows_totals"]:
        assert s.total_params == _int(entry, "shown_total_params", total)
        if s.format != "pytorch-print":  # print(model) never shows what trains
            assert s.trainable_params == _int(entry, "shown_trainable_params", trainable)
    else:
        lo = total - _int(entry, "container_params")
        hi = total + _int(entry, "tied_extra_params")
        slack = PRINT_SLACK * total
        assert lo - slack <= s.total_params <= hi + slack, (s.total_params, lo, hi)
    if s.format == "pytorch-print":
        assert s.trainable_params == s.total_params

    mibs = [estimate(s, batch_size=b).estimate_mib for b in BATCHES]
    assert all(m > 0 for m in mibs), mibs
    assert mibs == sorted(mibs), f"not monotone in batch: {mibs}"
    assert max(mibs) < ABSURD_MIB, mibs


@pytest.mark.parametrize("fname", sorted(EXPECTED_ERRORS))
def test_corpus_file_expected_error(fname: str) -> None:
    line_no, part, _why = EXPECTED_ERRORS[fname]
    text = (DATA / fname).read_text()
    with pytest.raises(SummaryParseError) as ei:
        parse_summary(text)
    assert ei.value.line_no == line_no
    assert part in str(ei.value)
    assert f"line {line_no}:" in str(ei.value)
    assert ei.value.line == text.splitlines()[line_no - 1]


@pytest.mark.parametrize("fname", sorted(REFUSED_ESTIMATES))
def test_too_shallow_table_is_refused_with_advice(fname: str) -> None:
    part, _why = REFUSED_ESTIMATES[fname]
    summary = parse_summary((DATA / fname).read_text())  # it parses...
    with pytest.raises(EstimatorInputError) as ei:  # ...but is not estimated from
        estimate(summary, batch_size=8)
    assert part in str(ei.value) and "depth=10" in str(ei.value)


@pytest.mark.parametrize("group", SAME_MODEL_GROUPS, ids=lambda g: g[0])
def test_presentation_does_not_change_the_parse(group: tuple[str, ...]) -> None:
    parsed = [parse_summary((DATA / f).read_text()) for f in group]
    assert len({s.fingerprint() for s in parsed}) == 1
    assert len({estimate(s, batch_size=16).estimate_mib for s in parsed}) == 1


# ------------------------------------------------------------ the fixes, one by one


def test_torchinfo_frozen_counts_in_parentheses() -> None:
    s = parse_summary((DATA / "ti_resnet50_frozen_backbone.txt").read_text())
    conv1 = s.layers[1]
    assert conv1.type == "Conv2d" and conv1.params == 9408 and not conv1.trainable
    fc = s.layers[-1]
    assert fc.type == "Linear" and fc.trainable and fc.params == 2_049_000


def test_torchinfo_depth_from_tree_without_depth_tags() -> None:
    s = parse_summary((DATA / "ti_resnet18_varnames.txt").read_text())
    assert [layer.depth for layer in s.layers[:7]] == [0, 1, 1, 1, 1, 1, 2]
    blocks = [layer for layer in s.layers if layer.type == "BasicBlock"]
    assert len(blocks) == 8 and not any(b.leaf or b.depth != 2 for b in blocks)
    # the same tree as the depth-tagged table of the same model
    tagged = parse_summary((DATA / "ti_resnet18_allcols.txt").read_text())
    assert [(x.depth, x.leaf) for x in s.layers] == [(x.depth, x.leaf) for x in tagged.layers]


def test_torchinfo_verbose2_parameter_rows_skipped() -> None:
    s = parse_summary((DATA / "ti_resnet18_verbose2.txt").read_text())
    assert not any(layer.type in {"weight", "bias"} for layer in s.layers)
    assert sum(layer.params for layer in s.leaves) == s.total_params


def test_torchinfo_modulelist_cut_by_depth_gets_the_enclosing_shape() -> None:
    s = parse_summary((DATA / "ti_bert_seqcls_default_depth.txt").read_text())
    ml = next(layer for layer in s.layers if layer.type == "ModuleList")
    assert ml.leaf and ml.output_shape == (128, 128)  # the BertEncoder row's


@pytest.mark.parametrize(
    ("line", "params"),
    [
        ("(c): Conv2d(3, 64, kernel_size=(7, 7), stride=(2, 2), padding=(3, 3), bias=False)",
         3 * 64 * 49),
        ("(c): Conv2d(32, 32, kernel_size=(3, 3), stride=(1, 1), groups=32)", 32 * 9 + 32),
        ("(c): Conv1d(128, 64, kernel_size=(5,), stride=(1,), padding=(2,))", 128 * 64 * 5 + 64),
        ("(c): ConvTranspose2d(4, 8, kernel_size=(3, 3), stride=(2, 2))", 4 * 8 * 9 + 8),
        ("(c_attn): Conv1D(nf=2304, nx=768)", 768 * 2304 + 2304),
        ("(n): LlamaRMSNorm((512,), eps=1e-06)", 512),
        ("(n): LayerNorm((768,), eps=1e-05, elementwise_affine=True, bias=False)", 768),
        ("(n): GroupNorm(8, 64, eps=1e-05, affine=True, bias=True)", 128),
        ("(lstm): LSTM(64, 128, num_layers=2)",
         4 * 128 * (64 + 128) + 4 * 128 * (128 + 128) + 2 * 2 * 4 * 128),
        ("(gru): GRU(32, 64, batch_first=True, bidirectional=True)",
         2 * (3 * 64 * (32 + 64) + 2 * 3 * 64)),
        ("(lstm): LSTM(10, 20, proj_size=5)", 4 * 20 * (10 + 5) + 2 * 4 * 20 + 5 * 20),
        ("(bag): EmbeddingBag(1000, 32, mode='mean')", 32_000),
        ("(p): PReLU(num_parameters=64)", 64),
        ("(b): Bilinear(in1_features=10, in2_features=32, out_features=7, bias=True)",
         10 * 32 * 7 + 7),
    ],
)
def test_print_parameters_from_constructor_arguments(line: str, params: int) -> None:
    s = parse_summary(f"M(\n  {line}\n  (x): ReLU()\n)\n")
    assert s.total_params == params


def test_print_module_with_arguments_and_children() -> None:
    text = ("M(\n  (bn1): BatchNormAct2d(\n"
            "    32, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True\n"
            "    (drop): Identity()\n    (act): SiLU(inplace=True)\n  )\n"
            "  (scales): ParameterList(\n"
            "      (0): Parameter containing: [torch.float32 of size 10x3]\n  )\n"
            "  (odd): Custom(\n    line one\n    line two\n  )\n)\n")
    s = parse_summary(text)
    assert s.total_params == 64 + 30
    assert [layer.type for layer in s.layers] == ["BatchNormAct2d", "Identity", "SiLU",
                                                   "Custom"]
    assert s.layers[0].width == 32


def test_print_multihead_attention_in_projection() -> None:
    text = ("M(\n  (attn): MultiheadAttention(\n    (out_proj): NonDynamicallyQuantizableLinear("
            "in_features=256, out_features=256, bias=True)\n  )\n)\n")
    assert parse_summary(text).total_params == 4 * 256 * 256 + 4 * 256


def test_print_stray_line_is_named() -> None:
    text = "M(\n  (a): Linear(in_features=2, out_features=2, bias=True)\n  oops\n)\n"
    with pytest.raises(SummaryParseError, match=r"line 3: print\(model\): not a module line"):
        parse_summary(text)
