"""A real Prometheus scrapes a running shared job's GPU metrics, and the dashboard's
queries all parse there (Debian's prometheus and prometheus-node-exporter, which the
26.05 root filesystem installs: slurm_colloc/devcluster/rootfs.py).

node_exporter serves the collector's textfile (``prometheus_textfile`` in the
devcluster's colloc.conf) on loopback; Prometheus scrapes it every second. Both run as
plain processes (no systemd in the root filesystem) on ports derived from
``COLLOC_TEST_PORT_BASE`` and are killed at the end.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from slurm_colloc import config as cfgmod
from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.slurm.adapter import SlurmCli, wait_for_jobs
from tests.e2e.conftest import sbatch
from tests.unit.test_grafana_dashboard import concrete, exprs, load

pytestmark = pytest.mark.devcluster

_BASE = int(os.environ.get("COLLOC_TEST_PORT_BASE", "26810"))
EXPORTER_PORT = _BASE + 31
PROMETHEUS_PORT = _BASE + 32
T = TypeVar("T")


def _poll(what: str, fn: Callable[[], T | None], timeout: float) -> T:
    """``fn()`` until it returns something (not None), or fail saying what never came."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got is not None:
            return got
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout:.0f}s")


def _get(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:  # 400 for a query that does not parse
        return json.loads(e.read())
    except (OSError, ValueError):
        return None


def query(q: str) -> dict[str, Any]:
    """Prometheus's instant query API (its JSON answer; status "error" when unparsable)."""
    url = (f"http://127.0.0.1:{PROMETHEUS_PORT}/api/v1/query?"
           + urllib.parse.urlencode({"query": q}))
    got = _get(url)
    assert isinstance(got, dict), f"no answer from Prometheus for {q!r}"
    return got


def _series(q: str) -> list[dict[str, Any]] | None:
    got = _get(f"http://127.0.0.1:{PROMETHEUS_PORT}/api/v1/query?"
               + urllib.parse.urlencode({"query": q}))
    if not isinstance(got, dict) or got.get("status") != "success":
        return None
    return got["data"]["result"] or None


@pytest.fixture(scope="module")
def prometheus(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """node_exporter (textfile collector only) and Prometheus, on loopback, 1 s scrapes."""
    textfile = Path(cfgmod.load(cluster.layout.colloc_conf).prometheus_textfile)
    assert textfile.name, "the devcluster's colloc.conf sets prometheus_textfile"
    textfile.parent.mkdir(parents=True, exist_ok=True)
    textfile.parent.chmod(0o755)
    d = tmp_path_factory.mktemp("prometheus")
    (d / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: colloc-node\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{EXPORTER_PORT}']\n")
    logs = [open(d / n, "wb") for n in ("node-exporter.log", "prometheus.log")]  # noqa: SIM115
    procs = [
        subprocess.Popen(["prometheus-node-exporter", f"--web.listen-address=127.0.0.1:"
                          f"{EXPORTER_PORT}", "--collector.disable-defaults",
                          "--collector.textfile",
                          f"--collector.textfile.directory={textfile.parent}"],
                         stdout=logs[0], stderr=subprocess.STDOUT),
        subprocess.Popen(["prometheus", f"--config.file={d / 'prometheus.yml'}",
                          f"--storage.tsdb.path={d / 'data'}",
                          f"--web.listen-address=127.0.0.1:{PROMETHEUS_PORT}"],
                         stdout=logs[1], stderr=subprocess.STDOUT),
    ]
    try:
        _poll("Prometheus scraping node_exporter",
              lambda: _series(f'up{{instance="127.0.0.1:{EXPORTER_PORT}"}} == 1'), 60)
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
        for f in logs:
            f.close()


def test_prometheus_scrapes_a_running_shared_job_and_the_dashboard_parses(
    cluster: Cluster, slurm: SlurmCli, workdir: Path, prometheus: None
) -> None:
    cfg = cfgmod.load(cluster.layout.colloc_conf)
    job = sbatch(cluster, workdir, "colloc-simjob --mem 2G --seconds 120", "--gres=shard:4")
    try:
        sel = f'{{jobid="{job}"}}'
        shards = _poll(f"job {job}'s series in Prometheus",
                       lambda: _series(f"colloc_job_shards{sel}"), 60)
        [s] = shards
        labels = s["metric"]
        assert labels["user"] == "root" and labels["node"] and labels["uuid"].startswith("GPU-")
        assert labels["job"] == "colloc-node", "the scrape's job label is left alone"
        assert float(s["value"][1]) == 4
        [limit] = _poll("limit", lambda: _series(f"colloc_job_memory_limit_bytes{sel}"), 10)
        assert float(limit["value"][1]) == 4 * cfg.shard_mib * (1 << 20)
        used = _poll("memory used", lambda: _series(
            f"colloc_job_memory_used_bytes{sel} > 0"), 30)
        assert 0 < float(used[0]["value"][1]) <= 4 * cfg.shard_mib * (1 << 20)
        assert _series(f"colloc_job_attempt{sel}") is not None
        assert _series('colloc_gpu_oom_total') and _series('colloc_requeues_total')
        # the dashboard loads: every query of every panel (and variable) parses and runs
        assert query("sum by (").get("status") == "error", "a broken query would be caught"
        for e in exprs(load()):
            m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", e)
            q = f"group by ({m.group(2)}) ({m.group(1)})" if m else concrete(e)
            got = query(q)
            assert got.get("status") == "success", (e, got.get("error"))
        assert _series(f'sum by (jobid) (colloc_job_memory_used_bytes{sel}) / sum by (jobid) '
                       f'(colloc_job_memory_limit_bytes{sel})')
    finally:
        slurm.cancel([job])
        wait_for_jobs(slurm, [job], timeout=60)
    # the job's series leave the file when its processes are gone (GONE_AFTER_S), and
    # Prometheus marks them stale on the next scrape
    _poll(f"job {job}'s series gone", lambda: None if _series(
        f"colloc_job_shards{{jobid=\"{job}\"}}") else True, 30)
