"""The report tells what ended each attempt (issue 27): colloc's kill, a signal, an OOM
at a known allocation, a co-tenant's fault, a collector gap; with the exit code as
sacct prints it and the advice that follows, in text, JSON and HTML."""

from __future__ import annotations

import json

import pytest

from slurm_colloc.accounting.record import (
    Attempt,
    Enforcement,
    MetricsSummary,
    OomInfo,
    Requeue,
)
from slurm_colloc.report import html, story
from slurm_colloc.report import job as job_report
from slurm_colloc.report.inquirer import EvidenceCheck
from slurm_colloc.report.model import JobReport
from tests.unit.test_report_build import CFG, EST, OOM1, Fake, comment, render_text, row

M = MetricsSummary(peak_mib=2100, mean_mib=1900.0, mean_sm_activity=0.3, samples=60, dcgm=True)
BASE = dict(estimate=EST, shards=2, shard_mib=1024, limit_mib=2048, gpu=0, node="n0",
            start=1000, end=1060)


def report(*attempts: Attempt, state: str = "FAILED", exit_code: str = "0:9",
           fake: Fake | None = None) -> JobReport:
    f = fake or Fake({})
    rows = [row("7", "REQUEUED", comment(*attempts[:i + 1]), exit_code="1:0")
            for i in range(len(attempts) - 1)]
    rows.append(row("7", state, comment(*attempts), exit_code=exit_code))
    f.rows["7"] = rows
    return job_report.build("7", f, CFG)


def everything(rep: JobReport) -> str:
    """The report's words in all three forms, for assertions that all of them say it."""
    return "\n".join((render_text(rep), json.dumps(rep.to_json()), html.render(rep)))


def test_a_job_colloc_killed_over_its_limit_outside_mps_is_told_so() -> None:
    a = Attempt(0, **BASE, metrics=M, enforcement=Enforcement(  # type: ignore[arg-type]
        "over_limit", "killed", 30720, 2048, outside_mps=True))
    rep = report(a)
    s = rep.attempts[0].story
    assert s is not None and s["cause"] == "killed-by-colloc"
    assert s["exit_code"] == "0:9" and s["exit"] == "killed by signal 9 (SIGKILL)"
    assert "colloc's collector killed it" in s["summary"] and "30.0 GiB outside MPS" in s["summary"]
    recs = " ".join(rep.recommendations)
    assert "Keep CUDA_MPS_PIPE_DIRECTORY" in recs
    assert "--colloc-mem=33G (33 shards)" in recs  # 30 GiB + 10 %
    assert "batch" not in recs and "shards instead" not in recs  # no usage advice
    out = everything(rep)
    assert out.count("collector killed it") == 3
    assert out.count("killed by signal 9 (SIGKILL)") >= 3
    assert rep.to_json()["attempts"][0]["enforcement"]["action"] == "killed"
    assert "What happened" in render_text(rep) and '<p class="story"' in html.render(rep)
    assert "(exit 0:9: killed by signal 9 (SIGKILL))" in render_text(rep)  # the header
    admin = report(Attempt(0, **BASE, metrics=M), state="REQUEUED",  # type: ignore[arg-type]
                   exit_code="0:0")
    assert admin.attempts[0].story and admin.attempts[0].story["cause"] == "requeued"


def test_outside_mps_kill_gets_the_pipe_directory_and_no_size() -> None:
    a = Attempt(0, **BASE, metrics=M, enforcement=Enforcement(  # type: ignore[arg-type]
        "outside_mps", "killed", 1500, 2048, outside_mps=True))
    rep = report(a, exit_code="137:0")
    s = rep.attempts[0].story
    assert s is not None and "outside MPS" in s["summary"]
    assert s["exit"] == "exit status 137 (128 + 9: a process of the job was killed by SIGKILL)"
    recs = " ".join(rep.recommendations)
    assert "CUDA_MPS_PIPE_DIRECTORY" in recs and "--colloc-mem" not in recs


def test_a_flag_without_a_kill_is_mentioned_not_blamed() -> None:
    a = Attempt(0, **BASE, metrics=M, enforcement=Enforcement(  # type: ignore[arg-type]
        "outside_mps", "flagged", 1500, 2048, outside_mps=True))
    rep = report(a, state="COMPLETED", exit_code="0:0")
    s = rep.attempts[0].story
    assert s is not None and s["cause"] == "completed"
    assert "flagged it without killing it" in story.line(rep.attempts[0])


