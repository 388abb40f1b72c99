"""Generate the parser robustness corpus: real summaries in formats and settings users paste.

Why this exists: the parsers were written against a handful of default-settings
summaries (``make_timm_summaries.py --samples``). Users paste torchinfo tables made
with other ``col_names``, ``depth``, ``row_settings`` and ``verbose`` values, frozen
backbones, Hugging Face models summarised with several inputs, torchsummary tables of
other CNNs, and ``print(model)`` of many model families. This script makes one file
per such setting, with the true parameter counts next to it, so that
``tests/unit/test_summary_robustness.py`` (no torch needed) can check every parser on
every file.

Run it with the separate torch venv (CPU only, no network: every model is built from
an explicit config or with ``pretrained=False``/``weights=None``)::

    /work/timmvenv/bin/python benchmarks/make_robustness_summaries.py

(that venv has torch, torchvision, timm, torchinfo 1.8, torchsummary 1.5.1 and
transformers; see ``make_timm_summaries.py`` for how it was made). ``--only SUBSTR``
regenerates the matching files only; the manifest is rewritten with every entry.

Output, in ``tests/unit/data/summaries/robustness/``: one ``.txt`` per summary (files
over ~60 KB are skipped and reported) and ``MANIFEST.json`` mapping file name to::

    {"source": how it was made,
     "format": the parser that must detect it,
     "kind": "cnn" | "transformer" | "rnn" | "mlp",
     "total_params": true count (model.parameters(), a tied weight once),
     "trainable_params": true count of requires_grad parameters,
     "shows_totals": whether the text itself states the totals,
     "shown_total_params" / "shown_trainable_params": what the tool printed, when it
         differs from the truth (torchinfo counts a tied weight once per module that
         holds it, so tied-embedding LMs show more than model.parameters()),
     "tied_extra_params" / "container_params": for print(model) only, what the text
         over-shows (a tied weight listed again at each module holding it) and
         under-shows (parameters owned by a module that has children, like ViT's
         cls_token; see _print_extras)}
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "tests" / "unit" / "data" / "summaries" / "robustness"
MAX_BYTES = 60_000

Case = Callable[[], tuple[str, Any, dict[str, Any]]]
"""A case returns (summary text, the model, extra manifest fields)."""
CASES: dict[str, tuple[str, str, str, Case]] = {}
"""file name -> (format, kind, source description, case)."""


def case(fname: str, fmt: str, kind: str, source: str) -> Callable[[Case], Case]:
    def deco(fn: Case) -> Case:
        CASES[fname] = (fmt, kind, source, fn)
        return fn
    return deco


# ----------------------------------------------------------------------------- helpers

def _counts(model: Any) -> tuple[int, int]:
    params = list(model.parameters())  # deduplicated: a tied weight once
    return (sum(p.numel() for p in params),
            sum(p.numel() for p in params if p.requires_grad))


def _print_extras(model: Any) -> dict[str, int]:
    """What print(model) cannot show exactly, as parameter counts.

    ``tied_extra_params``: print lists a shared weight at every module that holds it
    (GPT-2's lm_head is its wte; T5 shares one embedding three more times), so a
    reader of the text counts it again each time. ``container_params``: parameters a
    module with children owns itself (ViT's cls_token and pos_embed, CLIP's
    logit_scale, ConvNeXt's layer-scale gamma, MultiheadAttention's in_proj_weight):
    print shows none of them (a parser may still derive some from the arguments)."""
    occurrences = 0  # leaf parameters as print lists them: a shared one at each place
    for _, mod in model.named_modules(remove_duplicate=False):
        if not list(mod.children()):
            occurrences += sum(p.numel() for p in mod.parameters(recurse=False))
    leaf: dict[int, int] = {}
    container: dict[int, int] = {}
    for _, mod in model.named_modules():
        into = container if list(mod.children()) else leaf
        into.update((id(p), p.numel()) for p in mod.parameters(recurse=False))
    return {"tied_extra_params": occurrences - sum(leaf.values()),
            "container_params": sum(container.values())}


def _torchinfo(model: Any, **kw: Any) -> tuple[str, dict[str, Any]]:
    import torchinfo

    kw.setdefault("verbose", 0)
    stats = torchinfo.summary(model, device="cpu", **kw)
    return str(stats), {"shown_total_params": int(stats.total_params),
                        "shown_trainable_params": int(stats.trainable_params)}


def _torchsummary(model: Any, input_size: Any, **kw: Any) -> str:
    from torchsummary import summary

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        summary(model, input_size, device="cpu", **kw)
    return buf.getvalue()


def _with_params(module: Any, name: str | None = None, indent: int = 0) -> list[str]:
    """``print(model)`` with ``, N params`` after every module line (the annotated
    variant some tools print; same style as ``make_timm_summaries.py``). Laid out as
    ``Module.__repr__`` does: a module's extra_repr on its own line(s) above its
    children, or when it spans several lines; children as ``_modules`` lists them."""
    pad = "  " * indent
    head = f"{pad}({name}): " if name is not None else pad
    n = sum(p.numel() for p in module.parameters())
    extra = module.extra_repr()
    extra_lines = extra.split("\n") if extra else []
    children = [(k, v) for k, v in module._modules.items() if v is not None]
    cls = type(module).__name__
    if not children and len(extra_lines) <= 1:
        return [f"{head}{cls}({extra}), {n:,} params"]
    lines = [f"{head}{cls}("] + [f"{pad}  {ln}" for ln in extra_lines]
    for child_name, child in children:
        lines += _with_params(child, child_name, indent + 1)
    lines.append(f"{pad}), {n:,} params")
    return lines


def _tokens(batch: int, seq: int, vocab: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def _freeze(*modules: Any) -> None:
    for m in modules:
        for p in m.parameters():
            p.requires_grad = False


# ----------------------------------------------------------------------------- models

def _gpt2(**kw: Any) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = dict(n_layer=2, n_embd=128, n_head=4, vocab_size=5000, n_positions=256,
               bos_token_id=0, eos_token_id=0)
    cfg.update(kw)
    return GPT2LMHeadModel(GPT2Config(**cfg)).eval()


def _bert(**kw: Any) -> Any:
    from transformers import BertConfig, BertModel

    cfg = dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
               intermediate_size=512, vocab_size=5000)
    cfg.update(kw)
    return BertModel(BertConfig(**cfg)).eval()


def _t5() -> Any:
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(
        vocab_size=5000, d_model=128, d_kv=32, d_ff=256, num_layers=2, num_heads=4,
        decoder_start_token_id=0)).eval()


def _llama(**kw: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(vocab_size=5000, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               bos_token_id=0, eos_token_id=0)
    cfg.update(kw)
    return LlamaForCausalLM(LlamaConfig(**cfg)).eval()


def _vit_hf() -> Any:
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(
        hidden_size=192, num_hidden_layers=2, num_attention_heads=3, intermediate_size=768,
        image_size=64, patch_size=16, num_labels=10)).eval()


def _clip() -> Any:
    from transformers import CLIPConfig, CLIPModel

    return CLIPModel(CLIPConfig(
        text_config=dict(vocab_size=5000, hidden_size=128, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4,
                         max_position_embeddings=77),
        vision_config=dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                           num_attention_heads=4, image_size=64, patch_size=16),
        projection_dim=64)).eval()


class _LstmLM:
    """Embedding -> 2-layer LSTM (sequence first, PyTorch's default) -> Linear."""

    @staticmethod
    def build() -> Any:
        import torch
        from torch import nn

        class LstmLM(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed = nn.Embedding(2000, 64)
                self.lstm = nn.LSTM(64, 128, num_layers=2)
                self.drop = nn.Dropout(0.1)
                self.head = nn.Linear(128, 2000)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                out, _ = self.lstm(self.embed(x))
                return self.head(self.drop(out))

        return LstmLM().eval()


def _shared_mlp() -> Any:
    """An MLP that applies the same block three times (torchinfo's "(recursive)")."""
    import torch
    from torch import nn

    class SharedMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(32, 256)
            self.block = nn.Sequential(nn.Linear(256, 256), nn.ReLU())
            self.out = nn.Linear(256, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.inp(x)
            for _ in range(3):
                x = self.block(x)
            return self.out(x)

    return SharedMLP().eval()


def _two_input_cnn() -> Any:
    """Image + mask branches (torchsummary needs inputs of the same rank: it takes
    ``np.prod`` of the list of input sizes)."""
    import torch
    from torch import nn

    class TwoInput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.img = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16),
                                     nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
            self.mask = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
            self.head = nn.Linear(24, 5)

        def forward(self, img: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.head(torch.cat([self.img(img), self.mask(mask)], dim=1))

    return TwoInput().eval()


def _misc_layers() -> Any:
    """Less common layers in one token model: EmbeddingBag, bidirectional GRU, Conv1d,
    GroupNorm, InstanceNorm (no affine), PReLU, ModuleDict, ParameterList, Bilinear."""
    import torch
    from torch import nn

    class MiscLayers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(1000, 32, padding_idx=0)
            self.bag = nn.EmbeddingBag(1000, 32, mode="mean")
            self.gru = nn.GRU(32, 64, batch_first=True, bidirectional=True)
            self.conv1d = nn.Conv1d(128, 64, 5, padding=2)
            self.gn = nn.GroupNorm(8, 64)
            self.inorm = nn.InstanceNorm1d(64)
            self.prelu = nn.PReLU(64)
            self.heads = nn.ModuleDict({"a": nn.Linear(64, 10),
                                        "b": nn.Sequential(nn.Linear(64, 32), nn.GELU())})
            self.scales = nn.ParameterList([nn.Parameter(torch.ones(10)),
                                            nn.Parameter(torch.ones(32))])
            self.bil = nn.Bilinear(10, 32, 7)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h, _ = self.gru(self.emb(x))
            c = self.prelu(self.inorm(self.gn(self.conv1d(h.transpose(1, 2)))))
            p = c.mean(-1)
            a = self.heads["a"](p) * self.scales[0]
            b = self.heads["b"](p) * self.scales[1] + self.bag(x)
            return self.bil(a, b)

    return MiscLayers().eval()


def _tv(name: str) -> Any:
    import torchvision

    return getattr(torchvision.models, name)(weights=None).eval()


def _timm(name: str, **kw: Any) -> Any:
    import timm

    return timm.create_model(name, pretrained=False, **kw).eval()


# ----------------------------------------------------------------------------- torchinfo

ALL_COLS = ("input_size", "output_size", "num_params", "kernel_size", "mult_adds")


@case("ti_resnet18_allcols.txt", "torchinfo", "cnn",
      "torchvision resnet18, torchinfo col_names=(input_size, output_size, num_params, "
      "kernel_size, mult_adds), batch 4")
def _c1() -> tuple[str, Any, dict[str, Any]]:
    m = _tv("resnet18")
    text, extra = _torchinfo(m, input_size=(4, 3, 224, 224), col_names=ALL_COLS)
    return text, m, extra


@case("ti_resnet18_frozen_trainable.txt", "torchinfo", "cnn",
      "torchvision resnet18 with conv1/bn1/layer1 frozen, torchinfo col_names=(output_size, "
      "num_params, trainable)")
def _c2() -> tuple[str, Any, dict[str, Any]]:
    m = _tv("resnet18")
    _freeze(m.conv1, m.bn1, m.layer1)
    text, extra = _torchinfo(m, input_size=(8, 3, 224, 224),
                             col_names=("output_size", "num_params", "trainable"))
    return text, m, extra


@case("ti_resnet50_frozen_backbone.txt", "torchinfo", "cnn",
      "timm resnet50, everything but fc frozen (linear probe), torchinfo defaults")
def _c3() -> tuple[str, Any, dict[str, Any]]:
    m = _timm("resnet50")
    _freeze(m)
    for p in m.fc.parameters():
        p.requires_grad = True
    text, extra = _torchinfo(m, input_size=(16, 3, 224, 224))
    return text, m, extra


@case("ti_mobilenetv3_depth1.txt", "torchinfo", "cnn",
      "torchvision mobilenet_v3_small, torchinfo depth=1")
def _c4() -> tuple[str, Any, dict[str, Any]]:
    m = _tv("mobilenet_v3_small")
    text, extra = _torchinfo(m, input_size=(32, 3, 224, 224), depth=1)
    return text, m, extra


@case("ti_efficientnet_b0_depth3.txt", "torchinfo", "cnn",
      "timm efficientnet_b0, torchinfo defaults (depth=3)")
def _c5() -> tuple[str, Any, dict[str, Any]]:
    m = _timm("efficientnet_b0")
    text, extra = _torchinfo(m, input_size=(8, 3, 224, 224))
    return text, m, extra


@case("ti_convnext_atto_depth10.txt", "torchinfo", "cnn",
      "timm convnext_atto, torchinfo depth=10")
def _c6() -> tuple[str, Any, dict[str, Any]]:
    m = _timm("convnext_atto")
    text, extra = _torchinfo(m, input_size=(2, 3, 224, 224), depth=10)
    return text, m, extra


@case("ti_vit_tiny_depth10.txt", "torchinfo", "transformer",
      "timm vit_tiny_patch16_224, torchinfo depth=10")
def _c7() -> tuple[str, Any, dict[str, Any]]:
    m = _timm("vit_tiny_patch16_224")
    text, extra = _torchinfo(m, input_size=(2, 3, 224, 224), depth=10)
    return text, m, extra


@case("ti_resnet18_varnames.txt", "torchinfo", "cnn",
      "torchvision resnet18, torchinfo row_settings=('var_names',) (no depth-idx tags)")
def _c8() -> tuple[str, Any, dict[str, Any]]:
    m = _tv("resnet18")
    text, extra = _torchinfo(m, input_size=(4, 3, 224, 224), row_settings=("var_names",))
    return text, m, extra


@case("ti_mobilenetv2_depth_varnames.txt", "torchinfo", "cnn",
      "torchvision mobilenet_v2, torchinfo row_settings=('depth', 'var_names')")
def _c9() -> tuple[str, Any, dict[str, Any]]:
    m = _tv("mobilenet_v2")
    text, extra = _torchinfo(m, input_size=(4, 3, 224, 224), row_settings=("depth", "var_names"))
    return text, m, extra


@case("ti_resnet18_ascii.txt", "torchinfo", "cnn",
      "torchvision resnet18, torchinfo row_settings=('ascii_only', 'depth')")
def _c10() -> tuple[str, Any, dict[str, Any]]:
    m = _tv("resnet18")
    text, extra = _torchinfo(m, input_size=(4, 3, 224, 224), row_settings=("ascii_only", "depth"))
    return text, m, extra


@case("ti_resnet18_verbose2.txt", "torchinfo", "cnn",
      "torchvision resnet18 with layer1 frozen, torchinfo verbose=2 (one row per weight "
      "tensor), col_names=(output_size, num_params, kernel_size), depth=2")
def _c11() -> tuple[str, Any, dict[str, Any]]:
    m = _tv("resnet18")
    _freeze(m.layer1)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):  # verbose=2 also prints; str() is the same table
        text, extra = _torchinfo(m, input_size=(4, 3, 224, 224), verbose=2, depth=2,
                                 col_names=("output_size", "num_params", "kernel_size"))
    return text, m, extra


@case("ti_lstm_verbose2_ascii.txt", "torchinfo", "rnn",
      "Embedding+LSTM+Linear LM (sequence-first), torchinfo verbose=2, "
      "row_settings=('ascii_only', 'depth', 'var_names'), dtypes=[torch.long]")
def _c12() -> tuple[str, Any, dict[str, Any]]:
    import torch

    m = _LstmLM.build()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        text, extra = _torchinfo(m, input_size=(35, 4), dtypes=[torch.long], verbose=2,
                                 row_settings=("ascii_only", "depth", "var_names"))
    return text, m, extra


@case("ti_lstm_seqfirst.txt", "torchinfo", "rnn",
      "Embedding+LSTM+Linear LM (sequence-first input [35, 4]), torchinfo defaults, "
      "dtypes=[torch.long]")
def _c13() -> tuple[str, Any, dict[str, Any]]:
    import torch

    m = _LstmLM.build()
    text, extra = _torchinfo(m, input_size=(35, 4), dtypes=[torch.long])
    return text, m, extra


@case("ti_shared_mlp_recursive.txt", "torchinfo", "mlp",
      "MLP reusing one block three times (torchinfo '(recursive)' rows), all columns plus "
      "params_percent and trainable")
def _c14() -> tuple[str, Any, dict[str, Any]]:
    m = _shared_mlp()
    text, extra = _torchinfo(m, input_size=(64, 32),
                             col_names=(*ALL_COLS, "params_percent", "trainable"))
    return text, m, extra


@case("ti_gpt2_input_data.txt", "torchinfo", "transformer",
      "HF GPT2LMHeadModel (2 layers, tied lm_head), torchinfo input_data={input_ids, "
      "attention_mask}, depth=4")
def _c15() -> tuple[str, Any, dict[str, Any]]:
    import torch

    m = _gpt2()
    ids = _tokens(2, 64, 5000)
    text, extra = _torchinfo(m, input_data={"input_ids": ids,
                                            "attention_mask": torch.ones_like(ids)}, depth=4)
    return text, m, extra


@case("ti_gpt2_dtypes_long_depth10.txt", "torchinfo", "transformer",
      "HF GPT2LMHeadModel (2 layers), torchinfo input_size=(4, 128), dtypes=[torch.long], "
      "depth=10")
def _c16() -> tuple[str, Any, dict[str, Any]]:
    import torch

    m = _gpt2()
    text, extra = _torchinfo(m, input_size=(4, 128), dtypes=[torch.long], depth=10)
    return text, m, extra


@case("ti_bert_input_data_allcols.txt", "torchinfo", "transformer",
      "HF BertModel (2 layers), torchinfo input_data={input_ids, attention_mask, "
      "token_type_ids}, all columns, depth=4")
def _c17() -> tuple[str, Any, dict[str, Any]]:
    import torch

    m = _bert()
    ids = _tokens(2, 32, 5000)
    text, extra = _torchinfo(m, input_data={"input_ids": ids,
                                            "attention_mask": torch.ones_like(ids),
                                            "token_type_ids": torch.zeros_like(ids)},
                             col_names=ALL_COLS, depth=4)
    return text, m, extra


@case("ti_bert_frozen_embeddings.txt", "torchinfo", "transformer",
      "HF BertModel (2 layers) with frozen embeddings, torchinfo input_size=(8, 64), "
      "dtypes=[torch.long], col_names=(output_size, num_params, trainable)")
def _c18() -> tuple[str, Any, dict[str, Any]]:
    import torch

    m = _bert()
    _freeze(m.embeddings)
    text, extra = _torchinfo(m, input_size=(8, 64), dtypes=[torch.long],
                             col_names=("output_size", "num_params", "trainable"))
    return text, m, extra


@case("ti_t5_input_data.txt", "torchinfo", "transformer",
      "HF T5ForConditionalGeneration (2+2 layers), torchinfo input_data={input_ids, "
      "attention_mask, decoder_input_ids}, depth=3")
def _c19() -> tuple[str, Any, dict[str, Any]]:
    import torch

    m = _t5()
    ids = _tokens(2, 32, 5000)
    text, extra = _torchinfo(m, input_data={"input_ids": ids,
                                            "attention_mask": torch.ones_like(ids),
                                            "decoder_input_ids": _tokens(2, 16, 5000)})
    return text, m, extra


@case("ti_llama_varnames_depth10.txt", "torchinfo", "transformer",
      "HF LlamaForCausalLM (2 layers, GQA), torchinfo input_size=(2, 128), "
      "dtypes=[torch.long], depth=10, row_settings=('depth', 'var_names')")
def _c20() -> tuple[str, Any, dict[str, Any]]:
    import torch

    m = _llama()
    text, extra = _torchinfo(m, input_size=(2, 128), dtypes=[torch.long], depth=10,
                             row_settings=("depth", "var_names"))
    return text, m, extra


@case("ti_llama_lora_style_frozen.txt", "torchinfo", "transformer",
      "HF LlamaForCausalLM (2 layers), all frozen except lm_head and the norms, torchinfo "
      "input_data={input_ids, attention_mask}, col_names=(output_size, num_params, "
      "trainable), depth=3")
def _c21() -> tuple[str, Any, dict[str, Any]]:
    import torch

    m = _llama()
    _freeze(m)
    for name, p in m.named_parameters():
        if "norm" in name or name.startswith("lm_head"):
            p.requires_grad = True
    ids = _tokens(2, 64, 5000)
    text, extra = _torchinfo(m, input_data={"input_ids": ids,
                                            "attention_mask": torch.ones_like(ids)},
                             col_names=("output_size", "num_params", "trainable"))
    return text, m, extra


@case("ti_vit_hf.txt", "torchinfo", "transformer",
      "HF ViTForImageClassification (2 layers, 64 px), torchinfo input_size=(4, 3, 64, 64), "
      "depth=5")
def _c22() -> tuple[str, Any, dict[str, Any]]:
    m = _vit_hf()
    text, extra = _torchinfo(m, input_size=(4, 3, 64, 64), depth=5)
    return text, m, extra


@case("ti_clip_input_data.txt", "torchinfo", "transformer",
      "HF CLIPModel (2+2 layers), torchinfo input_data={input_ids, attention_mask, "
      "pixel_values}, depth=4")
def _c23() -> tuple[str, Any, dict[str, Any]]:
    import torch

    m = _clip()
    ids = _tokens(2, 16, 5000)
    g = torch.Generator().manual_seed(0)
    text, extra = _torchinfo(m, input_data={"input_ids": ids,
                                            "attention_mask": torch.ones_like(ids),
                                            "pixel_values": torch.randn(2, 3, 64, 64,
                                                                        generator=g)},
                             depth=4)
    return text, m, extra


@case("ti_nn_transformer_encoder.txt", "torchinfo", "transformer",
      "torch.nn.TransformerEncoder (2 layers, batch_first) on float input, torchinfo all "
      "columns, depth=4")
def _c24() -> tuple[str, Any, dict[str, Any]]:
    from torch import nn

    layer = nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=256,
                                       batch_first=True)
    m = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()
    text, extra = _torchinfo(m, input_size=(8, 50, 64), col_names=ALL_COLS, depth=4)
    return text, m, extra


@case("ti_bert_two_input_sizes.txt", "torchinfo", "transformer",
      "HF BertModel (2 layers), torchinfo input_size=[(4, 64), (4, 64)] (input_ids, "
      "attention_mask), dtypes=[torch.long, torch.long], depth=2")
def _c26() -> tuple[str, Any, dict[str, Any]]:
    import torch

    m = _bert()
    text, extra = _torchinfo(m, input_size=[(4, 64), (4, 64)],
                             dtypes=[torch.long, torch.long], depth=2)
    return text, m, extra


@case("ti_misc_layers.txt", "torchinfo", "rnn",
      "EmbeddingBag/GRU/Conv1d/GroupNorm/PReLU/ModuleDict/ParameterList/Bilinear model, "
      "torchinfo input_size=(8, 40), dtypes=[torch.long], row_settings=('var_names',)")
def _c27() -> tuple[str, Any, dict[str, Any]]:
    import torch

    m = _misc_layers()
    text, extra = _torchinfo(m, input_size=(8, 40), dtypes=[torch.long],
                             row_settings=("var_names",))
    return text, m, extra


@case("ti_bert_seqcls_default_depth.txt", "torchinfo", "transformer",
      "HF BertForSequenceClassification (2 layers), torchinfo defaults (depth=3: the "
      "encoder's ModuleList is the last row shown, with no output shape), input_data="
      "{input_ids, attention_mask}")
def _c28() -> tuple[str, Any, dict[str, Any]]:
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    m = BertForSequenceClassification(BertConfig(
        num_hidden_layers=2, hidden_size=128, num_attention_heads=4, intermediate_size=512,
        vocab_size=5000)).eval()
    ids = _tokens(4, 128, 5000)
    text, extra = _torchinfo(m, input_data={"input_ids": ids,
                                            "attention_mask": torch.ones_like(ids)})
    return text, m, extra


@case("ti_vit_base_hf_default_depth.txt", "torchinfo", "transformer",
      "HF ViTForImageClassification(ViTConfig()) (ViT-base, 224 px), torchinfo defaults "
      "(depth=3: the ViTLayer blocks are leaves), input_size=(2, 3, 224, 224)")
def _c29() -> tuple[str, Any, dict[str, Any]]:
    m = _vit_base()
    text, extra = _torchinfo(m, input_size=(2, 3, 224, 224))
    return text, m, extra


@case("ti_vit_base_hf_depth10.txt", "torchinfo", "transformer",
      "HF ViTForImageClassification(ViTConfig()) (ViT-base, 224 px), torchinfo depth=10, "
      "input_size=(2, 3, 224, 224)")
def _c30() -> tuple[str, Any, dict[str, Any]]:
    m = _vit_base()
    text, extra = _torchinfo(m, input_size=(2, 3, 224, 224), depth=10)
    return text, m, extra


@case("ti_resnet18_depth0.txt", "torchinfo", "cnn",
      "torchvision resnet18, torchinfo depth=0 (only the model row)")
def _c25() -> tuple[str, Any, dict[str, Any]]:
    m = _tv("resnet18")
    text, extra = _torchinfo(m, input_size=(4, 3, 224, 224), depth=0)
    return text, m, extra


# ----------------------------------------------------------------------------- torchsummary

@case("ts_vgg11.txt", "torchsummary", "cnn", "torchvision vgg11, torchsummary (3, 224, 224)")
def _s1() -> tuple[str, Any, dict[str, Any]]:
    m = _tv("vgg11")
    return _torchsummary(m, (3, 224, 224)), m, {}


@case("ts_mobilenet_v2.txt", "torchsummary", "cnn",
      "torchvision mobilenet_v2, torchsummary (3, 224, 224)")
def _s2() -> tuple[str, Any, dict[str, Any]]:
    m = _tv("mobilenet_v2")
    return _torchsummary(m, (3, 224, 224)), m, {}


@case("ts_resnet18_batch16_frozen.txt", "torchsummary", "cnn",
      "torchvision resnet18 with layer1 frozen, torchsummary (3, 128, 128) batch_size=16")
def _s3() -> tuple[str, Any, dict[str, Any]]:
    m = _tv("resnet18")
    _freeze(m.layer1)
    return _torchsummary(m, (3, 128, 128), batch_size=16), m, {}


@case("ts_two_input.txt", "torchsummary", "cnn",
      "custom two-input CNN (image + mask), torchsummary [(3, 32, 32), (1, 32, 32)]")
def _s4() -> tuple[str, Any, dict[str, Any]]:
    m = _two_input_cnn()
    return _torchsummary(m, [(3, 32, 32), (1, 32, 32)]), m, {}


@case("ts_squeezenet.txt", "torchsummary", "cnn",
      "torchvision squeezenet1_1, torchsummary (3, 224, 224)")
def _s5() -> tuple[str, Any, dict[str, Any]]:
    m = _tv("squeezenet1_1")
    return _torchsummary(m, (3, 224, 224)), m, {}


# ----------------------------------------------------------------------------- print(model)

def _print_case(fname: str, kind: str, source: str, build: Callable[[], Any],
                params: bool = False) -> None:
    def fn() -> tuple[str, Any, dict[str, Any]]:
        m = build()
        text = "\n".join(_with_params(m)) + "\n" if params else str(m) + "\n"
        return text, m, _print_extras(m)
    CASES[fname] = ("pytorch-print", kind, source, fn)


def _full_gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config()).eval()


def _bert_seqcls() -> Any:
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(num_labels=3)).eval()


