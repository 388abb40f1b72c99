"""colloc-report on the devcluster, read the way a person reads it: the HTML page of a
recovered job and of a running job rendered by headless Chromium (screenshots kept in
``.pytest_cache/report-screenshots/``), an array job by task id and as a table, and
the job table of the period (reportseff-like), all as the shipped ``colloc-report``.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from slurm_colloc.devcluster.cluster import Cluster
from slurm_colloc.report import html as html_mod
from slurm_colloc.slurm.adapter import SlurmCli, job_state, wait_for_jobs
from tests.e2e.conftest import sbatch
from tests.unit.test_report_browser import SHOTS, _browser, _colour_count, _run, read_png

pytestmark = pytest.mark.devcluster


def report(cluster: Cluster, *args: str) -> tuple[int, str, str]:
    cp = subprocess.run([str(cluster.venv_bin / "colloc-report"), *args], env=cluster.env(),
                        capture_output=True, text=True, check=False, timeout=90)
    return cp.returncode, cp.stdout, cp.stderr


def _wait_report(cluster: Cluster, slurm: SlurmCli, job: int, attempts: int,
                 timeout: float = 240) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    d: dict[str, Any] = {}
    while time.monotonic() < deadline:
        state = job_state(slurm, job)
        rc, out, _ = report(cluster, str(job), "--json")
        d = json.loads(out) if rc in (0, 3) and out.strip() else {}
        a = d.get("attempts", [])
        if (len(a) == attempts and a and a[-1].get("samples") and not d.get("running")
                and state in ("COMPLETED", "FAILED")):
            return d
        time.sleep(2)
    raise AssertionError(f"job {job}: no complete report: {d}")


def _render(page: Path, name: str) -> str:
    browser = _browser()
    SHOTS.mkdir(parents=True, exist_ok=True)
    dom = _run(browser, "--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    png = SHOTS / f"e2e-{name}.png"
    png.unlink(missing_ok=True)
    shot = _run(browser, f"--screenshot={png}", "--window-size=1200,2000", page.as_uri())
    assert shot.returncode == 0 and png.is_file(), shot.stderr[-2000:]
    _, _, rows = read_png(png)
    assert _colour_count(rows, html_mod.C_MEM, 20) > 100  # the memory line is drawn
    return dom.stdout


def test_recovered_and_running_jobs_render_in_a_browser(
    cluster: Cluster, slurm: SlurmCli, workdir: Path, tmp_path: Path
) -> None:
    oom = sbatch(cluster, workdir, "colloc-simjob --mem 3G --peak 9G --peak-at 0.3 "
                 "--sm-activity 50 --seconds 10", "--gres=shard:6")
    run = sbatch(cluster, workdir, "colloc-simjob --mem 2G --sm-activity 20 --seconds 90",
                 "--gres=shard:4")
    d = _wait_report(cluster, slurm, oom, 2)
    assert d["schema_version"] >= 2 and d["attempts"][0]["oom"]["cause"] == "gpu-oom"
    page = tmp_path / "oom.html"
    rc, _, err = report(cluster, str(oom), "--html", str(page))
    assert rc == 0, err
    dom = _render(page, "recovered")
    assert re.findall(r'data-plot="(\w+)"', dom) == ["memory", "activity", "tenants"] * 2
    assert "Elapsed" in dom and "Request" in dom and "shard" in dom

    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # running, with a few samples
        rc, out, _ = report(cluster, str(run), "--json")
        r = json.loads(out) if rc == 0 else {}
        if r.get("running") and r["attempts"] and r["attempts"][-1].get("samples", 0) >= 2:
            break
        time.sleep(2)
    assert r.get("running"), r
    assert r["attempts"][-1]["limit_mib"] == 4096  # the submit record's, not "?"
    page = tmp_path / "run.html"
    rc, _, err = report(cluster, str(run), "--html", str(page))
    assert rc == 0, err
    dom = _render(page, "running")
    assert 'class="run"' in dom and "RUNNING" in dom
    rc, text, _ = report(cluster, str(run))
    assert "of 4.0 GiB (limit)" in text  # the peak against the job's limit, not the GPU
    slurm.cancel([run])
    wait_for_jobs(slurm, [run], timeout=60)


def test_array_tasks_and_the_job_table(cluster: Cluster, slurm: SlurmCli,
                                       workdir: Path) -> None:
    arr = sbatch(cluster, workdir, "colloc-simjob --mem 1G --sm-activity 20 --seconds 6",
                 "--gres=shard:2", "--array=0-1")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if job_state(slurm, arr) in ("COMPLETED", "FAILED", "CANCELLED"):
            rc, out, _ = report(cluster, str(arr), "--json")
            table = json.loads(out).get("table", []) if rc == 0 else []
            if len(table) == 2 and all(t["peak_mib"] for t in table):
                break
        time.sleep(2)
    assert [t["job_id"] for t in table] == [f"{arr}_0", f"{arr}_1"], table
    rc, out, err = report(cluster, f"{arr}_1", "--json")
    assert rc == 0, err
    one = json.loads(out)
    assert one["job_id"] == f"{arr}_1" and one["attempts"][0]["peak_mib"] >= 1000
    rc, out, err = report(cluster, "--since", "now-1hour", "--state", "CD", "--json")
    assert rc == 0, err
    period = json.loads(out)
    assert period["schema_version"] >= 2 and f"{arr}_0" in [t["job_id"] for t in period["table"]]
    assert all(t["state"] == "COMPLETED" for t in period["table"])
    rc, out, _ = report(cluster, "987654_1")
    assert rc == 2
