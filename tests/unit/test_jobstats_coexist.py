"""colloc beside Princeton jobstats (issue 26 item 2): the record field, the readers'
fallback, never writing over a ``JS1:`` summary, both JSON releases' SystemComment,
and the per-job GPU share export."""

from __future__ import annotations

import base64
import gzip
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from slurm_colloc import config as cfgmod
from slurm_colloc.accounting import codec
from slurm_colloc.accounting.field import (
    carry_in_admin_comment,
    placement,
    record_in,
    record_texts,
)
from slurm_colloc.accounting.record import Attempt, JobRecord
from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu.budget import config_budget
from slurm_colloc.node import record_writer
from slurm_colloc.node.epilog import requeue
from slurm_colloc.node.job import JobContext
from slurm_colloc.report import gpu_shares as gs
from slurm_colloc.report.inquirer import JobRow
from slurm_colloc.report.usage import job_records
from slurm_colloc.slurm import sacct_json
from slurm_colloc.slurm.records import AccountingRecord
from slurm_colloc.slurm.squeue_json import parse_job

DATA = Path(__file__).parent / "data" / "slurm"
RELEASES = ("24.11", "26.05")
SUBMIT = "colloc1:mode=explicit,need_mib=2048,shards=2,shard_mib=1024,alloc_mib=2048"


def js1(summary: dict[str, Any]) -> str:
    """jobstats' own encoding: ``JS1:`` + base64 of gzipped JSON (mixed case)."""
    return "JS1:" + base64.b64encode(gzip.compress(json.dumps(summary).encode())).decode()


def js1_decode(text: str) -> dict[str, Any]:
    """jobstats' (and reportseff's) decoding: the whole field after the prefix."""
    assert text.startswith("JS1:")
    out: dict[str, Any] = json.loads(gzip.decompress(base64.b64decode(text[4:])))
    return out


def cl1(gpu: int = 1, attempt: int = 0) -> str:
    return codec.encode(JobRecord(attempts=(Attempt(attempt=attempt, shards=2, gpu=gpu),)))


SUMMARY = {"gpus": 1, "nodes": {"colloc-node0": {"gpu_utilization": {"1": 40.0}}}}


# ------------------------------------------------------------------ readers ---


def test_the_record_reads_from_either_field_and_jobstats_keeps_decoding() -> None:
    both = {"AdminComment": js1(SUMMARY), "SystemComment": cl1(gpu=3)}
    rec = record_in(both, "system_comment")
    assert rec is not None and rec.attempts[0].gpu == 3
    # a site that has not switched yet still finds it (the other field is the fallback)
    again = record_in(both, "admin_comment")
    assert again is not None and again.attempts[0].gpu == 3
    assert js1_decode(both["AdminComment"]) == SUMMARY
    # records written before a switch to system_comment still read
    old = record_in({"AdminComment": f"{SUBMIT} {cl1(gpu=2)}", "SystemComment": ""},
                    "system_comment")
    assert old is not None and old.attempts[0].gpu == 2
    assert record_in({"AdminComment": js1(SUMMARY), "SystemComment": ""}) is None


def test_the_configured_field_wins_when_both_hold_a_record() -> None:
    f = {"AdminComment": cl1(gpu=0), "SystemComment": cl1(gpu=1)}
    assert record_in(f, "system_comment").attempts[0].gpu == 1  # type: ignore[union-attr]
    assert record_in(f, "admin_comment").attempts[0].gpu == 0  # type: ignore[union-attr]
    assert record_texts(f, "system_comment") == [f["SystemComment"], f["AdminComment"]]


def test_report_rows_and_usage_read_the_system_comment() -> None:
    row = JobRow.from_fields({"JobIDRaw": "7", "AdminComment": js1(SUMMARY),
                              "SystemComment": cl1(gpu=2)})
    rec, sub = job_records([row], "system_comment")
    assert rec is not None and rec.attempts[0].gpu == 2 and sub is None
    row = JobRow.from_fields({"JobIDRaw": "7", "AdminComment": SUBMIT,
                              "SystemComment": cl1(gpu=1)})
    rec, sub = job_records([row])
    assert rec is not None and rec.attempts[0].gpu == 1
    assert sub is not None and sub.shards == 2  # job_submit's record stays in AdminComment


