"""Record what a Slurm release's ``--json`` tools print for each kind of job we parse.

Why: the parsers in ``slurm_colloc/slurm/`` are pinned to data_parser v0.0.42, and the
only trustworthy description of its shapes is a live controller's answer. Run inside a
release's lab (as root; jobs run as root there)::

    .venv/bin/colloc devcluster shell --slurm 26.05 -- /opt/colloc-venv/bin/python \\
        tools/capture_slurm_fixtures.py --out tests/unit/data/slurm/26.05

It submits one job of each kind (plain, shard via ``--colloc-mem``, two whole GPUs,
array, failed with exit 3, signalled with ``scancel --signal=KILL``, killed by
SIGKILL from its own script, requeued with ``scontrol requeue`` once finished and once
running, held), and writes one file per (command, job kind):
``squeue-KIND.json`` (``squeue --json=v0.0.42 -t all -j ID``), ``scontrol-KIND.json``
(``scontrol --json=v0.0.42 show job ID``), ``sacct-KIND.json`` (``sacct
--json=v0.0.42 --allocations --duplicates -j ID``), plus ``sinfo.json``,
``scontrol-unknown.json`` (a job id the controller never had) and ``manifest.json``
(release, job ids, what each kind is). Each file holds one job (an array's tasks for
``array``), so the fixtures stay small. Nothing is scrubbed: the lab holds no secret.

Standard library only: it runs under the lab's own Python, whatever it has installed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

JSON_FLAG = "--json=v0.0.42"
SACCT_ARGS = (JSON_FLAG, "--allocations", "--duplicates")
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL",
            "PREEMPTED", "BOOT_FAIL", "DEADLINE"}

KINDS: dict[str, tuple[tuple[str, ...], str]] = {
    # kind: (sbatch arguments, script body)
    "plain": ((), "sleep 2\n"),
    "shard": (("--colloc-mem=2G",), "sleep 40\n"),
    "gpu2": (("--gres=gpu:2", "-p", "gpu"), "sleep 40\n"),
    "array": (("--array=0-2",), "sleep 2\n"),
    "failed": ((), "sleep 1\nexit 3\n"),
    "signalled": ((), "sleep 600\n"),
    "killed": ((), "sleep 1\nkill -KILL $$\n"),
    "requeued": (("--requeue",), "sleep 2\n"),
    "requeued_running": (("--requeue",), "sleep 30\n"),
    "held": (("--hold",), "sleep 2\n"),
}


def say(text: str) -> None:
    """Progress on stderr, flushed (the lab's shell may not pass a terminal)."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """One Slurm command (argv, no shell); a failure stops the capture loudly."""
    cp = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    if check and cp.returncode != 0:
        sys.exit(f"{' '.join(argv)}: exit {cp.returncode}: {cp.stderr.strip()}")
    return cp


def squeue(job_id: int) -> dict[str, Any]:
    """``squeue --json -t all -j ID`` parsed: ``-t all`` or finished jobs are hidden."""
    cp = run("squeue", JSON_FLAG, "-t", "all", "-j", str(job_id))
    doc: dict[str, Any] = json.loads(cp.stdout)
    return doc


def states(job_id: int) -> list[list[str]]:
    """``job_state`` lists of the job (each array task)."""
    return [list(j.get("job_state") or []) for j in squeue(job_id).get("jobs", [])]


def wait(job_id: int, ok: Callable[[list[list[str]]], bool], what: str, timeout: float) -> bool:
    """Poll until ``ok(states)``; False (and a warning) on timeout, so a busy cluster
    yields a partial capture rather than none."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = states(job_id)
        if st and ok(st):
            return True
        time.sleep(1)
    say(f"warning: job {job_id} not {what} after {timeout:.0f}s: {states(job_id)}")
    return False


def running(st: list[list[str]]) -> bool:
    return all("RUNNING" in s for s in st)


def finished(st: list[list[str]]) -> bool:
    return all(s and s[0] in FINISHED for s in st)


def sacct_done(job_id: int) -> bool:
    """slurmdbd lags behind the controller: wait until every attempt has ended."""
    doc = json.loads(run("sacct", *SACCT_ARGS, "-j", str(job_id)).stdout)
    jobs = doc.get("jobs") or []
    return bool(jobs) and all(
        (j.get("state", {}).get("current") or ["?"])[0] in FINISHED | {"REQUEUED"}
        for j in jobs)


def write(out: Path, name: str, text: str) -> None:
    """Pretty JSON (re-indented so diffs of a recapture are readable)."""
    (out / name).write_text(json.dumps(json.loads(text), indent=1, sort_keys=True) + "\n")


def capture(out: Path, kind: str, job_id: int, *, with_sacct: bool = True) -> None:
    """The job as squeue, scontrol and (optionally) sacct show it now."""
    write(out, f"squeue-{kind}.json",
          run("squeue", JSON_FLAG, "-t", "all", "-j", str(job_id)).stdout)
    write(out, f"scontrol-{kind}.json",
          run("scontrol", JSON_FLAG, "show", "job", str(job_id)).stdout)
    if with_sacct:
        write(out, f"sacct-{kind}.json", run("sacct", *SACCT_ARGS, "-j", str(job_id)).stdout)
    say(f"captured {kind} (job {job_id}): {states(job_id)}")


def submit(workdir: Path, kind: str) -> int:
    """sbatch one job of ``kind`` from a script in a job-writable directory."""
    args, body = KINDS[kind]
    script = workdir / f"{kind}.sh"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    cp = run("sbatch", "--parsable", f"--job-name=cap-{kind}", f"--chdir={workdir}",
             f"--output={workdir}/%x-%j.out", *args, str(script))
    return int(cp.stdout.strip().split(";")[0])


def phase_running(out: Path, ids: dict[str, int], timeout: float) -> None:
    """Shard, GPU and held jobs while they hold (or wait for) resources; the signalled
    job is killed first, as a whole-GPU job may want the node to itself (Exclusive)."""
    for kind in ("shard", "signalled"):
        if wait(ids[kind], running, "running", timeout):
            capture(out, f"{kind}-running", ids[kind], with_sacct=kind != "signalled")
    capture(out, "held-pending", ids["held"])
    run("scancel", "--signal=KILL", str(ids["signalled"]))
    run("scancel", str(ids["held"]))
    if wait(ids["gpu2"], running, "running", timeout):
        capture(out, "gpu2-running", ids["gpu2"])


def settle(job_id: int, timeout: float) -> None:
    """Wait until slurmdbd has recorded the end of every attempt (it lags)."""
    deadline = time.monotonic() + timeout
    while not sacct_done(job_id) and time.monotonic() < deadline:
        time.sleep(1)


def phase_requeue(out: Path, ids: dict[str, int], workdir: Path, timeout: float,
                  rerun: float) -> None:
    """Requeue a finished job and a running one (two attempts in accounting; the
    controller shows them pending again); then, if they rerun within ``rerun`` s,
    their finished second attempts. The running one is submitted only now: earlier,
    it could end while a whole-node GPU job is being waited for."""
    done = ids["requeued"]
    wait(done, finished, "finished", timeout)
    settle(done, timeout)
    live = ids["requeued_running"] = submit(workdir, "requeued_running")
    wait(live, running, "running", timeout)
    run("scontrol", "requeue", str(done))
    run("scontrol", "requeue", str(live))
    capture(out, "requeued_running-now", live, with_sacct=False)
    time.sleep(3)
    capture(out, "requeued-pending", done)
    capture(out, "requeued_running-pending", live)
    for kind, job in (("requeued", done), ("requeued_running", live)):
        if wait(job, finished, "finished after its requeue", rerun):
            settle(job, timeout)
            capture(out, f"{kind}-done", job)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--timeout", type=float, default=120, help="per wait, seconds")
    ap.add_argument("--rerun", type=float, default=240,
                    help="how long to wait for a requeued job's second run (0: skip)")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="colloc-capture-", dir="/tmp"))
    workdir.chmod(0o777)
    ids = {kind: submit(workdir, kind) for kind in KINDS if kind != "requeued_running"}
    say(f"submitted {ids}")
    phase_running(a.out, ids, a.timeout)
    phase_requeue(a.out, ids, workdir, a.timeout, a.rerun)
    for kind in KINDS:
        if kind.startswith("requeued"):
            continue
        wait(ids[kind], finished, "finished", a.timeout)
        settle(ids[kind], a.timeout)
        capture(a.out, kind, ids[kind])
    unknown = run("scontrol", JSON_FLAG, "show", "job", "999999999", check=False)
    write(a.out, "scontrol-unknown.json", unknown.stdout)
    write(a.out, "sinfo.json", run("sinfo", JSON_FLAG).stdout)
    version = run("sinfo", "--version").stdout.strip()
    manifest = {"release": version, "json_flag": JSON_FLAG, "jobs": ids,
                "scontrol_unknown": {"rc": unknown.returncode, "stderr": unknown.stderr},
                "kinds": {k: list(v[0]) for k, v in KINDS.items()},
                "captured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    (a.out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    say(f"wrote {len(list(a.out.iterdir()))} files to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
