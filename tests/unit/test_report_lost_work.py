"""The report's "lost ~N min of work since the last checkpoint" for an OOM attempt: from
the newest file in the job's checkpoint directory written before the attempt ended, in
text, JSON and HTML; nothing when it is not known (no checkpoint before the OOM, the
feature off, the report not run as the job's user)."""

from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console

from slurm_colloc.accounting.codec import append_attempt
from slurm_colloc.accounting.record import Attempt, Estimate, MetricsSummary, OomInfo, Requeue
from slurm_colloc.config import CollocConfig
from slurm_colloc.report import html, text
from slurm_colloc.report import job as job_report
from slurm_colloc.report.inquirer import JobRow
from slurm_colloc.report.lost_work import estimate, lost_work_lines, newest_before
from tests.unit.test_report_build import SUB, Fake

START, END = 1_700_000_000, 1_700_000_000 + 3600


def _touch(p: Path, mtime: float) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("x")
    os.utime(p, (mtime, mtime))


def test_newest_before_walks_subdirectories_and_ignores_later_files_and_links(
    tmp_path: Path,
) -> None:
    _touch(tmp_path / "checkpoint-100" / "model.safetensors", START + 600)
    _touch(tmp_path / "checkpoint-200" / "optimizer.pt", START + 1800)
    _touch(tmp_path / "checkpoint-300" / "optimizer.pt", END + 60)  # the next attempt's
    outside = tmp_path.parent / "outside"
    _touch(outside, START + 3000)
    (tmp_path / "link").symlink_to(outside)
    assert newest_before(str(tmp_path), END) == START + 1800
    assert newest_before(str(tmp_path), START) is None
    assert newest_before(str(tmp_path / "missing"), END) is None


def test_estimate_as_the_jobs_user_only(tmp_path: Path) -> None:
    template = f"{tmp_path}/{{user}}/{{jobid}}"
    d = tmp_path / "root" / "77"  # these tests run as root: the job's user here is root
    _touch(d / "step-1.ckpt", START + 1500)
    got = estimate(template, "root", "77", START, END)
    assert got == {"checkpoint_dir": str(d), "last_checkpoint": START + 1500,
                   "lost_s": 2100}
    # a checkpoint older than the attempt: all of the attempt's work was lost
    assert estimate(template, "root", "77", START + 2000, END)["lost_s"] == 1600  # type: ignore[index]
    assert estimate(template, "nobody", "77", START, END) is None  # not the user: not read
    assert estimate("", "root", "77", START, END) is None  # feature off
    assert estimate(template, "root", "78", START, END) is None  # no directory
    assert estimate(template, "root", "77", START, None) is None  # end unknown
    assert estimate(template, "root", "77", START, START + 100) is None  # none before the OOM


def _world(tmp_path: Path) -> tuple[Fake, CollocConfig]:
    est = Estimate(6144, "layer-aware")
    oom = Attempt(0, est, shards=6, shard_mib=1024, limit_mib=6144, gpu=0, node="n0",
                  oom=OomInfo("gpu-oom", "torch-cuda-oom", "/ev/5/attempt0/x.out"),
                  requeue=Requeue(True, "GPU OOM with 6 shards", "gres:shard:40", 40960),
                  metrics=MetricsSummary(peak_mib=6100, samples=5), start=START, end=END)
    done = Attempt(1, est, shards=40, shard_mib=1024, limit_mib=40960, gpu=1, node="n0",
                   metrics=MetricsSummary(peak_mib=9000, samples=30), start=END + 60,
                   end=END + 1000)
    c0 = append_attempt(SUB, oom)
    rows = [JobRow(job_id="5", name="t", user="root", state="REQUEUED", exit_code="1:0",
                   elapsed_s=3600, node="n0", admin_comment=c0),
            JobRow(job_id="5", name="t", user="root", state="COMPLETED", exit_code="0:0",
                   elapsed_s=940, node="n0", admin_comment=append_attempt(c0, done))]
    _touch(tmp_path / "ck" / "5" / "last.pt", END - 240)
    cfg = CollocConfig(gpu_memory_mib=40960, shard_mib=1024,
                       checkpoint_dir=f"{tmp_path}/ck/{{jobid}}")
    return Fake(rows={"5": rows}), cfg


def test_the_report_says_what_the_oom_cost_in_text_json_and_html(tmp_path: Path) -> None:
    fake, cfg = _world(tmp_path)
    rep = job_report.build("5", fake, cfg)
    a0, a1 = rep.to_json()["attempts"]
    assert a0["lost_work"] == {"checkpoint_dir": f"{tmp_path}/ck/5",
                               "last_checkpoint": END - 240, "lost_s": 240}
    assert a1["lost_work"] is None  # it did not end in an OOM
    (line,) = lost_work_lines(rep.attempts)
    assert line.startswith("Attempt 0: lost ~4 min of work since the last checkpoint (saved ")
    c = Console(width=200, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    c.print(text.render(rep))
    assert "Attempt 0: lost ~4 min of work since the last checkpoint" in c.export_text()
    assert "Attempt 0: lost ~4 min of work since the last checkpoint" in html.render(rep)


def test_the_report_says_nothing_when_off(tmp_path: Path) -> None:
    fake, cfg = _world(tmp_path)
    cfg = CollocConfig(gpu_memory_mib=40960, shard_mib=1024)
    rep = job_report.build("5", fake, cfg)
    assert all(a.lost_work is None for a in rep.attempts)
    assert "lost" not in html.render(rep)
