"""The runtime distribution a site installs (issue 26 item 7).

* every third-party import of a runtime module is declared in ``install_requires`` --
  or is optional (guarded by ``except ImportError``, with its extra or the system
  package named here), or sits in a module that belongs to an extra;
* no simulation tool (``colloc-simjob``, the MPS stand-ins) is a console script: the
  lab writes its own launchers (:mod:`slurm_colloc.gpu.sim.tools`);
* ``colloc --version`` and ``colloc-report --version`` say the same version as the
  metadata and ``slurm_colloc.__version__``;
* the lab commands refuse, in one line naming the extra, where the lab is left out,
  and ``colloc --help`` imports no lab code.

The built wheel itself, in a clean venv, is checked by tests/e2e/test_wheel_install.py.
"""

from __future__ import annotations

import ast
import configparser
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from slurm_colloc import __version__, cli
from slurm_colloc.cli import lab
from slurm_colloc.gpu.sim import tools

TOP = Path(__file__).resolve().parents[2]
PKG = TOP / "slurm_colloc"
RUNTIME = ["node", "metrics", "report", "site", "slurm", "accounting", "mps", "oom", "gpu",
           "cli", "estimators"]
LAB_CLI = {"cli/demo_cmd.py", "cli/devcluster_cmd.py"}
"""The CLI modules of the lab's commands (reached only through :mod:`slurm_colloc.cli.lab`)."""
LAB_PREFIXES = ("slurm_colloc.devcluster", "slurm_colloc.bench", "slurm_colloc.demo",
                "slurm_colloc.gpu.sim", "numpy", "pandas", "matplotlib")

IMPORT_TO_DIST = {"click": "click", "rich": "rich", "pynvml": "nvidia-ml-py",
                  "prometheus_client": "prometheus-client", "numpy": "numpy",
                  "torch": "torch", "torchinfo": "torchinfo", "lupa": "lupa"}
"""Import name -> the distribution that provides it (they differ: pynvml)."""
OPTIONAL = {
    "torch": "torch",      # estimators/tracing.py: `colloc estimate --model` only
    "lupa": "dev",         # site/install.py: Lua 5.1 syntax check, else luac5.1
    "DcgmReader": None,    # gpu/dcgm.py: NVIDIA DCGM's own bindings (a system package)
}
"""Optional imports (always under ``except ImportError``) -> the extra declaring them
(None: not on PyPI, installed with the system package)."""
EXTRA_MODULES = {"estimators/calibration.py": "lab", "estimators/attention_fit.py": "lab"}
"""Runtime-tree modules that belong to an extra (offline fits); the runtime never
imports them."""
OFFLINE_SCRIPTS = {"estimators/data/make_attention_data.py"}
"""Scripts shipped with their data and run in a venv of their own (their docstring)."""


def _setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(TOP / "setup.cfg")
    return cfg


