"""colloc beside Princeton jobstats (issue 26 item 2), on the real Slurm.

jobstats' slurmctld epilog writes ``JS1:`` + base64(gzip(json)) over the whole
AdminComment with ``sacctmgr -i modify job where jobid=N set AdminComment=...``; the
writer below does exactly that. With ``record_field = "system_comment"`` colloc's
record lives in SystemComment: both records survive whichever writes first. With the
default field, colloc's writer that finds a ``JS1:`` summary puts its record in
SystemComment instead of replacing it. Either way ``colloc-report`` reads colloc's
record and ``colloc admin gpu-shares`` exports the job's fraction of a GPU. A requeued
job's record crosses attempts in the live AdminComment and still ends in SystemComment.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_colloc import config as cfgmod
from slurm_colloc.accounting.codec import try_decode
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.node import record_writer
from slurm_colloc.slurm.adapter import SlurmCli, by_start
from tests.e2e.conftest import sbatch

pytestmark = pytest.mark.devcluster

JOB = "colloc-simjob --mem 1G --sm-activity 20 --seconds 3"
OOM_JOB = "colloc-simjob --mem 1G --peak 3G --peak-at 0.2 --sm-activity 20 --seconds 4"


def js1_write(cluster: Cluster, job: int, summary: dict[str, Any]) -> str:
    """What jobstats' slurmctld epilog does (its own encoding, its own command)."""
    text = "JS1:" + base64.b64encode(gzip.compress(json.dumps(summary).encode())).decode()
    subprocess.run(["sacctmgr", "-i", "modify", "job", "where", f"jobid={job}", "set",
                    f"AdminComment={text}"], env=cluster.env(), check=True,
                   capture_output=True, timeout=30)
    return text


def js1_read(text: str) -> dict[str, Any]:
    """jobstats' (and reportseff's) decoding: strip ``JS1:``, base64, gunzip, JSON."""
    assert text.startswith("JS1:"), text[:40]
    out: dict[str, Any] = json.loads(gzip.decompress(base64.b64decode(text[4:])))
    return out


def fields(slurm: SlurmCli, job: int) -> dict[str, str]:
    """The job's latest accounting row (sacct --json, through the adapter)."""
    rows = by_start(slurm.accounting([job]))
    return dict(rows[-1].fields) if rows else {}


def wait_for(what: str, cond: Callable[[], dict[str, str] | None],
             timeout: float = 90) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got is not None:
            return got
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def ended(slurm: SlurmCli, job: int) -> dict[str, str] | None:
    f = fields(slurm, job)
    return f if f.get("State") == "COMPLETED" and f.get("End") not in ("", "Unknown") else None


def with_record(slurm: SlurmCli, job: int, name: str) -> dict[str, str] | None:
    """The job's fields once ``name`` holds a colloc record, else None."""
    f = fields(slurm, job)
    return f if try_decode(f.get(name)) is not None else None


