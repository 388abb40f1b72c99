"""The wheel carries every module: ``packages = find:`` skips a folder without
``__init__.py`` (slurm_colloc/gpu was missing from non-editable installs: the epilog's
record and the collector died with ModuleNotFoundError on a site's nodes)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_python_folder_is_a_package() -> None:
    missing = [
        str(d.relative_to(ROOT))
        for top in ("slurm_colloc",)
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


def test_the_license_the_metadata_names_ships_and_numpy_is_declared() -> None:
    """issue 26 (packaging): Apache-2.0 named in setup.cfg with no LICENSE file, and numpy
    imported by the estimators' fitting modules without being declared anywhere."""
    import configparser

    root = Path(__file__).resolve().parents[2]
    cfg = configparser.ConfigParser()
    cfg.read(root / "setup.cfg")
    assert cfg["metadata"]["license"] == "Apache-2.0"
    assert cfg["metadata"]["license_files"].strip() == "LICENSE"
    assert "Apache License" in (root / "LICENSE").read_text()[:200]
    assert (root / "CHANGELOG.md").is_file()
    extras = cfg["options.extras_require"]
    for extra in ("dev", "lab", "bench"):
        assert "numpy" in extras[extra], extra
