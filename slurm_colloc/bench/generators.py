"""The three traces of the replay benchmark, generated reproducibly from a seed.

(a) ``philly90``: 90 jobs, light/medium/heavy in 65/27/8 proportion, bursty
    Philly-like arrivals, one node with 4 x 40 GiB (the thesis set-up).
(b) ``heavy60``: 60 jobs, mostly medium and heavy, same node.
(c) ``alibaba``: a slice of the Alibaba 2023 GPU-sharing trace (single-GPU pods
    that finished), fractional GPU requests, on one node with 8 GPUs.

Profiles come from measurements (:mod:`.profiles`): a job with a timm model has a
measured peak at its batch size and a summary file the user passes to ``--colloc``;
a job with a Lucid model (custom code, no summary) gives explicit memory. The Philly
trace itself is not in the shared data, so arrivals are *Philly-like*: Poisson gaps
with bursts of several submissions within a minute, scaled so that jobs arrive over
``arrival_frac`` of the whole-GPU lower bound on makespan (a queue builds up, as in
the thesis replay).
"""

from __future__ import annotations

import csv
import hashlib
import math
import random
from collections.abc import Callable, Sequence
from pathlib import Path

from slurm_colloc.bench.profiles import SHARED_DATA, LucidProfile
from slurm_colloc.bench.trace import SIZE_CLASSES, Trace, TraceJob
from slurm_colloc.gpu.sim.activity import sm_activity_from_util

GIB = 1024
CLASS_MIB = {"light": (0, 6 * GIB), "medium": (6 * GIB, 16 * GIB), "heavy": (16 * GIB, 30 * GIB)}
"""True peak ranges of the size classes (CIFAR CNNs / ImageNet CNNs / transformers)."""
CLASS_WORK_S = {"light": (15 * 60, 5 * 60, 45 * 60), "medium": (45 * 60, 15 * 60, 120 * 60),
                "heavy": (100 * 60, 40 * 60, 200 * 60)}
"""Solo run time per class: (median, min, max) seconds of a log-normal (sigma 0.5)."""
GUESS_SIGMA = 0.3
GUESS_MEDIAN = 1.1
"""A user's guess of their job's memory: true peak x lognormal(median 1.1, sigma 0.3),
rounded up to whole GiB (about one user in three guesses too little)."""


HELD_OUT_SHARE = 0.30
REPLAY_USERS = ("colloc-r1", "colloc-r2", "colloc-r3", "colloc-r4")
"""Unix users of the held-out traces (created by the replayer when missing)."""


def held_out(model: str) -> bool:
    """True for models outside the estimator's calibration split.

    The same deterministic split as ``benchmarks/estimator_accuracy.py`` (``held_out``:
    sha256 of the model name, 30 % held out, never fitted; ``slurm_colloc/estimators/data/
    calibration.json`` ``fitted_on.split``).
    """
    h = int(hashlib.sha256(model.encode()).hexdigest()[:8], 16)
    return (h % 1000) < HELD_OUT_SHARE * 1000


def size_class(peak_mib: int) -> str:
    """The class whose memory range holds ``peak_mib``."""
    for c in SIZE_CLASSES:
        lo, hi = CLASS_MIB[c]
        if lo <= peak_mib < hi:
            return c
    return "heavy"


def user_guess(rng: random.Random, peak_mib: int, gpu_mib: int) -> int:
    """What a user without a tool asks for."""
    g = peak_mib * GUESS_MEDIAN * math.exp(rng.gauss(0.0, GUESS_SIGMA))
    return int(min(gpu_mib, max(GIB, math.ceil(g / GIB) * GIB)))


def _work(rng: random.Random, cls: str) -> float:
    median, lo, hi = CLASS_WORK_S[cls]
    return float(round(min(hi, max(lo, median * math.exp(rng.gauss(0.0, 0.5))))))


