"""``colloc admin doctor``: check a site's submit-path configuration, say what is wrong.

Each check returns a :class:`Finding`; the CLI prints them. Checks read files and
ask the running controller (through the Slurm adapter); they never change anything.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from slurm_colloc import __version__
from slurm_colloc.config import CollocConfig
from slurm_colloc.node.chain import untrusted as untrusted_task_prolog
from slurm_colloc.site import chain as site_hooks
from slurm_colloc.site.finding import Finding as Finding
from slurm_colloc.site.finding import Level
from slurm_colloc.site.install import MARKER, NODE_SCRIPTS, PLUGIN_NAME
from slurm_colloc.site.releases import SlurmRelease, plugin_release
from slurm_colloc.slurm.adapter import SlurmAdapter, SlurmCli, SlurmError

if TYPE_CHECKING:
    from slurm_colloc.gpu.identity import GpuMap



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


def check_files(slurm_conf: Path, cfg: CollocConfig, running: SlurmRelease | None = None,
                ) -> list[Finding]:
    """Static checks of slurm.conf, plugstack, the Lua filters and gres.conf.

    ``running``: the Slurm release this host runs; the SPANK plugin must have been
    built for the same major release (:func:`check_plugin_release`).
    """
    if not slurm_conf.exists():
        return [Finding("fail", f"{slurm_conf} not found", "set SLURM_CONF or --slurm-conf")]
    conf = read_conf(slurm_conf)
    d = slurm_conf.parent
    return [*_check_conf_keys(conf), *_check_plugin(conf, d, running, slurm_conf),
            *_check_lua(d, cfg), _check_gres(d / "gres.conf"),
            *check_cgroup_conf(d / "cgroup.conf", running), *check_compute_history(cfg)]


COMPUTE_HISTORY_STALE_S = 2 * 86400
"""A compute-history table older than this is reported: its timer has stopped."""


def check_compute_history(cfg: CollocConfig, now: float | None = None) -> list[Finding]:
    """With compute admission on, the table job_submit.lua reads must be there and fresh.

    Missing or stale, every job falls back to ``sm_prior_pct``: nothing breaks, but the
    admission the site asked for is not happening, which an admin should hear about.
    """
    if cfg.sm_capacity_pct <= 0:
        return []
    what, path = "compute admission", Path(cfg.compute_history_file)
    fix = "run `colloc admin compute-history --write` as root from a timer (docs/admin.md)"
    try:
        st = path.stat()
    except OSError as e:
        return [Finding("warn", what, f"{path}: {e.strerror}; every job gets sm_prior_pct="
                        f"{cfg.sm_prior_pct}: {fix}")]
    age = (time.time() if now is None else now) - st.st_mtime
    if st.st_uid != 0 or st.st_mode & 0o022:
        return [Finding("fail", what, f"{path} is not root's alone (uid {st.st_uid}, mode "
                        f"{st.st_mode & 0o777:o}): whoever can write it sizes jobs; {fix}")]
    if age > COMPUTE_HISTORY_STALE_S:
        return [Finding("warn", what, f"{path} last written {age / 86400:.1f} days ago: {fix}")]
    return [Finding("ok", what, f"sm_capacity_pct={cfg.sm_capacity_pct}, table {path}")]


def check_cgroup_conf(cgroup_conf: Path, running: SlurmRelease | None) -> list[Finding]:
    """26.05+: cgroup v2 job directories named ``job_<id>`` (``CgroupJobIdPaths=yes``).

    26.05 names them by SLUID; the prolog looks for ``job_<id>`` to put the hard
    GPU-memory limit on the job's cgroup (r615 drivers), and without it says "no job
    cgroup" and goes on without that limit. Nothing to check before 26.05, or where
    the site has no cgroup.conf next to slurm.conf (configless, or cgroups disabled).
    """
    if running is None or (running.major, running.minor) < (26, 5) or not cgroup_conf.exists():
        return []
    conf = read_conf(cgroup_conf)
    if conf.get("cgroupplugin", "").lower() == "disabled":
        return []
    if conf.get("cgroupjobidpaths", "").lower() == "yes":
        return [Finding("ok", "cgroup.conf CgroupJobIdPaths", "yes: job cgroups are job_<id>")]
    return [Finding("warn", "cgroup.conf CgroupJobIdPaths", f"Slurm {running} names job "
                    "cgroups by SLUID; the prolog looks for job_<id> to set the hard GPU-memory "
                    f"limit: add CgroupJobIdPaths=yes to {cgroup_conf} and restart slurmd")]


def _check_conf_keys(conf: dict[str, str]) -> list[Finding]:
    def need(key: str, pred: bool, fix: str) -> Finding:
        return Finding("ok", f"slurm.conf {key}") if pred else Finding(
            "fail", f"slurm.conf {key}", fix)

    return [
        need("SelectType", conf.get("selecttype") == "select/cons_tres",
             "SelectType=select/cons_tres (gres/shard needs it)"),
        need("GresTypes", "shard" in conf.get("grestypes", "").split(","),
             "GresTypes=gpu,shard"),
        need("CliFilterPlugins", "lua" in conf.get("clifilterplugins", "").split(","),
             "CliFilterPlugins=lua"),
        need("JobSubmitPlugins", "lua" in conf.get("jobsubmitplugins", "").split(","),
             "JobSubmitPlugins=lua"),
    ]


def _check_plugin(conf: dict[str, str], d: Path, running: SlurmRelease | None,
                  slurm_conf: Path) -> list[Finding]:
    plugstack = Path(conf.get("plugstackconfig", str(d / "plugstack.conf")))
    ours = [p for p in _plugstack_plugins(plugstack) if p.endswith(PLUGIN_NAME)]
    if not ours:
        return [Finding("fail", "SPANK plugin", f"{plugstack} loads no {PLUGIN_NAME}; "
                        "run `colloc admin install` and set PlugStackConfig")]
    if not Path(ours[0]).exists():
        return [Finding("fail", "SPANK plugin", f"{ours[0]} does not exist; rerun install")]
    found = [Finding("ok", "SPANK plugin", ours[0])]
    if running is not None:
        found.append(check_plugin_release(Path(ours[0]), running, slurm_conf))
    return found


def rebuild_command(plugin: Path, slurm_conf: Path) -> str:
    """The command that rebuilds ``plugin`` where it is (same --lib-dir, same site)."""
    return (f"colloc admin install --apply --slurm-conf {slurm_conf} --lib-dir {plugin.parent}")


def check_plugin_release(plugin: Path, running: SlurmRelease, slurm_conf: Path) -> Finding:
    """The SPANK plugin was built for the major release this host runs.

    Slurm loads a plugin only for its own major release; the plugin is ``optional`` in
    plugstack, so a stale one (after a Slurm upgrade) is skipped without an error and
    ``sbatch`` simply forgets ``--colloc``. The plugin carries the release of the headers
    it was built against (``colloc_spank.c``, :data:`releases.PLUGIN_MARK`).
    """
    what = "SPANK plugin Slurm release"
    try:
        built = plugin_release(plugin.read_bytes())
    except OSError as e:
        return Finding("fail", what, f"{plugin}: {e.strerror}")
    how = (f"rebuild it against Slurm {running.series}'s headers: "
           f"{rebuild_command(plugin, slurm_conf)} (headers: apt-get install libslurm-dev, or "
           "--slurm-include DIR), then copy it to every login host and node")
    if built is None:
        return Finding("warn", what, f"{plugin} does not say which Slurm it was built for "
                       f"(built by an older slurm-colloc); this host runs {running}: {how}")
    if not built.same_series(running):
        return Finding("fail", what, f"{plugin} was built for Slurm {built}, this host runs "
                       f"{running}: Slurm will not load it (sbatch loses --colloc); {how}")
    return Finding("ok", what, f"built for Slurm {built}, running {running}")


def _check_lua(d: Path, cfg: CollocConfig) -> list[Finding]:
    f: list[Finding] = []
    js, cf = d / "job_submit.lua", d / "cli_filter.lua"
    for lua in (js, cf):
        if not lua.exists():
            f.append(Finding("fail", lua.name, f"{lua} missing; run `colloc admin install`"))
        elif MARKER not in lua.read_text(errors="replace")[:400]:
            f.append(Finding("fail", lua.name, f"{lua} is not slurm-colloc's"))
        else:
            f.append(Finding("ok", lua.name, str(lua)))
    if js.exists():
        js_text = js.read_text(errors="replace")
        if re.search(r'"gres:shard:"\s*\.\.', js_text):
            f.append(Finding("fail", "job_submit.lua TRES spelling", f"{js} writes "
                             "gres:shard:K, which Slurm 24.11+ refuses for every --colloc "
                             "job (\"Invalid Trackable RESource (TRES) specification\"); "
                             "re-render it: colloc admin install --apply"))
        shard = _lua_number(js_text, "shard_mib")
        if shard != cfg.shard_mib:
            f.append(Finding("fail", "shard size", f"job_submit.lua has shard_mib={shard}, "
                             f"colloc.conf {cfg.shard_mib}; rerun `colloc admin install`"))
    if cf.exists():
        m = re.search(r'^\s*estimator = "([^"]*)"', cf.read_text(errors="replace"), re.M)
        if m and not Path(m.group(1)).exists():
            f.append(Finding("fail", "estimator", f"cli_filter.lua runs {m.group(1)}, "
                             "which does not exist on this host"))
    return f


def _check_gres(gres: Path) -> Finding:
    if not gres.exists():
        return Finding("warn", "gres.conf", f"{gres} not found (configless or per-node?)")
    shard_lines = [ln for ln in gres.read_text().splitlines()
                   if re.search(r"Name=shard", ln) and not ln.lstrip().startswith("#")]
    if not shard_lines:
        return Finding("fail", "gres.conf", "no Name=shard lines; see `colloc admin gres-conf`")
    if any("File=" not in ln for ln in shard_lines):
        return Finding("warn", "gres.conf", "shard lines without File=: Slurm cannot keep "
                       "a job's shards on one GPU; use one line per GPU")
    return Finding("ok", "gres.conf", f"{len(shard_lines)} per-GPU shard lines")


def check_live(adapter: SlurmAdapter | None = None) -> list[Finding]:
    """Ask the running controller what it actually loaded."""
    slurm = adapter if adapter is not None else SlurmCli()
    f: list[Finding] = []
    try:
        live = slurm.controller_config()
    except SlurmError as e:
        return [Finding("fail", "slurmctld", f"cannot ask the controller: {e}")]
    for key in ("jobsubmitplugins", "clifilterplugins"):
        val = live.get(key, "")
        f.append(Finding("ok" if "lua" in val else "fail", f"running {key}",
                         val or "(null): run `scontrol reconfigure` or restart slurmctld"))
    try:
        help_text = slurm.sbatch_help()
    except SlurmError as e:
        help_text = str(e)
    f.append(Finding("ok", "sbatch --colloc") if "--colloc" in help_text else Finding(
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


def _no_backend(cfg: CollocConfig, error: str, dev: Path = Path("/dev")) -> Finding:
    """The backend did not open: a skip on a host without GPUs, a failure on a GPU node.

    ``colloc admin doctor --gpus`` on a controller or login host (no ``/dev/nvidia<N>``)
    says the GPU checks were skipped and why, instead of failing; where device files
    exist, NVML not opening is the node's problem and fails.
    """
    if not gpu_host(cfg, dev):
        return Finding("warn", "no GPU backend", f"GPU checks skipped: no /dev/nvidia<N> here "
                       f"(controller or login host?); NVML: {error}")
    return Finding("fail", f"gpu backend {cfg.gpu_backend}", error)


def _listdir(d: Path) -> list[Path]:
    try:
        return list(d.iterdir())
    except OSError:
        return []


def compute_mode_finding(modes: dict[int, str], cfg: CollocConfig) -> Finding:
    """Every GPU must be in compute mode DEFAULT; say what that leaves open.

    Colloc cannot use EXCLUSIVE_PROCESS, NVIDIA's usual advice for one MPS server per
    GPU: with ``mps_protocol = "2"`` each user gets an MPS server of their own on the
    GPU (a second server is a second context), and whole-GPU jobs (``mode=whole``) run
    without MPS on a GPU where MPS servers may still hold contexts. DEFAULT lets a
    process that ignores ``CUDA_MPS_PIPE_DIRECTORY`` open its own context; the
    collector flags or kills it (``enforce_outside_mps``), and the hard cgroup limit
    (r615) holds its memory. With enforcement off nothing does: a warning.
    """
    bad = {i: m for i, m in sorted(modes.items()) if m != "DEFAULT"}
    if bad:
        nums = ",".join(str(i) for i in bad)
        return Finding("fail", "GPU compute mode", f"GPUs {bad} must be DEFAULT: "
                       f"nvidia-smi -i {nums} -c DEFAULT (as root; colloc runs one MPS "
                       "server per user on a GPU and whole-GPU jobs without MPS, so "
                       "EXCLUSIVE_PROCESS would refuse the second context)")
    if cfg.enforce_outside_mps == "off":
        return Finding("warn", "GPU compute mode", "DEFAULT on all GPUs, and "
                       "enforce_outside_mps = \"off\": a process that bypasses MPS is "
                       "neither prevented nor noticed; set enforce_outside_mps = \"flag\" "
                       "(or \"kill\") in colloc.conf")
    return Finding("ok", "GPU compute mode", "DEFAULT on all GPUs (processes outside MPS "
                   f"are caught by the collector: enforce_outside_mps = "
                   f"\"{cfg.enforce_outside_mps}\")")


def check_gpus(cfg: CollocConfig, gres_conf: Path | None = None) -> list[Finding]:
    """On a GPU node: backend, compute mode, Slurm's GPU order, and shards vs memory.

    One MPS server per (GPU, user) (docs/node.md) needs compute mode DEFAULT; a GPU in
    EXCLUSIVE_PROCESS mode admits one context, so a second user's job would fail
    (:func:`compute_mode_finding`). Without a GPU backend (a controller or login host)
    the GPU checks are skipped with one line (:func:`_no_backend`).
    Slurm numbers GPUs by device file; colloc maps that index to a UUID by minor number
    (:mod:`slurm_colloc.gpu.identity`), and gres.conf must declare no more shards per
    GPU than its memory budget allows (:mod:`slurm_colloc.gpu.budget`).
    """
    from slurm_colloc.gpu.backend import GpuBackendError
    from slurm_colloc.gpu.budget import BudgetError, budget_of
    from slurm_colloc.gpu.identity import GpuIdentityError, GpuMap
    from slurm_colloc.gpu.nvml import NvmlBackend
    from slurm_colloc.gpu.select import backend_from_config
    from slurm_colloc.gpu_settings import describe, local_node

    try:
        backend = backend_from_config(cfg, with_dcgm=False)
    except GpuBackendError as e:
        return [_no_backend(cfg, str(e))]
    try:
        gpus = backend.gpus()
        f = [Finding("ok", f"gpu backend {cfg.gpu_backend}", f"{len(gpus)} GPU(s)")]
        if isinstance(backend, NvmlBackend):
            f.append(compute_mode_finding(backend.compute_modes(), cfg))
        try:
            gmap = GpuMap.from_gpus(gpus)
        except GpuIdentityError as e:
            return [*f, Finding("fail", "GPU order", str(e))]
        f.append(Finding("ok", "GPU order", "Slurm index -> UUID: " + ", ".join(
            f"{i}={g.uuid}" + (f" (/dev/nvidia{g.minor_number})" if g.minor_number is not None
                               else "") for i, g in enumerate(gmap.gpus))))
        for i, g in enumerate(gmap.gpus):
            b = budget_of(cfg, g)
            if cfg.gpu_types or cfg.nodes:  # say which table each overhead came from
                f.append(Finding("ok", f"GPU {i} settings", f"{g.name} on {local_node()}: "
                                 + describe(cfg, node=local_node(), model=g.name)))
            try:
                b.check()
            except BudgetError as e:
                f.append(Finding("fail", f"GPU {i} memory budget", str(e)))
        if gres_conf is not None and gres_conf.exists():
            f += _check_gres_against(gmap, cfg, gres_conf)
        return f
    except GpuBackendError as e:
        return [Finding("fail", f"gpu backend {cfg.gpu_backend}", str(e))]
    except Exception as e:  # noqa: BLE001 - a doctor reports, it never shows a traceback
        return [Finding("fail", f"gpu backend {cfg.gpu_backend}",
                        f"unexpected {type(e).__name__}: {e}")]
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


def gpu_host(cfg: CollocConfig, dev: Path = Path("/dev")) -> bool:
    """Whether this host has GPUs to check: NVML device files, or a non-NVML backend."""
    return cfg.gpu_backend != "nvml" or any(
        re.fullmatch(r"nvidia\d+", p.name) for p in _listdir(dev))


def check_node(cfg: CollocConfig, slurm_conf: Path | None = None,
               dev: Path = Path("/dev")) -> list[Finding]:
    """On a GPU node: what the node scripts need besides the GPUs themselves.

    The MPS control program and which MPS it speaks (``mps_protocol``), the node
    scripts slurm.conf points at (they must exist here: slurmd runs them as root with
    no PATH), ``PrologFlags`` (Alloc: the prolog runs at allocation), ``mps_root``
    (root's own directory, never a symlink or someone else's: root writes MPS state
    there), the other state directories (:func:`check_dirs`), the collector that
    enforces limits (:func:`~slurm_colloc.site.doctor_collector.check_collector`), DCGM
    (:func:`check_dcgm`), container runtimes (:func:`check_containers`) and the
    installed programs' version (:func:`check_scripts`). On a host without GPUs
    (controller, login host) only the last runs, after one line saying so.
    """
    if not gpu_host(cfg, dev):
        return [Finding("warn", "node checks", "skipped: no /dev/nvidia<N> on this host "
                        "(controller or login host; on a GPU node the NVIDIA driver is not "
                        "loaded): MPS control, node scripts, PrologFlags, state directories, "
                        "DCGM, containers"), *check_scripts(None)]
    from slurm_colloc.site.doctor_collector import check_collector, check_collector_unit

    return [
        check_mps_control(cfg), *check_wiring(slurm_conf, cfg), check_mps_root(cfg),
        *check_dirs(cfg), *check_collector(cfg), *check_collector_unit(cfg),
        *check_dcgm(cfg),
        *check_containers(cfg, slurm_conf), *check_scripts(slurm_conf),
    ]


def check_mps_control(cfg: CollocConfig) -> Finding:
    """The MPS control program exists and speaks the protocol ``mps_protocol`` asks."""
    binary = shutil.which(cfg.mps_control) or cfg.mps_control
    if not os.access(binary, os.X_OK):
        return Finding("fail", "MPS control", f"{cfg.mps_control} not found or not "
                       "executable: install the NVIDIA driver's utilities or set mps_control")
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
    return Finding(level, "MPS control", detail)


def check_wiring(slurm_conf: Path | None, cfg: CollocConfig | None = None) -> list[Finding]:
    """slurm.conf's Prolog/TaskProlog/Epilog are executables here; PrologFlags=Alloc.

    A site's own Prolog/Epilog lines beside colloc's are fine (slurmd runs them all);
    so is a site TaskProlog chained by colloc's (``chain_task_prolog``), which must
    be root's alone.
    """
    if slurm_conf is None or not slurm_conf.exists():
        return []
    hooks = site_hooks.read_hooks(slurm_conf)
    f = [_wiring(hooks, key, name) for key, name in NODE_SCRIPTS.items()]
    if cfg is not None and cfg.chain_task_prolog:
        why = untrusted_task_prolog(cfg.chain_task_prolog)
        f.append(Finding("fail", "chain_task_prolog", f"{why}: every task on this node "
                         "fails until it is fixed") if why else
                 Finding("ok", "chain_task_prolog", f"{cfg.chain_task_prolog} (runs first)"))
    flags = {x.strip().lower() for x in (hooks.get("prologflags") or [""])[-1].split(",")}
    f.append(Finding("ok", "PrologFlags", ",".join(sorted(flags))) if "alloc" in flags
             else Finding("fail", "PrologFlags", "PrologFlags=Alloc,Contain: the prolog "
                          "must run at allocation, before any step"))
    return f


def _wiring(hooks: site_hooks.Hooks, key: str, name: str) -> Finding:
    """One node script key: set, every program executable here, colloc's among them."""
    what = f"slurm.conf {key.lower()}"
    paths = site_hooks.node_scripts(hooks, key)
    if not paths:
        return Finding("fail", what, "not set: see `colloc admin install` for the line")
    bad = [p for p in paths if not os.access(p, os.X_OK)]
    if bad:
        return Finding("fail", what, f"{', '.join(bad)}: not an executable on this node")
    ours = site_hooks.colloc_among(paths, name)
    if ours is None:
        return Finding("warn", what, f"{', '.join(paths)}: none is colloc's {name} "
                       f"(add a {key}= line for it: `colloc admin install`)")
    if len(paths) == 1:
        return Finding("ok", what, ours)
    return Finding("ok", what, f"{ours}, beside the site's "
                   f"{', '.join(p for p in paths if p != ours)}")


