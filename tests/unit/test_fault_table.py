"""The fault suite's rows, counts and table (slurm_colloc.bench.faults; issue 28 item 6)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slurm_colloc.bench import faults
from slurm_colloc.bench.faults import Outcome, Row


def test_rows_parse_kind_moment_and_outage() -> None:
    assert Row.parse("slurmctld@epilog") == Row("slurmctld", "epilog", 5.0)
    assert Row.parse(" mariadb@running:60 ") == Row("mariadb", "running", 60.0)
    assert Row.parse("mariadb@running:60").label == "mariadb@running:60"
    assert Row.parse("slurmd@prolog").label == "slurmd@prolog"


@pytest.mark.parametrize("text, says", [
    ("slurmctld", "<kind>@<moment>"),
    ("munged@epilog", "kind is one of"),
    ("slurmd@teardown", "moment is one of"),
    ("collector-worker@epilog", "collector-worker@running"),
    ("slurmdbd@epilog:99999", "0 to 3600"),
    ("slurmdbd@epilog:-1", "<kind>@<moment>"),
])
def test_bad_rows_say_what_a_row_is(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        Row.parse(text)


def test_the_quick_set_covers_every_daemon_at_every_moment() -> None:
    rows = faults.quick_rows()
    for kind in faults.DAEMON_KINDS:
        assert {r.moment for r in rows if r.kind == kind} == set(faults.MOMENTS)
    assert {r.kind for r in rows} == set(faults.KINDS)
    assert len({r.label for r in rows}) == len(rows)


def test_the_outage_set_has_the_issues_lengths() -> None:
    assert sorted({r.outage_s for r in faults.outage_rows()}) == [60, 300, 900]


@given(st.lists(st.floats(0, 1e4, allow_nan=False), min_size=1, max_size=200),
       st.floats(1, 100))
def test_percentile_is_a_member_and_monotone(values: list[float], q: float) -> None:
    p = faults.percentile(values, q)
    assert p in values
    assert faults.percentile(values, 100) == max(values)
    assert p is not None and p <= faults.percentile(values, 100)  # type: ignore[operator]


def test_percentile_nearest_rank() -> None:
    vals = [float(i) for i in range(1, 101)]
    assert faults.percentile(vals, 50) == 50.0
    assert faults.percentile(vals, 99) == 99.0
    assert faults.percentile([], 50) is None


def test_a_row_is_ok_only_when_nothing_is_lost_and_it_recovered() -> None:
    good = Outcome(Row("slurmdbd", "epilog"), jobs=2, records_expected=3, recovery_s=12.0)
    assert good.ok
    for change in ({"lost_records": 1}, {"lost_jobs": 1}, {"lost_requeues": 1},
                   {"drained": 1}, {"recovery_s": None}):
        bad = Outcome(good.row, jobs=2, records_expected=3, recovery_s=12.0)
        for k, v in change.items():
            setattr(bad, k, v)
        assert not bad.ok, change


def test_a_collector_row_needs_enforcement_back_within_ten_seconds() -> None:
    row = Row("collector-supervisor", "running")
    assert Outcome(row, recovery_s=1.0, enforcement_s=3.2).ok
    assert not Outcome(row, recovery_s=1.0, enforcement_s=10.5).ok
    assert not Outcome(row, recovery_s=1.0, enforcement_s=None).ok


def test_the_table_shows_each_count_against_its_total() -> None:
    o = Outcome(Row("slurmctld", "epilog"), jobs=2, lost_jobs=0, records_expected=3,
                lost_records=1, requeues_expected=1, prolog_s=[0.4, 0.5, 2.5],
                notes=["record replaced"])
    text = faults.table([o])
    row = text.splitlines()[-1]
    assert row.startswith("| slurmctld@epilog | 0/2 | 1/3 | 0/1 | 0 | — | — | 0.5 / 2.5 | NO")
    assert "record replaced" in row
    assert faults.summary([o]) == "0/1 rows lost nothing and recovered"


def test_prolog_times_come_from_the_rows_own_jobs() -> None:
    log = "\n".join([
        "2026-11-28 10:00:00 colloc: prolog: job 11: shared gpu=0 [took 0.41 s, cpu 0.20 s]",
        "2026-11-28 10:00:01 colloc: prolog: job 12: shared gpu=1 [took 1.50 s, cpu 0.30 s]",
        "2026-11-28 10:00:02 colloc: prolog: job 13: shared gpu=1 [took 9.00 s, cpu 0.30 s]",
        "2026-11-28 10:00:03 colloc: epilog: job 11: done [took 3.00 s, cpu 0.10 s]",
        "2026-11-28 10:00:04 colloc: prolog: job 12: a line without timing",
    ])
    assert faults.prolog_times(log, [11, 12]) == [0.41, 1.5]


def test_a_requeue_between_the_reads_does_not_settle_the_row(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen in faults --quick (slurmd@epilog): the late epilog requeued the OOM job
    between the suite's state read (FAILED, the old attempt) and its restart read (1):
    the row counted as settled and then found the job PENDING, one job "lost"."""
    world: dict[str, object] = {"state": "FAILED", "restarts": 0}
    reads: list[str] = []

    def state(slurm: object, job: int) -> str:
        reads.append("state")
        if job != 2:
            return "COMPLETED"
        seen = str(world["state"])
        if reads.count("state") == 1:
            world.update(state="PENDING", restarts=1)  # the requeue lands just after
        return seen

    suite = object.__new__(faults.Suite)
    suite.slurm = None  # type: ignore[assignment]
    monkeypatch.setattr(faults, "job_state", state)
    monkeypatch.setattr(suite, "_oom_seen", lambda job: True)
    monkeypatch.setattr(suite, "_restarts", lambda job: int(world["restarts"]))  # type: ignore[call-overload]
    assert not suite._settled(2, [2, 3])
    world["state"] = "COMPLETED"
    assert suite._settled(2, [2, 3])
