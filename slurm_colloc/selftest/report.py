"""What the admin sees (a rich table) and what the team gets (one JSON file).

The table is for deciding on the spot (did the node pass, which line to fix); the
JSON carries every figure behind it so the team can compare sites and calibrate the
simulation without another session on the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from slurm_colloc.selftest.gpu_kit import FAIL, INFO, NOT_RUN, PASS, KitResult, to_json

STYLE = {PASS: "green", FAIL: "bold red", INFO: "cyan", NOT_RUN: "dim"}


def default_json_path(host: str, now: float | None = None) -> Path:
    """``./colloc-selftest-<host>-<date>.json`` (time too: two runs a day keep both)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in host) or "host"
    return Path(f"colloc-selftest-{safe}-{stamp}.json")


def table(res: KitResult) -> Table:
    t = Table(title=f"colloc selftest --gpu on {res.host}", show_lines=False)
    t.add_column("check", no_wrap=True)
    t.add_column("result", no_wrap=True)
    t.add_column("detail", overflow="fold")
    for c in res.checks:
        t.add_row(c.name, f"[{STYLE[c.result]}]{c.result}[/]", c.detail)
    return t


def render(res: KitResult, console: Console, json_path: Path | None) -> None:
    """The table, the counts, the configuration lines to set, where the JSON is."""
    console.print(table(res))
    s = res.summary()
    console.print(f"{s[PASS]} passed, {s[FAIL]} failed, {s[INFO]} info, {s[NOT_RUN]} not run")
    if "aborted" in res.measurements:
        console.print(f"[red]run stopped early: {res.measurements['aborted']}[/]")
    if res.suggested_config:
        console.print("Measured overheads; set in colloc.conf:")
        for line in res.suggested_config:
            console.print(f"  {line}")
        model = (res.environment.get("gpu") or {}).get("name")
        if model:  # a site with several GPU models keeps each model's figures apart
            console.print(f'  (with several GPU models: under [gpu_types."{model}"])',
                          markup=False)
    if json_path is not None:
        console.print(f"Results: {json_path} (send this file to the colloc team)")


def write_json(res: KitResult, path: Path) -> None:
    """Written atomically, 0644: it holds no secret and the admin mails it on.

    The kit runs as root, often in a directory someone else can write (issue 23): the
    temporary file is a new one (``mkstemp``: ``O_CREAT | O_EXCL``, a random name, so a
    planted name or link is never opened), and the rename replaces whatever is at
    ``path`` (a link included) instead of writing through it. On failure nothing of
    ours is left.
    """
    data = (json.dumps(to_json(res), indent=2, sort_keys=False, default=str) + "\n").encode()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
