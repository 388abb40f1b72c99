"""Bring a private one-node Slurm cluster with simulated GPUs up and down.

Real daemons from Debian's packages (munged, MariaDB, slurmdbd, slurmctld, slurmd),
each with its own pid file, log and port under one root directory. ``up`` either
finishes with the node usable in ``sinfo`` or stops everything it started and raises
a :class:`DaemonError` naming the daemon and its log.

A cluster that already came up once is *resumed*, never rebuilt, unless asked
(``fresh``): one crashed daemon must not cost the running jobs, Slurm's saved state
or the accounting database, since that is exactly what crash tests want to observe.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from slurm_colloc.devcluster import configs, daemons, hosts, slurm_release
from slurm_colloc.devcluster.daemons import Daemon, DaemonError
from slurm_colloc.devcluster.layout import DEFAULT_ROOT, Layout, NodePlan, Spec
from slurm_colloc.devcluster.packages import ensure_packages
from slurm_colloc.gpu.sim import tools

log = logging.getLogger("colloc.devcluster")

DAEMON_NAMES = ("munged", "mariadb", "slurmdbd", "slurmctld", "slurmd")
"""Start order: each needs the ones before it (munge auth, the database, accounting).
A multi-node cluster has one ``slurmd-<host>`` per compute host where ``slurmd`` is;
``slurmd`` then names all of them."""


def expand(name: str, names: list[str]) -> list[str]:
    """The daemons ``name`` stands for among ``names`` (``all``, ``slurmd``, or one)."""
    if name == "all":
        return list(names)
    if name == "slurmd":
        return [n for n in names if n == "slurmd" or n.startswith("slurmd-")]
    return [name] if name in names else []


def up_plan(saved: Spec | None, wanted: Spec, *, fresh: bool) -> str:
    """``"build"`` or ``"resume"``; raise when an existing cluster has another shape.

    A different shape is refused rather than rebuilt: silently replacing a cluster
    would wipe its jobs and accounting, which only ``fresh`` may do.
    """
    if fresh or saved is None:
        return "build"
    if saved != wanted:
        raise DaemonError(
            "a devcluster with another shape exists there; bring it up with its own "
            "shape, or rebuild it with `colloc devcluster up --fresh` (wipes jobs and "
            "accounting)"
        )
    return "resume"


def to_start(pids: dict[str, int | None]) -> list[str]:
    """Daemons that are not running, in start order.

    Daemons still running are left alone even when one they depend on restarts:
    each reconnects by itself (munge per request, slurmdbd to MariaDB, slurmctld to
    slurmdbd with its queued records, slurmd to slurmctld), and restarting them
    would only lose more.
    """
    def rank(name: str) -> int:
        base = "slurmd" if name.startswith("slurmd-") else name
        return DAEMON_NAMES.index(base) if base in DAEMON_NAMES else len(DAEMON_NAMES)

    return sorted((n for n, pid in pids.items() if pid is None), key=rank)



@dataclass
class Cluster:
    """One devcluster, addressed by its root directory."""

    layout: Layout
    spec: Spec

    @classmethod
    def at(cls, root: Path | str = DEFAULT_ROOT, spec: Spec | None = None) -> Cluster:
        """The cluster at ``root``: its saved spec if it has one, else ``spec``/defaults."""
        layout = Layout(Path(root))
        if spec is None and layout.spec_file.exists():
            spec = Spec.from_json(layout.spec_file.read_text())
        return cls(layout, spec or Spec())

    # ---------------------------------------------------------------- environment
    @property
    def venv_bin(self) -> Path:
        """Directory of the Python running colloc (its console scripts live there)."""
        return Path(sys.executable).parent

    def env(self) -> dict[str, str]:
        """Environment for Slurm clients and daemons of this cluster."""
        env = {
            k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))
        }
        env["SLURM_CONF"] = str(self.layout.slurm_conf)
        env["COLLOC_CONF"] = str(self.layout.colloc_conf)
        path = env.get("PATH", "/usr/local/bin:/usr/bin:/bin")
        env["PATH"] = f"{self.layout.lab_bin}:{self.venv_bin}:{path}:/usr/sbin:/sbin"
        return env

    def export_lines(self) -> str:
        """Shell lines a user evaluates to use the cluster."""
        return (
            f"export SLURM_CONF={self.layout.slurm_conf}\n"
            f"export COLLOC_CONF={self.layout.colloc_conf}\n"
            f'export PATH={self.layout.lab_bin}:{self.venv_bin}:"$PATH"\n'
        )

    # ---------------------------------------------------------------- daemons
    def daemons(self) -> list[Daemon]:
        """The daemons in start order."""
        L, s = self.layout, self.spec
        return [
            Daemon(
                "munged",
                (
                    "/usr/sbin/munged",
                    f"--socket={L.munge_socket}",
                    f"--key-file={L.munge / 'munge.key'}",
                    f"--pid-file={L.munge / 'munged.pid'}",
                    f"--log-file={L.munge / 'munged.log'}",
                    f"--seed-file={L.munge / 'munged.seed'}",
                    "--force",
                ),
                L.munge / "munged.pid",
                L.munge / "munged.log",
                "munged",
                user="munge",
                capture_file=L.log / "munged.stdout",
            ),
            Daemon(
                "mariadb",
                (
                    "/usr/sbin/mariadbd",
                    "--no-defaults",
                    f"--datadir={L.mysql / 'data'}",
                    f"--socket={L.mysql_socket}",
                    f"--port={s.mysql_port}",
                    "--bind-address=127.0.0.1",
                    f"--pid-file={L.mysql / 'mariadb.pid'}",
                    f"--log-error={L.log / 'mariadb.log'}",
                    "--user=mysql",
                    "--skip-name-resolve",
                    "--innodb-buffer-pool-size=128M",
                    "--innodb-log-file-size=64M",
                    "--innodb-lock-wait-timeout=900",
                    "--max-allowed-packet=16M",
                ),
                L.mysql / "mariadb.pid",
                L.log / "mariadb.log",
                "mariadbd",
            ),
            Daemon(
                "slurmdbd", ("/usr/sbin/slurmdbd",), L.run / "slurmdbd.pid",
                L.log / "slurmdbd.log", "slurmdbd", extra_env=slurm_release.slurmdbd_env(),
            ),
            Daemon(
                # -i: a slurmctld killed mid-run may leave a state file unwritten
                # (26.05 stops at a missing assoc_usage); jobs are still recovered
                "slurmctld", ("/usr/sbin/slurmctld", "-i"), L.run / "slurmctld.pid",
                L.log / "slurmctld.log", "slurmctld",
            ),
            *self._slurmds(),
        ]

    def _slurmds(self) -> list[Daemon]:
        L, s = self.layout, self.spec
        if not s.multi_node:
            return [Daemon(
                "slurmd", ("/usr/sbin/slurmd", "-N", s.node_name),
                L.run / f"slurmd-{s.node_name}.pid", L.log / f"slurmd-{s.node_name}.log",
                "slurmd",
            )]
        return [
            Daemon(
                f"slurmd-{n.name}", hosts.slurmd_argv(s, L, n),
                L.run / f"slurmd-{n.name}.pid", L.log / f"slurmd-{n.name}.log", "slurmd",
            )
            for n in s.node_plans()
        ]

    def daemon_names(self) -> list[str]:
        """This cluster's daemons in start order (``restart`` takes these)."""
        return [d.name for d in self.daemons()]

    def node(self, name: str) -> NodePlan:
        """A compute host by name (DaemonError naming the hosts when there is none)."""
        for n in self.spec.node_plans():
            if n.name == name:
                return n
        names = ", ".join(n.name for n in self.spec.node_plans())
        raise DaemonError(f"no compute host {name!r} in this devcluster: {names}")

    def enter_argv(self, node: str, argv: list[str]) -> list[str]:
        """``argv`` run on a compute host (in its namespaces; as is on a one-node lab)."""
        plan = self.node(node)
        if not self.spec.multi_node:
            return argv
        pid = daemons.running(self._slurmds()[plan.index])
        if pid is None:
            raise DaemonError(f"slurmd of {node} is not running: `colloc devcluster up`")
        return hosts.enter_argv(pid, argv)

    def status(self) -> dict[str, int | None]:
        """Pid of each daemon, None where it is not running."""
        return {d.name: daemons.running(d) for d in self.daemons()}

    def is_up(self) -> bool:
        """All daemons running (the node's state is not asked)."""
        return self.layout.spec_file.exists() and all(v is not None for v in self.status().values())

    # ---------------------------------------------------------------- up
    def up(self, *, install: bool = True, timeout: float = 60, fresh: bool = False) -> float:
        """Bring the cluster up; idempotent. Returns seconds taken.

        With state from an earlier successful ``up`` of the same spec, only daemons
        that are not running are started, and nothing on disk is rewritten; ``fresh``
        (or no saved state) builds from scratch.
        """
        t0 = time.monotonic()
        self.spec.validate()
        if os.geteuid() != 0:
            raise DaemonError("colloc devcluster up must run as root (it starts munged, slurmd)")
        saved = self.saved_spec()
        try:
            plan = up_plan(saved, self.spec, fresh=fresh)
        except DaemonError as e:
            raise DaemonError(f"{self.layout.root}: {e}") from None
        if plan == "resume":
            self._resume(timeout)
            return time.monotonic() - t0
        if fresh:
            self.down()
        if install:
            ensure_packages()
        self._check_ports()
        started: list[Daemon] = []
        try:
            self._write_files()
            self._hosts_up()
            steps: list[tuple[Daemon, Callable[[], bool]]] = list(
                zip(self.daemons(), self._readiness(), strict=True)
            )
            for d, ready in steps:
                if d.name == "slurmctld":
                    self._register_accounting()
                log.info("starting %s", d.name)
                started.append(d)
                daemons.start(d, self.env(), ready, timeout=timeout)
                if d.name == "mariadb":
                    self._create_db_user()
            self._wait_node_idle(timeout)
        except BaseException:
            for d in reversed(started):
                daemons.stop(d)
            self._kill_cluster_processes()
            if self.spec.multi_node:
                hosts.network_down(self.spec)
            raise
        # written last: its presence means "configs, database user and accounting are
        # complete", which is what lets a later ``up`` resume instead of rebuild
        self.layout.spec_file.write_text(self.spec.to_json())
        return time.monotonic() - t0

    def saved_spec(self) -> Spec | None:
        """The spec of the last successful ``up`` here, None when there was none."""
        try:
            return Spec.from_json(self.layout.spec_file.read_text())
        except (OSError, ValueError, TypeError):
            return None

    def _hosts_up(self) -> None:
        """Namespaces and private directories of the compute hosts (multi-node only)."""
        if not self.spec.multi_node:
            return
        hosts.network_up(self.spec)
        for n in self.spec.node_plans():
            hosts.prepare_private_dirs(self.layout, n)

    def _resume(self, timeout: float) -> None:
        self._hosts_up()  # gone after a reboot; kept as they are otherwise
        names = to_start(self.status())
        if not names:
            if self._node_ready():
                log.info("devcluster already up at %s", self.layout.root)
                return
        else:
            log.info("devcluster at %s: restarting %s", self.layout.root, ", ".join(names))
        by_name = self._steps()
        for name in names:
            d, ready = by_name[name]
            daemons.stop(d)  # a stale pid file only; ``running`` said it is not
            log.info("starting %s", name)
            daemons.start(d, self.env(), ready, timeout=timeout)
        self._wait_node_idle(timeout)

    def restart(self, name: str, *, timeout: float = 60) -> float:
        """Stop one daemon (or ``all``) if it runs, start it again, wait until ready.

        Jobs are left alone: slurmstepd outlives slurmd, and slurmctld and slurmdbd
        recover from their saved state, which is the point of restarting one daemon.
        """
        t0 = time.monotonic()
        if os.geteuid() != 0:
            raise DaemonError("colloc devcluster restart must run as root")
        names = expand(name, self.daemon_names())
        if not names:
            raise DaemonError(
                f"no daemon {name!r}: one of {', '.join(self.daemon_names())}, slurmd or all")
        if self.saved_spec() is None:
            raise DaemonError(f"no devcluster at {self.layout.root}: run `colloc devcluster up`")
        self._hosts_up()
        by_name = self._steps()
        for n in reversed(names):
            if daemons.stop(by_name[n][0]):
                log.info("stopped %s", n)
        for n in names:
            d, ready = by_name[n]
            log.info("starting %s", n)
            daemons.start(d, self.env(), ready, timeout=timeout)
        self._wait_node_idle(timeout)
        return time.monotonic() - t0

    def _steps(self) -> dict[str, tuple[Daemon, Callable[[], bool]]]:
        return {
            d.name: (d, ready)
            for d, ready in zip(self.daemons(), self._readiness(), strict=True)
        }

    def _check_ports(self) -> None:
        s = self.spec
        ports = [("mariadb", s.mysql_port), ("slurmdbd", s.dbd_port),
                 ("slurmctld", s.ctld_port)]
        if not s.multi_node:  # compute hosts have their own network namespaces
            ports.append(("slurmd", s.slurmd_port))
        for name, port in ports:
            if not daemons.port_free(port):
                raise DaemonError(
                    f"{name}: port {port} on 127.0.0.1 is already in use; stop whatever "
                    f"listens there (ss -ltnp 'sport = :{port}') or choose another port"
                )

    def _readiness(self) -> list[Callable[[], bool]]:
        L, s = self.layout, self.spec
        return [
            # a killed munged leaves its socket file behind: connect, do not stat
            lambda: daemons.unix_socket_open(L.munge_socket),
            lambda: daemons.unix_socket_open(L.mysql_socket)
            and daemons.port_open(s.mysql_port),
            lambda: daemons.port_open(s.dbd_port),
            lambda: self._quiet_ok(["scontrol", "ping"]),
            *[self._slurmd_ready(n) for n in s.node_plans()],
        ]

    def _slurmd_ready(self, node: NodePlan) -> Callable[[], bool]:
        port = self.spec.slurmd_port
        return lambda: daemons.port_open(port, node.addr)

    def _quiet_ok(self, argv: list[str]) -> bool:
        cp = subprocess.run(argv, env=self.env(), capture_output=True, text=True, check=False)
        return cp.returncode == 0 and "DOWN" not in cp.stdout

    def _run(self, argv: list[str], what: str, input_text: str | None = None) -> str:
        cp = subprocess.run(
            argv, env=self.env(), capture_output=True, text=True, check=False, input=input_text
        )
        if cp.returncode != 0:
            raise DaemonError(f"{what} failed: {' '.join(argv[:3])}: {cp.stderr.strip()}")
        return cp.stdout

    def _write_files(self) -> None:
        L, s = self.layout, self.spec
        for p in (L.root, L.etc, L.log, L.run, L.dev, L.bin, L.slurm_state, L.spool, L.colloc_var):
            p.mkdir(parents=True, exist_ok=True)
            p.chmod(0o755)
        for sub in ("evidence", "metrics"):
            (L.colloc_var / sub).mkdir(exist_ok=True)
        # munge: its dirs must belong to munge and not be writable by others
        L.munge.mkdir(mode=0o755, exist_ok=True)  # users reach the socket; key stays 0400
        key = L.munge / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for p in (L.munge, key):
            shutil.chown(p, "munge", "munge")
        # mariadb data dir
        (L.mysql).mkdir(exist_ok=True)
        shutil.chown(L.mysql, "mysql", "mysql")
        if not (L.mysql / "data" / "mysql").exists():
            self._run(
                [
                    "/usr/bin/mariadb-install-db", "--no-defaults", f"--datadir={L.mysql / 'data'}",
                    "--user=mysql", "--auth-root-authentication-method=socket",
                    "--skip-test-db",
                ],
                "initialising the MariaDB data directory",
            )
        # simulated GPUs: character devices gres.conf accepts (null devices)
        for n in s.node_plans():
            host = n.name if s.multi_node else None
            for i in range(n.gpus):
                dev = L.gpu_device(i, host)
                dev.parent.mkdir(parents=True, exist_ok=True)
                if not dev.exists():
                    os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        password = configs.new_password()
        (L.root / "db.password").write_text(password)
        (L.root / "db.password").chmod(0o600)
        version = slurm_release.installed_version()
        L.slurm_conf.write_text(configs.slurm_conf(s, L, self._node_scripts(), version))
        cgroup = slurm_release.cgroup_conf(version)
        if cgroup is not None:
            (L.etc / "cgroup.conf").write_text(cgroup)
        (L.etc / "gres.conf").write_text(configs.gres_conf(s, L))
        dbd = L.etc / "slurmdbd.conf"
        dbd.write_text(configs.slurmdbd_conf(s, L, password))
        dbd.chmod(0o600)
        tools.write_launchers(L.lab_bin)  # jobs find colloc-simjob here (env(): PATH)
        L.colloc_conf.write_text(configs.colloc_conf(s, L))
        self._install_site()
        self._init_sim()

    def _node_scripts(self) -> dict[str, Path]:
        """Wrappers for colloc's node scripts: the installed console scripts.

        The console scripts of the environment running colloc (``colloc-prolog``,
        ``colloc-task-prolog``, ``colloc-epilog``), so a wheel install is exercised
        exactly as a site wires it; Slurm gives node scripts no PATH, hence wrappers.
        """
        if not self.spec.node_scripts:
            return {}
        scripts = {
            "Prolog": self.venv_bin / "colloc-prolog",
            "TaskProlog": self.venv_bin / "colloc-task-prolog",
            "Epilog": self.venv_bin / "colloc-epilog",
        }
        out = {}
        for key, script in scripts.items():
            if not script.exists():
                raise DaemonError(f"{script} is missing: reinstall slurm-colloc (make venv)")
            wrapper = self.layout.bin / f"colloc-{key.lower()}"
            target = script if key == "TaskProlog" else self._script_client(key, script)
            wrapper.write_text(
                "#!/bin/sh\n# generated by colloc devcluster: Slurm gives node scripts no PATH\n"
                f"export COLLOC_CONF={self.layout.colloc_conf}\n"
                f"export SLURM_CONF={self.layout.slurm_conf}\n"
                f'exec {target} "$@"\n'
            )
            wrapper.chmod(0o755)
            out[key] = wrapper
        return out

    def _script_client(self, key: str, script: Path) -> Path:
        """Root's Prolog/Epilog as slurmd runs them on a site: the C client of the node's
        script server (issue 28: ~1 ms of CPU to hand over, where the Python client's
        interpreter took ~0.07 s; it raises itself to nice -5 from its first
        instruction), falling back to ``script`` (node.md "The script server")."""
        from slurm_colloc.node.script_client_build import BuildError, build

        try:
            return build(self.layout.bin / f"{script.name}-client", key.lower(), script)
        except BuildError as e:
            raise DaemonError(f"{key}: {e}") from e

    def _install_site(self) -> None:
        """The submit path (SPANK plugin, Lua filters) of slurm_colloc.site."""
        from slurm_colloc.config import load
        from slurm_colloc.site.install import install, settings_from_config

        settings = settings_from_config(load(self.layout.colloc_conf))
        install(self.layout.etc, self.layout.root / "lib", settings, force=True)

    def _init_sim(self) -> None:
        from slurm_colloc.gpu.sim.state import init_state

        if not self.spec.multi_node:
            init_state(
                self.layout.sim, gpu_count=self.spec.gpus, memory_mib=self.spec.gpu_memory_mib
            )
            return
        for n in self.spec.node_plans():  # each host's own GPUs, bound over layout.sim
            init_state(self.layout.node_dir(n.name) / "sim", gpu_count=n.gpus,
                       memory_mib=n.gpu_memory_mib)

    def _create_db_user(self) -> None:
        password = (self.layout.root / "db.password").read_text().strip()
        sql = (
            f"CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '{password}';\n"
            f"ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '{password}';\n"
            "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';\n"
            "FLUSH PRIVILEGES;\n"
        )
        self._run(
            ["/usr/bin/mariadb", "--no-defaults", "-S", str(self.layout.mysql_socket),
             "-u", "root"],
            "creating the slurm database user",
            input_text=sql,
        )

    def _register_accounting(self) -> None:
        s = self.spec
        deadline = time.monotonic() + 20
        while True:
            cp = subprocess.run(
                ["sacctmgr", "-i", "add", "cluster", s.cluster_name],
                env=self.env(), capture_output=True, text=True, check=False,
            )
            if cp.returncode == 0 or "already exists" in (cp.stdout + cp.stderr):
                break
            if time.monotonic() > deadline:
                raise DaemonError(
                    f"slurmdbd: cannot register cluster: {cp.stderr.strip()} "
                    f"(see {self.layout.log / 'slurmdbd.log'})"
                )
            time.sleep(0.3)
        subprocess.run(
            ["sacctmgr", "-i", "add", "account", "colloc", f"cluster={s.cluster_name}",
             "Description=devcluster", "Organization=colloc"],
            env=self.env(), capture_output=True, check=False,
        )
        self.add_user("root")

    def add_user(self, user: str) -> None:
        """Give a Unix user an association so accounting records its jobs."""
        subprocess.run(
            ["sacctmgr", "-i", "add", "user", user, "account=colloc",
             f"cluster={self.spec.cluster_name}"],
            env=self.env(), capture_output=True, check=False,
        )

    def _node_ready(self) -> bool:
        """Every compute host answers (idle, mixed or allocated)."""
        names = [n.name for n in self.spec.node_plans()]
        cp = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %t", "-n", ",".join(names)],
            env=self.env(), capture_output=True, text=True, check=False,
        )
        ready = {
            line.split()[0] for line in cp.stdout.splitlines()
            if len(line.split()) == 2
            and line.split()[1].rstrip("*") in ("idle", "mix", "alloc")
        }
        return cp.returncode == 0 and ready >= set(names)

    def _wait_node_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._node_ready():
                return
            time.sleep(0.2)
        node_log = self.layout.log / f"slurmd-{self.spec.node_plans()[-1].name}.log"
        raise DaemonError(
            f"slurmd: the compute hosts did not all become idle in {timeout:.0f}s; "
            f"see {node_log} and {self.layout.log / 'slurmctld.log'}:\n"
            f"{daemons.log_tail(node_log)}"
        )

    # ---------------------------------------------------------------- down
    def down(self, *, keep_logs: Path | None = None) -> list[str]:
        """Stop what we started, kill leftover job processes, remove the root dir."""
        stopped = []
        if self.layout.slurm_conf.exists() and daemons.running(self.daemons()[3]):
            with contextlib.suppress(OSError):
                subprocess.run(
                    ["scancel", "--full", "--state=RUNNING,PENDING,SUSPENDED",
                     "--user=" + "root"], env=self.env(), capture_output=True, timeout=20,
                    check=False,
                )
        for d in reversed(self.daemons()):
            if daemons.stop(d):
                stopped.append(d.name)
        self._kill_cluster_processes()
        if self.spec.multi_node:
            hosts.network_down(self.spec)
        if keep_logs is not None and self.layout.log.exists():
            shutil.copytree(self.layout.log, keep_logs, dirs_exist_ok=True)
        if self.layout.root.exists():
            shutil.rmtree(self.layout.root, ignore_errors=True)
        return stopped

    def _kill_cluster_processes(self) -> None:
        """Jobs, slurmstepds and MPS stand-ins of this cluster carry its SLURM_CONF."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = daemons.cluster_processes(
                "SLURM_CONF", str(self.layout.slurm_conf), str(self.layout.root)
            )
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            if not pids:
                return
            time.sleep(0.5)
