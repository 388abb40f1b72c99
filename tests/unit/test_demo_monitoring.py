"""The demo's monitoring scene reads the exporter's textfile as Prometheus would."""

from __future__ import annotations

from pathlib import Path

from slurm_colloc.demo_monitoring import snapshot_table, textfile_rows

TEXT = """\
# HELP colloc_job_shards Shards of a GPU the job holds.
# TYPE colloc_job_shards gauge
colloc_job_shards{jobid="12",user="alice",node="n0",gpu="0",uuid="GPU-a"} 8.0
colloc_job_shards{jobid="13",user="bob",node="n0",gpu="0",uuid="GPU-a"} 4.0
# HELP colloc_job_memory_limit_bytes The job's MPS memory limit on the GPU.
# TYPE colloc_job_memory_limit_bytes gauge
colloc_job_memory_limit_bytes{jobid="12",user="alice",node="n0",gpu="0",uuid="GPU-a"} 8.053063680e+09
# HELP colloc_gpu_oom_total GPU OOMs seen by the epilog.
# TYPE colloc_gpu_oom_total counter
colloc_gpu_oom_total 3.0
"""


def test_rows_per_job_and_gpu_with_only_the_shown_metrics(tmp_path: Path) -> None:
    p = tmp_path / "colloc.prom"
    p.write_text(TEXT)
    rows = textfile_rows(p)
    assert [(j, u, g) for j, u, g, _ in rows] == [("12", "alice", "0"), ("13", "bob", "0")]
    assert rows[0][3] == {"colloc_job_shards": 8.0, "colloc_job_memory_limit_bytes": 8053063680.0}
    assert rows[1][3] == {"colloc_job_shards": 4.0}


def test_absent_or_empty_file_gives_no_table(tmp_path: Path) -> None:
    assert textfile_rows(tmp_path / "missing.prom") == []
    (tmp_path / "empty.prom").write_text("")
    assert snapshot_table(tmp_path / "empty.prom") is None
    p = tmp_path / "c.prom"
    p.write_text(TEXT)
    table = snapshot_table(p)
    assert table is not None and table.row_count == 2
