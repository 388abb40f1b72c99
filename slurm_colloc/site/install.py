"""Build and install the SPANK plugin and the Lua filters; render the config lines.

Used by ``colloc admin install`` (a real site) and by the devcluster (every test and
demo cluster gets the submit path). Pure functions render text; :func:`install`
writes files. Nothing here needs a running Slurm.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu.backend import GpuInfo
from slurm_colloc.gpu.budget import budget, budget_of
from slurm_colloc.site import chain as site_hooks
from slurm_colloc.site.releases import (
    SUPPORTED_RANGE,
    SlurmRelease,
    parse_header_release,
    plugin_release,
)

CFLAGS = (
    "-Wall", "-Wextra", "-fstack-protector-strong", "-D_FORTIFY_SOURCE=2", "-O2", "-fPIC",
    "-shared",
)
PLUGIN_NAME = "colloc_spank.so"
MARKER = "slurm-colloc"  # both Lua files mention it in their first lines
_SETTINGS_BLOCK = re.compile(r"local COLLOC = \{\n-- @@COLLOC_SETTINGS@@[^\n]*\n.*?\n\}\n", re.S)


class InstallError(RuntimeError):
    """The site files cannot be built or written as asked."""


_PARTITION_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class SharedPartition:
    """A partition whose GPUs are shared (colloc.conf ``shared_partitions``)."""

    name: str
    gpu_memory_mib: int
    """Memory of the partition's smallest GPU."""
    usable_mib: int
    """What jobs can have of one of its GPUs (:mod:`slurm_colloc.gpu.budget`)."""

    def shards_per_gpu(self, shard_mib: int) -> int:
        """Whole shards one of its GPUs offers."""
        return self.usable_mib // shard_mib


def parse_shared_partitions(entries: Sequence[str]) -> list[tuple[str, int | None]]:
    """``NAME`` / ``NAME:GPU_MIB`` entries -> (name, GPU MiB or None), checked."""
    out: list[tuple[str, int | None]] = []
    for entry in entries:
        name, sep, size = str(entry).strip().partition(":")
        if not _PARTITION_NAME.match(name):
            raise InstallError(
                f"shared_partitions: {entry!r}: expected NAME or NAME:GPU_MIB (a Slurm "
                "partition name of letters, digits, '_', '.', '-')")
        mib: int | None = None
        if sep:
            if not size.isdigit() or int(size) <= 0:
                raise InstallError(
                    f"shared_partitions: {entry!r}: GPU_MIB must be a positive number of MiB")
            mib = int(size)
        if any(n == name for n, _ in out):
            raise InstallError(f"shared_partitions: {name} is listed twice")
        out.append((name, mib))
    return out


@dataclass(frozen=True)
class SiteScript:
    """A site's own job_submit.lua, embedded into colloc's (``--chain-job-submit``)."""

    path: str
    text: str


_DEFINES_SUBMIT = re.compile(
    r"(?m)^[ \t]*(?:function[ \t]+slurm_job_submit[ \t]*\("
    r"|slurm_job_submit[ \t]*=[ \t]*function\b)")


def _lua51_syntax_error(text: str, name: str) -> str | None:
    """Lua 5.1's complaint about ``text`` (compiled, never run), or None.

    lupa's Lua 5.1 runtime (LuaJIT) when installed, else ``luac5.1 -p``; with neither,
    only the basic checks of :func:`check_site_job_submit` are made.
    """
    try:
        lua51: Any = importlib.import_module("lupa.lua51")
    except ImportError:
        lua51 = None
    if lua51 is not None:
        rt = lua51.LuaRuntime(unpack_returned_tuples=True)
        res = rt.globals().loadstring(text, "=" + name)
        if isinstance(res, tuple) and res and res[0] is None:
            return str(res[1])
        return None
    luac = shutil.which("luac5.1")
    if luac:
        with tempfile.NamedTemporaryFile("w", suffix=".lua") as f:
            f.write(text)
            f.flush()
            cp = subprocess.run([luac, "-p", f.name], capture_output=True, text=True,
                                check=False)
        if cp.returncode != 0:
            return (cp.stderr.strip() or "luac5.1 -p failed").replace(f.name, name)
    return None