@pytest.mark.parametrize("release", RELEASES)
def test_sacct_json_carries_system_comment(release: str) -> None:
    doc = json.loads((DATA / release / "sacct-shard.json").read_text())
    doc["jobs"][0]["comment"]["system"] = cl1(gpu=2)
    doc["jobs"][0]["comment"]["administrator"] = js1(SUMMARY)
    (r,) = [x for x in sacct_json.parse(json.dumps(doc)) if x.job_id == str(
        doc["jobs"][0]["job_id"])]
    assert r.fields["SystemComment"] == doc["jobs"][0]["comment"]["system"]
    assert js1_decode(r.fields["AdminComment"]) == SUMMARY
    rec = record_in(r.fields, "system_comment")
    assert rec is not None and rec.attempts[0].gpu == 2
    # the captured job itself: its record in AdminComment, SystemComment empty
    (orig,) = sacct_json.parse((DATA / release / "sacct-shard.json").read_text())[:1]
    assert orig.fields["SystemComment"] == "" and record_in(orig.fields) is not None


@pytest.mark.parametrize("release", RELEASES)
def test_squeue_json_carries_system_comment(release: str) -> None:
    ids = json.loads((DATA / release / "manifest.json").read_text())["jobs"]
    doc = json.loads((DATA / release / "squeue-shard.json").read_text())
    for j in doc["jobs"]:
        j["system_comment"] = cl1(gpu=1)
    job = parse_job(json.dumps(doc), ids["shard"])
    assert job is not None and job.system_comment == cl1(gpu=1)
    assert job.admin_comment.startswith("colloc1:")


# ------------------------------------------------------------------ writers ---


def _ctx(**kw: Any) -> JobContext:
    base: dict[str, Any] = dict(
        job_id=9, uid=1000, user="u", node="n0", gpus=(1,), shards=2, gpu_count=0,
        stdout=None, stderr=None, restarts=0, admin_comment=SUBMIT, exit_code="1:0",
        state="COMPLETING", system_comment="")
    base.update(kw)
    return JobContext(**base)


def test_the_epilog_appends_to_the_configured_field() -> None:
    ctx = _ctx(admin_comment=f"{SUBMIT} {cl1(gpu=0)}", system_comment=cl1(gpu=5))
    assert ctx.record_text("admin_comment") == ctx.admin_comment
    assert ctx.record_text("system_comment") == ctx.system_comment
    text = codec.append_attempt(ctx.record_text("system_comment"), Attempt(attempt=1, gpu=6))
    assert "colloc1:" not in text  # job_submit's decision is not copied over
    assert [a.gpu for a in codec.decode(text).attempts] == [5, 6]


def test_placement_never_writes_over_a_jobstats_summary() -> None:
    ours = f"{SUBMIT} {cl1()}"
    assert placement([{"AdminComment": SUBMIT}], "admin_comment", ours) == ("AdminComment", ours)
    where = placement([{"AdminComment": js1(SUMMARY), "SystemComment": ""}], "admin_comment",
                      ours)
    assert where == ("SystemComment", cl1())  # only colloc's token moves
    # text already in SystemComment (Slurm's burst-buffer notes) is kept beside it
    where = placement([{"AdminComment": js1(SUMMARY), "SystemComment": f"bb: stage-in {cl1(9)}"}],
                      "admin_comment", ours)
    assert where == ("SystemComment", f"bb: stage-in {cl1()}")
    assert placement([{"AdminComment": js1(SUMMARY), "SystemComment": js1(SUMMARY)}],
                     "admin_comment", ours) is None
    # record_field = system_comment: jobstats' field is not touched at all
    assert placement([{"AdminComment": js1(SUMMARY)}], "system_comment", cl1()) == (
        "SystemComment", cl1())