def _smact(util_pct: float) -> float:
    """The SM activity the simulation runs a job measured at ``util_pct`` utilisation at.

    Lucid measured nvidia-smi utilisation, not SM activity; the interference and power
    models need the latter (issue 24), so it is mapped through GPUMemNet's A100 curve
    (the trace keeps the measurement as ``util_pct``).
    """
    return round(max(0.1, sm_activity_from_util(util_pct)), 1)


def philly_arrivals(rng: random.Random, n: int, span_s: float) -> list[float]:
    """``n`` bursty arrival times in [0, span_s]: Poisson gaps, 30 % of jobs in bursts."""
    t, out = 0.0, []
    for i in range(n):
        if i and rng.random() < 0.3:
            t += rng.uniform(0.0, 60.0)  # same user submitting a sweep
        elif i:
            t += rng.expovariate(1.0)
        out.append(t)
    scale = span_s / out[-1] if out[-1] > 0 else 0.0
    return [round(x * scale, 1) for x in out]


class ProfilePools:
    """Candidate (model, batch) profiles per size class, with and without summaries."""

    def __init__(
        self, lucid: Sequence[LucidProfile], timm_peaks: dict[tuple[str, int], int],
        summaries: dict[str, str], *, held_out_only: bool = False,
    ) -> None:
        """Index the measured profiles by class (``held_out_only``: timm models outside
        the estimator's calibration split only)."""
        self.timm: dict[str, list[tuple[str, int, int]]] = {c: [] for c in SIZE_CLASSES}
        for (model, batch), peak in sorted(timm_peaks.items()):
            if held_out_only and not held_out(model):
                continue
            if model in summaries and batch >= 8:
                self.timm[size_class(peak)].append((model, batch, peak))
        self.lucid: dict[str, list[LucidProfile]] = {c: [] for c in SIZE_CLASSES}
        for p in lucid:
            self.lucid[size_class(p.gmem_mib)].append(p)
        self.util: dict[str, list[float]] = {
            c: [p.gpu_util for p in self.lucid[c]] or [p.gpu_util for p in lucid]
            for c in SIZE_CLASSES
        }
        # light jobs are CIFAR-scale CNNs: their utilisation is that of Lucid's CIFAR rows
        cifar = [p.gpu_util for p in lucid if p.dataset == "CIFAR-10"]
        if cifar:
            self.util["light"] = cifar
        for c in SIZE_CLASSES:
            if not self.timm[c] and not self.lucid[c]:
                raise ValueError(f"no measured profile of class {c}")

    def job(
        self, rng: random.Random, name: str, arrival: float, cls: str, gpu_mib: int,
        p_summary: float,
    ) -> TraceJob:
        """Draw one job of class ``cls``."""
        use_timm = self.timm[cls] and (not self.lucid[cls] or rng.random() < p_summary)
        if use_timm:
            model, batch, peak = rng.choice(self.timm[cls])
            summary, source = model, f"timm_a100_calibration:{model}@{batch}"
        else:
            p = rng.choice(self.lucid[cls])
            model, batch, peak = f"{p.model}-{p.dataset}", p.batch_size, p.gmem_mib
            summary, source = "", f"lucid_single_jobs:{p.model},{p.dataset},{p.batch_size}"
        return TraceJob(
            name=name, arrival_s=arrival, size_class=cls, model=model, batch_size=batch,
            peak_mib=peak, steady_mib=max(1, round(peak * rng.uniform(0.85, 0.95))),
            peak_at=round(rng.uniform(0.02, 0.3), 3),
            sm_pct=_smact(u := rng.choice(self.util[cls])), work_s=_work(rng, cls),
            guess_mib=user_guess(rng, peak, gpu_mib), summary=summary, source=source,
            util_pct=round(u, 1),
        )


