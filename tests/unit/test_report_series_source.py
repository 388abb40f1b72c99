"""colloc-report on a host without the compute node's metrics store (issue 13): plots
from the accounting record's downsampled series, the series source in text, JSON and
HTML, and whether the OOM evidence is readable from here (or where it lives)."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest

from slurm_colloc.accounting import codec
from slurm_colloc.accounting.record import Attempt, JobRecord, OomInfo
from slurm_colloc.report import html, inquirer, model
from slurm_colloc.report import job as job_report

from .test_report_build import (
    CFG,
    COLLOCATED,
    OOM0,
    OOM1,
    Fake,
    comment,
    render_text,
    row,
    series,
    world,
)

SVG = "{http://www.w3.org/2000/svg}"
N = 24
SERIES = tuple((i * 5, 1500 + 25 * i, 20 + i) for i in range(N))


def _metrics(a: Attempt, **kw: Any) -> Attempt:
    """``a`` with its metrics summary changed by ``kw``."""
    assert a.metrics is not None
    return replace(a, metrics=replace(a.metrics, **kw))


WITH_SERIES = _metrics(COLLOCATED, series=SERIES)


def _with_record(monkeypatch: pytest.MonkeyPatch, rec: JobRecord) -> None:
    """Every colloc comment decodes to ``rec`` (whatever the codec carries today)."""
    real = codec.try_decode
    monkeypatch.setattr(model, "try_decode", lambda c: rec if real(c) is not None else None)


def _login_host(job: str, *attempts: Attempt) -> Fake:
    """A host that sees accounting only: no node-local series."""
    w = world()
    w.rows[job] = [row(job, "COMPLETED", comment(*attempts))]
    w.ser = {}
    return w


def _svgs(page: str) -> dict[str, ElementTree.Element]:
    out = {}
    i = page.find("<svg")
    while i >= 0:
        root = ElementTree.fromstring(page[i: page.index("</svg>", i) + 6])
        out[str(root.get("data-plot"))] = root
        i = page.find("<svg", i + 1)
    return out


def _points(line: ElementTree.Element) -> list[tuple[float, float]]:
    return [(float(x), float(y)) for x, y in
            (p.split(",") for p in (line.get("points") or "").split())]


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.urls += [v or "" for k, v in attrs if k in ("src", "href")]


# ------------------------------------------------------------- series source ---


def test_accounting_series_plots_on_a_host_without_the_node_store(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _with_record(monkeypatch, JobRecord((WITH_SERIES,)))
    rep = job_report.build("70", _login_host("70", COLLOCATED), CFG)
    (a,) = rep.attempts
    assert a.series_source == model.SOURCE_ACCOUNTING and len(a.series_points) == N
    assert a.series_points[0] == [0.0, 1500, 20.0] and a.series_points[-1][0] == 5 * (N - 1)
    assert a.peak_mib == 2100  # figures stay the record's summary, not the downsample
    out = render_text(rep)
    assert "No time series" not in out
    assert f"accounting (downsampled, {N} points)" in out
    assert "memory" in out and "top = 6.0 GiB (limit)" in out
    page = html.render(rep)
    assert "No time series" not in page and f"accounting (downsampled, {N} points)" in page
    p = _Tags()
    p.feed(page)
    assert "script" not in p.tags and p.urls == []  # still one self-contained file
    svgs = _svgs(page)
    assert list(svgs) == ["memory", "activity", "tenants"]
    mem = svgs["memory"].findall(f"{SVG}polyline")
    assert len(mem) == 3 and len(_points(mem[0])) == N  # data, limit, estimate
    xs = [x for x, _ in _points(mem[0])]
    assert xs == sorted(xs) and all(0 <= x <= 640 for x in xs)
    (act,) = svgs["activity"].findall(f"{SVG}polyline")
    assert len(_points(act)) == N
    assert "SM activity" in ElementTree.tostring(svgs["activity"], encoding="unicode")
    # co-tenants are in the record, their times are not: say so, not "alone"
    ten = ElementTree.tostring(svgs["tenants"], encoding="unicode")
    assert "11, 12" in ten and "not in the accounting record" in ten and "alone" not in ten


def test_json_carries_the_series_source_and_points(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_record(monkeypatch, JobRecord((WITH_SERIES,)))
    d = json.loads(json.dumps(job_report.build("70", _login_host("70", COLLOCATED), CFG).to_json()))
    (a,) = d["attempts"]
    assert a["series_source"] == "accounting"
    assert a["series_label"] == f"accounting (downsampled, {N} points)"
    assert a["series_points"] == [[float(t), m, float(s)] for t, m, s in SERIES]
    assert d["series_available"] == [0]


def test_node_local_series_wins_over_the_record(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_record(monkeypatch, JobRecord((WITH_SERIES,)))
    w = _login_host("70", COLLOCATED)
    w.ser[("70", 0)] = series("70", 60, mem=2100, sm=30.0, tenants=("11",))
    rep = job_report.build("70", w, CFG)
    (a,) = rep.attempts
    assert a.series_source == model.SOURCE_LOCAL and len(a.series_points) == 60
    assert a.series_points[0][0] == 0.0  # seconds since the attempt's start (t = 1000)
    assert a.tenants_timeline  # only the full series has times
    assert "node-local full series (60 points)" in render_text(rep)
    assert rep.to_json()["attempts"][0]["series_source"] == "node-local"
    mem = _svgs(html.render(rep))["memory"].findall(f"{SVG}polyline")
    assert len(_points(mem[0])) == 60


def test_without_any_series_the_report_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    rep = job_report.build("70", _login_host("70", COLLOCATED), CFG)
    (a,) = rep.attempts
    assert a.series_source is None and a.series_points == []
    assert "none (no node-local series on this host, none in the accounting record)" \
        in render_text(rep)
    page = html.render(rep)
    assert "No time series" in page and "<svg" not in page


def test_accounting_series_without_dcgm_is_labelled_utilization(
        monkeypatch: pytest.MonkeyPatch) -> None:
    nodcgm = _metrics(WITH_SERIES, dcgm=False)
    _with_record(monkeypatch, JobRecord((nodcgm,)))
    rep = job_report.build("70", _login_host("70", COLLOCATED), CFG)
    page = html.render(rep)
    act = ElementTree.tostring(_svgs(page)["activity"], encoding="unicode")
    assert "GPU utilization" in act
    assert "util." in render_text(rep)


def test_malformed_record_points_are_skipped_and_unmeasured_activity_is_a_gap(
        monkeypatch: pytest.MonkeyPatch) -> None:
    bad: Any = ((0, 1000, None), (-5, 1000, 10), (10, -1, 10), ("x", 1, 1), (20, 1200, 250),
                (15, 1100, None), (True, 1, 1), (1, 2))
    odd = _metrics(WITH_SERIES, series=bad)
    _with_record(monkeypatch, JobRecord((odd,)))
    rep = job_report.build("70", _login_host("70", COLLOCATED), CFG)
    (a,) = rep.attempts
    assert a.series_points == [[0.0, 1000, None], [15.0, 1100, None], [20.0, 1200, 100.0]]
    svgs = _svgs(html.render(rep))
    assert len(_points(svgs["memory"].findall(f"{SVG}polyline")[0])) == 3
    (act,) = svgs["activity"].findall(f"{SVG}polyline")
    assert len(_points(act)) == 1  # only the measured point


def test_every_attempt_gets_its_own_source(monkeypatch: pytest.MonkeyPatch) -> None:
    """A requeued job: attempt 0 from the record, attempt 1 from the node store."""
    a0 = _metrics(OOM0, series=SERIES[:5])
    _with_record(monkeypatch, JobRecord((a0, OOM1)))
    w = _login_host("71", OOM0, OOM1)
    w.ser[("71", 1)] = series("71", 30, mem=14336, sm=55.0)
    rep = job_report.build("71", w, CFG)
    assert [(a.series_source, len(a.series_points)) for a in rep.attempts] == [
        ("accounting", 5), ("node-local", 30)]
    assert len(_svgs(html.render(rep))) == 3  # svgs keyed by role: both attempts plotted
    assert html.render(rep).count('data-plot="memory"') == 2


def test_record_round_trip_keeps_the_series_when_the_codec_carries_it() -> None:
    """End to end through AdminComment, once the codec writes ``series``."""
    enc = codec.append_attempt("", WITH_SERIES)
    dec = codec.try_decode(enc)
    if dec is None or dec.attempts[0].metrics is None or not dec.attempts[0].metrics.series:
        pytest.skip("codec does not carry MetricsSummary.series yet")
    w = _login_host("72", WITH_SERIES)
    rep = job_report.build("72", w, CFG)
    assert rep.attempts[0].series_source == "accounting"
    assert len(rep.attempts[0].series_points) == N


# ------------------------------------------------------------------ evidence ---


def _record_opens(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Record every os.open (the check must not open what it rejects)."""
    opened: list[Any] = []
    real = os.open

    def spy(*a: Any, **k: Any) -> int:
        opened.append(a)
        return real(*a, **k)

    monkeypatch.setattr(os, "open", spy)
    return opened