def check_mps_root(cfg: CollocConfig) -> Finding:
    """``mps_root`` is root's own directory (root writes MPS state there)."""
    root = Path(cfg.mps_root)
    try:
        st = root.lstat()
    except FileNotFoundError:
        return Finding("ok", "mps_root", f"{root} (created by the first prolog)")
    except OSError as e:
        return Finding("fail", "mps_root", f"{root}: {e.strerror}")
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        return Finding("fail", "mps_root", f"{root} must be a directory of root's that "
                       "only root can write (not a symlink)")
    return Finding("ok", "mps_root", str(root))



# --- node: directories, DCGM, containers, installed scripts ---------------------------

Which = Callable[[str], "str | None"]
Runner = Callable[[Sequence[str]], "tuple[int, str]"]


def _run(argv: Sequence[str], timeout: float = 10.0) -> tuple[int, str]:
    """Run a program without a shell: (exit status, first 4 KiB of its output)."""
    try:
        cp = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                            check=False, stdin=subprocess.DEVNULL, errors="replace")
    except (OSError, subprocess.SubprocessError) as e:
        return 127, str(e)
    return cp.returncode, (cp.stdout + cp.stderr)[:4096]


def check_dirs(cfg: CollocConfig, owner_uid: int = 0) -> list[Finding]:
    """Node-local state directories: root's own, writable by root only, or not there yet.

    ``metrics_dir`` (the collector's series, meta and verdicts), ``evidence_dir``
    (root's copy of failed attempts' logs) and the directory of ``history_db`` (the
    node's measured peaks) are created by the node scripts on first use; once they
    exist, a directory another user could write (or a symlink) would let that user
    plant what root later reads, renames or prunes there.
    """
    out: list[Finding] = []
    for what, path in (("metrics_dir", Path(cfg.metrics_dir)),
                       ("evidence_dir", Path(cfg.evidence_dir)),
                       ("history_db directory", Path(cfg.history_db).parent)):
        try:
            st = path.lstat()
        except FileNotFoundError:
            out.append(Finding("ok", what, f"{path} (created by the first job)"))
            continue
        except OSError as e:
            out.append(Finding("fail", what, f"{path}: {e.strerror}"))
            continue
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            out.append(Finding("fail", what, f"{path} is not a directory (symlink?): remove "
                               "it; the node scripts create it"))
        elif st.st_uid != owner_uid or st.st_mode & 0o022:
            out.append(Finding("fail", what, f"{path} is owned by uid {st.st_uid}, mode "
                               f"{stat.S_IMODE(st.st_mode):04o}: chown root:root {path} && "
                               f"chmod go-w {path}"))
        else:
            out.append(Finding("ok", what, f"{path} ({stat.S_IMODE(st.st_mode):04o}, root)"))
    return out


