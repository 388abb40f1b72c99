"""Security issue 11, report side: accounting reads and what reaches the terminal/HTML.

Every test names the finding it covers. The fake ``sacct`` below answers like the real
22.05 one does: ``--parsable2`` joins raw values with ``|`` and ends rows with a newline
(no escaping at all); ``--json`` (openapi/dbv0.0.38 dumper) escapes strings and ignores
``--user`` (sacct's dump_data() does not pass the user list to the plugin).
"""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

from slurm_colloc.accounting.codec import append_attempt
from slurm_colloc.cli.report_cmd import ReportParams, run
from slurm_colloc.metrics import store
from slurm_colloc.report import admin, html, text
from slurm_colloc.report import job as job_report
from slurm_colloc.report.inquirer import JobRow, SlurmInquirer
from slurm_colloc.slurm import adapter as ad

from .test_report_build import CFG, COLLOCATED, SUB, comment, row, world

T0 = 1_795_000_000  # 2026-11-18, a plain epoch second


def num(n: int | None) -> dict[str, Any]:
    """A data_parser v0.0.42 number (``set: false`` for None)."""
    return {"set": n is not None, "infinite": False, "number": n or 0}


def exit_obj(status: str = "SUCCESS", rc: int | None = 0, sig: int | None = None,
             name: str = "") -> dict[str, Any]:
    """A v0.0.42 exit code object."""
    return {"status": [status], "return_code": num(rc),
            "signal": {"id": num(sig), "name": name}}


def job(jid: int, **kw: Any) -> dict[str, Any]:
    """One job object as ``sacct --json=v0.0.42`` prints it (24.11 through 26.05)."""
    t = kw.pop("time", {})
    state = kw.pop("state", "COMPLETED")
    return {
        "account": "colloc",
        "comment": {"administrator": kw.pop("admin", None), "job": kw.pop("comment", None),
                    "system": None},
        "exit_code": kw.pop("exit_code", exit_obj()),
        "job_id": jid,
        "name": kw.pop("name", "train"),
        "nodes": kw.pop("nodes", "n0"),
        "state": {"current": ["PENDING", "REQUEUED"] if state == "REQUEUED" else [state],
                  "reason": "None"},
        "steps": [],
        "time": {"elapsed": 60, "eligible": T0, "end": T0 + 65, "start": T0 + 5,
                 "submission": T0, "suspended": 0, "limit": 60, **t},
        "tres": kw.pop("tres", {
            "allocated": [{"type": "cpu", "name": None, "id": 1, "count": 1},
                          {"type": "gres", "name": "shard", "id": 1002, "count": 6}],
            "requested": [{"type": "cpu", "name": None, "id": 1, "count": 1},
                          {"type": "gres", "name": "shard", "id": 1002, "count": 6}],
        }),
        "user": kw.pop("user", "alice"),
        **kw,
    }


def _iso(t: int) -> str:
    return datetime.fromtimestamp(t).strftime("%Y-%m-%dT%H:%M:%S") if t else "Unknown"


def _parsable2(j: dict[str, Any]) -> str:
    """What ``sacct --parsable2`` prints for the job: raw values, no escaping."""
    tres = ",".join(f"{x['type']}{'/' + x['name'] if x['name'] else ''}={x['count']}"
                    for x in j["tres"]["allocated"])
    t = j["time"]
    vals = [str(j["job_id"]), j["name"], j["user"], j["state"]["current"][-1], "0:0",
            _iso(t["submission"]), _iso(t["start"]), _iso(t["end"]), "00:01:00", tres, tres,
            j["nodes"], j["comment"]["administrator"] or "", j["comment"]["job"] or ""]
    return "|".join(vals) + "\n"


