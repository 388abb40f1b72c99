"""slurmdbd away while jobs end, one of them OOM'd and requeued (issue 28 item 1).

Fault injection lost 4 of 6 records with slurmdbd and MariaDB away for 243 s: the
record writer gave up after ~36 s and nothing replayed what it left. Here slurmdbd
is stopped while two jobs end (one OOMs, is requeued and ends on a whole GPU) and
kept away for at least 30 s. Meanwhile every attempt's record waits in root's spool
(``colloc admin records`` lists it) and ``colloc-report`` says accounting is
unreachable instead of failing with sacct's error. After slurmdbd is back, every
attempt's record must reach accounting within 2 minutes. slurmdbd is always running
again when the module ends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from slurm_colloc import config as cfgmod
from slurm_colloc.accounting.field import record_in
from slurm_colloc.accounting.newest import attempt_numbers
from slurm_colloc.accounting.spool import spool_dir_of
from slurm_colloc.devcluster import daemons
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.slurm.adapter import SlurmCli, SlurmError, by_start
from tests.e2e.conftest import sbatch

pytestmark = pytest.mark.devcluster

OUTAGE_S = 30.0
RECORD_WITHIN_S = 120.0


def _wait(cond: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.5)
    raise TimeoutError(what)


@pytest.fixture
def dbd_back(cluster: Cluster) -> Iterator[None]:
    """slurmdbd running again whatever the test did."""
    try:
        yield
    finally:
        if cluster.status().get("slurmdbd") is None:
            cluster.restart("slurmdbd", timeout=60)


def _stop_dbd(cluster: Cluster) -> None:
    pid = cluster.status()["slurmdbd"]
    assert pid is not None
    os.kill(pid, signal.SIGTERM)
    _wait(lambda: not daemons.pid_runs(pid, "slurmdbd"), "slurmdbd did not stop", 20)


def _tool(cluster: Cluster, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(cluster.venv_bin / argv[0]), *argv[1:]], env=cluster.env(),
                          capture_output=True, text=True, check=False, timeout=60)


def _attempts(slurm: SlurmCli, job: int, field: cfgmod.RecordField) -> frozenset[int]:
    """The attempts accounting's best record of ``job`` holds (none while away)."""
    try:
        rows = by_start(slurm.accounting([job]))
    except SlurmError:
        return frozenset()
    got: frozenset[int] = frozenset()
    for r in rows:
        got |= attempt_numbers(record_in(r.fields, field))
    return got


def test_records_kept_while_accounting_is_away_reach_it_after(
    cluster: Cluster, slurm: SlurmCli, workdir: Path, dbd_back: None
) -> None:
    cfg = cfgmod.load(cluster.layout.colloc_conf)
    spool = spool_dir_of(cfg.evidence_dir)
    ok = sbatch(cluster, workdir, "colloc-simjob --mem 2G --seconds 4", "--gres=shard:4")
    oom = sbatch(cluster, workdir,
                 "colloc-simjob --mem 3G --peak 9G --peak-at 0.3 --seconds 3",
                 "--gres=shard:6")
    # at once: the jobs start and end without slurmdbd (slurmctld keeps their
    # records), and no race with a short job ending before the stop
    _stop_dbd(cluster)
    stopped = time.monotonic()
    try:
        # every attempt's record is in root's spool, and the admin sees it
        _wait(lambda: (spool / f"{ok}.0.adminc").exists()
              and (spool / f"{oom}.0.adminc").exists(), "records not spooled", 60)
        _wait(lambda: (slurm.show_job(oom) or {}).get("Restarts") == "1",
              f"job {oom} was not requeued", 60)
        listing = _tool(cluster, "colloc", "admin", "records")
        assert listing.returncode == 0, listing.stderr
        assert f"{ok} " in listing.stdout and f"{oom} " in listing.stdout, listing.stdout
        # the report says accounting is away, from what it can reach
        rep = _tool(cluster, "colloc-report", str(ok), "--json")
        assert rep.returncode == 0, rep.stderr
        away = json.loads(rep.stdout)["accounting"]
        assert away.startswith("accounting unreachable: "), away
        left = OUTAGE_S - (time.monotonic() - stopped)
        if left > 0:
            _wait(lambda: time.monotonic() - stopped >= OUTAGE_S, "outage", left + 5)
    finally:
        outage = time.monotonic() - stopped
        cluster.restart("slurmdbd", timeout=60)
    back = time.monotonic()
    want = {ok: frozenset({0}), oom: frozenset({0, 1})}
    reached: dict[int, float] = {}

    def all_recorded() -> bool:
        for j, need in want.items():
            if j not in reached and need <= _attempts(slurm, j, cfg.record_field):
                reached[j] = time.monotonic() - back
        return len(reached) == len(want)

    try:
        _wait(all_recorded, "records did not reach accounting", RECORD_WITHIN_S)
    finally:
        print(f"\nslurmdbd away {outage:.0f} s; records in accounting after the restart "
              f"(s): {json.dumps({str(k): round(v) for k, v in reached.items()})}; "
              f"wanted {({str(k): sorted(v) for k, v in want.items()})}")
    _wait(lambda: not list(spool.glob(f"{ok}.*.adminc")) and not list(
        spool.glob(f"{oom}.*.adminc")), "spool entries not removed after confirmation", 30)
