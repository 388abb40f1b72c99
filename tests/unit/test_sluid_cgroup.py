"""Slurm 26.05 names job cgroups by SLUID (``CgroupJobIdPaths=no``, its default).

The prolog must still find the job's cgroup for the hard GPU memory limit (slurmd
gives it ``SLURM_JOB_SLUID``), and the collector must still attribute a process whose
cgroup is ``0::/system.slice/slurmstepd.scope/<SLUID>/...``: only through the SLUID
the prolog recorded in root's meta, never from a SLUID-looking name elsewhere, and
with the same owner check as for ``job_<id>``. A malformed SLUID is dropped, never
joined into a path and never fatal.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from slurm_colloc import procfs
from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu import backend as gb
from slurm_colloc.gpu import nvml, select
from slurm_colloc.metrics import store
from slurm_colloc.metrics.attribution import Attributor, slurm_cgroup_job
from slurm_colloc.metrics.collector import SLUID_RESCAN_S, Collector
from slurm_colloc.node import job as jobmod
from slurm_colloc.node import prolog
from slurm_colloc.node.metrics_launch import meta_for
from tests.unit.conftest import Clock

SLUID = "sEKNKTV3WPV500"  # the example of cgroup.conf(5)
OTHER = "s0123456789ABC"
BAD = [
    "seknktv3wpv500",  # lower case
    "SEKNKTV3WPV500",  # upper-case prefix: sluid2str writes "s"
    "sEKNKTV3WPV5000",  # too long
    "sEKNKTV3WPV50",  # too short
    "s" + "A" * 40,
    "sEKNKTV3WPV50I",  # I, L, O, U are not Crockford digits
    "sEKNKTV3/PV500",
    "s../../../etc0",
    "..",
    "sEKNKTV3WPV500\n",
    "sEKNKTV3WPV500/",
    "",
]
ROOT_RUN = os.getuid() == 0
OWNER = 4001 if ROOT_RUN else os.getuid()
ENV = {"SLURM_JOB_ID": "7", "SLURM_JOB_UID": str(OWNER), "SLURM_JOB_GPUS": "0",
       "SLURM_JOB_USER": "alice"}


# ------------------------------------------------------------------ validation ---


def test_a_sluid_is_what_slurm_writes_and_nothing_else() -> None:
    assert procfs.sluid(SLUID) == SLUID
    assert procfs.sluid(OTHER) == OTHER
    for bad in BAD:
        assert procfs.sluid(bad) is None, bad
    assert procfs.sluid(None) is None
    assert procfs.sluid(12345678901234) is None  # a saved context's JSON may hold anything


# ------------------------------------------------------------------ prolog's cgroup ---


def _cgroot(tmp_path: Path, *dirs: str, scope: str = "slurmstepd.scope") -> Path:
    root = tmp_path / "cgroup"
    for d in dirs:
        (root / "system.slice" / scope / d).mkdir(parents=True)
    (root / "system.slice" / scope).mkdir(parents=True, exist_ok=True)
    return root


def test_the_job_cgroup_is_found_by_sluid(tmp_path: Path) -> None:
    root = _cgroot(tmp_path, SLUID)
    want = str(root / "system.slice" / "slurmstepd.scope" / SLUID)
    assert nvml.slurm_job_cgroup(7, str(root), sluid=SLUID) == want
    assert nvml.slurm_job_cgroup(7, str(root)) is None  # no SLUID, no job_7
    assert nvml.slurm_job_cgroup(7, str(root), sluid=OTHER) is None  # another job's


def test_job_id_paths_still_work_and_win(tmp_path: Path) -> None:
    root = _cgroot(tmp_path, "job_7", SLUID)
    want = str(root / "system.slice" / "slurmstepd.scope" / "job_7")
    assert nvml.slurm_job_cgroup(7, str(root)) == want
    assert nvml.slurm_job_cgroup(7, str(root), sluid=SLUID) == want


def test_the_sluid_cgroup_of_a_multi_slurmd_node(tmp_path: Path) -> None:
    root = _cgroot(tmp_path, SLUID, scope="n3_slurmstepd.scope")
    got = nvml.slurm_job_cgroup("7", str(root), sluid=SLUID)
    assert got == str(root / "system.slice" / "n3_slurmstepd.scope" / SLUID)


@pytest.mark.parametrize("bad", BAD)
def test_a_malformed_sluid_is_never_joined_into_a_path(tmp_path: Path, bad: str) -> None:
    root = _cgroot(tmp_path, SLUID)
    # a directory the bad value would reach if it were joined in
    (root / "system.slice" / "slurmstepd.scope" / "seknktv3wpv500").mkdir()
    (tmp_path / "etc0").mkdir()
    assert nvml.slurm_job_cgroup(7, str(root), sluid=bad) is None


def test_a_symlinked_sluid_cgroup_is_not_followed(tmp_path: Path) -> None:
    root = _cgroot(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / "system.slice" / "slurmstepd.scope" / SLUID).symlink_to(elsewhere)
    assert nvml.slurm_job_cgroup(7, str(root), sluid=SLUID) is None


def test_a_sluid_dir_outside_slurms_scope_is_not_the_jobs(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    (root / "system.slice" / "user.scope" / SLUID).mkdir(parents=True)
    (root / "user.slice" / "user-1001.slice" / SLUID).mkdir(parents=True)
    assert nvml.slurm_job_cgroup(7, str(root), sluid=SLUID) is None


# ------------------------------------------------------------------ the job context ---


def _slurm_job(**over: Any) -> SimpleNamespace:
    """What :func:`jobmod.context_from_job` reads of a controller record."""
    job = SimpleNamespace(
        job_id=7, user_id=OWNER, user_name="alice", allocated_gpus=(0,),
        tres_per_node="gres/shard:2", tres_per_job="", tres_per_task="",
        tres_per_socket="", stdout=None, stderr=None, restarts=0, admin_comment="",
        state="RUNNING",
    )
    for k, v in over.items():
        setattr(job, k, v)
    return job


def test_the_context_takes_the_sluid_from_slurmd_and_keeps_it() -> None:
    env = {**ENV, "SLURM_JOB_SLUID": SLUID}
    ctx = jobmod.context_from_job(_slurm_job(), env)  # type: ignore[arg-type]
    assert ctx.sluid == SLUID
    assert jobmod.bare_context(env).sluid == SLUID
    back = jobmod.context_from_json(jobmod.context_to_json(ctx), env)
    assert back == ctx  # the epilog sees what the prolog saw
    assert jobmod.context_from_job(_slurm_job(), ENV).sluid is None  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", BAD)
def test_a_malformed_sluid_in_slurmds_env_is_dropped(bad: str) -> None:
    env = {**ENV, "SLURM_JOB_SLUID": bad}
    ctx = jobmod.context_from_job(_slurm_job(), env)  # type: ignore[arg-type]
    assert ctx.sluid is None and ctx.job_id == 7 and ctx.is_shared
    assert jobmod.bare_context(env).sluid is None


def test_a_saved_context_with_a_forged_sluid_loses_it() -> None:
    import json

    ctx = jobmod.context_from_job(_slurm_job(), ENV)  # type: ignore[arg-type]
    for bad in [*BAD, 5, ["x"]]:
        d = json.loads(jobmod.context_to_json(ctx))
        d["sluid"] = bad
        assert jobmod.context_from_json(json.dumps(d), ENV).sluid is None


class _FakeBackend:
    def __init__(self) -> None:
        self.calls: list[tuple[int, str, int]] = []

    def hard_memory_limit_supported(self, index: int) -> gb.HardLimitSupport:
        return gb.HardLimitSupport(True, "")

    def set_job_memory_limit(self, index: int, cg: str, hard: int,
                             soft: int = 0) -> gb.LimitResult:
        self.calls.append((index, cg, hard))
        return gb.LimitResult(True, "set", "")

    def close(self) -> None:
        pass


def _hard_limit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, root: Path,
                env: dict[str, str]) -> tuple[str, _FakeBackend]:
    fake = _FakeBackend()
    monkeypatch.setattr(nvml, "slurm_job_cgroup",
                        functools.partial(nvml.slurm_job_cgroup, root=str(root)))
    monkeypatch.setattr(select, "backend_from_config", lambda c, with_dcgm=True: fake)
    cfg = CollocConfig(mps_root=str(tmp_path / "mps"), metrics_dir=str(tmp_path / "m"),
                       gpu_backend="sim")
    ctx = jobmod.context_from_job(_slurm_job(), env)  # type: ignore[arg-type]
    return prolog.hard_limit(ctx, cfg, 0, 2048), fake


def test_the_prolog_limits_the_sluid_named_cgroup(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    root = _cgroot(tmp_path, SLUID)
    out, fake = _hard_limit(monkeypatch, tmp_path, root, {**ENV, "SLURM_JOB_SLUID": SLUID})
    assert out == "set"
    assert fake.calls == [(0, str(root / "system.slice" / "slurmstepd.scope" / SLUID), 2048)]


@pytest.mark.parametrize("bad", ["seknktv3wpv500", "s" + "A" * 40, "../job_9", ".."])
def test_a_bad_sluid_leaves_the_prolog_without_a_limit_not_broken(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, bad: str
) -> None:
    root = _cgroot(tmp_path, SLUID, "seknktv3wpv500", "job_9")
    out, fake = _hard_limit(monkeypatch, tmp_path, root, {**ENV, "SLURM_JOB_SLUID": bad})
    assert out.startswith("no job cgroup") and "SLUID none" in out
    assert fake.calls == []


def test_the_meta_records_the_sluid(tmp_path: Path) -> None:
    cfg = CollocConfig(metrics_dir=str(tmp_path / "m"))
    ctx = jobmod.context_from_job(  # type: ignore[arg-type]
        _slurm_job(), {**ENV, "SLURM_JOB_SLUID": SLUID})
    store.write_meta(cfg.metrics_dir, meta_for(ctx, cfg, {}))
    meta = store.read_meta(cfg.metrics_dir, 7, 0)
    assert meta is not None and meta.sluid == SLUID and meta.uid == OWNER
    assert (os.stat(store.meta_path(cfg.metrics_dir, 7, 0)).st_mode & 0o777) == 0o600


# ------------------------------------------------------------------ the SLUID index ---


def _meta(metrics: Path, job: int, sluid: object, uid: int = OWNER, attempt: int = 0) -> None:
    store.write_meta(metrics, store.JobMeta(job_id=job, attempt=attempt, uid=uid, gpus=(0,),
                                            sluid=sluid))  # type: ignore[arg-type]


def test_the_index_maps_recorded_sluids_only(tmp_path: Path) -> None:
    m = tmp_path / "m"
    _meta(m, 31, SLUID)
    _meta(m, 32, "seknktv3wpv500")  # malformed in a meta: ignored
    _meta(m, 33, None)  # a 24.11 prolog's meta
    idx = store.SluidIndex(m)
    assert idx.job_of(SLUID) is None  # nothing read yet
    idx.refresh()
    assert idx.job_of(SLUID) == "31"
    assert idx.job_of("seknktv3wpv500") is None and idx.job_of(OTHER) is None
    _meta(m, 34, OTHER)  # a new job: its directory is new
    idx.refresh()
    assert idx.job_of(OTHER) == "34"


def test_a_sluid_claimed_by_two_jobs_maps_to_neither(tmp_path: Path) -> None:
    m = tmp_path / "m"
    _meta(m, 31, SLUID)
    _meta(m, 32, SLUID)
    idx = store.SluidIndex(m)
    idx.refresh()
    assert idx.job_of(SLUID) is None


def test_pruned_jobs_and_symlinked_dirs_give_no_sluid(tmp_path: Path) -> None:
    m = tmp_path / "m"
    _meta(m, 31, SLUID)
    idx = store.SluidIndex(m)
    idx.refresh()
    assert idx.job_of(SLUID) == "31"
    store.prune(m, 0, now=4e9)
    idx.refresh()
    assert idx.job_of(SLUID) is None
    other = tmp_path / "other"
    _meta(other, 35, OTHER)
    (m / "jobs" / "35").symlink_to(other / "jobs" / "35")
    idx.refresh()
    assert idx.job_of(OTHER) is None


# ------------------------------------------------------------------ attribution ---

SCOPE = "0::/system.slice/slurmstepd.scope"


def test_a_sluid_cgroup_line_is_attributed_through_the_recorded_mapping() -> None:
    known = {SLUID: "31"}.get
    for line in (f"{SCOPE}/{SLUID}/step_0/user/task_0", f"{SCOPE}/{SLUID}",
                 f"0::/system.slice/n3_slurmstepd.scope/{SLUID}/step_batch/user/task_0"):
        assert slurm_cgroup_job(line.encode() + b"\n", OWNER, known) == "31", line
    assert slurm_cgroup_job(f"{SCOPE}/{OTHER}/step_0\n".encode(), OWNER, known) is None
    assert slurm_cgroup_job(f"{SCOPE}/{SLUID}/step_0\n".encode(), OWNER) is None
    assert slurm_cgroup_job(f"{SCOPE}/job_7/step_0\n".encode(), OWNER, known) == "7"


@pytest.mark.parametrize("line", [
    f"0::/user.slice/user-4001.slice/user@4001.service/{SLUID}",
    f"0::/user.slice/user-4001.slice/user@4001.service/app.slice/{SLUID}/x",
    f"0::/system.slice/other.scope/{SLUID}",
    f"0::/system.slice/slurmstepd.scope/system/{SLUID}",
    f"0::/system.slice/slurmstepd.scope/{SLUID}x",
    f"0::/system.slice/slurmstepd.scope/{SLUID.lower()}",
    f"0::/system.slice/slurmstepd.scope/s{SLUID}",
    f"0::/machine.slice/x/system.slice/slurmstepd.scope/{SLUID}",
    f"1:name=x:/system.slice/slurmstepd.scope/{SLUID}",
])
def test_a_sluid_looking_cgroup_elsewhere_is_not_attributed(line: str) -> None:
    lower = SLUID.lower()
    known = {SLUID: "31", lower: "31", "s" + SLUID: "31", SLUID + "x": "31"}.get
    assert slurm_cgroup_job(line.encode() + b"\n", OWNER, known) is None


def test_a_mapping_answer_that_is_not_a_job_id_is_refused() -> None:
    line = f"{SCOPE}/{SLUID}/step_0\n".encode()
    for answer in ("../31", "", "1" * 13, "31\n"):
        assert slurm_cgroup_job(line, OWNER, {SLUID: answer}.get) is None


def _fake_proc(root: Path, pid: int, uid: int, ticks: int, cgroup: str,
               environ: dict[str, str] | None = None) -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    fields = ["S"] + ["0"] * 18 + [str(ticks)] + ["0"] * 20
    (d / "stat").write_text(f"{pid} (python3) " + " ".join(fields) + "\n")
    (d / "cgroup").write_text(cgroup)
    (d / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0"
                                         for k, v in (environ or {}).items()))
    if ROOT_RUN:
        os.chown(d, uid, uid)


def _collector(tmp_path: Path, clock: Clock) -> Collector:
    cfg = CollocConfig(metrics_dir=str(tmp_path / "m"), mps_root=str(tmp_path / "mps"),
                       enforce_over_limit="off", enforce_outside_mps="off")
    return Collector(cfg, backend=None, clock=clock)  # type: ignore[arg-type]


def _attributor(col: Collector, proc: Path) -> Attributor:
    """The collector's own lookups, on a fake /proc."""
    return Attributor(proc=str(proc), uid_of_job=col._uid_of_job,
                      job_of_sluid=col._job_of_sluid)


