"""Suite-wide policy: the unprivileged test users exist, and nothing skips unannounced.

Two rules (issue 23), for every tier and any test order on a fresh machine:

- **The users are made first.** The security tests act as the site's unprivileged users
  ``colloc-u1`` (attacker) and ``colloc-u2`` (victim). Test modules look them up when
  imported, so they are created in :func:`pytest_configure`, before collection, when
  the suite runs as root (as ``make test`` does); the e2e fixtures give them Slurm
  associations later.
- **A skip is a failure unless its reason is documented here.** :data:`ALLOWED_SKIPS`
  lists the reasons a test may skip on CI; any other skip turns the run red with the
  list of offenders, so a check that silently stops running shows up. Running without
  root (a developer's quick unit run) also allows the root-only reasons, and says so.
"""

from __future__ import annotations

import os
import pwd
import re
import subprocess

import pytest

TEST_USERS = ("colloc-u1", "colloc-u2")
"""Unprivileged users the two-user tests run as (system users, no home)."""

ALLOWED_SKIPS: dict[str, str] = {
    r"\btorch\b": "PyTorch is optional (`pip install torch==2.13.0`, CPU build): the "
                  "tests that trace a real model skip without it",
}
"""Skip reasons (regular expressions) that may appear on CI, each with why."""

ROOT_ONLY_SKIPS = r"root|as other users|second user|two users|setuid|chown|colloc-u1"
"""Reasons that are allowed only when the suite does not run as root."""

_skipped: list[tuple[str, str]] = []


def _ensure_user(name: str) -> None:
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/bin/bash", name],
                       check=True, capture_output=True)


def pytest_configure(config: pytest.Config) -> None:
    """Create the test users before any test module is imported (root only)."""
    if os.geteuid() == 0:
        for name in TEST_USERS:
            _ensure_user(name)


def allowed(reason: str, root: bool) -> bool:
    """Whether a skip with this reason is documented (see :data:`ALLOWED_SKIPS`)."""
    if any(re.search(p, reason) for p in ALLOWED_SKIPS):
        return True
    return not root and re.search(ROOT_ONLY_SKIPS, reason) is not None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Remember every skip (an expected failure is not one)."""
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else str(
            report.longrepr)
        _skipped.append((report.nodeid, reason.removeprefix("Skipped: ")))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run on a skip whose reason is not documented."""
    root = os.geteuid() == 0
    bad = [(n, r) for n, r in _skipped if not allowed(r, root)]
    if bad and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    session.config.stash[_BAD] = bad


_BAD = pytest.StashKey[list[tuple[str, str]]]()


def pytest_terminal_summary(terminalreporter: object, exitstatus: int,
                            config: pytest.Config) -> None:
    """Name the undocumented skips (tests/conftest.py says which reasons are allowed)."""
    bad = config.stash.get(_BAD, [])
    if not bad:
        return
    tr = terminalreporter
    tr.section("undocumented skips (a failure: see tests/conftest.py ALLOWED_SKIPS)")  # type: ignore[attr-defined]
    for nodeid, reason in bad:
        tr.write_line(f"{nodeid}: {reason}")  # type: ignore[attr-defined]
