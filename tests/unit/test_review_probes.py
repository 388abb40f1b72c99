"""Review probes for the hidden-block estimator, the layer taxonomy and the history
rules (bdd829c..HEAD). Each test pins one bug found in review and fails before a fix.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from slurm_colloc.estimators import (
    Estimate,
    EstimatorInputError,
    SummaryParseError,
    estimate,
    parse_summary,
    read_summary_file,
)
from slurm_colloc.estimators.features import compute
from slurm_colloc.estimators.history_scaling import scale_history
from slurm_colloc.estimators.model import Layer, ModelSummary

DATA = Path(__file__).parent / "data" / "summaries"
ROB = DATA / "robustness"
DEPTH_NOTE = "torchinfo's depth cut them off"


def _keras2(rows: list[tuple[str, str, str, int]]) -> str:
    out = ['Model: "m"', "_" * 65,
           " Layer (type)                Output Shape              Param #   ", "=" * 65]
    for name, typ, shape, p in rows:
        out += [f" {name + ' (' + typ + ')':<28}{shape:<26}{p:<10}", " " * 65]
    total = sum(r[3] for r in rows)
    out += ["=" * 65, f"Total params: {total:,}", f"Trainable params: {total:,}",
            "Non-trainable params: 0", "_" * 65]
    return "\n".join(out) + "\n"


def _notes(e: Estimate) -> list[str]:
    notes = e.uncertainty.get("notes")
    return [str(n) for n in notes] if isinstance(notes, list) else []


def _torchinfo(layers: list[Layer], fmt: str = "torchinfo") -> ModelSummary:
    tot = sum(la.params for la in layers)
    return ModelSummary(format=fmt, layers=tuple(layers), total_params=tot,
                        trainable_params=tot)


# --- history -------------------------------------------------------------------------


class _Store:
    def __init__(self, points: dict[int, int]):
        self.points = points

    def lookup(self, *a: object) -> int | None:
        return None

    def peaks(self, *a: object) -> dict[int, int]:
        return dict(self.points)

    def record(self, *a: object, **k: object) -> None:
        pass


def test_history_with_only_zero_peaks_falls_back_to_the_estimator() -> None:
    """A successful attempt whose sampled peak was 0 MiB is filed by record_history;
    scale_history then drops every point and _from_history's assert raises
    AssertionError out of estimate() (a traceback in sbatch)."""
    text = (DATA / "resnet50_torchinfo.txt").read_text()
    est = estimate(text, 16, history=_Store({32: 0}))
    assert est.estimate_mib > 1000


def test_anchored_below_is_not_below_the_proportional_floor() -> None:
    """One peak at a larger batch bounds a smaller batch's peak from below too (the
    fixed part does not shrink): 20000 MiB at 64 means at least 2500 MiB at 8. The
    fit rule keeps that floor, the anchored rule takes a far lower cold estimate."""
    s = scale_history({64: 20000}, 8, lambda b: 1000)
    assert s is not None
    assert s.estimate_mib >= 20000 * 8 / 64


# --- hidden blocks in formats that cannot hide blocks ----------------------------------


def test_print_model_batchnormact_is_not_a_hidden_block() -> None:
    """print(model) shows BatchNormAct2d's children; the parser emits its BN op as a
    layer, which is_composite ('norm\\w*act') turns into a hidden block: EfficientNet
    moves to the normfree bucket, 1.8x the estimate at batch 32, and a torchinfo-depth
    note on a print(model) summary."""
    s = read_summary_file(ROB / "pp_timm_efficientnet_b0.txt")
    f = compute(s, 32, None, "adam", "fp32")
    assert f.hidden_share == 0
    e = estimate(s, 32)
    assert e.uncertainty["bucket"] == "cnn"
    assert not any(DEPTH_NOTE in n for n in _notes(e))


def test_keras_prelu_is_not_a_hidden_transformer_block() -> None:
    """Keras PReLU() has one alpha per input element (H*W*C parameters): the
    'act with params >= width^2' rule takes it for a hidden block of 392 output-sized
    tensors plus attention scores (67 GB at batch 32 for a 400k-parameter CNN)."""
    text = _keras2([("conv1", "Conv2D", "(None, 112, 112, 32)", 896),
                    ("prelu", "PReLU", "(None, 112, 112, 32)", 401408),
                    ("gap", "GlobalAveragePooling2D", "(None, 32)", 0),
                    ("dense", "Dense", "(None, 10)", 330)])
    e = estimate(text, 32)
    assert e.estimate_mib < 8 * 1024
    assert e.uncertainty["bucket"] != "attn_hidden"


def test_keras_depthwise_and_separable_convs_are_not_hidden_blocks() -> None:
    """Keras DepthwiseConv2D / SeparableConv2D are single layers; is_composite
    ('depthwise', 'separable') makes them hidden blocks with a torchinfo-depth note."""
    text = _keras2([("conv1", "Conv2D", "(None, 112, 112, 32)", 864),
                    ("bn1", "BatchNormalization", "(None, 112, 112, 32)", 128),
                    ("dw1", "DepthwiseConv2D", "(None, 112, 112, 32)", 288),
                    ("sep1", "SeparableConv2D", "(None, 112, 112, 64)", 2400),
                    ("gap", "GlobalAveragePooling2D", "(None, 64)", 0),
                    ("dense", "Dense", "(None, 10)", 650)])
    s = parse_summary(text)
    assert compute(s, 32, None, "adam", "fp32").hidden_share == 0
    assert not any(DEPTH_NOTE in n for n in _notes(estimate(s, 32)))


# --- hidden-block false positives in complete torchinfo tables -------------------------


def test_embeddingbag_is_not_a_hidden_block() -> None:
    """EmbeddingBag is 'other' (the embedding rule is 'embedding$'); with
    params >= width^2 it becomes vocab*dim/dim^2 hidden output tensors: a DLRM-like
    model with 8 tables of 1M x 64 goes from 11 GB to 218 GB at batch 2048."""
    layers = [Layer("DLRM", 0, (1,), depth=0, leaf=False)]
    layers += [Layer("EmbeddingBag", 1_000_000 * 64, (64,), depth=1) for _ in range(8)]
    layers += [Layer("Linear", 512 * 64 + 64, (64,), depth=1),
               Layer("ReLU", 0, (64,), depth=1), Layer("Linear", 4097, (1,), depth=1)]
    s = _torchinfo(layers)
    assert compute(s, 2048, None, "adam", "fp32").act["hidden_tok"] == 0
    assert estimate(s, 2048).estimate_mib < 20 * 1024


def test_relposbias_leaf_above_the_cut_depth_is_not_hidden() -> None:
    """gcvit's RelPosBias ([heads, N, N] output, (2w-1)^2*heads params) is a complete
    leaf at depth 6 of a depth-7 table; read as a feature map of width 'heads' it
    counts 46 output tensors: gcvit_base at batch 32 is estimated at 350 GB
    (measured 15 GB, 18.9 GB before the change)."""
    layers = [Layer("GlobalContextVit", 0, (1000,), depth=0, leaf=False),
              Layer("Stage", 0, (256, 14, 14), depth=1, leaf=False)]
    for _ in range(8):
        layers += [Layer("WindowAttentionGlobal", 0, (196, 256), depth=2, leaf=False),
                   Layer("Linear", 256 * 768 + 768, (196, 768), depth=3),
                   Layer("RelPosBias", 729 * 16, (16, 196, 196), depth=3),
                   Layer("Linear", 256 * 256 + 256, (196, 256), depth=3),
                   Layer("Mlp", 0, (196, 256), depth=3, leaf=False),
                   Layer("Linear", 256 * 1024, (196, 1024), depth=4),
                   Layer("GELU", 0, (196, 1024), depth=4),
                   Layer("Linear", 1024 * 256, (196, 256), depth=4)]
    s = _torchinfo(layers)
    assert compute(s, 32, None, "adam", "fp32").act["hidden_conv"] == 0


def test_full_depth_multiheadattention_is_not_hidden() -> None:
    """nn.MultiheadAttention never calls its out_proj, so torchinfo always shows it as
    a childless row, at any depth; is_primitive lists it as complete, but the
    'attention' category bypasses that check: a note says depth=10 would help (it
    cannot)."""
    s = read_summary_file(ROB / "ti_nn_transformer_encoder.txt")
    assert compute(s, 32, None, "adam", "fp32").hidden_share == 0


def test_flat_model_with_multiheadattention_is_not_refused() -> None:
    """A complete depth-1 torchinfo table (a flat model holding nn.MultiheadAttention)
    is refused as 'stops at depth 1 and hides blocks'; depth=10 prints the same table."""
    text = """\