def _process_running(name: str, proc: Path = Path("/proc")) -> int | None:
    """The pid of a process whose command name is ``name``, or None."""
    for d in _listdir(proc):
        if d.name.isdigit():
            try:
                if (d / "comm").read_text().strip() == name:
                    return int(d.name)
            except OSError:
                continue
    return None


def _dcgm_bindings() -> str | None:
    """Where DCGM's ``DcgmReader`` module is, as the collector would import it."""
    import importlib.util

    from slurm_colloc.gpu.dcgm import DCGM_PYTHON_DIRS

    for d in DCGM_PYTHON_DIRS:
        if (Path(d) / "DcgmReader.py").is_file():
            return d
    try:
        spec = importlib.util.find_spec("DcgmReader")
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None and spec.origin else None


def check_dcgm(cfg: CollocConfig, *, which: Which = shutil.which, proc: Path = Path("/proc"),
               bindings: Callable[[], str | None] = _dcgm_bindings,
               run: Runner = _run) -> list[Finding]:
    """DCGM is optional: without it the collector reports NVML utilisation only.

    With DCGM's host engine (``nv-hostengine``) running and its Python bindings where
    :mod:`slurm_colloc.gpu.dcgm` looks, the collector adds SM activity, SM occupancy
    and DRAM activity. Absent altogether is fine (``ok``); half installed is a warning.
    """
    what = "DCGM (optional)"
    if cfg.gpu_backend != "nvml":
        return [Finding("ok", what, f"not used with gpu_backend = \"{cfg.gpu_backend}\"")]
    pid = _process_running("nv-hostengine", proc)
    where = bindings()
    dcgmi = which("dcgmi")
    if pid is None and where is None and dcgmi is None:
        return [Finding("ok", what, "not installed: DCGM profiling metrics (SM activity, "
                        "occupancy, DRAM activity) unavailable; NVML utilization used. To add "
                        "them: install datacenter-gpu-manager, systemctl enable --now "
                        "nvidia-dcgm")]
    if pid is None:
        return [Finding("warn", what, "installed but nv-hostengine is not running: "
                        "systemctl enable --now nvidia-dcgm (or start nv-hostengine); until "
                        "then DCGM profiling metrics unavailable, NVML utilization used")]
    if dcgmi is not None:
        rc, text = run([dcgmi, "discovery", "-l"])
        if rc != 0:
            last = text.strip().splitlines()[-1] if text.strip() else f"exit {rc}"
            return [Finding("warn", what, f"nv-hostengine runs (pid {pid}) but `dcgmi "
                            f"discovery -l` fails ({last}): check the host engine's log "
                            "(journalctl -u nvidia-dcgm)")]
    if where is None:
        from slurm_colloc.gpu.dcgm import DCGM_PYTHON_DIRS

        return [Finding("warn", what, f"nv-hostengine runs (pid {pid}) but DCGM's Python "
                        f"bindings (DcgmReader) are not in {', '.join(DCGM_PYTHON_DIRS)} nor "
                        "importable: the collector uses NVML utilization only")]
    return [Finding("ok", what, f"nv-hostengine running (pid {pid}), bindings {where}: "
                    "SM activity and occupancy measured")]


