"""Accuracy and speed of the GPU-memory estimators on measured A100 peaks.

One command::

    .venv/bin/python benchmarks/estimator_accuracy.py             # evaluate (table)
    .venv/bin/python benchmarks/estimator_accuracy.py --calibrate # refit, then evaluate

Data (``../shared/data/gpu-memory``, not shipped; see docs/estimators.md for sources):

* ``gpumemnet_mlp_a100.csv``: 3,000 MLP runs; each row's layer list becomes a summary
  in our JSON format (input width from the file name).
* ``timm_a100_calibration.csv``: timm model x batch, measured peak (Adam, fp32) and
  PyTorch FakeTensor's estimate (shown as the tracing baseline); the model summaries
  come from ``benchmarks/summaries/timm_torchinfo.jsonl.xz``
  (``make_timm_summaries.py``). Rows whose FakeTensor figure already exceeds the
  40 GiB card, or whose measured peak is at the card's capacity, are runs that hit
  OOM: their "peak" is not the job's need. Rows measured below 90% of FakeTensor's
  tensors-only figure, and models whose peak stays flat over all batch sizes, are
  runs that never completed a training step. All are left out (counted in the
  header) by rules that look only at the CSV, never at our estimates.

Split: by model (timm) / by architecture file (MLP), a fixed hash, 30% held out. The
calibration (``--calibrate``) sees only the calibration split; the table reports both.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import json
import lzma
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import pandas as pd  # noqa: E402

from slurm_colloc.estimators import (  # noqa: E402
    attention_fit,
    estimate,
    layer_aware,
    parse_summary,
    read_summary_file,
)
from slurm_colloc.estimators.base import Job  # noqa: E402
from slurm_colloc.estimators.calibration import Row, fit, fit_quantile, hides_blocks  # noqa: E402
from slurm_colloc.estimators.features import compute  # noqa: E402
from slurm_colloc.estimators.history_scaling import scale_history  # noqa: E402
from slurm_colloc.estimators.horus import HorusEstimator  # noqa: E402
from slurm_colloc.estimators.layer_aware import (  # noqa: E402
    CALIBRATION_FILE,
    PRIOR,
    LayerAwareEstimator,
    load_calibration,
)
from slurm_colloc.estimators.model import Layer, ModelSummary  # noqa: E402
from slurm_colloc.estimators.recognition import recognise  # noqa: E402

CORPUS = REPO / "slurm_colloc" / "estimators" / "data" / "corpus"

DATA = REPO.parent / "shared" / "data" / "gpu-memory"
SUMMARIES = REPO / "benchmarks" / "summaries" / "timm_torchinfo.jsonl.xz"
CARD_MIB = 40960
AT_CAPACITY_MIB = 40000
HELD_OUT_SHARE = 0.30
FAILED_RATIO = 0.9
"""A run whose measured peak is below 90% of FakeTensor's tensors-only figure did not
complete a training step (the trace is a lower bound of what a step allocates)."""
FLAT_RATIO = 1.10
"""A model whose measured peaks across all its batch sizes stay within 10% of each
other did not train (activations grow linearly with the batch): all its rows go."""


def held_out(key: str) -> bool:
    """Deterministic split by a hash of the model / architecture name."""
    h = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16)
    return (h % 1000) < HELD_OUT_SHARE * 1000


@dataclass
class Case:
    """One measured run."""

    dataset: str
    key: str
    batch: int
    measured: float
    summary: ModelSummary
    faketensor: float | None
    held_out: bool


def mlp_cases(path: Path) -> list[Case]:
    """GPUMemNet MLP rows as summaries in our JSON format."""
    df = pd.read_csv(path)
    cases = []
    for row in df.itertuples(index=False):
        fname = str(row.Filename)
        layers = ast.literal_eval(str(row[2]))
        doc = {
            "format": "colloc-summary/1",
            "name": fname,
            "layers": [{"type": t, "output_shape": [int(w)], "params": int(p)}
                       for t, w, p in layers],
            "total_params": int(str(row[5])),
        }
        summary = parse_summary(json.dumps(doc))
        cases.append(Case("mlp", fname, int(str(row[6])), float(str(row[9])), summary, None,
                          held_out(fname)))
    return cases


def timm_cases(path: Path) -> tuple[list[Case], dict[str, int]]:
    """timm rows that have a summary and did not run out of memory."""
    with lzma.open(SUMMARIES, "rt", encoding="utf-8") as f:
        recs = [json.loads(line) for line in f if line.strip()]
    partial = SUMMARIES.with_suffix(".partial.jsonl")  # a generation still running
    if partial.exists():
        recs += [json.loads(line) for line in partial.open() if line.strip()]
    summaries = {r["model"]: parse_summary(r["summary"]) for r in recs if "summary" in r}
    df = pd.read_csv(path)
    dropped = {"no_summary": 0, "oom": 0, "failed": 0, "flat": 0}
    # a model whose peak does not grow over a 16x batch range never trained
    span = df.groupby("model")["measured_peak_mib"].agg(["min", "max", "count"])
    flat = set(span[(span["count"] >= 3) & (span["max"] <= FLAT_RATIO * span["min"])].index)
    cases = []
    for row in df.itertuples(index=False):
        model = str(row.model)
        if model not in summaries:
            dropped["no_summary"] += 1
            continue
        if model in flat:
            dropped["flat"] += 1
            continue
        fake = float(str(row.faketensor_estimate_mib))
        measured = float(str(row.measured_peak_mib))
        if fake >= CARD_MIB or measured >= AT_CAPACITY_MIB:
            dropped["oom"] += 1
            continue
        if measured < FAILED_RATIO * fake:
            dropped["failed"] += 1
            continue
        cases.append(Case("timm", model, int(str(row.batch_size)), measured, summaries[model],
                          fake, held_out(model)))
    return cases, dropped


TRUNCATED_DEPTH = 3
"""torchinfo's default ``depth``: the depth most users' tables come at."""


def truncate(summary: ModelSummary, depth: int) -> ModelSummary:
    """The table torchinfo prints at ``depth``, made from a deeper one: rows below
    ``depth`` go, and a container at ``depth`` becomes a childless row carrying its
    subtree's parameters (what torchinfo shows for a block it does not expand)."""
    rows = summary.layers
    out: list[Layer] = []
    for i, layer in enumerate(rows):
        if layer.depth > depth:
            continue
        if layer.depth == depth and not layer.leaf:
            params, j = layer.params, i + 1
            while j < len(rows) and rows[j].depth > layer.depth:
                params += rows[j].params
                j += 1
            shape = layer.output_shape
            if shape is None and params > 0:
                # as the torchinfo parser does: the layers a container torchinfo never
                # saw called (ModuleList, a looped Sequential) hides produce the
                # enclosing row's shape
                shape = next((r.output_shape for r in reversed(out)
                              if r.depth < layer.depth and r.output_shape), None)
            layer = dataclasses.replace(layer, params=params, leaf=True, output_shape=shape)
        out.append(layer)
    return dataclasses.replace(summary, layers=tuple(out))


