"""The runtime a site installs on its nodes never imports the lab (issue 13, item 3).

Runtime: what runs as root on nodes, inside the submit path or for users (node scripts,
metrics, report, site, Slurm adapter, accounting, MPS, OOM detection, the GPU backend
interface and NVML, estimators). Lab: the devcluster, the demo, the benchmark harness and
the GPU simulation. The simulation is reached only through ``gpu/select.py`` when a
site's colloc.conf names ``gpu_backend = "sim"`` (never as a fallback), so that one
lazy import is the only allowed crossing. Checked on the source (every import
statement, at any depth), so a late import inside a function counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "slurm_colloc"
RUNTIME = ["node", "metrics", "report", "site", "slurm", "accounting", "mps", "oom", "gpu"]
RUNTIME_FILES = ["config.py", "procfs.py", "units.py", "detach.py", "safe_tree.py", "owner_read.py",
                 "log_escape.py"]
LAB = ("slurm_colloc.devcluster", "slurm_colloc.bench", "slurm_colloc.demo",
       "slurm_colloc.demo_site", "slurm_colloc.demo_attacks", "slurm_colloc.demo_monitoring",
       "slurm_colloc.demo_faults",
       "slurm_colloc.gpu.sim",
       "slurm_colloc.selftest")
ALLOWED = {("gpu/select.py", "slurm_colloc.gpu.sim.backend"),
           # `colloc selftest`: a site's check on its real GPUs, loaded when run
           ("cli/selftest_cmd.py", "slurm_colloc.selftest")}
LAB_CLI = ["cli/demo_cmd.py", "cli/devcluster_cmd.py"]
"""The lab's own commands: reached only through cli/lab.py's gate (issue 26 item 7)."""


def _runtime_files() -> list[Path]:
    files = [PKG / f for f in RUNTIME_FILES]
    for pkg in RUNTIME:
        files += [p for p in (PKG / pkg).rglob("*.py") if "sim" not in p.relative_to(PKG).parts]
    files += [p for p in (PKG / "cli").glob("*.py") if str(p.relative_to(PKG)) not in LAB_CLI]
    return sorted(files)


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return out


@pytest.mark.parametrize("path", _runtime_files(), ids=lambda p: str(p.relative_to(PKG)))
def test_runtime_module_does_not_import_the_lab(path: Path) -> None:
    rel = str(path.relative_to(PKG))
    bad = sorted({
        m for m in _imports(path)
        if any(m == lab or m.startswith(lab + ".") for lab in LAB) and (rel, m) not in ALLOWED
        and not any((rel, a) in ALLOWED and m.startswith(a) for _, a in ALLOWED)
    })
    assert not bad, f"{rel} imports lab modules {bad}: runtime must not depend on the lab"


def test_the_check_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from slurm_colloc.devcluster import cluster\n")
    assert "slurm_colloc.devcluster" in _imports(f)


def test_pandas_is_not_a_runtime_dependency() -> None:
    """Only the benchmarks import pandas: the runtime does not carry it (setup.cfg)."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(PKG.parent / "setup.cfg")
    runtime = cfg["options"]["install_requires"]
    assert "pandas" not in runtime and "pandas" in cfg["options.extras_require"]["lab"]
    for path in _runtime_files():
        assert not any(m.split(".")[0] == "pandas" for m in _imports(path)), path


def test_the_cli_names_its_lab_commands_only_through_the_gate() -> None:
    """``colloc`` reaches demo/devcluster by name (SUBCOMMANDS), gated by cli/lab.py;
    no runtime CLI module imports them."""
    from slurm_colloc.cli import SUBCOMMANDS
    from slurm_colloc.cli.lab import LAB_COMMANDS

    lab_modules = {SUBCOMMANDS[name].split(":")[0] for name in LAB_COMMANDS}
    assert lab_modules == {"slurm_colloc." + f.removesuffix(".py").replace("/", ".")
                           for f in LAB_CLI}
    for path in _runtime_files():
        assert not set(_imports(path)) & lab_modules, path
