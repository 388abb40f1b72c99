"""A site's own hooks kept beside colloc's: slurm.conf read as Slurm reads it (several
Prolog/Epilog lines, globs, comma lists), the install plan's lines, doctor's view."""

from __future__ import annotations

import sys
from pathlib import Path

from slurm_colloc.config import CollocConfig
from slurm_colloc.site import chain, doctor
from slurm_colloc.site import install as site

SITE_CONF = """\
ClusterName=gpu  # trailing comment
Prolog=/etc/slurm/healthcheck.sh
Prolog=/usr/local/jobstats/prolog.d/*
Epilog=/etc/slurm/slurm.epilog.clean
TaskProlog=/etc/slurm/task_prolog.sh
CliFilterPlugins=syslog
JobSubmitPlugins=all_partitions,lua
PrologFlags=X11
NodeName=n1 Prolog=/not/a/cluster/key
"""
BIN = Path("/opt/colloc/bin")


def _lines(hooks: chain.Hooks | None) -> list[str]:
    return site.site_slurm_conf(Path("/etc/slurm"), BIN, hooks)


def test_conf_values_keeps_every_line_in_order() -> None:
    v = chain.conf_values(SITE_CONF + "Epilog=/a Prolog=/b\n")
    assert v["prolog"] == ["/etc/slurm/healthcheck.sh", "/usr/local/jobstats/prolog.d/*", "/b"]
    assert v["epilog"] == ["/etc/slurm/slurm.epilog.clean", "/a"]
    assert v["clustername"] == ["gpu"]  # comment stripped
    assert "nodename" not in v


def test_without_site_hooks_the_lines_are_unchanged() -> None:
    lines = _lines(None)
    assert "CliFilterPlugins=lua" in lines and "JobSubmitPlugins=lua" in lines
    assert f"Prolog={BIN}/colloc-prolog" in lines and "PrologFlags=Alloc,Contain" in lines
    assert _lines({}) == lines


def test_site_prolog_and_epilog_lines_stay_and_collocs_is_one_more() -> None:
    lines = _lines(chain.conf_values(SITE_CONF))
    text = "\n".join(lines)
    # the site's own lines are not reprinted (they stay where they are) but named
    assert "Prolog=/etc/slurm/healthcheck.sh" not in lines
    assert "keep your Prolog=/etc/slurm/healthcheck.sh, Prolog=/usr/local/jobstats/prolog.d/*" \
        in text
    assert f"Prolog={BIN}/colloc-prolog" in lines
    assert f"Epilog={BIN}/colloc-epilog" in lines
    assert "keep your Epilog=/etc/slurm/slurm.epilog.clean" in text


def test_site_task_prolog_is_chained_not_dropped() -> None:
    lines = _lines(chain.conf_values(SITE_CONF))
    assert f"TaskProlog={BIN}/colloc-task-prolog" in lines
    assert any('chain_task_prolog = "/etc/slurm/task_prolog.sh"' in ln for ln in lines)
    assert any("replaces your TaskProlog=/etc/slurm/task_prolog.sh" in ln for ln in lines)


def test_plugin_lists_and_flags_are_merged() -> None:
    lines = _lines(chain.conf_values(SITE_CONF))
    assert "CliFilterPlugins=syslog,lua" in lines
    assert "JobSubmitPlugins=all_partitions,lua" in lines  # lua already: not twice
    assert "PrologFlags=X11,Alloc,Contain" in lines
    assert any("put back CliFilterPlugins=syslog" in ln for ln in lines)
    assert any("--chain-job-submit" in ln for ln in lines)  # the site's job_submit.lua
    assert not any("--chain-cli-filter" in ln for ln in lines)  # no cli_filter.lua yet


def test_collocs_own_lines_are_not_taken_for_the_sites() -> None:
    ours = "\n".join(ln for ln in _lines(None) if not ln.startswith("#")) + "\n"
    again = _lines(chain.conf_values(ours))  # install re-run on an installed site
    assert [ln for ln in again if not ln.startswith("#")] == \
        [ln for ln in _lines(None) if not ln.startswith("#")]
    assert not any("keep your" in ln or "replaces your" in ln for ln in again)