def _oom_world(path: str) -> Fake:
    a = replace(OOM0, oom=OomInfo("gpu-oom", "torch-cuda-oom", path))
    w = world()
    w.rows["80"] = [row("80", "FAILED", comment(a), exit_code="1:0")]
    return w


def test_readable_evidence_is_marked_and_its_last_lines_shown(tmp_path: Path) -> None:
    ev = tmp_path / "slurm-80.out.oom"
    ev.write_text("x" * 9000 + "\nstep 1\nstep 2\n\ntorch.OutOfMemoryError: CUDA out of memory\n")
    rep = job_report.build("80", _oom_world(str(ev)), CFG)
    oom = rep.attempts[0].oom
    assert oom is not None and oom["evidence_readable"] is True
    assert oom["evidence_status"] == "readable"
    tail = oom["evidence_tail"]
    if os.geteuid() == 0:  # root shows lines only from a root-owned file (this one is)
        assert ev.stat().st_uid == 0
    assert tail == ["step 1", "step 2", "torch.OutOfMemoryError: CUDA out of memory"]
    out = render_text(rep)
    assert f"{ev} (readable here)" in out and "| torch.OutOfMemoryError" in out
    page = html.render(rep)
    assert "<pre>" in page and "torch.OutOfMemoryError" in page
    d = rep.to_json()["attempts"][0]["oom"]
    assert d["evidence_readable"] is True and d["evidence_tail"][-1].startswith("torch.")


