"""A measured run feeds the estimator: the rerun's estimate is tighter and still safe."""

from __future__ import annotations

from pathlib import Path

from slurm_colloc.accounting.record import MetricsSummary
from slurm_colloc.config import CollocConfig
from slurm_colloc.estimators import SqliteHistory, estimate, parse_summary
from slurm_colloc.metrics import store
from slurm_colloc.metrics.summary import record_history
from slurm_colloc.node.job import context_from_record
from slurm_colloc.node.metrics_launch import SPANK, meta_for

SUMMARY = Path(__file__).parent / "data" / "summaries" / "resnet50_torchinfo.txt"


def test_rerun_is_estimated_from_the_measured_peak(tmp_path: Path) -> None:
    cfg = CollocConfig(metrics_dir=str(tmp_path / "m"), history_db=str(tmp_path / "h.sqlite"))
    text = SUMMARY.read_text()
    fp = parse_summary(text).fingerprint()
    hist = SqliteHistory(cfg.history_db, uid=1000)  # the job owner's view (history is per user)
    first = estimate(text, batch_size=32, history=hist)
    assert first.estimator != "history"
    # the prolog's view of the job: job_submit's record + the SPANK options
    rec = {"TresPerNode": "gres:shard:20", "GRES": "shard:20(IDX:1)",
           "AdminComment": f"colloc1:mode=estimate,need_mib={first.estimate_mib},shards=20,"
                           f"shard_mib=1024,est=layer-aware,est_mib={first.estimate_mib},fp={fp}"}
    ctx = context_from_record(77, 1000, {}, rec)
    env = {SPANK + "batch_size": "32", SPANK + "optimizer": "(null)"}
    store.write_meta(cfg.metrics_dir, meta_for(ctx, cfg, env))
    measured = int(first.estimate_mib * 0.8)
    summ = MetricsSummary(peak_mib=measured, samples=120)

    assert record_history(cfg, 77, 0, summ, succeeded=False).startswith("not recorded")
    assert hist.lookup(fp, 32, None, "adam", "fp32") is None
    assert record_history(cfg, 77, 0, summ, succeeded=True).startswith("recorded")

    rerun = estimate(text, batch_size=32, history=hist)
    assert rerun.estimator == "history"
    assert measured <= rerun.estimate_mib < first.estimate_mib  # safe, and tighter
    # other inputs are other keys: a bigger batch is not estimated from this run
    assert estimate(text, batch_size=64, history=hist).estimator != "history"


def test_no_fingerprint_or_no_samples_records_nothing(tmp_path: Path) -> None:
    cfg = CollocConfig(metrics_dir=str(tmp_path / "m"), history_db=str(tmp_path / "h.sqlite"))
    ctx = context_from_record(5, 1000, {}, {"TresPerNode": "gres:shard:4", "GRES": "shard:4(IDX:0)"})
    store.write_meta(cfg.metrics_dir, meta_for(ctx, cfg, {SPANK + "batch_size": "8"}))
    assert "no model fingerprint" in record_history(
        cfg, 5, 0, MetricsSummary(peak_mib=100, samples=3), succeeded=True)
    assert "no measurement" in record_history(cfg, 5, 0, None, succeeded=True)
    assert not Path(cfg.history_db).exists()


def test_untrusted_spank_values_are_sanitised(tmp_path: Path) -> None:
    cfg = CollocConfig(metrics_dir=str(tmp_path))
    ctx = context_from_record(5, 1000, {}, {"TresPerNode": "gres:shard:4", "GRES": "shard:4(IDX:0)"})
    m = meta_for(ctx, cfg, {SPANK + "batch_size": "32; rm -rf /", SPANK + "optimizer": "AdamW",
                            SPANK + "precision": "../../x", SPANK + "seq_len": "512"})
    assert (m.batch_size, m.optimizer, m.precision, m.seq_len) == (None, "adamw", None, 512)
    assert m.limit_mib == 4096 and m.gpus == (0,)