def _config_lines(paths: list[Path]) -> list[str]:
    """Lines of the readable files among ``paths``, comments (``#``) cut off."""
    out: list[str] = []
    for p in paths:
        try:
            text = p.read_text(errors="replace")
        except OSError:
            continue
        out += [raw.split("#", 1)[0] for raw in text.splitlines()]
    return out


def _fstab_binds(paths: list[Path]) -> list[str]:
    """Source fields of the fstab-style lines in ``paths`` (enroot's mounts.d)."""
    return [line.split()[0] for line in _config_lines(paths) if line.split()]


def _apptainer_binds(paths: list[Path]) -> list[str]:
    """``bind path = SRC[:DST]`` sources of apptainer.conf / singularity.conf."""
    out: list[str] = []
    for line in _config_lines(paths):
        m = re.match(r"\s*bind path\s*=\s*(\S+)", line)
        if m:
            out.append(m.group(1).split(":", 1)[0])
    return out


def _covers(sources: list[str], target: str) -> bool:
    """A bind of one of ``sources`` makes ``target`` visible at the same path."""
    t = os.path.normpath(target)
    return any(t == os.path.normpath(s) or t.startswith(os.path.normpath(s).rstrip("/") + "/")
               for s in sources if s.startswith("/"))


def check_containers(cfg: CollocConfig, slurm_conf: Path | None = None, *,
                     which: Which = shutil.which, etc: Path = Path("/etc")) -> list[Finding]:
    """Container runtimes on the node must show jobs the MPS pipe directory.

    The TaskProlog exports ``CUDA_MPS_PIPE_DIRECTORY`` (a directory under ``mps_root``);
    a job in a container that cannot see it opens its own CUDA context outside MPS (no
    per-process cap; the collector flags it). So where enroot/pyxis or Apptainer is
    installed, ``mps_root`` must be bind-mounted at the same path: a warning with the
    exact option unless the runtime's site configuration already does it.
    """
    root = cfg.mps_root
    out: list[Finding] = []
    pyxis = False
    if slurm_conf is not None and slurm_conf.exists():
        conf = read_conf(slurm_conf)
        plugstack = Path(conf.get("plugstackconfig", str(slurm_conf.parent / "plugstack.conf")))
        pyxis = any(Path(p).name == "spank_pyxis.so" for p in _plugstack_plugins(plugstack))
    enroot = which("enroot") is not None or (etc / "enroot").is_dir()
    if enroot or pyxis:
        names = " + ".join(n for n, on in (("enroot", enroot), ("pyxis", pyxis)) if on)
        fstabs = sorted((etc / "enroot" / "mounts.d").glob("*.fstab"))
        if _covers(_fstab_binds(fstabs), root):
            out.append(Finding("ok", f"containers: {names}", f"{etc}/enroot/mounts.d binds "
                               f"{root}"))
        else:
            out.append(Finding("warn", f"containers: {names}", f"containers must see the MPS "
                               f"pipe directory {root}: add the line `{root} {root} none "
                               f"x-create=dir,bind,ro,nosuid,nodev` to "
                               f"{etc}/enroot/mounts.d/90-colloc.fstab (every container; "
                               f"per job: srun --container-mounts={root}:{root}:ro)"))
    for tool in ("apptainer", "singularity"):
        if which(tool) is None:
            continue
        conf_file = etc / tool / f"{tool}.conf"
        if _covers(_apptainer_binds([conf_file]), root):
            out.append(Finding("ok", f"containers: {tool}", f"{conf_file} binds {root}"))
        else:
            out.append(Finding("warn", f"containers: {tool}", f"containers must see the MPS "
                               f"pipe directory {root}: add `bind path = {root}` to "
                               f"{conf_file} (per job: {tool} exec --bind {root}:{root}:ro "
                               f"...; with --cleanenv also --env CUDA_MPS_PIPE_DIRECTORY="
                               "$CUDA_MPS_PIPE_DIRECTORY)"))
    if not out:
        out.append(Finding("ok", "containers", "no enroot, pyxis, apptainer or singularity "
                           "here: nothing to bind"))
    return out


