"""The submit path on a real devcluster: sbatch --colloc, cli_filter, job_submit, shards.

The estimator is the stand-in tests/e2e/data/fake_colloc (chosen per sbatch with
COLLOC_ESTIMATOR_COMMAND), so shard counts are exact whatever the real estimator
says; one test runs the real `colloc estimate` when it is installed.
"""

from __future__ import annotations

import re
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

from slurm_colloc.accounting.submit_record import parse_record
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.slurm.adapter import SlurmCli, SlurmError

pytestmark = pytest.mark.devcluster
FAKE = Path(__file__).resolve().parent / "data" / "fake_colloc"
SCRIPT = "#!/bin/sh\nsleep 30\n"


def _env(cluster: Cluster, **extra: str) -> dict[str, str]:
    env = cluster.env()
    env["COLLOC_ESTIMATOR_COMMAND"] = str(FAKE)
    env.update(extra)
    return env


def _sbatch(cluster: Cluster, workdir: Path, *args: str, script: str = SCRIPT,
            **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["sbatch", "--parsable", "--hold", "-o", "/dev/null", f"--chdir={workdir}", *args],
        input=script, capture_output=True, text=True, env=_env(cluster, **env), check=False,
        cwd=workdir,
    )


def _job_id(cp: subprocess.CompletedProcess[str]) -> int:
    assert cp.returncode == 0, cp.stderr
    return int(cp.stdout.strip().split(";")[0])


def _summary(workdir: Path, name: str, first_line: str) -> Path:
    p = workdir / name
    p.write_text(first_line + "\n")
    return p


@pytest.fixture
def jobs(slurm: SlurmCli):
    ids: list[int] = []
    yield ids
    slurm.cancel(ids)


def test_colloc_summary_gives_shards_and_record(cluster, slurm, workdir, jobs) -> None:
    s = _summary(workdir, "m.txt", "mib=7000 margin=500")
    cp = _sbatch(cluster, workdir, f"--colloc={s}", "--colloc-batch-size=32",
                 "--comment=my words")
    jobs.append(_job_id(cp))
    info = slurm.show_job(jobs[0])
    assert info is not None
    assert info["TresPerNode"] == "gres/shard:7"  # 7000 MiB, margin already inside
    assert info["Comment"] == "my words"
    rec = parse_record(info["AdminComment"])
    assert rec is not None and rec.mode == "estimate"
    assert (rec.est_mib, rec.margin_mib, rec.shards, rec.alloc_mib) == (7000, 500, 7, 7168)
    assert rec.fingerprint == "00ff32" and rec.estimator == "fake"


def test_sbatch_directive_form(cluster, slurm, workdir, jobs) -> None:
    s = _summary(workdir, "m.txt", "mib=3000 margin=0")
    script = (f"#!/bin/sh\n#SBATCH --colloc={s}\n#SBATCH --colloc-batch-size=16\n"
              "#SBATCH --colloc-optimizer=adamw\nsleep 30\n")
    jobs.append(_job_id(_sbatch(cluster, workdir, script=script)))
    info = slurm.show_job(jobs[0])
    assert info is not None and info["TresPerNode"] == "gres/shard:3"
    rec = parse_record(info["AdminComment"])
    assert rec is not None and rec.mode == "estimate" and rec.need_mib == 3000


def test_explicit_memory(cluster, slurm, workdir, jobs) -> None:
    jobs.append(_job_id(_sbatch(cluster, workdir, "--colloc-mem=5G")))
    info = slurm.show_job(jobs[0])
    assert info is not None and info["TresPerNode"] == "gres/shard:5"
    assert info["AdminComment"].startswith("colloc1:mode=explicit,need_mib=5120,shards=5,")


def _no_cli_filter_conf(cluster: Cluster, workdir: Path) -> Path:
    """A user's private copy of slurm.conf without CliFilterPlugins: the bypass."""
    text = cluster.layout.slurm_conf.read_text()
    conf = workdir / "slurm.conf"
    conf.write_text("\n".join(ln for ln in text.splitlines()
                              if not ln.startswith("CliFilterPlugins")) + "\n")
    return conf


def test_bypassing_cli_filter_gets_whole_gpu(cluster, slurm, workdir, jobs) -> None:
    s = _summary(workdir, "m.txt", "mib=1000")
    conf = _no_cli_filter_conf(cluster, workdir)
    cp = _sbatch(cluster, workdir, f"--colloc={s}", "--colloc-batch-size=8",
                 SLURM_CONF=str(conf))
    jobs.append(_job_id(cp))
    assert "whole GPU" in cp.stderr and "bypassed" in cp.stderr
    info = slurm.show_job(jobs[0])
    assert info is not None and info["TresPerNode"] == "gres/shard:39"
    rec = parse_record(info["AdminComment"])
    assert rec is not None and rec.mode == "default" and rec.why == "no-estimate"


def test_forged_estimate_is_checked(cluster, workdir) -> None:
    conf = _no_cli_filter_conf(cluster, workdir)
    for comment, needle in [
        ("colloc-estimate:v1:mib=lots,margin=0,est=x,fp=00", "malformed"),
        ("colloc-estimate:v1:mib=90000,margin=0,est=x,fp=00", "one GPU offers at most"),
    ]:
        cp = _sbatch(cluster, workdir, "--colloc=x", "--colloc-batch-size=1",
                     f"--comment={comment}", SLURM_CONF=str(conf))
        assert cp.returncode != 0 and needle in cp.stderr, cp.stderr


