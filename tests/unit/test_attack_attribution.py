"""Issue 23, item 3: attribution that no user can steer.

Each test replays an attack (or a hardware fact the simulation used to hide) against
the root collector with real processes on a simulated GPU, run as two unprivileged
uids (``ATTACKER``, ``VICTIM``: numeric, no account needed), and failed before its fix.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu.backend import GpuProcess
from slurm_colloc.gpu.sim import tools as sim_tools
from slurm_colloc.gpu.sim.backend import SimBackend
from slurm_colloc.gpu.sim.state import ProcRecord, init_state, process_start_ticks, write_record
from slurm_colloc.metrics import enforce, store
from slurm_colloc.metrics.attribution import JobTag
from slurm_colloc.metrics.collector import Collector
from slurm_colloc.mps.control import MpsDaemon
from slurm_colloc.mps.tenancy import Tenancy
from tests.unit.conftest import Clock
from tests.unit.test_enforce import alive, spawn

VICTIM = 65534
ATTACKER = 65532
# the lab's launcher (not a console script of the wheel: issue 26 item 7)
STANDIN = str(sim_tools.tool("colloc-sim-mps-control"))


@pytest.fixture(autouse=True)
def _root() -> None:
    if os.geteuid() != 0:
        pytest.fail("these attacks run processes as other users: run as root")


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory other uids can traverse (pytest's tmp_path is root's 0700)."""
    d = Path(tempfile.mkdtemp(prefix="colloc-attr-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def register(state: Path, pid: int, mib: int, uid: int, *, server: int = 0, gpu: int = 0) -> None:
    ticks = process_start_ticks(pid)
    assert ticks is not None
    write_record(state, ProcRecord(pid=pid, gpu=gpu, uid=uid, used_mib=mib, sm_pct=10.0,
                                   start_ticks=ticks, mps_server=server))


def meta(cfg: CollocConfig, job: int, limit: int | None, uid: int) -> None:
    store.write_meta(cfg.metrics_dir, store.JobMeta(
        job_id=job, attempt=0, uid=uid, gpus=(0,), limit_mib=limit,
        shards=(limit or 0) // 1024, start=1.0))


def make(d: Path, **over: object) -> tuple[CollocConfig, SimBackend, Path, Tenancy]:
    state = d / "sim"
    init_state(state, gpu_count=1, memory_mib=40960)
    cfg = CollocConfig(gpu_backend="sim", sim_state_dir=str(state), metrics_dir=str(d / "metrics"),
                       mps_root=str(d / "mps"), mps_control=STANDIN,
                       **over)  # type: ignore[arg-type]
    return cfg, SimBackend(state), state, Tenancy(d / "mps")


# --- 1. no negative caching of owners ---------------------------------------------------


def test_a_job_id_claimed_before_it_exists_does_not_turn_root_on_its_owner(
    base: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """ATTACK: the attacker's processes claim the victim's next job ids
    (``SLURM_JOB_ID=<future id>``) before the victim submits them; the collector cached
    "no owner" for those ids for good, so the victim's own processes later failed the
    owner check and were all charged to the victim's newest job on the GPU.
    IMPACT: root killed the victim's jobs (``over_limit, killed`` on W with V's pids).
    FIX: an owner is never cached as unknown; a process claiming its own job is that job's.
    """
    cfg, backend, state, tenancy = make(base, enforce_samples=1, enforce_over_limit="kill")
    for job in ("60", "61"):
        spy = spawn(procs, job, uid=ATTACKER)
        register(state, spy.pid, 100, ATTACKER, server=4242)
    clock = Clock()
    col = Collector(cfg, backend, clock=clock)
    for _ in range(2):
        col.step()
        clock.t += 1.0
    # the victim's jobs 60 and 61 start on the GPU (prolog: meta, then MPS registration)
    victims = []
    for job in (60, 61):
        meta(cfg, job, 2048, VICTIM)
        tenancy.add_job(0, VICTIM, job)
        p = spawn(procs, str(job), uid=VICTIM)
        register(state, p.pid, 1500, VICTIM, server=4242)
        victims.append(p)
    for _ in range(3):
        seen = col.step()
        clock.t += 1.0
    assert seen.get(("60", 0)) == 1500 and seen.get(("61", 0)) == 1500, seen
    assert enforce.read_verdicts(cfg.metrics_dir) == []
    assert all(alive(p) for p in victims), "root killed the victim's own jobs"


def test_an_owner_unknown_at_first_is_learnt_when_the_prolog_records_it(base: Path) -> None:
    cfg, backend, _state, _t = make(base)
    col = Collector(cfg, backend, clock=Clock())
    assert col._uid_of_job("70") is None
    meta(cfg, 70, 2048, VICTIM)
    assert col._uid_of_job("70") == VICTIM


def test_a_limit_unknown_at_first_is_enforced_as_soon_as_the_meta_appears(base: Path) -> None:
    """The enforcer re-reads a missing meta at every sample, not once every 30 s."""
    cfg, _backend, _state, _t = make(base, enforce_samples=1, enforce_over_limit="flag")
    clock = Clock()
    enf = enforce.Enforcer(cfg, clock=clock)
    entry = (GpuProcess(pid=123456, used_mib=9000, mps_client=True), 1,
             JobTag("71", 0, "environ", VICTIM))
    enf.begin_step()
    assert enf.observe(0, [entry]) == []
    enf.end_step()
    meta(cfg, 71, 2048, VICTIM)
    clock.t += 1.0
    enf.begin_step()
    got = enf.observe(0, [entry])
    enf.end_step()
    assert [(v.job_id, v.kind) for v in got] == [("71", enforce.OVER_LIMIT)]


# --- 2. the MPS server is not a job's process outside MPS ------------------------------

_CLIENT = (
    "import socket, sys, time\n"
    "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
    "s.connect(sys.argv[1] + '/control')\n"
    "s.sendall(b'CLIENT 0\\n')\n"
    "print(s.makefile().readline().strip(), flush=True)\n"
    "time.sleep(60)\n"
)


@contextlib.contextmanager
def user_daemon(cfg: CollocConfig, tenancy: Tenancy, uid: int) -> Iterator[MpsDaemon]:
    """The (GPU 0, uid) control daemon, started and handed over as the prolog does."""
    if not os.path.exists(STANDIN):
        pytest.fail(f"MPS stand-in not installed at {STANDIN}; run make venv")
    pipe, logdir = tenancy.prepare_user_dirs(0, uid)
    d = MpsDaemon(STANDIN, 0, pipe, logdir, tenancy.daemon_state(0, uid))
    d.start()
    tenancy.hand_pipe_dir_to(0, uid, uid)
    try:
        yield d
    finally:
        d.stop()


def mps_client(procs: list[subprocess.Popen[bytes]], pipe: Path, job: str,
               uid: int) -> tuple[subprocess.Popen[bytes], int]:
    """A process of ``uid`` in ``job`` that connects as an MPS client; (it, server pid)."""
    p = subprocess.Popen(  # type: ignore[call-overload]
        [sys.executable, "-c", _CLIENT, str(pipe)], user=uid, stdout=subprocess.PIPE,
        env={"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": job})
    procs.append(p)
    assert p.stdout is not None
    words = p.stdout.readline().decode().split()
    assert words[:1] == ["READY"], words
    return p, int(words[1])


def test_the_sim_lists_mps_servers_as_compute_processes_like_nvml(
    base: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """On hardware the legacy MPS server is in NVML's compute list (not in its MPS list)
    with the memory it holds; the sim hid it, so no test saw what the collector does."""
    cfg, backend, state, tenancy = make(base)
    with user_daemon(cfg, tenancy, VICTIM) as d:
        client, server = mps_client(procs, d.pipe_dir, "80", VICTIM)
        register(state, client.pid, 1024, VICTIM, server=server)
        got = {p.pid: p for p in backend.sample(0).processes}
        spec = backend.spec
        assert got[server] == GpuProcess(pid=server, used_mib=spec.server_mib, mps_client=False)
        assert got[client.pid].mps_client is True
        assert backend.sample(0).memory_used_mib == (
            spec.reserved_mib + spec.server_mib + 1024)  # the server counted once


@pytest.mark.parametrize("action", ["kill", "flag"])
def test_the_users_mps_server_is_never_outside_mps_nor_charged_to_a_job(
    base: Path, procs: list[subprocess.Popen[bytes]], action: str
) -> None:
    """FACT: the server of (GPU, user) runs as the user outside every job's cgroup and
    is no MPS client. IMPACT before the fix: charged to the user's newest job there as a
    process outside MPS: an ``outside_mps`` verdict on every shard job, and with
    ``enforce_outside_mps=kill`` root killed the user's MPS server.
    FIX: a child of root's verified control daemon of (GPU, its owner), with the
    daemon's program, is the MPS server: charged to nothing, never outside MPS."""
    cfg, backend, state, tenancy = make(base, enforce_samples=1, enforce_outside_mps=action)
    meta(cfg, 81, 2048, VICTIM)
    tenancy.add_job(0, VICTIM, 81)
    with user_daemon(cfg, tenancy, VICTIM) as d:
        client, server = mps_client(procs, d.pipe_dir, "81", VICTIM)
        register(state, client.pid, 1024, VICTIM, server=server)
        clock = Clock()
        col = Collector(cfg, backend, clock=clock)
        for _ in range(3):
            seen = col.step()
            clock.t += 1.0
        assert seen == {("81", 0): 1024}
        assert enforce.read_verdicts(cfg.metrics_dir) == []
        assert process_start_ticks(server) is not None, "root killed the user's MPS server"
        assert alive(client)


def test_a_process_outside_mps_is_still_caught_beside_a_recognised_server(
    base: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """Recognising the server must not excuse anything else of that user: a process of
    the same program (not the daemon's child) outside MPS is still flagged."""
    cfg, backend, state, tenancy = make(base, enforce_samples=1, enforce_outside_mps="flag")
    meta(cfg, 82, 2048, VICTIM)
    tenancy.add_job(0, VICTIM, 82)
    with user_daemon(cfg, tenancy, VICTIM) as d:
        client, server = mps_client(procs, d.pipe_dir, "82", VICTIM)
        register(state, client.pid, 1024, VICTIM, server=server)
        rogue = subprocess.Popen(  # type: ignore[call-overload]
            [sys.executable, "-c", "import time; time.sleep(60)"], user=VICTIM,
            env={"PATH": "/usr/bin:/bin"})
        procs.append(rogue)
        time.sleep(0.3)
        register(state, rogue.pid, 512, VICTIM)
        clock = Clock()
        col = Collector(cfg, backend, clock=clock)
        for _ in range(2):
            seen = col.step()
            clock.t += 1.0
        assert seen == {("82", 0): 1024 + 512}
        v = enforce.verdict_for(cfg, 82, 0)
        assert v is not None and v.kind == enforce.OUTSIDE_MPS and v.action == enforce.FLAGGED


def test_a_server_left_by_a_daemon_root_no_longer_vouches_for_is_not_excused(
    base: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """The daemon's identity comes from root's ``daemon.json`` and /proc: without it (or
    with another pid in it) the same process is an ordinary process outside MPS."""
    cfg, backend, state, tenancy = make(base, enforce_samples=1, enforce_outside_mps="flag")
    meta(cfg, 83, 2048, VICTIM)
    tenancy.add_job(0, VICTIM, 83)
    with user_daemon(cfg, tenancy, VICTIM) as d:
        client, server = mps_client(procs, d.pipe_dir, "83", VICTIM)
        register(state, client.pid, 1024, VICTIM, server=server)
        saved = tenancy.daemon_state(0, VICTIM).read_text()
        tenancy.daemon_state(0, VICTIM).unlink()
        try:
            col = Collector(cfg, backend, clock=Clock())
            col.step()
            v = enforce.verdict_for(cfg, 83, 0)
            assert v is not None and v.kind == enforce.OUTSIDE_MPS
        finally:
            tenancy.daemon_state(0, VICTIM).write_text(saved)
            os.chmod(tenancy.daemon_state(0, VICTIM), 0o600)


def test_the_v3_server_is_recognised_even_when_a_job_cgroup_would_claim_it(
    base: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """MPS v3: the node's daemon runs one server per GPU as root. Where the prolog runs
    inside the job (``PrologFlags=RunInJob``) the daemon and its servers sit in the
    first job's cgroup, which would make the server that job's process outside MPS.
    The v3 daemon's recorded identity (``mps_root/v3/state/daemon.json``) vouches for
    its servers as the legacy daemon's does for its own."""
    from slurm_colloc.mps.v3 import MpsV3Node
    from slurm_colloc.node.mps_protocol import V3_DIR

    cfg, backend, state, _t = make(base, enforce_samples=1, enforce_outside_mps="flag")
    v3 = base / "mps" / V3_DIR
    v3.mkdir(parents=True)
    script = base / "nvidia-cuda-mps-control"
    script.write_text(f"#!{sys.executable}\nimport sys\n"
                      "from slurm_colloc.gpu.sim.mps_v3_control import main\nsys.exit(main())\n")
    script.chmod(0o755)
    node = MpsV3Node(str(script), v3 / "pipe", v3 / "log", v3 / "state",
                     extra_env={"COLLOC_SIM_STATE": str(state)})
    uuid = backend.spec.uuid(0)
    node.start({0: uuid})
    try:
        env = node.add_job(0, uuid, 84, VICTIM, VICTIM, 2048, 0)
        meta(cfg, 84, 2048, VICTIM)
        client, server = mps_client(procs, Path(env["CUDA_MPS_PIPE_DIRECTORY"]), "84", VICTIM)
        register(state, client.pid, 1024, VICTIM, server=server)
        col = Collector(cfg, backend, clock=Clock())
        real = col.attributor.identity
        ticks = process_start_ticks(server)

        def in_job_cgroup(pid: int) -> tuple[int, JobTag] | None:  # RunInJob's layout
            if pid == server and ticks is not None:
                return ticks, JobTag("84", 0, "cgroup", 0)
            return real(pid)

        col.attributor.identity = in_job_cgroup  # type: ignore[method-assign]
        assert col._mps_server(server, 0)
        assert col.step() == {("84", 0): 1024}
        assert enforce.read_verdicts(cfg.metrics_dir) == []
    finally:
        node.stop()


# --- 3. culprits are jobs over their limit only --------------------------------------


def _v(job: str, kind: str, last: float = 100.0) -> enforce.Verdict:
    return enforce.Verdict(job, 0, VICTIM, 0, kind, 1800, 2048, last - 1, last, enforce.FLAGGED)


def test_a_job_outside_mps_within_its_allocation_is_no_culprit(tmp_path: Path) -> None:
    """ATTACK/DEFECT: a job that left MPS but stayed within its allocation was only
    flagged, yet counted as the culprit of a co-tenant's OOM: the victim's genuine OOM
    was requeued with the same request until it ran out of requeues.
    FIX: only jobs found over their limit are culprits."""
    cfg = CollocConfig(metrics_dir=str(tmp_path / "m"))
    enforce.write_verdict(cfg.metrics_dir, _v("90", enforce.OUTSIDE_MPS))
    assert enforce.culprits_on_gpu(cfg, 0, since=50.0, exclude_job=99) == []
    enforce.write_verdict(cfg.metrics_dir, _v("91", enforce.OVER_LIMIT))
    got = enforce.culprits_on_gpu(cfg, 0, since=50.0, exclude_job=99)
    assert [v.job_id for v in got] == ["91"]


def test_the_culprit_wait_is_not_cut_short_by_an_outside_mps_flag(tmp_path: Path) -> None:
    """The epilog waits for a verdict in the making: a mere flag must not end the wait
    before the over-limit verdict of the real offender arrives."""
    import threading

    cfg = CollocConfig(metrics_dir=str(tmp_path / "m"))
    enforce.write_verdict(cfg.metrics_dir, _v("92", enforce.OUTSIDE_MPS))
    t = threading.Timer(0.3, enforce.write_verdict,
                        (cfg.metrics_dir, _v("93", enforce.OVER_LIMIT)))
    t.start()
    got = enforce.culprits_on_gpu(cfg, 0, since=50.0, wait_s=3.0)
    t.join()
    assert [v.job_id for v in got] == ["93"]