def truncated_cases(cases: list[Case]) -> list[Case]:
    """Every timm run again, from the depth-3 table of its model (dataset ``timm-d3``)."""
    memo: dict[str, ModelSummary] = {}
    out = []
    for c in cases:
        if c.dataset != "timm":
            continue
        if c.key not in memo:
            memo[c.key] = truncate(c.summary, TRUNCATED_DEPTH)
        out.append(dataclasses.replace(c, dataset="timm-d3", summary=memo[c.key]))
    return out


def metrics(est: list[float], meas: list[float]) -> dict[str, float]:
    """Share not underestimated, median / p90 overestimate, worst underestimate."""
    rel = [(e - m) / m for e, m in zip(est, meas, strict=True)]
    over = sorted(r for r in rel if r >= 0)
    q = statistics.quantiles(rel, n=10) if len(rel) >= 2 else rel * 9
    return {
        "n": len(rel),
        "ok": sum(r >= 0 for r in rel) / len(rel),
        "med": statistics.median(rel),
        "med_over": statistics.median(over) if over else float("nan"),
        "p90": q[8],
        "worst": min(rel),
    }


def evaluate(cases: list[Case]) -> dict[str, Callable[[Case], float | None]]:
    """The estimators compared: name -> function of a case (None = not applicable).

    ``learned-q96`` and ``learned-gbm`` are fitted here, on the calibration split only,
    every run (comparisons, not shipped: at matched coverage they do not beat
    layer-aware on held-out data; docs/estimators.md). ``learned-gbm`` needs
    scikit-learn (the ``bench`` extra) and is left out without it."""
    horus, la = HorusEstimator(), LayerAwareEstimator()
    prior = LayerAwareEstimator(PRIOR)
    full_rows = [r for r in _rows(cases) if not hides_blocks(r.features)]
    learned = LayerAwareEstimator(fit_quantile(full_rows, tau=0.96), name="learned-q96")

    def run(e: HorusEstimator | LayerAwareEstimator) -> Callable[[Case], float]:
        return lambda c: float(e.estimate(c.summary, Job(batch_size=c.batch)).estimate_mib)

    gbm = learned_gbm(cases)
    return {
        "horus": run(horus),
        "faketensor": lambda c: c.faketensor,
        "tracing-cal": tracing_calibrated,
        "physics-prior": run(prior),
        "learned-q96": run(learned),
        **({"learned-gbm": gbm} if gbm else {}),
        "layer-aware": run(la),
    }


