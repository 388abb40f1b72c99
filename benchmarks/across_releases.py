"""Node-script benchmarks on Slurm 26.05, 24.11 and 22.05, side by side, in one run.

    .venv/bin/python benchmarks/across_releases.py          # as root, about 15 min

Runs two benchmarks on each release, one after the other, and prints one table of
their figures with the ratios new release / 22.05:

* ``benchmarks/controller_rpcs.py``: slurmctld calls per job made by our node
  scripts (sdiag; target <= 1);
* ``benchmarks/node_script_overhead.py``: prolog cold/warm, task prolog, epilog, and
  the epilog on a 1 GB log (medians, ms).

Releases and code:

* **26.05** and **24.11**: this checkout, inside the release's root filesystem
  (``slurm_colloc/devcluster/rootfs.py``: Debian's packages, the project in
  ``.venv-slurm-<release>``), each benchmark on a cluster of its own
  (``controller_rpcs.py --own-cluster``);
* **22.05**: the code of commit ``de3fac0`` (the last one that ran on 22.05; later
  commits parse only Slurm's v0.0.42 JSON), in a git worktree at
  ``/var/tmp/colloc-2205`` made here if absent, with its own venv (``/usr/bin/python3``,
  ``pip install -e '.[dev]'``), on the host's own Debian 12 Slurm 22.05 packages (the
  old code's devcluster installs them with apt if missing). Its controller_rpcs.py has
  no ``--own-cluster``: the old code brings a cluster up at
  ``/var/lib/colloc-bench-rpcs-2205`` (ports 19227-19229, 19216) and the benchmark is
  pointed at it with ``--root``.

One cluster at a time: every step checks that its ports are free before it starts
and takes its cluster down afterwards (also on error, timeout, Ctrl-C or SIGTERM:
the child is interrupted so its own ``finally`` runs, then the cluster's root is
taken down from outside as well); a lock file keeps two runs of this script apart.
Ports: controller_rpcs 19217-19219/19206 (22.05: 19227-19229/19216),
node_script_overhead 19117-19119/19106; no test, demo or other benchmark uses them.

The figures are read from each run's output: the last line ``BENCH_JSON {...}`` of
this checkout's benchmarks, and for de3fac0's (which predate it) their human output.
Written: ``benchmarks/results/across_releases.json`` (figures, every run's raw
figures, Slurm versions, load averages, errors) and ``across_releases.csv`` (the
table). One run of each: on a shared machine the figures are noisy; compare ratios
within one run.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import pandas as pd
from bench_cleanup import end_leftovers

from slurm_colloc.devcluster import rootfs
from slurm_colloc.devcluster.daemons import port_free

CHECKOUT = Path(__file__).resolve().parents[1]
RESULTS = CHECKOUT / "benchmarks" / "results"
NEW_RELEASES = ("26.05", "24.11")
OLD_RELEASE = "22.05"
OLD_COMMIT = "de3fac0"
OLD_TREE = Path("/var/tmp/colloc-2205")
OLD_VENV = OLD_TREE / ".venv"
OLD_PY = OLD_VENV / "bin" / "python"
OLD_STAMP = OLD_VENV / ".across-releases-installed"
LOCK = Path("/run/lock/colloc-across-releases.lock")
JSON_PREFIX = "BENCH_JSON "

# the benchmarks' own roots and ports (see each benchmark); 22.05's controller_rpcs
# cluster is brought up here, with ports of its own
RPC_ROOT = Path("/var/lib/colloc-bench-rpcs")
RPC_PORTS = {"ctld_port": 19217, "slurmd_port": 19218, "dbd_port": 19219, "mysql_port": 19206}
OLD_RPC_ROOT = Path("/var/lib/colloc-bench-rpcs-2205")
OLD_RPC_PORTS = {"ctld_port": 19227, "slurmd_port": 19228, "dbd_port": 19229,
                 "mysql_port": 19216}
NODE_ROOT = Path("/var/lib/colloc-bench-node")
NODE_PORTS = {"ctld_port": 19117, "slurmd_port": 19118, "dbd_port": 19119, "mysql_port": 19106}

STEP_TIMEOUT_S = 1500
INTERRUPT_GRACE_S = 180
"""After SIGINT, how long a benchmark gets to take its cluster down itself."""

CLUSTER_CODE = """
import json, sys
from pathlib import Path
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.devcluster.layout import Layout, Spec
action, root, ports = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
cluster = Cluster(Layout(root), Spec(**ports))
if action == "up":
    cluster.down()
    try:
        cluster.up()
    except BaseException:
        cluster.down()
        raise
