"""The job table against the real sacct (issue 27 item 3): ``colloc report -u U`` lists
the jobs ``sacct -X -u U`` lists, for a user without an association and one with, and
``--state``, ``--partition`` and ``--format`` select as sacct's ``-s``/``-r`` do.

Plain batch jobs (no GPU work): what is checked is which jobs the table finds.
"""

from __future__ import annotations

import json
import pwd
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.slurm.adapter import SlurmCli, wait_for_jobs
from tests.e2e.conftest import ensure_user, sbatch

pytestmark = pytest.mark.devcluster

LONE = f"colloc-tl{int(time.time()) % 10**6}"
"""A Unix user Slurm runs jobs for but accounting has no association of (made for the
test, removed at the end)."""
MEMBER = "colloc-tab-member"


def _report(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(cluster.venv_bin / "colloc"), "report", *args],
                          env=cluster.env(), capture_output=True, text=True, check=False,
                          timeout=60)


def _sacct(cluster: Cluster, *args: str) -> list[str]:
    cp = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "JobIDRaw", *args],
                        env=cluster.env(), capture_output=True, text=True, check=True,
                        timeout=30)
    return sorted(set(cp.stdout.split()))


def _table(cluster: Cluster, *args: str) -> list[dict[str, object]]:
    cp = _report(cluster, *args, "--json")
    assert cp.returncode == 0, cp.stderr
    rows: list[dict[str, object]] = json.loads(cp.stdout)["table"]
    return rows


@pytest.fixture
def lone_user(cluster: Cluster) -> Iterator[str]:
    try:
        pwd.getpwnam(LONE)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/bin/bash",
                        LONE], check=True)
    yield LONE
    subprocess.run(["userdel", LONE], check=False, capture_output=True)


def test_table_matches_sacct_for_users_with_and_without_association(
        cluster: Cluster, slurm: SlurmCli, workdir: Path, lone_user: str) -> None:
    ensure_user(cluster, MEMBER)
    assoc = subprocess.run(["sacctmgr", "-n", "-P", "show", "assoc", f"user={LONE}",
                            "format=user"], env=cluster.env(), capture_output=True, text=True,
                           check=True).stdout.split()
    assert assoc == [], f"{LONE} must have no association: {assoc}"
    since = (datetime.now() - timedelta(seconds=2)).strftime("%Y-%m-%dT%H:%M:%S")
    ok = sbatch(cluster, workdir, "true", "-t", "1", user=LONE)
    bad = sbatch(cluster, workdir, "exit 3", "-t", "1", user=LONE)
    other = sbatch(cluster, workdir, "true", "-t", "1", user=MEMBER)
    states = wait_for_jobs(slurm, [ok, bad, other], timeout=120)
    assert states == {str(ok): "COMPLETED", str(bad): "FAILED", str(other): "COMPLETED"}

    # slurmdbd hears of the ends a moment later
    deadline = time.monotonic() + 60
    while len(_sacct(cluster, "-u", LONE, "-S", since)) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    lone = _sacct(cluster, "-u", LONE, "-S", since)
    assert lone == sorted([str(ok), str(bad)])

    # what the JSON names as the user (on the devcluster slurmdbd names even a user
    # without an association; "user": null, issue 27's case, is unit-tested on both
    # releases' captured JSON)
    raw = subprocess.run(["sacct", "--json", "-X", "-j", str(ok)], env=cluster.env(),
                         capture_output=True, text=True, check=True).stdout
    json_user = json.loads(raw)["jobs"][0].get("user")

    rows = _table(cluster, "-u", LONE, "-S", since)
    assert sorted(str(r["raw_id"]) for r in rows) == lone, f"sacct JSON user: {json_user!r}"
    assert {r["user"] for r in rows} == {LONE}
    member = _table(cluster, "-u", MEMBER, "-S", since)
    assert [str(r["raw_id"]) for r in member] == _sacct(cluster, "-u", MEMBER, "-S", since)
    assert [str(r["raw_id"]) for r in member] == [str(other)]

    # --state as sacct -s (codes and names)
    for st, want in (("F", [str(bad)]), ("CD", [str(ok)]), ("COMPLETED,FAILED", lone)):
        got = sorted(str(r["raw_id"]) for r in _table(cluster, "-u", LONE, "-S", since,
                                                        "-s", st))
        # -E now: with -s and no -E, sacct looks at the one second after -S
        assert got == _sacct(cluster, "-u", LONE, "-S", since, "-E", "now", "-s", st) \
            == sorted(want), st

    # --partition as sacct -r
    part = str(rows[0]["partition"])
    assert part, rows[0]
    got = sorted(str(r["raw_id"]) for r in _table(cluster, "-u", LONE, "-S", since, "-r", part))
    assert got == _sacct(cluster, "-u", LONE, "-S", since, "-r", part) == lone
    assert _table(cluster, "-u", LONE, "-S", since, "-r", "nosuchpart") == []

    # --format: the chosen columns only; an unknown one names the valid ones
    cp = _report(cluster, "-u", LONE, "-S", since, "--format", "JobID,State,Partition")
    assert cp.returncode == 0, cp.stderr
    lines = cp.stdout.splitlines()
    at = next(i for i, ln in enumerate(lines) if "JobID" in ln)
    assert lines[at].split() == ["JobID", "State", "Partition"], lines[at]
    body = [ln.split() for ln in lines[at + 1:at + 3]]
    assert body == [[str(ok), "COMPLETED", part], [str(bad), "FAILED", part]], cp.stdout
    cp = _report(cluster, "-u", LONE, "--format", "JobID,Bogus")
    assert cp.returncode == 2 and "valid columns" in cp.stderr and "MemEff" in cp.stderr