class FakeSacct:
    """subprocess.run stand-in answering sacct in the format asked for."""

    def __init__(self, jobs: list[Any], raw_json: str | None = None) -> None:
        self.jobs = jobs
        self.raw_json = raw_json
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append(argv)
        assert argv[0].endswith("sacct")
        if ad.JSON_FLAG in argv:
            out = self.raw_json if self.raw_json is not None else json.dumps(
                {"meta": {"plugin": {"data_parser": "data_parser/v0.0.42"}}, "errors": [],
                 "jobs": self.jobs})
        else:
            want = next((a.split("=", 1)[1] for a in argv if a.startswith("--user=")), None)
            out = "".join(_parsable2(j) for j in self.jobs if want in (None, j["user"]))
        return subprocess.CompletedProcess(argv, 0, out, "")


def cli(monkeypatch: pytest.MonkeyPatch, jobs: list[Any], raw: str | None = None
        ) -> tuple[ad.SlurmCli, FakeSacct]:
    fake = FakeSacct(jobs, raw)
    monkeypatch.setattr(ad.subprocess, "run", fake)
    return ad.SlurmCli(env={"PATH": "/usr/bin"}, bindir="/usr/bin"), fake


# ------------------------------------------------------------------ M6: sacct reads ---


def test_m6_pipe_in_job_name_neither_hides_nor_invents_rows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """M6: a job named ``hide|me`` used to shift every later column (the row was dropped,
    so a requeued job lost an attempt); from JSON both attempts come back intact."""
    jobs = [job(42, name="hide|me", state="REQUEUED", admin="cl1:first"),
            job(42, name="hide|me", admin="cl1:second", time={"start": T0 + 100})]
    slurm, fake = cli(monkeypatch, jobs)
    recs = slurm.accounting([42])
    assert [r.state for r in recs] == ["REQUEUED", "COMPLETED"]
    assert {r.fields["JobName"] for r in recs} == {"hide|me"}
    assert [r.fields["AdminComment"] for r in recs] == ["cl1:first", "cl1:second"]
    assert ad.JSON_FLAG in fake.calls[-1] and "--parsable2" not in fake.calls[-1]


def test_m6_newline_in_name_cannot_forge_a_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """M6: a newline in a job name or comment split the record, and the second half
    could be a whole forged row (any job id, user, state and AdminComment)."""
    forged = "99|forged|root|COMPLETED|0:0|a|b|c|d|e|f|g|" + SUB + "|"
    jobs = [job(42, name="x\n" + forged, comment="multi\nline|comment")]
    slurm, _ = cli(monkeypatch, jobs)
    (rec,) = slurm.accounting([42])
    assert rec.job_id == "42" and rec.fields["JobName"] == "x\n" + forged
    assert rec.fields["Comment"] == "multi\nline|comment" and rec.fields["AdminComment"] == ""


