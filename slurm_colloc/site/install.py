"""Build and install the SPANK plugin and the Lua filters; render the config lines.

Used by ``colloc admin install`` (a real site) and by the devcluster (every test and
demo cluster gets the submit path). Pure functions render text; :func:`install`
writes files. Nothing here needs a running Slurm.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu.backend import GpuInfo
from slurm_colloc.gpu.budget import budget, budget_of

CFLAGS = (
    "-Wall", "-Wextra", "-fstack-protector-strong", "-D_FORTIFY_SOURCE=2", "-O2", "-fPIC",
    "-shared",
)
PLUGIN_NAME = "colloc_spank.so"
MARKER = "slurm-colloc"  # both Lua files mention it in their first lines
_SETTINGS_BLOCK = re.compile(r"local COLLOC = \{\n-- @@COLLOC_SETTINGS@@[^\n]*\n.*?\n\}\n", re.S)


class InstallError(RuntimeError):
    """The site files cannot be built or written as asked."""


@dataclass(frozen=True)
class SiteSettings:
    """The constants written into the Lua filters at install time."""

    shard_mib: int
    gpu_memory_mib: int
    usable_mib: int = 0
    """What jobs can have of one GPU (:mod:`slurm_colloc.gpu.budget`): total less the
    driver's reserve and the MPS servers. 0: all of ``gpu_memory_mib``."""
    default_colloc_mib: int = 0
    estimator_command: str = ""
    estimate_timeout_s: float = 30.0
    trusted_uids: tuple[int, ...] = (0,)
    timeout_bin: str = "/usr/bin/timeout"

    def __post_init__(self) -> None:
        if self.jobs_mib < self.shard_mib:
            raise InstallError(
                f"gpu_memory_mib = {self.gpu_memory_mib} (usable by jobs: {self.jobs_mib}): "
                f"smaller than one shard ({self.shard_mib} MiB); set gpu_memory_mib, or "
                "lower mps_server_mib / gpu_reserved_mib, in colloc.conf"
            )
        if self.estimator_command and not os.path.isabs(self.estimator_command):
            raise InstallError(
                f"estimator_command = {self.estimator_command!r}: must be an absolute path "
                "(cli_filter runs in users' sbatch with their PATH)"
            )

    @property
    def jobs_mib(self) -> int:
        """Memory of one GPU that shards divide."""
        return self.usable_mib or self.gpu_memory_mib

    @property
    def shards_per_gpu(self) -> int:
        """Whole shards one GPU offers (what gres.conf declares per GPU)."""
        return self.jobs_mib // self.shard_mib

    @property
    def estimator(self) -> str:
        """Absolute path of ``colloc`` for the cli_filter."""
        return self.estimator_command or default_estimator_command()


def default_estimator_command() -> str:
    """The ``colloc`` console script next to the running Python (the venv's)."""
    return str(Path(sys.executable).parent / "colloc")


def detect_gpus(cfg: CollocConfig) -> list[GpuInfo]:
    """The GPUs the configured backend reports (NVML or sim)."""
    from slurm_colloc.gpu.select import gpus_from_config

    gpus = gpus_from_config(cfg)
    if not gpus:
        raise InstallError(f"the {cfg.gpu_backend} GPU backend reports no GPUs; "
                           "set gpu_memory_mib in colloc.conf")
    return gpus


def detect_gpu_memory_mib(cfg: CollocConfig) -> int:
    """Smallest GPU memory the configured backend reports (NVML or sim)."""
    return min(g.memory_total_mib for g in detect_gpus(cfg))


def settings_from_config(
    cfg: CollocConfig, *, gpu_memory_mib: int | None = None,
    trusted_uids: Sequence[int] = (0,),
) -> SiteSettings:
    """Site settings from colloc.conf; GPU memory detected when the config says 0.

    Shards divide what jobs can use of the smallest GPU (:mod:`slurm_colloc.gpu.budget`).
    """
    mem = gpu_memory_mib or cfg.gpu_memory_mib
    if mem:
        usable = budget(cfg, mem).usable_mib
    else:
        gpus = detect_gpus(cfg)
        small = min(gpus, key=lambda g: budget_of(cfg, g).usable_mib)
        mem, usable = small.memory_total_mib, budget_of(cfg, small).usable_mib
    return SiteSettings(
        shard_mib=cfg.shard_mib,
        gpu_memory_mib=mem,
        usable_mib=usable,
        default_colloc_mib=cfg.default_colloc_mib,
        estimator_command=cfg.estimator_command,
        estimate_timeout_s=cfg.estimate_timeout_s,
        trusted_uids=tuple(sorted(set(trusted_uids) | {0})),
    )


