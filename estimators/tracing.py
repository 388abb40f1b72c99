"""Optional tracing estimator: run the model under FakeTensorMode with PyTorch's
``MemTracker`` (torch >= 2.5) for one training step on fake CPU tensors.

Imported only when asked for (``--estimator tracing --model-factory mod:func``), never
on the default path: importing torch alone takes longer than the whole CLI budget.
MemTracker counts tensors, not the CUDA context or the allocator's caching, so the
calibrated context of the layer-aware estimator is added and the breakdown says so.
Fake CUDA tensors fail in backward on a GPU-less login node, so CPU fakes are used.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

from estimators.base import Estimate, Job
from estimators.errors import EstimatorInputError
from estimators.layer_aware import load_calibration
from estimators.model import ModelSummary
from estimators.physics import MIB


def _load_factory(spec: str) -> Any:
    if ":" not in spec:
        raise EstimatorInputError(f"model factory {spec!r} must be 'module:function'")
    mod, attr = spec.split(":", 1)
    try:
        return getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise EstimatorInputError(f"cannot load model factory {spec!r}: {e}") from None


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
        with FakeTensorMode():
            model, example = make()
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
            except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
                raise EstimatorInputError(f"tracing {self.factory} failed: {e}") from e
            peak = mt.get_tracker_snapshot("peak")
        traced = max((sum(v.values()) for v in peak.values()), default=0) / MIB
        ctx = load_calibration().context_mib
        return Estimate(
            estimate_mib=math.ceil(ctx + traced),
            estimator=self.name,
            breakdown={"cuda_context": ctx, "traced_tensors": traced},
            margin_mib=0,
            fingerprint=summary.fingerprint(),
            uncertainty={"notes": ["MemTracker misses allocator caching and cuDNN "
                                   "workspaces; measured A100 peaks were 1.2-2x its figure"]},
        )
