"""The suite's skip policy (tests/conftest.py): an undocumented skip turns the run red."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import allowed

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"


def test_only_documented_reasons_are_allowed_as_root() -> None:
    assert allowed("could not import 'torch': No module named 'torch'", root=True)
    assert not allowed("needs root and the system user colloc-u1", root=True)
    assert not allowed("no headless Chromium", root=True)
    assert allowed("needs root and the system user colloc-u1", root=False)
    assert not allowed("data not present", root=False)


def _run(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_x.py").write_text("import pytest\n\n" + body)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                          check=False, timeout=120)


def test_an_undocumented_skip_fails_the_run(tmp_path: Path) -> None:
    r = _run(tmp_path, "def test_a():\n    pytest.skip('data not present')\n")
    assert r.returncode == 1, r.stdout
    assert "undocumented skips" in r.stdout and "data not present" in r.stdout


def test_a_documented_skip_passes(tmp_path: Path) -> None:
    r = _run(tmp_path, "def test_a():\n    pytest.importorskip('torch_not_here_xyz', "
                       "reason='torch is optional')\n")
    assert r.returncode == 0, r.stdout
