"""The HTML report in a real browser: Debian's ``chromium-headless-shell`` renders it.

Reports built from the fake inquirer (no Slurm): a collocated job with the node-local
series (memory, SM activity, power, a co-tenant), a job recovered from an OOM, a
running job and one plotted from the accounting record only. Each page is loaded by
headless Chromium twice: ``--dump-dom`` (the browser's own parse: every plot is an
SVG element, no script, no error page) and ``--screenshot`` (a PNG whose pixels show
the plot colours). The screenshots are kept in ``.pytest_cache/report-screenshots/``.

``make test`` installs the browser (Makefile, ``test`` target). Without it the test is
skipped with the reason, except under CI (``CI=true``), where it fails.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import zlib
from dataclasses import replace
from pathlib import Path

import pytest

from slurm_colloc.accounting import codec
from slurm_colloc.accounting.record import JobRecord
from slurm_colloc.report import html, model
from slurm_colloc.report import job as job_report

from .test_report_build import CFG, COLLOCATED, world

BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser")
SHOTS = Path(__file__).resolve().parents[2] / ".pytest_cache" / "report-screenshots"


def _browser() -> str:
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    reason = ("no headless Chromium (apt-get install chromium-headless-shell; "
              "`make test` installs it)")
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(reason)
    pytest.skip(reason)


def _run(browser: str, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [browser, "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            "--allow-file-access-from-files", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=90, check=False,
                          env={**os.environ, "HOME": str(SHOTS)})


def read_png(path: Path) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB(A) bytes) of an 8-bit RGB/RGBA PNG (no library)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width = 8, b"", 0
    height = depth = ctype = 0
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            width, height, depth, ctype = struct.unpack(">IIBB", body[:10])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    assert depth == 8 and ctype in (2, 6), (depth, ctype)
    bpp = 3 if ctype == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line) if bpp == 3 else bytes(
            v for k, v in enumerate(line) if k % 4 != 3))
        prev = line
    return width, height, rows


def _colour_count(rows: list[bytes], rgb: str, tol: int = 40) -> int:
    want = bytes.fromhex(rgb.lstrip("#"))
    n = 0
    for r in rows:
        for i in range(0, len(r), 3):
            if all(abs(r[i + k] - want[k]) <= tol for k in range(3)):
                n += 1
    return n


def _reports() -> dict[str, model.JobReport]:
    w = world()
    out = {j: job_report.build(j, w, CFG) for j in ("10", "13", "30")}
    series = tuple((i * 30, 1500 + 20 * i, 25 + (i % 7) * 5) for i in range(40))
    assert COLLOCATED.metrics is not None
    acc = replace(COLLOCATED, metrics=replace(COLLOCATED.metrics, series=series))
    w2 = world()
    w2.ser = {}
    real = codec.try_decode
    with pytest.MonkeyPatch.context() as mp:  # every colloc comment decodes to ``acc``
        mp.setattr(model, "try_decode", lambda c: JobRecord((acc,)) if real(c) else None)
        out["10-accounting"] = job_report.build("10", w2, CFG)
    return out


@pytest.mark.parametrize("name", ["10", "13", "30", "10-accounting"])
def test_report_renders_in_headless_chromium(name: str) -> None:
    browser = _browser()
    SHOTS.mkdir(parents=True, exist_ok=True)
    rep = _reports()[name]
    page = SHOTS / f"job-{name}.html"
    page.write_text(html.render(rep))
    url = page.as_uri()

    dom = _run(browser, "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    text = dom.stdout
    assert "<html" in text.lower() and "</html>" in text
    assert "<script" not in text.lower()
    assert "ERR_" not in text and "This page" not in text  # no Chromium error page
    plots = re.findall(r'<svg[^>]*data-plot="(\w+)"', text)
    n_series = sum(1 for a in rep.attempts if rep.series.get(a.attempt))
    assert plots == ["memory", "activity", "tenants"] * n_series
    assert f"colloc job report: job {rep.job_id}" in text

    png = SHOTS / f"job-{name}.png"
    png.unlink(missing_ok=True)
    shot = _run(browser, f"--screenshot={png}", "--window-size=1200,2000", url)
    assert shot.returncode == 0 and png.is_file(), shot.stderr[-2000:]
    head = png.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", head[16:24]) == (1200, 2000)
    if rep.running:  # running is blue text, never the error red
        assert "RUNNING" in text and 'class="run"' in text
    if name == "10":  # the pixels (decoding takes seconds: once)
        _, _, rows = read_png(png)
        assert _colour_count(rows, html.C_MEM, 20) > 200  # the memory line (and legend)
        assert _colour_count(rows, html.C_SM, 20) > 100  # the activity line
        assert _colour_count(rows, html.C_POWER, 20) > 100  # power panel
        assert _colour_count(rows, html.C_TENANT, 20) > 500  # the co-tenant's lane
    if name == "10-accounting":
        assert "not in this series" in text  # power missing: said, not silently blank


def test_pending_job_is_grey_and_says_it_has_not_started() -> None:
    from .test_report_build import SUB, Fake

    w = Fake(rows={}, live={"60": {"JobState": "PENDING", "Restarts": "0", "AdminComment": SUB,
                                   "TresPerNode": "gres:shard:6"}})
    rep = job_report.build("60", w, CFG)
    page = html.render(rep)
    assert '<td class="pend">PENDING</td>' in page and "so far" not in page
    assert any("has not started" in n for n in rep.notes)
    assert "shard" in page  # the request


def test_what_ended_each_attempt_shows_in_the_browser() -> None:
    """Issue 27: the story of a job colloc killed, in Chromium's own parse of the page."""
    from slurm_colloc.accounting.record import Enforcement

    from .test_report_build import Fake, comment, row

    browser = _browser()
    SHOTS.mkdir(parents=True, exist_ok=True)
    killed = replace(COLLOCATED, enforcement=Enforcement("over_limit", "killed", 30720, 6144,
                                                         outside_mps=True))
    w = Fake(rows={"70": [row("70", "FAILED", comment(killed), exit_code="0:9")]})
    page = SHOTS / "job-70-story.html"
    page.write_text(html.render(job_report.build("70", w, CFG)))
    dom = _run(browser, "--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    story = re.findall(r'<p class="story" data-cause="([\w-]+)">([^<]*)</p>', dom.stdout)
    assert [c for c, _ in story] == ["killed-by-colloc"]
    assert "collector killed it" in story[0][1] and "killed by signal 9 (SIGKILL)" in story[0][1]
    assert "Keep CUDA_MPS_PIPE_DIRECTORY" in dom.stdout