def _mix_trace(
    pools: ProfilePools, *, name: str, description: str, n: int,
    mix: tuple[float, float, float], gpus: int, gpu_mib: int, arrival_frac: float,
    p_summary: float, seed: int, users: Sequence[str] = (), multi_gpu: int = 0,
) -> Trace:
    rng = random.Random(seed)  # noqa: S311 - reproducible traces, not crypto
    counts = [round(n * f) for f in mix]
    counts[0] += n - sum(counts)
    classes = [c for c, k in zip(SIZE_CLASSES, counts, strict=True) for _ in range(k)]
    rng.shuffle(classes)
    draft = [pools.job(rng, f"{name}-{i:03d}", 0.0, c, gpu_mib, p_summary)
             for i, c in enumerate(classes)]
    if users:
        draft = [TraceJob(**{**j.__dict__, "user": rng.choice(list(users))}) for j in draft]
    if multi_gpu:  # data-parallel medium/heavy jobs on 2 GPUs (one rank per GPU)
        big = [i for i, j in enumerate(draft) if j.size_class != "light"]
        for i in rng.sample(big, min(multi_gpu, len(big))):
            draft[i] = TraceJob(**{**draft[i].__dict__, "gpus": 2})
    span = arrival_frac * sum(j.work_s * j.gpus for j in draft) / gpus
    arrivals = philly_arrivals(rng, n, span)
    jobs = tuple(
        TraceJob(**{**j.__dict__, "arrival_s": a}) for j, a in zip(draft, arrivals, strict=True)
    )
    return Trace(name, description, gpus, gpu_mib, jobs)


def philly90(pools: ProfilePools, seed: int = 1) -> Trace:
    """Trace (a): 90 jobs, 65/27/8 light/medium/heavy, 4 x 40 GiB."""
    return _mix_trace(
        pools, name="philly90", n=90, mix=(0.65, 0.27, 0.08), gpus=4, gpu_mib=40 * GIB,
        arrival_frac=0.4, p_summary=0.85, seed=seed,
        description="90 jobs, 65/27/8 light/medium/heavy, Philly-like bursty arrivals, "
        "1 node x 4 GPUs x 40 GiB",
    )


def heavy60(pools: ProfilePools, seed: int = 2) -> Trace:
    """Trace (b): 60 jobs, mostly medium and heavy."""
    return _mix_trace(
        pools, name="heavy60", n=60, mix=(0.2, 0.45, 0.35), gpus=4, gpu_mib=40 * GIB,
        arrival_frac=0.4, p_summary=0.85, seed=seed,
        description="60 jobs, 20/45/35 light/medium/heavy, Philly-like bursty arrivals, "
        "1 node x 4 GPUs x 40 GiB",
    )


