"""A Debian root filesystem per supported Slurm release, for the devcluster.

Sites run Slurm 24.11 to 26.05; Debian ships 24.11 in trixie (13) and 26.05 in
forky. A lab machine runs whichever Debian it has, so each release's packages are
installed in a root filesystem built from Debian's archive with debootstrap and
entered with chroot: there the devcluster's own code (namespaces, daemons,
simulated GPUs) runs unchanged, with the project installed in that root's Python
(``<checkout>/.venv-slurm-<release>``, an editable install of this checkout,
bind-mounted at the same path so paths agree inside and out).

Built once into ``/var/lib/colloc-rootfs/<release>``, rebuilt when its recipe
changes, its packages upgraded when older than :data:`MAX_AGE_S`. Two pitfalls of
Debian 13 and newer are solved here and documented for admins (docs/admin.md):
slurmdbd needs MariaDB Connector/C 3.3 (Debian 12's libmariadb3, unpacked beside
the release's own, see :mod:`slurm_release`), and slurmd needs
``CgroupPlugin=disabled`` where no cgroup filesystem is mounted.

Safety: the root holds bind mounts of this checkout, /proc, /sys and /dev; nothing
under it is ever deleted while a mount remains below it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from slurm_colloc.devcluster.packages import PACKAGES, PackageError, ensure_packages

log = logging.getLogger("colloc.devcluster")


@dataclass(frozen=True)
class Release:
    """A Slurm release and the Debian suite that packages it."""

    version: str
    suite: str
    script: str
    """debootstrap's script for the suite (Debian 12's debootstrap has no ``forky``;
    ``sid``'s script builds testing too)."""
    check_valid_until: bool = True
    """testing/sid Release files may be expired on mirrors: apt is told not to care."""
    extra_packages: tuple[str, ...] = ()
    """Packages a release's tests need beyond :data:`ROOTFS_PACKAGES`. Not part of the
    recipe: one added here is installed into an existing root on its next use
    (:func:`ensure_extra_packages`) instead of rebuilding it."""


PROMETHEUS_PACKAGES = ("prometheus", "prometheus-node-exporter")
"""A real Prometheus and node_exporter (textfile collector) for the metrics export's
end-to-end test (tests/e2e/test_prometheus_e2e.py); started as plain processes there."""

RELEASES: dict[str, Release] = {
    "24.11": Release("24.11", "trixie", "trixie"),
    "26.05": Release("26.05", "forky", "sid", check_valid_until=False,
                     extra_packages=PROMETHEUS_PACKAGES),
}
"""Releases the lab can run (Debian packages both; 25.05 and 25.11 are not in
Debian's archive, and share their JSON data parser v0.0.42 with these two)."""

DEFAULT_RELEASE = "26.05"
"""The newest: what ``make demo``, ``make test`` and ``colloc devcluster up`` run."""

BASE = Path("/var/lib/colloc-rootfs")
VENV_PREFIX = ".venv-slurm-"
"""The project's virtual environment for a release: ``<checkout>/.venv-slurm-<release>``,
visible inside at the same path; one per checkout, so two checkouts sharing a root
filesystem never run each other's code."""
MARKER = "etc/colloc-rootfs.json"
"""Inside a root filesystem: its release and recipe (absent on a host)."""
MAX_AGE_S = 7 * 86400
"""Packages older than this are upgraded (security and Slurm point releases)."""

ROOTFS_PACKAGES = (
    *PACKAGES, "python3", "python3-venv", "python3-dev", "iproute2", "util-linux",
    "procps", "passwd", "make", "git", "ca-certificates", "debianutils",
    "chromium-headless-shell", "fonts-dejavu-core",
)
"""What the lab needs inside: the Slurm daemons and clients, the namespaces' tools,
Python for the project, and the headless browser the report's tests render with."""

PASS_ENV_PREFIXES = ("COLLOC_", "PIP_", "PYTEST_", "HYPOTHESIS_")
PASS_ENV = ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY",
            "NO_PROXY", "TERM", "CI", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE",
            "CURL_CA_BUNDLE")
"""Host variables a command inside keeps (proxies and CA bundles reach PyPI;
``COLLOC_*`` test settings); everything else is reset."""
DROP_ENV = ("PIP_FIND_LINKS",)
"""Host paths that mean nothing inside."""


class RootfsError(RuntimeError):
    """The root filesystem could not be built or entered."""


def release(version: str) -> Release:
    """The release named ``version`` (RootfsError listing the known ones)."""
    try:
        return RELEASES[version]
    except KeyError:
        raise RootfsError(
            f"Slurm {version} is not a lab release; one of {', '.join(RELEASES)}") from None