@pytest.mark.parametrize(("state", "code", "cause", "words"), [
    ("FAILED", "0:9", "signal", "killed by SIGKILL"),
    ("CANCELLED", "0:15", "cancelled", "Slurm cancelled it"),
    ("TIMEOUT", "0:15", "timeout", "time limit"),
])
def test_a_signalled_job_gets_no_memory_advice(state: str, code: str, cause: str,
                                               words: str) -> None:
    rep = report(Attempt(0, **BASE, metrics=M), state=state,  # type: ignore[arg-type]
                 exit_code=code)
    s = rep.attempts[0].story
    assert s is not None and (s["cause"], s["exit_code"]) == (cause, code)
    assert words in s["summary"]
    recs = " ".join(rep.recommendations)
    assert "--colloc-mem" not in recs and "batch" not in recs and "shards" not in recs
    assert words in everything(rep)


def test_an_oom_at_a_known_allocation_is_sized_to_cover_it() -> None:
    a = Attempt(0, **{**BASE, "shards": 6, "limit_mib": 6144},  # type: ignore[arg-type]
                metrics=MetricsSummary(peak_mib=4000, samples=10),
                oom=OomInfo("gpu-oom", "torch-cuda-oom", alloc_mib=10240, in_use_mib=4096),
                requeue=Requeue(False, "already requeued 1 time(s); max_requeues=1"))
    rep = report(a, exit_code="1:0")
    s = rep.attempts[0].story
    assert s is not None and s["cause"] == "gpu-oom" and s["exit"] == "exit status 1"
    assert "OOM: a 10.0 GiB allocation failed with 4.0 GiB in use (limit 6.0 GiB)" in s["summary"]
    assert "it was not requeued" in s["summary"]
    recs = " ".join(rep.recommendations)
    assert "--colloc-mem=16G (16 shards)" in recs  # (4 + 10) GiB + 10 %, whole shards
    assert "was too low" not in recs  # not sized from the 3.9 GiB peak
    assert everything(rep).count("a 10.0 GiB allocation failed") >= 3


def test_an_oom_beyond_a_whole_gpu_is_told_no_share_covers_it() -> None:
    a = Attempt(0, **{**BASE, "shards": 40, "limit_mib": 40960},  # type: ignore[arg-type]
                metrics=MetricsSummary(peak_mib=4096, samples=10),
                oom=OomInfo("gpu-oom", "torch-cuda-oom", alloc_mib=47104, in_use_mib=4096,
                            whole_gpu=True),
                requeue=Requeue(False, "out of GPU memory on a whole GPU"))
    rep = report(a, exit_code="1:0")
    recs = " ".join(rep.recommendations)
    assert "needs at least 50.0 GiB, more than a whole GPU here (40.0 GiB)" in recs
    assert "--colloc-mem" not in recs


def test_an_old_records_allocation_is_read_from_the_evidence_tail() -> None:
    class WithEvidence(Fake):
        def evidence(self, path: str) -> EvidenceCheck:
            return EvidenceCheck(True, "ok", ("torch.OutOfMemoryError: CUDA out of memory. "
                                              "Tried to allocate 8.00 GiB. GPU 0",))

    a = Attempt(0, **BASE, metrics=MetricsSummary(peak_mib=2000, samples=5),  # type: ignore[arg-type]
                oom=OomInfo("gpu-oom", "torch-cuda-oom", "/ev/7/attempt0/x.out"))
    rep = report(a, exit_code="1:0", fake=WithEvidence({}))
    assert rep.attempts[0].oom and rep.attempts[0].oom["alloc_mib"] == 8192
    assert "--colloc-mem=11G" in " ".join(rep.recommendations)  # 2000 MiB + 8 GiB + 10 %


def test_a_co_tenants_victim_is_told_it_was_not_its_fault() -> None:
    a0 = Attempt(0, **BASE, co_tenants=("12",), metrics=M,  # type: ignore[arg-type]
                 oom=OomInfo("gpu-oom", "torch-cuda-oom", alloc_mib=512, culprit="12"),
                 requeue=Requeue(True, "co-tenant job 12 over its allocation: same request"))
    rep = report(a0, OOM1, state="COMPLETED", exit_code="0:0")
    s = rep.attempts[0].story
    assert s is not None and s["cause"] == "co-tenant"
    assert "not this job's fault: co-tenant job 12" in s["summary"] and "requeued" in s["summary"]
    recs = " ".join(rep.recommendations)
    assert "no resize is needed (it was requeued with the same request)" in recs
    assert "was too low" not in recs
    mps = Attempt(0, **BASE, metrics=M, oom=OomInfo(  # type: ignore[arg-type]
        "mps-fault", "mps-client-terminated"), requeue=Requeue(False, "max_requeues=0"))
    rep = report(mps, exit_code="1:0")
    s = rep.attempts[0].story
    assert s is not None and s["cause"] == "co-tenant" and "not requeued" in s["summary"]
    assert "resubmit it as it is" in " ".join(rep.recommendations)
    assert "not this job's fault" in everything(rep)