def _names(block: str) -> set[str]:
    return {m.group(1).lower() for ln in block.splitlines()
            if (m := re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", ln))}


def _runtime_files() -> list[Path]:
    files = list(PKG.glob("*.py"))
    for pkg in RUNTIME:
        files += [p for p in (PKG / pkg).rglob("*.py") if "sim" not in p.relative_to(PKG).parts]
    return sorted(p for p in files if str(p.relative_to(PKG)) not in LAB_CLI
                  and not p.name.startswith("demo"))


def _guarded(handler: ast.ExceptHandler) -> bool:
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError")
               for n in names)


def _imports(tree: ast.AST, guarded: bool = False) -> list[tuple[str, bool]]:
    """(top-level module, under ``except ImportError``) of every import in ``tree``,
    ``importlib.import_module("literal")`` included."""
    out: list[tuple[str, bool]] = []
    if isinstance(tree, ast.Try):
        inner = guarded or any(_guarded(h) for h in tree.handlers)
        for node in tree.body:
            out += _imports(node, inner)
        for node in [*tree.handlers, *tree.orelse, *tree.finalbody]:
            out += _imports(node, guarded)
        return out
    if isinstance(tree, ast.Import):
        out += [(a.name.split(".")[0], guarded) for a in tree.names]
    elif isinstance(tree, ast.ImportFrom) and tree.level == 0 and tree.module:
        out.append((tree.module.split(".")[0], guarded))
    elif (isinstance(tree, ast.Call) and isinstance(tree.func, ast.Attribute)
          and tree.func.attr == "import_module" and tree.args
          and isinstance(tree.args[0], ast.Constant) and isinstance(tree.args[0].value, str)):
        out.append((tree.args[0].value.split(".")[0], guarded))
    for node in ast.iter_child_nodes(tree):
        out += _imports(node, guarded)
    return out


def _third_party(path: Path) -> list[tuple[str, bool]]:
    return [(m, g) for m, g in _imports(ast.parse(path.read_text()))
            if m not in sys.stdlib_module_names and m not in ("slurm_colloc", "__future__")]


@pytest.mark.parametrize("path", _runtime_files(), ids=lambda p: str(p.relative_to(PKG)))
def test_every_runtime_import_is_declared(path: Path) -> None:
    rel = str(path.relative_to(PKG))
    if rel in OFFLINE_SCRIPTS:
        return
    cfg = _setup_cfg()
    runtime = _names(cfg["options"]["install_requires"])
    extras = {k: _names(v) for k, v in cfg["options.extras_require"].items()}
    for module, guarded in _third_party(path):
        if rel in EXTRA_MODULES:
            assert IMPORT_TO_DIST.get(module) in extras[EXTRA_MODULES[rel]], (rel, module)
            continue
        if module in OPTIONAL:
            assert guarded, f"{rel}: optional {module} must be imported under except ImportError"
            extra = OPTIONAL[module]
            assert extra is None or IMPORT_TO_DIST[module] in extras[extra], (rel, module)
            continue
        dist = IMPORT_TO_DIST.get(module)
        assert dist is not None, f"{rel} imports {module}: name its distribution here"
        assert dist in runtime, f"{rel} imports {module}: add {dist} to install_requires"


def test_the_check_sees_lazy_and_guarded_imports() -> None:
    tree = ast.parse("def f():\n    import numpy\n"
                     "try:\n    import torch\nexcept ImportError:\n    torch = None\n"
                     "importlib.import_module('pynvml')\n")
    assert _imports(tree) == [("numpy", False), ("torch", True), ("pynvml", False)]


def test_modules_of_an_extra_and_offline_scripts_stay_out_of_the_runtime() -> None:
    banned = {"slurm_colloc." + m.removesuffix(".py").replace("/", ".")
              for m in [*EXTRA_MODULES, *OFFLINE_SCRIPTS]}
    for path in _runtime_files():
        if str(path.relative_to(PKG)) in {*EXTRA_MODULES, *OFFLINE_SCRIPTS}:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
                assert not names & banned, (path, names & banned)


def test_no_simulation_tool_is_a_console_script() -> None:
    scripts = _setup_cfg()["options.entry_points"]["console_scripts"]
    names = _names(scripts)
    assert names == {"colloc", "colloc-report", "colloc-prolog", "colloc-task-prolog",
                     "colloc-epilog"}
    assert not names & set(tools.TOOLS) and "gpu.sim" not in scripts


def test_the_labs_launchers_run_the_simulation(tmp_path: Path) -> None:
    made = tools.write_launchers(tmp_path / "lab-bin")
    assert set(made) == set(tools.TOOLS)
    for name, path in made.items():
        assert path.stat().st_mode & 0o777 == 0o755
        head = path.read_bytes()[:4096]
        if name in tools.CLIENT_MODULES and head.startswith(b"\x7fELF"):
            # the C client with the Python stand-in appended (tools.c_launcher)
            assert zipfile.ZipFile(path).read("__main__.py").decode().endswith(
                f"from {tools.TOOLS[name]} import main\n\nsys.exit(main())\n")
        else:
            assert head.startswith((f"#!{sys.executable}\n".encode(),
                                    f"#!{sys.executable} -S\n".encode()))
        cp = subprocess.run([str(path), "--help"], capture_output=True, text=True,
                            cwd=tmp_path, timeout=60, check=False)
        # each its module's own usage (v3 mimics NVIDIA's program, name and all)
        assert cp.returncode == 0 and cp.stdout.startswith("usage" if "v3" not in name
                                                           else "Usage"), (name, cp.stderr)
    again = tools.write_launchers(tmp_path / "lab-bin")
    assert again == made and not list((tmp_path / "lab-bin").glob(".*"))


def test_the_stand_in_mps_client_needs_no_site_and_speaks_the_protocol() -> None:
    """Issue 28: the stand-in's client mode runs in an interpreter without ``site``, so
    it must import the standard library only, and its copies of the wire constants must
    be :mod:`~slurm_colloc.gpu.sim.mps_protocol`'s."""
    from slurm_colloc.gpu.sim import mps_protocol, mps_ui

    assert (mps_ui.SOCKET_NAME, mps_ui.DEFAULT_PIPE_DIR, mps_ui.PIPE_ENV, mps_ui.END) == (
        mps_protocol.SOCKET_NAME, mps_protocol.DEFAULT_PIPE_DIR, mps_protocol.PIPE_ENV,
        mps_protocol.END)
    code = ("import sys; before = set(sys.modules); "
            f"exec(compile(open({mps_ui.__file__!r}).read(), 'mps_ui', 'exec'), {{}}); "
            "print(sorted(m for m in set(sys.modules) - before if m.startswith('slurm')))")
    cp = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                        timeout=60, check=True, cwd="/")
    assert cp.stdout.strip() == "[]"


