"""The gate in front of the lab's subcommands (``colloc devcluster``, ``colloc demo``).

The runtime a site installs (``pip install slurm-colloc``) carries the lab's code but not
its extra (``slurm-colloc[lab]``: numpy, pandas, matplotlib), and never imports it: the
CLI names the lab commands without loading them (``colloc --help`` lists them from
:data:`LAB_COMMANDS`), and running one in a runtime-only install stops with one line
naming the extra instead of an ImportError traceback. Only distribution metadata is
read here (no import of the lab or of its dependencies).
"""

from __future__ import annotations

import importlib.metadata
import re

import click

DIST = "slurm-colloc"
EXTRA = "lab"
INSTALL_HINT = f"pip install '{DIST}[{EXTRA}]'"

LAB_COMMANDS: dict[str, str] = {
    "demo": "The devcluster running collocated jobs end to end (root; lab).",
    "devcluster": "A private Slurm cluster with simulated GPUs (root; lab).",
}
"""Lab subcommand -> the one-line help ``colloc --help`` shows without importing it."""

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_EXTRA = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def extra_requirements(requires: list[str], extra: str = EXTRA) -> list[str]:
    """Distribution names that ``extra`` adds, from ``Requires-Dist`` lines."""
    out = []
    for req in requires:
        marker = _EXTRA.search(req)
        name = _NAME.match(req)
        if marker and marker.group(1) == extra and name:
            out.append(name.group(1))
    return out


def missing() -> list[str]:
    """The lab extra's distributions not installed here ([] also when slurm-colloc has
    no metadata: a bare checkout on sys.path is a developer's, who has the lab)."""
    try:
        requires = importlib.metadata.requires(DIST) or []
    except importlib.metadata.PackageNotFoundError:
        return []
    gone = []
    for name in extra_requirements(requires):
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            gone.append(name)
    return gone


def refusal(command: str, why: str) -> click.ClickException:
    """The one-line error of a lab command in an install without the lab."""
    return click.ClickException(
        f"'{command}' is part of the lab (devcluster, demo, simulated GPUs), which this "
        f"runtime install leaves out ({why}): {INSTALL_HINT}")


def require(command: str) -> None:
    """Raise :func:`refusal` unless the lab extra is installed."""
    gone = missing()
    if gone:
        raise refusal(command, f"missing {', '.join(gone)}")
