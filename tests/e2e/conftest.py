"""End-to-end fixtures: one real devcluster per test session.

The cluster uses its own root and ports so that it never collides with a demo
cluster a developer left running. Tests fail (not skip) without root: a skipped
end-to-end suite must not look like a passing one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.devcluster.layout import Layout, Spec
from slurm_colloc.slurm.adapter import SlurmCli

TEST_ROOT = Path(os.environ.get("COLLOC_TEST_ROOT", "/var/lib/colloc-devcluster-test"))
_BASE = int(os.environ.get("COLLOC_TEST_PORT_BASE", "26810"))
TEST_SPEC = Spec(ctld_port=_BASE + 7, slurmd_port=_BASE + 8, dbd_port=_BASE + 9,
                 mysql_port=_BASE - 3500)
LOG_KEEP = Path(__file__).resolve().parents[2] / ".pytest_cache" / "devcluster-logs"


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    if os.geteuid() != 0:
        pytest.fail("end-to-end tests start slurmd/munged and need root (run `make test` as root)")
    c = Cluster(Layout(TEST_ROOT), TEST_SPEC)
    c.down()  # leftovers of an interrupted run
    c.up(timeout=90)
    yield c
    c.down(keep_logs=LOG_KEEP)


@pytest.fixture(scope="session")
def slurm(cluster: Cluster) -> SlurmCli:
    return SlurmCli(env=cluster.env())


@pytest.fixture
def workdir(cluster: Cluster, request: pytest.FixtureRequest) -> Path:
    """A fresh job directory any user can write (jobs may run as another user)."""
    d = cluster.layout.root / "jobs" / request.node.name.replace("/", "_")[:80]
    d.mkdir(parents=True, exist_ok=True)
    d.parent.chmod(0o755)
    d.chmod(0o1777)
    return d


def sbatch(
    cluster: Cluster, workdir: Path, script_body: str, *args: str, user: str | None = None
) -> int:
    """Submit a batch script (as ``user`` if given) with output in ``workdir``."""
    import subprocess

    script = workdir / f"job-{len(list(workdir.iterdir()))}.sh"
    script.write_text("#!/bin/bash\n" + script_body + "\n")
    script.chmod(0o755)
    argv = ["sbatch", "--parsable", f"--chdir={workdir}", f"--output={workdir}/%j.out", *args,
            str(script)]
    if user:
        argv = ["runuser", "-u", user, "--", *argv]
    cp = subprocess.run(argv, env=cluster.env(), capture_output=True, text=True, check=False)
    assert cp.returncode == 0, f"sbatch failed: {cp.stderr}"
    return int(cp.stdout.strip().split(";")[0])


def node_state(cluster: Cluster) -> str:
    import subprocess

    cp = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%t", "-n", cluster.spec.node_name],
        env=cluster.env(), capture_output=True, text=True, check=True,
    )
    return cp.stdout.strip()


def ensure_user(cluster: Cluster, name: str) -> None:
    """A Unix user with a Slurm association (for the multi-user tests)."""
    import pwd
    import subprocess

    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/bin/bash", name],
                       check=True)
    cluster.add_user(name)
