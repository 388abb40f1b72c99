"""colloc-report over a fake inquirer: each job kind, with and without DCGM fields,
JSON contract, HTML that parses and is self-contained, the admin view, exit codes."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from typing import Any
from xml.etree import ElementTree

import pytest
from rich.console import Console

from slurm_colloc.accounting.codec import append_attempt
from slurm_colloc.accounting.record import Attempt, Estimate, MetricsSummary, OomInfo, Requeue
from slurm_colloc.cli.report_cmd import EXIT_NO_DATA, EXIT_UNKNOWN, ReportParams, run
from slurm_colloc.config import CollocConfig
from slurm_colloc.metrics import store
from slurm_colloc.report import admin, html, model, text
from slurm_colloc.report import job as job_report
from slurm_colloc.report.inquirer import Inquirer, JobRow, parse_elapsed

CFG = CollocConfig(gpu_memory_mib=40960, shard_mib=1024)
SUB = "colloc1:mode=estimate,need_mib=6144,shards=6,shard_mib=1024,alloc_mib=6144,est=layer-aware,est_mib=6144"


def series(job: str, n: int, *, mem: int, sm: float | None, util: float = 90.0,
           tenants: tuple[str, ...] = (), idle_every: int = 0) -> store.Series:
    rows = []
    for i in range(n):
        idle = idle_every and i % idle_every == 0
        rows.append(store.Row(t=1000.0 + i, gpu=0, mem_mib=float(mem - (n - i)),
                              mem_max_mib=mem - (n - i) + 1, gpu_mem_mib=mem * 2,
                              util_pct=0.0 if idle else util,
                              sm_pct=None if sm is None else (0.0 if idle else sm),
                              power_w=200.0, energy_j=200.0,
                              tenants=tenants if i < n // 2 else ()))
    return store.Series(job, 0, rows)


class Fake(Inquirer):
    def __init__(self, rows: dict[str, list[JobRow]], live: dict[str, dict[str, Any]] | None = None,
                 ser: dict[tuple[str, int], store.Series] | None = None) -> None:
        self.rows, self._live, self.ser = rows, live or {}, ser or {}

    def job_rows(self, job_id: str) -> list[JobRow]:
        return self.rows.get(job_id, [])

    def period_rows(self, since: str, until: str | None, user: str | None) -> list[JobRow]:
        return [r for rs in self.rows.values() for r in rs if user in (None, r.user)]

    def live(self, job_id: str) -> dict[str, Any] | None:
        return self._live.get(job_id)

    def series(self, job_id: str, attempt: int) -> store.Series | None:
        return self.ser.get((job_id, attempt))


def comment(*attempts: Attempt) -> str:
    text_ = SUB
    for a in attempts:
        text_ = append_attempt(text_, a)
    return text_.lower()  # as sacctmgr leaves it


EST = Estimate(6144, "layer-aware")
COLLOCATED = Attempt(0, EST, shards=6, shard_mib=1024, limit_mib=6144, gpu=0, node="n0",
                     co_tenants=("11", "12"),
                     metrics=MetricsSummary(peak_mib=2100, mean_mib=1900.0, mean_sm_activity=0.3,
                                            energy_j=7200.0, samples=60, dcgm=True),
                     start=1000, end=1060)
OOM0 = Attempt(0, EST, shards=6, shard_mib=1024, limit_mib=6144, gpu=0, node="n0",
               co_tenants=("10",), oom=OomInfo("gpu-oom", "torch-cuda-oom", "/ev/13/attempt0/x.out"),
               requeue=Requeue(True, "GPU OOM with 6 shards", "gres:shard:40", 40960),
               metrics=MetricsSummary(peak_mib=6100, samples=5, mean_sm_activity=0.5, dcgm=True))
OOM1 = Attempt(1, EST, shards=40, shard_mib=1024, limit_mib=40960, gpu=1, node="n0",
               metrics=MetricsSummary(peak_mib=14336, mean_mib=12000.0, mean_sm_activity=0.55,
                                      energy_j=9000.0, samples=30, dcgm=True))


def row(job: str, state: str, adminc: str, **kw: Any) -> JobRow:
    return JobRow(job_id=job, name=kw.pop("name", "train"), user=kw.pop("user", "alice"),
                  state=state, exit_code=kw.pop("exit_code", "0:0"), elapsed_s=kw.pop("el", 60),
                  node="n0", admin_comment=adminc, **kw)


def world() -> Fake:
    return Fake(
        rows={
            "10": [row("10", "COMPLETED", comment(COLLOCATED))],
            "13": [row("13", "REQUEUED", comment(OOM0), exit_code="1:0"),
                   row("13", "COMPLETED", comment(OOM0, OOM1), el=30)],
            "20": [row("20", "COMPLETED", "", name="plain")],
            "30": [row("30", "RUNNING", SUB)],
        },
        live={"30": {"JobState": "RUNNING", "Restarts": "0", "AdminComment": SUB,
                     "TresPerNode": "gres:shard:6", "GRES": "shard:6(IDX:0)", "NodeList": "n0"}},
        ser={("10", 0): series("10", 60, mem=2100, sm=30.0, tenants=("11",)),
             ("30", 0): series("30", 20, mem=3000, sm=None, util=40.0, idle_every=3)},
    )


def test_collocated_job_report_and_json_contract() -> None:
    rep = job_report.build("10", world(), CFG)
    d = rep.to_json()
    json.dumps(d)
    assert d["job_id"] == "10" and d["state"] == "COMPLETED"
    (a,) = d["attempts"]
    assert (a["estimate_mib"], a["limit_mib"], a["peak_mib"], a["gpu"]) == (6144, 6144, 2100, 0)
    assert a["co_tenants"] == ["11", "12"] and a["oom"] is None
    assert a["tenants_timeline"][0]["job_id"] == "11"
    assert isinstance(d["recommendations"], list)
    recs = " ".join(d["recommendations"])
    assert "batch" in recs  # SM 30 %, peak 34 % of the limit
    assert "shards instead of 6" in recs  # 2.1 GiB + 10 % fits 3 shards
    assert "sized from this measured peak" not in recs  # no fingerprint: no history
    assert "Estimate 6.0 GiB vs measured peak 2.1 GiB" in " ".join(d["notes"])


def test_over_request_advice_points_at_history_when_the_model_is_known() -> None:
    w = world()
    w.rows["40"] = [row("40", "COMPLETED", append_attempt(SUB + ",fp=0123abcd", COLLOCATED).lower())]
    w.ser[("40", 0)] = series("40", 60, mem=2100, sm=30.0, tenants=("11",))
    recs = " ".join(job_report.build("40", w, CFG).recommendations)
    assert "shards instead of 6" in recs
    assert "sized from this measured peak automatically" in recs


def test_fatal_cuda_error_notes_victim_or_culprit() -> None:
    """A shared attempt killed by a fatal CUDA error, requeued on a whole GPU: if the
    rerun completes, the report says it was most likely a co-tenant's fault; if it
    fails the same way alone, it tells the user the bug is theirs."""
    fatal0 = Attempt(0, EST, shards=6, shard_mib=1024, limit_mib=6144, gpu=0, node="n0",
                     co_tenants=("10",),
                     oom=OomInfo("cuda-fatal", "cuda-illegal-address", "/ev/50/attempt0/x.out"),
                     requeue=Requeue(True, "fatal CUDA error under MPS", "gres:shard:40", 40960))
    fatal1 = Attempt(1, EST, shards=40, shard_mib=1024, gpu=1, node="n0",
                     oom=OomInfo("cuda-fatal", "cuda-illegal-address", "/ev/50/attempt1/x.out",
                                 whole_gpu=True),
                     requeue=Requeue(False, "fatal CUDA error on a GPU of its own"))
    w = world()
    w.rows["50"] = [row("50", "REQUEUED", comment(fatal0), exit_code="1:0"),
                    row("50", "COMPLETED", comment(fatal0, OOM1), el=30)]
    w.rows["51"] = [row("51", "REQUEUED", comment(fatal0), exit_code="1:0"),
                    row("51", "FAILED", comment(fatal0, fatal1), exit_code="1:0")]
    ok = job_report.build("50", w, CFG)
    assert any("co-tenant's fault" in n for n in ok.notes)
    assert any("died of cuda-fatal on a shared GPU (MPS)" in n for n in ok.notes)
    bad = job_report.build("51", w, CFG)
    assert any("CUDA_LAUNCH_BLOCKING=1" in r for r in bad.recommendations)
    assert not any("co-tenant's fault" in n for n in bad.notes)


def test_recovered_job_has_every_attempt_with_evidence_and_advice() -> None:
    rep = job_report.build("13", world(), CFG)
    assert [a.attempt for a in rep.attempts] == [0, 1]
    a0, a1 = rep.attempts
    assert a0.outcome == "gpu-oom, requeued" and a0.oom and a0.oom["evidence"] == "/ev/13/attempt0/x.out"
    assert a1.outcome == "COMPLETED" and a1.peak_mib == 14336 and a1.limit_mib == 40960
    recs = " ".join(rep.recommendations)
    assert "--colloc-mem=16G" in recs  # 14 GiB + 10 % rounded up
    assert "shards instead" not in recs
    out = render_text(rep)
    assert "gpu-oom, requeued" in out and "/ev/13/attempt0/x.out" in out


def render_text(rep: model.JobReport) -> str:
    c = Console(width=120, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    c.print(text.render(rep))
    return c.export_text()


def test_running_job_without_dcgm_reports_so_far_from_the_series() -> None:
    rep = job_report.build("30", world(), CFG)
    assert rep.running and len(rep.attempts) == 1
    a = rep.attempts[0]
    assert a.peak_mib == 3000 and a.sm_source == "utilization"
    assert a.sm_activity is not None and a.sm_activity < 0.4
    assert a.idle_fraction is not None and a.idle_fraction >= 0.3
    notes = " ".join(rep.notes)
    assert "RUNNING" in notes and "SM activity not measured" in notes
    assert any("idle" in r for r in rep.recommendations)
    out = render_text(rep)
    assert "GPU utilization" in out and "SM activity" not in out.split("Attempts")[0]


def test_dcgm_series_is_labelled_sm_activity() -> None:
    rep = job_report.build("10", world(), CFG)
    assert rep.attempts[0].sm_source == "sm-activity"
    out = render_text(rep)
    assert "SM activity" in out and "not measured" not in out


def test_job_without_colloc_data_and_unknown_job(capsys: pytest.CaptureFixture[str]) -> None:
    rep = job_report.build("20", world(), CFG)
    assert not rep.colloc and rep.attempts == [] and "no colloc data" in rep.notes[0]
    with pytest.raises(model.UnknownJobError):
        job_report.build("404", world(), CFG)
    p = ReportParams("404", False, None, None, None, None)
    assert run(p, CFG, world()) == EXIT_UNKNOWN
    assert run(ReportParams("20", True, None, None, None, None), CFG, world()) == EXIT_NO_DATA
    assert json.loads(capsys.readouterr().out)["colloc"] is False


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.urls += [v or "" for k, v in attrs if k in ("src", "href")]


def test_html_is_self_contained_and_plots_parse(tmp_path: Any) -> None:
    w = world()
    bad = row("66", "COMPLETED", comment(COLLOCATED), name="<script>alert(1)</script>")
    w.rows["66"] = [bad]
    w.ser[("66", 0)] = w.ser[("10", 0)]
    rep = job_report.build("66", w, CFG)
    page = html.render(rep)
    p = _Tags()
    p.feed(page)
    assert "script" not in p.tags and p.urls == [] and "<script>" not in page
    assert "&lt;script&gt;" in page
    svgs = [page[i: page.index("</svg>", i) + 6] for i in range(len(page)) if page.startswith("<svg", i)]
    assert len(svgs) == 3
    roles = []
    for s in svgs:
        root = ElementTree.fromstring(s)
        roles.append(root.get("data-plot"))
        lines = root.findall("{http://www.w3.org/2000/svg}polyline")
        for ln in lines:
            pts = [tuple(map(float, xy.split(","))) for xy in (ln.get("points") or "").split()]
            assert all(0 <= x <= 640 and 0 <= y <= 400 for x, y in pts)
    assert roles == ["memory", "activity", "tenants"]
    mem = ElementTree.fromstring(svgs[0]).findall("{http://www.w3.org/2000/svg}polyline")
    assert len(mem) == 3 and len((mem[0].get("points") or "").split()) == 60  # data, limit, est.
    tenants = ElementTree.fromstring(svgs[2]).findall("{http://www.w3.org/2000/svg}rect")
    assert len(tenants) == 1
    # and via the CLI
    out = tmp_path / "r.html"
    assert run(ReportParams("10", True, out, None, None, None), CFG, world()) == 0
    assert out.read_text().startswith("<!DOCTYPE html>")


def test_admin_view_counts_savings_ooms_and_accuracy() -> None:
    w = world()
    s = admin.summarize_period(w.period_rows("x", None, None), CFG, "x", None)
    # job 30 runs with a submit record only: nothing says it shares its GPU (issue 27)
    assert (s.jobs, s.colloc_jobs, s.collocated, s.oom_crashes, s.recovered) == (4, 3, 2, 1, 1)
    # job 10: 60 s at 6/40 of a GPU; job 13: 60 s at 6/40 (attempt 1 had the whole GPU)
    assert s.gpu_hours_saved == pytest.approx(round(2 * 60 / 3600 * (1 - 6 / 40), 3))
    (e,) = s.estimators
    assert e.estimator == "layer-aware" and e.jobs == 2 and e.under == 1
    only_bob = admin.summarize_period(w.period_rows("x", None, "bob"), CFG, "x", "bob")
    assert only_bob.jobs == 0


def test_elapsed_parser() -> None:
    assert parse_elapsed("1-02:03:04") == 93784
    assert parse_elapsed("03:04") == 184
    assert parse_elapsed("Unknown") is None


def test_admin_view_says_when_it_assumes_the_gpu_size() -> None:
    """With gpu_memory_mib = 0 the savings rest on an assumed 40 shards: say so."""
    from dataclasses import replace

    w = world()
    rows = w.period_rows("x", None, None)
    unsized = admin.summarize_period(rows, replace(CFG, gpu_memory_mib=0), "x", None)
    assert any("gpu_memory_mib = 0" in m for m in unsized.warnings)
    sized = admin.summarize_period(rows, replace(CFG, gpu_memory_mib=40960), "x", None)
    assert not any("gpu_memory_mib" in m for m in sized.warnings)


def test_placement_notes_say_where_each_attempt_ran_and_how_long_it_queued() -> None:
    """issue 25 item 5: the GPU, the share of it, and the queue wait of each attempt."""
    w = world()
    w.rows["13"] = [row("13", "REQUEUED", comment(OOM0), exit_code="1:0", submit=100, start=160),
                    row("13", "COMPLETED", comment(OOM0, OOM1), el=30, submit=200, start=1400)]
    rep = job_report.build("13", w, CFG)
    assert [a.waited_s for a in rep.attempts] == [60, 1200]
    notes = " ".join(rep.notes)
    assert ("Attempt 0 asked for 6 of a GPU's 39 shards (15 %), waited 00:01:00 in the queue "
            "then ran on GPU 0 of n0.") in notes
    assert "Attempt 1 asked for 40 shards, a GPU of its own, waited " \
           "00:20:00 in the queue after its requeue then ran on GPU 1 of n0." in notes


def test_a_pending_recovery_says_it_runs_ahead_and_a_big_request_gets_advice() -> None:
    w = world()
    w.rows["60"] = [row("60", "REQUEUED", comment(OOM0), exit_code="1:0")]
    w._live["60"] = {"JobState": "PENDING", "Reason": "Resources", "Nice": "-10000",
                     "Restarts": "1", "AdminComment": comment(OOM0)}
    rep = job_report.build("60", w, CFG)
    assert rep.pending == {"reason": "Resources", "nice": -10000}
    notes = " ".join(rep.notes)
    assert "Pending (Resources): no GPU has the shards it asks for free yet." in notes
    assert "runs ahead of the queue" in notes and "Nice=-10000" in notes
    # a recovery is meant to ask for a whole GPU: no advice to ask for less
    assert not any("smaller batch" in r for r in rep.recommendations)
    w._live["61"] = {"JobState": "PENDING", "Reason": "Resources", "Nice": "0", "Restarts": "0",
                     "AdminComment": SUB.replace("shards=6", "shards=30")}
    w.rows["61"] = []
    big = job_report.build("61", w, CFG)
    assert big.pending == {"reason": "Resources", "nice": 0}
    assert "runs ahead" not in " ".join(big.notes)
    assert any("asks for 30 of a GPU's 39 shards (77 %)" in r and "smaller batch" in r
               for r in big.recommendations), big.recommendations


def test_a_job_sized_by_compute_says_so_and_gets_compute_advice() -> None:
    """issue 25 item 2: the record's sm_pct/mem_shards reach the report's notes."""
    w = world()
    sized = SUB.replace("shards=6", "shards=36") + ",sm_pct=92,sm_src=history,mem_shards=7"
    w._live["62"] = {"JobState": "PENDING", "Reason": "Resources", "Nice": "0", "Restarts": "0",
                     "AdminComment": sized}
    w.rows["62"] = []
    rep = job_report.build("62", w, CFG)
    assert rep.submitted is not None and rep.submitted["sm_pct"] == 92
    notes = " ".join(rep.notes)
    assert ("Sized by compute: expected SM activity 92 % (from your earlier runs of this "
            "model) takes 36 of a GPU's 39 shards (92 %) where memory needed 7") in notes
    assert any("because of its expected compute" in r for r in rep.recommendations)
    w._live["63"] = dict(w._live["62"], AdminComment=SUB + ",sm_pct=10,sm_src=prior,"
                         "mem_shards=6")
    w.rows["63"] = []
    small = job_report.build("63", w, CFG)
    assert "Sized by memory (6 shards)" in " ".join(small.notes)
    assert "the site's prior" in " ".join(small.notes)
