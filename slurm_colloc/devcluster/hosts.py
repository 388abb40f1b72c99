"""Compute hosts of a multi-node devcluster: Linux namespaces on one machine.

Each compute host is a network namespace (its own address on a bridge the controller
shares, so slurmctld, slurmd and the tree fan-out talk over real TCP between different
addresses), plus a mount and UTS namespace entered by its slurmd (its own hostname; its
own ``/var/lib/colloc``-like directory, simulated GPUs, MPS pipe directories and
``/tmp``, bound over the shared paths). Everything else, ``/home`` first, is shared the
way a site's NFS is. Every process of a host (Prolog, jobs, Epilog, the metrics
collector, MPS daemons) descends from its slurmd and so lives in its namespaces.

Names derive from the cluster's controller port so several devclusters (the test
suite runs a few) never collide; interface names stay within Linux's 15 characters.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from slurm_colloc.devcluster.daemons import DaemonError
from slurm_colloc.devcluster.layout import Layout, NodePlan, Spec


def netns_name(spec: Spec, node: NodePlan) -> str:
    """The network namespace (``ip netns``) of a compute host."""
    return f"colloc{spec.ctld_port}-{node.name}"


def bridge_name(spec: Spec) -> str:
    return f"cdb{spec.ctld_port}"


def _veth(spec: Spec, node: NodePlan, side: str) -> str:
    return f"cd{side}{spec.ctld_port}n{node.index}"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    cp = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and cp.returncode != 0:
        raise DaemonError(f"network set-up failed: ip {' '.join(args)}: {cp.stderr.strip()}")
    return cp


def _exists(*args: str) -> bool:
    return _ip(*args, check=False).returncode == 0


def network_up(spec: Spec) -> None:
    """Bridge with the controller's address, one namespace and veth pair per host.

    Idempotent: what exists is kept (a resumed cluster keeps its addresses).
    """
    br = bridge_name(spec)
    if not _exists("link", "show", br):
        _ip("link", "add", br, "type", "bridge")
    if spec.controller_addr() not in _ip("-o", "addr", "show", "dev", br).stdout:
        _ip("addr", "add", f"{spec.controller_addr()}/24", "dev", br)
    _ip("link", "set", br, "up")
    for node in spec.node_plans():
        ns = netns_name(spec, node)
        if not Path(f"/run/netns/{ns}").exists():
            _ip("netns", "add", ns)
        host_side, node_side = _veth(spec, node, "h"), _veth(spec, node, "n")
        if not _exists("link", "show", host_side):
            _ip("link", "add", host_side, "type", "veth", "peer", "name", node_side)
            _ip("link", "set", node_side, "netns", ns)
        _ip("link", "set", host_side, "master", br)
        _ip("link", "set", host_side, "up")
        inside = ["netns", "exec", ns, "ip"]
        _ip(*inside, "link", "set", "lo", "up")
        if node.addr not in _ip(*inside, "-o", "addr", "show", "dev", node_side).stdout:
            _ip(*inside, "addr", "add", f"{node.addr}/24", "dev", node_side)
        _ip(*inside, "link", "set", node_side, "up")


def network_down(spec: Spec) -> None:
    """Remove the namespaces (their veth ends go with them) and the bridge."""
    for node in spec.node_plans():
        _ip("netns", "del", netns_name(spec, node), check=False)
        _ip("link", "del", _veth(spec, node, "h"), check=False)
    _ip("link", "del", bridge_name(spec), check=False)


def prepare_private_dirs(layout: Layout, node: NodePlan) -> None:
    """The host's own directories, and the mount points they are bound over."""
    for src, target in layout.node_private(node.name):
        src.mkdir(parents=True, exist_ok=True)
        target.mkdir(parents=True, exist_ok=True)
        if target == layout.tmp:
            src.chmod(0o1777)
        else:
            src.chmod(0o755)
    for sub in ("evidence", "metrics"):
        (layout.node_dir(node.name) / "colloc" / sub).mkdir(exist_ok=True)
    (layout.spool / node.name).mkdir(parents=True, exist_ok=True)


_ENTER = """set -e
hostname "$1"
shift
while [ "$1" != "--" ]; do mkdir -p "$2"; mount --rbind "$1" "$2"; shift 2; done
shift
exec "$@"
"""


def colloc_paths() -> list[Path]:
    """colloc's own environment and source tree."""
    import sys

    import slurm_colloc

    return [Path(sys.prefix), Path(slurm_colloc.__file__).resolve().parents[1]]


def _kept_under_tmp(layout: Layout) -> list[Path]:
    """Directories under /tmp that every host must still see: colloc's own
    environment and source (a CI checkout may live in /tmp) - the host's private /tmp
    would hide them, and with them the Prolog/Epilog console scripts."""
    keep = []
    for p in colloc_paths():
        try:
            rel = p.resolve().relative_to(layout.tmp)
        except ValueError:
            continue
        if rel.parts:
            keep.append(layout.tmp / rel.parts[0])
    return sorted(set(keep))


def slurmd_argv(spec: Spec, layout: Layout, node: NodePlan) -> tuple[str, ...]:
    """slurmd of one host, started inside its namespaces (it daemonizes from there)."""
    binds: list[str] = []
    private_tmp = layout.node_dir(node.name) / "tmp"
    for keep in _kept_under_tmp(layout):  # into the private /tmp before it is bound
        binds += [str(keep), str(private_tmp / keep.relative_to(layout.tmp))]
    for src, target in layout.node_private(node.name):
        binds += [str(src), str(target)]
    # nsenter, not `ip netns exec`: the latter remounts /sys, hiding /sys/fs/cgroup,
    # without which slurmd 22.05 does not start
    return (
        "nsenter", f"--net=/run/netns/{netns_name(spec, node)}", "--",
        "unshare", "--mount", "--uts", "--propagation", "private", "--",
        "/bin/sh", "-c", _ENTER, "colloc-host", node.name, *binds, "--",
        "/usr/sbin/slurmd", "-N", node.name,
    )


def enter_argv(slurmd_pid: int, argv: list[str]) -> list[str]:
    """Run ``argv`` in a host's namespaces (those of its running slurmd), under its root
    directory too (``-r``: inside a release's root filesystem that is the chroot, not
    the mount namespace's own root) and in its working directory (``-w``)."""
    return ["nsenter", "-t", str(slurmd_pid), "-m", "-u", "-n", "-r", "-w", "--", *argv]


def describe(spec: Spec) -> str:
    """One line per host for ``up``'s summary."""
    lines = []
    for n in spec.node_plans():
        shards = f"{n.shards_per_gpu} shards each" if n.shards_per_gpu else "whole GPUs only"
        lines.append(
            f"  {n.name:14s} {n.addr:15s} partition {n.partition:7s} {n.gpus} x "
            f"{n.gpu_memory_mib} MiB ({n.feature}), {shards}"
        )
    return "\n".join(lines)


def quote(argv: list[str]) -> str:
    return shlex.join(argv)
