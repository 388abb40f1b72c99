"""Security issue 11, finding H3: estimator history poisoning across users.

History used to be keyed by the model fingerprint only. The fingerprint reaches the
epilog from the job's record, and every part of that record is the user's to choose
(``COLLOC_ESTIMATOR_COMMAND`` picks the estimator program, ``job_submit`` accepts any hex
``fp``), so one user's job could file a peak under another user's model: measured, a
700 MiB job cut someone else's bert-base batch-32 estimate from 12,266 MiB to 735 MiB
(their jobs then OOM on a shared GPU), and a huge fake peak would push them onto whole
GPUs forever. History is now per user (the uid slurmd gave the prolog), and another
user's measurements are ignored (policy in ``slurm_colloc/estimators/history.py``).
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_colloc.accounting.record import MetricsSummary
from slurm_colloc.config import CollocConfig
from slurm_colloc.estimators import SqliteHistory, estimate, parse_summary, read_summary_file
from slurm_colloc.estimators.history import HistoryUnsafe
from slurm_colloc.metrics import store
from slurm_colloc.metrics.summary import record_history
from slurm_colloc.node.job import context_from_record
from slurm_colloc.node.metrics_launch import SPANK, meta_for

DATA = Path(__file__).parent / "data" / "summaries"
SUMMARY = DATA / "resnet50_torchinfo.txt"
ALICE, BOB = 41001, 41002


def _job(cfg: CollocConfig, job_id: int, uid: int, fp: str, batch: int = 32) -> None:
    """What the prolog (root) stores for an attempt: the uid comes from slurmd's
    SLURM_JOB_UID, the fingerprint from the job's (user-written) record."""
    rec = {"TresPerNode": "gres:shard:4", "GRES": "shard:4(IDX:0)",
           "AdminComment": f"colloc1:mode=estimate,need_mib=4096,shards=4,shard_mib=1024,"
                           f"est=layer-aware,est_mib=4096,fp={fp}"}
    ctx = context_from_record(job_id, uid, {}, rec)
    store.write_meta(cfg.metrics_dir, meta_for(ctx, cfg, {SPANK + "batch_size": str(batch)}))


def _cfg(tmp_path: Path) -> CollocConfig:
    return CollocConfig(metrics_dir=str(tmp_path / "m"), history_db=str(tmp_path / "h.sqlite"))


def test_h3_another_users_small_peak_does_not_lower_my_estimate(tmp_path: Path) -> None:
    """H3: Alice runs Bob's model (same fingerprint) with a tiny measured peak; Bob's
    estimate must not drop to it."""
    cfg = _cfg(tmp_path)
    text = SUMMARY.read_text()
    fp = parse_summary(text).fingerprint()
    cold = estimate(text, batch_size=32)
    _job(cfg, 501, ALICE, fp)
    assert record_history(cfg, 501, 0, MetricsSummary(peak_mib=700, samples=50),
                          succeeded=True).startswith("recorded")
    bob = estimate(text, batch_size=32, history=SqliteHistory(cfg.history_db, uid=BOB))
    assert bob.estimator == cold.estimator and bob.estimate_mib == cold.estimate_mib
    # a batch Bob never ran either: no anchoring on Alice's point
    assert estimate(text, batch_size=64, history=SqliteHistory(cfg.history_db, uid=BOB)
                    ).estimator == "layer-aware"
    # Alice's own reruns still use her measurement
    alice = estimate(text, batch_size=32, history=SqliteHistory(cfg.history_db, uid=ALICE))
    assert alice.estimator == "history" and alice.estimate_mib < cold.estimate_mib


def test_h3_another_users_huge_peak_does_not_raise_my_estimate(tmp_path: Path) -> None:
    """H3 (denial of service): a fake 80 GiB peak filed by Alice must not push Bob's
    jobs onto whole GPUs."""
    cfg = _cfg(tmp_path)
    text = SUMMARY.read_text()
    fp = parse_summary(text).fingerprint()
    cold = estimate(text, batch_size=32)
    _job(cfg, 502, ALICE, fp)
    record_history(cfg, 502, 0, MetricsSummary(peak_mib=80_000, samples=50), succeeded=True)
    bob = estimate(text, batch_size=32, history=SqliteHistory(cfg.history_db, uid=BOB))
    assert bob.estimate_mib == cold.estimate_mib


def test_h3_record_history_takes_the_uid_from_the_root_side_meta(tmp_path: Path) -> None:
    """H3: the owner is the uid slurmd gave the prolog (JobMeta.uid), and the epilog's
    own view of it (``uid=``) must agree; provenance is stored with the peak."""
    cfg = _cfg(tmp_path)
    fp = "ab" * 16
    _job(cfg, 503, ALICE, fp)
    summ = MetricsSummary(peak_mib=5000, samples=10)
    assert record_history(cfg, 503, 0, summ, succeeded=True, uid=BOB).startswith(
        "not recorded")
    assert SqliteHistory(cfg.history_db, uid=BOB).peaks(fp, None, "adam", "fp32") == {}
    assert record_history(cfg, 503, 0, summ, succeeded=True, uid=ALICE).startswith("recorded")
    assert SqliteHistory(cfg.history_db, uid=ALICE).peaks(fp, None, "adam", "fp32") == {32: 5000}
    prov = SqliteHistory(cfg.history_db).provenance(ALICE, fp)
    assert len(prov) == 1
    row = prov[0]
    assert (row["uid"], row["peak_job"], row["peak_attempt"], row["last_job"]) == (
        ALICE, "503", 0, "503")
    assert "job record" in str(row["fp_source"]) and "layer-aware" in str(row["fp_source"])
    assert float(row["updated"]) > 0  # type: ignore[arg-type]


