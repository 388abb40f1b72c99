"""Issue 25 item 2: compute admission (expected SM activity as a second dimension of shards).

Three tiers: the table root builds from accounting records (pure), the file it writes,
and job_submit.lua reading it inside (a fake) slurmctld.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from slurm_colloc.accounting import Attempt, Estimate, MetricsSummary, OomInfo, append_attempt
from slurm_colloc.accounting import compute_history as ch
from slurm_colloc.accounting.submit_record import parse_record
from slurm_colloc.config import ConfigError, from_mapping
from slurm_colloc.slurm import sacct_json
from tests.unit.test_lua_job_submit import SETTINGS, Harness

FP = "ab" * 16
OTHER_FP = "cd" * 16


def _attempt(sm: float | None, *, fp: str = FP, oom: bool = False, samples: int = 50,
             n: int = 0) -> Attempt:
    return Attempt(
        attempt=n,
        estimate=Estimate(9000, "layer-aware", 1000, fp, batch_size=32, seq_len=None,
                          optimizer=None, precision=None),
        oom=OomInfo("gpu-oom", "torch-cuda-oom") if oom else None,
        metrics=MetricsSummary(peak_mib=8000, samples=samples, mean_sm_activity=sm,
                               dcgm=True),
    )


def _row(job_id: int, user: str | None, *attempts: Attempt, state: str = "COMPLETED"):
    s: str | None = "colloc1:mode=estimate,need_mib=9000,shards=9,shard_mib=1024"
    for a in attempts:
        s = append_attempt(s, a)
    job = {"job_id": job_id, "name": "train", "user": user, "state": {"current": [state]},
           "comment": {"administrator": (s or "").lower()}}
    import json
    return sacct_json.parse(json.dumps({"meta": {}, "errors": [], "jobs": [job]}))[0]


UIDS = {"alice": 1001, "bob": 1002}


def _table(*rows) -> dict[ch.Key, int]:
    return ch.build_table(ch.measurements(rows, UIDS.get))


# ---------------------------------------------------------------- the table (pure)
def test_each_user_gets_only_their_own_runs_figure() -> None:
    t = _table(_row(10, "alice", _attempt(0.9)), _row(11, "bob", _attempt(0.2)))
    assert t == {(1001, FP): 90, (1002, FP): 20}


def test_incomplete_attempts_never_count() -> None:
    """An OOM'd attempt, one without samples, a failed job, a job without a user."""
    t = _table(
        _row(10, "alice", _attempt(0.95, oom=True), _attempt(0.3, n=1)),
        _row(11, "alice", _attempt(0.99, samples=0, fp=OTHER_FP)),
        _row(12, "alice", _attempt(0.99, fp=OTHER_FP), state="FAILED"),
        _row(13, None, _attempt(0.99, fp=OTHER_FP)),
        _row(14, "mallory", _attempt(0.99, fp=OTHER_FP)),  # no uid on this host
    )
    assert t == {(1001, FP): 30}


def test_the_largest_of_the_newest_runs_is_kept() -> None:
    rows = [_row(j, "alice", _attempt(sm)) for j, sm in
            ((1, 0.99), (2, 0.40), (3, 0.41), (4, 0.42), (5, 0.43), (6, 0.44))]
    assert _table(*rows) == {(1001, FP): 44}  # job 1's 99 % is older than the newest five
    assert _table(*rows[:3]) == {(1001, FP): 99}  # one light run does not undo a heavy one


def test_render_and_parse_round_trip_and_bad_lines_are_skipped() -> None:
    t = {(1001, FP): 90, (1002, OTHER_FP): 7}
    assert ch.parse(ch.render(t)) == t
    bad = "1001 ZZ 50\n1001 ab 0\n1001 ab 101\nx ab 5\n1001  ab 5\n1003 ab 55\n"
    assert ch.parse(bad) == {(1003, "ab"): 55}


def test_write_is_atomic_world_readable_and_refuses_a_writable_directory(
        tmp_path: Path) -> None:
    d = tmp_path / "lib"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    path = d / "compute-history"
    ch.write(path, {(1001, FP): 90})
    assert ch.parse(path.read_text()) == {(1001, FP): 90}
    assert path.stat().st_mode & 0o777 == 0o644
    assert [p.name for p in d.iterdir()] == ["compute-history"]  # no temporary left
    os.chmod(d, 0o777)
    with pytest.raises(ch.ComputeHistoryError, match="writable by it alone"):
        ch.write(path, {})
    assert ch.parse(path.read_text()) == {(1001, FP): 90}  # the old table stays


