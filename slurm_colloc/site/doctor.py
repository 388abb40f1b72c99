"""``colloc admin doctor``: check a site's submit-path configuration, say what is wrong.

Each check returns a :class:`Finding`; the CLI prints them. Checks read files and
ask the running controller (through the Slurm adapter); they never change anything.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from slurm_colloc.config import CollocConfig
from slurm_colloc.site.install import MARKER, PLUGIN_NAME
from slurm_colloc.slurm.adapter import SlurmAdapter, SlurmCli, SlurmError

if TYPE_CHECKING:
    from slurm_colloc.gpu.identity import GpuMap

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


_GRES_FILE = re.compile(r"^(?P<pre>.*?)\[(?P<a>\d+)-(?P<b>\d+)\](?P<post>.*)$")


def expand_gres_files(value: str) -> list[str]:
    """``/dev/nvidia[0-3]`` -> four paths; ``a,b`` lists; one range per item."""
    out: list[str] = []
    for item in (v.strip() for v in value.split(",")):
        m = _GRES_FILE.match(item)
        if m and int(m["b"]) - int(m["a"]) < 1024:
            out += [f"{m['pre']}{i}{m['post']}" for i in range(int(m["a"]), int(m["b"]) + 1)]
        elif item:
            out.append(item)
    return out


def read_gres_conf(path: Path, node: str | None = None) -> tuple[list[str], dict[str, int]]:
    """(gpu device files in Slurm's index order, shard Count per device file).

    Only the simple per-GPU lines ``colloc admin gres-conf`` writes are understood
    (``[NodeName=X] Name=gpu|shard [Count=N] File=...``); lines of other nodes are
    skipped when ``node`` is given. Slurm numbers GPUs in device-file order (natural
    sort), so the files are sorted the same way.
    """
    gpu_files: list[str] = []
    shards: dict[str, int] = {}
    for raw in path.read_text(errors="replace").splitlines():
        words = dict(w.split("=", 1) for w in raw.split("#", 1)[0].split() if "=" in w)
        words = {k.lower(): v for k, v in words.items()}
        if node and "nodename" in words and words["nodename"] != node:
            continue
        files = expand_gres_files(words.get("file", ""))
        if words.get("name") == "gpu":
            gpu_files += files
        elif words.get("name") == "shard" and len(files) == 1:
            count = words.get("count", "0")
            shards[files[0]] = int(count) if count.isdigit() else 0

    def natural(p: str) -> tuple[str, int]:
        m = re.search(r"(\d+)$", p)
        return (p[: m.start()] if m else p, int(m.group(1)) if m else -1)

    return sorted(gpu_files, key=natural), shards


def check_gpus(cfg: CollocConfig, gres_conf: Path | None = None) -> list[Finding]:
    """On a GPU node: backend, compute mode, Slurm's GPU order, and shards vs memory.

    One MPS server per (GPU, user) (docs/node.md) needs compute mode DEFAULT; a GPU in
    EXCLUSIVE_PROCESS mode admits one context, so a second user's job would fail.
    Slurm numbers GPUs by device file; colloc maps that index to a UUID by minor number
    (:mod:`slurm_colloc.gpu.identity`), and gres.conf must declare no more shards per
    GPU than its memory budget allows (:mod:`slurm_colloc.gpu.budget`).
    """
    from slurm_colloc.gpu.backend import GpuBackendError
    from slurm_colloc.gpu.budget import BudgetError, budget_of
    from slurm_colloc.gpu.identity import GpuIdentityError, GpuMap
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
        try:
            gmap = GpuMap.from_gpus(gpus)
        except GpuIdentityError as e:
            return [*f, Finding("fail", "GPU order", str(e))]
        f.append(Finding("ok", "GPU order", "Slurm index -> UUID: " + ", ".join(
            f"{i}={g.uuid}" + (f" (/dev/nvidia{g.minor_number})" if g.minor_number is not None
                               else "") for i, g in enumerate(gmap.gpus))))
        for i, g in enumerate(gmap.gpus):
            b = budget_of(cfg, g)
            try:
                b.check()
            except BudgetError as e:
                f.append(Finding("fail", f"GPU {i} memory budget", str(e)))
        if gres_conf is not None and gres_conf.exists():
            f += _check_gres_against(gmap, cfg, gres_conf)
        return f
    except GpuBackendError as e:
        return [Finding("fail", f"gpu backend {cfg.gpu_backend}", str(e))]
    finally:
        backend.close()


def _check_gres_against(gmap: GpuMap, cfg: CollocConfig, gres_conf: Path) -> list[Finding]:
    """gres.conf's GPU files follow the minors; its shard counts fit each GPU's budget."""
    import socket

    from slurm_colloc.gpu.budget import budget_of
    from slurm_colloc.gpu.identity import check_gres_files

    files, shards = read_gres_conf(gres_conf, socket.gethostname().split(".")[0])
    if not files:
        return [Finding("warn", "gres.conf GPUs", f"{gres_conf}: no Name=gpu File= lines for "
                        "this node (AutoDetect?): cannot check the GPU order")]
    out: list[Finding] = []
    if gmap.by_minor:
        problems = check_gres_files(list(gmap.gpus), files)
        out.append(Finding("fail", "gres.conf GPU order", "; ".join(problems)) if problems
                   else Finding("ok", "gres.conf GPU order", "device files match the GPUs"))
    over = []
    for i, path in enumerate(files[: len(gmap.gpus)]):
        have = budget_of(cfg, gmap.gpus[i]).shards_per_gpu
        declared = shards.get(path)
        if declared is not None and declared > have:
            over.append(f"{path}: Count={declared} > {have}")
    out.append(Finding("fail", "gres.conf shards", "more shards than memory for jobs ("
                       + "; ".join(over) + "): regenerate with `colloc admin gres-conf`")
               if over else Finding("ok", "gres.conf shards", "within each GPU's budget"))
    return out


def check_node(cfg: CollocConfig, slurm_conf: Path | None = None) -> list[Finding]:
    """On a GPU node: what the node scripts need besides the GPUs themselves.

    The MPS control program and which MPS it speaks (``mps_protocol``), the node
    scripts slurm.conf points at (they must exist here: slurmd runs them as root with
    no PATH), ``PrologFlags`` (Alloc: the prolog runs at allocation), and ``mps_root``
    (root's own directory, never a symlink or someone else's: root writes MPS state
    there).
    """
    import os
    import shutil
    import stat

    f: list[Finding] = []
    binary = shutil.which(cfg.mps_control) or cfg.mps_control
    if not os.access(binary, os.X_OK):
        f.append(Finding("fail", "MPS control", f"{cfg.mps_control} not found or not "
                         "executable: install the NVIDIA driver's utilities or set mps_control"))
    else:
        from slurm_colloc.mps.v3 import detect

        cap = detect(binary)
        want = cfg.mps_protocol
        level: Level = "ok"
        detail = f"{binary}: MPS v{cap.protocol} ({cap.detail}); mps_protocol = {want}"
        if want == "3" and cap.protocol != 3:
            level, detail = "fail", detail + ": this node has no MPS v3 (driver r615+)"
        elif want == "2" and cap.protocol == 3:
            level, detail = "warn", detail + (": v3 available; set mps_protocol = \"auto\" "
                                              "after `colloc selftest --gpu` passes")
        f.append(Finding(level, "MPS control", detail))
    if slurm_conf is not None and slurm_conf.exists():
        conf = read_conf(slurm_conf)
        for key in ("prolog", "taskprolog", "epilog"):
            path = conf.get(key, "")
            if not path:
                f.append(Finding("fail", f"slurm.conf {key}", "not set: see `colloc admin "
                                 "install` for the line"))
            elif not os.access(path, os.X_OK):
                f.append(Finding("fail", f"slurm.conf {key}", f"{path} is not an executable "
                                 "on this node"))
            else:
                f.append(Finding("ok", f"slurm.conf {key}", path))
        flags = {x.strip().lower() for x in conf.get("prologflags", "").split(",")}
        f.append(Finding("ok", "PrologFlags", ",".join(sorted(flags))) if "alloc" in flags
                 else Finding("fail", "PrologFlags", "PrologFlags=Alloc,Contain: the prolog "
                              "must run at allocation, before any step"))
    root = Path(cfg.mps_root)
    try:
        st = root.lstat()
    except FileNotFoundError:
        f.append(Finding("ok", "mps_root", f"{root} (created by the first prolog)"))
    except OSError as e:
        f.append(Finding("fail", "mps_root", f"{root}: {e.strerror}"))
    else:
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
            f.append(Finding("fail", "mps_root", f"{root} must be a directory of root's that "
                             "only root can write (not a symlink)"))
        else:
            f.append(Finding("ok", "mps_root", str(root)))
    return f