def test_plan_shows_the_merged_lines_between_the_markers(tmp_path: Path) -> None:
    s = site.SiteSettings(shard_mib=1024, gpu_memory_mib=40960)
    text = site.render_plan(tmp_path, tmp_path / "lib", s, hooks=chain.conf_values(SITE_CONF))
    block = text.split(site.BEGIN_MARK, 1)[1].split(site.END_MARK, 1)[0]
    assert "CliFilterPlugins=syslog,lua" in block and "TaskProlog=" in block


def test_globs_are_expanded_for_the_checks(tmp_path: Path) -> None:
    d = tmp_path / "prolog.d"
    d.mkdir()
    for n in ("b", "a"):
        (d / n).touch()
    hooks = {"prolog": [f"{d}/*", "/x/colloc-prolog"], "taskprolog": ["/t1", "/t2"]}
    assert chain.node_scripts(hooks, "Prolog") == [f"{d}/a", f"{d}/b", "/x/colloc-prolog"]
    assert chain.node_scripts(hooks, "TaskProlog") == ["/t2"]  # Slurm takes the last
    assert chain.colloc_among(["/s/a", "/x/colloc-prolog"], "colloc-prolog") == \
        "/x/colloc-prolog"
    assert chain.colloc_among(["/s/wrapper"], "colloc-prolog") == "/s/wrapper"
    assert chain.colloc_among(["/s/a", "/s/b"], "colloc-prolog") is None


def _exe(p: Path, text: str = "#!/bin/sh\n") -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    p.chmod(0o755)
    return p


def test_doctor_accepts_colloc_among_several_scripts(tmp_path: Path) -> None:
    health = _exe(tmp_path / "site" / "healthcheck.sh")
    prolog = _exe(tmp_path / "bin" / "colloc-prolog", f"#!{sys.executable}\n")
    epilog = _exe(tmp_path / "bin" / "colloc-epilog", f"#!{sys.executable}\n")
    clean = _exe(tmp_path / "site" / "slurm.epilog.clean")
    conf = tmp_path / "slurm.conf"
    conf.write_text(f"Prolog={health}\nProlog={prolog}\nEpilog={epilog}\nEpilog={clean}\n"
                    f"TaskProlog={_exe(tmp_path / 'bin' / 'colloc-task-prolog')}\n"
                    "PrologFlags=Alloc,Contain\n")
    found = {f.what: f for f in doctor.check_wiring(conf)}
    assert found["slurm.conf prolog"].level == "ok"
    assert str(health) in found["slurm.conf prolog"].detail
    assert found["slurm.conf epilog"].level == "ok"  # colloc's is not the last line
    versions = {f.what: f for f in doctor.check_scripts(conf, which=lambda n: None)}
    assert versions["slurm.conf prolog version"].level == "ok"  # colloc's, not the site's
    assert versions["slurm.conf epilog version"].level == "ok"


def test_doctor_flags_site_scripts_without_collocs_and_broken_ones(tmp_path: Path) -> None:
    a, b = _exe(tmp_path / "a.sh"), _exe(tmp_path / "b.sh")
    conf = tmp_path / "slurm.conf"
    conf.write_text(f"Prolog={a}\nProlog={b}\nEpilog={a}\nEpilog=/nowhere/colloc-epilog\n")
    found = {f.what: f for f in doctor.check_wiring(conf)}
    assert found["slurm.conf prolog"].level == "warn"
    assert "none is colloc's colloc-prolog" in found["slurm.conf prolog"].detail
    assert found["slurm.conf epilog"].level == "fail"  # a missing script fails jobs


def test_doctor_checks_the_chained_task_prolog(tmp_path: Path) -> None:
    conf = tmp_path / "slurm.conf"
    conf.write_text("PrologFlags=Alloc\n")
    site_tp = _exe(tmp_path / "site" / "task_prolog.sh")
    ok = {f.what: f for f in doctor.check_wiring(conf, CollocConfig(
        chain_task_prolog=str(site_tp)))}
    assert ok["chain_task_prolog"].level == "ok"
    site_tp.chmod(0o777)
    bad = {f.what: f for f in doctor.check_wiring(conf, CollocConfig(
        chain_task_prolog=str(site_tp)))}
    assert bad["chain_task_prolog"].level == "fail"
    assert "writable by others" in bad["chain_task_prolog"].detail