def test_evidence_not_on_this_host_says_which_node_holds_it() -> None:
    path = "/var/lib/colloc/evidence/80/attempt0/slurm-80.out"
    rep = job_report.build("80", _oom_world(path), CFG)
    oom = rep.attempts[0].oom
    assert oom is not None and oom["evidence_readable"] is False
    assert oom["evidence_status"] == "absent" and oom["evidence_tail"] == []
    out = render_text(rep)
    assert f"{path} on node n0 (not on this host)" in out
    assert "log kept in " + path + " on node n0" in " ".join(rep.notes)
    assert "on node n0 (not on this host)" in html.render(rep)


def test_unreadable_evidence_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ev = tmp_path / "secret.out"
    ev.write_text("private\n")
    ev.chmod(0)
    if os.geteuid() == 0:  # root reads anything: stand in for another user
        monkeypatch.setattr(os, "access", lambda *a, **k: False)
    opened = _record_opens(monkeypatch)
    rep = job_report.build("80", _oom_world(str(ev)), CFG)
    oom = rep.attempts[0].oom
    assert oom is not None and oom["evidence_status"] == "denied" and not oom["evidence_readable"]
    assert oom["evidence_tail"] == [] and opened == []
    assert "(not readable by you; kept on node n0)" in render_text(rep)
    assert "private" not in render_text(rep) and "private" not in html.render(rep)


@pytest.mark.parametrize("kind", ["symlink", "fifo", "dir"])
def test_evidence_that_is_not_a_regular_file_is_never_opened(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    target = tmp_path / "target"
    target.write_text("root secret\n")
    ev = tmp_path / "evidence"
    if kind == "symlink":
        ev.symlink_to(target)
    elif kind == "fifo":
        os.mkfifo(ev)  # opening it would block the report
    else:
        ev.mkdir()
    opened = _record_opens(monkeypatch)
    rep = job_report.build("80", _oom_world(str(ev)), CFG)
    oom = rep.attempts[0].oom
    assert oom is not None and oom["evidence_status"] == "not-a-file"
    assert oom["evidence_readable"] is False and opened == []
    out = render_text(rep)
    assert "not a regular file here" in out and "root secret" not in out


def test_root_does_not_show_lines_of_a_file_it_does_not_own(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (chown)")
    ev = tmp_path / "user.out"
    ev.write_text("user text\n")
    os.chown(ev, 65534, 65534)
    chk = inquirer.check_evidence(str(ev))
    assert chk.readable and chk.status == "readable" and chk.tail == ()


def test_evidence_read_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ev = tmp_path / "big.out"
    ev.write_bytes(b"a" * (1 << 20) + b"\n" + b"b" * 10000 + b"\nlast line\n")
    asked: list[int] = []
    real = os.pread

    def pread(fd: int, n: int, off: int) -> bytes:
        asked.append(n)
        return real(fd, n, off)

    monkeypatch.setattr(os, "pread", pread)
    chk = inquirer.check_evidence(str(ev))
    assert asked == [inquirer.EVIDENCE_TAIL_BYTES] and chk.tail == ("last line",)
    assert all(len(ln) <= inquirer.EVIDENCE_LINE_CHARS for ln in chk.tail)


def test_evidence_lines_cannot_inject_markup_or_control_sequences(tmp_path: Path) -> None:
    ev = tmp_path / "evil.out"
    ev.write_text("[link=https://evil.example]x[/link] \x1b[2J <img src=x onerror=alert(1)>\n")
    rep = job_report.build("80", _oom_world(str(ev)), CFG)
    out = render_text(rep)
    assert "[link=https://evil.example]x[/link]" in out and "\x1b[2J" not in out
    page = html.render(rep)
    assert "<img" not in page and "&lt;img src=x onerror=alert(1)&gt;" in page


def test_relative_or_empty_evidence_paths_are_not_checked() -> None:
    assert inquirer.check_evidence("relative/x.out").status == "invalid"
    assert inquirer.check_evidence("").status == "invalid"
    assert inquirer.check_evidence("/a\x00b").status == "invalid"


def test_oom_without_evidence_has_no_evidence_section() -> None:
    a = replace(OOM0, oom=OomInfo("gpu-oom", "torch-cuda-oom", None))
    w = world()
    w.rows["81"] = [row("81", "FAILED", comment(a), exit_code="1:0")]
    rep = job_report.build("81", w, CFG)
    assert "OOM evidence" not in render_text(rep)
    assert rep.attempts[0].oom is not None and "evidence_readable" not in rep.attempts[0].oom

