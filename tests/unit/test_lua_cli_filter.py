"""cli_filter.lua against a fake ``slurm`` table and a fake estimator command."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

# PUC Lua 5.1 in lupa is built without io.popen; LuaJIT 2.1 (5.1 semantics) has it.
lupa = pytest.importorskip("lupa.luajit21", reason="lupa (dev extra) runs the Lua filters")

from slurm_colloc.site.install import SiteSettings, render_cli_filter  # noqa: E402

FAKE = Path(__file__).resolve().parents[1] / "e2e" / "data" / "fake_colloc"


class Harness:
    def __init__(self, estimator: Path = FAKE, timeout_s: float = 30) -> None:
        self.lua = lupa.LuaRuntime(unpack_returned_tuples=True)
        self.errors: list[str] = []
        fake = self.lua.eval("{}")
        fake.SUCCESS, fake.ERROR = 0, -1
        fmt = self.lua.eval(
            "function(sink) return function(f, ...) sink(string.format(f, ...)) end end")
        fake.log_error = fmt(lambda s: self.errors.append(str(s)))
        fake.log_verbose = fmt(lambda s: None)
        self.lua.globals().slurm = fake
        settings = SiteSettings(shard_mib=1024, gpu_memory_mib=40960,
                                estimator_command=str(estimator), estimate_timeout_s=timeout_s)
        self.lua.execute(render_cli_filter(settings))

    def pre_submit(self, spank: dict[str, str] | None, **opts: Any):
        options = self.lua.eval("{}")
        for k, v in opts.items():
            options[k] = v
        if spank is not None:
            sp, colloc = self.lua.eval("{}"), self.lua.eval("{}")
            for k, v in spank.items():
                colloc[k] = v
            sp.colloc = colloc
            options.spank = sp
        rc = self.lua.globals().slurm_cli_pre_submit(options, 0)
        return rc, options


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLLOC_ESTIMATOR_COMMAND", raising=False)


def test_estimate_goes_into_comment(tmp_path: Path) -> None:
    s = tmp_path / "m.txt"
    s.write_text("mib=7000 margin=500\n")
    h = Harness()
    rc, opts = h.pre_submit({"colloc": str(s), "colloc-batch-size": "32",
                             "colloc-optimizer": "adamw"}, comment="my words")
    assert rc == 0, h.errors
    assert opts.comment == "colloc-estimate:v1:mib=7000,margin=500,est=fake,fp=00ff32 my words"


def test_stale_record_replaced(tmp_path: Path) -> None:
    s = tmp_path / "m.txt"
    s.write_text("mib=100\n")
    h = Harness()
    rc, opts = h.pre_submit({"colloc": str(s), "colloc-batch-size": "1"},
                            comment="colloc-estimate:v1:mib=1,margin=0,est=x,fp=0")
    assert rc == 0 and opts.comment == "colloc-estimate:v1:mib=100,margin=0,est=fake,fp=00ff1"


def test_estimator_message_fails_sbatch(tmp_path: Path) -> None:
    s = tmp_path / "bad.txt"
    s.write_text("bad\n")
    h = Harness()
    rc, opts = h.pre_submit({"colloc": str(s), "colloc-batch-size": "1"})
    assert rc == -1 and opts.comment is None
    assert "not a model summary" in h.errors[0] and h.errors[0].startswith("colloc: --colloc=")


def test_unreadable_summary(tmp_path: Path) -> None:
    h = Harness()
    rc, _ = h.pre_submit({"colloc": str(tmp_path / "missing.txt"), "colloc-batch-size": "1"})
    assert rc == -1 and "cannot read summary" in h.errors[0]


def test_quoting_is_safe(tmp_path: Path) -> None:
    evil = tmp_path / "a'b; touch pwned $(id).txt"
    evil.write_text("mib=10\n")
    h = Harness()
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        rc, opts = h.pre_submit({"colloc": str(evil), "colloc-batch-size": "1"})
    finally:
        os.chdir(cwd)
    assert rc == 0 and opts.comment.startswith("colloc-estimate:v1:mib=10,")
    assert not (tmp_path / "pwned").exists()


def test_missing_estimator(tmp_path: Path) -> None:
    s = tmp_path / "m.txt"
    s.write_text("mib=10\n")
    h = Harness(estimator=tmp_path / "nope")
    rc, _ = h.pre_submit({"colloc": str(s), "colloc-batch-size": "1"})
    assert rc == -1 and "cannot run the estimator" in h.errors[0]


def test_timeout(tmp_path: Path) -> None:
    s = tmp_path / "m.txt"
    s.write_text("slow\n")
    h = Harness(timeout_s=1)
    rc, _ = h.pre_submit({"colloc": str(s), "colloc-batch-size": "1"})
    assert rc == -1 and "longer than 1 s" in h.errors[0]


def test_garbage_output(tmp_path: Path) -> None:
    est = tmp_path / "est"
    est.write_text('#!/bin/sh\necho \'{"estimate_mib": "x"}\'\n')
    est.chmod(0o755)
    s = tmp_path / "m.txt"
    s.write_text("x\n")
    h = Harness(estimator=est)
    rc, _ = h.pre_submit({"colloc": str(s), "colloc-batch-size": "1"})
    assert rc == -1 and "lacks estimate_mib" in h.errors[0]


@pytest.mark.parametrize("spank", [None, {"colloc": "set"}, {"colloc-mem": "8G"},
                                   {"colloc": "m.txt", "colloc-mem": "8G"}])
def test_nothing_to_estimate(spank: dict[str, str] | None) -> None:
    h = Harness(estimator=Path("/nonexistent"))
    rc, opts = h.pre_submit(spank, comment="keep")
    assert rc == 0 and opts.comment == "keep" and not h.errors


def test_env_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLLOC_ESTIMATOR_COMMAND", str(FAKE))
    s = tmp_path / "m.txt"
    s.write_text("mib=5\n")
    h = Harness(estimator=Path("/nonexistent"))
    rc, opts = h.pre_submit({"colloc": str(s), "colloc-batch-size": "2"})
    assert rc == 0 and "mib=5," in opts.comment


@pytest.mark.parametrize(("spank", "needle"), [
    ({"colloc-batch-size": "4"}, "need --colloc=SUMMARY"),
    ({"colloc-optimizer": "sgd", "colloc": "set"}, "need --colloc=SUMMARY"),
    ({"colloc": "m.txt"}, "needs --colloc-batch-size"),
])
def test_option_combinations_fail_sbatch_here(spank: dict[str, str], needle: str) -> None:
    """The SPANK plugin is loaded optional, so its own checks no longer fail sbatch:
    the filter must refuse these itself (found by the e2e rejections after the change)."""
    h = Harness(estimator=Path("/nonexistent"))
    rc, _ = h.pre_submit(spank)
    assert rc == -1 and needle in h.errors[0], h.errors