def alibaba(
    pools: ProfilePools, *, n: int = 300, gpus: int = 8, seed: int = 3,
    path: Path | None = None, max_work_s: float = 3600.0, arrival_frac: float = 0.5,
) -> Trace:
    """Trace (c): ``n`` consecutive finished single-GPU pods of the Alibaba 2023 trace.

    Request = ``gpu_milli`` of a 40 GiB GPU (the user's share). The trace has no
    memory use, so the true peak is drawn around the request: 0.6-1.0x for 90 % of
    pods, 1.0-1.3x for 10 % (under-requests). Durations are the pods' lifetimes,
    capped at ``max_work_s``; arrival gaps are compressed so the pods arrive over
    ``arrival_frac`` of the whole-GPU lower bound on makespan (the original slice is
    so sparse that any policy keeps up).
    """
    rng = random.Random(seed)  # noqa: S311 - reproducible traces, not crypto
    path = path or SHARED_DATA / "traces" / "alibaba2023_openb_pods.csv"
    rows = []
    with path.open() as f:
        for r in csv.DictReader(f):
            if r["num_gpu"] != "1" or r["pod_phase"] not in ("Succeeded", "Failed"):
                continue
            dur = int(r["deletion_time"]) - int(r["creation_time"])
            if dur < 60:
                continue
            rows.append((int(r["creation_time"]), dur, int(r["gpu_milli"]), r["name"]))
    rows.sort()
    start = len(rows) // 3
    rows = rows[start:start + n]
    gpu_mib = 40 * GIB
    draft = []
    for i, (created, dur, milli, pod) in enumerate(rows):
        request = max(GIB, math.ceil(milli / 1000 * gpu_mib / GIB) * GIB)
        ratio = rng.uniform(1.0, 1.3) if rng.random() < 0.1 else rng.uniform(0.6, 1.0)
        peak = min(gpu_mib - GIB, max(512, round(request * ratio)))
        cls = size_class(peak)
        draft.append((created, TraceJob(
            name=f"alibaba-{i:03d}", arrival_s=0.0, size_class=cls, model=pod,
            batch_size=1, peak_mib=peak, steady_mib=max(1, round(peak * rng.uniform(0.85, 0.95))),
            peak_at=round(rng.uniform(0.02, 0.3), 3),
            sm_pct=_smact(u := rng.choice(pools.util[cls])), util_pct=round(u, 1),
            work_s=float(min(max_work_s, dur)), guess_mib=request, summary="",
            source=f"alibaba2023_openb_pods:{pod},gpu_milli={milli}",
        )))
    t0 = draft[0][0]
    raw = [c - t0 for c, _ in draft]
    span = arrival_frac * sum(j.work_s for _, j in draft) / gpus
    k = span / raw[-1] if raw[-1] > 0 else 0.0
    jobs = tuple(TraceJob(**{**j.__dict__, "arrival_s": round(r * k, 1)})
                 for r, (_, j) in zip(raw, draft, strict=True))
    return Trace(
        "alibaba", f"{len(jobs)} finished single-GPU pods of Alibaba openb 2023 (gpu_milli "
        f"requests), arrivals compressed x{1 / k if k else 0:.0f}, 1 node x {gpus} GPUs x 40 GiB",
        gpus, gpu_mib, jobs,
    )


def philly90h(pools: ProfilePools, seed: int = 11) -> Trace:
    """philly90's mix, fair (issue 14): held-out models only, 4 users, 3 two-GPU jobs.

    ``pools`` must be built with ``held_out_only=True`` (:func:`pools_for`).
    """
    return _mix_trace(
        pools, name="philly90h", n=90, mix=(0.65, 0.27, 0.08), gpus=4, gpu_mib=40 * GIB,
        arrival_frac=0.4, p_summary=0.85, seed=seed, users=REPLAY_USERS, multi_gpu=3,
        description="90 jobs, 65/27/8 light/medium/heavy, summary jobs only of models "
        "outside the estimator's calibration split, 4 users, 3 two-GPU jobs, Philly-like "
        "bursty arrivals, 1 node x 4 GPUs x 40 GiB",
    )


def heavy60h(pools: ProfilePools, seed: int = 12) -> Trace:
    """heavy60's mix, fair (issue 14): held-out models only, 4 users, 3 two-GPU jobs."""
    return _mix_trace(
        pools, name="heavy60h", n=60, mix=(0.2, 0.45, 0.35), gpus=4, gpu_mib=40 * GIB,
        arrival_frac=0.4, p_summary=0.85, seed=seed, users=REPLAY_USERS, multi_gpu=3,
        description="60 jobs, 20/45/35 light/medium/heavy, summary jobs only of models "
        "outside the estimator's calibration split, 4 users, 3 two-GPU jobs, Philly-like "
        "bursty arrivals, 1 node x 4 GPUs x 40 GiB",
    )


GENERATORS: dict[str, Callable[..., Trace]] = {
    "philly90": philly90, "heavy60": heavy60, "alibaba": alibaba,
    "philly90h": philly90h, "heavy60h": heavy60h,
}

HELD_OUT_TRACES = {"philly90h", "heavy60h"}
"""Traces whose pools hold only models outside the estimator's calibration split."""
