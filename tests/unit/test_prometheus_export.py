"""Prometheus export of the collector: text format, labels, removal of ended jobs, counters."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from slurm_colloc.config import CollocConfig, ConfigError, from_mapping
from slurm_colloc.gpu.backend import GpuInfo
from slurm_colloc.metrics import enforce, node_counters, store
from slurm_colloc.metrics.collector import GONE_AFTER_S, Collector
from slurm_colloc.metrics.prometheus_export import TextfileExporter, checked_dir
from tests.unit.conftest import Clock
from tests.unit.test_metrics_collector import make, register, spawn

GIB = 1 << 30


class _Gpus:
    """The one backend call the exporter makes (the GPUs' identities)."""

    def gpus(self) -> list[GpuInfo]:
        return [GpuInfo(index=i, uuid=f"GPU-{i}aaa", name="sim", memory_total_mib=40960)
                for i in range(2)]


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)], parsed by prometheus_client's own parser."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def cfg_for(tmp_path: Path) -> CollocConfig:
    return CollocConfig(metrics_dir=str(tmp_path / "metrics"),
                        prometheus_textfile=str(tmp_path / "textfile" / "colloc.prom"))


def meta(cfg: CollocConfig, job: int, attempt: int = 0, shards: int = 4) -> None:
    store.write_meta(cfg.metrics_dir, store.JobMeta(
        job_id=job, attempt=attempt, uid=os.getuid(), gpus=(1,), limit_mib=shards * 1024,
        shards=shards))


def row(gpu: int = 1, mem: float = 1500.0, sm: float | None = 55.0) -> store.Row:
    return store.Row(t=1.0, gpu=gpu, mem_mib=mem, mem_max_mib=int(mem), gpu_mem_mib=9000,
                     util_pct=70.0, sm_pct=sm, power_w=120.5)


def exporter(cfg: CollocConfig, clock: Clock | None = None) -> TextfileExporter:
    return TextfileExporter(cfg, _Gpus(), node="n7", clock=clock or Clock(),  # type: ignore[arg-type]
                            user_of=lambda uid: "alice")


def test_job_series_carry_labels_and_values(tmp_path: Path) -> None:
    cfg = cfg_for(tmp_path)
    meta(cfg, 42, attempt=1, shards=4)
    exp = exporter(cfg)
    exp.write({("42", 1): {1: row()}})
    path = Path(cfg.prometheus_textfile)
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o644 and st.st_uid == os.geteuid()
    got = samples(path.read_text())
    labels = {"jobid": "42", "user": "alice", "node": "n7", "gpu": "1", "uuid": "GPU-1aaa"}
    assert got["colloc_job_shards"] == [(labels, 4.0)]
    assert got["colloc_job_memory_limit_bytes"] == [(labels, 4 * GIB)]
    assert got["colloc_job_memory_used_bytes"] == [(labels, 1500.0 * (1 << 20))]
    assert got["colloc_job_gpu_sm_activity_percent"] == [(labels, 55.0)]
    assert got["colloc_job_gpu_utilization_percent"] == [(labels, 70.0)]
    assert got["colloc_job_gpu_power_watts"] == [(labels, 120.5)]
    assert got["colloc_job_attempt"] == [(labels, 1.0)]
    assert got["colloc_exporter_jobs"] == [({"node": "n7"}, 1.0)]
    assert "colloc_job_verdict" not in got
    assert not [p for p in path.parent.iterdir() if p.name != path.name]  # no temp left


def test_unmeasured_values_are_absent_not_zero(tmp_path: Path) -> None:
    cfg = cfg_for(tmp_path)
    meta(cfg, 5)
    got = samples(exporter(cfg).text({("5", 0): {1: row(sm=None)}}))
    assert "colloc_job_gpu_sm_activity_percent" not in got
    assert got["colloc_job_memory_used_bytes"][0][1] > 0


def test_job_without_meta_has_usage_but_no_size_or_user(tmp_path: Path) -> None:
    cfg = cfg_for(tmp_path)
    got = samples(exporter(cfg).text({("9", 0): {1: row()}}))
    assert "colloc_job_shards" not in got and "colloc_job_memory_limit_bytes" not in got
    assert got["colloc_job_memory_used_bytes"][0][0]["user"] == ""


def test_ended_job_disappears_from_the_file(tmp_path: Path) -> None:
    cfg = cfg_for(tmp_path)
    meta(cfg, 42)
    meta(cfg, 43)
    exp = exporter(cfg)
    exp.write({("42", 0): {1: row()}, ("43", 0): {1: row(mem=700.0)}})
    jobs = {lab["jobid"] for lab, _ in samples(Path(cfg.prometheus_textfile).read_text())
            ["colloc_job_memory_used_bytes"]}
    assert jobs == {"42", "43"}
    exp.write({("43", 0): {1: row(mem=700.0)}})
    got = samples(Path(cfg.prometheus_textfile).read_text())
    assert {lab["jobid"] for lab, _ in got["colloc_job_shards"]} == {"43"}
    exp.write({})
    got = samples(Path(cfg.prometheus_textfile).read_text())
    assert not [n for n in got if n.startswith("colloc_job_")]
    assert got["colloc_exporter_jobs"] == [({"node": "n7"}, 0.0)]


