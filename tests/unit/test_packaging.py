"""The wheel carries every module: ``packages = find:`` skips a folder without
``__init__.py`` (slurm_colloc/gpu was missing from non-editable installs: the epilog's
record and the collector died with ModuleNotFoundError on a site's nodes)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_python_folder_is_a_package() -> None:
    missing = [
        str(d.relative_to(ROOT))
        for top in ("slurm_colloc", "estimators")
        for d in [ROOT / top, *(p for p in (ROOT / top).rglob("*") if p.is_dir())]
        if "__pycache__" not in d.parts and any(d.glob("*.py"))
        and not (d / "__init__.py").exists()
    ]
    assert missing == []


def test_every_console_script_names_an_importable_callable() -> None:
    """A typo in setup.cfg only shows on a site, where the prolog then fails to start."""
    import configparser
    import importlib

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    scripts = [ln.split("=", 1) for ln in
               cfg["options.entry_points"]["console_scripts"].strip().splitlines()]
    names = {n.strip() for n, _ in scripts}
    assert {"colloc", "colloc-report", "colloc-prolog", "colloc-task-prolog",
            "colloc-epilog"} <= names
    for name, target in scripts:
        module, func = target.strip().split(":")
        assert callable(getattr(importlib.import_module(module), func)), name
