"""A site's own Prolog/Epilog/TaskProlog beside colloc's on the devcluster (issue 26 item 1).

slurm.conf gets the site's Prolog and Epilog as lines of their own next to colloc's
(Slurm runs every line); the site's TaskProlog is chained by colloc's
(colloc.conf ``chain_task_prolog``). The module puts slurm.conf and colloc.conf back
and resumes the node when it is done: later modules share the cluster.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.slurm.adapter import SlurmCli, wait_for_jobs
from tests.e2e.conftest import node_state, sbatch

pytestmark = pytest.mark.devcluster

SITE_PROLOG = """#!/bin/sh
# a site's health check: writes a marker, fails while {fail} exists
echo "prolog $SLURM_JOB_ID" >> {marks}/prolog
[ -e {fail} ] && exit 1
exit 0
"""
SITE_EPILOG = """#!/bin/sh
echo "epilog $SLURM_JOB_ID" >> {marks}/epilog
exit 0
"""
SITE_TASK_PROLOG = """#!/bin/sh
echo "export SITE_SCRATCH=/scratch/$SLURM_JOB_ID"
echo "print site task prolog was here"
exit 0
"""


def _wait(cond: Callable[[], bool], what: str, timeout: float = 45) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.5)
    raise TimeoutError(what)


def _scontrol(cluster: Cluster, *args: str) -> str:
    cp = subprocess.run(["scontrol", *args], env=cluster.env(), capture_output=True,
                        text=True, check=False)
    assert cp.returncode == 0, f"scontrol {' '.join(args)}: {cp.stderr}"
    return cp.stdout


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


class Site:
    """Where the site's scripts leave their markers, and the switch that fails its prolog."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.marks = root / "marks"
        self.fail = root / "fail-prolog"


def _install_site(cluster: Cluster) -> Site:
    site = Site(cluster.layout.root / "site-hooks")
    site.marks.mkdir(parents=True, exist_ok=True)
    site.root.chmod(0o755)
    site.marks.chmod(0o755)
    for name, text in (("prolog", SITE_PROLOG), ("epilog", SITE_EPILOG),
                       ("task_prolog", SITE_TASK_PROLOG)):
        p = site.root / name
        p.write_text(text.format(marks=site.marks, fail=site.fail))
        p.chmod(0o755)
    return site


@pytest.fixture(scope="module")
def site(cluster: Cluster) -> Iterator[Site]:
    """The site's hooks wired in beside colloc's; everything put back afterwards."""
    conf, cconf = cluster.layout.slurm_conf, cluster.layout.colloc_conf
    conf_text, cconf_text = conf.read_text(), cconf.read_text()
    s = _install_site(cluster)
    # the site's lines first, colloc's stay where the devcluster wrote them
    conf.write_text(f"Prolog={s.root / 'prolog'}\nEpilog={s.root / 'epilog'}\n" + conf_text)
    cconf.write_text(f'chain_task_prolog = "{s.root / "task_prolog"}"\n' + cconf_text)
    try:
        _scontrol(cluster, "reconfigure")
        _wait(lambda: str(s.root / "prolog") in _scontrol(cluster, "show", "config"),
              "slurmctld did not take the site's Prolog")
        yield s
    finally:
        s.fail.unlink(missing_ok=True)
        conf.write_text(conf_text)
        cconf.write_text(cconf_text)
        _scontrol(cluster, "reconfigure")
        if "drain" in node_state(cluster) or "drng" in node_state(cluster):
            _scontrol(cluster, "update", f"nodename={cluster.spec.node_name}", "state=resume")
        _wait(lambda: str(s.root / "prolog") not in _scontrol(cluster, "show", "config"),
              "slurmctld kept the site's Prolog")
        _wait(lambda: node_state(cluster) in ("idle", "mix"), "node not back to idle")


def _final(slurm: SlurmCli, job: int) -> str:
    return wait_for_jobs(slurm, [job], timeout=90)[str(job)]


def test_site_hooks_run_beside_collocs_on_a_colloc_job(
    cluster: Cluster, slurm: SlurmCli, workdir: Path, site: Site
) -> None:
    job = sbatch(cluster, workdir,
                 'echo "SITE=$SITE_SCRATCH PIPE=$CUDA_MPS_PIPE_DIRECTORY"', "--colloc-mem=2G")
    assert _final(slurm, job) == "COMPLETED"
    out = (workdir / f"{job}.out").read_text()
    # the site's TaskProlog ran first (its export and print reached the task) and
    # colloc's exports followed (the MPS pipe its prolog set up)
    assert f"SITE=/scratch/{job} " in out, out
    assert "PIPE=/" in out and "site task prolog was here" in out, out
    assert f"prolog {job}" in _lines(site.marks / "prolog")
    _wait(lambda: f"epilog {job}" in _lines(site.marks / "epilog"), "site epilog did not run")
    log = cluster.layout.log / "colloc.log"
    _wait(lambda: f"epilog: job {job}:" in log.read_text(), "colloc's epilog did not run")
    assert f"prolog: job {job}:" in log.read_text()


def test_failing_site_prolog_fails_the_job_as_slurm_intends(
    cluster: Cluster, slurm: SlurmCli, workdir: Path, site: Site
) -> None:
    """Slurm's meaning of a failed Prolog stands with colloc's beside it: the node is
    drained and the batch job requeued held (it never runs)."""
    site.fail.touch()
    job = sbatch(cluster, workdir, "echo ran", "--colloc-mem=2G")
    try:
        _wait(lambda: "drain" in node_state(cluster) or "drng" in node_state(cluster),
              "node not drained by the failed prolog")
        def requeued_held() -> bool:
            info = slurm.show_job(job) or {}  # COMPLETING first while the epilogs run
            return (info.get("JobState") == "PENDING"
                    and "held" in str(info.get("Reason", "")).lower())

        _wait(requeued_held, f"job {job} not requeued held: {slurm.show_job(job)}")
        assert f"prolog {job}" in _lines(site.marks / "prolog")
        assert not (workdir / f"{job}.out").exists() or "ran" not in (
            workdir / f"{job}.out").read_text()
    finally:
        slurm.cancel([job])
        site.fail.unlink(missing_ok=True)
        _scontrol(cluster, "update", f"nodename={cluster.spec.node_name}", "state=resume")
        _wait(lambda: node_state(cluster) in ("idle", "mix"), "node not resumed")