def report(cluster: Cluster, job: int) -> dict[str, Any]:
    cp = subprocess.run([str(cluster.venv_bin / "colloc-report"), str(job), "--json"],
                        env=cluster.env(), capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    out: dict[str, Any] = json.loads(cp.stdout)
    return out


def gpu_share(cluster: Cluster, job: int) -> dict[str, Any]:
    cp = subprocess.run([str(cluster.venv_bin / "colloc"), "admin", "gpu-shares", "--since",
                         "now-1hours", "--format", "json"], env=cluster.env(),
                        capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    (row,) = [r for r in json.loads(cp.stdout) if r["jobid"] == str(job)]
    out: dict[str, Any] = row
    return out


def no_writer_running(cluster: Cluster) -> None:
    """Wait until the node's record writer (which reads record_field when it starts)
    is not running: the next job's record goes where colloc.conf says now."""
    spool = Path(cfgmod.load(cluster.layout.colloc_conf).evidence_dir).parent / "spool"
    spool.mkdir(mode=0o700, parents=True, exist_ok=True)
    deadline = time.monotonic() + 150  # a writer waits at most WAIT_S for a job's end
    while (fd := record_writer.try_lock(spool)) is None:
        assert time.monotonic() < deadline, "a record writer is still running"
        time.sleep(0.5)
    os.close(fd)


@pytest.fixture
def system_comment_site(cluster: Cluster) -> Iterator[cfgmod.CollocConfig]:
    """colloc.conf with ``record_field = "system_comment"`` (top-level key first)."""
    conf = cluster.layout.colloc_conf
    original = conf.read_text()
    conf.write_text('record_field = "system_comment"\n' + original)
    try:
        no_writer_running(cluster)
        yield cfgmod.load(conf)
    finally:
        conf.write_text(original)


def test_both_records_survive_either_order_with_system_comment(
    cluster: Cluster, slurm: SlurmCli, workdir: Path, system_comment_site: cfgmod.CollocConfig,
) -> None:
    """A job that outgrows its 2 shards, is requeued on a whole GPU and completes:
    the first attempt's record travels in the live AdminComment (scontrol cannot set
    SystemComment), the final one with both attempts lands in SystemComment."""
    job = sbatch(cluster, workdir, OOM_JOB, "--colloc-mem=2G")
    wait_for("the job's end in slurmdbd", lambda: ended(slurm, job), timeout=150)
    first = js1_write(cluster, job, {"order": "before colloc's record", "gpus": 1})
    f = wait_for("colloc's record in SystemComment",
                 lambda: with_record(slurm, job, "SystemComment"))
    assert js1_read(f["AdminComment"]) == js1_read(first)  # colloc left it alone
    second = js1_write(cluster, job, {"order": "after colloc's record", "gpus": 1})
    f = fields(slurm, job)
    assert f["AdminComment"] == second  # case kept: sacctmgr no longer lowercases
    assert js1_read(f["AdminComment"])["order"] == "after colloc's record"
    rec = try_decode(f["SystemComment"])
    assert rec is not None and [a.attempt for a in rec.attempts] == [0, 1]
    assert rec.attempts[0].oom is not None and rec.attempts[0].oom.cause == "gpu-oom"

    d = report(cluster, job)
    a0, a1 = d["attempts"]
    assert a0["oom"]["cause"] == "gpu-oom" and a0["requeue"]["requeued"]
    assert a0["limit_mib"] == 2 * system_comment_site.shard_mib
    assert a1["gpu"] == rec.attempts[-1].gpu and d["state"] == "COMPLETED"
    share = gpu_share(cluster, job)  # the last attempt: all shards of one GPU
    assert share["shards"] == share["shards_per_gpu"] and share["fraction"] == 1.0


def test_the_writer_never_replaces_a_js1_it_finds(
    cluster: Cluster, slurm: SlurmCli, workdir: Path,
) -> None:
    """Default field (AdminComment). jobstats writing last replaces colloc's record
    (why jobstats sites set system_comment); a colloc record written after a JS1:
    (here: the failed record an admin replays from the spool) goes to SystemComment."""
    no_writer_running(cluster)
    job = sbatch(cluster, workdir, JOB, "--colloc-mem=2G")
    f = wait_for("colloc's record in AdminComment",
                 lambda: with_record(slurm, job, "AdminComment"))
    ours = f["AdminComment"]
    summary = js1_write(cluster, job, {"order": "after colloc's record", "gpus": 1})
    assert try_decode(fields(slurm, job)["AdminComment"]) is None  # jobstats wrote last

    cfg = cfgmod.load(cluster.layout.colloc_conf)
    spool = Path(cfg.evidence_dir).parent / "spool"
    replay = spool / f"{job}.adminc"
    replay.write_text(ours)
    os.chmod(replay, 0o600)
    subprocess.run([str(cluster.venv_bin / "python"), "-m", "slurm_colloc.node.record_writer",
                    str(job), str(replay)], env=cluster.env(), check=True, timeout=120)
    wait_for("the replayed record to be written",
             lambda: None if replay.exists() else {})
    f = fields(slurm, job)
    assert f["AdminComment"] == summary and js1_read(f["AdminComment"])["gpus"] == 1
    rec = try_decode(f["SystemComment"])
    assert rec is not None and rec == try_decode(ours)
    (att,) = report(cluster, job)["attempts"]
    assert att["limit_mib"] == 2 * cfg.shard_mib and att["gpu"] == rec.attempts[-1].gpu
    share = gpu_share(cluster, job)
    spg = share["shards_per_gpu"]
    assert share["shards"] == 2 and spg > 2 and share["gpu"] == att["gpu"]
    assert share["fraction"] == round(2 / spg, 4)