_VERSION_PROBE = "import slurm_colloc; print(slurm_colloc.__version__)"


def script_version(path: Path, run: Runner = _run, depth: int = 0) -> tuple[str | None, str]:
    """(slurm-colloc version a console script runs, how it was found).

    A console script's ``#!`` names its Python: this interpreter means this version;
    another is asked. A shell wrapper (``exec /opt/colloc/bin/colloc-prolog "$@"``, or
    ``exec /usr/bin/nice -n -5 /opt/colloc/bin/colloc-prolog "$@"``) and the C client of
    the node's script server (``script_client.c``: its compiled-in Python script) are
    followed: a shell wrapper once, a C client after at most one wrapper (the
    devcluster's wrapper execs a C client).
    """
    try:
        with path.open("rb") as fh:
            raw = fh.read(4096)
            if raw.startswith(b"\x7fELF"):
                raw += fh.read(1 << 20)
    except OSError as e:
        return None, f"{path}: {e.strerror}"
    if raw.startswith(b"\x7fELF"):
        found = re.search(rb"colloc-script-client fallback=(/[^\0\s]+)", raw)
        from slurm_colloc.node.script_client import MAGIC

        if found and MAGIC not in raw:
            return None, (f"{path}: a C client of another wire than this version's "
                          f"({MAGIC.decode()}); rebuild it with `colloc admin node-clients`")
        if found and depth < 2:
            return script_version(Path(os.fsdecode(found.group(1))), run, depth + 1)
        return None, f"{path}: not a console script of slurm-colloc"
    head = raw.decode("utf-8", errors="replace")
    first = head.splitlines()[0] if head else ""
    words = first[2:].split() if first.startswith("#!") else []
    if words and "python" in Path(words[-1] if words[0].endswith("/env") else words[0]).name:
        interp = words[0] if not words[0].endswith("/env") else words[-1]
        if os.path.abspath(interp) == os.path.abspath(sys.executable):
            return __version__, f"{path} (this installation)"
        rc, text = run([interp, "-c", _VERSION_PROBE])
        lines = text.strip().splitlines()
        if rc == 0 and lines:
            return lines[-1].strip(), f"{path} ({interp})"
        return None, f"{path}: {interp} cannot import slurm_colloc"
    m = re.search(r"^\s*exec\s+(?:(?:/usr)?/bin/nice\s+-n\s*-?\d+\s+)?(/\S+)", head, re.M)
    if m and depth == 0:
        return script_version(Path(m.group(1)), run, depth + 1)
    return None, f"{path}: not a console script of slurm-colloc"