def test_verdicts_per_job_and_per_node(tmp_path: Path) -> None:
    cfg = cfg_for(tmp_path)
    meta(cfg, 42)
    for job, action in (("42", enforce.KILLED), ("40", enforce.KILLED), ("41", enforce.FLAGGED)):
        enforce.write_verdict(cfg.metrics_dir, enforce.Verdict(
            job_id=job, attempt=0, uid=os.getuid(), gpu=1, kind=enforce.OVER_LIMIT,
            peak_mib=9000, limit_mib=4096, first_seen=1.0, last_seen=2.0, action=action))
    got = samples(exporter(cfg).text({("42", 0): {1: row()}}))
    [(labels, value)] = got["colloc_job_verdict"]
    assert (labels["jobid"], labels["kind"], labels["action"], value) == (
        "42", "over_limit", "killed", 1.0)
    node = {(lab["kind"], lab["action"]): v for lab, v in got["colloc_verdicts"]}
    assert node == {("over_limit", "killed"): 2.0, ("over_limit", "flagged"): 1.0}


def test_epilog_counters_are_exported_as_counters(tmp_path: Path) -> None:
    cfg = cfg_for(tmp_path)
    got = samples(exporter(cfg).text({}))
    assert got["colloc_gpu_oom_total"] == [({"node": "n7"}, 0.0)]
    node_counters.bump(cfg.metrics_dir, {"gpu_oom": 1, "requeues": 1})
    node_counters.bump(cfg.metrics_dir, {"gpu_oom": 1, "requeues": 0, "bogus": 5})
    text = exporter(cfg).text({})
    assert "# TYPE colloc_gpu_oom_total counter" in text
    got = samples(text)
    assert got["colloc_gpu_oom_total"] == [({"node": "n7"}, 2.0)]
    assert got["colloc_requeues_total"] == [({"node": "n7"}, 1.0)]


def test_counters_file_is_roots_private_and_damage_reads_as_zero(tmp_path: Path) -> None:
    md = tmp_path / "metrics"
    assert node_counters.read(md) == {"gpu_oom": 0, "requeues": 0}
    node_counters.bump(md, {"requeues": 3})
    f = md / "collector" / node_counters.COUNTERS
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(f.parent).st_mode) == 0o700
    f.write_text('{"requeues": -4, "gpu_oom": "x"}')
    assert node_counters.read(md) == {"gpu_oom": 0, "requeues": 0}
    f.write_text("not json")
    assert node_counters.bump(md, {"gpu_oom": 1}) == {"gpu_oom": 1, "requeues": 0}


def test_concurrent_bumps_all_count(tmp_path: Path) -> None:
    md = tmp_path / "metrics"
    node_counters.bump(md, {})
    code = ("import sys; from slurm_colloc.metrics import node_counters as n\n"
            "for _ in range(20): n.bump(sys.argv[1], {'requeues': 1})")
    ps = [subprocess.Popen([sys.executable, "-c", code, str(md)], cwd=Path(__file__).parents[2])
          for _ in range(4)]
    assert all(p.wait(timeout=60) == 0 for p in ps)
    assert node_counters.read(md)["requeues"] == 80


def test_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(PermissionError):
        checked_dir(d)
    cfg = CollocConfig(metrics_dir=str(tmp_path / "m"), prometheus_textfile=str(d / "x.prom"))
    with pytest.raises(PermissionError):
        exporter(cfg).write({})
    assert not (d / "x.prom").exists()


def test_config_key_must_be_an_absolute_prom_path() -> None:
    ok = "/var/lib/ne/colloc.prom"
    assert from_mapping({"prometheus_textfile": ok}).prometheus_textfile == ok
    assert from_mapping({}).prometheus_textfile == ""
    for bad in ("colloc.prom", "/var/lib/ne/colloc.txt"):
        with pytest.raises(ConfigError, match="prometheus_textfile"):
            from_mapping({"prometheus_textfile": bad})


def test_collector_writes_the_file_each_step_and_drops_a_job_that_ended(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    cfg, backend, state = make(tmp_path)
    cfg = replace(cfg, prometheus_textfile=str(tmp_path / "textfile" / "colloc.prom"))
    meta(cfg, 77, shards=3)
    pid = spawn(procs, {"SLURM_JOB_ID": "77"})
    register(state, pid, 1, 2500, sm=40.0)
    clock = Clock(time.time())
    col = Collector(cfg, backend, clock=clock)
    col.step()
    assert set(col.latest) == {("77", 0)} and col.latest[("77", 0)][1].mem_mib == 2500
    got = samples(Path(cfg.prometheus_textfile).read_text())
    assert [(lab["jobid"], lab["gpu"], v) for lab, v in got["colloc_job_memory_used_bytes"]] == [
        ("77", "1", 2500.0 * (1 << 20))]
    assert [v for _, v in got["colloc_job_shards"]] == [3.0]
    assert got["colloc_job_shards"][0][0]["uuid"].startswith("GPU-")
    procs[0].kill()
    procs[0].wait()
    clock.t += GONE_AFTER_S + 1
    col.step()
    assert col.latest == {}
    got = samples(Path(cfg.prometheus_textfile).read_text())
    assert not [n for n in got if n.startswith("colloc_job_")]
    col.close()
