"""The systemd unit of the node collector: rendered for this install, and installed.

The unit ships as a template in the package (``site/systemd/colloc-collector.service``)
with two holes: ``@PYTHON@``, the interpreter of this install (the collector is
``python -I -m slurm_colloc.metrics.collector --stay``: isolated, so nothing outside
the install is imported as root), and ``@ENVIRONMENT@``, the ``COLLOC_CONF`` of the
admin who renders it when that is not the default path. ``colloc admin
collector-unit`` prints it; ``--install`` writes it to ``/etc/systemd/system`` and
says what to run next (daemon-reload, enable, ``collector_unit`` in colloc.conf).
"""

from __future__ import annotations

import os
import sys
from importlib import resources
from pathlib import Path

from slurm_colloc import config as config_mod

UNIT_NAME = "colloc-collector.service"
UNIT_DIR = Path("/etc/systemd/system")
TEMPLATE = "systemd/" + UNIT_NAME


def template() -> str:
    """The unit as shipped (with its ``@...@`` holes)."""
    return resources.files("slurm_colloc.site").joinpath(TEMPLATE).read_text()


def render(python: str | None = None, conf: str | None = None) -> str:
    """The unit for this install: ``python`` (default: this interpreter) and, when
    ``conf`` (default: ``$COLLOC_CONF``) is not the default path, its environment."""
    python = python or sys.executable
    if conf is None:
        conf = os.environ.get(config_mod.ENV_VAR)
    env = ""
    if conf and Path(conf) != config_mod.DEFAULT_PATH:
        env = f"Environment={config_mod.ENV_VAR}={_quote(conf)}"
    text = template().replace("@PYTHON@", _quote(python))
    return text.replace("@ENVIRONMENT@\n", env + "\n" if env else "")


def _quote(value: str) -> str:
    """A path for a unit file; refuses what systemd would split or expand."""
    if not value or any(c.isspace() or c in "\"'\\$%;" for c in value) or not value.isprintable():
        raise ValueError(f"{value!r}: not a path a unit file can hold unquoted")
    return value


def install(unit_dir: Path = UNIT_DIR, text: str | None = None) -> Path:
    """Write the unit (0644) into ``unit_dir``; returns its path."""
    path = unit_dir / UNIT_NAME
    data = render() if text is None else text
    tmp = path.with_name(f".{UNIT_NAME}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        os.fchmod(fd, 0o644)
        os.write(fd, data.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path
