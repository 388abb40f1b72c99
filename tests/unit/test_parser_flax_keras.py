"""Flax ``nn.tabulate`` and Keras ``model.summary()`` parsers on realistic samples."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_colloc.estimators import SummaryParseError, estimate, parse_summary, read_summary_file
from slurm_colloc.estimators.recognition import recognise

CORPUS = Path(__file__).resolve().parents[2] / "slurm_colloc" / "estimators" / "data" / "corpus"

FLAX_BN = """\
                                   ResNetBlock Summary
┏━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━━━━┓
┃ path          ┃ module      ┃ inputs               ┃ outputs              ┃ batch_stats                ┃ params                    ┃
┡━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━━━━┩
│               │ ResNetBlock │ float32[32,56,56,64] │ float32[32,56,56,64] │                            │                           │
├───────────────┼─────────────┼──────────────────────┼──────────────────────┼────────────────────────────┼───────────────────────────┤
│ Conv_0        │ Conv        │ float32[32,56,56,64] │ float32[32,56,56,64] │                            │ kernel: float32[3,3,64,64]│
│               │             │                      │                      │                            │                           │
│               │             │                      │                      │                            │ 36,864 (147.5 KB)         │
├───────────────┼─────────────┼──────────────────────┼──────────────────────┼────────────────────────────┼───────────────────────────┤
│ BatchNorm_0   │ BatchNorm   │ float32[32,56,56,64] │ float32[32,56,56,64] │ mean: float32[64]          │ bias: float32[64]         │
│               │             │                      │                      │ var: float32[64]           │ scale: float32[64]        │
│               │             │                      │                      │                            │                           │
│               │             │                      │                      │ 128 (512 B)                │ 128 (512 B)               │
├───────────────┼─────────────┼──────────────────────┼──────────────────────┼────────────────────────────┼───────────────────────────┤
│ Stage_0       │ Stage       │ float32[32,56,56,64] │ float32[32,56,56,64] │                            │ 73,856 (295.4 KB)         │
├───────────────┼─────────────┼──────────────────────┼──────────────────────┼────────────────────────────┼───────────────────────────┤
│               │             │                      │                Total │ 128 (512 B)                │ 110,848 (443.4 KB)        │
└───────────────┴─────────────┴──────────────────────┴──────────────────────┴────────────────────────────┴───────────────────────────┘

                                       Total Parameters: 110,976 (443.9 KB)
"""


def test_flax_cnn_rows_shapes_and_params() -> None:
    s = read_summary_file(CORPUS / "flax_cnn.tabulate.txt")
    assert s.format == "flax"
    assert s.total_params == 824_458
    assert [la.type for la in s.leaves] == ["Conv", "Conv", "Dense", "Dense"]
    assert s.layers[1].output_shape == (28, 28, 32)  # batch 16 removed
    assert s.layers[3].params == 803_072
    assert s.meta["summary_batch"] == "16"
    assert recognise(s).kind == "cnn"


def test_flax_batch_stats_column_is_not_parameters() -> None:
    s = parse_summary(FLAX_BN)
    assert [la.params for la in s.layers[1:]] == [36_864, 128, 73_856]
    assert s.total_params == 110_976  # the footer counts every collection
    assert s.layers[3].leaf  # a module shown without its children (depth limit)


def test_flax_transformer_is_attention_bearing() -> None:
    s = read_summary_file(CORPUS / "flax_vit_tiny.tabulate.txt")
    assert s.total_params == 914_122 == sum(la.params for la in s.layers)
    rec = recognise(s)
    assert rec.kind == "transformer" and len(rec.cores) == 2
    assert rec.cores[0].type == "MultiHeadDotProductAttention" and rec.cores[0].width == 192
    assert rec.cores[0].tokens == 65
    e = estimate(s, batch_size=64)
    assert e.breakdown["attention"] > 0


def test_flax_without_outputs_column_is_refused() -> None:
    text = FLAX_BN.replace("┃ outputs              ┃", "┃ results              ┃")
    with pytest.raises(SummaryParseError, match="outputs"):
        parse_summary(text)


def test_keras_transformer_samples() -> None:
    k2 = read_summary_file(CORPUS / "keras2_text_transformer.summary.txt")
    assert k2.format == "keras" and k2.total_params == 653_566
    assert [la.type for la in k2.layers][1:3] == ["TokenAndPositionEmbedding",
                                                 "TransformerBlock"]
    assert recognise(k2).attention
    k3 = read_summary_file(CORPUS / "keras3_text_encoder.summary.txt")
    assert k3.format == "keras"
    assert sum(la.params for la in k3.layers) == k3.total_params == 6_766_084
    rec = recognise(k3)
    assert rec.kind == "transformer" and len(rec.cores) == 2
    assert rec.cores[0].tokens == 256
    e = estimate(k3, batch_size=32)
    att = e.uncertainty["attention"]
    assert isinstance(att, dict) and att["seq_len"] == 256
