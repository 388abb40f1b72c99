"""benchmarks/oom_audit.py: an OOM inside a reservation that held the job's peak is ours.

Issue 24 asks for none over three runs of each fair trace; the audit must tell that
apart from an under-guessed request (the job's) and from a full GPU under a policy that
limits nothing (plain shards), from the committed CSVs alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.bench_scripts import load


def _run(d: Path, rows: list[str]) -> None:
    d.mkdir(parents=True)
    (d / "t_jobs.csv").write_text(
        "policy,job,job_id,state,attempts,submit_h,start_h,end_h,oom_crashes,requeues,gres,"
        "need_mib,mode,first_gpu_h\n" + "\n".join(rows) + "\n")
    (d / "t_trace.csv").write_text("name,peak_mib\nj1,5000\nj2,5000\nj3,5000\n")


def test_the_audit_classes_each_oom_and_fails_only_on_one_inside(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mod = load("oom_audit")
    _run(tmp_path / "clean" / "run1", [
        "colloc,j1,1,COMPLETED,2,0,0,1,1,1,shard=4,4096,explicit,0.1",     # under-guessed
        "shards,j2,2,FAILED,1,0,0,1,1,0,shard=6,6144,,",                   # GPU full
        "colloc-oracle,j3,3,COMPLETED,1,0,0,1,0,0,shard=5,5120,oracle,0.1",
    ])
    assert mod.main([str(tmp_path / "clean")]) == 0  # type: ignore[attr-defined]
    out = capsys.readouterr().out
    assert "j1 (under-guessed: 4096 vs 5000)" in out and "j2 (unlimited" in out
    assert "inside a reservation at or above the true peak: 0" in out
    _run(tmp_path / "bad" / "run1", [
        "colloc-oracle,j3,3,COMPLETED,2,0,0,1,1,1,shard=5,5000,oracle,0.1",  # need == peak
    ])
    report = tmp_path / "audit.json"
    assert mod.main([str(tmp_path / "bad"), "--json", str(report)]) == 1  # type: ignore[attr-defined]
    assert '"class": "inside"' in report.read_text()
    assert mod.main([str(tmp_path / "empty")]) == 2  # type: ignore[attr-defined]