def _t5_small() -> Any:
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config()).eval()


def _llama_mid() -> Any:
    return _llama(vocab_size=32000, hidden_size=512, intermediate_size=1376,
                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  max_position_embeddings=2048)


def _vit_base() -> Any:
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(num_labels=1000)).eval()


def _clip_base() -> Any:
    from transformers import CLIPConfig, CLIPModel

    return CLIPModel(CLIPConfig()).eval()


def _data_parallel() -> Any:
    import torch

    return torch.nn.DataParallel(_tv("resnet18"))


def _compiled() -> Any:
    import torch

    return torch.compile(_tv("mobilenet_v3_small"))  # printing does not compile


def _nn_transformer() -> Any:
    import torch

    return torch.nn.Transformer(d_model=256, nhead=4, num_encoder_layers=2,
                                num_decoder_layers=2, dim_feedforward=1024).eval()


for _f, _k, _s, _b in (
    ("pp_gpt2.txt", "transformer", "print(model) of HF GPT2LMHeadModel(GPT2Config())", _full_gpt2),
    ("pp_bert_seqcls.txt", "transformer",
     "print(model) of HF BertForSequenceClassification(BertConfig(num_labels=3))", _bert_seqcls),
    ("pp_t5_small.txt", "transformer",
     "print(model) of HF T5ForConditionalGeneration(T5Config()) (t5-small)", _t5_small),
    ("pp_llama.txt", "transformer",
     "print(model) of HF LlamaForCausalLM (4 layers, hidden 512, GQA)", _llama_mid),
    ("pp_vit.txt", "transformer",
     "print(model) of HF ViTForImageClassification(ViTConfig())", _vit_base),
    ("pp_clip.txt", "transformer", "print(model) of HF CLIPModel(CLIPConfig())", _clip_base),
    ("pp_resnet50_tv.txt", "cnn", "print(model) of torchvision resnet50",
     lambda: _tv("resnet50")),
    ("pp_vgg16.txt", "cnn", "print(model) of torchvision vgg16", lambda: _tv("vgg16")),
    ("pp_mobilenet_v3_large.txt", "cnn", "print(model) of torchvision mobilenet_v3_large",
     lambda: _tv("mobilenet_v3_large")),
    ("pp_timm_vit_small.txt", "transformer", "print(model) of timm vit_small_patch16_224",
     lambda: _timm("vit_small_patch16_224")),
    ("pp_timm_convnext_tiny.txt", "cnn", "print(model) of timm convnext_tiny",
     lambda: _timm("convnext_tiny")),
    ("pp_dataparallel_resnet18.txt", "cnn",
     "print(model) of torch.nn.DataParallel(torchvision resnet18)", _data_parallel),
    ("pp_compiled_mobilenet.txt", "cnn",
     "print(model) of torch.compile(torchvision mobilenet_v3_small) (OptimizedModule)",
     _compiled),
    ("pp_nn_transformer.txt", "transformer",
     "print(model) of torch.nn.Transformer(d_model=256, 2+2 layers)", _nn_transformer),
    ("pp_lstm_lm.txt", "rnn", "print(model) of an Embedding+LSTM+Linear LM", _LstmLM.build),
    ("pp_timm_efficientnet_b0.txt", "cnn",
     "print(model) of timm efficientnet_b0 (BatchNormAct2d: arguments and children)",
     lambda: _timm("efficientnet_b0")),
    ("pp_misc_layers.txt", "rnn",
     "print(model) of a model with EmbeddingBag/GRU/Conv1d/GroupNorm/PReLU/ModuleDict/"
     "ParameterList/Bilinear", _misc_layers),
):
    _print_case(_f, _k, _s, _b)