# ------------------------------------------------------------------ rendering
def _source(*parts: str) -> str:
    return resources.files("slurm_colloc.site").joinpath(*parts).read_text(encoding="utf-8")


def _lua_string(s: str) -> str:
    if any(c in s for c in "\\\"\n\r\0"):
        raise InstallError(f"{s!r}: cannot be written into a Lua filter")
    return f'"{s}"'


def _with_settings(text: str, body: list[str], name: str) -> str:
    block = "local COLLOC = {\n-- written by colloc admin install\n" + "\n".join(
        f"\t{line}," for line in body
    ) + "\n}\n"
    out, n = _SETTINGS_BLOCK.subn(lambda _m: block, text, count=1)
    if n != 1:
        raise InstallError(f"{name}: settings block not found (damaged package?)")
    return out


def render_job_submit(s: SiteSettings) -> str:
    """job_submit.lua with the site's constants."""
    uids = ", ".join(f"[{u}] = true" for u in s.trusted_uids)
    return _with_settings(
        _source("lua", "job_submit.lua"),
        [
            f"shard_mib = {s.shard_mib}",
            f"gpu_memory_mib = {s.jobs_mib}",  # what jobs can have of one GPU
            f"default_colloc_mib = {s.default_colloc_mib}",
            f"trusted_uids = {{ {uids} }}",
        ],
        "job_submit.lua",
    )


def render_cli_filter(s: SiteSettings) -> str:
    """cli_filter.lua with the estimator's absolute path and timeout."""
    return _with_settings(
        _source("lua", "cli_filter.lua"),
        [
            f"estimator = {_lua_string(s.estimator)}",
            f"timeout_s = {max(1, round(s.estimate_timeout_s))}",
            f"timeout_bin = {_lua_string(s.timeout_bin)}",
        ],
        "cli_filter.lua",
    )


def plugstack_line(plugin: Path) -> str:
    """The plugstack.conf line loading the plugin.

    ``optional``: a plugin that fails to load (a broken build, a Slurm upgrade) then
    only loses ``--colloc`` instead of failing every srun/sbatch on the cluster; the
    controller side (job_submit.lua) does not rely on the plugin.
    """
    return f"optional {plugin}"


def slurm_conf_lines(conf_dir: Path, plugstack: Path | None = None) -> list[str]:
    """Lines slurm.conf needs; the Lua scripts must sit in slurm.conf's directory."""
    return [
        f"PlugStackConfig={plugstack or conf_dir / 'plugstack.conf'}",
        "CliFilterPlugins=lua",
        "JobSubmitPlugins=lua",
    ]


def gres_conf_lines(
    gpus: Sequence[GpuInfo], cfg: CollocConfig, device_pattern: str = "/dev/nvidia{index}",
    node_name: str | None = None,
) -> tuple[str, str]:
    """(gres.conf text, the node's ``Gres=`` value): one shard line per GPU.

    Per-GPU ``Name=shard ... File=`` lines keep a job's shards on one GPU and tell
    the job which GPU. Each GPU offers the whole shards of what jobs can use of it
    (its memory less the driver's reserve and the MPS servers' share,
    :mod:`slurm_colloc.gpu.budget`), so Slurm never promises more than a job can get.
    GPUs are listed in device-file order (minor number), which is Slurm's index order,
    and ``{index}`` in the pattern is the minor number (NVML's index if unknown).
    """
    from slurm_colloc.gpu.identity import slurm_order

    prefix = f"NodeName={node_name} " if node_name else ""
    order = slurm_order(gpus)
    lines = [f"# generated by colloc admin gres-conf (shard = {cfg.shard_mib} MiB)",
             "AutoDetect=off"]

    def dev(g: GpuInfo) -> str:
        return device_pattern.format(index=g.index if g.minor_number is None else g.minor_number)

    lines += [f"{prefix}Name=gpu File={dev(g)}" for g in order]
    total = 0
    for i, g in enumerate(order):
        b = budget_of(cfg, g)
        b.check()
        total += b.shards_per_gpu
        lines.append(
            f"# Slurm GPU {i}: {g.name} {g.uuid}, {g.memory_total_mib} MiB - {b.reserved_mib} "
            f"reserved - {b.servers} x {b.server_mib} MPS = {b.usable_mib} MiB for shards"
        )
        lines.append(f"{prefix}Name=shard Count={b.shards_per_gpu} File={dev(g)}")
    return "\n".join(lines) + "\n", f"Gres=gpu:{len(order)},shard:{total}"


