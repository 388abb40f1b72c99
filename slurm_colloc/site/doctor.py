"""``colloc admin doctor``: check a site's submit-path configuration, say what is wrong.

Each check returns a :class:`Finding`; the CLI prints them. Checks read files and
ask the running controller (through the Slurm adapter); they never change anything.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from slurm_colloc.config import CollocConfig
from slurm_colloc.site.install import MARKER, PLUGIN_NAME
from slurm_colloc.slurm.adapter import SlurmAdapter, SlurmCli, SlurmError

Level = Literal["ok", "warn", "fail"]


@dataclass(frozen=True)
class Finding:
    """One check's verdict."""

    level: Level
    what: str
    detail: str = ""


def read_conf(path: Path) -> dict[str, str]:
    """Key=Value lines of a Slurm config file (keys lowercased, last wins)."""
    out: dict[str, str] = {}
    for raw in path.read_text(errors="replace").splitlines():
        line = raw.split("#", 1)[0].strip()
        if "=" in line and not line.lower().startswith(("nodename", "partitionname")):
            k, _, v = line.partition("=")
            out[k.strip().lower()] = v.strip()
    return out


def _plugstack_plugins(path: Path, depth: int = 0) -> list[str]:
    plugins: list[str] = []
    if depth > 3 or not path.exists():
        return plugins
    for raw in path.read_text(errors="replace").splitlines():
        words = shlex.split(raw.split("#", 1)[0])
        if len(words) >= 2 and words[0] == "include":
            for inc in sorted(Path(words[1]).parent.glob(Path(words[1]).name)):
                plugins += _plugstack_plugins(inc, depth + 1)
        elif len(words) >= 2 and words[0] in ("required", "optional"):
            plugins.append(words[1])
    return plugins


def _lua_number(text: str, key: str) -> int | None:
    m = re.search(rf"^\s*{key} = (\d+),", text, re.M)
    return int(m.group(1)) if m else None


def check_files(slurm_conf: Path, cfg: CollocConfig) -> list[Finding]:
    """Static checks of slurm.conf, plugstack, the Lua filters and gres.conf."""
    f: list[Finding] = []
    if not slurm_conf.exists():
        return [Finding("fail", f"{slurm_conf} not found", "set SLURM_CONF or --slurm-conf")]
    conf = read_conf(slurm_conf)
    d = slurm_conf.parent

    def need(key: str, pred: bool, fix: str) -> None:
        f.append(Finding("ok", f"slurm.conf {key}") if pred else Finding(
            "fail", f"slurm.conf {key}", fix))

    need("SelectType", conf.get("selecttype") == "select/cons_tres",
         "SelectType=select/cons_tres (gres/shard needs it)")
    need("GresTypes", "shard" in conf.get("grestypes", "").split(","),
         "GresTypes=gpu,shard")
    need("CliFilterPlugins", "lua" in conf.get("clifilterplugins", "").split(","),
         "CliFilterPlugins=lua")
    need("JobSubmitPlugins", "lua" in conf.get("jobsubmitplugins", "").split(","),
         "JobSubmitPlugins=lua")
    plugstack = Path(conf.get("plugstackconfig", str(d / "plugstack.conf")))
    plugins = _plugstack_plugins(plugstack)
    ours = [p for p in plugins if p.endswith(PLUGIN_NAME)]
    if not ours:
        f.append(Finding("fail", "SPANK plugin", f"{plugstack} loads no {PLUGIN_NAME}; "
                         "run `colloc admin install` and set PlugStackConfig"))
    elif not Path(ours[0]).exists():
        f.append(Finding("fail", "SPANK plugin", f"{ours[0]} does not exist; rerun install"))
    else:
        f.append(Finding("ok", "SPANK plugin", ours[0]))
    js, cf = d / "job_submit.lua", d / "cli_filter.lua"
    for lua in (js, cf):
        if not lua.exists():
            f.append(Finding("fail", lua.name, f"{lua} missing; run `colloc admin install`"))
        elif MARKER not in lua.read_text(errors="replace")[:400]:
            f.append(Finding("fail", lua.name, f"{lua} is not slurm-colloc's"))
        else:
            f.append(Finding("ok", lua.name, str(lua)))
    if js.exists():
        text = js.read_text(errors="replace")
        shard = _lua_number(text, "shard_mib")
        if shard != cfg.shard_mib:
            f.append(Finding("fail", "shard size", f"job_submit.lua has shard_mib={shard}, "
                             f"colloc.conf {cfg.shard_mib}; rerun `colloc admin install`"))
    if cf.exists():
        m = re.search(r'^\s*estimator = "([^"]*)"', cf.read_text(errors="replace"), re.M)
        if m and not Path(m.group(1)).exists():
            f.append(Finding("fail", "estimator", f"cli_filter.lua runs {m.group(1)}, "
                             "which does not exist on this host"))
    gres = d / "gres.conf"
    if gres.exists():
        shard_lines = [ln for ln in gres.read_text().splitlines()
                       if re.search(r"Name=shard", ln) and not ln.lstrip().startswith("#")]
        if not shard_lines:
            f.append(Finding("fail", "gres.conf", "no Name=shard lines; "
                             "see `colloc admin gres-conf`"))
        elif any("File=" not in ln for ln in shard_lines):
            f.append(Finding("warn", "gres.conf", "shard lines without File=: Slurm cannot keep "
                             "a job's shards on one GPU; use one line per GPU"))
        else:
            f.append(Finding("ok", "gres.conf", f"{len(shard_lines)} per-GPU shard lines"))
    else:
        f.append(Finding("warn", "gres.conf", f"{gres} not found (configless or per-node?)"))
    return f