==========================================================================================
Layer (type:depth-idx)                   Output Shape              Param #
==========================================================================================
Net                                      [8, 2]                    --
├─Embedding: 1-1                         [8, 128, 256]             2,560,000
├─MultiheadAttention: 1-2                [8, 128, 256]             263,168
├─LayerNorm: 1-3                         [8, 128, 256]             512
├─Linear: 1-4                            [8, 128, 2]               514
==========================================================================================
Total params: 2,824,194
Trainable params: 2,824,194
Non-trainable params: 0
==========================================================================================
"""
    assert estimate(text, 32).estimate_mib > 0


# --- geometry of hidden blocks ------------------------------------------------------------


def _nonsquare(text: str, factor: float) -> str:
    def rep(m: re.Match[str]) -> str:
        b, c, h, w = (int(x) for x in m.group(1).split(","))
        return f"[{b}, {c}, {h}, {round(w * factor)}]".ljust(len(m.group(0)))
    return re.sub(r"\[(\d+, \d+, \d+, \d+)\]", rep, text)


def test_non_square_feature_maps_of_hidden_blocks_stay_feature_maps() -> None:
    """_block_geometry calls [C, H, W] a feature map only when H == W: the default-depth
    EfficientNet-B0 table at 224x320 input (1.43x the pixels) is read as token blocks
    of width W with params/W^2 tensors and attention scores: 6.3 GB -> 200 GB at
    batch 32, bucket attn_hidden."""
    text = (ROB / "ti_efficientnet_b0_depth3.txt").read_text()
    square = estimate(text, 32)
    wide = estimate(_nonsquare(text, 10 / 7), 32)
    assert wide.uncertainty["bucket"] == square.uncertainty["bucket"]
    assert wide.estimate_mib < 2 * square.estimate_mib


def test_3d_feature_maps_of_hidden_blocks_are_feature_maps() -> None:
    """[C, D, H, W] (video / volumetric convs) is read as tokens of width W: an
    r3d_18-like table at depth 2 is estimated at ~1.9 TB for batch 8."""
    layers = [Layer("VideoResNet", 0, (400,), depth=0, leaf=False),
              Layer("BasicStem", 0, (64, 16, 56, 56), depth=1, leaf=False),
              Layer("Conv3d", 28224, (64, 16, 56, 56), depth=2),
              Layer("BatchNorm3d", 128, (64, 16, 56, 56), depth=2),
              Layer("ReLU", 0, (64, 16, 56, 56), depth=2)]
    for c, t, hw, p in ((64, 16, 56, 221952), (128, 8, 28, 886272),
                        (256, 4, 14, 3542016), (512, 2, 7, 14161920)):
        layers += [Layer("Sequential", 0, (c, t, hw, hw), depth=1, leaf=False),
                   Layer("BasicBlock", p // 2, (c, t, hw, hw), depth=2),
                   Layer("BasicBlock", p // 2, (c, t, hw, hw), depth=2)]
    layers += [Layer("AdaptiveAvgPool3d", 0, (512, 1, 1, 1), depth=1),
               Layer("Linear", 205200, (400,), depth=1)]
    s = _torchinfo(layers)
    f = compute(s, 8, None, "adam", "fp32")
    assert f.act["hidden_tok"] == 0 and f.attn_scores == 0
    assert estimate(s, 8).estimate_mib < 64 * 1024


def test_hidden_attention_named_block_scores_counted_once() -> None:
    """A hidden transformer block whose name contains 'Attention' (open_clip's
    ResidualAttentionBlock) gets its score tensors twice: once as an attention row,
    once as a hidden block with >= 10 width^2 parameters."""
    w = 768

    def scores(typ: str) -> float:
        layers = [Layer("Model", 0, (1000,), depth=0, leaf=False)]
        layers += [Layer(typ, 12 * w * w + 13 * w, (197, w), depth=1) for _ in range(12)]
        return compute(_torchinfo(layers), 32, None, "adam", "fp32").attn_scores

    assert scores("ResidualAttentionBlock") == pytest.approx(scores("ViTLayer"))


# --- torchinfo depth=0 ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ConvNeXt", "PoolFormer"])
def test_depth0_table_is_refused_whatever_the_model_class_is_called(name: str) -> None:
    """The depth=0 refusal only fires when the model row's class name is in category
    'other': torchvision's ConvNeXt (category conv) or a PoolFormer (pool) is
    accepted and sized from its logits (2 MiB of activations at batch 64)."""
    text = (ROB / "ti_resnet18_depth0.txt").read_text().replace("ResNet    ", name.ljust(10), 1)
    assert name in text
    with pytest.raises((SummaryParseError, EstimatorInputError)):
        estimate(text, 64)
