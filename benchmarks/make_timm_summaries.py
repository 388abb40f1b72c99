"""Generate the torchinfo summaries of the timm models in the calibration data (run once).

Why this exists: ``timm_a100_calibration.csv`` has measured peaks per (model, batch) but
no model structure, and every summary-based estimator needs the structure. A user of
``sbatch --colloc`` hands us a torchinfo table; so we make exactly that table for each
timm model and keep the (small, xz-compressed) result in the repository, so that the
benchmark and the calibration never need torch.

How the file was made (needs a separate venv, about 5.5 GB, CPU is enough)::

    python3 -m venv /work/timmvenv
    /work/timmvenv/bin/pip install torch==2.14.1 torchvision==0.29.1 timm torchinfo
    /work/timmvenv/bin/python benchmarks/make_timm_summaries.py --jobs 2

Each model is built with ``timm.create_model(name, pretrained=False)`` (no download),
summarised with ``torchinfo.summary`` at batch 1 (activations scale linearly with the
batch; the estimators multiply) at the model's default input size, with
``depth=DEPTH`` so that the leaf layers are visible, and the default columns
(``Output Shape``, ``Param #``) that users get. Models that fail to build or trace are
skipped and listed in the output's ``failed`` records. Re-running appends only the
models that are missing.

``--samples`` instead writes the realistic example summaries used by the sbatch
templates and the parser tests (``sbatch_templates/summaries/``,
``tests/unit/data/summaries/``): resnet50 as torchinfo (default depth 3, batch 32)
and torchsummary-style tables, and Hugging Face bert-base-uncased (built from its
config, no download) as ``print(model)``, plain and with a ``, N params`` suffix.

Output: ``benchmarks/summaries/timm_torchinfo.jsonl.xz``, one JSON object per line:
``{"model", "input_size", "batch", "depth", "torch", "timm", "torchinfo", "summary"}``
or ``{"model", "failed": "<reason>"}``.
"""

from __future__ import annotations

import argparse
import csv
import json
import lzma
import multiprocessing as mp
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "summaries" / "timm_torchinfo.jsonl.xz"
CSV = HERE.parents[1] / "shared" / "data" / "gpu-memory" / "timm_a100_calibration.csv"
DEPTH = 8


def _one(model: str) -> dict[str, object]:
    """Summarise one model in a fresh worker process (torch state never leaks)."""
    try:
        import timm
        import torch
        import torchinfo

        torch.set_num_threads(1)
        m = timm.create_model(model, pretrained=False)
        m.eval()
        cfg = getattr(m, "pretrained_cfg", None) or {}
        c, h, w = cfg.get("input_size", (3, 224, 224))
        t0 = time.time()
        with torch.no_grad():
            s = torchinfo.summary(m, input_size=(1, c, h, w), depth=DEPTH, verbose=0, device="cpu")
        return {
            "model": model,
            "input_size": [c, h, w],
            "batch": 1,
            "depth": DEPTH,
            "torch": torch.__version__,
            "timm": timm.__version__,
            "torchinfo": getattr(torchinfo, "__version__", "?"),
            "seconds": round(time.time() - t0, 2),
            "summary": str(s),
        }
    except Exception as e:  # noqa: BLE001 - any model-specific failure just skips it
        return {"model": model, "failed": f"{type(e).__name__}: {e}"[:300]}


def _load_done() -> dict[str, dict[str, object]]:
    """Models already summarised: the packed file plus an interrupted run's partial log."""
    recs = []
    if OUT.exists():
        with lzma.open(OUT, "rt", encoding="utf-8") as f:
            recs += [json.loads(line) for line in f if line.strip()]
    partial = OUT.with_suffix(".partial.jsonl")
    if partial.exists():
        recs += [json.loads(line) for line in partial.open() if line.strip()]
    return {str(r["model"]): r for r in recs}


