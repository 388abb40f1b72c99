"""The Slurm releases slurm-colloc supports, and which one a host runs.

The one place that says which releases are supported: ``colloc admin install`` and
``colloc admin doctor`` refuse any other, and anything else that must know (docs,
the devcluster, the SPANK plugin check) imports it from here rather than repeating
the numbers. 22.05 (Debian 12) is no longer supported: slurmctld 24.11+ refuses the
TRES spelling job_submit.lua wrote for it, and no current release upgrades from it
in one step (SchedMD upgrades only from the three releases before).

Slurm's major releases are YY.MM; a SPANK plugin must be built for the same one as
the daemons (Slurm's plugin loader refuses another), so comparisons here are by
``major.minor`` ("24.11"), never by the maintenance number.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass

SUPPORTED_RELEASES: tuple[str, ...] = ("24.11", "25.05", "25.11", "26.05")
"""The supported major releases, oldest first (Debian 13 trixie: 24.11.5; forky:
26.05.5)."""
FIRST_SUPPORTED: tuple[int, int] = (24, 11)
"""The oldest supported major release."""
FIRST_UNSUPPORTED: tuple[int, int] = (26, 11)
"""The first major release after the supported ones: not yet checked with colloc."""
SUPPORTED_RANGE = (f"{FIRST_SUPPORTED[0]}.{FIRST_SUPPORTED[1]:02d} <= Slurm < "
                   f"{FIRST_UNSUPPORTED[0]}.{FIRST_UNSUPPORTED[1]:02d}")

# "slurm 24.11.5" (SchedMD), "slurm-wlm 24.11.5" (Debian), "slurm 25.05.0-0rc1"
_VERSION = re.compile(r"\bslurm(?:-wlm)?\s+(\d{2})\.(\d{2})(?:\.(\d+))?(\S*)", re.I)
VERSION_TOOLS: tuple[str, ...] = ("sinfo", "scontrol")
"""The client tools asked for ``--version`` (only the binary's own version: no
controller needed)."""

Runner = Callable[[Sequence[str]], "tuple[int, str]"]


class ReleaseError(RuntimeError):
    """The host's Slurm release cannot be told."""


@dataclass(frozen=True, order=True)
class SlurmRelease:
    """A Slurm version as ``--version`` prints it; ordered by (major, minor, micro)."""

    major: int
    minor: int
    micro: int = 0
    suffix: str = ""
    """What follows the numbers (``-0rc1``); kept for messages only."""

    @property
    def series(self) -> str:
        """``"24.11"``: the major release, what a SPANK plugin must match."""
        return f"{self.major}.{self.minor:02d}"

    def __str__(self) -> str:
        return f"{self.series}.{self.micro}{self.suffix}"

    @property
    def supported(self) -> bool:
        """Whether slurm-colloc supports this release."""
        return FIRST_SUPPORTED <= (self.major, self.minor) < FIRST_UNSUPPORTED

    def same_series(self, other: SlurmRelease) -> bool:
        """Same major release (a plugin built for one loads in the other)."""
        return (self.major, self.minor) == (other.major, other.minor)


def parse_release(text: str) -> SlurmRelease | None:
    """The release in ``sinfo --version``'s output, or None if it holds none."""
    m = _VERSION.search(text or "")
    if not m:
        return None
    return SlurmRelease(int(m.group(1)), int(m.group(2)), int(m.group(3) or 0), m.group(4))


def release_of_number(number: int) -> SlurmRelease:
    """``SLURM_VERSION_NUMBER`` (``0x180b05``: one byte each) as a release (24.11.5)."""
    return SlurmRelease((number >> 16) & 0xFF, (number >> 8) & 0xFF, number & 0xFF)


_NUMBER = re.compile(r"#\s*define\s+SLURM_VERSION_NUMBER\s+(0x[0-9a-fA-F]+|\d+)")


def parse_header_release(text: str) -> SlurmRelease | None:
    """The release of ``slurm/slurm_version.h`` (``#define SLURM_VERSION_NUMBER 0x180b05``).

    What a plugin built against those headers is for (Slurm's plugin loader compares
    the same number, compiled into the plugin by ``SPANK_PLUGIN``): the installer
    compares it with the running release before building.
    """
    m = _NUMBER.search(text or "")
    return release_of_number(int(m.group(1), 0)) if m else None


PLUGIN_MARK = b"colloc-slurm-version-number="
"""Prefix of the string colloc_spank.c compiles in: SLURM_VERSION_NUMBER of the headers
it was built against."""
_PLUGIN_MARK = re.compile(re.escape(PLUGIN_MARK) + rb"(0x[0-9a-fA-F]{1,8}|\d{1,10})\0")


def plugin_release(data: bytes) -> SlurmRelease | None:
    """The release a built ``colloc_spank.so`` (its bytes) is for, or None when it
    carries no mark (built by a slurm-colloc before the mark, or not colloc's)."""
    m = _PLUGIN_MARK.search(data)
    return release_of_number(int(m.group(1).decode(), 0)) if m else None


def unsupported_reason(release: SlurmRelease) -> str | None:
    """One line saying why ``release`` is refused, or None when it is supported."""
    if release.supported:
        return None
    known = ", ".join(SUPPORTED_RELEASES)
    if (release.major, release.minor) < FIRST_SUPPORTED:
        return (f"Slurm {release} is not supported: slurm-colloc needs {SUPPORTED_RANGE} "
                f"({known}); upgrade Slurm first (docs/admin.md, \"Upgrading Slurm\")")
    return (f"Slurm {release} is newer than slurm-colloc supports ({SUPPORTED_RANGE}: "
            f"{known}); use a slurm-colloc release that lists {release.series}")


def _run(argv: Sequence[str]) -> tuple[int, str]:
    """Run a program without a shell: (exit status, its output)."""
    try:
        cp = subprocess.run(list(argv), capture_output=True, text=True, timeout=20,
                            check=False, stdin=subprocess.DEVNULL, errors="replace")
    except (OSError, subprocess.SubprocessError) as e:
        return 127, str(e)
    return cp.returncode, cp.stdout + cp.stderr


def detect_release(run: Runner = _run, which: Callable[[str], str | None] = shutil.which,
                   ) -> SlurmRelease:
    """The Slurm release of this host's client tools (``sinfo --version``, else
    ``scontrol --version``); :class:`ReleaseError` with one line when neither tells."""
    tried: list[str] = []
    for tool in VERSION_TOOLS:
        path = which(tool)
        if path is None:
            tried.append(f"{tool}: not on PATH")
            continue
        rc, out = run([path, "--version"])
        release = parse_release(out) if rc == 0 else None
        if release is not None:
            return release
        first = (out.strip().splitlines() or [f"exit {rc}"])[0][:200]
        tried.append(f"{path} --version: {first}")
    raise ReleaseError("cannot tell which Slurm release this host runs (" + "; ".join(tried)
                       + "); install Slurm's client tools (slurm-client) or fix PATH")


def check_supported(run: Runner = _run, which: Callable[[str], str | None] = shutil.which,
                    ) -> SlurmRelease:
    """This host's release when supported; else :class:`ReleaseError` with one line."""
    release = detect_release(run, which)
    reason = unsupported_reason(release)
    if reason:
        raise ReleaseError(reason)
    return release
