"""The product as a site installs it: a non-editable wheel in a clean venv.

Every other test imports the checkout (``pip install -e``), which hides files the wheel
leaves out (``slurm_colloc/gpu`` once lacked ``__init__.py`` and the node scripts died
on every site with ModuleNotFoundError). Here the wheel is built from a copy of the
working tree, installed into a fresh venv, and that venv alone runs a small devcluster
of its own: Slurm's Prolog/TaskProlog/Epilog are the wheel's console scripts, and a
job that overruns its MPS limit must be requeued on a whole GPU, complete, and show
both attempts in the wheel's ``colloc-report``. The wheel is the runtime only (no
``lab`` extra): no simulation tool on PATH, no lab module imported by its commands, and
``colloc devcluster``/``demo`` refused in one line naming the extra; the cluster is
driven through the lab's Python API, and its jobs find the lab's own ``colloc-simjob``.

The cluster has its own root and ports (368xx) so that the shared test cluster, the
demo cluster and restart tests (468xx) keep running beside it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.devcluster

ROOT = Path(__file__).resolve().parents[2]
# not under /root: Slurm runs the node scripts and jobs run this venv's python (the lab's
# colloc-simjob launcher names it), possibly as other users, so every directory on the
# way must be world-executable
VENV = Path(os.environ.get("COLLOC_WHEEL_VENV", "/opt/colloc-wheel-test-venv"))
CLUSTER_ROOT = Path(os.environ.get("COLLOC_WHEEL_TEST_ROOT", "/var/lib/colloc-wheel-test"))
_BASE = int(os.environ.get("COLLOC_WHEEL_TEST_PORT_BASE", "28810"))
PORTS = {"ctld_port": _BASE + 7, "slurmd_port": _BASE + 8, "dbd_port": _BASE + 9,
         "mysql_port": _BASE - 3500}
CLEAN_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": "/root",
             "LANG": "C.UTF-8"}


def _run(argv: list[str], *, env: dict[str, str] | None = None, timeout: float = 300,
         cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    # cwd outside the checkout: `python -c` puts the cwd first on sys.path, and the
    # checkout's slurm_colloc would then shadow the wheel's
    return subprocess.run(argv, env=env or CLEAN_ENV, cwd=cwd or "/", capture_output=True,
                          text=True, timeout=timeout, check=False)


def _ok(cp: subprocess.CompletedProcess[str]) -> str:
    assert cp.returncode == 0, f"{cp.args}: rc={cp.returncode}\n{cp.stdout}\n{cp.stderr}"
    return cp.stdout


def _copy_tree(dest: Path) -> None:
    """The working tree without build outputs (a stale build/lib would enter the wheel)."""
    cp = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                        capture_output=True, check=False)
    if cp.returncode != 0:
        shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(
            ".venv", "build", "*.egg-info", ".git", "__pycache__", ".*_cache"))
        return
    for rel in filter(None, cp.stdout.decode().split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel and its runtime dependencies, nothing else.

    pip reaches what this machine's pip configuration names (the Makefile installs the
    dev venv the same way); build isolation fetches setuptools/wheel from there too.
    """
    tmp = tmp_path_factory.mktemp("wheel")
    src, dist = tmp / "src", tmp / "dist"
    _copy_tree(src)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    env = {**os.environ, "PIP_NO_INPUT": "1"}
    env.pop("PYTHONPATH", None)
    _ok(_run([*pip, "wheel", "--no-deps", "-q", "-w", str(dist), str(src)], env=env))
    (wheel,) = dist.glob("slurm_colloc-*.whl")
    shutil.rmtree(VENV, ignore_errors=True)
    _ok(_run(["/usr/bin/python3", "-m", "venv", str(VENV)]))
    VENV.chmod(0o755)
    _ok(_run([str(VENV / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
              str(wheel)], env={**env, "PIP_NO_INPUT": "1"}))
    return VENV


def _script_servers_of(venv: Path) -> list[int]:
    """Pids of script servers (slurm_colloc.node.script_server) run by ``venv``'s python."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes() if entry.name.isdigit() else b""
        except OSError:
            continue
        if b"slurm_colloc.node.script_server" in cmd and str(venv).encode() in cmd:
            out.append(int(entry.name))
    return out


def test_console_scripts_and_modules_come_from_the_wheel(venv: Path) -> None:
    b = venv / "bin"
    for argv in (["colloc", "--help"], ["colloc", "admin", "--help"],
                 ["colloc-report", "--help"], ["colloc", "admin", "install", "--help"]):
        _ok(_run([str(b / argv[0]), *argv[1:]]))
    version = _ok(_run([str(b / "python"), "-c",
                        "import slurm_colloc; print(slurm_colloc.__version__)"])).strip()
    for name in ("colloc", "colloc-report"):
        assert _ok(_run([str(b / name), "--version"])).strip() == f"{name}, version {version}"
    # Slurm starts the prolog with almost no environment; it must never fail the job
    prolog = _run([str(b / "colloc-prolog")], env={})
    assert prolog.returncode == 0, prolog.stderr
    time.sleep(1)  # a detached start would be running by now
    assert not _script_servers_of(venv), "a prolog run by hand left a script server behind"
    out = _ok(_run([str(b / "python"), "-c",
                    "import slurm_colloc, slurm_colloc.gpu.sim, slurm_colloc.selftest, "
                    "slurm_colloc.mps.v3; print(slurm_colloc.__file__)"]))
    assert out.strip().startswith(str(venv)), out  # not the checkout
    pkg = Path(out.strip()).parent
    assert (pkg / "site" / "lua" / "job_submit.lua").is_file()
    assert (pkg / "site" / "spank" / "colloc_spank.c").is_file()


SIM_TOOLS = ("colloc-simjob", "colloc-sim-mps-control", "colloc-sim-mps-control-v3")
LAB = ("slurm_colloc.devcluster", "slurm_colloc.bench", "slurm_colloc.demo",
       "slurm_colloc.gpu.sim", "numpy", "pandas", "matplotlib")
# the runtime's entry points, each run as a site runs it, then the lab modules it loaded
_NO_LAB = """
import runpy, sys
from importlib.metadata import entry_points
eps = {e.name: e for e in entry_points(group="console_scripts")
       if e.value.startswith("slurm_colloc")}
print(sorted(eps))
for name, argv in (("colloc", ["--help"]), ("colloc", ["--version"]),
                   ("colloc", ["estimate", "--help"]), ("colloc", ["admin", "--help"]),
                   ("colloc-report", ["--help"]), ("colloc-prolog", [])):
    sys.argv = [name, *argv]
    try:
        eps[name].load()()
    except SystemExit:
        pass
print("LAB", sorted(m for m in sys.modules if m.startswith(%r)))
"""


def test_the_runtime_wheel_puts_no_simulation_tool_on_path_and_imports_no_lab(
    venv: Path,
) -> None:
    """issue 26 item 7: a site's install is the runtime; the lab stays out of it."""
    b = venv / "bin"
    assert not [t for t in SIM_TOOLS if (b / t).exists()], sorted(p.name for p in b.iterdir())
    env = {**CLEAN_ENV, "PATH": f"{b}:{CLEAN_ENV['PATH']}"}
    for tool in SIM_TOOLS:
        assert _run(["/bin/sh", "-c", f"command -v {tool}"], env=env).returncode != 0, tool
    out = _ok(_run([str(b / "python"), "-c", _NO_LAB % (LAB,)], env=env)).splitlines()
    assert out[0] == str(["colloc", "colloc-epilog", "colloc-prolog", "colloc-report",
                          "colloc-task-prolog"]), out[0]
    assert out[-1] == "LAB []", out[-1]
    # the lab's commands: one line naming the extra, never an ImportError traceback
    for argv in (["devcluster", "up"], ["demo"]):
        cp = _run([str(b / "colloc"), *argv], env=env)
        assert cp.returncode == 2 and "Traceback" not in cp.stderr, cp.stderr
        assert "pip install 'slurm-colloc[lab]'" in cp.stderr, cp.stderr
        assert cp.stderr.count("\n") == 1, cp.stderr


def _cluster_py(venv: Path, code: str, timeout: float = 300) -> str:
    """Run devcluster code in the wheel's python (so venv_bin is the wheel's bin)."""
    return _ok(_run([str(venv / "bin" / "python"), "-c", _CLUSTER_HEAD + code],
                    timeout=timeout))


_CLUSTER_HEAD = ("import json, logging, sys\nfrom pathlib import Path\n"
                 "from slurm_colloc.devcluster.cluster import Cluster\n"
                 "from slurm_colloc.devcluster.layout import Layout, Spec\n"
                 "logging.basicConfig(level=logging.INFO)\n")


@pytest.fixture(scope="module")
def wheel_cluster(venv: Path) -> Iterator[dict[str, str]]:
    """The wheel venv's own devcluster; its Slurm environment. Always torn down."""
    if os.geteuid() != 0:
        pytest.fail("the wheel test starts its own devcluster and needs root")
    # the lab's Python API (the wheel carries its code; `colloc devcluster` asks for the
    # lab extra this runtime-only venv leaves out): the cluster still runs the wheel's
    # node scripts, and the lab writes its own colloc-simjob launcher (<root>/lab-bin)
    at = f"Cluster.at(Path({str(CLUSTER_ROOT)!r}))"
    _run([str(venv / "bin" / "python"), "-c", _CLUSTER_HEAD + f"{at}.down()"],
         timeout=120)  # leftovers of an interrupted run
    spec = f"Spec(gpus=2, **{PORTS!r})"
    try:
        _cluster_py(venv, f"Cluster(Layout(Path({str(CLUSTER_ROOT)!r})), {spec}).up(timeout=90)")
        env = json.loads(_cluster_py(venv, f"print(json.dumps({at}.env()))"))
        yield env
    finally:
        keep = ROOT / ".pytest_cache" / "wheel-devcluster-logs"
        cp = _run([str(venv / "bin" / "python"), "-c",
                   _CLUSTER_HEAD + f"{at}.down(keep_logs=Path({str(keep)!r}))"], timeout=120)
        _stop_leftovers()
        assert cp.returncode == 0, cp.stderr


def _stop_leftovers() -> None:
    """End this cluster's node-side helpers that ``down`` leaves (the metrics collector
    the prolog starts has no SLURM_JOB_ID, so down does not count it as a job process);
    only processes whose environment names this cluster's slurm.conf."""
    needle = f"SLURM_CONF={CLUSTER_ROOT}/etc/slurm.conf".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), 15)
        except (OSError, ProcessLookupError):
            continue


