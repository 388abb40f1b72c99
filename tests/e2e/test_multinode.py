"""A real site in miniature: `colloc devcluster up --nodes 3`, read from the login host.

Three compute hosts, each in its own network, mount and UTS namespace (private
colloc state, MPS dirs, simulated GPUs and /tmp; /home shared): colloc-node0 (2 x 40 GB,
partition ``shared``), colloc-node1 (1 x 80 GB, ``shared80``), colloc-node2 (2 x 40 GB,
partition ``gpu``, whole GPUs only, the default). The test runs as an unprivileged user
with a home directory, from the host, which plays the login node: nothing it reads
comes from a compute host's disk.

What issue 13 asks, end to end:
* a job's first attempt runs out of GPU memory on one host and completes on another;
* ``colloc-report`` on the login host shows both attempts with their plots (the
  accounting record's downsampled series) and evidence the user can read;
* the next run of the model at another batch size is sized from history (slurmdbd);
* a plain ``--gres=gpu:1`` job is not rewritten and never lands on a shard GPU.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_colloc.accounting.submit_record import parse_record
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.devcluster.layout import Layout, Spec
from slurm_colloc.slurm.adapter import SlurmCli, wait_for_jobs

pytestmark = pytest.mark.devcluster

ROOT = Path("/var/lib/colloc-multinode-test")
SPEC = Spec(nodes=3, gpus=2, ctld_port=25827, slurmd_port=25828, dbd_port=25829,
            mysql_port=25316)
USER = "colloc-site1"
SUMMARY = (Path(__file__).resolve().parents[2] / "sbatch_templates" / "summaries"
           / "resnet50_torchinfo.txt")
LOG_KEEP = Path(__file__).resolve().parents[2] / ".pytest_cache" / "multinode-logs"


@pytest.fixture(scope="module")
def mc() -> Iterator[Cluster]:
    if os.geteuid() != 0:
        pytest.fail("the multi-node devcluster needs root (namespaces, slurmd)")
    c = Cluster(Layout(ROOT), SPEC)
    c.down()
    c.up(timeout=90)
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--home-dir", f"/home/{USER}",
                        "--shell", "/bin/bash", USER], check=True)
    c.add_user(USER)
    yield c
    c.down(keep_logs=LOG_KEEP)


@pytest.fixture(scope="module")
def slurm(mc: Cluster) -> SlurmCli:
    return SlurmCli(env=mc.env())


@pytest.fixture
def home(request: pytest.FixtureRequest) -> Path:
    """A job directory in the user's home (shared by every host, as /home is at a site)."""
    d = Path(f"/home/{USER}") / str(request.node.name)[:60]
    subprocess.run(["runuser", "-u", USER, "--", "mkdir", "-p", str(d)], check=True)
    return d


def as_user(mc: Cluster, argv: list[str], *, check: bool = True) -> str:
    cp = subprocess.run(["runuser", "-u", USER, "--", *argv], env=mc.env(),
                        capture_output=True, text=True, check=False, cwd="/")
    if check:
        assert cp.returncode == 0, f"{argv[:3]}: {cp.stderr}"
    return cp.stdout


def submit(mc: Cluster, home: Path, body: str, *args: str) -> int:
    script = home / f"job-{time.monotonic_ns()}.sh"
    script.write_text("#!/bin/bash\n" + body + "\n")
    os.chown(script, pwd.getpwnam(USER).pw_uid, -1)
    out = as_user(mc, ["sbatch", "--parsable", f"--chdir={home}", f"--output={home}/%j.out",
                       *args, str(script)])
    return int(out.strip().split(";")[0])


def nodes_of(slurm: SlurmCli, job: int) -> str:
    return str((slurm.show_job(job) or {}).get("BatchHost", ""))