def test_m6_period_rows_read_json_and_survive_crafted_tokens(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """M6: the admin view (inquirer.period_rows) parsed ``--parsable2`` itself; it now
    reads JSON, keeps every job whatever its name, and filters --user itself."""
    jobs = [job(1, name="a|b|c"), job(2, name="[/]\n|", user="bob"),
            job(3, name="ok", admin=SUB)]
    slurm, fake = cli(monkeypatch, jobs)
    inq = SlurmInquirer(slurm, None)
    rows = inq.period_rows("2026-11-01", None, None)
    assert [(r.job_id, r.name) for r in rows] == [("1", "a|b|c"), ("2", "[/]\n|"), ("3", "ok")]
    assert rows[2].admin_comment == SUB and rows[0].elapsed_s == 60
    assert ad.JSON_FLAG in fake.calls[-1]
    # 22.05's sacct --json ignores --user: the inquirer filters
    assert [r.job_id for r in inq.period_rows("2026-11-01", None, "bob")] == ["2"]


def test_m6_json_fields_keep_the_text_formats_callers_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """M6: epoch ints become sacct's local ISO text, elapsed ``[D-]HH:MM:SS``, exit
    codes ``N:S``, TRES ``type/name=count``, never-started times ``Unknown``."""
    jobs = [
        job(5, time={"elapsed": 93784}, exit_code=exit_obj("ERROR", 3)),
        job(6, state="CANCELLED", time={"start": 0, "end": 0, "elapsed": 0},
            exit_code=exit_obj("SIGNALED", None, 9, "KILL")),
        job(7, state="PENDING", exit_code=exit_obj("PENDING", None), tres={"allocated": [],
            "requested": [{"type": "gres", "name": "gpu", "id": 1001, "count": 1}]},
            nodes="None assigned"),
    ]
    slurm, _ = cli(monkeypatch, jobs)
    a, b, c = slurm.accounting([5, 6, 7])
    assert a.fields["Submit"] == _iso(T0) and a.fields["Start"] == _iso(T0 + 5)
    assert a.fields["Elapsed"] == "1-02:03:04" and a.exit_code == "3:0"
    assert "gres/shard=6" in a.fields["AllocTRES"] and "cpu=1" in a.fields["AllocTRES"]
    assert b.fields["Start"] == "Unknown" and b.fields["End"] == "Unknown"
    assert b.fields["Elapsed"] == "00:00:00" and b.exit_code == "0:9"
    assert c.fields["AllocTRES"] == "" and c.fields["ReqTRES"] == "gres/gpu=1"
    assert set(a.fields) == set(ad.SACCT_FIELDS)
    assert JobRow.from_fields(a.fields).start == T0 + 5


def test_m6_malformed_job_objects_are_skipped_with_a_warning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """M6: one crafted or broken job object never takes the others down."""
    jobs: list[Any] = [job(1), "not a job", {"job_id": "12;rm"}, job(2, name=None),
                       job(3, time={"start": 10**30, "elapsed": 10**30}), {"name": "no id"}]
    slurm, _ = cli(monkeypatch, jobs)
    warnings: list[str] = []
    inq = SlurmInquirer(slurm, None)
    rows = inq.period_rows("2026-11-01", None, None)
    assert [r.job_id for r in rows] == ["1", "2", "3"]
    assert rows[1].name == "" and rows[2].start is None
    warnings = inq.warnings()
    assert any("12;rm" in w for w in warnings) and len(warnings) == 3
    # plain accounting() logs and skips the same way
    assert [r.job_id for r in slurm.accounting([1, 2, 3])] == ["1", "2", "3"]


def test_m6_unreadable_json_is_a_slurm_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """M6: output that is not sacct's JSON document fails as SlurmError (exit 1), not a
    traceback."""
    slurm, _ = cli(monkeypatch, [], raw="42|train|alice|COMPLETED\n")
    with pytest.raises(ad.SlurmError, match="sacct"):
        slurm.accounting([42])
    slurm, _ = cli(monkeypatch, [], raw="[1, 2]")
    with pytest.raises(ad.SlurmError, match="sacct"):
        slurm.accounting([42])
    # junk around a good jobs list is not fatal
    for errors in (5, "x", [{"error": "slurmdbd: timeout", "error_number": 1}, None]):
        slurm, _ = cli(monkeypatch, [], raw=json.dumps({"errors": errors, "jobs": [job(42)]}))
        assert [r.job_id for r in slurm.accounting([42])] == ["42"]


TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40) | st.sampled_from(
    ["|", "\n", "a|b\nc", "[/]", "[link=https://evil]x[/link]", "\x1b[2J", "cl1:aaaa", ""])
INT = st.integers(0, 2**31) | st.sampled_from([0, 2**32 - 1, 2**64, 10**30, -1])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 10**9), TEXT, TEXT, TEXT, TEXT, TEXT, INT, INT),
                min_size=1, max_size=6))