_DEFINES_CLI = re.compile(
    r"(?m)^[ \t]*(?:function[ \t]+slurm_cli_(?:setup_defaults|pre_submit|post_submit)[ \t]*\("
    r"|slurm_cli_(?:setup_defaults|pre_submit|post_submit)[ \t]*=[ \t]*function\b)")


def _check_site_lua(text: str, name: str, kind: str, defines: re.Pattern[str],
                    entry: str) -> SiteScript:
    """A site's ``kind`` script (job_submit.lua, cli_filter.lua) fit to be embedded."""
    if "\0" in text:
        raise InstallError(f"{name}: not a Lua script (it holds NUL bytes)")
    if f"{kind} of slurm-colloc" in text:
        raise InstallError(f"{name} is colloc's own {kind}; chain the site's original script")
    err = _lua51_syntax_error(text, name)
    if err:
        raise InstallError(f"{name} is not valid Lua 5.1 (Debian's Slurm runs Lua 5.1): {err}")
    if not defines.search(text):
        raise InstallError(f"{name} defines no {entry} (a global `function {entry}(...)`): "
                           f"not a {kind} to chain")
    return SiteScript(name, text)


def check_site_job_submit(text: str, name: str) -> SiteScript:
    """The site's script, or :class:`InstallError` saying why it cannot be chained."""
    return _check_site_lua(text, name, "job_submit.lua", _DEFINES_SUBMIT, "slurm_job_submit")


def check_site_cli_filter(text: str, name: str) -> SiteScript:
    """The site's cli_filter.lua, or :class:`InstallError` saying why it cannot be chained."""
    return _check_site_lua(text, name, "cli_filter.lua", _DEFINES_CLI, "slurm_cli_pre_submit")


