"""Extra packages of a release's root filesystem reach an existing root without a rebuild."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_colloc.devcluster import rootfs

STATUS = """Package: slurmd
Status: install ok installed
Version: 26.05

Package: prometheus
Status: deinstall ok config-files
Version: 3.5

Package: prometheus-node-exporter
Status: install ok installed
Description: node exporter
 Package: prometheus
"""


def root_with(tmp_path: Path, status: str) -> Path:
    root = tmp_path / "26.05"
    (root / "var/lib/dpkg").mkdir(parents=True)
    (root / "var/lib/dpkg/status").write_text(status)
    return root


def test_installed_means_dpkg_says_installed(tmp_path: Path) -> None:
    root = root_with(tmp_path, STATUS)
    assert rootfs.installed_in(root, rootfs.PROMETHEUS_PACKAGES) == {"prometheus-node-exporter"}
    assert rootfs.installed_in(tmp_path / "none", ("slurmd",)) == set()


def test_missing_extras_are_installed_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = root_with(tmp_path, STATUS)
    ran: list[str] = []
    monkeypatch.setattr(rootfs, "mount", lambda r: None)
    monkeypatch.setattr(rootfs, "_stream", lambda argv, what: ran.append(argv[-1]))
    rel = rootfs.RELEASES["26.05"]
    rootfs.ensure_extra_packages(rel, root)
    assert len(ran) == 1 and ran[0].endswith("--no-install-recommends prometheus")
    ran.clear()
    done = STATUS.replace("deinstall ok config-files", "install ok installed")
    (root / "var/lib/dpkg/status").write_text(done)
    rootfs.ensure_extra_packages(rel, root)
    rootfs.ensure_extra_packages(rootfs.RELEASES["24.11"], root)
    assert ran == []


def test_extras_do_not_change_the_recipe() -> None:
    """A root built before an extra package was listed is kept (and completed)."""
    rel = rootfs.RELEASES["26.05"]
    assert rel.extra_packages == rootfs.PROMETHEUS_PACKAGES
    bare = rootfs.Release(rel.version, rel.suite, rel.script, rel.check_valid_until)
    assert rootfs.recipe(rel) == rootfs.recipe(bare)