def fit_tracing(cases: list[Case], coverage: float = 0.96) -> dict[str, float]:
    """The tracing estimator's constants from the calibration split: context and
    allocator factor k (least relative squares of measured ~ context + k x FakeTensor),
    and the split-conformal margin on the traced part. The CSV's FakeTensor column
    stands in for our tracer (the same MemTracker count; spot checks in
    docs/estimators.md)."""
    import numpy as np

    cal = [c for c in cases if c.dataset == "timm" and not c.held_out and c.faketensor]
    x = np.array([[1.0, c.faketensor or 0.0] for c in cal])
    y = np.array([c.measured for c in cal])
    w = 1 / y
    ctx, k = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)[0]
    need = [(c.measured - ctx) / (k * (c.faketensor or 1.0)) - 1 for c in cal]
    return {"context_mib": round(float(ctx), 1), "k": round(float(k), 4),
            "margin_rel": round(float(np.quantile(need, coverage)), 4)}


def tracing_calibrated(c: Case) -> float | None:
    """The shipped tracing calibration applied to the CSV's FakeTensor figure: the best
    a tracing estimator does here (exact tensors; allocator and cuDNN behaviour from
    the calibration). It bounds what a better activation count from a summary could
    reach."""
    if c.faketensor is None:
        return None
    t = load_calibration().tracing
    return t["context_mib"] + t["k"] * c.faketensor * (1 + t["margin_rel"])


def learned_gbm(cases: list[Case], alpha: float = 0.96) -> Callable[[Case], float | None] | None:
    """A non-linear learned alternative (comparison only): gradient-boosted quantile
    trees on the layer-aware features, predicting log(measured / unmargined layer-aware
    estimate) at quantile ``alpha``; fitted on the calibration split's timm runs. None
    when scikit-learn is missing (``pip install -e '.[bench]'``)."""
    try:
        from sklearn.ensemble import GradientBoostingRegressor
    except ImportError:
        return None
    import numpy as np

    from slurm_colloc.estimators.features import MARGIN_BUCKETS, margin_bucket
    from slurm_colloc.estimators.layer_aware import base_breakdown
    from slurm_colloc.estimators.layers import CATEGORIES

    cal = load_calibration()

    def feats(c: Case) -> tuple[list[float], float]:
        f = compute(c.summary, c.batch, None, "adam", "fp32")
        p = base_breakdown(f, cal)
        base = sum(p.values())
        act = sum(f.act.values()) + 1e-9
        x = [math.log(base), math.log(c.batch), p["activations"] / base,
             p["workspace"] / base, p["weights"] * 4 / base, f.largest / act,
             f.attn_scores / act, *(f.act[k] / act for k in CATEGORIES),
             *(float(margin_bucket(f) == b) for b in MARGIN_BUCKETS)]
        return x, base

    train = [c for c in cases if c.dataset == "timm" and not c.held_out]
    xy = [feats(c) for c in train]
    model = GradientBoostingRegressor(loss="quantile", alpha=alpha, n_estimators=200,
                                      max_depth=2, learning_rate=0.05, min_samples_leaf=20,
                                      subsample=0.8, random_state=0)
    model.fit(np.array([x for x, _ in xy]),
              np.array([math.log(c.measured / b) for c, (_, b) in zip(train, xy, strict=True)]))

    def run(c: Case) -> float | None:
        if c.dataset != "timm":
            return None
        x, base = feats(c)
        return base * math.exp(float(model.predict(np.array([x]))[0]))
    return run


