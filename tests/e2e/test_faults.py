"""The fault-injection suite's short rows on a devcluster of their own (issue 28 item 6).

Each row SIGKILLs one part at one moment of an OOM job's life (or fills root's state
filesystem) while a good job runs beside it, brings the part back the way an admin
would (``Cluster.restart``, what ``colloc devcluster restart`` runs; the collector
is never restarted by the test: colloc must bring it back), and counts what was lost
(:mod:`slurm_colloc.bench.faults`). Every row must lose no job, no record and no
requeue, drain nothing, and recover; a collector row must have enforcement back
within 10 s. The long outages and the whole table are ``benchmarks/faults.py``.

Its own cluster: the gates change slurm.conf and the kills would disturb other
modules' jobs on the session's cluster.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from slurm_colloc.bench import faults
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.devcluster.layout import Layout, Spec
from tests.e2e.conftest import _BASE, LOG_KEEP, TEST_ROOT

pytestmark = pytest.mark.devcluster

ROWS = ["slurmctld@prolog", "slurmdbd@epilog", "mariadb@epilog", "collector-supervisor@running",
        "statefs@epilog:10"]
"""``slurmctld@prolog`` lost 1 of 3 records in one CI run (2026-11-28): slurmctld's
restart re-sent a job that had ended with its own AdminComment, replacing the record
colloc had written and read back. The record writer now keeps written records
confirming and writes a replaced one again (issue 28); the row is back. The other
slurmctld rows are in the benchmark; tests/e2e/test_fault_controller.py covers
slurmctld away at an epilog."""
SPEC = Spec(ctld_port=_BASE + 47, slurmd_port=_BASE + 48, dbd_port=_BASE + 49,
            mysql_port=_BASE - 3500 + 40)


@pytest.fixture(scope="module")
def suite() -> Iterator[faults.Suite]:
    c = Cluster(Layout(TEST_ROOT.with_name(TEST_ROOT.name + "-faults")), SPEC)
    c.down()
    c.up(timeout=120)
    try:
        workdir = c.layout.root / "jobs" / "faults"
        workdir.mkdir(parents=True, exist_ok=True)
        workdir.parent.chmod(0o755)
        workdir.chmod(0o1777)
        with faults.Suite(c, workdir).installed() as s:
            yield s
    finally:
        c.down(keep_logs=LOG_KEEP / "faults")


@pytest.mark.parametrize("text", ROWS)
def test_a_fault_loses_nothing(suite: faults.Suite, text: str) -> None:
    o = suite.run_row(faults.Row.parse(text))
    print("\n" + faults.table([o]))
    assert o.requeues_expected == 1, f"the OOM job never OOM'd: the row proves nothing: {o}"
    assert o.records_expected >= 3
    assert o.ok, faults.table([o])
