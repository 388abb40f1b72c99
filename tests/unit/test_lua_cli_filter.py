"""cli_filter.lua against a fake ``slurm`` table and a fake estimator command."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

# PUC Lua 5.1 in lupa is built without io.popen; LuaJIT 2.1 (5.1 semantics) has it.
lupa = pytest.importorskip("lupa.luajit21", reason="lupa (dev extra) runs the Lua filters")

from slurm_colloc.site.install import (  # noqa: E402
    InstallError,
    SiteScript,
    SiteSettings,
    check_site_cli_filter,
    render_cli_filter,
)

FAKE = Path(__file__).resolve().parents[1] / "e2e" / "data" / "fake_colloc"


class Harness:
    def __init__(self, estimator: Path = FAKE, timeout_s: float = 30,
                 chain: SiteScript | None = None) -> None:
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
        self.lua.execute(render_cli_filter(settings, chain))

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


# ------------------------------------------------------------------ --chain-cli-filter
SITE_FILTER = """
-- a site's own cli_filter.lua: a default account, a refusal, a post-submit log
seen = {}
function slurm_cli_setup_defaults(options, early_pass)
	seen[#seen + 1] = "defaults"
	options["account"] = "site-default"
	return slurm.SUCCESS
end
function slurm_cli_pre_submit(options, pack_offset)
	seen[#seen + 1] = "pre"
	if options["comment"] == "forbidden" then
		slurm.log_error("site: no such comment")
		return slurm.ERROR
	end
	options["comment"] = (options["comment"] or "") .. " [site]"
	return slurm.SUCCESS
end
function slurm_cli_post_submit(offset, job_id, step_id)
	seen[#seen + 1] = "post:" .. tostring(job_id)
	return slurm.SUCCESS
end
return slurm.SUCCESS
"""


def _chained(text: str = SITE_FILTER, **kw: Any) -> Harness:
    return Harness(chain=check_site_cli_filter(text, "/etc/slurm/site_cli_filter.lua"), **kw)


def test_chained_site_filter_runs_first_then_colloc(tmp_path: Path) -> None:
    s = tmp_path / "m.txt"
    s.write_text("mib=7000 margin=500\n")
    h = _chained()
    g = h.lua.globals()
    opts = h.lua.eval("{}")
    assert g.slurm_cli_setup_defaults(opts, False) == 0 and opts.account == "site-default"
    rc, opts = h.pre_submit({"colloc": str(s), "colloc-batch-size": "32"}, comment="mine")
    assert rc == 0, h.errors
    # the site's change is kept and colloc's record goes in front of it
    assert opts.comment == "colloc-estimate:v1:mib=7000,margin=500,est=fake,fp=00ff32 mine [site]"
    assert g.slurm_cli_post_submit(0, 42, 0) == 0
    assert list(g.seen.values()) == ["defaults", "pre", "post:42"]


def test_chained_site_refusal_stands_and_colloc_does_not_run() -> None:
    h = _chained(estimator=Path("/nonexistent"))
    rc, opts = h.pre_submit({"colloc": "m.txt", "colloc-batch-size": "1"}, comment="forbidden")
    assert rc == -1 and h.errors == ["site: no such comment"]  # colloc's estimate never ran
    assert opts.comment == "forbidden"


def test_chained_site_code_other_than_error_is_passed_on() -> None:
    h = _chained("function slurm_cli_pre_submit(o, p) return 2007 end\n")
    rc, _ = h.pre_submit(None)
    assert rc == 2007
    # functions the site does not define: colloc's answer alone
    assert h.lua.globals().slurm_cli_setup_defaults(h.lua.eval("{}"), True) == 0


def test_site_filter_that_fails_to_load_fails_every_command() -> None:
    h = _chained("function slurm_cli_pre_submit(o, p) return 0 end\nerror('boom')\n")
    rc, _ = h.pre_submit(None)
    assert rc == -1
    assert any("did not load" in e and "boom" in e for e in h.errors), h.errors


def test_site_filter_checked_before_embedding() -> None:
    with pytest.raises(InstallError, match="defines no slurm_cli_pre_submit"):
        check_site_cli_filter("x = 1\n", "s.lua")
    with pytest.raises(InstallError, match=r"not valid Lua 5\.1"):
        check_site_cli_filter(SITE_FILTER + "if x then\n", "s.lua")
    own = render_cli_filter(SiteSettings(shard_mib=1024, gpu_memory_mib=40960))
    with pytest.raises(InstallError, match=r"colloc's own cli_filter\.lua"):
        check_site_cli_filter(own, "/etc/slurm/cli_filter.lua")


def test_site_filter_closing_brackets_survive_embedding() -> None:
    text = "function slurm_cli_pre_submit(o, p) o.comment = ']]]=]' return 0 end\n"
    h = _chained(text)
    rc, opts = h.pre_submit(None)
    assert rc == 0 and opts.comment == "]]]=]"
