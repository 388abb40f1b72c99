"""Attack variants found by a review of the issue 11 fixes ("root must act only on
what Slurm and root vouch for"), each fixed after it was found.

Each test replays one attack by an unprivileged user; each failed on the code the
review read and passes since its fix. The docstring of each says attack, impact and
the fix (docs/security.md lists them).
Fakes follow tests/unit/test_enforce.py (real processes on the simulated GPU) and
tests/unit/test_security_node.py / test_security_epilog.py.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import sqlite3
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu.backend import GpuProcess
from slurm_colloc.gpu.sim.backend import SimBackend
from slurm_colloc.gpu.sim.state import ProcRecord, init_state, process_start_ticks, write_record
from slurm_colloc.metrics import enforce, store
from slurm_colloc.metrics.attribution import Attributor
from slurm_colloc.metrics.collector import Collector
from slurm_colloc.mps.tenancy import Tenancy
from tests.unit.conftest import Clock
from tests.unit.test_enforce import alive, spawn

ROOT_RUN = os.geteuid() == 0
NOBODY = 65534
JOB_UID = NOBODY if ROOT_RUN else os.getuid()
as_root = pytest.mark.skipif(not ROOT_RUN, reason="needs root to run processes as other users")


def _spawn(procs: list[subprocess.Popen[bytes]], job: str) -> subprocess.Popen[bytes]:
    return spawn(procs, job)


def _register(state: Path, pid: int, mib: int, *, mps: bool, gpu: int) -> None:
    ticks = process_start_ticks(pid)
    assert ticks is not None
    write_record(state, ProcRecord(pid=pid, gpu=gpu, uid=JOB_UID, used_mib=mib, sm_pct=10.0,
                                   start_ticks=ticks, mps_server=4242 if mps else 0))


def _meta(cfg: CollocConfig, job: int, limit: int | None, gpus: tuple[int, ...],
          uid: int = JOB_UID, start: float = 1.0) -> None:
    store.write_meta(cfg.metrics_dir, store.JobMeta(
        job_id=job, attempt=0, uid=uid, gpus=gpus, limit_mib=limit,
        shards=(limit or 0) // 1024, start=start))


def _alive(p: subprocess.Popen[bytes]) -> bool:
    return alive(p)


# ------------------------------------------------------------------------------------
# 1. Collector: SLURM_JOB_ID of the user's OWN other job (no limit, other GPU, or long
#    finished) lifts the cap.                                          severity: HIGH
# ------------------------------------------------------------------------------------


@as_root
@pytest.mark.parametrize("claimed", ["whole-gpu-job-on-gpu1", "finished-whole-job-on-gpu0"])
def test_probe_claiming_own_unlimited_job_escapes_enforcement(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]], claimed: str
) -> None:
    """ATTACK: the user runs a 1-shard MPS job (job 5, 1024 MiB) on GPU 0. Inside it
    they ``unset CUDA_MPS_PIPE_DIRECTORY`` (leave MPS) and ``export SLURM_JOB_ID=600``,
    where 600 is another job OF THEIR OWN that has a prolog meta on this node with no
    limit: a whole-GPU job running on GPU 1, or any whole-GPU job they ran here within
    ``metrics_retention_days`` (meta files are kept 14 days, ``_uid_of_job`` only
    checks the owner). Attribution (metrics/attribution.py ``Attributor.identity``)
    accepts the environ claim because the owner matches, so the process is charged
    to job 600; ``Enforcer._check`` returns at ``meta.limit_mib is None`` before even
    the outside-MPS check. The tenancy fallback added in 6fce2b1 is never reached.

    IMPACT: the 1-shard job takes the whole GPU (30 GiB here) with no verdict, no
    kill, not even an outside-MPS flag; co-tenants OOM and, with no verdict, are not
    told who did it (no culprit: they are stepped up to a whole GPU or fail).

    FIX: an environ-claimed job must be one that root knows is running on THIS GPU
    (meta.gpus contains the GPU and the job is registered/active: tenancy markers for
    shard jobs, ctx/<job>.json for whole ones); otherwise fall back to the owner's MPS
    job on that GPU (``_by_tenancy``). In ``Enforcer._check``, a job whose meta does
    not list this GPU must never be "no limit". Better still: charge every process of
    a uid that has MPS jobs on the GPU to those jobs unless a cgroup proves otherwise.
    """
    cfg = CollocConfig(gpu_backend="sim", sim_state_dir=str(tmp_path / "sim"),
                       metrics_dir=str(tmp_path / "metrics"), mps_root=str(tmp_path / "mps"))
    init_state(tmp_path / "sim", gpu_count=2, memory_mib=40960)
    backend = SimBackend(tmp_path / "sim")
    _meta(cfg, 5, 1024, (0,))                     # the real, capped shard job
    Tenancy(tmp_path / "mps").add_job(0, JOB_UID, 5)
    if claimed == "whole-gpu-job-on-gpu1":
        _meta(cfg, 600, None, (1,))               # running whole-GPU job on GPU 1
    else:
        _meta(cfg, 600, None, (0,), start=1.0)    # a whole-GPU job of last week, gone
    liar = _spawn(procs, "600")
    _register(tmp_path / "sim", liar.pid, 30000, mps=False, gpu=0)
    clock = Clock()
    col = Collector(cfg, backend, clock=clock)
    for _ in range(4):
        col.step()
        clock.t += 1.0
    on_gpu0 = [v for v in enforce.read_verdicts(cfg.metrics_dir) if v.gpu == 0]
    assert on_gpu0, "30 GiB outside MPS on GPU 0 by a 1-shard job: no verdict at all"
    assert not _alive(liar), "the over-limit process was not killed"


# ------------------------------------------------------------------------------------
# 2. Collector: the cgroup source is trusted without any owner check.  severity: HIGH
#    (where jobs are not in Slurm job cgroups: proctrack/linuxproc, or a process moved
#    into a user-delegated cgroup)
# ------------------------------------------------------------------------------------


def _fake_proc(root: Path, pid: int, uid: int, ticks: int, *, cgroup: str,
               environ: dict[str, str]) -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    fields = ["S"] + ["0"] * 18 + [str(ticks)] + ["0"] * 20
    (d / "stat").write_text(f"{pid} (python3) " + " ".join(fields) + "\n")
    (d / "cgroup").write_text(cgroup)
    (d / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0"
                                         for k, v in environ.items()))
    if ROOT_RUN:
        os.chown(d, uid, uid)


VICTIM_UID = 4001
ATTACKER_UID = 4002


@as_root
def test_probe_forged_job_cgroup_is_attributed_to_another_users_job(tmp_path: Path) -> None:
    """ATTACK: ``tag_of`` (metrics/attribution.py) takes the job from the FIRST
    ``/job_<N>/`` anywhere in ``/proc/<pid>/cgroup`` and marks it ``source=cgroup``,
    which ``Attributor.identity`` never checks against the job's owner (only
    ``environ`` answers are verified). Where the job's processes are not in a Slurm
    job cgroup (proctrack/linuxproc: the devcluster layout that the environ fallback
    exists for), the only ``/job_N`` in that file is one the user made: on cgroup v2
    ``user@UID.service`` is delegated to the user (``systemd-run --user --scope``, or
    ``mkdir .../user@4002.service/job_777 && echo $$ > .../job_777/cgroup.procs``); on
    v1 any hierarchy where the user owns a directory. The process then shows
    ``0::/user.slice/user-4002.slice/user@4002.service/job_777``.

    IMPACT: the attacker's GPU memory is charged to the victim's job 777 (see the next
    probe: the victim is killed), the attacker escapes their own cap, the victim's
    measured peak (history) and report are inflated.

    FIX: trust a cgroup path only in Slurm's own layout (anchored:
    ``^0::/system.slice/slurmstepd.scope/job_N/`` or ``.../slurm/uid_U/job_N/``, with
    ``uid_U`` equal to the process owner), and verify EVERY source against the owner
    root recorded (``uid_of_job(job) == process uid``), not only ``environ``.
    """
    proc = tmp_path / "proc"
    _fake_proc(proc, 4242, ATTACKER_UID, 555,
               cgroup="0::/user.slice/user-4002.slice/user@4002.service/job_777\n",
               environ={"PATH": "/usr/bin"})
    owners = {"777": VICTIM_UID}
    att = Attributor(proc=str(proc), uid_of_job=owners.get)
    ident = att.identity(4242)
    assert ident is None or ident[1].job_id != "777", (
        f"uid {ATTACKER_UID}'s process attributed to uid {VICTIM_UID}'s job: {ident}")


@as_root
def test_probe_forged_cgroup_makes_root_kill_the_victims_processes(tmp_path: Path) -> None:
    """ATTACK (continued from the previous probe): the victim's job 777 has a 4 GiB
    allocation and uses 3 GiB. The attacker's process (forged ``job_777`` cgroup)
    allocates 8 GiB on the same GPU. ``Enforcer._check`` sums both into job 777: over
    the limit; ``_kill_job`` then sends SIGKILL to every process attributed to 777
    whose owner is the job's uid: the attacker's is refused (wrong uid), the
    VICTIM's processes are killed. Root kills another user's job on the attacker's
    say-so, repeatably (each requeue), and the victim's verdict makes it the
    "culprit" of co-tenants' OOMs.

    FIX: as above (owner-verified attribution); in addition ``_check`` should sum only
    processes whose owner is ``meta.uid`` (a process of another uid attributed to the
    job is an attribution error, never the job's memory).
    """
    proc = tmp_path / "proc"
    _fake_proc(proc, 100, VICTIM_UID, 11, cgroup="0::/system.slice/slurmd.service\n",
               environ={"SLURM_JOB_ID": "777"})
    _fake_proc(proc, 200, ATTACKER_UID, 22,
               cgroup="0::/user.slice/user-4002.slice/user@4002.service/job_777\n",
               environ={})
    cfg = CollocConfig(metrics_dir=str(tmp_path / "metrics"))
    _meta(cfg, 777, 4096, (0,), uid=VICTIM_UID)
    att = Attributor(proc=str(proc), uid_of_job={"777": VICTIM_UID}.get)
    killed: list[tuple[int, int]] = []

    def kill(pid: int, ticks: int, uid: int) -> tuple[bool, str]:
        owner = os.stat(proc / str(pid)).st_uid
        if owner != uid:
            return False, "refused: other uid"
        killed.append((pid, uid))
        return True, "signalled"

    enf = enforce.Enforcer(cfg, clock=Clock(), proc=str(proc), kill=kill)
    procs = [(GpuProcess(100, 3072, True), 100), (GpuProcess(200, 8192, True), 200)]
    for _ in range(3):
        enf.begin_step()
        entries = []
        for gp, pid in procs:
            ident = att.identity(pid)
            if ident is not None:
                entries.append((gp, ident[0], ident[1]))
        enf.observe(0, entries)
        enf.end_step()
    assert (100, VICTIM_UID) not in killed, (
        "root SIGKILLed the victim's process because of another user's memory")


# ------------------------------------------------------------------------------------
# 3. MPS tenancy: hand_pipe_dir_to chowns the directory BEFORE it chowns the sockets
#    in it.                       severity: MEDIUM (needs fs.protected_hardlinks=0)
# ------------------------------------------------------------------------------------


@as_root
def test_probe_hand_pipe_dir_chowns_a_hardlinked_foreign_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ATTACK: ``Tenancy.hand_pipe_dir_to`` (mps/tenancy.py) first
    ``chown(pipe_dir, uid)``, then scans the (now user-owned) directory and chowns
    every socket in it to the user. In the window between the two, the user (a
    process of theirs polling ``mps_root/gpu<i>/uid<u>/pipe``, whose parent is 0755)
    hard-links a root-owned socket from the same file system into it: ``mps_root`` is
    ``/run/colloc/mps``, on the ``/run`` tmpfs with ``/run/munge/munge.socket.2``,
    ``/run/docker.sock``, ``/run/systemd/private``... Root then chowns that inode to
    the user (lchown does not follow symlinks, but a hard link IS the inode).
    Blocked by ``fs.protected_hardlinks=1`` (a user cannot link an inode they do not
    own), but the project elsewhere defends explicitly against that sysctl being off
    (oom/safe_open.py rule 4), so it should not rely on it here.

    IMPACT: root hands another service's socket to the user (docker.sock: root).

    FIX: chown by name only the sockets the daemon made (``control``), through an
    ``O_PATH|O_NOFOLLOW`` fd checked ``st_nlink == 1`` and root-owned, and do it
    BEFORE chowning the directory (while only root can add entries).
    """
    t = Tenancy(tmp_path / "mps")
    pipe, _ = t.prepare_user_dirs(0, JOB_UID)
    ctl = socket.socket(socket.AF_UNIX)
    ctl.bind(str(pipe / "control"))                  # the daemon's socket
    precious_dir = tmp_path / "run-munge"
    precious_dir.mkdir()
    precious = socket.socket(socket.AF_UNIX)
    precious.bind(str(precious_dir / "munge.socket.2"))  # another root service's socket
    real_chown = os.chown

    def racing_chown(path, uid, gid, *, follow_symlinks=True):  # type: ignore[no-untyped-def]
        real_chown(path, uid, gid, follow_symlinks=follow_symlinks)
        if Path(path) == pipe and not (pipe / "evil").exists():
            os.link(precious_dir / "munge.socket.2", pipe / "evil")  # the user, racing

    monkeypatch.setattr(os, "chown", racing_chown)
    try:
        t.hand_pipe_dir_to(0, JOB_UID, JOB_UID)
    finally:
        monkeypatch.setattr(os, "chown", real_chown)
        ctl.close()
        precious.close()
    st = os.lstat(precious_dir / "munge.socket.2")
    assert st.st_uid == 0, "root chowned another service's socket to the job's user"


# ------------------------------------------------------------------------------------
# 4. Evidence copies are owned by the user: writable on root's file system.
#                                                                  severity: LOW-MEDIUM
# ------------------------------------------------------------------------------------

try:
    U1: pwd.struct_passwd | None = pwd.getpwnam("colloc-u1")
except KeyError:
    U1 = None


@pytest.mark.skipif(not ROOT_RUN or U1 is None, reason="needs root and colloc-u1")
def test_probe_evidence_copy_is_not_writable_by_the_user() -> None:
    """ATTACK: ``evidence._copy_one`` (node/evidence.py) ``fchown``s each copy to the
    job's user, mode 0600. The module docstring promises the user "cannot add to
    root's disk use", but the owner of a file may write it, chmod it and hard-link
    it: ``cat /dev/zero >> $EVIDENCE/<job>/attempt0/0-job.out`` grows it without
    bound on root's file system (``/var/lib/colloc``, where the record spool and
    history live, usually without user quotas); a hard link in any user-writable
    directory of that file system (``/var/tmp``) keeps the inode after ``prune``;
    prune only counts size at the next ``keep``. The user can also rewrite the
    "evidence" root's record points to.

    IMPACT: fill the node's /var (slurmd state, spool, history: every user), tamper
    with evidence.

    FIX: the copy belongs to root, group = the user's primary gid, mode 0640 (the
    attempt directory is already root:gid 0750), or root 0600 plus a read ACL.
    """
    from slurm_colloc.node import evidence

    assert U1 is not None
    top = Path(tempfile.mkdtemp(prefix="colloc-probe-", dir="/tmp"))
    try:
        os.chmod(top, 0o755)
        udir = top / "user"
        udir.mkdir()
        os.chown(udir, U1.pw_uid, U1.pw_gid)
        log = udir / "job.out"
        log.write_text("torch.OutOfMemoryError: CUDA out of memory.\n")
        os.chown(log, U1.pw_uid, U1.pw_gid)
        written = evidence.keep(str(top / "evidence"), 77, 0, U1.pw_uid, U1.pw_gid,
                                [str(log)], 1 << 20)
        assert written
        st = os.lstat(written[0])
        user_can_write = st.st_uid == U1.pw_uid and bool(st.st_mode & stat.S_IWUSR)
        assert not user_can_write, "the evidence copy on root's file system is the user's"
    finally:
        shutil.rmtree(top, ignore_errors=True)


# ------------------------------------------------------------------------------------
# 5. History db: any reader (every user can read it) blocks root's writes.
#                                                                         severity: LOW
# ------------------------------------------------------------------------------------


def test_probe_a_reader_holding_the_history_db_blocks_every_users_record(
    tmp_path: Path,
) -> None:
    """ATTACK: the history db is 0644 in rollback-journal mode and users open it
    read-only at sbatch time. Any user can keep a SHARED lock for ever
    (``sqlite3 'file:/var/lib/colloc/history.sqlite?mode=ro' 'BEGIN; SELECT ...'`` and
    leave it open, or just a POSIX F_RDLCK on sqlite's lock bytes through an
    O_RDONLY fd). ``SqliteHistory.record`` (estimators/history.py) then waits 2 s and
    fails with "database is locked" in every epilog on the node (on every node if the
    db is on shared storage).

    IMPACT: nobody's measured peak is recorded (everyone falls back to estimates, the
    feature is off cluster-wide on a shared db); each epilog is 2 s slower.

    FIX: ``PRAGMA journal_mode=WAL`` (readers do not block the writer; read-only
    readers need the -shm/-wal files, root-created 0644) or publish a read-only copy
    (root writes a private db and atomically renames a snapshot users read).
    """
    from slurm_colloc.estimators.history import SqliteHistory

    db = tmp_path / "hist" / "history.sqlite"
    h = SqliteHistory(db, uid=1000)
    h.record("ab" * 8, 32, None, "adam", "fp32", 4000, job_id="1", uid=1000)
    reader = sqlite3.connect(f"file:{db}?mode=ro", uri=True, isolation_level=None)
    try:
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM peaks_v2").fetchall()  # SHARED lock held
        try:
            SqliteHistory(db, uid=2000).record("cd" * 8, 16, None, "adam", "fp32", 9000,
                                               job_id="2", uid=2000)
            blocked = None
        except sqlite3.OperationalError as e:
            blocked = str(e)
    finally:
        reader.close()
    assert blocked is None, f"a reader blocked root's history write: {blocked}"
