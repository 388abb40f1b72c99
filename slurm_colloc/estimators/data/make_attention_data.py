"""Generate the transformer measurements and the recognition corpus (needs torch and
transformers; never imported by the estimators).

Run it in a separate environment, never the project's venv::

    python3 -m venv /opt/colloc-est-venv
    /opt/colloc-est-venv/bin/pip install torch==2.13.0 transformers torchinfo
    nice -n 10 /opt/colloc-est-venv/bin/python estimators/data/make_attention_data.py measure
    nice -n 10 /opt/colloc-est-venv/bin/python estimators/data/make_attention_data.py \
        measure --layers 6
    nice -n 10 /opt/colloc-est-venv/bin/python estimators/data/make_attention_data.py \
        measure --layers 12 --seqs 512 bert roberta gpt2 xlnet
    /opt/colloc-est-venv/bin/python estimators/data/make_attention_data.py corpus

``measure`` writes ``estimators/data/attention_measurements.csv`` and, for every model
measured, its ``print(model)`` with parameter counts in
``estimators/data/attention_summaries.jsonl``: one training step (forward, loss,
backward, Adam step; two steps so that Adam's state exists) of Hugging Face models
built from configs (no weights) under ``FakeTensorMode`` with
``torch.distributed._tools.mem_tracker.MemTracker`` on fake CPU tensors: exact tensor
accounting of what autograd keeps, without a GPU. Each family is measured with
``attn_implementation="eager"`` and ``"sdpa"`` where the model supports it, at
sequence lengths 128-4096 and several batch sizes. Models have two layers (the
per-layer terms are what the fit needs) at their real widths, head counts and
vocabularies; six layers at two lengths separate the per-layer terms from the heads,
and twelve (BERT-base, RoBERTa-base, GPT-2 small, XLNet at base width... as built by
``families``) check the extrapolation to full depth.

``sdpa`` on a CPU runs PyTorch's CPU flash kernel only without dropout; with dropout it
falls back to the math path, which keeps ``heads x seq^2`` tensors like eager. CUDA's
flash and memory-efficient kernels apply dropout from a random seed and keep no
``seq^2`` tensor, so the sdpa runs set the attention dropout to 0 (the kernel GPU jobs
use keeps the same O(seq) tensors with or without dropout); the ``attn_dropout``
column says which.

``corpus`` writes real-format summaries of full-size configurations to
``estimators/data/corpus/`` (``print(model)`` plain and with ``, N params`` built on
the meta device; torchinfo tables of the smaller ones at batch 1).
"""

# ruff: noqa: T201

from __future__ import annotations

import contextlib
import csv
import io
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CSV_PATH = HERE / "attention_measurements.csv"
SUMMARIES_PATH = HERE / "attention_summaries.jsonl"
CORPUS = HERE / "corpus"

SEQS = (128, 512, 1024, 2048, 4096)
BATCHES = (1, 4)
SEQS_DEEP = (512, 2048)
"""Sequence lengths of the deeper (``--layers 6``) runs that separate per-layer terms
from the heads (vocabulary logits dominate a 2-layer language model)."""
MIB = 1024 * 1024


def with_params(module: Any, name: str | None = None, indent: int = 0) -> list[str]:
    """``print(model)`` with ``, N params`` after every module."""
    pad = "  " * indent
    head = f"{pad}({name}): " if name is not None else pad
    n = sum(p.numel() for p in module.parameters())
    children = list(module.named_children())
    cls = type(module).__name__
    if not children:
        return [f"{head}{cls}({module.extra_repr()}), {n:,} params"]
    lines = [f"{head}{cls}("]
    for child_name, child in children:
        lines += with_params(child, child_name, indent + 1)
    lines.append(f"{pad}), {n:,} params")
    return lines


