"""Fault injection on a devcluster: one daemon killed at one moment of an OOM job's life.

Issue 28 item 6. A *row* is ``<kind>@<moment>[:<outage s>]``:

* kinds: ``slurmctld``, ``slurmdbd``, ``mariadb`` and ``slurmd`` are SIGKILLed by their
  pid files and, after the outage, started again with ``Cluster.restart`` (what
  ``colloc devcluster restart`` runs); ``collector-supervisor`` and ``collector-worker``
  are SIGKILLed and never restarted by the suite (colloc must bring them back);
  ``statefs`` fills the filesystem under root's evidence, spool and requeue directories
  (a full tmpfs mounted over each) for the outage.
* moments: ``prolog`` (the OOM job's prolog is held by a site Prolog line ahead of
  colloc's, the fault strikes, the gate opens: colloc's prolog runs during the fault),
  ``running`` (both jobs run), ``epilog`` (the same with a site Epilog line: colloc's
  epilog of the OOM'd attempt runs during the fault).

Each row runs two jobs of its own: an OOM job (6 shards, peaks at 9 GiB; colloc should
requeue it on a whole GPU, where it completes) and a good job beside it. slurmctld is
killed only after it has saved its job state (``job_state`` newer than the moment):
a slurmctld killed before that loses the job by Slurm's own design, which no node
script can repair, and would be measured as colloc's loss.

Counted per row (:class:`Outcome`): lost jobs (not COMPLETED), lost records (every
attempt's colloc record, decoded from every row of ``sacct -D``), lost requeues (an
attempt OOM'd, the job was not rerun), nodes drained, recovery (from the daemon's
restart until every job has ended and every record is in accounting), enforcement
back (collector rows: from the kill until a supervisor holds the lock and the worker
completed a sample) and the row's prolog p50/p99 from the ``[took W s, …]`` log
suffix. :func:`table` prints them as the issue's table.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from slurm_colloc import config as cfgmod
from slurm_colloc.accounting.field import record_in
from slurm_colloc.accounting.newest import attempt_numbers
from slurm_colloc.accounting.spool import spool_dir_of
from slurm_colloc.bench.burst import percentile, prolog_runs
from slurm_colloc.devcluster import daemons
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.metrics import liveness
from slurm_colloc.slurm.adapter import TERMINAL_STATES, SlurmCli, SlurmError, by_start, job_state

DAEMON_KINDS = ("slurmctld", "slurmdbd", "mariadb", "slurmd")
COLLECTOR_KINDS = ("collector-supervisor", "collector-worker")
KINDS = (*DAEMON_KINDS, *COLLECTOR_KINDS, "statefs")
MOMENTS = ("prolog", "running", "epilog")
DRAINED = ("drain", "drng", "down", "fail")

OOM_JOB = ("echo attempt=${SLURM_RESTART_COUNT:-0}\n"
           "colloc-simjob --mem 3G --peak 9G --peak-at 0.5 --seconds 6")
OOM_SHARDS = 6  # 9 GiB is over its 6 shards; a whole GPU (39 shards) holds it
GOOD_JOB = "echo attempt=${SLURM_RESTART_COUNT:-0}\ncolloc-simjob --mem 2G --seconds 10"
GOOD_SHARDS = 4
ENFORCEMENT_TARGET_S = 10.0
RECORD_TARGET_S = 120.0

GATE = """#!/bin/sh
# colloc fault suite: hold the {what} of a job armed for it until {d}/go.{what} (<= 120 s)
[ -e {d}/armed.{what}.$SLURM_JOB_ID ] || exit 0
/bin/mv {d}/armed.{what}.$SLURM_JOB_ID {d}/claimed.{what}.$SLURM_JOB_ID 2>/dev/null || exit 0
/bin/touch {d}/started.{what}.$SLURM_JOB_ID
i=0
while [ ! -e {d}/go.{what} ] && [ $i -lt 1200 ]; do /bin/sleep 0.1; i=$((i+1)); done
exit 0
"""


class FaultError(RuntimeError):
    """The suite itself could not run a row (not a finding about colloc)."""


@dataclass(frozen=True)
class Row:
    """One fault: what is killed, when, and for how long it stays away."""

    kind: str
    moment: str
    outage_s: float = 5.0

    @classmethod
    def parse(cls, text: str) -> Row:
        """``slurmctld@epilog`` or ``mariadb@running:60``; a clear error otherwise."""
        m = re.fullmatch(r"([a-z-]+)@([a-z]+)(?::(\d+(?:\.\d+)?))?", text.strip())
        if not m:
            raise ValueError(f"{text!r}: a row is <kind>@<moment>[:<outage seconds>]")
        kind, moment, outage = m.groups()
        if kind not in KINDS:
            raise ValueError(f"{text!r}: kind is one of {', '.join(KINDS)}")
        if moment not in MOMENTS:
            raise ValueError(f"{text!r}: moment is one of {', '.join(MOMENTS)}")
        if kind in COLLECTOR_KINDS and moment != "running":
            raise ValueError(f"{text!r}: the collector runs only while a job runs: "
                             f"{kind}@running")
        secs = float(outage) if outage else 5.0
        if not 0 <= secs <= 3600:
            raise ValueError(f"{text!r}: an outage of 0 to 3600 s")
        return cls(kind, moment, secs)

    @property
    def label(self) -> str:
        base = f"{self.kind}@{self.moment}"
        return base if self.outage_s == 5.0 else f"{base}:{self.outage_s:g}"


def quick_rows() -> list[Row]:
    """Every daemon at every moment (5 s away), both collector kills, a full disk."""
    rows = [Row(k, m) for k in DAEMON_KINDS for m in MOMENTS]
    rows += [Row(k, "running") for k in COLLECTOR_KINDS]
    rows += [Row("statefs", "epilog", 10.0)]
    return rows


def outage_rows(lengths: Iterable[float] = (60, 300, 900)) -> list[Row]:
    """The issue's long outages (1, 5 and 15 min) of the controller and of accounting."""
    return [Row(k, "epilog", s) for s in lengths for k in ("slurmctld", "slurmdbd")]