for _f, _k, _s, _b in (
    ("pp_params_gpt2.txt", "transformer", "HF GPT2LMHeadModel (2 layers, tied lm_head)", _gpt2),
    ("pp_params_llama.txt", "transformer", "HF LlamaForCausalLM (4 layers, hidden 512)",
     _llama_mid),
    ("pp_params_t5.txt", "transformer", "HF T5ForConditionalGeneration (2+2 layers)", _t5),
    ("pp_params_clip.txt", "transformer", "HF CLIPModel (2+2 layers)", _clip),
    ("pp_params_resnet50.txt", "cnn", "torchvision resnet50", lambda: _tv("resnet50")),
    ("pp_params_vit_tiny.txt", "transformer", "timm vit_tiny_patch16_224",
     lambda: _timm("vit_tiny_patch16_224")),
    ("pp_params_lstm_lm.txt", "rnn", "Embedding+LSTM+Linear LM", _LstmLM.build),
    ("pp_params_efficientnet_b0.txt", "cnn", "timm efficientnet_b0 (BatchNormAct2d)",
     lambda: _timm("efficientnet_b0")),
    ("pp_params_misc_layers.txt", "rnn",
     "EmbeddingBag/GRU/Conv1d/GroupNorm/PReLU/ModuleDict/ParameterList/Bilinear model",
     _misc_layers),
):
    _print_case(_f, _k, f"print(model) with ', N params' per module line: {_s}", _b,
                params=True)