def _squeue_done(env: dict[str, str], job: int) -> bool:
    cp = _run(["squeue", "-h", "-j", str(job), "-o", "%T"], env=env)
    return cp.returncode == 0 and cp.stdout.strip() == ""


def test_wheel_cluster_requeues_an_oom_on_a_whole_gpu_and_reports_both(
    venv: Path, wheel_cluster: dict[str, str]
) -> None:
    env = wheel_cluster
    conf = _ok(_run(["scontrol", "show", "config"], env=env))
    # 23.02+ prints several scripts per key as Prolog[0], Prolog[1]: ours is the first
    wired = {k.strip().removesuffix("[0]"): v.strip() for k, v in
             (ln.split("=", 1) for ln in conf.splitlines() if "=" in ln)}
    for key, name in (("Prolog", "colloc-prolog"), ("TaskProlog", "colloc-task-prolog"),
                      ("Epilog", "colloc-epilog")):
        path = Path(wired[key])
        # the script itself, or the devcluster's wrapper that execs it with SLURM_CONF set,
        # or (Prolog, Epilog) execs the C client built from the wheel's source, which
        # falls back to the wheel's script (node/script_client.c, issue 28)
        text = path.read_text()
        client = re.search(r'^exec (/\S+-client) "\$@"$', text, re.M)
        if client and key != "TaskProlog":
            built = Path(client.group(1)).read_bytes()
            assert f"colloc-script-client fallback={venv}/bin/{name}".encode() in built, key
            continue
        assert path == venv / "bin" / name or f"{venv}/bin/{name}" in text, key
    jobs = CLUSTER_ROOT / "jobs"
    jobs.mkdir(mode=0o1777, exist_ok=True)
    jobs.chmod(0o1777)
    script = jobs / "oom.sh"
    script.write_text("#!/bin/bash\necho attempt=${SLURM_RESTART_COUNT:-0} "
                      "LIMIT=$CUDA_MPS_PINNED_DEVICE_MEM_LIMIT\n"
                      'echo "SIMJOB=$(command -v colloc-simjob)"\n'
                      "colloc-simjob --mem 3G --peak 9G --peak-at 0.3 --seconds 2\n")
    script.chmod(0o755)
    out = _ok(_run(["sbatch", "--parsable", f"--chdir={jobs}", f"--output={jobs}/%j.out",
                    "--gres=shard:6", str(script)], env=env))
    job = int(out.strip().split(";")[0])

    deadline = time.monotonic() + 150
    report: dict[str, object] = {}
    while time.monotonic() < deadline:
        time.sleep(2)
        if not _squeue_done(env, job):
            continue
        cp = _run([str(venv / "bin" / "colloc-report"), str(job), "--json"], env=env,
                  timeout=60)
        report = json.loads(cp.stdout) if cp.returncode in (0, 3) and cp.stdout else {}
        atts = report.get("attempts") or []
        assert isinstance(atts, list)
        if len(atts) == 2 and atts[-1].get("samples") and not report.get("running"):
            break
    else:
        log = (CLUSTER_ROOT / "log" / "colloc.log")
        pytest.fail(f"job {job}: no two-attempt report: {report}\n"
                    f"{log.read_text()[-3000:] if log.exists() else ''}")
    assert report["state"] == "COMPLETED"
    atts = report["attempts"]
    assert isinstance(atts, list)
    a0, a1 = atts
    assert a0["oom"]["cause"] == "gpu-oom" and a0["requeue"]["requeued"]
    assert a1["limit_mib"] > a0["limit_mib"]  # the whole GPU's shards the second time
    final = (jobs / f"{job}.out").read_text()
    assert "attempt=1" in final
    # the lab's launcher, not the wheel's bin (which has none)
    assert f"SIMJOB={CLUSTER_ROOT}/lab-bin/colloc-simjob\n" in final, final
    text = _ok(_run([str(venv / "bin" / "colloc-report"), str(job)], env=env, timeout=60))
    assert str(job) in text