def history_table(cases: list[Case]) -> str:
    """Estimates from measured peaks of the same model at other batch sizes, as
    ``colloc estimate`` makes them once the history holds earlier runs
    (:mod:`slurm_colloc.estimators.history_scaling`), on the timm runs: for every run, the history
    is (a) each one other batch size of the same model, (b) each pair of other batch
    sizes, (c) all its other batch sizes."""
    import itertools

    la = LayerAwareEstimator()
    by: dict[str, dict[int, Case]] = {}
    for c in cases:
        if c.dataset == "timm":
            by.setdefault(c.key, {})[c.batch] = c
    cold_cache: dict[tuple[str, int], int] = {}

    def cold(key: str) -> Callable[[int], int]:
        def f(b: int) -> int:
            if (key, b) not in cold_cache:
                cold_cache[(key, b)] = la.estimate(
                    by[key][b].summary, Job(batch_size=b)).estimate_mib
            return cold_cache[(key, b)]
        return f

    lines = [f"{'history':<26} {'split':<9} {'n':>5} {'not-under':>9} {'med-err':>8} "
             f"{'med-over':>8} {'p90-err':>8} {'worst-under':>11}"]
    scenarios: dict[str, Callable[[dict[int, Case], int], list[list[int]]]] = {
        "anchored (1 other batch)": lambda g, b: [[b0] for b0 in g if b0 != b],
        "fit (2 other batches)": lambda g, b: [list(p) for p in
                                               itertools.combinations([x for x in g if x != b], 2)],
        "fit (all other batches)": lambda g, b: [[x for x in g if x != b]]
        if len(g) >= 3 else [],
    }
    for name, hist in scenarios.items():
        for split in ("calib", "held-out"):
            est, meas = [], []
            for key, g in by.items():
                if next(iter(g.values())).held_out != (split == "held-out"):
                    continue
                for b, case in g.items():
                    for h in hist(g, b):
                        s = scale_history({x: int(g[x].measured) for x in h}, b, cold(key))
                        assert s is not None
                        est.append(float(s.estimate_mib))
                        meas.append(case.measured)
            m = metrics(est, meas)
            lines.append(f"{name:<26} {split:<9} {m['n']:>5} {m['ok']:>9.1%} {m['med']:>+8.1%} "
                         f"{m['med_over']:>+8.1%} {m['p90']:>+8.1%} {m['worst']:>+11.1%}")
    return "\n".join(lines)


def table(cases: list[Case], only: tuple[str, ...] = ()) -> str:
    """The accuracy table, one line per estimator x dataset x split."""
    ests = evaluate(cases)
    if only:
        ests = {k: v for k, v in ests.items() if k in only}
    lines = [f"{'estimator':<14} {'data':<7} {'split':<9} {'n':>5} {'not-under':>9} "
             f"{'med-err':>8} {'med-over':>8} {'p90-err':>8} {'worst-under':>11}"]
    for name, fn in ests.items():
        for ds in ("mlp", "timm", "timm-d3", "all"):
            for split in ("calib", "held-out"):
                sel = [c for c in cases
                       if (ds == c.dataset or (ds == "all" and c.dataset != "timm-d3"))
                       and c.held_out == (split == "held-out")]
                pairs = [(fn(c), c.measured) for c in sel]
                pairs2 = [(e, m) for e, m in pairs if e is not None]
                if not pairs2:
                    continue
                m = metrics([e for e, _ in pairs2], [m for _, m in pairs2])
                lines.append(
                    f"{name:<14} {ds:<7} {split:<9} {m['n']:>5} {m['ok']:>9.1%} "
                    f"{m['med']:>+8.1%} {m['med_over']:>+8.1%} {m['p90']:>+8.1%} "
                    f"{m['worst']:>+11.1%}")
    return "\n".join(lines)