# ------------------------------------------------------------------ building
def build_spank_plugin(dest: Path, *, cc: str | None = None) -> Path:
    """Compile the SPANK plugin against the installed Slurm headers into ``dest``."""
    compiler = cc or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise InstallError("no C compiler found (apt-get install gcc)")
    if not Path("/usr/include/slurm/spank.h").exists():
        raise InstallError("/usr/include/slurm/spank.h missing (apt-get install libslurm-dev)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="colloc-spank-") as tmp:
        t = Path(tmp)
        src, vmap = t / "colloc_spank.c", t / "colloc_spank.map"
        src.write_text(_source("spank", "colloc_spank.c"))
        vmap.write_text(_source("spank", "colloc_spank.map"))
        out = t / PLUGIN_NAME
        cp = subprocess.run(
            [compiler, *CFLAGS, f"-Wl,--version-script={vmap}", "-o", str(out), str(src)],
            capture_output=True, text=True, check=False,
        )
        if cp.returncode != 0:
            raise InstallError(f"compiling the SPANK plugin failed:\n{cp.stderr.strip()}")
        tmp_dest = dest.with_name(f".{dest.name}.tmp")
        shutil.copyfile(out, tmp_dest)
        tmp_dest.chmod(0o755)
        os.replace(tmp_dest, dest)  # atomic: running sbatch never sees half a file
    return dest


def exported_symbols(plugin: Path) -> list[str]:
    """Dynamic symbols the plugin defines (``nm -D --defined-only``)."""
    cp = subprocess.run(
        ["nm", "-D", "--defined-only", str(plugin)], capture_output=True, text=True, check=True
    )
    return sorted(line.split()[-1] for line in cp.stdout.splitlines() if line.strip())


# ------------------------------------------------------------------ installing
@dataclass
class InstallResult:
    """What :func:`install` wrote and what the admin still has to add."""

    written: list[Path] = field(default_factory=list)
    slurm_conf_lines: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _write(path: Path, text: str, *, force: bool, mode: int = 0o644) -> None:
    if path.exists() and not force:
        head = path.read_text(errors="replace")[:400]
        if MARKER not in head:
            raise InstallError(
                f"{path} exists and was not written by slurm-colloc; merge it by hand or "
                "pass --force to replace it"
            )
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.chmod(mode)
    os.replace(tmp, path)


def install(
    conf_dir: Path, lib_dir: Path, settings: SiteSettings, *, force: bool = False,
    cc: str | None = None,
) -> InstallResult:
    """Build the plugin into ``lib_dir``; write the Lua filters and plugstack drop-in.

    ``conf_dir`` is the directory of slurm.conf (Slurm loads ``job_submit.lua`` and
    ``cli_filter.lua`` from there). plugstack: ``plugstack.conf.d/colloc.conf`` is
    always written; ``plugstack.conf`` is created (including the drop-in directory)
    when missing, and left alone with a note when it exists without that include.
    """
    res = InstallResult()
    conf_dir.mkdir(parents=True, exist_ok=True)
    plugin = build_spank_plugin(lib_dir / PLUGIN_NAME, cc=cc)
    res.written.append(plugin)
    for name, text in (
        ("job_submit.lua", render_job_submit(settings)),
        ("cli_filter.lua", render_cli_filter(settings)),
    ):
        _write(conf_dir / name, text, force=force)
        res.written.append(conf_dir / name)
    dropin_dir = conf_dir / "plugstack.conf.d"
    dropin_dir.mkdir(exist_ok=True)
    dropin = dropin_dir / "colloc.conf"
    _write(dropin, f"# slurm-colloc: sbatch --colloc\n{plugstack_line(plugin)}\n", force=True)
    res.written.append(dropin)
    plugstack = conf_dir / "plugstack.conf"
    include = f"include {dropin_dir}/*.conf"
    if not plugstack.exists():
        plugstack.write_text(f"# written by slurm-colloc\n{include}\n")
        res.written.append(plugstack)
    elif include not in plugstack.read_text(errors="replace"):
        res.notes.append(f"add this line to {plugstack}: {include}")
    res.slurm_conf_lines = slurm_conf_lines(conf_dir, plugstack)
    return res