@dataclass
class Outcome:
    """What one row cost."""

    row: Row
    jobs: int = 0
    lost_jobs: int = 0
    records_expected: int = 0
    lost_records: int = 0
    requeues_expected: int = 0
    lost_requeues: int = 0
    drained: int = 0
    recovery_s: float | None = None
    enforcement_s: float | None = None
    prolog_s: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """The issue's bar: nothing lost, nothing drained, recovered, enforcement back."""
        enforced = (self.row.kind not in COLLECTOR_KINDS
                    or (self.enforcement_s is not None
                        and self.enforcement_s <= ENFORCEMENT_TARGET_S))
        return (self.lost_jobs == self.lost_records == self.lost_requeues == self.drained == 0
                and self.recovery_s is not None and enforced)


def _fmt(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f}"


def table(outcomes: list[Outcome]) -> str:
    """The issue's table, one markdown row per fault."""
    head = ("| fault | jobs lost | records lost | requeues lost | drained | recovery s "
            "| enforcement back s | prolog p50 / p99 s | ok | notes |")
    lines = [head, "|" + "---|" * 10]
    for o in outcomes:
        p50, p99 = percentile(o.prolog_s, 50), percentile(o.prolog_s, 99)
        lines.append(
            f"| {o.row.label} | {o.lost_jobs}/{o.jobs} "
            f"| {o.lost_records}/{o.records_expected} "
            f"| {o.lost_requeues}/{o.requeues_expected} | {o.drained} "
            f"| {_fmt(o.recovery_s)} | {_fmt(o.enforcement_s)} "
            f"| {_fmt(p50)} / {_fmt(p99)} | {'yes' if o.ok else 'NO'} "
            f"| {'; '.join(o.notes)} |")
    return "\n".join(lines)


def prolog_times(log_text: str, jobs: Iterable[int]) -> list[float]:
    """Wall seconds of every prolog of ``jobs`` found in colloc's node log."""
    return [r.wall_s for r in prolog_runs(log_text.splitlines(), jobs)]