def _rows(cases: list[Case]) -> list[Row]:
    """Calibration-split rows (the held-out split never reaches a fit)."""
    return [Row(compute(c.summary, c.batch, None, "adam", "fp32"), c.measured,
                "timm" if c.dataset == "timm-d3" else c.dataset)
            for c in cases if not c.held_out]


def spike_rows(cases: list[Case]) -> set[tuple[str, int]]:
    """Runs whose peak exceeds the peak of the same model at a larger batch: a
    deterministic step cannot do that (activations only grow with the batch), so
    these carry a transient such as cuDNN benchmark workspace trials."""
    by: dict[str, dict[int, float]] = {}
    for c in cases:
        by.setdefault(c.key, {})[c.batch] = c.measured
    out = set()
    for key, peaks in by.items():
        for b, m in peaks.items():
            if any(b2 > b and m > 1.02 * m2 for b2, m2 in peaks.items()):
                out.add((key, b))
    return out


def underestimate_report(cases: list[Case]) -> str:
    """Where the default estimator is more than 10% low, and why."""
    la = LayerAwareEstimator()
    spikes = spike_rows(cases)
    lines = []
    for split in ("calib", "held-out"):
        sel = [c for c in cases if c.held_out == (split == "held-out")]
        bad = [c for c in sel
               if la.estimate(c.summary, Job(batch_size=c.batch)).estimate_mib < 0.9 * c.measured]
        n_spike = sum((c.key, c.batch) in spikes for c in bad)
        clean = [c for c in sel if (c.key, c.batch) not in spikes]
        worst = min(((la.estimate(c.summary, Job(batch_size=c.batch)).estimate_mib - c.measured)
                     / c.measured for c in clean), default=float("nan"))
        lines.append(f"layer-aware {split}: {len(bad)} of {len(sel)} runs more than 10% low, "
                     f"{n_spike} of them spike runs (peak above the same model's peak at a "
                     f"larger batch); worst underestimate without spike runs: {worst:+.1%}")
    return "\n".join(lines)


def calibrate(cases: list[Case]) -> None:
    """Fit on the calibration split and write ``slurm_colloc/estimators/data/calibration.json``."""
    rows = _rows(cases)
    cal = fit(rows)
    doc = cal.to_dict()
    doc["tracing"] = fit_tracing(cases)
    doc["fitted_on"] = {
        "rows": len(rows),
        "by_dataset": {ds: sum(r.group == ds for r in rows) for ds in ("mlp", "timm")},
        "data": ["gpumemnet_mlp_a100.csv", "timm_a100_calibration.csv (non-OOM rows)"],
        "split": f"hash of model name, {HELD_OUT_SHARE:.0%} held out, never fitted",
        "command": "benchmarks/estimator_accuracy.py --calibrate",
    }
    if attention_fit.CSV_PATH.exists():
        doc["attention"] = attention_fit.fit(attention_fit.load(), k_params=cal.k_params)
    CALIBRATION_FILE.parent.mkdir(parents=True, exist_ok=True)
    CALIBRATION_FILE.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    print(f"wrote {CALIBRATION_FILE.relative_to(REPO)}: "
          f"context {cal.context_mib:.0f} MiB, k_params {cal.k_params:.3f}, "
          f"margin {cal.margin_rel:.1%} (largest bucket) + {cal.margin_abs_mib:.0f} MiB")


