"""Architecture recognition on the corpus of real-format summaries
(``slurm_colloc/estimators/data/corpus``: print(model), torchinfo, Keras and Flax tables of Hugging
Face and research models, made by ``slurm_colloc/estimators/data/make_attention_data.py corpus``
from the models' configurations, or written in the tools' formats)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_colloc.estimators import estimate, parse_summary, read_summary_file
from slurm_colloc.estimators.layers import category
from slurm_colloc.estimators.recognition import recognise

CORPUS = Path(__file__).resolve().parents[2] / "slurm_colloc" / "estimators" / "data" / "corpus"
FILES = sorted(p for p in CORPUS.iterdir() if p.suffix == ".txt")
NOT_TRANSFORMERS = ("flax_cnn", "resnet", "keras3_resnet", "vgg")
TRANSFORMERS = [p for p in FILES if not p.name.startswith(NOT_TRANSFORMERS)]

# file stem prefix -> (family, self-attention layers, cross-attention layers)
EXPECTED = {
    "bert_base_mlm": ("bert", 12, 0),
    "bert_large_cls": ("bert", 24, 0),
    "roberta_base_cls": ("roberta", 12, 0),
    "xlnet_base_cls": ("xlnet", 24, 0),
    "gpt2_lm": ("gpt2", 12, 0),
    "gpt2_medium_lm": ("gpt2", 24, 0),
    "gpt_neo_125m": ("gpt_neo", 12, 0),
    "gptj_6b": ("gptj", 28, 0),
    "t5_small": ("t5", 12, 6),
    "t5_base": ("t5", 24, 12),
    "llama_7b": ("llama", 32, 0),
    "tinyllama_1b": ("llama", 22, 0),
    "mistral_7b": ("llama", 32, 0),
    "vit_base": ("vit", 12, 0),
    "deit_small": ("deit", 12, 0),
    "swin_tiny": ("swin", 12, 0),
    "whisper_tiny": ("whisper", 8, 4),
    "whisper_small": ("whisper", 24, 12),
}


def test_corpus_is_there() -> None:
    formats = {read_summary_file(p).format for p in FILES}
    assert {"pytorch-print", "torchinfo", "keras", "flax"} <= formats
    assert len(TRANSFORMERS) >= 40


@pytest.mark.parametrize("path", TRANSFORMERS, ids=lambda p: p.name)
def test_every_corpus_transformer_is_attention_bearing(path: Path) -> None:
    s = read_summary_file(path)
    rec = recognise(s)
    assert rec.attention, rec.evidence
    assert rec.kind == "transformer"
    assert rec.recognised
    stem = path.name.split(".")[0]
    if stem in EXPECTED:
        family, self_layers, cross_layers = EXPECTED[stem]
        assert rec.family == family
        assert sum(not c.cross for c in rec.cores) == self_layers
        assert sum(c.cross for c in rec.cores) == cross_layers
    e = estimate(s, batch_size=4, seq_len=512)
    arch = e.uncertainty["architecture"]
    assert isinstance(arch, dict) and arch["kind"] == "transformer"
    assert e.uncertainty["bucket"] in ("transformer", "attn_hidden", "attn_explicit")


def test_gpt2_is_not_a_cnn() -> None:
    """HF ``Conv1D`` (nf, nx) is GPT-2's transposed linear, not a convolution."""
    assert category("Conv1D") == "linear"
    assert category("Conv1d") == "conv"
    s = read_summary_file(CORPUS / "gpt2_lm.print.txt")
    e = estimate(s, batch_size=4, seq_len=512)
    assert e.uncertainty["bucket"] == "transformer"
    assert not any(category(la.type) == "conv" for la in s.leaves)


def test_attention_containers_are_seen_in_print_model() -> None:
    """print(model)'s containers (BertSelfAttention, XLNetRelativeAttention holding its
    parameters directly) are kept for recognition, outside the leaf layers."""
    s = read_summary_file(CORPUS / "bert_base_mlm.print_params.txt")
    types = {c.type for c in s.containers}
    assert "BertSelfAttention" in types and "BertSelfAttention" not in {la.type for la in
                                                                        s.layers}
    x = recognise(read_summary_file(CORPUS / "xlnet_base_cls.print.txt"))
    assert x.cores[0].type == "XLNetRelativeAttention" and x.cores[0].relative
    assert x.cores[0].width == 1024