def check_scripts(slurm_conf: Path | None = None, *, which: Which = shutil.which,
                  run: Runner = _run) -> list[Finding]:
    """The colloc programs this host runs are the version running this doctor.

    ``colloc`` and ``colloc-report`` on PATH (users run them; the cli_filter names
    ``colloc`` by path) and the node scripts slurm.conf names: a node left on an old
    wheel after an upgrade runs old node scripts under new job_submit records.
    """
    out: list[Finding] = []
    targets: list[tuple[str, Path | None]] = [(n, Path(p) if (p := which(n)) else None)
                                              for n in ("colloc", "colloc-report")]
    if slurm_conf is not None and slurm_conf.exists():
        hooks = site_hooks.read_hooks(slurm_conf)
        for key, name in NODE_SCRIPTS.items():
            ours = site_hooks.colloc_among(site_hooks.node_scripts(hooks, key), name)
            if ours:  # a site's own script beside it has no colloc version to check
                targets.append((f"slurm.conf {key.lower()} version", Path(ours)))
    for name, path in targets:
        if path is None:
            out.append(Finding("warn", f"{name} on PATH", f"not found: users here need it; "
                               f"link {Path(sys.executable).parent / name} into "
                               "/usr/local/bin"))
            continue
        what = name if name.startswith("slurm.conf") else f"{name} on PATH"
        if not path.exists():
            continue  # check_node already failed it
        version, how = script_version(path, run)
        if version is None:
            out.append(Finding("warn", what, f"cannot tell its version: {how}"))
        elif version != __version__:
            out.append(Finding("fail", what, f"{how} is slurm-colloc {version}, this doctor "
                               f"{__version__}: install the same wheel on every host (or fix "
                               "PATH)"))
        else:
            out.append(Finding("ok", what, f"{how}: {version}"))
    return out