def current() -> str | None:
    """The release of the root filesystem this process runs in (None on a host)."""
    try:
        return str(json.loads((Path("/") / MARKER).read_text())["release"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def root_of(rel: Release) -> Path:
    return BASE / rel.version


def recipe(rel: Release) -> str:
    """What the root is made of; a change rebuilds it."""
    text = json.dumps({"suite": rel.suite, "packages": sorted(ROOTFS_PACKAGES), "v": 2})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def checkout() -> Path:
    """This project's source checkout (the lab installs it editable inside)."""
    top = Path(__file__).resolve().parents[2]
    if not (top / "Makefile").exists() or not (top / "slurm_colloc").is_dir():
        raise RootfsError(
            f"{top} is not a slurm-colloc checkout: the devcluster of another Slurm "
            "release installs the project from its source tree (git clone, then make)")
    return top


def bind_sources() -> list[Path]:
    """Host directories visible inside at the same path: the checkout's parent (the
    checkout and ``../shared`` beside it) and where ``../shared`` really lies."""
    top = checkout()
    out = [top.parent]
    shared = (top.parent / "shared").resolve()
    if shared.exists() and not shared.is_relative_to(top.parent):
        out.append(shared)
    return out


# ---------------------------------------------------------------- mounts
def mounts_under(root: Path) -> list[Path]:
    """Mount points at or below ``root``, deepest first."""
    found = []
    rp = str(root.resolve())
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].replace("\\040", " ")
            if point == rp or point.startswith(rp + "/"):
                found.append(Path(point))
    return sorted(set(found), key=lambda p: len(p.parts), reverse=True)


def _is_mount(path: Path) -> bool:
    return path.resolve() in mounts_under(path)


def mount(root: Path) -> None:
    """Bind what a command inside needs; idempotent (mounts stay for later commands
    and for the daemons started inside)."""
    plan: list[tuple[list[str], Path]] = [
        (["-t", "proc", "proc"], root / "proc"),
        (["--rbind", "/sys"], root / "sys"),
        (["--rbind", "/dev"], root / "dev"),
    ]
    plan += [(["--bind", str(src)], root / str(src).lstrip("/")) for src in bind_sources()]
    if not _is_mount(root):
        # "/" inside must be a mount point: `ip netns exec` (the multi-node hosts) runs
        # `mount --make-rslave /`, which fails on a plain directory. Bound onto itself
        # first, the others on top.
        umount(root)
        _run(["mount", "--bind", str(root), str(root)], f"mounting {root}")
    for args, target in plan:
        target.mkdir(parents=True, exist_ok=True)
        if _is_mount(target) and _same_dir(args[-1], target):
            continue
        if _is_mount(target):  # a bind of a directory since deleted and made anew
            subprocess.run(["umount", "-l", str(target)], capture_output=True, check=False)
            target.mkdir(parents=True, exist_ok=True)
        _run(["mount", *args, str(target)], f"mounting {target}")
        if "--rbind" in args:  # nothing unmounted inside may reach the host's /dev, /sys
            _run(["mount", "--make-rslave", str(target)], f"mounting {target}")


def _same_dir(source: str, target: Path) -> bool:
    """A bind mount still shows ``source`` (not a deleted directory of that name);
    non-path sources (proc) always count as the same."""
    if not source.startswith("/"):
        return True
    try:
        a, b = os.stat(source), os.stat(target)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def umount(root: Path) -> None:
    """Undo :func:`mount` (and anything mounted below, e.g. network namespaces)."""
    for point in mounts_under(root):
        subprocess.run(["umount", "-l", str(point)], capture_output=True, check=False)
    left = mounts_under(root)
    if left:
        raise RootfsError(f"still mounted under {root}: {', '.join(map(str, left))}")


def remove(root: Path) -> None:
    """Delete a root filesystem, never through a mount (a bind of the checkout!)."""
    umount(root)
    if mounts_under(root):
        raise RootfsError(f"refusing to delete {root}: mounts remain below it")
    shutil.rmtree(root)


# ---------------------------------------------------------------- commands inside
def venv_of(version: str) -> Path:
    """The project's virtual environment for ``version``'s root filesystem."""
    return checkout() / f"{VENV_PREFIX}{version}"


def inner_env(version: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """A clean environment for a command inside, with what must cross over."""
    venv = venv_of(version)
    env = {"PATH": f"{venv}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "HOME": "/root", "LANG": "C.UTF-8", "DEBIAN_FRONTEND": "noninteractive"}
    for k, v in os.environ.items():
        if (k in PASS_ENV or k.startswith(PASS_ENV_PREFIXES)) and k not in DROP_ENV:
            env[k] = v
    env.update(extra or {})
    return env


def command(root: Path, argv: Sequence[str], *, cwd: Path | None = None,
            env: dict[str, str] | None = None) -> list[str]:
    """``argv`` run inside ``root`` (in ``cwd``, which must be visible inside)."""
    where = str(cwd or Path.cwd())
    if not any(Path(where).is_relative_to(s) for s in bind_sources()):
        where = "/"
    pairs = [f"{k}={v}" for k, v in inner_env(root.name.removesuffix(".partial"), env).items()]
    return ["chroot", str(root), "/usr/bin/env", "-i", *pairs, "/bin/sh", "-c",
            'cd "$0" && exec "$@"', where, *argv]


def run(root: Path, argv: Sequence[str], *, check: bool = True,
        env: dict[str, str] | None = None) -> int:
    """Run inside ``root`` with output to ours; the exit status."""
    mount(root)
    rc = subprocess.run(command(root, argv, env=env), check=False).returncode
    if check and rc != 0:
        raise RootfsError(f"inside {root}: {' '.join(argv)} exited {rc}")
    return rc


def _run(argv: list[str], what: str) -> None:
    cp = subprocess.run(argv, capture_output=True, text=True, check=False)
    if cp.returncode != 0:
        raise RootfsError(f"{what}: {' '.join(argv[:4])}: {(cp.stderr or cp.stdout).strip()}")


def _stream(argv: list[str], what: str) -> None:
    """Run with its progress shown line by line (debootstrap and apt take a minute)."""
    log.info("%s", what)
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace", stdin=subprocess.DEVNULL) as p:
        assert p.stdout is not None
        tail: list[str] = []
        for line in p.stdout:
            line = line.rstrip()
            if line:
                tail = [*tail[-30:], line]
                log.info("  %s", line[:200])
        if p.wait() != 0:
            raise RootfsError(f"{what} failed:\n" + "\n".join(tail)[-2000:])


# ---------------------------------------------------------------- building
def mirror() -> str:
    """The Debian mirror the host's apt uses (deb.debian.org when none is found)."""
    for src in sorted(Path("/etc/apt").glob("sources.list.d/*.sources")):
        for line in src.read_text().splitlines():
            if line.startswith("URIs:") and "security" not in line:
                return line.split()[1]
    try:
        for line in Path("/etc/apt/sources.list").read_text().splitlines():
            parts = line.split()
            if parts[:1] == ["deb"] and "security" not in line:
                return next(p for p in parts[1:] if p.startswith("http"))
    except (OSError, StopIteration):
        pass
    return "http://deb.debian.org/debian"


def state(root: Path) -> dict[str, object] | None:
    try:
        data = json.loads((root / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def ensure(version: str, *, rebuild: bool = False) -> Path:
    """The root filesystem of ``version``, built or brought up to date first."""
    if os.geteuid() != 0:
        raise RootfsError("building and entering a root filesystem needs root")
    rel = release(version)
    root = root_of(rel)
    st = state(root)
    if rebuild or st is None or st.get("recipe") != recipe(rel):
        if root.exists():
            log.info("root filesystem %s is %s: rebuilding", root,
                     "asked to be rebuilt" if rebuild else "stale or incomplete")
            remove(root)
        _build(rel, root)
    elif time.time() - float(str(st.get("built", 0))) > MAX_AGE_S:
        log.info("root filesystem %s is older than %d days: upgrading its packages",
                 root, MAX_AGE_S // 86400)
        _apt_install(rel, root, upgrade=True)
        _write_state(rel, root)
    ensure_extra_packages(rel, root)
    mount(root)
    return root


def installed_in(root: Path, packages: Sequence[str]) -> set[str]:
    """Which of ``packages`` the root's dpkg database lists as installed."""
    try:
        text = (root / "var/lib/dpkg/status").read_text(errors="replace")
    except OSError:
        return set()
    found = set()
    for para in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in para.splitlines()
                      if ": " in line and not line.startswith(" "))
        if fields.get("Package") in packages and fields.get("Status", "").endswith(" installed"):
            found.add(fields["Package"])
    return found


def ensure_extra_packages(rel: Release, root: Path) -> None:
    """Install the release's :attr:`~Release.extra_packages` the root lacks.

    Runs on every entry, so a package added to the list reaches roots built before it
    (a developer's, CI's cached one) without a rebuild. Serialised by a lock beside the
    root: several test runs entering at once install once.
    """
    if not rel.extra_packages or not set(rel.extra_packages) - installed_in(
            root, rel.extra_packages):
        return
    with open(root.with_name(root.name + ".extra.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        missing = [p for p in rel.extra_packages
                   if p not in installed_in(root, rel.extra_packages)]
        if missing:
            mount(root)
            opts = "" if rel.check_valid_until else "-o Acquire::Check-Valid-Until=false"
            steps = (f"apt-get -q {opts} update && apt-get install -y -q "
                     f"-o DPkg::Lock::Timeout=300 --no-install-recommends {' '.join(missing)}")
            _stream(command(root, ["/bin/sh", "-c", steps]),
                    f"installing {', '.join(missing)} into {root}")


def _build(rel: Release, root: Path) -> None:
    try:
        ensure_packages(("debootstrap",))
    except PackageError as e:
        raise RootfsError(str(e)) from e
    partial = root.with_name(root.name + ".partial")
    if partial.exists():
        remove(partial)
    partial.parent.mkdir(parents=True, exist_ok=True)
    _stream(["debootstrap", "--variant=minbase", rel.suite, str(partial), mirror(),
             f"/usr/share/debootstrap/scripts/{rel.script}"],
            f"debootstrap {rel.suite} into {partial} (about 30 s)")
    _trust_host_cas(partial)
    (partial / "usr/sbin/policy-rc.d").write_text("#!/bin/sh\nexit 101\n")
    (partial / "usr/sbin/policy-rc.d").chmod(0o755)
    _apt_install(rel, partial, upgrade=False)
    _compat_libmariadb(partial)
    umount(partial)
    partial.rename(root)
    _write_state(rel, root)
    log.info("root filesystem for Slurm %s ready at %s", rel.version, root)


def _trust_host_cas(root: Path) -> None:
    """The host's resolver and local CAs (a site's TLS proxy) reach apt and pip inside."""
    shutil.copy("/etc/resolv.conf", root / "etc/resolv.conf")
    local = Path("/usr/local/share/ca-certificates")
    if local.is_dir():
        shutil.copytree(local, root / str(local).lstrip("/"), dirs_exist_ok=True)


def _apt_install(rel: Release, root: Path, *, upgrade: bool) -> None:
    mount(root)
    opts = "" if rel.check_valid_until else "-o Acquire::Check-Valid-Until=false"
    steps = f"apt-get -q {opts} update && "
    if upgrade:
        steps += "apt-get -y -q upgrade && "
    steps += ("apt-get install -y -q --no-install-recommends "
              + " ".join((*ROOTFS_PACKAGES, *rel.extra_packages)) + " && update-ca-certificates")
    _stream(command(root, ["/bin/sh", "-c", steps]),
            f"installing Slurm {rel.version}'s packages from {rel.suite} (about 30 s)")


def _compat_libmariadb(root: Path) -> None:
    """Unpack Debian 12's libmariadb3 (Connector/C 3.3) for slurmdbd, apart from the
    root's own package database (a separate source list and state)."""
    from slurm_colloc.devcluster.slurm_release import COMPAT_LIBMARIADB

    (root / "etc/apt/colloc-bookworm.list").write_text(
        f"deb {mirror()} bookworm main\n")
    target = COMPAT_LIBMARIADB.parents[2]  # .../libmariadb3 (holds usr/lib/...)
    opts = ("-o Dir::Etc::SourceList=/etc/apt/colloc-bookworm.list "
            "-o Dir::Etc::SourceParts=/nonexistent -o Dir::State::Lists=/var/lib/apt/"
            "lists-bookworm -o Dir::Cache::pkgcache= -o Dir::Cache::srcpkgcache= "
            "-o Dir::State::status=/dev/null")
    script = (f"set -e; mkdir -p /var/lib/apt/lists-bookworm/partial {target}; "
              f"apt-get -q {opts} update; cd /tmp; apt-get -q {opts} download libmariadb3; "
              f"dpkg-deb -x libmariadb3_*.deb {target}; rm -f libmariadb3_*.deb")
    _stream(command(root, ["/bin/sh", "-c", script]),
            "unpacking MariaDB Connector/C 3.3 for slurmdbd (Debian 13+ pitfall)")


def _write_state(rel: Release, root: Path) -> None:
    (root / MARKER).write_text(json.dumps(
        {"release": rel.version, "suite": rel.suite, "recipe": recipe(rel),
         "built": time.time()}))


def ensure_venv(root: Path) -> None:
    """The project installed (editable) in the root's Python, by the Makefile's rule."""
    top = checkout()
    run(root, ["make", "-s", "-C", str(top), f"VENV={venv_of(root.name)}",
               "PY=/usr/bin/python3", "venv"])


def reexec(version: str, argv: Sequence[str]) -> int:
    """Run ``colloc ARGV`` inside ``version``'s root filesystem (built if needed)."""
    root = ensure(version)
    ensure_venv(root)
    return run(root, [f"{venv_of(version)}/bin/colloc", *argv], check=False)