def _with_params(module: object, name: str | None = None, indent: int = 0) -> list[str]:
    """``print(model)`` with ``, N params`` after every module (the annotated variant
    some users paste: per-module parameter counts, Hugging Face style)."""
    pad = "  " * indent
    head = f"{pad}({name}): " if name is not None else pad
    n = sum(p.numel() for p in module.parameters())  # type: ignore[attr-defined]
    children = list(module.named_children())  # type: ignore[attr-defined]
    cls = type(module).__name__
    if not children:
        return [f"{head}{cls}({module.extra_repr()}), {n:,} params"]  # type: ignore[attr-defined]
    lines = [f"{head}{cls}("]
    for child_name, child in children:
        lines += _with_params(child, child_name, indent + 1)
    lines.append(f"{pad}), {n:,} params")
    return lines


def _torchsummary_table(model: object, input_size: tuple[int, ...]) -> str:
    """torchsummary's table (captured from its print)."""
    import contextlib
    import io

    from torchsummary import summary

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        summary(model, input_size, device="cpu")
    return buf.getvalue()


def samples() -> None:
    """Write the example summaries (see the module docstring)."""
    import timm
    import torchinfo
    from transformers import BertConfig, BertModel

    repo = HERE.parent
    out_dirs = [repo / "sbatch_templates" / "summaries",
                repo / "tests" / "unit" / "data" / "summaries"]
    r50 = timm.create_model("resnet50", pretrained=False)
    texts = {
        "resnet50_torchinfo.txt": str(torchinfo.summary(r50, input_size=(32, 3, 224, 224),
                                                        verbose=0, device="cpu")),
        "resnet50_torchsummary.txt": _torchsummary_table(r50, (3, 224, 224)),
    }
    bert = BertModel(BertConfig())
    texts["bert_base_print.txt"] = str(bert) + "\n"
    texts["bert_base_print_params.txt"] = "\n".join(_with_params(bert)) + "\n"
    for d in out_dirs:
        d.mkdir(parents=True, exist_ok=True)
        for fname, text in texts.items():
            (d / fname).write_text(text)
            print(f"wrote {d / fname}", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--csv", type=Path, default=CSV)
    ap.add_argument("--limit", type=int, default=0, help="only the first N models (testing)")
    ap.add_argument("--retry-failed", action="store_true")
    ap.add_argument("--samples", action="store_true", help="write the example summaries")
    args = ap.parse_args()
    if args.samples:
        samples()
        return 0

    with args.csv.open(newline="") as f:
        models = sorted({row["model"] for row in csv.DictReader(f)})
    if args.limit:
        models = models[: args.limit]
    done = _load_done()
    if args.retry_failed:
        done = {k: v for k, v in done.items() if "failed" not in v}
    todo = [m for m in models if m not in done]
    print(f"{len(models)} models, {len(done)} done, {len(todo)} to do", file=sys.stderr)

    results = dict(done)
    partial = OUT.with_suffix(".partial.jsonl")
    ctx = mp.get_context("spawn")
    with ctx.Pool(args.jobs, maxtasksperchild=25) as pool, partial.open("a") as log:
        for i, rec in enumerate(pool.imap_unordered(_one, todo), 1):
            results[str(rec["model"])] = rec
            log.write(json.dumps(rec) + "\n")
            log.flush()
            status = rec.get("failed", f"ok {rec.get('seconds')}s")
            print(f"[{i}/{len(todo)}] {rec['model']}: {status}", file=sys.stderr)

    OUT.parent.mkdir(parents=True, exist_ok=True)
    with lzma.open(OUT, "wt", encoding="utf-8", preset=9 | lzma.PRESET_EXTREME) as f:
        for name in sorted(results):
            f.write(json.dumps(results[name], sort_keys=True) + "\n")
    partial.unlink(missing_ok=True)
    n_ok = sum(1 for r in results.values() if "failed" not in r)
    print(f"wrote {OUT}: {n_ok} summaries, {len(results) - n_ok} failed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