# --- the submit path, end to end ---------------------------------------------------------

SUBMIT_PROBE = ("--test-only", "--colloc-mem=2G", "--job-name=colloc-doctor", "--time=1",
                "--chdir=/tmp", "--output=/dev/null", "--wrap=true")
"""What :func:`check_submit` asks sbatch: ``--colloc-mem`` is the plugin's option
(colloc_spank.c), so the plugin, cli_filter.lua and job_submit.lua all take part;
``--test-only`` makes slurmctld run job_submit.lua and schedule the job on paper,
and submit nothing."""

# Slurm's refusal -> what to do about it
_SUBMIT_HINTS: tuple[tuple[str, str], ...] = (
    ("invalid trackable resource", "slurmctld refused the TRES request job_submit.lua wrote "
     "(24.11+ takes only gres/shard:K): re-render it with colloc admin install --apply, then "
     "scontrol reconfigure"),
    ("unrecognized option", "sbatch does not know --colloc-mem: the SPANK plugin did not "
     "load here (see the plugin lines above)"),
    ("invalid account", "the user has no Slurm account: pass --submit-as USER, a user with "
     "an association"),
    ("association", "the user has no Slurm association: pass --submit-as USER, a user with "
     "one"),
    ("requested node configuration is not available", "no node offers shards for this job: "
     "node Gres=...,shard:N in slurm.conf, gres.conf (colloc admin gres-conf)"),
    ("invalid generic resource", "gres/shard is not configured: GresTypes=gpu,shard and "
     "the nodes' Gres=...,shard:N"),
)