def test_a_collector_gap_is_told_and_never_shrinks_the_share() -> None:
    gapped = MetricsSummary(peak_mib=1000, mean_sm_activity=0.9, samples=8, dcgm=True,
                            gaps=((8, 8, "collector"),), span_s=16)
    a = Attempt(0, **{**BASE, "shards": 8, "limit_mib": 8192},  # type: ignore[arg-type]
                metrics=gapped)
    rep = report(a, state="COMPLETED", exit_code="0:0")
    s = rep.attempts[0].story
    assert s is not None and s["measured"].startswith("measured 8 s of 16 s (50%)")
    assert "collector was stopped for 8 s" in s["measured"]
    assert "shards instead" not in " ".join(rep.recommendations)
    full = report(Attempt(0, **{**BASE, "shards": 8, "limit_mib": 8192},  # type: ignore[arg-type]
                          metrics=MetricsSummary(peak_mib=1000, mean_sm_activity=0.9,
                                                 samples=16, dcgm=True, span_s=16)),
                  state="COMPLETED", exit_code="0:0")
    assert "shards instead" in " ".join(full.recommendations)
    assert full.attempts[0].story and full.attempts[0].story["measured"] == "measured all of its 16 s"
    assert "measured 8 s of 16 s" in everything(rep)


@pytest.mark.parametrize(("code", "words"), [
    ("0:0", "exit status 0"), ("1:0", "exit status 1"), ("0:9", "killed by signal 9 (SIGKILL)"),
    ("0:15", "killed by signal 15 (SIGTERM)"), ("", None), ("x:y", None), ("200:0", "exit status 200"),
])
def test_exit_words(code: str, words: str | None) -> None:
    assert story.exit_words(code) == words


def test_story_words_from_the_user_are_escaped_in_html() -> None:
    a = Attempt(0, **BASE, metrics=M,  # type: ignore[arg-type]
                oom=OomInfo("gpu-oom", alloc_mib=512, culprit="<b>12</b>"),
                requeue=Requeue(True, "x"))
    page = html.render(report(a, exit_code="1:0"))
    assert "<b>12</b>" not in page and "&lt;b&gt;12&lt;/b&gt;" in page




def test_a_fatal_fault_under_mps_that_did_not_recur_is_a_co_tenants() -> None:
    """Every client of an MPS server prints the same fatal error: one attempt cannot
    tell culprit from victim. The victim's next attempt completes; the culprit's faults
    again on a GPU of its own. Only the victim's first attempt is told it was not its
    fault (and advised no resize); a culprit stays a fatal CUDA error."""
    fault = OomInfo("cuda-fatal", "cuda-illegal-address")
    a0 = Attempt(0, **BASE, metrics=M, oom=fault,  # type: ignore[arg-type]
                 requeue=Requeue(True, "fatal CUDA error under MPS: a GPU of its own"))
    a1 = Attempt(1, **{**BASE, "shards": 39, "limit_mib": 39 * 1024},  # type: ignore[arg-type]
                 metrics=M)
    victim = report(a0, a1, state="COMPLETED", exit_code="0:0")
    s = victim.attempts[0].story
    assert s is not None and s["cause"] == "co-tenant", s
    assert "most likely not this job's fault" in s["summary"] and "requeued" in s["summary"]
    assert "no resize is needed" in " ".join(victim.recommendations)
    assert "most likely not this job's fault" in everything(victim)
    own = OomInfo("cuda-fatal", "cuda-illegal-address", whole_gpu=True)
    c1 = Attempt(1, **{**BASE, "shards": 39, "limit_mib": 39 * 1024},  # type: ignore[arg-type]
                 metrics=M, oom=own, requeue=Requeue(False, "on a GPU of its own"))
    culprit = report(a0, c1, state="FAILED", exit_code="1:0")
    assert [a.story and a.story["cause"] for a in culprit.attempts] == ["cuda-fatal"] * 2
    assert "CUDA_LAUNCH_BLOCKING=1" in " ".join(culprit.recommendations)