def wait_running(slurm: SlurmCli, jobs: list[int], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = {j: str((slurm.show_job(j) or {}).get("JobState", "")) for j in jobs}
        if all(s == "RUNNING" for s in states.values()):
            return
        time.sleep(0.5)
    pytest.fail(f"jobs not running: {states}")


def test_hosts_are_separate_machines_sharing_home(mc: Cluster, slurm: SlurmCli) -> None:
    names = [n.name for n in mc.spec.node_plans()]
    for n in names:
        out = subprocess.run(mc.enter_argv(n, ["hostname"]), capture_output=True, text=True,
                             check=True).stdout.strip()
        assert out == n
    marker = mc.layout.colloc_var / "login-only"
    marker.write_text("x")
    seen = subprocess.run(mc.enter_argv(names[0], ["ls", str(mc.layout.colloc_var)]),
                          capture_output=True, text=True, check=True).stdout
    assert "login-only" not in seen  # the host's colloc state is not the login host's
    marker.unlink()
    gres = {n["NodeName"]: n.get("Gres", "") for n in slurm.nodes()}
    assert "shard:78" in str(gres[names[0]])  # 2 x 39: each host sized by its own GPUs
    assert "shard:79" in str(gres[names[1]])
    assert "shard" not in str(gres[names[2]])


def test_oom_on_one_host_completes_on_another_and_the_login_host_sees_it_all(
    mc: Cluster, slurm: SlurmCli, home: Path
) -> None:
    node0, node1, _ = (n.name for n in mc.spec.node_plans())
    # two long jobs take 20 of the 39 shards of each of node0's GPUs: the victim fits
    # next to one of them, but a whole 40 GB GPU's worth (39 shards) fits only on node1
    fillers = [submit(mc, home, "sleep 600", "--colloc-mem=20G") for _ in range(2)]
    wait_running(slurm, fillers)
    assert {nodes_of(slurm, j) for j in fillers} == {node0}
    victim = submit(mc, home, "colloc-simjob --mem 2G --peak 6G --peak-at 0.5 --seconds 6",
                    "--colloc-mem=3G")
    try:
        state = wait_for_jobs(slurm, [victim], timeout=150)[str(victim)]
    finally:
        slurm.cancel(fillers)
    assert state == "COMPLETED"
    # the last attempt's record reaches slurmdbd after the job's end record does
    deadline = time.monotonic() + 60
    while True:
        report = json.loads(as_user(mc, ["colloc-report", str(victim), "--json"]))
        attempts = report["attempts"]
        if (len(attempts) >= 2 and attempts[-1]["samples"]) or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert len(attempts) == 2, attempts
    first, second = attempts
    assert first["node"] == node0 and second["node"] == node1
    assert first["oom"]["cause"] == "gpu-oom" and first["requeue"]["requeued"]
    assert first["oom"]["evidence_readable"] is True
    evidence = Path(first["oom"]["evidence"])
    assert evidence.is_relative_to(home)  # next to the job's output, not in root's dirs
    assert evidence.stat().st_uid == pwd.getpwnam(USER).pw_uid
    assert "out of memory" in as_user(mc, ["cat", str(evidence)]).lower()
    for a in attempts:  # plots from the accounting record: no compute host disk here
        assert a["series_source"] and len(a["series_points"]) >= 3, a
    html = home / "report.html"
    as_user(mc, ["colloc-report", str(victim), "--html", str(html)])
    page = html.read_text()
    assert page.count("<polyline") >= 2 and "No time series" not in page
    # root's copy stayed on node0's own disk
    root_copy = subprocess.run(
        mc.enter_argv(node0, ["ls", str(mc.layout.colloc_var / "evidence")]),
        capture_output=True, text=True, check=True).stdout
    assert str(victim) in root_copy
    assert not (mc.layout.colloc_var / "evidence").exists() or str(victim) not in " ".join(
        os.listdir(mc.layout.colloc_var / "evidence"))


def test_next_run_at_another_batch_size_is_sized_from_accounting_history(
    mc: Cluster, slurm: SlurmCli, home: Path
) -> None:
    opts = (f"--colloc={SUMMARY}", "--colloc-optimizer=momentum")
    first = submit(mc, home, "colloc-simjob --mem 5G --peak 6G --peak-at 0.3 --seconds 4",
                   *opts, "--colloc-batch-size=48")
    r1 = parse_record(str((slurm.show_job(first) or {}).get("AdminComment", "")))
    assert r1 is not None and r1.estimator == "layer-aware"
    assert wait_for_jobs(slurm, [first], timeout=120)[str(first)] == "COMPLETED"
    # the peak reaches the login host through slurmdbd once the epilog's record lands
    deadline = time.monotonic() + 60
    est: dict[str, object] = {}
    while time.monotonic() < deadline:
        est = json.loads(as_user(mc, ["colloc", "estimate", "--summary", str(SUMMARY),
                                      "--batch-size", "96",
                                      "--optimizer", "momentum", "--json"]))
        if str(est.get("estimator", "")).startswith("history"):
            break
        time.sleep(2)
    assert est.get("estimator") == "history-anchored", est
    nxt = submit(mc, home, "sleep 1", *opts, "--colloc-batch-size=96")
    r2 = parse_record(str((slurm.show_job(nxt) or {}).get("AdminComment", "")))
    slurm.cancel([nxt])
    assert r2 is not None and r2.estimator == "history-anchored", r2
    assert r2.fingerprint == r1.fingerprint


def test_plain_gpu_job_is_left_alone_and_never_on_a_shard_gpu(
    mc: Cluster, slurm: SlurmCli, home: Path
) -> None:
    whole_host = mc.spec.node_plans()[-1].name
    shard_job = submit(mc, home, "sleep 60", "--colloc-mem=4G")
    plain = submit(mc, home, "echo CVD=$CUDA_VISIBLE_DEVICES", "--gres=gpu:1")
    info = slurm.show_job(plain) or {}
    assert "shard" not in str(info.get("TresPerNode", "")), info
    assert not str(info.get("AdminComment") or "").startswith("colloc1:")
    try:
        assert wait_for_jobs(slurm, [plain], timeout=90)[str(plain)] == "COMPLETED"
        assert nodes_of(slurm, plain) == whole_host
        assert nodes_of(slurm, shard_job) != whole_host
    finally:
        slurm.cancel([shard_job])
    acct = subprocess.run(["sacct", "-X", "-n", "-P", "-j", str(plain), "-o", "AllocTRES"],
                          env=mc.env(), capture_output=True, text=True, check=True).stdout
    assert "gres/gpu=1" in acct and "gres/shard" not in acct
