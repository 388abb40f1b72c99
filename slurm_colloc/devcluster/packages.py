"""Make sure the Debian packages a devcluster runs on are installed."""

from __future__ import annotations

import collections
import logging
import os
import subprocess

log = logging.getLogger("colloc.devcluster")

PACKAGES = (
    "slurmctld",
    "slurmd",
    "slurmdbd",
    "slurm-client",
    "munge",
    "mariadb-server",
    "libslurm-dev",
    "gcc",
    "lua5.1",
)


class PackageError(RuntimeError):
    """Packages are missing and could not be installed."""


def missing_packages(packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """Packages dpkg does not report as installed."""
    cp = subprocess.run(
        ["dpkg-query", "-W", "-f=${Package} ${db:Status-Abbrev}\\n", *packages],
        capture_output=True, text=True, check=False,
    )
    installed = {
        line.split()[0] for line in cp.stdout.splitlines()
        if len(line.split()) >= 2 and line.split()[1].startswith("ii")
    }
    return [p for p in packages if p not in installed]


APT_TAIL_LINES = 40
"""Last lines of apt's output kept for the error message."""


def _apt(argv: list[str], env: dict[str, str]) -> tuple[int, list[str]]:
    """Run apt-get, logging its progress line by line (downloads and unpacking take
    minutes: the user sees them instead of a silent wait); (exit code, last lines)."""
    log.info("running %s", " ".join(argv))
    tail: collections.deque[str] = collections.deque(maxlen=APT_TAIL_LINES)
    with subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL, text=True, errors="replace") as p:
        assert p.stdout is not None
        for line in p.stdout:
            line = line.rstrip()
            if line:
                tail.append(line)
                log.info("apt: %s", line)
        rc = p.wait()
    return rc, list(tail)


def ensure_packages(packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """Install what is missing with apt-get (root); return what was installed."""
    missing = missing_packages(packages)
    if not missing:
        return []
    if os.geteuid() != 0:
        raise PackageError(f"missing Debian packages {' '.join(missing)}; install them as root")
    log.info("installing %s (apt-get; a few minutes on a fresh machine)", " ".join(missing))
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # services are started by us, not by the package scripts
    policy = "/usr/sbin/policy-rc.d"
    created_policy = False
    if not os.path.exists(policy):
        with open(policy, "w") as f:
            f.write("#!/bin/sh\nexit 101\n")
        os.chmod(policy, 0o755)  # noqa: S103 - policy-rc.d must be executable
        created_policy = True
    try:
        tail: list[str] = []
        for attempt in ("install", "update-then-install"):
            if attempt == "update-then-install":
                log.info("apt-get install failed; updating the package lists, then again")
                _apt(["apt-get", "update", "-q"], env)
            rc, tail = _apt(
                ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing], env)
            if rc == 0:
                return missing
        raise PackageError(
            f"apt-get install {' '.join(missing)} failed:\n" + "\n".join(tail)[-2000:]
        )
    finally:
        if created_policy:
            os.unlink(policy)