def test_h3_store_is_per_uid(tmp_path: Path) -> None:
    """H3: the store itself keeps users apart (also ``lookup``)."""
    db = tmp_path / "h.sqlite"
    fp = "cd" * 16
    SqliteHistory(db).record(fp, 8, None, "adam", "fp32", 900, uid=ALICE, job_id="1")
    SqliteHistory(db).record(fp, 8, None, "adam", "fp32", 3000, uid=BOB, job_id="2")
    assert SqliteHistory(db, uid=ALICE).lookup(fp, 8, None, "adam", "fp32") == 900
    assert SqliteHistory(db, uid=BOB).lookup(fp, 8, None, "adam", "fp32") == 3000
    assert SqliteHistory(db, uid=BOB + 1).peaks(fp, None, "adam", "fp32") == {}


def test_h3_reader_defaults_to_the_callers_uid(tmp_path: Path) -> None:
    db = tmp_path / "h.sqlite"
    fp = "ef" * 16
    SqliteHistory(db).record(fp, 8, None, "adam", "fp32", 900, uid=os.getuid() + 1)
    assert SqliteHistory(db).peaks(fp, None, "adam", "fp32") == {}
    assert SqliteHistory(db).uid == os.getuid()


def test_h3_legacy_unowned_history_is_ignored_and_the_db_still_records(tmp_path: Path) -> None:
    """H3: an old database (no uid column) holds rows anyone could have poisoned: they
    are not used, and recording into the same file works."""
    db = tmp_path / "h.sqlite"
    text = SUMMARY.read_text()
    fp = parse_summary(text).fingerprint()
    con = sqlite3.connect(db)
    con.execute(
        "CREATE TABLE peaks (fingerprint TEXT NOT NULL, batch_size INTEGER NOT NULL, "
        "seq_len INTEGER NOT NULL, optimizer TEXT NOT NULL, precision TEXT NOT NULL, "
        "peak_mib INTEGER NOT NULL, runs INTEGER NOT NULL DEFAULT 1, last_job TEXT, "
        "updated REAL NOT NULL, PRIMARY KEY (fingerprint, batch_size, seq_len, optimizer, "
        "precision))")
    con.execute("INSERT INTO peaks VALUES (?,32,0,'adam','fp32',700,1,'9',1.0)", (fp,))
    con.commit()
    con.close()
    hist = SqliteHistory(db)
    assert hist.peaks(fp, None, "adam", "fp32") == {}
    assert hist.lookup(fp, 32, None, "adam", "fp32") is None
    assert estimate(text, batch_size=32, history=hist).estimator == "layer-aware"
    hist.record(fp, 32, None, "adam", "fp32", 9000, job_id="10")
    assert hist.peaks(fp, None, "adam", "fp32") == {32: 9000}


def test_h3_writable_or_foreign_db_is_not_trusted(tmp_path: Path) -> None:
    """H3: users read the root-written database at sbatch time; a copy others can
    write (or a directory others can write, where one could swap it) is not used, and
    root does not write through a symlink there."""
    d = tmp_path / "hist"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    db = d / "h.sqlite"
    fp = "12" * 16
    SqliteHistory(db).record(fp, 8, None, "adam", "fp32", 900)
    assert SqliteHistory(db).peaks(fp, None, "adam", "fp32") == {8: 900}
    assert db.stat().st_mode & 0o777 == 0o600  # every user's rows: root's only (issue 23)
    os.chmod(db, 0o666)
    assert SqliteHistory(db).peaks(fp, None, "adam", "fp32") == {}
    with pytest.raises(HistoryUnsafe):
        SqliteHistory(db).record(fp, 8, None, "adam", "fp32", 900)
    os.chmod(db, 0o644)
    os.chmod(d, 0o777)
    assert SqliteHistory(db).peaks(fp, None, "adam", "fp32") == {}
    os.chmod(d, 0o755)
    link = d / "link.sqlite"
    link.symlink_to(db)
    with pytest.raises(HistoryUnsafe):
        SqliteHistory(link).record(fp, 8, None, "adam", "fp32", 900)


def test_h3_record_history_reports_an_unsafe_db(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    _job(cfg, 504, ALICE, "ab" * 16)
    Path(cfg.history_db).write_text("")
    os.chmod(cfg.history_db, 0o666)
    out = record_history(cfg, 504, 0, MetricsSummary(peak_mib=5000, samples=10), succeeded=True)
    assert out.startswith("not recorded") and "unsafe" in out


def test_h3_estimate_cli_reads_only_the_callers_history(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """H3: ``colloc estimate`` runs as the submitting user (cli_filter) and computes the
    fingerprint itself from the summary file; it uses that user's history only."""
    from slurm_colloc.cli.estimate_cmd import estimate as estimate_cmd

    conf = tmp_path / "colloc.conf"
    db = tmp_path / "history.sqlite"
    conf.write_text(f'history_db = "{db}"\nhistory_source = "sqlite"\n')
    monkeypatch.setenv("COLLOC_CONF", str(conf))
    monkeypatch.setenv("COLLOC_FINGERPRINT", "00" * 16)  # nothing reads a fingerprint from env
    path = DATA / "keras2_cnn.txt"
    fp = read_summary_file(path).fingerprint()
    SqliteHistory(db).record(fp, 8, None, "adam", "fp32", 1234, uid=os.getuid() + 7)
    args = ["--summary", str(path), "--batch-size", "8", "--json"]
    out = json.loads(CliRunner().invoke(estimate_cmd, args).stdout)
    assert out["estimator"] == "layer-aware" and out["fingerprint"] == fp
    SqliteHistory(db).record(fp, 8, None, "adam", "fp32", 1234, uid=os.getuid())
    out = json.loads(CliRunner().invoke(estimate_cmd, args).stdout)
    assert out["estimator"] == "history"