def transformer_table() -> str:
    """Transformers, held out by model family: every family's traced runs
    (``attention_measurements.csv``: exact tensor accounting of Hugging Face models,
    FakeTensorMode + MemTracker) predicted by constants fitted on the other families,
    with the margin chosen on the other families too (nested leave-one-family-out),
    tensors only (no CUDA context, no allocator overhead: k_alloc = 1)."""
    runs = attention_fit.load()
    fams = sorted({r.family for r in runs})
    k_p = load_calibration().k_params
    lines = [f"{'family':<10} {'impl':<6} {'n':>4} {'not-under':>9} {'med-err':>8} "
             f"{'med-over':>8} {'worst-under':>11}  (tensors; constants and margin fitted "
             "without the family)"]
    allp: list[tuple[float, float]] = []
    by_depth: dict[int, list[tuple[float, float]]] = {}
    for fam in fams:
        train = [r for r in runs if r.family != fam]
        c = attention_fit.fit_coefficients(train)
        rel = attention_fit.margin(attention_fit.held_out_by_family(train), k_params=k_p)
        for impl in ("eager", "sdpa"):
            test = [r for r in runs if r.family == fam and r.impl == impl]
            if not test:
                continue
            pairs = []
            for r in test:
                _, a = attention_fit.split_parts(c, r.x_est)
                pairs.append((k_p * r.x_est[0] + a * (1 + rel), r.traced_mib))
                by_depth.setdefault(r.layers, []).append(pairs[-1])
            allp += pairs
            m = metrics([e for e, _ in pairs], [t for _, t in pairs])
            lines.append(f"{fam:<10} {impl:<6} {m['n']:>4} {m['ok']:>9.1%} {m['med']:>+8.1%} "
                         f"{m['med_over']:>+8.1%} {m['worst']:>+11.1%}")
    m = metrics([e for e, _ in allp], [t for _, t in allp])
    lines.append(f"{'all':<10} {'':<6} {m['n']:>4} {m['ok']:>9.1%} {m['med']:>+8.1%} "
                 f"{m['med_over']:>+8.1%} {m['worst']:>+11.1%}")
    for depth, pairs in sorted(by_depth.items()):
        m = metrics([e for e, _ in pairs], [t for _, t in pairs])
        lines.append(f"{f'{depth} layers':<10} {'':<6} {m['n']:>4} {m['ok']:>9.1%} "
                     f"{m['med']:>+8.1%} {m['med_over']:>+8.1%} {m['worst']:>+11.1%}")
    cal = load_calibration().attention
    lines.append("shipped constants (all families): " + ", ".join(
        f"{k} {cal[k]:.3g}" for k in ("score_bytes", "nodrop_bytes", "rel_factor",
                                       "token_bytes", "k_leaf", "k_head", "k_alloc",
                                       "margin_rel")))
    return "\n".join(lines)


