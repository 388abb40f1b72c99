"""Issue 23 item 1: the report says when a job ran with no collector on its node."""

from __future__ import annotations

import os
from pathlib import Path

from slurm_colloc.metrics import liveness, store
from slurm_colloc.report import job as job_report
from slurm_colloc.report.inquirer import SlurmInquirer
from tests.unit.test_report_build import CFG, world


class WithGaps(type(world())):  # type: ignore[misc]
    def collector_gaps(self, job_id: str, start: float,
                       end: float | None) -> list[tuple[float, float]] | None:
        assert (job_id, start, end) == ("10", 1000, 1060)
        return [(1010.0, 1045.0)]


def test_a_gap_in_the_collector_is_a_note_and_in_the_json() -> None:
    w = world()
    inq = WithGaps(w.rows, w._live, w.ser)
    rep = job_report.build("10", inq, CFG)
    d = rep.to_json()
    assert d["attempts"][0]["unenforced"] == [[1010.0, 1045.0]]
    note = [n for n in d["notes"] if "without the node's collector" in n]
    assert note and "00:00:35" in note[0] and "not enforced" in note[0]


def test_no_record_here_says_nothing() -> None:
    rep = job_report.build("10", world(), CFG)
    assert rep.to_json()["attempts"][0]["unenforced"] is None
    assert not [n for n in rep.notes if "collector" in n]


def test_the_node_record_is_read_only_for_a_job_that_ran_here(tmp_path: Path) -> None:
    m = tmp_path / "m"
    m.mkdir()
    liveness.append_event(m, liveness.UP, 1, now=900.0)
    for t in (930.0, 960.0, 990.0):
        liveness.append_event(m, liveness.ALIVE, 1, now=t)
    liveness.append_event(m, liveness.DOWN, 1, "exit 1", now=1010.0)
    liveness.append_event(m, liveness.UP, 2, now=1045.0)
    inq = SlurmInquirer(slurm=None, metrics_dir=str(m))  # type: ignore[arg-type]
    assert inq.collector_gaps("10", 1000, 1060) is None  # no job 10 on this node
    store.ensure_dir(store.job_dir(m, "10"))
    os.utime(m)
    assert inq.collector_gaps("10", 1000, 1060) == [(1010.0, 1045.0)]
    assert inq.collector_gaps("../x", 1000, 1060) is None
