"""The GPU overhead settings in effect for one GPU of one node.

``cuda_context_mib``, ``mps_server_mib``, ``gpu_reserved_mib`` and ``gpu_memory_mib``
differ between GPU models (a context on an H100 is not one on a V100), so colloc.conf
may override them per GPU model (``[gpu_types."MODEL"]``) and per node
(``[nodes."HOSTLIST"]``). This module is the one place the precedence lives, per key:

    node table  >  GPU model table  >  global key

Every reader that acts for a particular GPU (the prolog's pinned limit, gres.conf's
shard counts, the epilog, doctor, selftest) resolves through :func:`effective`, usually
via :func:`slurm_colloc.gpu.budget.budget_of`. The result is an ordinary
:class:`~slurm_colloc.config.CollocConfig`, so code below it needs no change.
"""

from __future__ import annotations

import dataclasses
import os
import socket

from slurm_colloc.config import OVERRIDABLE, CollocConfig, GpuOverride, gpu_model_key
from slurm_colloc.hostlist import contains


def local_node() -> str:
    """This node's Slurm name: ``SLURMD_NODENAME`` (set for prolog and epilog), else the
    short host name (doctor, selftest, ``colloc admin gres-conf`` run by an admin)."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def node_table(cfg: CollocConfig, node: str | None) -> tuple[str, GpuOverride] | None:
    """The ``[nodes."..."]`` table naming ``node`` (the loader allows at most one)."""
    if not node:
        return None
    return next(((k, o) for k, o in cfg.nodes.items() if contains(k, node)), None)


def type_table(cfg: CollocConfig, model: str | None) -> tuple[str, GpuOverride] | None:
    """The ``[gpu_types."..."]`` table of GPU model ``model`` (case and spacing aside)."""
    if not model:
        return None
    want = gpu_model_key(model)
    return next(((k, o) for k, o in cfg.gpu_types.items() if gpu_model_key(k) == want), None)


def sources(cfg: CollocConfig, *, node: str | None, model: str | None) -> dict[str, str]:
    """Where each overridable key's effective value comes from: ``global``,
    ``gpu_types."MODEL"`` or ``nodes."HOSTLIST"``."""
    out = dict.fromkeys(OVERRIDABLE, "global")
    for kind, hit in (("gpu_types", type_table(cfg, model)), ("nodes", node_table(cfg, node))):
        if hit is not None:
            out.update(dict.fromkeys(hit[1].values(), f'{kind}."{hit[0]}"'))
    return out


def effective(cfg: CollocConfig, *, node: str | None, model: str | None) -> CollocConfig:
    """``cfg`` with the overrides of ``model``'s and ``node``'s tables applied.

    ``node`` None or empty: no node table applies; ``model`` likewise. Applying it
    twice gives the same result, so a caller may pass an already resolved config.
    """
    values: dict[str, int] = {}
    for hit in (type_table(cfg, model), node_table(cfg, node)):  # later wins
        if hit is not None:
            values.update(hit[1].values())
    return dataclasses.replace(cfg, **values) if values else cfg  # type: ignore[arg-type]


def describe(cfg: CollocConfig, *, node: str | None, model: str | None) -> str:
    """``key = value (source)`` for each overridable key, as doctor and ``colloc config``
    show it: what a GPU of ``model`` on ``node`` runs with, and why."""
    eff, src = effective(cfg, node=node, model=model), sources(cfg, node=node, model=model)
    return ", ".join(f"{k} = {getattr(eff, k)} ({src[k]})" for k in OVERRIDABLE)


def combinations(cfg: CollocConfig) -> list[tuple[str | None, str | None]]:
    """Every (node table, GPU model table) pair colloc.conf can produce, None for "no
    table": what ``colloc config --check`` sizes and ``colloc config`` lists."""
    nodes: list[str | None] = [None, *cfg.nodes]
    models: list[str | None] = [None, *cfg.gpu_types]
    return [(n, m) for n in nodes for m in models]


def effective_for_tables(cfg: CollocConfig, node_key: str | None,
                         model_key: str | None) -> CollocConfig:
    """The settings of a node named by table ``node_key`` with a GPU of table
    ``model_key`` (names as written in colloc.conf; None: no such table)."""
    values: dict[str, int] = {}
    if model_key is not None:
        values.update(cfg.gpu_types[model_key].values())
    if node_key is not None:
        values.update(cfg.nodes[node_key].values())
    return dataclasses.replace(cfg, **values) if values else cfg  # type: ignore[arg-type]