class _Dbd:
    """slurmdbd behind sacct/sacctmgr: fields per name, values lowercased on write."""

    def __init__(self, **fields: str) -> None:
        self.fields = {"AdminComment": "", "SystemComment": "", **fields}
        self.writes: list[tuple[str, str]] = []

    def accounting(self, job_ids: list[int]) -> list[AccountingRecord]:
        return [AccountingRecord("9", "COMPLETED", dict(self.fields, End="2026-01-01T00:00:00"))]

    def set_admin_comment_finished(self, job_id: int, value: str) -> None:
        self.set_field_finished(job_id, "AdminComment", value)

    def set_field_finished(self, job_id: int, name: str, value: str) -> None:
        self.writes.append((name, value))
        self.fields[name] = value.lower() if name == "SystemComment" else value


@pytest.mark.parametrize("field", ["admin_comment", "system_comment"])
def test_the_writer_keeps_a_js1_that_got_there_first(field: cfgmod.RecordField) -> None:
    dbd = _Dbd(AdminComment=js1(SUMMARY))
    ours = f"{SUBMIT} {cl1(gpu=3)}"
    why = record_writer.write_verified(dbd, 9, ours, field,  # type: ignore[arg-type]
                                       [r.fields for r in dbd.accounting([9])])
    assert why is None
    assert [w[0] for w in dbd.writes] == ["SystemComment"]
    assert js1_decode(dbd.fields["AdminComment"]) == SUMMARY
    rec = record_in(dbd.fields, field)
    assert rec is not None and rec.attempts[0].gpu == 3


def test_the_writer_uses_admin_comment_when_it_is_free() -> None:
    dbd = _Dbd(AdminComment=SUBMIT)
    ours = f"{SUBMIT} {cl1()}"
    assert record_writer.write_verified(dbd, 9, ours, "admin_comment",  # type: ignore[arg-type]
                                        [r.fields for r in dbd.accounting([9])]) is None
    assert dbd.writes == [("AdminComment", ours)]


class _Ctl:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, str]]] = []

    def requeue(self, job_id: int, *, hold: bool = False) -> None:
        self.calls.append(("requeue", {}))

    def update_job(self, job_id: int, **kw: str) -> None:
        self.calls.append(("update", kw))

    def release(self, job_id: int) -> None:
        self.calls.append(("release", {}))


def test_a_requeued_attempts_record_travels_in_admin_comment() -> None:
    """scontrol refuses SystemComment: the next attempt finds the record in the live
    AdminComment, job_submit's decision kept beside it, and appends to it."""
    a0 = codec.append_attempt("", Attempt(attempt=0, gpu=1))  # record_field=system_comment
    carry = carry_in_admin_comment(SUBMIT, a0)
    assert carry == f"{SUBMIT} {a0}"
    ctl = _Ctl()
    assert requeue(_ctx(), ctl, 4, admin_comment=carry) == []  # type: ignore[arg-type]
    assert {"AdminComment": carry} in [kw for name, kw in ctl.calls if name == "update"]
    nxt = _ctx(admin_comment=carry, system_comment="", restarts=1)
    text = codec.append_attempt(nxt.record_text("system_comment"), Attempt(attempt=1, gpu=2))
    assert text.startswith("cl1:") and [a.gpu for a in codec.decode(text).attempts] == [1, 2]
    # a second requeue replaces the token, never stacks a second one
    again = carry_in_admin_comment(carry, text)
    assert again == f"{SUBMIT} {text}" and again.count("cl1:") == 1
    assert carry_in_admin_comment(SUBMIT, "no record") == SUBMIT


def test_record_field_is_a_checked_config_key(tmp_path: Path) -> None:
    assert CollocConfig().record_field == "admin_comment"
    p = tmp_path / "colloc.conf"
    p.write_text('record_field = "system_comment"\n')
    assert cfgmod.load(p).record_field == "system_comment"
    p.write_text('record_field = "comment"\n')  # users can set Comment: refused
    with pytest.raises(cfgmod.ConfigError, match="record_field"):
        cfgmod.load(p)


# --------------------------------------------------------------- gpu-shares ---