def recognition_coverage() -> str:
    """What the rules recognise on the corpus (every transformer must be
    attention-bearing) and how the timm tables are classified."""
    lines = []
    n_tr = ok = 0
    for p in sorted(CORPUS.glob("*.txt")):
        s = read_summary_file(p)
        rec = recognise(s)
        is_tr = not p.name.startswith(("flax_cnn", "resnet", "keras3_resnet"))
        n_tr += is_tr
        ok += is_tr and rec.attention and rec.recognised
        lines.append(f"  {p.name:<40} {s.format:<13} {rec.kind:<11} {rec.family or '-':<12} "
                     f"attention layers {sum(not c.cross for c in rec.cores):>3} "
                     f"cross {sum(c.cross for c in rec.cores):>2}")
    head = (f"recognition on the corpus ({CORPUS.relative_to(REPO)}): {ok} of {n_tr} "
            "transformer summaries recognised as attention-bearing")
    kinds: dict[str, int] = {}
    with lzma.open(SUMMARIES, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                k = recognise(parse_summary(json.loads(line)["summary"])).kind
                kinds[k] = kinds.get(k, 0) + 1
    tail = "timm tables by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
    return "\n".join([head, *lines, tail])


def timings(summary_text: str, name: str = "resnet50 torchinfo") -> str:
    """CLI wall time (fresh process each call) and library call time."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(summary_text)
        path = f.name
    exe = Path(sys.executable).parent / "colloc"
    if exe.exists():
        argv = [str(exe)]
    else:
        argv = [sys.executable, "-c",
                "import sys; from slurm_colloc.cli import main; sys.exit(main())"]
    argv += ["estimate", "--summary", path, "--batch-size", "32", "--json"]
    walls = []
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    for _ in range(7):
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True, env=env)
        walls.append(time.perf_counter() - t0)
    Path(path).unlink()
    lib = []
    for _ in range(200):
        t0 = time.perf_counter()
        estimate(summary_text, batch_size=32)
        lib.append(time.perf_counter() - t0)
    return (f"CLI `colloc estimate --json` ({name}): median "
            f"{statistics.median(walls) * 1000:.0f} ms, max {max(walls) * 1000:.0f} ms wall "
            f"(7 runs)\nlibrary estimate(text, batch_size=32) incl. parsing: median "
            f"{statistics.median(lib) * 1000:.2f} ms, p99 "
            f"{sorted(lib)[int(len(lib) * 0.99) - 1] * 1000:.2f} ms (200 calls)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibrate", action="store_true", help="refit calibration.json first")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--calibrate-attention", action="store_true",
                    help="refit only the transformer constants (attention section) from "
                         "slurm_colloc/estimators/data/attention_measurements.csv, then "
                         "--transformers-only")
    ap.add_argument("--transformers-only", action="store_true",
                    help="only the transformer section and recognition coverage (no "
                         "measured data needed)")
    args = ap.parse_args()
    if args.calibrate_attention:
        doc = json.loads(CALIBRATION_FILE.read_text())
        doc["attention"] = attention_fit.fit(attention_fit.load(),
                                             k_params=load_calibration().k_params)
        CALIBRATION_FILE.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        layer_aware._cached = None  # the tables below use the new constants
        print(f"wrote the attention section of {CALIBRATION_FILE.relative_to(REPO)}: "
              + ", ".join(f"{k} {v:.4g}" for k, v in doc["attention"].items()))
        args.transformers_only = True
    if args.transformers_only:
        print("transformers, held out by model family:")
        print(transformer_table())
        print(recognition_coverage())
        if not args.no_timing:
            print(timings((CORPUS / "bert_base_mlm.print_params.txt").read_text(),
                          "bert-base print(model)"))
        return 0
    cases = mlp_cases(DATA / "gpumemnet_mlp_a100.csv")
    timm, dropped = timm_cases(DATA / "timm_a100_calibration.csv")
    cases += timm
    cases += truncated_cases(timm)
    n_models = len({c.key for c in timm})
    print(f"cases: {sum(c.dataset == 'mlp' for c in cases)} MLP runs, {len(timm)} timm runs "
          f"({n_models} models); left out: {dropped['oom']} timm OOM/at-capacity rows, "
          f"{dropped['failed']} failed-run rows, {dropped['flat']} flat-peak rows, "
          f"{dropped['no_summary']} rows without a summary; held out: "
          f"{sum(c.held_out for c in cases)} runs")
    if args.calibrate:
        calibrate(cases)
    cal = load_calibration()
    by_bucket = ", ".join(f"{b} {v:.0%} + {cal.abs_margin(b):.0f} MiB"
                          for b, v in cal.margin_rel_by_bucket.items())
    print(f"calibration: context {cal.context_mib:.0f} MiB, k_params {cal.k_params:.3f}, "
          f"margin {cal.margin_rel:.1%} of the model part + {cal.margin_abs_mib:.0f} MiB"
          + (f" (margin by bucket: {by_bucket})" if by_bucket else ""))
    print("errors are (estimate - measured) / measured; med-over = median over the "
          "not-underestimated runs")
    print(table(cases))
    print(underestimate_report(cases))
    spikes = spike_rows(cases)
    print(f"the same, without the {len(spikes)} spike runs (CSV-only rule: a run whose peak "
          "is more than 2% above the same model's peak at a larger batch; reported, not "
          "used for the targets):")
    print(table([c for c in cases if (c.key, c.batch) not in spikes], only=("layer-aware",)))
    print("with measured history of the same model (timm; every run's history is built "
          "from the same model's other rows, spike runs included):")
    print(history_table(cases))
    print("transformers, held out by model family:")
    print(transformer_table())
    print(recognition_coverage())
    if not args.no_timing:
        sample = REPO / "sbatch_templates" / "summaries" / "resnet50_torchinfo.txt"
        print(timings(sample.read_text()))
        print(timings((CORPUS / "bert_base_mlm.print_params.txt").read_text(),
                      "bert-base print(model)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