else:
    cluster.down()
"""
"""Brings a cluster up or down with whichever slurm_colloc the interpreter imports
(de3fac0's Cluster/Layout/Spec have the same API as today's)."""


def log(msg: str) -> None:
    print(f"[across_releases {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------- environments
def sh(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=True, text=True, **kw)


def prepare_new(version: str) -> Path:
    """The release's root filesystem (built on first use) with this checkout's venv."""
    log(f"Slurm {version}: root filesystem and .venv-slurm-{version}")
    root = rootfs.ensure(version)
    rootfs.ensure_venv(root)
    return root


def prepare_old() -> None:
    """de3fac0's worktree, its venv, and the host's Slurm 22.05 packages."""
    want = sh(["git", "-C", str(CHECKOUT), "rev-parse", f"{OLD_COMMIT}^{{commit}}"],
              capture_output=True).stdout.strip()
    if not OLD_TREE.exists():
        log(f"git worktree {OLD_TREE} at {OLD_COMMIT}")
        sh(["git", "-C", str(CHECKOUT), "worktree", "add", "--detach", str(OLD_TREE), want])
    have = sh(["git", "-C", str(OLD_TREE), "rev-parse", "HEAD"], capture_output=True).stdout
    if have.strip() != want:
        raise RuntimeError(f"{OLD_TREE} is at {have.strip()[:10]}, not {OLD_COMMIT}: "
                           "remove it (git worktree remove) and run again")
    if not OLD_STAMP.exists():
        log(f"venv {OLD_VENV} (/usr/bin/python3, pip install -e '.[dev]')")
        if not OLD_PY.exists():
            sh(["/usr/bin/python3", "-m", "venv", str(OLD_VENV)])
        sh([str(OLD_PY), "-m", "pip", "install", "-q", "--disable-pip-version-check",
            "-e", ".[dev]"], cwd=OLD_TREE)
        OLD_STAMP.touch()
    log("host Slurm 22.05 packages (de3fac0's devcluster installs what is missing)")
    sh([str(OLD_PY), "-c", "from slurm_colloc.devcluster.packages import ensure_packages;"
        " ensure_packages()"], cwd=OLD_TREE)


def slurm_version(argv_prefix: list[str]) -> str:
    """The Debian version of slurmctld (``26.05.5-1``) where ``argv_prefix`` runs."""
    cp = subprocess.run([*argv_prefix, "dpkg-query", "-W", "-f=${Version}", "slurmctld"],
                        capture_output=True, text=True, check=False)
    return cp.stdout.strip() or "?"


def python_version(argv_prefix: list[str], python: Path) -> str:
    """The version of the interpreter the node scripts run on (their time is mostly
    Python's start and imports, and each root filesystem has its own Python)."""
    cp = subprocess.run([*argv_prefix, str(python), "-c",
                         "import platform; print(platform.python_version())"],
                        capture_output=True, text=True, check=False)
    return cp.stdout.strip() or "?"


def dirty_files() -> list[str]:
    """Tracked files of this checkout that differ from HEAD (the runs use them)."""
    cp = subprocess.run(["git", "-C", str(CHECKOUT), "status", "--porcelain",
                         "--untracked-files=no"], capture_output=True, text=True, check=False)
    return [line[3:] for line in cp.stdout.splitlines()]


# ---------------------------------------------------------------- steps
@dataclass
class Step:
    """One benchmark on one release: its command, its cluster(s) and their ports."""

    release: str
    bench: str
    argv: list[str]
    ports: list[dict[str, int]]
    down: Callable[[], None]
    """Takes the step's cluster(s) down from outside (idempotent)."""
    confs: list[tuple[Path, str]]
    """(slurm.conf, root directory) of each cluster: what carries them is ended after."""
    before: Callable[[], None] | None = None
    output: list[str] = field(default_factory=list)


def _cluster_cmd(prefix: list[str], action: str, root: Path,
                 ports: dict[str, int]) -> list[str]:
    return [*prefix, "-c", CLUSTER_CODE, action, str(root), json.dumps(ports)]


def new_steps(version: str, root: Path) -> list[Step]:
    py = str(rootfs.venv_of(version) / "bin" / "python")

    def inside(argv: list[str]) -> list[str]:
        return rootfs.command(root, argv, cwd=CHECKOUT)

    def downer(croot: Path, ports: dict[str, int]) -> Callable[[], None]:
        def down() -> None:
            if (root / str(croot).lstrip("/")).exists():  # the cluster's root, seen outside
                subprocess.run(inside(_cluster_cmd([py], "down", croot, ports)), check=False)
        return down

    bench = CHECKOUT / "benchmarks"
    return [
        Step(version, "controller_rpcs",
             inside([py, str(bench / "controller_rpcs.py"), "--own-cluster"]),
             [RPC_PORTS], downer(RPC_ROOT, RPC_PORTS),
             [(RPC_ROOT / "etc/slurm.conf", str(root))]),
        Step(version, "node_script_overhead",
             inside([py, str(bench / "node_script_overhead.py")]),
             [NODE_PORTS], downer(NODE_ROOT, NODE_PORTS),
             [(NODE_ROOT / "etc/slurm.conf", str(root))]),
    ]


def old_steps() -> list[Step]:
    py = [str(OLD_PY)]

    def downer(croot: Path, ports: dict[str, int]) -> Callable[[], None]:
        def down() -> None:
            if croot.exists():
                subprocess.run(_cluster_cmd(py, "down", croot, ports), cwd=OLD_TREE,
                               check=False)
        return down

    def rpc_cluster_up() -> None:
        log(f"22.05: de3fac0's devcluster up at {OLD_RPC_ROOT} (ports 19227..)")
        sh(_cluster_cmd(py, "up", OLD_RPC_ROOT, OLD_RPC_PORTS), cwd=OLD_TREE)

    bench = OLD_TREE / "benchmarks"
    return [
        Step(OLD_RELEASE, "controller_rpcs",
             [*py, str(bench / "controller_rpcs.py"), "--root", str(OLD_RPC_ROOT)],
             [OLD_RPC_PORTS], downer(OLD_RPC_ROOT, OLD_RPC_PORTS),
             [(OLD_RPC_ROOT / "etc/slurm.conf", "/")], before=rpc_cluster_up),
        Step(OLD_RELEASE, "node_script_overhead",
             [*py, str(bench / "node_script_overhead.py")],
             [NODE_PORTS], downer(NODE_ROOT, NODE_PORTS),
             [(NODE_ROOT / "etc/slurm.conf", "/")]),
    ]


def _busy_ports(step: Step) -> list[int]:
    return [p for ports in step.ports for p in ports.values() if not port_free(p)]


def _interrupt(p: subprocess.Popen[str]) -> None:
    """SIGINT (KeyboardInterrupt: the benchmark's ``finally`` takes its cluster down),
    then SIGKILL to its whole process group."""
    if p.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        p.send_signal(signal.SIGINT)
    try:
        p.wait(INTERRUPT_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def run_step(step: Step) -> None:
    """Run one benchmark, its output streamed with a prefix and kept; raise on failure.
    Its cluster is always taken down before this returns."""
    busy = _busy_ports(step)
    if busy:
        raise RuntimeError(f"ports {busy} are in use: another cluster runs on this "
                           "benchmark's ports; not starting a second one")
    tag = f"[{step.release} {step.bench}] "
    try:
        if step.before is not None:
            step.before()
        log(f"{step.release}: {step.bench}")
        # own session: a Ctrl-C on our terminal is forwarded by _interrupt, in order
        p = subprocess.Popen(step.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, text=True, errors="replace",
                             start_new_session=True,
                             cwd=OLD_TREE if step.release == OLD_RELEASE else CHECKOUT)

        def pump() -> None:
            assert p.stdout is not None
            for line in p.stdout:
                step.output.append(line.rstrip("\n"))
                if not line.startswith(JSON_PREFIX):
                    print(tag + line.rstrip("\n"), flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = p.wait(STEP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _interrupt(p)
            raise RuntimeError(f"timed out after {STEP_TIMEOUT_S} s") from None
        except BaseException:
            _interrupt(p)
            raise
        reader.join(10)
        if rc != 0:
            raise RuntimeError(f"exited {rc}: " + " | ".join(step.output[-5:]))
    finally:
        step.down()
        for conf, fs_root in step.confs:
            n = end_leftovers(conf, fs_root)
            if n:
                log(f"ended {n} processes left by {step.bench}'s cluster "
                    "(detached record writers)")
        busy = _busy_ports(step)
        if busy:
            log(f"WARNING: ports {busy} still in use after taking {step.bench} down")


# ---------------------------------------------------------------- parsing
NODE_LABELS = {
    "prolog_cold": r"prolog, cold",
    "prolog_warm": r"prolog, warm",
    "task_prolog": r"task prolog \(",
    "epilog": r"epilog, job without OOM",
    "epilog_big_log": r"epilog, [\d.]+ GB log",
}


def parse(step: Step) -> dict[str, Any]:
    """The figures of a run: its ``BENCH_JSON`` line, else its human output (de3fac0)."""
    for line in reversed(step.output):
        if line.startswith(JSON_PREFIX):
            return {**json.loads(line[len(JSON_PREFIX):]), "source": "json"}
    text = "\n".join(step.output)
    if step.bench == "node_script_overhead":
        med, mx = {}, {}
        for key, label in NODE_LABELS.items():
            m = re.search(rf"^{label}.*: median\s+(\d+) ms\s+max\s+(\d+) ms", text, re.M)
            if m is None:
                raise ValueError(f"no '{label}' line in the output")
            med[key], mx[key] = float(m.group(1)), float(m.group(2))
        runs = re.search(r"^runs: (\d+)", text, re.M)
        size = re.search(r"^epilog, ([\d.]+) GB log", text, re.M)
        return {"benchmark": step.bench, "runs": int(runs.group(1)) if runs else None,
                "big_log_bytes": float(size.group(1)) * 1e9 if size else None,
                "median_ms": med, "max_ms": mx, "source": "text (whole ms)"}
    jobs = re.search(r"^(\d+) jobs \(", text, re.M)
    calls = re.search(r"^node-script controller calls per job: ([\d.]+)", text, re.M)
    if jobs is None or calls is None:
        raise ValueError("no 'N jobs' or 'controller calls per job' line in the output")
    ours_part = text[jobs.end():calls.start()]
    slurm_part = text.split("Slurm's own messages (not ours):", 1)[-1]
    row = re.compile(r"^\s*([A-Z][A-Z0-9_]+)\s+(\d+)\s*$", re.M)
    return {"benchmark": step.bench, "jobs": int(jobs.group(1)),
            "calls_per_job": float(calls.group(1)),
            "ours": {m.group(1): int(m.group(2)) for m in row.finditer(ours_part)},
            "slurm": {m.group(1): int(m.group(2)) for m in row.finditer(slurm_part)},
            "source": "text"}


ROWS: list[tuple[str, str, Callable[[dict[str, Any]], float]]] = [
    ("controller calls per job, node scripts (sdiag)", "controller_rpcs",
     lambda f: f["calls_per_job"]),
    ("Slurm's own controller messages per job (sdiag)", "controller_rpcs",
     lambda f: sum(f["slurm"].values()) / f["jobs"]),
    ("prolog cold, median ms", "node_script_overhead", lambda f: f["median_ms"]["prolog_cold"]),
    ("prolog warm, median ms", "node_script_overhead", lambda f: f["median_ms"]["prolog_warm"]),
    ("task prolog, median ms", "node_script_overhead", lambda f: f["median_ms"]["task_prolog"]),
    ("prolog + task prolog cold, ms", "node_script_overhead",
     lambda f: f["median_ms"]["prolog_cold"] + f["median_ms"]["task_prolog"]),
    ("epilog, median ms", "node_script_overhead", lambda f: f["median_ms"]["epilog"]),
    ("epilog on 1 GB log, median ms", "node_script_overhead",
     lambda f: f["median_ms"]["epilog_big_log"]),
]


def table(figures: dict[str, dict[str, dict[str, Any]]],
          versions: dict[str, str]) -> pd.DataFrame:
    """Rows: the figures; columns: each release, then each new release / 22.05."""
    releases = [OLD_RELEASE, *reversed(NEW_RELEASES)]
    cols = {r: versions.get(r, r).split("-")[0] + (f" @{OLD_COMMIT}" if r == OLD_RELEASE else "")
            for r in releases}
    if len(set(cols.values())) < len(cols):
        cols = {r: r for r in releases}
    data: dict[str, dict[str, float]] = {}
    for label, bench, get in ROWS:
        row: dict[str, float] = {}
        for r in releases:
            f = figures.get(r, {}).get(bench)
            try:
                row[cols[r]] = float(get(f)) if f else math.nan
            except (KeyError, TypeError, ZeroDivisionError):
                row[cols[r]] = math.nan
        old = row[cols[OLD_RELEASE]]
        for r in reversed(NEW_RELEASES):
            new = row[cols[r]]
            ratio = new / old if old and not math.isnan(old) else math.nan
            row[f"{r}/22.05"] = ratio
        data[label] = row
    return pd.DataFrame.from_dict(data, orient="index")


# ---------------------------------------------------------------- main
def _terminate(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--releases", default=",".join([*NEW_RELEASES, OLD_RELEASE]),
                    help="comma-separated subset of 26.05,24.11,22.05 (default: all)")
    ap.add_argument("--out", type=Path, default=RESULTS / "across_releases.json")
    a = ap.parse_args()
    wanted = a.releases.split(",")
    if os.geteuid() != 0:
        print("run as root: it starts Slurm clusters", file=sys.stderr)
        return 2
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    lock = LOCK.open("w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"another across_releases run holds {LOCK}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)

    errors: list[str] = []
    dirty = dirty_files()
    versions: dict[str, str] = {}
    pythons: dict[str, str] = {}
    steps: list[Step] = []
    t0 = time.time()
    # all preparation first (apt, pip, debootstrap), so none of it runs beside a measurement
    for r in wanted:
        try:
            if r == OLD_RELEASE:
                prepare_old()
                versions[r] = slurm_version([])
                pythons[r] = python_version([], OLD_PY)
                steps += old_steps()
            else:
                root = prepare_new(r)
                inside = rootfs.command(root, ["true"])[:-1]
                versions[r] = slurm_version(inside)
                pythons[r] = python_version(inside, rootfs.venv_of(r) / "bin" / "python")
                steps += new_steps(r, root)
        except Exception as e:  # noqa: BLE001 - reported, the other releases still run
            errors.append(f"{r}: preparing: {e}")
            log(f"ERROR {errors[-1]}")
    figures: dict[str, dict[str, dict[str, Any]]] = {}
    runs: list[dict[str, Any]] = []
    for step in steps:
        load0 = os.getloadavg()[0]
        s0 = time.monotonic()
        entry: dict[str, Any] = {"release": step.release, "benchmark": step.bench,
                                 "load_before": round(load0, 2)}
        try:
            run_step(step)
            figures.setdefault(step.release, {})[step.bench] = parse(step)
        except Exception as e:  # noqa: BLE001 - reported, the other steps still run
            errors.append(f"{step.release} {step.bench}: {e}")
            entry["error"] = str(e)
            entry["output_tail"] = step.output[-40:]
            log(f"ERROR {errors[-1]}")
        entry["wall_s"] = round(time.monotonic() - s0, 1)
        entry["load_after"] = round(os.getloadavg()[0], 2)
        runs.append(entry)

    df = table(figures, versions)
    head = sh(["git", "-C", str(CHECKOUT), "rev-parse", "--short", "HEAD"],
              capture_output=True).stdout.strip()
    result = {
        "command": "python benchmarks/across_releases.py",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "checkout_head": head, "checkout_dirty_at_start": dirty, "old_commit": OLD_COMMIT,
        "slurm_versions": versions, "python_versions": pythons,
        "cpus": os.cpu_count(), "wall_s": round(time.time() - t0, 1),
        "note": "one run of each benchmark per release on a shared 2-core machine: "
                "compare ratios within this run",
        "table": json.loads(df.to_json(orient="index")),
        "figures": figures, "runs": runs, "errors": errors,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    df.to_csv(a.out.with_suffix(".csv"), float_format="%.3f")
    print()
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(df.to_string(float_format=lambda x: f"{x:.2f}"))
    print(f"\nSlurm: {versions}; load average before/after each run in {a.out}")
    print(f"written: {a.out}, {a.out.with_suffix('.csv')}")
    for err in errors:
        print(f"ERROR: {err}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