def _console(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(Path(sys.executable).parent / name), *args],
                          capture_output=True, text=True, timeout=60, check=False, cwd="/")


def test_colloc_and_colloc_report_say_one_version() -> None:
    cfg_version = _setup_cfg()["metadata"]["version"]
    assert cfg_version == __version__
    for name in ("colloc", "colloc-report"):
        cp = _console(name, "--version")
        assert cp.returncode == 0, cp.stderr
        assert cp.stdout.strip() == f"{name}, version {__version__}"


def test_colloc_help_lists_the_lab_but_imports_none_of_it() -> None:
    code = ("import sys\nfrom slurm_colloc.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            f"print([m for m in sys.modules if m.startswith({LAB_PREFIXES!r})])\n")
    cp = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=60, check=False, cwd="/")
    assert cp.returncode == 0, cp.stderr
    assert "devcluster" in cp.stdout and "demo" in cp.stdout and "(root; lab)" in cp.stdout
    assert cp.stdout.strip().splitlines()[-1] == "[]"


def test_a_lab_command_without_the_lab_is_one_line_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(lab, "missing", lambda: ["numpy", "pandas"])
    for argv in (["devcluster", "up"], ["demo"], ["devcluster", "--help"]):
        with pytest.raises(SystemExit) as e:
            cli.main.main(argv, prog_name="colloc")
        assert e.value.code == cli.EXIT_ERROR
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert f"'colloc {argv[0]}' is part of the lab" in err
        assert "pip install 'slurm-colloc[lab]'" in err and "missing numpy, pandas" in err


def test_a_lab_module_that_cannot_import_is_refused_the_same_way(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(lab, "missing", lambda: [])
    monkeypatch.setitem(cli.SUBCOMMANDS, "demo", "slurm_colloc.no_such_lab_module:demo")
    with pytest.raises(SystemExit):
        cli.main.main(["demo"], prog_name="colloc")
    err = capsys.readouterr().err
    assert "cannot import slurm_colloc.no_such_lab_module" in err
    assert "pip install 'slurm-colloc[lab]'" in err and "Traceback" not in err


def test_the_lab_extra_is_read_from_the_metadata() -> None:
    reqs = ['click>=8.1', 'numpy>=1.24; extra == "lab"', "pandas>=2.0 ; extra=='lab'",
            'torch>=2.5; extra == "torch"']
    assert lab.extra_requirements(reqs) == ["numpy", "pandas"]
    declared = _names(_setup_cfg()["options.extras_require"]["lab"])
    import importlib.metadata

    here = set(lab.extra_requirements(importlib.metadata.requires("slurm-colloc") or []))
    assert here == declared  # the installed metadata is this setup.cfg's
    assert lab.missing() == []  # the dev venv has the lab