@pytest.mark.parametrize("args,summary_line,needle", [
    (["--colloc-mem=2G", "--gres=gpu:1"], None, "cannot be combined with --gres=gpu"),
    (["--colloc-mem=2G", "--gpus=1"], None, "cannot be combined with --gres=gpu"),
    (["--colloc-mem=2G", "--gres=shard:2"], None, "--colloc-mem=SIZE instead"),
    (["--colloc-mem=2G", "-N", "2"], None, "one node"),
    (["--colloc-mem=41G"], None, "one GPU offers at most 39936 MiB"),
    (["--colloc-mem=lots"], None, "expected a size"),
    (["--colloc-batch-size=0", "--colloc=S"], "mib=1", "positive integer"),
    (["--colloc=S"], "mib=1", "needs --colloc-batch-size"),
    (["--colloc-batch-size=4"], None, "need --colloc=SUMMARY"),
    (["--colloc-optimizer=lion", "--colloc=S", "--colloc-batch-size=1"], "mib=1",
     "expected one of"),
    (["--colloc=S", "--colloc-batch-size=1"], "bad", "not a model summary"),
    (["--colloc=S", "--colloc-batch-size=1"], "mib=50000 margin=0", "needs 50000 MiB"),
])
def test_rejections(cluster, workdir, args, summary_line, needle) -> None:
    if summary_line is not None:
        s = _summary(workdir, "s.txt", summary_line)
        args = [a.replace("=S", f"={s}") if a.startswith("--colloc=") else a for a in args]
    cp = _sbatch(cluster, workdir, *args)
    assert cp.returncode != 0, cp.stdout
    assert needle in cp.stderr, cp.stderr


def test_root_may_resize_a_colloc_job(cluster, slurm, workdir, jobs) -> None:
    """The epilog raises shards of a requeued job as root: job_modify lets uid 0 through."""
    jobs.append(_job_id(_sbatch(cluster, workdir, "--colloc-mem=2G")))
    slurm.update_job(jobs[0], TresPerNode="gres/shard:4")
    info = slurm.show_job(jobs[0])
    assert info is not None and info["TresPerNode"] == "gres/shard:4"


def _gres_index(info: dict[str, str]) -> tuple[int, int] | None:
    m = re.search(r"GRES=shard:(\d+)\(IDX:(\d+)\)", " ".join(f"{k}={v}" for k, v in info.items()))
    return (int(m.group(1)), int(m.group(2))) if m else None


def test_jobs_fill_gpus_in_shards_without_overcommit(cluster, slurm, workdir, jobs) -> None:
    sizes = [30, 30, 20, 15, 10, 10, 8, 8, 5, 5, 30, 30]  # GiB: 201 > 4 x 39
    import time as _t

    # the arithmetic below counts only these jobs: start from a node no earlier test's
    # job (still ending, or a whole GPU) holds any of
    quiet = _t.monotonic() + 90
    while any(j.active for j in slurm.jobs().values()) and _t.monotonic() < quiet:
        _t.sleep(1)
    for gib in sizes:
        cp = subprocess.run(
            ["sbatch", "--parsable", "-o", "/dev/null", f"--chdir={workdir}",
             f"--colloc-mem={gib}G", "--wrap", "sleep 60"],
            capture_output=True, text=True, env=_env(cluster), check=False,
        )
        jobs.append(_job_id(cp))
    import time

    deadline = time.monotonic() + 40
    while True:
        infos = [slurm.show_job(j) or {} for j in jobs]
        running = [i for i in infos if i.get("JobState") == "RUNNING"]
        pending = [i for i in infos if i.get("JobState") == "PENDING"]
        if len(running) + len(pending) == len(jobs) and pending and all(
            i.get("Reason") == "Resources" or i.get("Reason") == "Priority" for i in pending
        ) and len(running) >= 6:
            break
        if time.monotonic() > deadline:
            states = [(i.get("JobId"), i.get("JobState"), i.get("Reason")) for i in infos]
            pytest.fail(f"jobs did not settle: {states}")
        time.sleep(1)
    per_gpu: dict[int, int] = defaultdict(int)
    jobs_per_gpu: dict[int, int] = defaultdict(int)
    for i in running:
        got = _gres_index(i)
        assert got is not None, i
        per_gpu[got[1]] += got[0]
        jobs_per_gpu[got[1]] += 1
    assert all(v <= 39 for v in per_gpu.values()), per_gpu  # never over-committed
    assert max(jobs_per_gpu.values()) >= 2, jobs_per_gpu  # GPUs are shared
    # whatever waits does so because its shards do not fit on any GPU now
    free = [39 - per_gpu.get(g, 0) for g in range(4)]
    for i in pending:
        need = int(i["TresPerNode"].rsplit(":", 1)[1])
        assert need > max(free), (need, free)


def test_real_estimator_when_installed(cluster, slurm, workdir, jobs) -> None:
    summaries = sorted((Path(__file__).resolve().parents[2] / "sbatch_templates" / "summaries")
                       .glob("*.txt"))
    cp = subprocess.run([str(cluster.venv_bin / "colloc"), "estimate", "--help"],
                        capture_output=True, text=True, check=False)
    if cp.returncode != 0 or not summaries:
        pytest.skip("the real estimator (colloc estimate) or its sample summaries are not here yet")
    env = cluster.env()
    out = subprocess.run(
        ["sbatch", "--parsable", "--hold", "-o", "/dev/null", f"--colloc={summaries[0]}",
         "--colloc-batch-size=8"], input=SCRIPT, capture_output=True, text=True, env=env,
        check=False)
    if out.returncode != 0:
        raise SlurmError(out.stderr)
    jobs.append(int(out.stdout.strip()))
    info = slurm.show_job(jobs[0])
    rec = parse_record(info["AdminComment"] if info else None)
    assert rec is not None and rec.mode == "estimate" and rec.shards >= 1