def _submit_run(argv: Sequence[str]) -> tuple[int, str]:
    """sbatch --test-only waits for the controller: a longer limit than other probes."""
    return _run(argv, timeout=60.0)


def submit_argv(user: str, *, euid: int, sbatch: str, runuser: str | None,
                slurm_conf: Path | None = None) -> tuple[list[str], str]:
    """(argv of the probe submission, who it runs as).

    As root it runs as ``user`` through ``runuser`` (job_submit.lua treats root as
    trusted, so a submission by root proves nothing about users'); otherwise as the
    caller, who cannot switch users. ``SLURM_CONF`` is passed on explicitly.
    """
    env = ["env", f"SLURM_CONF={slurm_conf}"] if slurm_conf is not None else []
    probe = [*env, sbatch, *SUBMIT_PROBE]
    if euid == 0:
        if runuser is None:
            return [], "runuser not found (util-linux): cannot submit as another user"
        return [runuser, "-u", user, "--", *probe], user
    import pwd

    try:
        me = pwd.getpwuid(euid).pw_name
    except KeyError:
        me = f"uid {euid}"
    return probe, f"{me} (not root: cannot switch to {user})" if me != user else me


def check_submit(user: str = "nobody", slurm_conf: Path | None = None, *,
                 run: Runner = _submit_run, which: Which = shutil.which,
                 euid: int | None = None) -> Finding:
    """A real ``sbatch --test-only --colloc-mem=2G`` as an unprivileged user.

    The files can all look right while users' submissions fail: a job_submit.lua that
    writes what this Slurm refuses, a plugin that does not load, a partition without
    shards. This asks the running controller the question users will ask, and reports
    Slurm's own words when it says no.
    """
    what = f"sbatch --test-only --colloc-mem=2G as {user}"
    sbatch = which("sbatch")
    if sbatch is None:
        return Finding("fail", what, "sbatch not on PATH (slurm-client)")
    argv, who = submit_argv(user, euid=os.geteuid() if euid is None else euid, sbatch=sbatch,
                            runuser=which("runuser"), slurm_conf=slurm_conf)
    if not argv:
        return Finding("fail", what, who)
    what = f"sbatch --test-only --colloc-mem=2G as {who}"
    rc, out = run(argv)
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    if rc == 0:
        said = next((ln for ln in lines if "to start at" in ln), lines[-1] if lines else "")
        return Finding("ok", what, f"accepted: {said[:300]}")
    errors = [ln for ln in lines if "error" in ln.lower()] or lines[-3:] or [f"exit {rc}"]
    text = " | ".join(errors)[:800]
    hints = [h for needle, h in _SUBMIT_HINTS if needle in out.lower()]
    return Finding("fail", what, f"refused (exit {rc}): {text}"
                   + (f"; {hints[0]}" if hints else ""))