def families(layers: int, seq_max: int) -> dict[str, tuple[Any, Any, str]]:
    """family -> (model class, config, input kind). ``layers`` per stack."""
    import transformers as tf

    pos = seq_max + 8
    return {
        "bert": (tf.BertForMaskedLM, tf.BertConfig(num_hidden_layers=layers,
                                                   max_position_embeddings=pos), "tokens"),
        "roberta": (tf.RobertaForSequenceClassification,
                    tf.RobertaConfig(num_hidden_layers=layers, max_position_embeddings=pos,
                                     vocab_size=50265), "tokens-cls"),
        "xlnet": (tf.XLNetForSequenceClassification, tf.XLNetConfig(n_layer=layers),
                  "tokens-cls"),
        "gpt2": (tf.GPT2LMHeadModel, tf.GPT2Config(n_layer=layers, n_positions=pos), "tokens"),
        "gpt_neo": (tf.GPTNeoForCausalLM,
                    tf.GPTNeoConfig(num_layers=layers, hidden_size=768, num_heads=12,
                                    attention_types=[[["global", "local"], max(1, layers // 2)]],
                                    max_position_embeddings=pos), "tokens"),
        "gptj": (tf.GPTJForCausalLM, tf.GPTJConfig(n_layer=layers, n_embd=1024, n_head=16,
                                                   rotary_dim=64, n_positions=pos), "tokens"),
        "t5": (tf.T5ForConditionalGeneration,
               tf.T5Config(num_layers=layers, num_decoder_layers=layers, d_model=512,
                           num_heads=8, d_ff=2048, decoder_start_token_id=0,
                           pad_token_id=0), "seq2seq"),
        "llama": (tf.LlamaForCausalLM,
                  tf.LlamaConfig(hidden_size=1024, intermediate_size=2816,
                                 num_hidden_layers=layers, num_attention_heads=16,
                                 num_key_value_heads=16, vocab_size=32000,
                                 max_position_embeddings=pos), "tokens"),
        "vit": (tf.ViTForImageClassification, tf.ViTConfig(num_hidden_layers=layers), "image"),
        "deit": (tf.DeiTForImageClassification, tf.DeiTConfig(num_hidden_layers=layers),
                 "image"),
        "whisper": (tf.WhisperForConditionalGeneration,
                    tf.WhisperConfig(encoder_layers=layers, decoder_layers=layers, d_model=384,
                                     encoder_attention_heads=6, decoder_attention_heads=6,
                                     encoder_ffn_dim=1536, decoder_ffn_dim=1536,
                                     max_source_positions=1500,
                                     max_target_positions=max(448, pos)), "audio"),
    }


IMAGE_FOR_SEQ = {128: 176, 512: 352, 1024: 512, 2048: 720, 4096: 1024}
"""ViT/DeiT image side giving about ``seq`` tokens at patch 16 (176 -> 121 + 1 tokens,
1024 -> 4096 + 1)."""


def _inputs(kind: str, cfg: Any, batch: int, seq: int, torch: Any) -> tuple[dict[str, Any], int]:
    """Model inputs for one step and the sequence length the model really sees."""
    if kind == "image":
        side = IMAGE_FOR_SEQ[seq]
        cfg_tokens = (side // cfg.patch_size) ** 2 + (2 if "Deit" in type(cfg).__name__ else 1)
        return ({"pixel_values": torch.randn(batch, 3, side, side),
                 "labels": torch.randint(0, 2, (batch,)),
                 "interpolate_pos_encoding": True}, cfg_tokens)
    if kind == "audio":
        # the encoder always sees 1500 frames (3000 mel frames); seq is the decoder's
        dec = min(seq, cfg.max_target_positions)
        return ({"input_features": torch.randn(batch, cfg.num_mel_bins, 3000),
                 "labels": torch.randint(0, cfg.vocab_size, (batch, dec))}, 1500)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    if kind == "tokens-cls":
        return {"input_ids": ids, "labels": torch.randint(0, 2, (batch,))}, seq
    if kind == "seq2seq":
        return {"input_ids": ids, "labels": torch.randint(0, cfg.vocab_size, (batch, seq))}, seq
    return {"input_ids": ids, "labels": ids}, seq


def trace_step(model: Any, inputs: dict[str, Any], torch: Any) -> dict[str, float]:
    """Peak MiB of two training steps (Adam) of ``model`` on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from slurm_colloc.estimators.tracing import fake_state

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    fake_state(model, mode, torch)
    with mode:
        fin = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
               for k, v in inputs.items()}
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        mt = MemTracker()
        mt.track_external(model, opt)
        with mt:
            for step in range(2):
                out = model(**fin)
                out.loss.backward()
                opt.step()
                opt.zero_grad()
                if step == 0:
                    mt.reset_mod_stats()
        peak = mt.get_tracker_snapshot("peak")
    best: dict[str, float] = {}
    for cats in peak.values():
        total = cats.get("Total", sum(v for k, v in cats.items() if k != "Total"))
        if total > best.get("Total", -1):
            best = {str(k): v / MIB for k, v in cats.items()}
            best["Total"] = total / MIB
    return best


def summary_key(family: str, impl: str, layers: int) -> str:
    """Key of a measured model's summary in ``attention_summaries.jsonl``."""
    return f"{family}-{impl}-L{layers}"


def measure(layers: int, seqs: tuple[int, ...], only: set[str] | None = None) -> None:
    """Add measurements of ``layers``-layer models to the CSV (rows of other layer
    counts, and of other families when ``only`` names some, are kept)."""
    import torch

    torch.manual_seed(0)
    fams = families(layers, max(SEQS))
    rows: list[dict[str, Any]] = []
    summaries: dict[str, str] = {}

    def replaced(fam: str, n_layers: int) -> bool:
        return n_layers == layers and (not only or fam in only)

    if CSV_PATH.exists():
        with CSV_PATH.open() as f:
            rows = [r for r in csv.DictReader(f)
                    if not replaced(r["family"], int(r["layers"]))]
    if SUMMARIES_PATH.exists():
        for line in SUMMARIES_PATH.read_text().splitlines():
            rec = json.loads(line)
            if not replaced(rec["family"], int(rec.get("layers", 2))):
                summaries[rec["key"]] = line
    for fam, (cls, cfg, kind) in fams.items():
        if only and fam not in only:
            continue
        for impl in ("eager", "sdpa"):
            c = type(cfg).from_dict(cfg.to_dict())
            dropout_off = impl == "sdpa"
            if dropout_off:
                for attr in ("attention_probs_dropout_prob", "attn_pdrop", "attention_dropout",
                             "dropout_rate"):
                    if hasattr(c, attr) and attr != "dropout_rate":
                        setattr(c, attr, 0.0)
            try:
                model = cls._from_config(c, attn_implementation=impl)
            except (ValueError, ImportError) as e:
                print(f"{fam} {impl}: not supported ({str(e)[:80]})", file=sys.stderr)
                continue
            model.train()
            key = summary_key(fam, impl, layers)
            summaries[key] = json.dumps({"key": key, "family": fam, "impl": impl,
                                         "layers": layers, "class": cls.__name__,
                                         "summary": "\n".join(with_params(model)) + "\n"})
            state = {k: v.clone() for k, v in model.state_dict().items()}
            for seq in seqs:
                for batch in BATCHES:
                    model = cls._from_config(c, attn_implementation=impl)
                    model.load_state_dict(state)
                    model.train()
                    for p in model.parameters():
                        # frozen tables (Whisper's positions) would make MemTracker hook
                        # a tensor without grad; training them costs a few MiB
                        p.requires_grad_(True)
                    inputs, real_seq = _inputs(kind, c, batch, seq, torch)
                    t0 = time.time()
                    try:
                        peak = trace_step(model, inputs, torch)
                    except Exception as e:  # noqa: BLE001 - record and go on
                        print(f"{key} b{batch} s{seq}: {type(e).__name__}: {str(e)[:120]}",
                              file=sys.stderr)
                        continue
                    took = time.time() - t0
                    params = sum(p.numel() for p in model.parameters())
                    row = {"family": fam, "model_class": cls.__name__, "impl": impl,
                           "attn_dropout": 0 if dropout_off else 1, "batch": batch,
                           "seq": real_seq, "dec_seq": seq if kind in ("seq2seq", "audio")
                           else 0, "layers": layers, "params": params,
                           "traced_peak_mib": round(peak["Total"], 2),
                           "trace_s": round(took, 1)}
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    _write(rows, summaries)
    _write(rows, summaries)


def _write(rows: list[dict[str, Any]], summaries: dict[str, str]) -> None:
    cols = ["family", "model_class", "impl", "attn_dropout", "batch", "seq", "dec_seq",
            "layers", "params", "traced_peak_mib", "trace_s"]
    with CSV_PATH.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow({k: r[k] for k in cols})
    SUMMARIES_PATH.write_text("".join(line + "\n" for line in summaries.values()))


CORPUS_MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # name -> (class, config class, config overrides): full-size public configurations
    "bert_base_mlm": ("BertForMaskedLM", "BertConfig", {}),
    "bert_large_cls": ("BertForSequenceClassification", "BertConfig",
                       {"hidden_size": 1024, "num_hidden_layers": 24,
                        "num_attention_heads": 16, "intermediate_size": 4096}),
    "roberta_base_cls": ("RobertaForSequenceClassification", "RobertaConfig",
                         {"vocab_size": 50265, "max_position_embeddings": 514}),
    "xlnet_base_cls": ("XLNetForSequenceClassification", "XLNetConfig", {}),
    "gpt2_lm": ("GPT2LMHeadModel", "GPT2Config", {}),
    "gpt2_medium_lm": ("GPT2LMHeadModel", "GPT2Config",
                       {"n_embd": 1024, "n_layer": 24, "n_head": 16}),
    "gpt_neo_125m": ("GPTNeoForCausalLM", "GPTNeoConfig",
                     {"hidden_size": 768, "num_layers": 12, "num_heads": 12,
                      "attention_types": [[["global", "local"], 6]]}),
    "gptj_6b": ("GPTJForCausalLM", "GPTJConfig", {}),
    "t5_small": ("T5ForConditionalGeneration", "T5Config", {}),
    "t5_base": ("T5ForConditionalGeneration", "T5Config",
                {"d_model": 768, "d_ff": 3072, "num_layers": 12, "num_heads": 12}),
    "llama_7b": ("LlamaForCausalLM", "LlamaConfig",
                 {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "vocab_size": 32000}),
    "tinyllama_1b": ("LlamaForCausalLM", "LlamaConfig",
                     {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
                      "num_attention_heads": 32, "num_key_value_heads": 4,
                      "vocab_size": 32000}),
    "mistral_7b": ("MistralForCausalLM", "MistralConfig", {}),
    "vit_base": ("ViTForImageClassification", "ViTConfig", {}),
    "deit_small": ("DeiTForImageClassification", "DeiTConfig",
                   {"hidden_size": 384, "num_attention_heads": 6, "intermediate_size": 1536}),
    "swin_tiny": ("SwinForImageClassification", "SwinConfig", {}),
    "whisper_tiny": ("WhisperForConditionalGeneration", "WhisperConfig",
                     {"d_model": 384, "encoder_layers": 4, "decoder_layers": 4,
                      "encoder_attention_heads": 6, "decoder_attention_heads": 6,
                      "encoder_ffn_dim": 1536, "decoder_ffn_dim": 1536}),
    "whisper_small": ("WhisperForConditionalGeneration", "WhisperConfig",
                      {"d_model": 768, "encoder_layers": 12, "decoder_layers": 12,
                       "encoder_attention_heads": 12, "decoder_attention_heads": 12,
                       "encoder_ffn_dim": 3072, "decoder_ffn_dim": 3072}),
}
TORCHINFO_INPUTS = {
    "bert_base_mlm": "tokens", "gpt2_lm": "tokens", "vit_base": "image", "t5_small": "seq2seq",
    "roberta_base_cls": "tokens", "deit_small": "image",
}


def corpus() -> None:
    """Write the recognition corpus (see the module docstring)."""
    import torch
    import transformers as tf

    CORPUS.mkdir(parents=True, exist_ok=True)
    for name, (cls_name, cfg_name, over) in CORPUS_MODELS.items():
        cfg = getattr(tf, cfg_name)(**over)
        cls = getattr(tf, cls_name)
        with torch.device("meta"):
            model = cls._from_config(cfg)
        (CORPUS / f"{name}.print.txt").write_text(str(model) + "\n")
        (CORPUS / f"{name}.print_params.txt").write_text("\n".join(with_params(model)) + "\n")
        print(f"wrote {name} print(model)", file=sys.stderr)
        if name in TORCHINFO_INPUTS:
            import torchinfo

            model = cls._from_config(cfg)
            model.eval()
            kind = TORCHINFO_INPUTS[name]
            if kind == "image":
                data: Any = {"pixel_values": torch.randn(1, 3, 224, 224)}
            elif kind == "seq2seq":
                data = {"input_ids": torch.randint(0, 100, (1, 128)),
                        "decoder_input_ids": torch.randint(0, 100, (1, 128))}
            else:
                data = {"input_ids": torch.randint(0, 100, (1, 128))}
            for depth in (3, 10):
                buf = io.StringIO()
                with contextlib.redirect_stdout(buf):
                    s = torchinfo.summary(model, input_data=data, depth=depth, verbose=0,
                                          device="cpu")
                (CORPUS / f"{name}.torchinfo_d{depth}.txt").write_text(str(s) + "\n")
            print(f"wrote {name} torchinfo", file=sys.stderr)


def main() -> int:
    what = sys.argv[1] if len(sys.argv) > 1 else "measure"
    if what == "measure":
        args = sys.argv[2:]
        layers = 2
        seqs: tuple[int, ...] = SEQS
        if args[:1] == ["--layers"]:
            layers, args = int(args[1]), args[2:]
            seqs = SEQS_DEEP
        if args[:1] == ["--seqs"]:
            seqs, args = tuple(int(x) for x in args[1].split(",")), args[2:]
        measure(layers, seqs, set(args) or None)
    elif what == "corpus":
        corpus()
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
