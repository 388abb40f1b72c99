"""Make sure the Debian packages a devcluster runs on are installed."""

from __future__ import annotations

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


def ensure_packages(packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """Install what is missing with apt-get (root); return what was installed."""
    missing = missing_packages(packages)
    if not missing:
        return []
    if os.geteuid() != 0:
        raise PackageError(f"missing Debian packages {' '.join(missing)}; install them as root")
    log.info("installing %s", " ".join(missing))
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
        for attempt in ("install", "update-then-install"):
            if attempt == "update-then-install":
                subprocess.run(
                    ["apt-get", "update", "-q"], env=env, capture_output=True, check=False
                )
            cp = subprocess.run(
                ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing],
                env=env, capture_output=True, text=True, check=False,
            )
            if cp.returncode == 0:
                return missing
        raise PackageError(
            f"apt-get install {' '.join(missing)} failed:\n{cp.stderr.strip()[-2000:]}"
        )
    finally:
        if created_policy:
            os.unlink(policy)
