"""devcluster up: apt's progress is shown line by line, not hidden until it ends."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from slurm_colloc.devcluster import packages


def test_apt_output_is_logged_as_it_comes_and_kept_for_errors(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fake = tmp_path / "apt-get"
    fake.write_text("#!/bin/sh\necho 'Get:1 http://deb slurmd 1 MB'\necho 'Unpacking slurmd'\n"
                    "echo 'E: broken' >&2\nexit 3\n")
    fake.chmod(0o755)
    with caplog.at_level(logging.INFO, logger="colloc.devcluster"):
        rc, tail = packages._apt([str(fake), "install"], dict(os.environ))
    assert rc == 3 and tail == ["Get:1 http://deb slurmd 1 MB", "Unpacking slurmd", "E: broken"]
    logged = [r.getMessage() for r in caplog.records]
    assert "apt: Unpacking slurmd" in logged and "apt: E: broken" in logged
