"""Estimator registry: names to factories, so that configuration names an estimator and
a misspelt name is an error, not a silent fallback. Factories import their module
only when called (the tracing estimator must never be imported on the default path).
"""

from __future__ import annotations

from collections.abc import Callable

from slurm_colloc.estimators.base import Estimator
from slurm_colloc.estimators.errors import EstimatorInputError


def _layer_aware(**_: object) -> Estimator:
    from slurm_colloc.estimators.layer_aware import LayerAwareEstimator

    return LayerAwareEstimator()


def _horus(**_: object) -> Estimator:
    from slurm_colloc.estimators.horus import HorusEstimator

    return HorusEstimator()


def _tracing(model_factory: str | None = None, **_: object) -> Estimator:
    from slurm_colloc.estimators.tracing import TracingEstimator

    return TracingEstimator(model_factory)


REGISTRY: dict[str, Callable[..., Estimator]] = {
    "layer-aware": _layer_aware,
    "horus": _horus,
    "tracing": _tracing,
}
DEFAULT = "layer-aware"


def names() -> list[str]:
    """Registered estimator names."""
    return sorted(REGISTRY)


def get(name: str, *, model_factory: str | None = None) -> Estimator:
    """Instantiate the named estimator."""
    try:
        factory = REGISTRY[name]
    except KeyError:
        raise EstimatorInputError(
            f"unknown estimator {name!r}; known: {', '.join(names())}") from None
    return factory(model_factory=model_factory)
