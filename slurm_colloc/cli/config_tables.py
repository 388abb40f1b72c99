"""``colloc config``'s view of the per-GPU-model and per-node tables.

``colloc config`` prints, under the file's values, what each combination of a
``[nodes."..."]`` table and a ``[gpu_types."..."]`` table runs with (node over GPU
model over global); ``--check`` also sizes each combination whose GPU memory is known
(``gpu_memory_mib``, global or per node), so a table that leaves no room for one
shard fails at the admin's desk and not in a prolog.
"""

from __future__ import annotations

from slurm_colloc.config import OVERRIDABLE, CollocConfig
from slurm_colloc.gpu.budget import BudgetError, budget
from slurm_colloc.gpu_settings import combinations, effective, effective_for_tables, sources


def _label(node_key: str | None, model_key: str | None) -> str:
    node = f'nodes."{node_key}"' if node_key is not None else "any other node"
    model = f'gpu_types."{model_key}"' if model_key is not None else "any other GPU model"
    return f"{node}, {model}"


def effective_lines(cfg: CollocConfig) -> list[str]:
    """TOML comments: the effective overhead keys of every table combination (none when
    colloc.conf has no tables)."""
    if not cfg.gpu_types and not cfg.nodes:
        return []
    out = ["", "# effective per node and GPU model (node table > gpu_types table > global):"]
    for node_key, model_key in combinations(cfg):
        eff = effective_for_tables(cfg, node_key, model_key)
        values = ", ".join(f"{k} = {getattr(eff, k)}" for k in OVERRIDABLE)
        out.append(f"#   {_label(node_key, model_key)}: {values}")
    return out


def budget_problems(cfg: CollocConfig) -> list[str]:
    """Combinations whose GPU (of known memory) cannot hold one shard and a context."""
    problems = []
    for node_key, model_key in combinations(cfg):
        eff = effective_for_tables(cfg, node_key, model_key)
        if eff.gpu_memory_mib <= 0:
            continue  # the GPU's size comes from the backend on the node
        try:
            budget(eff, eff.gpu_memory_mib).check()
        except BudgetError as e:
            problems.append(f"{_label(node_key, model_key)}: {e}")
    return problems


def for_gpu_lines(cfg: CollocConfig, node: str | None, model: str | None) -> list[str]:
    """``key = value  # source``: what a GPU of ``model`` on ``node`` runs with."""
    eff, src = effective(cfg, node=node, model=model), sources(cfg, node=node, model=model)
    return [f"{k} = {getattr(eff, k)}  # {src[k]}" for k in OVERRIDABLE]


def submit_warnings(cfg: CollocConfig) -> list[str]:
    """Tables whose GPUs may offer fewer shards than job_submit.lua's whole GPU.

    job_submit.lua (slurmctld) sizes a whole GPU with the global keys; a table that
    sets a larger MPS server or driver reserve leaves its GPUs fewer shards, and a
    whole-GPU job sized by the global keys then never fits on them. (A global
    ``gpu_reserved_mib = 0`` means the backend's figure, which slurmctld cannot
    compare.)
    """
    out = []
    for kind in ("gpu_types", "nodes"):
        for name, o in getattr(cfg, kind).items():
            for key in ("mps_server_mib", "gpu_reserved_mib"):
                mine, glob = o.values().get(key), getattr(cfg, key)
                if mine is not None and mine > glob and (glob or key == "mps_server_mib"):
                    out.append(f'[{kind}."{name}"] {key} = {mine} is above the global {glob}, '
                               "which job_submit.lua sizes whole GPUs with: those GPUs may "
                               "offer fewer shards than a whole-GPU job asks for; raise the "
                               f"global {key}")
    return out
