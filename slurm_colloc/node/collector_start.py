"""How a prolog that finds no collector gets one: systemd's unit, else a detached start.

With ``collector_unit`` set (the unit ``colloc admin collector-unit --install`` writes),
systemd runs the collector: it restarts it when it ends (``Restart=always``) and
logs it to the journal. The prolog then only asks systemd to start the unit, without
waiting for it (``systemctl start --no-block``: a prolog must not block on a unit's
start-up). Where that cannot work (no ``systemctl``, a host not booted with systemd,
a container, or ``systemctl`` failing: unit not installed, no bus) the prolog starts
the collector itself, detached, as it does without a unit, and the fallback is logged.

The choice is one function, :func:`start_collector`, whose ``run`` (the systemctl
call) and ``spawn`` (the detached start) are parameters, so tests drive it with a
fake ``systemctl``. ``systemctl`` is looked for at fixed paths only: the prolog runs
as root with slurmd's environment, and a PATH lookup there is a lookup a site may not
expect.
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Callable, Sequence

log = logging.getLogger("colloc.node.prolog.collector_start")
"""A child of the prolog's logger: the fallback lands in the prolog's log (log_file)."""

SYSTEMCTL_PATHS = ("/usr/bin/systemctl", "/bin/systemctl")
BOOTED_MARK = "/run/systemd/system"
"""Exists only when systemd is PID 1 (what ``sd_booted()`` checks)."""
TIMEOUT_S = 10.0
"""A ``--no-block`` start returns at once; this only bounds a hung bus."""

Runner = Callable[[Sequence[str]], tuple[int, str]]


def find_systemctl(paths: Sequence[str] = SYSTEMCTL_PATHS,
                   booted_mark: str = BOOTED_MARK) -> str | None:
    """The ``systemctl`` to use, or None where systemd does not run this host."""
    if not os.path.isdir(booted_mark):
        return None
    for p in paths:
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def run_systemctl(argv: Sequence[str]) -> tuple[int, str]:
    """Run ``argv`` (no shell, bounded); (exit status, its stderr's first line)."""
    try:
        r = subprocess.run(list(argv), stdin=subprocess.DEVNULL, capture_output=True,
                           timeout=TIMEOUT_S, check=False, cwd="/",
                           env={"PATH": "/usr/bin:/bin", "LANG": "C"})
    except (OSError, subprocess.TimeoutExpired) as e:
        return 127, str(e)
    err = r.stderr.decode("utf-8", "replace").strip().splitlines()
    return r.returncode, err[0][:200] if err else ""


def start_collector(unit: str, spawn: Callable[[], None], *,
                    systemctl: str | None = None, run: Runner = run_systemctl) -> str:
    """Start the collector (the caller found none running); returns what it did.

    ``unit`` empty: ``spawn()`` (the detached start). Else ``systemctl start
    --no-block -- unit`` when ``systemctl`` (default: :func:`find_systemctl`) is
    there and succeeds; otherwise ``spawn()``, with a warning that says why.
    """
    if not unit:
        spawn()
        return "collector started"
    ctl = systemctl if systemctl is not None else find_systemctl()
    if ctl is None:
        why = "no systemd on this host"
    else:
        rc, err = run([ctl, "start", "--no-block", "--", unit])
        if rc == 0:
            return f"collector started by systemd ({unit})"
        why = f"systemctl start {unit} failed (exit {rc}{': ' + err if err else ''})"
    log.warning("%s: starting the collector detached instead", why)
    spawn()
    return f"collector started detached ({why})"