def test_config_bounds() -> None:
    assert from_mapping({"sm_capacity_pct": 108}).sm_capacity_pct == 108
    with pytest.raises(ConfigError, match="sm_capacity_pct"):
        from_mapping({"sm_capacity_pct": 401})
    with pytest.raises(ConfigError, match="sm_prior_pct"):
        from_mapping({"sm_prior_pct": 101})
    with pytest.raises(ConfigError, match="absolute"):
        from_mapping({"compute_history_file": "compute-history"})


# ------------------------------------------------------ job_submit.lua reading it
def _estimate(mib: int = 7000, fp: str = FP) -> dict[str, str]:
    return {"comment": f"colloc-estimate:v1:mib={mib},margin=500,est=layer-aware,fp={fp}"}


def _harness(tmp_path: Path, table: dict[ch.Key, int] | None, *, capacity: int = 100,
             prior: int = 0) -> Harness:
    path = tmp_path / "compute-history"
    if table is not None:
        path.write_text(ch.render(table))
    return Harness(replace(SETTINGS, sm_capacity_pct=capacity, sm_prior_pct=prior,
                           compute_history_file=str(path)))


def _submit(h: Harness, uid: int, fp: str = FP, mib: int = 7000):
    rc, job = h.submit({"colloc": "m.txt", "colloc_batch_size": "32"}, uid=uid,
                       **_estimate(mib, fp))
    assert rc == 0, h.user_msgs
    rec = parse_record(job.admin_comment)
    assert rec is not None
    return job, rec


def test_a_compute_heavy_job_gets_its_share_of_the_gpu_in_shards(tmp_path: Path) -> None:
    h = _harness(tmp_path, {(1001, FP): 92})
    job, rec = _submit(h, 1001)
    assert job.tres_per_node == "gres/shard:37"  # ceil(92 / 100 * 40), memory wanted 7
    assert (rec.shards, rec.mem_shards, rec.sm_pct, rec.sm_source, rec.need_mib) == (
        37, 7, 92, "history", 7000)
    assert rec.alloc_mib == 37 * 1024


def test_another_users_figure_is_never_used(tmp_path: Path) -> None:
    h = _harness(tmp_path, {(1001, FP): 92})
    job, rec = _submit(h, 1002)  # same fingerprint, another uid: memory alone
    assert job.tres_per_node == "gres/shard:7"
    assert rec.sm_pct is None and rec.mem_shards is None


def test_memory_wins_when_it_is_the_larger_share(tmp_path: Path) -> None:
    h = _harness(tmp_path, {(1001, FP): 10})
    job, rec = _submit(h, 1001, mib=20000)
    assert job.tres_per_node == "gres/shard:20"  # compute alone: 4
    assert (rec.sm_pct, rec.mem_shards) == (10, 20)


def test_prior_for_first_runs_and_off_means_memory_alone(tmp_path: Path) -> None:
    h = _harness(tmp_path, {}, prior=50)
    job, rec = _submit(h, 1001)
    assert job.tres_per_node == "gres/shard:20" and rec.sm_source == "prior"
    h = _harness(tmp_path, {(1001, FP): 92}, capacity=0)
    job, rec = _submit(h, 1001)
    assert job.tres_per_node == "gres/shard:7" and rec.sm_pct is None


def test_explicit_memory_jobs_get_the_prior(tmp_path: Path) -> None:
    h = _harness(tmp_path, {(1001, FP): 92}, prior=30)
    rc, job = h.submit({"colloc": "", "colloc_mem": "4G"}, uid=1001)
    assert rc == 0 and job.tres_per_node == "gres/shard:12"


def test_a_capacity_above_one_gpu_lets_two_heavy_jobs_share(tmp_path: Path) -> None:
    h = _harness(tmp_path, {(1001, FP): 92}, capacity=200)
    job, _ = _submit(h, 1001)
    assert job.tres_per_node == "gres/shard:19"


def test_a_missing_or_damaged_table_costs_only_the_figure(tmp_path: Path) -> None:
    h = _harness(tmp_path, None, prior=0)  # no file
    job, rec = _submit(h, 1001)
    assert job.tres_per_node == "gres/shard:7" and rec.sm_pct is None
    assert any("no compute history" in m for m in h.info)
    (tmp_path / "compute-history").write_bytes(b"\xff\x00garbage\n1001 " + FP.encode()
                                               + b" 250\n%s %s 92\n")
    h = _harness(tmp_path, None, prior=0)
    job, rec = _submit(h, 1001)
    assert job.tres_per_node == "gres/shard:7"


def test_compute_never_pushes_a_job_past_one_gpu(tmp_path: Path) -> None:
    h = _harness(tmp_path, {(1001, FP): 100}, capacity=50)
    job, rec = _submit(h, 1001)
    assert job.tres_per_node == "gres/shard:40" and rec.shards == 40