def test_m6_fuzz_json_row_count_and_name_round_trip(
        specs: list[tuple[int, str, str, str, str, str, int, int]]) -> None:
    """M6 (fuzz): arbitrary strings in every text field (``|``, newlines, rich markup,
    escapes) and huge ints: one record per job object, text fields unchanged."""
    jobs = [job(jid, name=n, user=u, admin=a, comment=c, nodes=nd,
                time={"start": t, "elapsed": el})
            for jid, n, u, a, c, nd, t, el in specs]
    fake = FakeSacct(jobs)
    mp = pytest.MonkeyPatch()
    mp.setattr(ad.subprocess, "run", fake)
    try:
        recs = ad.SlurmCli(env={"PATH": "/usr/bin"}, bindir="/usr/bin").accounting(
            [s[0] for s in specs])
    finally:
        mp.undo()
    assert len(recs) == len(jobs)
    for r, (jid, n, u, a, c, nd, _t, _el) in zip(recs, specs, strict=True):
        assert r.job_id == str(jid)
        assert (r.fields["JobName"], r.fields["User"], r.fields["AdminComment"],
                r.fields["Comment"], r.fields["NodeList"]) == (n, u, a, c, nd)
        JobRow.from_fields(r.fields)  # never raises


# ------------------------------------------------------------------ Low: rich markup ---


def _ansi(renderable: Any) -> str:
    buf = io.StringIO()
    Console(file=buf, width=200, force_terminal=True, color_system="truecolor").print(renderable)
    return buf.getvalue()


def _plain(renderable: Any) -> str:
    c = Console(width=200, record=True, file=io.StringIO())
    c.print(renderable)
    return c.export_text()


NASTY = ["train[/]", "[link=https://evil.example]click[/link]", "[bold red]x",
         "\x1b]8;;https://evil.example\x1b\\click\x1b]8;;\x1b\\", "\x1b[2J\x1b[31mred"]


@pytest.mark.parametrize("name", NASTY)
def test_low_rich_markup_in_job_fields_is_shown_literally(name: str) -> None:
    """Low: a job name/user/node with rich markup crashed ``colloc-report``
    (``train[/]``: MarkupError) or injected a hyperlink; terminal escapes in them
    reached the terminal. They are now shown as text."""
    w = world()
    w.rows["10"] = [row("10", "COMPLETED", comment(COLLOCATED), name=name, user=name)]
    rep = job_report.build("10", w, CFG)
    rep.node = name
    rep.attempts[0].co_tenants = [name]
    ansi = _ansi(text.render(rep))
    assert "\x1b]8;" not in ansi and "evil.example\x1b" not in ansi
    assert "\x1b[2J" not in ansi
    plain = _plain(text.render(rep))
    if "\x1b" not in name:
        assert name in plain


def test_low_rich_markup_in_admin_view_is_shown_literally() -> None:
    """Low: the admin view renders estimator names and the user from Slurm/records."""
    s = admin.PeriodSummary(since="[/]", user="[link=https://evil.example]u[/link]")
    s.estimators = [admin.EstimatorStats("train[/]", jobs=1, median_error_pct=1.0),
                    admin.EstimatorStats("[link=https://evil.example]e[/link]", jobs=1)]
    s.warnings = ["job 7: [/] \x1b[2J"]
    ansi = _ansi(admin.render(s))
    assert "\x1b]8;" not in ansi and "\x1b[2J" not in ansi
    plain = _plain(admin.render(s))
    assert "train[/]" in plain and "[link=https://evil.example]e[/link]" in plain


def test_low_html_escapes_every_slurm_and_user_string() -> None:
    """Low: HTML output escapes names, users, nodes, exit codes, co-tenants, evidence
    paths, notes (no tag or attribute can be injected)."""
    evil = "\"'><img src=x onerror=alert(1)><a href='https://evil.example'>"
    w = world()
    w.rows["10"] = [row("10", "COMPLETED", comment(COLLOCATED), name=evil, user=evil,
                        exit_code=evil)]
    rep = job_report.build("10", w, CFG)
    rep.node = evil
    rep.attempts[0].co_tenants = [evil]
    rep.attempts[0].oom = {"evidence": evil}
    rep.notes.append(evil)
    rep.recommendations.append(evil)
    page = html.render(rep)
    assert "<img" not in page and "<a " not in page and "onerror=alert(1)>" not in page
    assert "&lt;img src=x onerror=alert(1)&gt;" in page