def test_cnn_and_flax_cnn_are_not_transformers() -> None:
    rec = recognise(read_summary_file(CORPUS / "flax_cnn.tabulate.txt"))
    assert rec.kind == "cnn" and not rec.attention


def test_bert_eager_dominates_sdpa_and_grows_with_seq_squared() -> None:
    s = read_summary_file(CORPUS / "bert_base_mlm.print_params.txt")
    eager = [estimate(s, batch_size=8, seq_len=n, attention="eager") for n in (512, 1024)]
    sdpa = [estimate(s, batch_size=8, seq_len=n, attention="sdpa") for n in (512, 1024)]
    a_e = [e.breakdown["attention"] for e in eager]
    a_s = [e.breakdown["attention"] for e in sdpa]
    assert a_e[0] > 5 * a_s[0]
    assert a_e[1] == pytest.approx(4 * a_e[0], rel=0.05)  # seq^2
    assert a_s[1] == pytest.approx(2 * a_s[0], rel=0.05)  # O(seq)
    default = estimate(s, batch_size=8, seq_len=512)
    att = default.uncertainty["attention"]
    assert isinstance(att, dict)
    assert att["implementation"] == "eager" and att["implementation_source"] == "default"
    assert default.estimate_mib == eager[0].estimate_mib


def test_implementation_shown_by_class_name() -> None:
    text = (CORPUS / "bert_base_mlm.print.txt").read_text().replace(
        "BertSelfAttention(", "BertSdpaSelfAttention(")
    rec = recognise(parse_summary(text))
    assert rec.impl_shown == "sdpa"
    att = estimate(text, batch_size=8, seq_len=512).uncertainty["attention"]
    assert isinstance(att, dict) and att["implementation_source"] == "summary"


def test_unknown_model_gets_the_most_conservative_margin() -> None:
    text = ("Net(\n  (a): Frobnicator(in=512, out=512), 4,000,000 params\n"
            "  (b): Frobnicator(in=512, out=512), 4,000,000 params\n"
            "  (fc): Linear(in_features=512, out_features=10, bias=True)\n)\n")
    e = estimate(text, batch_size=32, seq_len=128)
    assert e.uncertainty["bucket"] == "unknown"
    arch = e.uncertainty["architecture"]
    assert isinstance(arch, dict) and arch["recognised"] is False
    assert any("not recognised" in n for n in e.notes)
    from slurm_colloc.estimators.layer_aware import load_calibration
    cal = load_calibration()
    rel, _ = cal.conservative_margin()
    assert rel >= max(cal.margin_rel_by_bucket.values())


def test_recognition_is_fast_on_a_big_model() -> None:
    import time

    s = read_summary_file(CORPUS / "llama_7b.print_params.txt")
    t0 = time.perf_counter()
    for _ in range(5):
        recognise(s)
    assert (time.perf_counter() - t0) / 5 < 0.5


def test_cnns_in_the_corpus() -> None:
    for name in ("flax_cnn.tabulate.txt", "flax_cnn_rich.tabulate.txt",
                 "keras3_resnet50.summary.txt", "resnet50.torchinfo_d10.txt"):
        s = read_summary_file(CORPUS / name)
        rec = recognise(s)
        assert rec.kind == "cnn" and not rec.attention, name
        assert estimate(s, batch_size=32).uncertainty["bucket"] == "cnn", name


def test_rich_styled_flax_table_parses() -> None:
    """Flax's nn.tabulate prints through rich with a forced terminal: a redirected
    table carries ANSI codes, which are stripped."""
    s = read_summary_file(CORPUS / "flax_cnn_rich.tabulate.txt")
    assert "\x1b" in (CORPUS / "flax_cnn_rich.tabulate.txt").read_text()
    assert s.format == "flax" and s.total_params == 824_458
    assert s.meta["summary_batch"] == "128"


def test_keras_table_cut_by_the_console_is_refused_clearly() -> None:
    from slurm_colloc.estimators import SummaryParseError

    text = "\n".join(ln[:80] for ln in
                     (CORPUS / "keras3_resnet50.summary.txt").read_text().splitlines())
    with pytest.raises(SummaryParseError, match="COLUMNS"):
        parse_summary(text)