# ----------------------------------------------------------------------------- main

def _strip_trailing(text: str) -> str:
    """torchinfo pads cells with spaces; keep them (users paste them), end with one newline."""
    return text.rstrip("\n") + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="regenerate only file names containing this")
    args = ap.parse_args()

    import torch
    import transformers

    torch.manual_seed(0)
    torch.set_num_threads(2)
    transformers.logging.set_verbosity_error()

    OUT.mkdir(parents=True, exist_ok=True)
    manifest_path = OUT / "MANIFEST.json"
    manifest: dict[str, Any] = (json.loads(manifest_path.read_text())
                                if manifest_path.exists() else {})
    skipped: list[str] = []
    for fname, (fmt, kind, source, fn) in CASES.items():
        if args.only and args.only not in fname:
            continue
        try:
            with torch.no_grad():
                text, model, extra = fn()
        except Exception as e:  # noqa: BLE001 - report and go on with the others
            print(f"FAILED {fname}: {type(e).__name__}: {e}", file=sys.stderr)
            skipped.append(fname)
            continue
        text = _strip_trailing(text)
        if len(text.encode()) > MAX_BYTES:
            print(f"SKIPPED {fname}: {len(text.encode())} bytes", file=sys.stderr)
            skipped.append(fname)
            continue
        total, trainable = _counts(model)
        entry: dict[str, Any] = {"source": source, "format": fmt, "kind": kind,
                                 "total_params": total, "trainable_params": trainable,
                                 "shows_totals": fmt != "pytorch-print" or
                                 bool(re.search(r" params\s*$", text))}
        if fmt == "torchsummary":
            shown = re.search(r"Total params: ([\d,]+)", text)
            # torchsummary counts only module.weight/.bias; these models have no other
            # parameters, so what it prints is the truth (checked, not assumed)
            assert shown and int(shown.group(1).replace(",", "")) == total, fname
        for key in ("shown_total_params", "shown_trainable_params"):
            truth = total if key == "shown_total_params" else trainable
            if key in extra and extra[key] == truth:
                del extra[key]
        entry.update(extra)
        (OUT / fname).write_text(text)
        manifest[fname] = entry
        print(f"wrote {fname}: {len(text.encode())} bytes, {total:,} params", file=sys.stderr)
    manifest = {k: manifest[k] for k in sorted(manifest) if (OUT / k).exists()}
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(f"{len(manifest)} files in {OUT}; skipped: {skipped or 'none'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