def check_live(adapter: SlurmAdapter | None = None) -> list[Finding]:
    """Ask the running controller what it actually loaded."""
    slurm = adapter if isinstance(adapter, SlurmCli) else SlurmCli()
    f: list[Finding] = []
    try:
        cp = slurm.run("scontrol", "show", "config")
    except SlurmError as e:
        return [Finding("fail", "slurmctld", f"cannot ask the controller: {e}")]
    live = {}
    for line in cp.stdout.splitlines():
        k, eq, v = line.partition("=")
        if eq:
            live[k.strip().lower()] = v.strip()
    for key in ("jobsubmitplugins", "clifilterplugins"):
        val = live.get(key, "")
        f.append(Finding("ok" if "lua" in val else "fail", f"running {key}",
                         val or "(null): run `scontrol reconfigure` or restart slurmctld"))
    help_cp = slurm.run("sbatch", "--help", check=False)
    f.append(Finding("ok", "sbatch --colloc") if "--colloc" in help_cp.stdout else Finding(
        "fail", "sbatch --colloc", "sbatch does not know --colloc: PlugStackConfig/plugin"))
    try:
        nodes = slurm.nodes()
    except SlurmError as e:
        return [*f, Finding("fail", "nodes", str(e))]
    with_shards = [n.get("NodeName", "?") for n in nodes if "shard" in n.get("Gres", "")]
    f.append(Finding("ok" if with_shards else "fail", "nodes with gres/shard",
                     ", ".join(with_shards) or "no node offers gres/shard (node Gres=...)"))
    return f


def check_gpus(cfg: CollocConfig) -> list[Finding]:
    """On a GPU node: the backend works and every GPU is in a compute mode MPS can share.

    One MPS server per (GPU, user) (docs/node.md) needs compute mode DEFAULT; a GPU in
    EXCLUSIVE_PROCESS mode admits one context, so a second user's job would fail.
    """
    from slurm_colloc.gpu.backend import GpuBackendError
    from slurm_colloc.gpu.nvml import NvmlBackend
    from slurm_colloc.gpu.select import backend_from_config

    try:
        backend = backend_from_config(cfg)
    except GpuBackendError as e:
        return [Finding("fail", f"gpu backend {cfg.gpu_backend}", str(e))]
    try:
        gpus = backend.gpus()
        f = [Finding("ok", f"gpu backend {cfg.gpu_backend}", f"{len(gpus)} GPU(s)")]
        if isinstance(backend, NvmlBackend):
            bad = {i: m for i, m in backend.compute_modes().items() if m != "DEFAULT"}
            f.append(Finding("fail", "GPU compute mode",
                             f"GPUs {bad} must be DEFAULT: nvidia-smi -i N -c DEFAULT")
                     if bad else Finding("ok", "GPU compute mode", "DEFAULT on all GPUs"))
        return f
    except GpuBackendError as e:
        return [Finding("fail", f"gpu backend {cfg.gpu_backend}", str(e))]
    finally:
        backend.close()