def wait_until(cond: Callable[[], bool], what: str, timeout: float, step: float = 0.3) -> float:
    """Poll ``cond``; seconds it took. Raises :class:`FaultError` on timeout."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        time.sleep(step)
    raise FaultError(f"{what} (waited {timeout:.0f} s)")


class Suite:
    """Runs rows on one devcluster: gates in slurm.conf, jobs, kills, restarts, counts."""

    def __init__(self, cluster: Cluster, workdir: Path) -> None:
        self.c = cluster
        self.slurm = SlurmCli(env=cluster.env(), timeout=30)
        self.cfg = cfgmod.load(cluster.layout.colloc_conf)
        self.gates = cluster.layout.root / "fault-gates"
        self.workdir = workdir
        self._conf_text: str | None = None
        self._pending_unmount: list[tuple[Path, Path]] = []

    # ---------------------------------------------------------------- gates
    @contextlib.contextmanager
    def installed(self) -> Iterator[Suite]:
        """Gate lines ahead of colloc's Prolog and Epilog; slurm.conf restored after."""
        self.gates.mkdir(parents=True, exist_ok=True)
        self.gates.chmod(0o755)
        lines = []
        for what, key in (("prolog", "Prolog"), ("epilog", "Epilog")):
            script = self.gates / what
            script.write_text(GATE.format(d=self.gates, what=what))
            script.chmod(0o755)
            lines.append(f"{key}={script}\n")
        conf = self.c.layout.slurm_conf
        self._conf_text = conf.read_text()
        conf.write_text("".join(lines) + self._conf_text)
        try:
            self._reconfigure(lambda cfg: str(self.gates / "epilog") in cfg)
            yield self
        finally:
            for what in ("prolog", "epilog"):
                (self.gates / f"go.{what}").touch()
            self.ensure_up()
            conf.write_text(self._conf_text)
            self._reconfigure(lambda cfg: str(self.gates / "epilog") not in cfg)

    def _scontrol(self, *args: str) -> str:
        cp = subprocess.run(["scontrol", *args], env=self.c.env(), capture_output=True,
                            text=True, check=False, timeout=60)
        if cp.returncode != 0:
            raise FaultError(f"scontrol {' '.join(args)}: {cp.stderr.strip()}")
        return cp.stdout

    def _reconfigure(self, took: Callable[[str], bool]) -> None:
        self._scontrol("reconfigure")
        wait_until(lambda: took(self._scontrol("show", "config")),
                   "slurmctld did not take the changed Prolog/Epilog lines", 60, 1.0)
        wait_until(lambda: self.c.is_up() and self.node_state() in ("idle", "mix", "alloc"),
                   "the node did not come back after reconfigure", 90, 1.0)

    def node_state(self) -> str:
        cp = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=self.c.env(),
                            capture_output=True, text=True, check=False, timeout=30)
        return cp.stdout.strip().splitlines()[0].rstrip("*~#!%$@^-") if cp.stdout.strip() else ""

    def ensure_up(self) -> None:
        """Every daemon running again (whatever a row left down)."""
        self.c.up(install=False, timeout=120)

    # ---------------------------------------------------------------- jobs
    def _submit(self, name: str, body: str, shards: int, *, hold: bool) -> int:
        script = self.workdir / f"{name}.sh"
        script.write_text("#!/bin/bash\n" + body + "\n")
        script.chmod(0o755)
        argv = ["sbatch", "--parsable", f"--chdir={self.workdir}", "--open-mode=append",
                f"--output={self.workdir}/%j.out", f"--gres=shard:{shards}",
                f"--job-name=fault-{name}", str(script)]
        if hold:
            argv.insert(1, "--hold")
        cp = subprocess.run(argv, env=self.c.env(), capture_output=True, text=True,
                            check=False, timeout=60)
        if cp.returncode != 0:
            raise FaultError(f"sbatch: {cp.stderr.strip()}")
        return int(cp.stdout.strip().split(";")[0])

    def _info(self, job: int) -> dict[str, str]:
        try:
            return self.slurm.show_job(job) or {}
        except SlurmError:
            return {}

    def _recorded(self, job: int) -> frozenset[int]:
        try:
            rows = by_start(self.slurm.accounting([job]))
        except SlurmError:
            return frozenset()
        got: frozenset[int] = frozenset()
        for r in rows:
            got |= attempt_numbers(record_in(r.fields, self.cfg.record_field))
        return got

    # ---------------------------------------------------------------- faults
    def _daemon(self, name: str) -> daemons.Daemon:
        by_name = {d.name: d for d in self.c.daemons()}
        return by_name[name]

    def _state_saved_after(self, t_wall: float) -> bool:
        try:
            return (self.c.layout.slurm_state / "job_state").stat().st_mtime > t_wall
        except OSError:
            return False

    def _kill_daemon(self, name: str, after_wall: float) -> None:
        if name == "slurmctld":  # see the module docstring: Slurm's own loss otherwise
            with contextlib.suppress(FaultError):
                wait_until(lambda: self._state_saved_after(after_wall),
                           "slurmctld did not save its job state", 20, 0.2)
        d = self._daemon(name)
        pid = daemons.read_pid(d.pid_file)
        if pid is None or not daemons.pid_runs(pid, d.exe_name):
            raise FaultError(f"{name} is not running: nothing to kill")
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not daemons.pid_runs(pid, d.exe_name), f"{name} survived SIGKILL", 20)

    def _kill_collector(self, kind: str) -> float:
        """SIGKILL one collector process; seconds until enforcement is back."""
        md = self.cfg.metrics_dir
        wait_until(lambda: liveness.collector_running(md)
                   and (liveness.heartbeat_age(md) or 99.0) < 3.0,
                   "the collector was not sampling before the kill", 60)
        sup, worker = liveness.read_pids(md)
        pid = sup if kind == "collector-supervisor" else worker
        if pid is None:
            raise FaultError(f"{kind}: no pid in the collector's pid file")
        killed = time.time()
        os.kill(pid, signal.SIGKILL)

        def back() -> bool:
            age = liveness.heartbeat_age(md)
            return (liveness.collector_running(md) and age is not None
                    and age < time.time() - killed)

        with contextlib.suppress(FaultError):
            wait_until(back, "", 60, 0.1)
            return time.time() - killed
        return float("inf")

    @contextlib.contextmanager
    def _full_statefs(self) -> Iterator[None]:
        """A full tmpfs over root's evidence, spool and requeue directories."""
        ev = Path(self.cfg.evidence_dir)
        dirs = [ev, spool_dir_of(str(ev)), ev.parent / "requeue"]
        mounted: list[tuple[Path, Path]] = []
        try:
            for d in dirs:
                d.mkdir(parents=True, exist_ok=True)
                st = d.stat()
                subprocess.run(["mount", "-t", "tmpfs", "-o",
                                f"size=64k,mode={st.st_mode & 0o7777:o},uid={st.st_uid},"
                                f"gid={st.st_gid}", "colloc-fault-full", str(d)], check=True)
                filler = d / ".fault-filler"
                mounted.append((d, filler))
                with contextlib.suppress(OSError), open(filler, "wb") as f:
                    while True:
                        f.write(b"\0" * 4096)
                        f.flush()
            yield
        finally:
            for _, filler in mounted:
                filler.unlink(missing_ok=True)  # space back: what was written stays
            self._pending_unmount = mounted

    def _unmount(self) -> None:
        """Copy what colloc wrote on the full filesystem back to the real directory."""
        for d, _ in self._pending_unmount:
            keep = self.c.layout.root / f"fault-keep-{d.name}"
            shutil.rmtree(keep, ignore_errors=True)
            shutil.copytree(d, keep, symlinks=True)
            subprocess.run(["umount", "-l", str(d)], check=False)
            shutil.copytree(keep, d, symlinks=True, dirs_exist_ok=True)
            shutil.rmtree(keep, ignore_errors=True)
        self._pending_unmount = []

    # ---------------------------------------------------------------- a row
    def run_row(self, row: Row) -> Outcome:
        """Run one fault with two fresh jobs; everything is running again afterwards."""
        out = Outcome(row)
        for w in ("prolog", "epilog"):
            (self.gates / f"go.{w}").unlink(missing_ok=True)
        tag = row.label.replace("@", "-").replace(":", "-")
        oom = self._submit(f"{tag}-oom", OOM_JOB, OOM_SHARDS, hold=True)
        if row.moment != "running":
            (self.gates / f"armed.{row.moment}.{oom}").touch()
        self._scontrol("release", str(oom))
        good = self._submit(f"{tag}-good", GOOD_JOB, GOOD_SHARDS, hold=False)
        jobs = [oom, good]
        out.jobs = len(jobs)
        try:
            self._reach(row, oom, jobs)
            back = self._strike(row, out)
            self._count(out, oom, jobs, back)
        finally:
            for w in ("prolog", "epilog"):
                (self.gates / f"go.{w}").touch()
                (self.gates / f"armed.{w}.{oom}").unlink(missing_ok=True)
            self._unmount()
            with contextlib.suppress(FaultError, daemons.DaemonError):
                self.ensure_up()
            subprocess.run(["scancel", *map(str, jobs)], env=self.c.env(), check=False,
                           capture_output=True, timeout=60)
        log = Path(self.cfg.log_file)
        text = log.read_text(errors="replace") if log.exists() else ""
        out.prolog_s = prolog_times(text, jobs)
        without = [j for j in jobs if f"prolog: job {j}: job runs without MPS" in text]
        if without:
            out.notes.append(f"prolog without MPS (controller away, bounded): {without}")
        return out

    def _reach(self, row: Row, oom: int, jobs: list[int]) -> None:
        if row.moment == "running":  # RUNNING includes CONFIGURING: the scripts' output
            wait_until(lambda: all(self._started(j) for j in jobs),
                       f"jobs {jobs} never ran together", 180)
            return
        started = self.gates / f"started.{row.moment}.{oom}"
        wait_until(started.exists, f"job {oom}'s {row.moment} never reached the gate", 180)

    def _strike(self, row: Row, out: Outcome) -> float:
        """The fault itself; returns the monotonic time the faulty part was back."""
        moment_wall = time.time()
        go = self.gates / f"go.{row.moment}"
        if row.kind in COLLECTOR_KINDS:
            out.enforcement_s = round(self._kill_collector(row.kind), 2)
            return time.monotonic()
        if row.kind == "statefs":
            with self._full_statefs():
                go.touch()
                time.sleep(row.outage_s)
            return time.monotonic()
        self._kill_daemon(row.kind, moment_wall)
        go.touch()
        time.sleep(row.outage_s)
        try:
            self.c.restart(row.kind, timeout=120)
        except daemons.DaemonError as e:
            out.notes.append(f"restart: {str(e).splitlines()[0]}")
            self.ensure_up()
        return time.monotonic()

    def _started(self, job: int) -> bool:
        """The batch script runs (its first line is out; its prolog is over)."""
        with contextlib.suppress(OSError):
            return "attempt=" in (self.workdir / f"{job}.out").read_text(errors="replace")
        return False

    def _oom_seen(self, job: int) -> bool:
        f = self.workdir / f"{job}.out"
        with contextlib.suppress(OSError):
            return "out of memory" in f.read_text(errors="replace").lower()
        return False

    def _restarts(self, job: int) -> int:
        """Slurm's restart count; from accounting's rows (one per attempt, ``sacct -D``)
        once slurmctld has forgotten the job (a long outage outlasts ``MinJobAge``)."""
        v = str(self._info(job).get("Restarts", ""))
        if v.isdigit():
            return int(v)
        try:
            return max(0, len(self.slurm.accounting([job])) - 1)
        except SlurmError:
            return 0

    def _rerun_whole(self, job: int) -> bool:
        """The last attempt had a whole GPU's shards (39): from slurmctld, or from
        accounting's last row once slurmctld has forgotten the job (a long outage)."""
        tres = str(self._info(job).get("TresPerNode", ""))
        if tres:
            return "gres/shard:39" in tres
        try:
            rows = by_start(self.slurm.accounting([job]))
        except SlurmError:
            return False
        return bool(rows) and rows[-1].alloc_tres.get("gres/shard", 0) >= 39

    def _settled(self, oom: int, jobs: list[int]) -> bool:
        """Every job in a final state, the OOM job's requeue (if it OOM'd) done.

        The restart count is read before the states: read after, a requeue landing
        between the reads paired the old attempt's FAILED with the new count, and the
        row ended with the job PENDING and counted it lost (seen: slurmd@epilog, the
        late epilog's requeue 21 s after the job failed)."""
        try:
            requeued = not self._oom_seen(oom) or self._restarts(oom) >= 1
            states = [job_state(self.slurm, j) for j in jobs]
        except SlurmError:
            return False
        return requeued and all(s in TERMINAL_STATES for s in states)

    def _count(self, out: Outcome, oom: int, jobs: list[int], back: float) -> None:
        settle_by = back + 300.0
        while time.monotonic() < settle_by and not self._settled(oom, jobs):
            time.sleep(1.0)
        states = {j: job_state(self.slurm, j) for j in jobs}
        out.lost_jobs = sum(1 for s in states.values() if s != "COMPLETED")
        if out.lost_jobs:
            out.notes.append("ended " + ", ".join(f"{j} {s}" for j, s in states.items()))
        if self._oom_seen(oom):
            out.requeues_expected = 1
            if self._restarts(oom) < 1:
                out.lost_requeues = 1
            elif not self._rerun_whole(oom):
                out.notes.append(f"job {oom} rerun without a whole GPU")
        want = {j: frozenset(range(self._restarts(j) + 1)) for j in jobs}
        out.records_expected = sum(len(v) for v in want.values())
        record_by = time.monotonic() + RECORD_TARGET_S + 60.0
        got: dict[int, frozenset[int]] = {}
        while True:
            got = {j: self._recorded(j) & want[j] for j in jobs}
            if all(got[j] == want[j] for j in jobs) or time.monotonic() > record_by:
                break
            time.sleep(2.0)
        out.lost_records = sum(len(want[j] - got[j]) for j in jobs)
        if not out.lost_records and not out.lost_jobs:
            out.recovery_s = round(time.monotonic() - back, 1)
        out.drained = 1 if self.node_state() in DRAINED else 0


def summary(outcomes: list[Outcome]) -> str:
    """One line: how many rows met the bar."""
    ok = sum(1 for o in outcomes if o.ok)
    med = [o.recovery_s for o in outcomes if o.recovery_s is not None]
    return (f"{ok}/{len(outcomes)} rows lost nothing and recovered"
            + (f"; recovery median {statistics.median(med):.1f} s" if med else ""))
