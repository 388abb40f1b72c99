"""The HTML report's layout in a real browser at a desktop width (1000 px) and a
phone's (360 px): the page never grows wider than the window, no cell's content
spills out of its cell, the OOM evidence lines are shown whole (wrapped, not cut),
and at 1000 px the attempts table fits without scrolling (issue 27: it spilled past
its column and the evidence excerpt was cut).

Headless Chromium as in :mod:`tests.unit.test_report_browser` (skipped without it,
failed under CI). The page is measured by a script the test appends to a copy of
it (the report itself has none): it writes what it measured into the DOM, which
``--dump-dom`` prints.
"""

from __future__ import annotations

import json
import re

import pytest

from slurm_colloc.report import html, model
from slurm_colloc.report import job as job_report

from .test_report_browser import SHOTS, _browser, _reports, _run
from .test_report_build import CFG, world

MEASURE = """<script>
const px = (el) => [el.scrollWidth, el.clientWidth];
const r = {page: [document.documentElement.scrollWidth, window.innerWidth],
           cells: [], pres: [], tables: [], svgs: []};
document.querySelectorAll('td,th').forEach((el, i) => {
  const [s, c] = px(el); if (s > c + 1) r.cells.push([el.textContent.slice(0, 60), s, c]); });
document.querySelectorAll('pre').forEach((el) => r.pres.push(px(el)));
document.querySelectorAll('table').forEach((el) => r.tables.push(px(el)));
document.querySelectorAll('svg').forEach((el) => r.svgs.push(
  [el.getBoundingClientRect().right, document.body.getBoundingClientRect().right]));
const d = document.createElement('div'); d.id = 'layout'; d.textContent = JSON.stringify(r);
document.body.appendChild(d);
</script>"""

LONG_LINE = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 10.00 GiB. GPU 0 "
             "has a total capacity of 79.10 GiB of which 3.21 GiB is free. Including non-"
             "PyTorch memory, this process has 6.00 GiB memory in use; see "
             "/home/a-rather-long-user-name/projects/" + "very-deep/" * 8 + "train.py")


def _oom_report() -> model.JobReport:
    """Job 13 (an OOM then a whole GPU) with a long name, a long evidence path and
    evidence lines longer than any screen."""
    rep = job_report.build("13", world(), CFG)
    rep.name = "finetune-" + "x" * 90 + "-with-a-name-nobody-would-type"
    a = rep.attempts[0]
    a.oom = dict(a.oom or {})
    a.oom["evidence_where"] = "/var/spool/colloc/evidence/13/attempt0/" + "d" * 70 + "/slurm.out"
    a.oom["evidence_tail"] = [LONG_LINE, "Traceback (most recent call last): " + "y" * 200]
    a.co_tenants = [str(1000 + i) for i in range(12)]
    return rep


def _measure(name: str, page: str, width: int) -> dict[str, list]:  # type: ignore[type-arg]
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"layout-{name}-{width}.html"
    path.write_text(page.replace("</body>", MEASURE + "</body>"))
    dom = _run(_browser(), f"--window-size={width},900", "--virtual-time-budget=2000",
               "--dump-dom", path.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    m = re.search(r'<div id="layout">(.*?)</div>', dom.stdout, re.S)
    assert m, dom.stdout[-2000:]
    got: dict[str, list] = json.loads(m.group(1).replace("&quot;", '"')  # type: ignore[type-arg]
                                      .replace("&amp;", "&").replace("&lt;", "<")
                                      .replace("&gt;", ">"))
    return got


@pytest.mark.parametrize("width", [1000, 360])
def test_the_page_reads_at_desktop_and_phone_width(width: int) -> None:
    pages = {"oom": html.render(_oom_report())}
    pages |= {k: html.render(v) for k, v in _reports().items() if k in ("10", "30")}
    assert "Tried to allocate 10.00 GiB" in pages["oom"]
    for name, page in pages.items():
        m = _measure(name, page, width)
        sw, win = m["page"]
        assert sw <= win, f"{name} at {width}px: page {sw}px wide in a {win}px window"
        assert m["cells"] == [], f"{name} at {width}px: content spills out of cells"
        for s, c in m["pres"]:  # evidence lines wrap: nothing cut or scrolled away
            assert s <= c + 1, f"{name} at {width}px: evidence {s}px in a {c}px box"
        for right, body in m["svgs"]:
            assert right <= body + 1, f"{name} at {width}px: a plot spills past the page"
        if width >= 1000:
            for s, c in m["tables"]:
                assert s <= c + 1, f"{name} at {width}px: a table needs scrolling ({s}>{c})"
        if name == "oom":
            assert len(m["pres"]) == 1
