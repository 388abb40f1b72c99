"""Optional tracing estimator: run the model under FakeTensorMode with PyTorch's
``MemTracker`` (torch >= 2.5) for one training step on fake CPU tensors.

Imported only when asked for (``--estimator tracing --model-factory mod:func``), never
on the default path: importing torch alone takes longer than the whole CLI budget.
MemTracker counts tensors, not the CUDA context, the allocator's caching or cuDNN
workspaces, so its peak goes through its own calibration (``tracing`` in
``calibration.json``: context + k x traced tensors, and a split-conformal margin on the
traced part), fitted on the FakeTensor figures of the timm A100 runs by
``benchmarks/estimator_accuracy.py --calibrate``.
Fake CUDA tensors fail in backward on a GPU-less login node, so CPU fakes are used.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

from slurm_colloc.estimators.base import Estimate, Job
from slurm_colloc.estimators.errors import EstimatorInputError
from slurm_colloc.estimators.layer_aware import load_calibration
from slurm_colloc.estimators.model import ModelSummary
from slurm_colloc.estimators.physics import MIB


def _load_factory(spec: str) -> Any:
    if ":" not in spec:
        raise EstimatorInputError(f"model factory {spec!r} must be 'module:function'")
    mod, attr = spec.split(":", 1)
    try:
        return getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise EstimatorInputError(f"cannot load model factory {spec!r}: {e}") from None


TOTAL_KEY = "Total"
"""MemTracker's snapshot holds a running total next to the per-category figures."""


def traced_peak_bytes(snapshot: dict[Any, dict[str, int]]) -> int:
    """Peak bytes of the busiest device in a MemTracker ``"peak"`` snapshot.

    Each device's dict holds one figure per category (parameters, gradients,
    activations, ...) *and* their total: summing every value would count the peak twice.
    """
    best = 0
    for cats in snapshot.values():
        total = cats.get(TOTAL_KEY)
        if total is None:
            total = sum(v for k, v in cats.items() if k != TOTAL_KEY)
        best = max(best, int(total))
    return best


def _build_fake(make: Any, mode: Any, torch: Any) -> tuple[Any, Any]:
    """The factory's model and example input as fake tensors of ``mode``.

    Built inside the fake mode first (no real memory). Constructors that read tensor
    values (timm's ``[x.item() for x in torch.linspace(...)]`` drop-path schedules,
    ``torch.unique`` in RegNet's width rounding) cannot run on fake tensors; those
    are built for real on the CPU (weights only) and their parameters and buffers
    swapped for fakes.
    """
    try:
        with mode:
            built: tuple[Any, Any] = make()
            return built
    except Exception as e:  # a constructor failure of any kind: maybe data-dependent
        if not any(k in type(e).__name__ for k in ("DataDependent", "DynamicOutputShape")):
            raise EstimatorInputError(f"building the model failed: {e}") from e
    try:
        model, example = make()
    except Exception as e:  # the user's factory: any failure is bad input, not a crash
        raise EstimatorInputError(f"building the model failed: {e}") from e
    fake_state(model, mode, torch)
    return model, mode.from_tensor(example)


def fake_state(model: Any, mode: Any, torch: Any) -> None:
    """Swap ``model``'s parameters and buffers for fake tensors of ``mode``, in place.

    Tied weights (one Parameter in two modules) stay tied: each real Parameter gets
    one fake, shared wherever it was shared.
    """
    fakes: dict[int, Any] = {}
    with torch.no_grad():
        for mod in model.modules():
            for name, p in list(mod.named_parameters(recurse=False)):
                if id(p) not in fakes:
                    fakes[id(p)] = torch.nn.Parameter(mode.from_tensor(p),
                                                      requires_grad=p.requires_grad)
                setattr(mod, name, fakes[id(p)])
            for name, b in list(mod.named_buffers(recurse=False)):
                if b is not None:
                    mod._buffers[name] = mode.from_tensor(b)


class TracingEstimator:
    """MemTracker under FakeTensorMode; needs torch and a ``module:factory``.

    The factory is called as ``factory()`` and must return ``(model, example_input)``
    where ``example_input`` is a tensor for batch 1 (the batch is expanded here).
    """

    name = "tracing"

    def __init__(self, factory: str | None = None):
        self.factory = factory

    def estimate(self, summary: ModelSummary, job: Job) -> Estimate:
        """Trace one step (forward, backward, optimizer step) and read the peak."""
        if not self.factory:
            raise EstimatorInputError("the tracing estimator needs --model-factory module:func")
        try:
            import torch
            from torch._subclasses.fake_tensor import FakeTensorMode
            from torch.distributed._tools.mem_tracker import MemTracker
        except ImportError as e:
            raise EstimatorInputError(f"the tracing estimator needs torch >= 2.5: {e}") from None
        make = _load_factory(self.factory)
        mode = FakeTensorMode()
        model, example = _build_fake(make, mode, torch)
        with mode:
            x = example.expand(job.batch_size, *example.shape[1:]).contiguous()
            opt_cls = {"sgd": torch.optim.SGD, "momentum": torch.optim.SGD,
                       "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[job.optimizer]
            kw = {"lr": 0.01, "momentum": 0.9} if job.optimizer == "momentum" else {"lr": 0.01}
            opt = opt_cls(model.parameters(), **kw)
            mt = MemTracker()
            mt.track_external(model, opt)
            try:
                with mt:
                    for step in range(2):  # the second step has optimizer state allocated
                        out = model(x)
                        out.float().sum().backward()
                        opt.step()
                        opt.zero_grad()
                        if step == 0:
                            mt.reset_mod_stats()
            except Exception as e:  # fake-mode errors (DataDependentOutputException...) vary
                raise EstimatorInputError(f"tracing {self.factory} failed: {e}") from e
            peak = mt.get_tracker_snapshot("peak")
        traced = traced_peak_bytes(peak) / MIB
        t = load_calibration().tracing
        ctx, k, rel = t["context_mib"], t["k"], t["margin_rel"]
        margin = k * traced * rel
        return Estimate(
            estimate_mib=math.ceil(ctx + k * traced + margin),
            estimator=self.name,
            breakdown={"cuda_context": ctx, "traced_tensors": traced,
                       "allocator_and_workspace": (k - 1) * traced, "margin": margin},
            margin_mib=math.ceil(margin),
            fingerprint=summary.fingerprint(),
            uncertainty={"basis": "context + k x traced tensors, margin from the calibration "
                                  "split of the timm A100 runs (FakeTensor figures)",
                         "notes": ["MemTracker counts tensors only; allocator caching and "
                                   "cuDNN workspaces come from the calibration"]},
        )
