"""Issue 28 items 4 and 5 on the devcluster: causes that survive, promises checked.

* A GPU-OOM job whose output is a FIFO, and one that deleted its own output file: the
  epilog cannot scan either (before, it said only ``cause=none``). Each log is named in
  the epilog's log line, in the attempt's record in accounting and in colloc-report.
* A GPU promised more shards than it has (its registrations planted as root state, as
  a slurmctld restart left them in the issue's run): the newcomer's prolog does not
  co-locate it, requeues it with ``scontrol requeue`` (the real call of this release,
  from inside a running Prolog), and the node is never drained; once the GPU is free
  the job reruns and completes.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from slurm_colloc import config as cfgmod
from slurm_colloc.accounting.codec import try_decode
from slurm_colloc.accounting.record import JobRecord
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.mps.tenancy import Tenancy
from slurm_colloc.slurm.adapter import SlurmCli, by_start, wait_for_jobs
from tests.e2e.conftest import node_state, sbatch
from tests.e2e.test_report_e2e import report

pytestmark = pytest.mark.devcluster

DRAINED = ("drain", "drng", "down", "fail")
OOM = "colloc-simjob --mem 3G --peak 9G --peak-at 0.3 --seconds 2"  # over its 6 shards


def _wait(cond: Callable[[], bool], what: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.5)
    raise TimeoutError(what)


def _record(slurm: SlurmCli, job: int) -> JobRecord | None:
    recs = by_start(slurm.accounting([job]))
    return try_decode(recs[-1].fields.get("AdminComment", "")) if recs else None


def _log(cluster: Cluster) -> str:
    return (cluster.layout.log / "colloc.log").read_text(errors="replace")


@contextlib.contextmanager
def _drained(fifo: Path) -> Iterator[None]:
    """Read the FIFO until its writer (the job's slurmstepd) closes it."""

    def drain() -> None:
        with open(fifo, "rb") as f:  # blocks until the job opens it
            while f.read(1 << 16):
                pass

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    try:
        yield
    finally:
        with contextlib.suppress(OSError):  # never opened by a job: let the reader go
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(timeout=10)


def test_unscannable_output_is_named_in_log_record_and_report(
    cluster: Cluster, slurm: SlurmCli, workdir: Path
) -> None:
    fifo = workdir / "fifo.out"
    os.mkfifo(fifo, 0o600)
    with _drained(fifo):
        to_fifo = sbatch(cluster, workdir, OOM, "--gres=shard:6", f"--output={fifo}")
        deleted = sbatch(cluster, workdir, f'rm -f "{workdir}/$SLURM_JOB_ID.out"\n{OOM}',
                         "--gres=shard:6")
        states = wait_for_jobs(slurm, [to_fifo, deleted], timeout=90)
    assert states == {str(to_fifo): "FAILED", str(deleted): "FAILED"}, states
    gone = f"{workdir}/{deleted}.out"
    named = {to_fifo: f"{fifo}: FIFO, not read", deleted: f"{gone}: missing (deleted?), not read"}
    _wait(lambda: all(f"job {j}: cause=none" in _log(cluster) for j in named),
          "the epilogs' lines", 60)
    log = _log(cluster)
    for job, said in named.items():
        line = next(ln for ln in log.splitlines() if f"job {job}: cause=none" in ln)
        assert f"cannot scan {said}" in line, line
    for job, said in named.items():
        _wait(lambda: all(_record(slurm, j) is not None for j in named), "the records", 90)
        rec = _record(slurm, job)
        assert rec is not None and rec.attempts[-1].unscanned == (said,), rec
    _, out, _ = report(cluster, str(to_fifo))
    flat = out.replace("\n", "")  # the console wraps long paths
    assert f"the job's output could not be scanned: {fifo}: FIFO" in flat, out
    _, out, _ = report(cluster, str(deleted), "--json")
    assert json.loads(out)["attempts"][-1]["unscanned"] == [named[deleted]], out
    assert node_state(cluster) in ("idle", "mix"), node_state(cluster)


def test_an_over_promised_gpu_sends_the_newcomer_back_without_draining(
    cluster: Cluster, slurm: SlurmCli, workdir: Path
) -> None:
    tenancy = Tenancy(Path(cfgmod.load(cluster.layout.colloc_conf).mps_root))
    fakes = {gpu: 999_900 + gpu for gpu in range(cluster.spec.gpus)}
    later = time.time() + 3600  # registered after any snapshot: it counts as running
    for gpu, fake in fakes.items():  # every GPU already promised all its 39 shards
        tenancy.add_job(gpu, 0, fake)
        marker = tenancy.user_dir(gpu, 0) / "jobs" / str(fake)
        os.utime(marker, (later, later))
        tenancy.write_job_context(fake, json.dumps({"shards": 39}))
    try:
        job = sbatch(cluster, workdir, 'echo "attempt=${SLURM_RESTART_COUNT:-0}"',
                     "--gres=shard:2")
        _wait(lambda: f"prolog: job {job}: refused" in _log(cluster),
              f"job {job}'s prolog did not refuse it", 60)
        line = next(ln for ln in _log(cluster).splitlines()
                    if f"prolog: job {job}: refused" in ln)
        assert "41 shards promised" in line and f"job {job} requeued (1 of 3)" in line, line
        _wait(lambda: (slurm.show_job(job) or {}).get("Restarts") == "1",
              f"job {job} was not requeued: {slurm.show_job(job)}", 60)
        assert not node_state(cluster).startswith(DRAINED), node_state(cluster)
    finally:
        for fake in fakes.values():
            tenancy.remove_job(fake)
            tenancy.forget_job_context(fake)
    assert wait_for_jobs(slurm, [job], timeout=90)[str(job)] == "COMPLETED"
    assert "attempt=1" in (workdir / f"{job}.out").read_text()
    print("\n".join(ln for ln in _log(cluster).splitlines() if f"job {job}:" in ln))
    assert node_state(cluster) in ("idle", "mix"), node_state(cluster)