# ------------------------------------------------------------- admin side
def test_doctor_reports_a_missing_stale_or_foreign_table(tmp_path: Path) -> None:
    from slurm_colloc.site.doctor import check_compute_history

    path = tmp_path / "compute-history"
    cfg = from_mapping({"sm_capacity_pct": 100, "compute_history_file": str(path)})
    assert check_compute_history(from_mapping({})) == []  # off: nothing to check
    (f,) = check_compute_history(cfg)
    assert f.level == "warn" and "compute-history --write" in f.detail
    path.write_text(ch.render({}))
    os.chmod(path, 0o644)
    now = path.stat().st_mtime
    if os.geteuid() == 0:
        assert check_compute_history(cfg, now)[0].level == "ok"
        assert check_compute_history(cfg, now + 3 * 86400)[0].level == "warn"
        os.chmod(path, 0o666)
    assert check_compute_history(cfg, now)[0].level == "fail"


def test_admin_command_builds_the_table_from_every_users_jobs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from slurm_colloc.cli.admin_cmd import admin
    from slurm_colloc.slurm.adapter import SlurmCli, SlurmError

    rows = [_row(10, "alice", _attempt(0.9)), _row(11, "bob", _attempt(0.2))]
    asked: list[tuple[str, str | None]] = []

    def period(self: SlurmCli, since: str, until: str | None = None,
               user: str | None = None, warn: object = None) -> list:
        asked.append((since, user))
        return rows

    monkeypatch.setattr(SlurmCli, "accounting_period", period)
    monkeypatch.setattr(ch, "uid_by_name", UIDS.get)
    d = tmp_path / "lib"
    d.mkdir()
    os.chmod(d, 0o755)
    conf = tmp_path / "colloc.conf"
    conf.write_text(f'sm_capacity_pct = 100\ncompute_history_file = "{d / "ch"}"\n')
    monkeypatch.setenv("COLLOC_CONF", str(conf))
    out = CliRunner().invoke(admin, ["compute-history"])
    assert out.exit_code == 0, out.output
    assert ch.parse(out.output) == {(1001, FP): 90, (1002, FP): 20}
    assert asked[0][1] is None  # every user's jobs, not the caller's
    out = CliRunner().invoke(admin, ["compute-history", "--write"])
    assert out.exit_code == 0 and "2 (user, model) entries from 2 jobs" in out.output
    assert ch.parse((d / "ch").read_text()) == {(1001, FP): 90, (1002, FP): 20}

    def down(self: SlurmCli, *a: object, **k: object) -> list:
        raise SlurmError("sacct: error: Problem talking to the database")

    monkeypatch.setattr(SlurmCli, "accounting_period", down)
    out = CliRunner().invoke(admin, ["compute-history", "--write"])
    assert out.exit_code == 1 and "left as it was" in out.output
    assert ch.parse((d / "ch").read_text()) == {(1001, FP): 90, (1002, FP): 20}


def test_the_replays_warm_history_keys_on_the_users_uid_and_the_summarys_fingerprint() -> None:
    from slurm_colloc.bench.replayer import warm_compute_history
    from slurm_colloc.bench.trace import Trace, TraceJob
    from slurm_colloc.estimators import parse_summary

    text = (Path(__file__).parent / "data" / "summaries" / "resnet50_torchinfo.txt").read_text()
    fp = parse_summary(text).fingerprint()

    def job(name: str, user: str, sm: float, summary: str = "r50", gpus: int = 1) -> TraceJob:
        return TraceJob(name=name, arrival_s=0.0, size_class="medium", model="r50",
                        batch_size=32, peak_mib=8000, steady_mib=7000, peak_at=0.5,
                        sm_pct=sm, work_s=60.0, guess_mib=9000, summary=summary,
                        gpus=gpus, user=user)

    jobs = (job("a", "alice", 40.2), job("b", "alice", 91.1), job("c", "bob", 20.0),
            job("d", "bob", 99.0, gpus=2), job("e", "bob", 99.0, summary=""),
            job("f", "mallory", 99.0))
    trace = Trace("t", "", 4, 40960, jobs)
    assert warm_compute_history(trace, {"r50": text}, UIDS.get) == {
        (1001, fp): 92, (1002, fp): 20}


def test_the_install_plan_says_whether_admission_is_on() -> None:
    from slurm_colloc.site.install import compute_admission_lines

    assert "off" in compute_admission_lines(SETTINGS)[0]
    (on,) = compute_admission_lines(replace(SETTINGS, sm_capacity_pct=108,
                                            compute_history_file="/var/lib/colloc/ch"))
    assert "sm_capacity_pct = 108" in on and "/var/lib/colloc/ch" in on
    assert "compute-history --write" in on