def test_the_collector_attributes_a_sluid_cgroup_to_the_jobs_meta(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    _fake_proc(proc, 100, OWNER, 11, f"{SCOPE}/{SLUID}/step_0/user/task_0\n",
               {"SLURM_RESTART_COUNT": "1"})
    col = _collector(tmp_path, Clock())
    _meta(tmp_path / "m", 31, SLUID, attempt=1)
    tag = _attributor(col, proc).lookup(100)
    assert tag is not None and (tag.job_id, tag.attempt, tag.source) == ("31", 1, "cgroup")


def test_a_sluid_without_meta_falls_back_as_before(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    _fake_proc(proc, 100, OWNER, 11, f"{SCOPE}/{SLUID}/step_0\n", {"SLURM_JOB_ID": "32"})
    _fake_proc(proc, 101, OWNER, 12, f"{SCOPE}/{SLUID}/step_0\n")
    col = _collector(tmp_path, Clock())
    _meta(tmp_path / "m", 32, None)  # the job the environment names, no SLUID recorded
    att = _attributor(col, proc)
    tag = att.lookup(100)
    assert tag is not None and (tag.job_id, tag.source) == ("32", "environ")
    assert att.lookup(101) is None


@pytest.mark.skipif(not ROOT_RUN, reason="needs root to give fake /proc entries owners")
def test_a_sluid_cgroup_of_another_users_job_is_refused(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    _fake_proc(proc, 100, OWNER + 1, 11, f"{SCOPE}/{SLUID}/step_0\n")
    col = _collector(tmp_path, Clock())
    _meta(tmp_path / "m", 31, SLUID, uid=OWNER)
    assert _attributor(col, proc).lookup(100) is None


def test_a_forged_sluid_dir_of_a_user_is_not_attributed(tmp_path: Path) -> None:
    """A user can make ``<SLUID>`` in a cgroup subtree delegated to them; a victim's
    SLUID is no secret (``scontrol show job``)."""
    proc = tmp_path / "proc"
    _fake_proc(proc, 200, OWNER, 22,
               f"0::/user.slice/user-{OWNER}.slice/user@{OWNER}.service/{SLUID}\n")
    col = _collector(tmp_path, Clock())
    _meta(tmp_path / "m", 31, SLUID)
    assert _attributor(col, proc).lookup(200) is None


def test_unknown_sluids_rescan_the_metas_at_most_every_few_seconds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    col = _collector(tmp_path, clock)
    scans: list[int] = []
    real = store.SluidIndex.refresh
    monkeypatch.setattr(store.SluidIndex, "refresh",
                        lambda self: (scans.append(1), real(self))[1])
    for _ in range(5):
        assert col._job_of_sluid(OTHER) is None
    assert len(scans) == 1
    _meta(tmp_path / "m", 31, SLUID)
    assert col._job_of_sluid(SLUID) is None  # still within the quiet time
    clock.t += SLUID_RESCAN_S
    assert col._job_of_sluid(SLUID) == "31" and len(scans) == 2
    assert col._job_of_sluid(SLUID) == "31" and len(scans) == 2  # known: no rescan