# ------------------------------------------------------------------ Low: meta perms ---


def test_low_meta_files_are_private_to_root(tmp_path: Path) -> None:
    """Low: ``meta-*.json`` (uid, model fingerprint, batch size, optimizer) were written
    0644 despite PrivateData=jobs; they are now 0600, whatever the umask or a stale
    temp file left behind."""
    meta = store.JobMeta(job_id=7, attempt=0, uid=1001, gpus=(0,), estimator="x")
    stale = store.meta_path(tmp_path, 7, 0)
    stale.parent.mkdir(parents=True)
    tmp = stale.with_name(f".{stale.name}.{os.getpid()}.tmp")
    tmp.write_text("{}")
    tmp.chmod(0o666)
    old = os.umask(0)
    try:
        p = store.write_meta(tmp_path, meta)
    finally:
        os.umask(old)
    st_ = os.stat(p)
    assert stat.S_IMODE(st_.st_mode) == 0o600
    if os.geteuid() == 0:
        assert st_.st_uid == 0
    assert store.read_meta(tmp_path, 7, 0) == meta  # root (collector, epilog) still reads it


# ------------------------------------------------------------------ admin view robustness ---


def poison_rows() -> list[JobRow]:
    """A job whose record/elapsed make the aggregation overflow (huge numbers)."""
    return [row("99", "COMPLETED", append_attempt(SUB, COLLOCATED).lower(), el=10**400)]


def test_admin_view_skips_a_malformed_job_with_a_warning() -> None:
    """``colloc report --since``: one malformed row (here an elapsed time that overflows
    a float) crashed the whole admin view; it is skipped with a warning naming it."""
    w = world()
    good = admin.summarize_period(w.period_rows("x", None, None), CFG, "x", None)
    s = admin.summarize_period(w.period_rows("x", None, None) + poison_rows(), CFG, "x", None)
    assert any("99" in m for m in s.warnings)
    assert (s.colloc_jobs, s.collocated, s.oom_crashes, s.recovered) == (
        good.colloc_jobs, good.collocated, good.oom_crashes, good.recovered)
    assert s.gpu_hours_saved == good.gpu_hours_saved
    assert "99" in " ".join(s.to_json()["warnings"])


def test_admin_cli_prints_warnings_and_still_reports(capsys: pytest.CaptureFixture[str]) -> None:
    """``colloc report --since``: the CLI shows the summary and the skipped job id."""
    w = world()
    w.rows["99"] = poison_rows()
    assert run(ReportParams(None, False, None, "x", None, None), CFG, w) == 0
    out = capsys.readouterr()
    assert "Jobs in period" in out.out and "99" in (out.err + out.out)


# ------------------------------------------------------------------ bench: exit codes ---


def test_m6_bench_counts_plain_slurm_ooms_without_a_return_code() -> None:
    """M6 follow-up: 22.05's JSON dumper reports every normal exit as SUCCESS/0 (it
    tests WIFEXITED first), so a failed attempt reads ``0:0``; the benchmark's
    plain-Slurm OOM count keys on the state and the output, not on ``1:``."""
    from slurm_colloc.bench.collect import outcome
    from slurm_colloc.slurm import sacct_json

    rec = sacct_json.job_record(
        job(7, state="FAILED", exit_code=exit_obj("SUCCESS", 0)))
    assert rec.exit_code == "0:0"
    o = outcome("j", 7, [rec], "x\ntorch.OutOfMemoryError: CUDA out of memory.\n")
    assert o.lost and o.oom_crashes == 1
    killed = sacct_json.job_record(job(8, state="FAILED", exit_code=exit_obj(
        "SIGNALED", None, 9, "KILL")))
    assert outcome("k", 8, [killed], "torch.OutOfMemoryError\n").oom_crashes == 0