def _cfg() -> CollocConfig:
    return CollocConfig(gpu_memory_mib=40960)


@pytest.mark.parametrize("release", RELEASES)
def test_gpu_shares_of_a_shard_job_and_a_gpu_job(release: str) -> None:
    ids = json.loads((DATA / release / "manifest.json").read_text())["jobs"]
    rows = sacct_json.parse((DATA / release / "sacct-shard.json").read_text())
    rows += sacct_json.parse((DATA / release / "sacct-gpu2.json").read_text())
    rows += sacct_json.parse((DATA / release / "sacct-plain.json").read_text())
    spg = config_budget(_cfg())
    assert spg is not None and spg.shards_per_gpu > 2
    by_id = {s.jobid: s for s in gs.shares(rows, _cfg())}
    shard = by_id[str(ids["shard"])]
    assert (shard.shards, shard.shards_per_gpu) == (2, spg.shards_per_gpu)
    assert shard.fraction == round(2 / spg.shards_per_gpu, 4) and 0 < shard.fraction < 1
    assert shard.gpu is not None and shard.node and shard.user  # gpu from colloc's record
    gpu = by_id[str(ids["gpu2"])]
    assert gpu.shards == 0 and gpu.fraction is not None and gpu.fraction >= 1
    assert str(ids["plain"]) not in by_id  # no GPU held: not listed


def test_gpu_shares_render_and_unknown_gpu_size() -> None:
    row = AccountingRecord("12", "COMPLETED", {"User": "u", "NodeList": "n1",
                                               "SystemComment": cl1(gpu=2)},
                           alloc_tres={"gres/shard": 4})
    (unknown,) = gs.shares([row], CollocConfig())  # gpu_memory_mib = 0: size unknown
    assert unknown.fraction is None and unknown.gpu == 2
    (s,) = gs.shares([row], _cfg())
    text = gs.render([s], "csv").splitlines()
    assert text[0] == ",".join(gs.COLUMNS)
    assert text[1].startswith("12,u,n1,2,4,") and text[1].endswith(str(s.fraction))
    (obj,) = json.loads(gs.render([s], "json"))
    assert obj["jobid"] == "12" and obj["fraction"] == s.fraction


def test_the_cli_is_a_thin_layer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from slurm_colloc.cli.admin_cmd import admin
    from slurm_colloc.slurm import adapter

    conf = tmp_path / "colloc.conf"
    conf.write_text("gpu_memory_mib = 40960\n")
    monkeypatch.setenv("COLLOC_CONF", str(conf))
    row = AccountingRecord("12", "COMPLETED", {"User": "u", "NodeList": "n1"},
                           alloc_tres={"gres/shard": 4})
    seen: list[tuple[str, str | None]] = []

    def period(self: Any, since: str, until: str | None = None, **kw: Any) -> list[Any]:
        seen.append((since, until))
        return [row]

    monkeypatch.setattr(adapter.SlurmCli, "accounting_period", period)
    out = CliRunner().invoke(admin, ["gpu-shares", "--since", "2026-01-01", "--format", "json"])
    assert out.exit_code == 0, out.output
    assert seen == [("2026-01-01", None)]
    assert json.loads(out.output)[0]["shards"] == 4


def test_the_report_prefers_the_configured_field_on_a_tie() -> None:
    from slurm_colloc.report.model import _records

    row = JobRow.from_fields({"JobIDRaw": "7", "AdminComment": f"{SUBMIT} {cl1(gpu=0)}",
                              "SystemComment": cl1(gpu=1)})
    rec, sub = _records([row], None, "system_comment")
    assert rec is not None and rec.attempts[0].gpu == 1 and sub is not None
    rec, _ = _records([row], None, "admin_comment")
    assert rec is not None and rec.attempts[0].gpu == 0
    live = {"AdminComment": js1(SUMMARY), "SystemComment": cl1(gpu=4)}
    rec, _ = _records([], live, "admin_comment")  # JS1: is foreign text: the other field
    assert rec is not None and rec.attempts[0].gpu == 4