def _read_site_lua(path: Path, option: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InstallError(f"{option} {path}: cannot read it: {e}") from e


def load_site_job_submit(path: Path) -> SiteScript:
    """Read and check a site's job_submit.lua for ``--chain-job-submit``."""
    return check_site_job_submit(_read_site_lua(path, "--chain-job-submit"), str(path))


def load_site_cli_filter(path: Path) -> SiteScript:
    """Read and check a site's cli_filter.lua for ``--chain-cli-filter``."""
    return check_site_cli_filter(_read_site_lua(path, "--chain-cli-filter"), str(path))


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
    shared_partitions: tuple[SharedPartition, ...] = ()
    """Partitions whose GPUs are shared, in colloc.conf's order (the first takes
    ``--colloc`` jobs without a partition). Empty: colloc is opt-in per job."""
    sm_capacity_pct: int = 0
    """Compute admission (colloc.conf); 0: off."""
    sm_prior_pct: int = 0
    compute_history_file: str = ""

    def __post_init__(self) -> None:
        if self.jobs_mib < self.shard_mib:
            raise InstallError(
                f"gpu_memory_mib = {self.gpu_memory_mib} (usable by jobs: {self.jobs_mib}): "
                f"smaller than one shard ({self.shard_mib} MiB); set gpu_memory_mib, or "
                "lower mps_server_mib / gpu_reserved_mib, in colloc.conf"
            )
        names = [p.name for p in self.shared_partitions]
        if len(set(names)) != len(names):
            raise InstallError(f"shared_partitions: a partition is listed twice ({names})")
        for p in self.shared_partitions:
            if not _PARTITION_NAME.match(p.name):
                raise InstallError(f"shared_partitions: {p.name!r} is not a partition name")
            if p.usable_mib < self.shard_mib:
                raise InstallError(
                    f"shared_partitions: {p.name}: a {p.gpu_memory_mib} MiB GPU leaves "
                    f"{p.usable_mib} MiB for jobs, smaller than one shard ({self.shard_mib} "
                    "MiB); fix its GPU_MIB, or lower mps_server_mib / gpu_reserved_mib")
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
    parts = parse_shared_partitions(cfg.shared_partitions)
    sized = [m for _, m in parts if m]
    mem = gpu_memory_mib or cfg.gpu_memory_mib
    if not mem and parts and len(sized) == len(parts):
        mem = min(sized)  # every shared partition has its size: nothing to detect
    if mem:
        usable = budget(cfg, mem).usable_mib
    else:
        gpus = detect_gpus(cfg)
        small = min(gpus, key=lambda g: budget_of(cfg, g).usable_mib)
        mem, usable = small.memory_total_mib, budget_of(cfg, small).usable_mib
    shared = tuple(
        SharedPartition(name, m, budget(cfg, m).usable_mib) if m
        else SharedPartition(name, mem, usable)
        for name, m in parts
    )
    return SiteSettings(
        shard_mib=cfg.shard_mib,
        gpu_memory_mib=mem,
        usable_mib=usable,
        default_colloc_mib=cfg.default_colloc_mib,
        estimator_command=cfg.estimator_command,
        estimate_timeout_s=cfg.estimate_timeout_s,
        trusted_uids=tuple(sorted(set(trusted_uids) | {0})),
        shared_partitions=shared,
        sm_capacity_pct=cfg.sm_capacity_pct,
        sm_prior_pct=cfg.sm_prior_pct,
        compute_history_file=cfg.compute_history_file,
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


_CHAIN_MARKER = "-- @@SITE_CHAIN@@\n"


def _lua_long_string(text: str) -> str:
    """``text`` as a Lua long string whose closing bracket it does not hold."""
    level = 0
    while f"]{'=' * level}]" in text:
        level += 1
    eq = "=" * level
    # the newline after the opening bracket is dropped by Lua; the one before the
    # closing one only ends the script's last line
    return f"[{eq}[\n{text}\n]{eq}]"


def render_job_submit(s: SiteSettings, chain: SiteScript | None = None) -> str:
    """job_submit.lua with the site's constants (and the site's own script, chained)."""
    uids = ", ".join(f"[{u}] = true" for u in s.trusted_uids)
    names = ", ".join(_lua_string(p.name) for p in s.shared_partitions)
    sizes = ", ".join(f"[{_lua_string(p.name)}] = {p.usable_mib}" for p in s.shared_partitions)
    text = _with_settings(
        _source("lua", "job_submit.lua"),
        [
            f"shard_mib = {s.shard_mib}",
            f"gpu_memory_mib = {s.jobs_mib}",  # what jobs can have of one GPU
            f"default_colloc_mib = {s.default_colloc_mib}",
            f"trusted_uids = {{ {uids} }}",
            f"shared_partitions = {{ {names} }}",  # in order: the first takes --colloc jobs
            f"partition_gpu_mib = {{ {sizes} }}",  # usable MiB of one GPU per partition
            f"sm_capacity_pct = {s.sm_capacity_pct}",  # compute admission; 0: off
            f"sm_prior_pct = {s.sm_prior_pct}",
            f"compute_history_file = {_lua_string(s.compute_history_file)}",
        ],
        "job_submit.lua",
    )
    return _embed_chain(text, chain, "job_submit.lua")


def _embed_chain(text: str, chain: SiteScript | None, kind: str) -> str:
    """``text`` with the site's script written in at its chain marker (or none)."""
    if text.count(_CHAIN_MARKER) != 1:
        raise InstallError(f"{kind}: chain marker not found (damaged package?)")
    if chain is not None:
        block = (f"-- chained: {chain.path}, embedded by colloc admin install\n"
                 f"SITE_CHAIN = {{ name = {_lua_string(chain.path)}, "
                 f"text = {_lua_long_string(chain.text)} }}\n")
        text = text.replace(_CHAIN_MARKER, block, 1)
    return text


def render_cli_filter(s: SiteSettings, chain: SiteScript | None = None) -> str:
    """cli_filter.lua with the estimator's absolute path and timeout (and the site's
    own script, chained)."""
    text = _with_settings(
        _source("lua", "cli_filter.lua"),
        [
            f"estimator = {_lua_string(s.estimator)}",
            f"timeout_s = {max(1, round(s.estimate_timeout_s))}",
            f"timeout_bin = {_lua_string(s.timeout_bin)}",
        ],
        "cli_filter.lua",
    )
    return _embed_chain(text, chain, "cli_filter.lua")


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
        b = budget_of(cfg, g, node_name)  # that node's overheads for this model (gpu_types, nodes)
        b.check()
        total += b.shards_per_gpu
        lines.append(
            f"# Slurm GPU {i}: {g.name} {g.uuid}, {g.memory_total_mib} MiB - {b.reserved_mib} "
            f"reserved - {b.servers} x {b.server_mib} MPS = {b.usable_mib} MiB for shards"
        )
        lines.append(f"{prefix}Name=shard Count={b.shards_per_gpu} File={dev(g)}")
    return "\n".join(lines) + "\n", f"Gres=gpu:{len(order)},shard:{total}"


# ------------------------------------------------------------------ building
HEADER_DIRS = (
    Path("/usr/include/slurm"),  # Debian/Ubuntu libslurm-dev, RHEL slurm-devel
    Path("/usr/include/slurm-wlm"),  # older Debian/Ubuntu slurm-wlm packaging
    Path("/usr/local/include/slurm"),  # Slurm built from source with the default prefix
)
HEADER_PACKAGES = "Debian/Ubuntu: apt-get install libslurm-dev; RHEL/Rocky: dnf install slurm-devel"


def header_candidates(include: Path | None = None, env: Mapping[str, str] | None = None,
                      ) -> list[Path]:
    """Directories that may hold ``spank.h``, in the order they are tried.

    ``include`` (``--slurm-include``) is searched alone: an admin naming the headers of
    the Slurm the site runs must not get a build against another version's headers
    found elsewhere. ``$SLURM_INCLUDE_DIR`` comes before the usual places. Either may
    name the ``slurm`` directory itself or the include directory above it.
    """
    env = os.environ if env is None else env
    if include:
        return [Path(include), Path(include) / "slurm"]
    given = env.get("SLURM_INCLUDE_DIR")
    out = [Path(given), Path(given) / "slurm"] if given else []
    return out + [d for d in HEADER_DIRS if d not in out]


def find_spank_header(include: Path | None = None, env: Mapping[str, str] | None = None,
                      ) -> Path:
    """The directory holding the Slurm headers (``spank.h``) to build against."""
    tried = header_candidates(include, env)
    for d in tried:
        if (d / "spank.h").is_file():
            return d
    raise InstallError(
        "spank.h not found; searched " + ", ".join(str(d / "spank.h") for d in tried)
        + f". Install Slurm's development headers ({HEADER_PACKAGES}), or pass "
        "--slurm-include DIR (or set SLURM_INCLUDE_DIR) for a Slurm built from source"
    )


def header_release(headers: Path) -> SlurmRelease | None:
    """The Slurm release of the headers in ``headers`` (``slurm_version.h``), or None.

    A plugin is built for the release of its headers (``SPANK_PLUGIN`` compiles in
    their ``SLURM_VERSION_NUMBER``, and Slurm loads a plugin only for its own major
    release), so this is what the plugin will be for.
    """
    try:
        text = (headers / "slurm_version.h").read_text(errors="replace")
    except OSError:
        return None
    return parse_header_release(text)


def check_headers_match(headers: Path, running: SlurmRelease) -> SlurmRelease | None:
    """The headers' release; :class:`InstallError` when it is another major release
    than ``running``: the plugin would build, then not load (sbatch would silently
    forget ``--colloc``, the plugin being ``optional``)."""
    built = header_release(headers)
    if built is not None and not built.same_series(running):
        raise InstallError(
            f"{headers}/spank.h is Slurm {built}'s but this host runs Slurm {running}: a "
            f"plugin built from it would not load. Install Slurm {running.series}'s headers "
            f"({HEADER_PACKAGES}) or pass --slurm-include DIR")
    return built


def build_spank_plugin(dest: Path, *, cc: str | None = None,
                       include: Path | None = None) -> Path:
    """Compile the SPANK plugin against the installed Slurm headers into ``dest``."""
    compiler = cc or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise InstallError("no C compiler found (apt-get install gcc)")
    headers = find_spank_header(include)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="colloc-spank-") as tmp:
        t = Path(tmp)
        src, vmap = t / "colloc_spank.c", t / "colloc_spank.map"
        src.write_text(_source("spank", "colloc_spank.c"))
        vmap.write_text(_source("spank", "colloc_spank.map"))
        # the source and spank.h itself include <slurm/...>: a "slurm" link to the
        # header directory found makes that resolve whatever the directory is called
        inc = t / "include"
        inc.mkdir()
        (inc / "slurm").symlink_to(headers.resolve(), target_is_directory=True)
        out = t / PLUGIN_NAME
        cp = subprocess.run(
            [compiler, *CFLAGS, f"-I{inc}", f"-Wl,--version-script={vmap}", "-o", str(out),
             str(src)],
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
    plugin_release: SlurmRelease | None = None
    """The Slurm release of the headers the plugin was built against (None: unknown)."""


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
    cc: str | None = None, include: Path | None = None, chain: SiteScript | None = None,
    slurm_release: SlurmRelease | None = None, cli_chain: SiteScript | None = None,
) -> InstallResult:
    """Build the plugin into ``lib_dir``; write the Lua filters and plugstack drop-in.

    ``conf_dir`` is the directory of slurm.conf (Slurm loads ``job_submit.lua`` and
    ``cli_filter.lua`` from there). plugstack: ``plugstack.conf.d/colloc.conf`` is
    always written; ``plugstack.conf`` is created (including the drop-in directory)
    when missing, and left alone with a note when it exists without that include.
    ``chain``: the site's own job_submit.lua, embedded to run first; when it is the
    file being replaced, a copy is kept as ``job_submit.lua.pre-colloc``.
    ``cli_chain``: the same for the site's cli_filter.lua (``cli_filter.lua.pre-colloc``).
    ``slurm_release``: the release this site runs (``colloc admin install`` detects
    it); headers of another major release are refused before anything is written.
    """
    res = InstallResult()
    js_text = render_job_submit(settings, chain)  # before building: fail early
    cf_text = render_cli_filter(settings, cli_chain)
    if slurm_release is not None:
        check_headers_match(find_spank_header(include), slurm_release)
    conf_dir.mkdir(parents=True, exist_ok=True)
    plugin = build_spank_plugin(lib_dir / PLUGIN_NAME, cc=cc, include=include)
    res.written.append(plugin)
    res.plugin_release = plugin_release(plugin.read_bytes())  # what doctor will read
    for path, text, site_script in (
        (conf_dir / "job_submit.lua", js_text, chain),
        (conf_dir / "cli_filter.lua", cf_text, cli_chain),
    ):
        _write(path, text, force=force or _keep_chained(path, site_script, res))
        res.written.append(path)
    dropin = plugstack_dropin(conf_dir)
    dropin.parent.mkdir(exist_ok=True)
    _write(dropin, f"# slurm-colloc: sbatch --colloc\n{plugstack_line(plugin)}\n", force=True)
    res.written.append(dropin)
    plugstack = conf_dir / "plugstack.conf"
    include_line = plugstack_include(conf_dir)
    if not plugstack.exists():
        plugstack.write_text(f"# written by slurm-colloc\n{include_line}\n")
        res.written.append(plugstack)
    elif include_line not in plugstack.read_text(errors="replace"):
        res.notes.append(f"add this line to {plugstack}: {include_line}")
    res.slurm_conf_lines = slurm_conf_lines(conf_dir, plugstack)
    return res


def _keep_chained(path: Path, chain: SiteScript | None, res: InstallResult) -> bool:
    """Whether ``path`` is the site's script the admin chained (it may be replaced: it
    lives on inside colloc's); a copy is kept as ``<name>.pre-colloc``."""
    if chain is None or not path.exists() or path.resolve() != Path(chain.path).resolve():
        return False
    backup = path.with_name(f"{path.name}.pre-colloc")
    if not backup.exists():
        shutil.copy2(path, backup)
        res.written.append(backup)
    res.notes.append(f"{path} now holds the site's script chained before colloc's; "
                     f"the original is kept as {backup}")
    return True


def plugstack_dropin(conf_dir: Path) -> Path:
    """The plugstack drop-in colloc owns (a site's plugstack.conf stays the site's)."""
    return conf_dir / "plugstack.conf.d" / "colloc.conf"


def plugstack_include(conf_dir: Path) -> str:
    """The line of plugstack.conf that loads the drop-ins."""
    return f"include {plugstack_dropin(conf_dir).parent}/*.conf"


# ------------------------------------------------------------------ the site's plan
SELECT_TYPE_PARAMETERS = "SelectTypeParameters=CR_Core_Memory,LL_SHARED_GRES"
CGROUP_JOB_ID_PATHS = "CgroupJobIdPaths=yes"
"""cgroup.conf, 26.05+: job cgroup directories named job_<id> (as the prolog looks them
up, :func:`slurm_colloc.gpu.nvml.slurm_job_cgroup`), not by SLUID."""
SITE_WIDE_KEYS = ("selecttype=", "selecttypeparameters=", "grestypes=")
"""slurm.conf settings colloc recommends but a site uses for more than colloc: never
listed for removal by ``colloc admin uninstall``."""
NODE_SCRIPTS = {"Prolog": "colloc-prolog", "TaskProlog": "colloc-task-prolog",
                "Epilog": "colloc-epilog"}


def node_script_paths(bin_dir: Path | None = None) -> dict[str, Path]:
    """slurm.conf key -> console script, next to the running Python (the venv's).

    Slurm runs these as root with an empty PATH, so slurm.conf needs absolute paths, and
    the same path must exist on every GPU node (install colloc there the same way).
    """
    d = bin_dir or Path(sys.executable).parent
    return {k: d / v for k, v in NODE_SCRIPTS.items()}


def site_slurm_conf(conf_dir: Path, bin_dir: Path | None = None,
                    hooks: site_hooks.Hooks | None = None) -> list[str]:
    """Everything slurm.conf needs, with ``#`` lines saying why where it is not obvious.

    ``hooks``: the site's slurm.conf as it is (:func:`slurm_colloc.site.chain.read_hooks`):
    its own Prolog/Epilog lines and plugin lists are kept, colloc's added beside them.
    """
    scripts = node_script_paths(bin_dir)
    h = hooks or {}
    return [
        "SelectType=select/cons_tres",
        "# LL_SHARED_GRES (23.11+): a shard job goes to the node's least-loaded GPU, so",
        "# co-located jobs spread over the GPUs (less interference, fewer jobs hit by one",
        "# GPU's MPS fault) instead of filling GPU 0 first; without it whole GPUs stay",
        "# free longer. Keep your site's CR_* value and append LL_SHARED_GRES",
        SELECT_TYPE_PARAMETERS,
        "GresTypes=gpu,shard",
        *slurm_conf_lines(conf_dir)[:1],
        *site_hooks.list_line(h, "CliFilterPlugins", ["lua"]),
        *site_hooks.list_line(h, "JobSubmitPlugins", ["lua"]),
        *site_hooks.node_script_lines(h, scripts),
        "# Alloc: the prolog runs when the job is allocated (it starts the job's MPS",
        "# client limits before any step); Contain: the job's cgroup exists from the",
        "# start, so the hard GPU-memory limit holds every process of the job",
        *site_hooks.list_line(h, "PrologFlags", ["Alloc", "Contain"]),
        "# also needed: ProctrackType=proctrack/cgroup, and in cgroup.conf",
        "# ConstrainDevices=yes (a shard job sees only its GPU's device file);",
        f"# on 26.05+ also {CGROUP_JOB_ID_PATHS} in cgroup.conf: the prolog finds the job's",
        "# cgroup v2 directory as job_<id> for the hard GPU-memory limit (26.05 names it by SLUID)",
    ]


@dataclass(frozen=True)
class NodeType:
    """One GPU size of the site and what gres.conf declares for it."""

    gpu_memory_mib: int
    usable_mib: int
    shards_per_gpu: int


def node_types(cfg: CollocConfig, gpu_memory_mib: Sequence[int]) -> list[NodeType]:
    """Per GPU size, the shards of one GPU (:mod:`slurm_colloc.gpu.budget`)."""
    out = []
    for mem in sorted(set(gpu_memory_mib)):
        b = budget(cfg, mem)
        out.append(NodeType(mem, b.usable_mib, b.shards_per_gpu))
    return out


def planned_files(conf_dir: Path, lib_dir: Path) -> list[tuple[Path, str]]:
    """(file, what it is) that ``install --apply`` writes, in order."""
    return [
        (lib_dir / PLUGIN_NAME, "SPANK plugin (sbatch --colloc), built against spank.h"),
        (conf_dir / "job_submit.lua", "job_submit filter (slurmctld)"),
        (conf_dir / "cli_filter.lua", "cli_filter (sbatch/salloc/srun on login nodes)"),
        (plugstack_dropin(conf_dir), "plugstack drop-in loading the plugin"),
        (conf_dir / "plugstack.conf", "only if missing; else add the include line"),
    ]


def scope_lines(settings: SiteSettings, chain: SiteScript | None = None) -> list[str]:
    """What job_submit.lua will touch, in words (dry run and --apply)."""
    if settings.shared_partitions:
        out = ["shared partitions (their one-GPU jobs become whole GPUs as shards; "
               "--colloc jobs without -p go to the first that holds them):"]
        out += [f"  {p.name}: {p.gpu_memory_mib} MiB GPU, {p.usable_mib} MiB for jobs, "
                f"{p.shards_per_gpu(settings.shard_mib)} shards per GPU"
                for p in settings.shared_partitions]
        out.append("jobs in other partitions are never touched")
    else:
        out = ["shared partitions: none (opt-in: only --colloc and --gres=shard jobs are "
               "handled; other GPU jobs are left as submitted)"]
    if chain is not None:
        out.append(f"chained: {chain.path} (embedded; its slurm_job_submit runs first)")
    return out


def compute_admission_lines(s: SiteSettings) -> list[str]:
    """What the plan says about compute admission (docs/admin.md section 14)."""
    if s.sm_capacity_pct <= 0:
        return ["# compute admission: off (sm_capacity_pct = 0): shards are memory alone"]
    return [f"# compute admission: on, sm_capacity_pct = {s.sm_capacity_pct}, prior "
            f"{s.sm_prior_pct} %; slurmctld reads {s.compute_history_file}: write it as "
            "root from a timer, `colloc admin compute-history --write`"]


def render_plan(
    conf_dir: Path, lib_dir: Path, settings: SiteSettings, types: Sequence[NodeType] = (),
    *, bin_dir: Path | None = None, headers: Path | str | None = None,
    chain: SiteScript | None = None, slurm_release: SlurmRelease | None = None,
    hooks: site_hooks.Hooks | None = None, cli_chain: SiteScript | None = None,
) -> str:
    """The whole site set-up as text, per role: what ``--apply`` writes, what to add.

    ``hooks``: the site's slurm.conf as it is: its hooks are kept beside colloc's.
    """
    slurm_conf = conf_dir / "slurm.conf"
    plugin = lib_dir / PLUGIN_NAME
    out = ["# slurm-colloc site set-up (dry run: nothing written; --apply writes the files)",
           f"# shard = {settings.shard_mib} MiB; estimator (cli_filter) = {settings.estimator}",
           f"# Slurm: {slurm_release or 'not checked'} (supported: {SUPPORTED_RANGE})",
           "", f"## slurm.conf ({slurm_conf}; the same file on every host), then "
           "`scontrol reconfigure`", BEGIN_MARK, *site_slurm_conf(conf_dir, bin_dir, hooks),
           END_MARK, ""]
    out += ["## files `colloc admin install --apply` writes (run it on the controller)"]
    out += [f"{p}  # {what}" for p, what in planned_files(conf_dir, lib_dir)]
    built = header_release(Path(headers)) if headers else None
    out += [f"# Slurm headers for the plugin: {headers or 'NOT FOUND (see --slurm-include)'}"
            + (f" (Slurm {built})" if built else ""),
            "", f"## {conf_dir / 'plugstack.conf'} (written when missing; else add this line)",
            plugstack_include(conf_dir),
            f"## {plugstack_dropin(conf_dir)} (written)", plugstack_line(plugin), ""]
    what = (f"--colloc jobs into shards of {settings.jobs_mib} MiB GPUs "
            f"({settings.shards_per_gpu} shards per GPU)" if not settings.shared_partitions
            else "--colloc jobs and the shared partitions' GPU jobs into shards")
    out += ["## controller (slurmctld)",
            f"job_submit.lua next to slurm.conf ({conf_dir}/job_submit.lua); rewrites {what}",
            *(f"# {line}" for line in scope_lines(settings, chain)),
            *compute_admission_lines(settings), ""]
    out += ["## login / submit hosts",
            f"cli_filter.lua in {conf_dir}/, {plugin} and the plugstack files as above;",
            f"colloc installed so that {settings.estimator} exists",
            *([f"# chained: {cli_chain.path} (embedded; its slurm_cli_* functions run "
               "first)"] if cli_chain else []), ""]
    out += ["## GPU nodes (slurmd)",
            f"{plugin} and the plugstack files as above;",
            *(f"{v}" + "  # must exist on every GPU node" for v in
              node_script_paths(bin_dir).values()),
            "gres.conf: run `colloc admin gres-conf --node-name NODE` on one node of each "
            "GPU type; add its Gres= value to that NodeName line in slurm.conf"]
    if types:
        out += ["# shards per GPU by GPU size (usable = total less driver reserve and MPS "
                "servers):"]
        out += [f"#   {t.gpu_memory_mib} MiB GPU: {t.usable_mib} MiB usable, "
                f"Name=shard Count={t.shards_per_gpu} per GPU" for t in types]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------ uninstalling
def carries_marker(path: Path) -> bool:
    """Whether colloc wrote ``path``: text files name :data:`MARKER` in their first lines,
    the plugin in its option help (a string constant of the binary)."""
    try:
        data = path.read_bytes()
    except OSError:
        return False
    head = data if path.suffix == ".so" else data[:400]
    return MARKER.encode() in head


@dataclass
class UninstallPlan:
    """What ``colloc admin uninstall`` removes and what the admin must take out by hand."""

    remove: list[Path] = field(default_factory=list)
    foreign: list[Path] = field(default_factory=list)
    """Files at colloc's paths that colloc did not write: never removed."""
    slurm_conf_lines: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


BEGIN_MARK = "# BEGIN slurm-colloc (colloc admin uninstall lists the lines up to END)"
END_MARK = "# END slurm-colloc"
"""The block the install plan prints around slurm.conf's lines: pasted with them, it
tells ``colloc admin uninstall`` exactly which lines are colloc's."""


def _is_node_script(line: str) -> bool:
    """``Prolog=`` / ``Epilog=`` / ``TaskProlog=`` naming one of colloc's own scripts."""
    key, _, value = line.partition("=")
    name = NODE_SCRIPTS.get(key.strip())
    return name is not None and Path(value.split("#")[0].strip()).name == name


def colloc_conf_lines(text: str, ours: Sequence[str]) -> list[str]:
    """slurm.conf's lines that are colloc's, by exact markers only (pure).

    A line counts when it sits between :data:`BEGIN_MARK` and :data:`END_MARK`, is one
    of the lines the install plan prints (``ours``, compared whole), or sets a node
    script key to one of colloc's scripts by name. Never by a substring: a site whose
    paths or cluster name contain "colloc" keeps every line of its own.
    """
    out: list[str] = []
    inside = False
    exact = {" ".join(ln.split()) for ln in ours}
    for raw in text.splitlines():
        s = raw.strip()
        if s.startswith(BEGIN_MARK.split(" (")[0]):
            inside = True
        elif s.startswith(END_MARK):
            inside = False
        elif s.lower().startswith(SITE_WIDE_KEYS):
            continue  # recommended by colloc, used by the site for more than colloc
        elif s and not s.startswith("#") and (
                inside or " ".join(s.split()) in exact or _is_node_script(s)):
            out.append(s)
    return out


def plan_uninstall(conf_dir: Path, lib_dir: Path, bin_dir: Path | None = None,
                   ) -> UninstallPlan:
    """Find colloc's files (marker only) and slurm.conf's colloc lines."""
    plan = UninstallPlan()
    for path, _ in planned_files(conf_dir, lib_dir):
        if path.exists():
            (plan.remove if carries_marker(path) else plan.foreign).append(path)
    slurm_conf = conf_dir / "slurm.conf"
    ours = [ln for ln in site_slurm_conf(conf_dir, bin_dir)
            if not ln.startswith("#") and not ln.lower().startswith(SITE_WIDE_KEYS)]
    if slurm_conf.exists():
        plan.slurm_conf_lines = colloc_conf_lines(slurm_conf.read_text(errors="replace"),
                                                  ours)
    plugstack = conf_dir / "plugstack.conf"
    if plugstack in plan.foreign and plugstack_include(conf_dir) in plugstack.read_text(
        errors="replace"
    ):
        plan.notes.append(f"the site's {plugstack}: remove {plugstack_include(conf_dir)}")
    return plan


def uninstall(plan: UninstallPlan) -> list[Path]:
    """Remove the plan's files, re-checking each for the marker; returns those removed."""
    removed = []
    for path in plan.remove:
        if path.exists() and carries_marker(path):
            path.unlink()
            removed.append(path)
    for path in plan.remove:
        d = path.parent
        if d.name == "plugstack.conf.d" and d.exists() and not any(d.iterdir()):
            d.rmdir()
    return removed
