"""Supported Slurm releases (site/releases.py): parsing, the range, detection, and the
release a SPANK plugin was built for (install refuses mismatched headers)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest

from slurm_colloc.site import install as site
from slurm_colloc.site import releases as rel
from slurm_colloc.site.releases import SlurmRelease
from tests.unit.test_site_install import S, _admin, _tree


@pytest.mark.parametrize("text,want", [
    ("slurm 24.11.5\n", SlurmRelease(24, 11, 5)),
    ("slurm-wlm 22.05.8", SlurmRelease(22, 5, 8)),  # Debian's packaging name
    ("slurm 26.05.5", SlurmRelease(26, 5, 5)),
    ("slurm 25.05.0-0rc1", SlurmRelease(25, 5, 0, "-0rc1")),
    ("Slurm 25.11", SlurmRelease(25, 11, 0)),
])
def test_parse_release(text: str, want: SlurmRelease) -> None:
    assert rel.parse_release(text) == want


@pytest.mark.parametrize("text", ["", "sinfo: command not found", "slurm x.y", "24.11.5"])
def test_parse_release_needs_slurm_and_numbers(text: str) -> None:
    assert rel.parse_release(text) is None


@pytest.mark.parametrize("version,ok", [
    ("22.05.8", False), ("23.02.7", False), ("23.11.10", False), ("24.05.4", False),
    ("24.11.0", True), ("24.11.5", True), ("25.05.3", True), ("25.11.1", True),
    ("26.05.5", True), ("26.11.0", False), ("27.05.0", False),
])
def test_supported_range(version: str, ok: bool) -> None:
    r = rel.parse_release(f"slurm {version}")
    assert r is not None and r.supported is ok
    assert (rel.unsupported_reason(r) is None) is ok


def test_every_listed_release_is_in_the_range_and_nothing_else() -> None:
    listed = {f"{y}.{m:02d}" for y in range(20, 30) for m in (5, 11)
              if SlurmRelease(y, m).supported}
    assert listed == set(rel.SUPPORTED_RELEASES) == {"24.11", "25.05", "25.11", "26.05"}
    assert rel.SUPPORTED_RANGE == "24.11 <= Slurm < 26.11"


def test_reasons_say_what_to_do() -> None:
    old = rel.unsupported_reason(SlurmRelease(22, 5, 8))
    assert old is not None and "22.05.8 is not supported" in old and "upgrade Slurm" in old
    assert "24.11, 25.05, 25.11, 26.05" in old and "\n" not in old
    new = rel.unsupported_reason(SlurmRelease(26, 11, 0))
    assert new is not None and "newer than slurm-colloc supports" in new


def _which(found: dict[str, str]) -> object:
    return lambda name: found.get(name)


def test_detect_asks_sinfo_then_scontrol() -> None:
    calls: list[list[str]] = []

    def run(argv: Sequence[str]) -> tuple[int, str]:
        calls.append(list(argv))
        return (1, "sinfo: error: broken") if "sinfo" in argv[0] else (0, "slurm 26.05.5\n")

    got = rel.detect_release(run, _which({"sinfo": "/x/sinfo", "scontrol": "/x/scontrol"}))
    assert got == SlurmRelease(26, 5, 5)
    assert calls == [["/x/sinfo", "--version"], ["/x/scontrol", "--version"]]


def test_detect_without_tools_is_one_line() -> None:
    with pytest.raises(rel.ReleaseError) as e:
        rel.detect_release(lambda argv: (0, ""), _which({}))
    assert "sinfo: not on PATH" in str(e.value) and "scontrol: not on PATH" in str(e.value)
    assert "\n" not in str(e.value)


def test_check_supported_refuses_22_05() -> None:
    with pytest.raises(rel.ReleaseError, match=r"22\.05\.8 is not supported"):
        rel.check_supported(lambda argv: (0, "slurm-wlm 22.05.8"), _which({"sinfo": "/s"}))
    assert rel.check_supported(lambda argv: (0, "slurm 24.11.5"),
                               _which({"sinfo": "/s"})) == SlurmRelease(24, 11, 5)


def test_header_and_plugin_numbers() -> None:
    assert rel.release_of_number(0x180B05) == SlurmRelease(24, 11, 5)
    assert rel.parse_header_release("#define SLURM_VERSION_NUMBER 0x160508\n") == \
        SlurmRelease(22, 5, 8)
    assert rel.parse_header_release("nothing") is None
    blob = b"\x7fELF..." + rel.PLUGIN_MARK + b"0x1a0505\0more"
    assert rel.plugin_release(blob) == SlurmRelease(26, 5, 5)
    assert rel.plugin_release(b"\x7fELF (slurm-colloc, NVIDIA MPS)\0") is None


# ------------------------------------------------------------------ the plugin build
FAKE_SPANK_H = """#ifndef SPANK_H
#define SPANK_H
#include <slurm/slurm_version.h>
typedef struct spank_handle *spank_t;
typedef int (*spank_opt_cb_f)(int val, const char *optarg, int remote);
struct spank_option { char *name; char *arginfo; char *usage; int has_arg; int val;
                      spank_opt_cb_f cb; };
#define SPANK_OPTIONS_TABLE_END { NULL, NULL, NULL, 0, 0, NULL }
typedef enum { S_CTX_ERROR, S_CTX_LOCAL, S_CTX_REMOTE, S_CTX_ALLOCATOR, S_CTX_SLURMD,
               S_CTX_JOB_SCRIPT } spank_context_t;
typedef enum { ESPANK_SUCCESS = 0, ESPANK_ERROR = 1 } spank_err_t;
spank_context_t spank_context(void);
spank_err_t spank_option_register(spank_t sp, struct spank_option *opt);
const char *spank_strerror(spank_err_t err);
void slurm_error(const char *fmt, ...);
#define SPANK_PLUGIN(__name, __ver) \\
    const char plugin_name [] = #__name; \\
    const char plugin_type [] = "spank"; \\
    const unsigned int plugin_version = SLURM_VERSION_NUMBER; \\
    const unsigned int spank_plugin_version = __ver;
#endif
"""


def fake_headers(d: Path, number: int) -> Path:
    """Slurm-like headers (the parts colloc_spank.c uses) of release ``number``."""
    d.mkdir(parents=True)
    (d / "spank.h").write_text(FAKE_SPANK_H)
    (d / "slurm_version.h").write_text(f"#define SLURM_VERSION_NUMBER {number:#x}\n")
    return d


@pytest.mark.skipif(not (shutil.which("cc") and shutil.which("nm")), reason="needs cc and nm")
def test_built_plugin_carries_its_release_unexported(tmp_path: Path) -> None:
    inc = fake_headers(tmp_path / "slurm", 0x180B05)
    res = site.install(tmp_path / "etc", tmp_path / "lib", S, include=inc,
                       slurm_release=SlurmRelease(24, 11, 1))
    plugin = tmp_path / "lib" / site.PLUGIN_NAME
    assert res.plugin_release == SlurmRelease(24, 11, 5)
    assert rel.plugin_release(plugin.read_bytes()) == SlurmRelease(24, 11, 5)
    assert "colloc_built_for_slurm" not in site.exported_symbols(plugin)


def test_install_refuses_headers_of_another_release_before_writing(tmp_path: Path) -> None:
    inc = fake_headers(tmp_path / "slurm", 0x160508)
    with pytest.raises(site.InstallError) as e:
        site.install(tmp_path / "etc", tmp_path / "lib", S, include=inc,
                     slurm_release=SlurmRelease(24, 11, 5))
    assert "Slurm 22.05.8's" in str(e.value) and "runs Slurm 24.11.5" in str(e.value)
    assert not (tmp_path / "etc").exists() and not (tmp_path / "lib").exists()


# ------------------------------------------------------------------ colloc admin install
def test_install_cli_refuses_an_unsupported_release_with_one_line(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from slurm_colloc.cli.admin_cmd import admin
    from tests.unit.test_site_install import _colloc_conf, _fake_sinfo

    env = {"COLLOC_CONF": str(_colloc_conf(tmp_path)),
           "PATH": f"{_fake_sinfo(tmp_path, 'slurm-wlm 22.05.8')}:{os.environ['PATH']}"}
    r = CliRunner().invoke(admin, ["install", "--slurm-conf", str(tmp_path / "slurm.conf"),
                                   "--lib-dir", str(tmp_path / "lib"), "--gpu-memory-mib",
                                   "40960", "--apply"], env=env)
    assert r.exit_code != 0
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Slurm 22.05.8 is not supported" in lines[0]
    assert "24.11 <= Slurm < 26.11" in lines[0]
    assert _tree(tmp_path) == []


def test_install_plan_names_the_release_and_least_loaded_shards(tmp_path: Path) -> None:
    rc, out = _admin(["install", "--slurm-conf", str(tmp_path / "slurm.conf"), "--lib-dir",
                      str(tmp_path / "lib"), "--gpu-memory-mib", "40960"], tmp_path,
                     slurm="slurm 26.05.5")
    assert rc == 0, out
    assert "# Slurm: 26.05.5 (supported: 24.11 <= Slurm < 26.11)" in out
    lines = out.splitlines()
    assert "SelectTypeParameters=CR_Core_Memory,LL_SHARED_GRES" in lines
    i = lines.index("SelectTypeParameters=CR_Core_Memory,LL_SHARED_GRES")
    assert "least-loaded" in " ".join(lines[i - 4:i])
    assert "CgroupJobIdPaths=yes in cgroup.conf" in out  # 26.05: job_<id>, not the SLUID


def test_uninstall_never_lists_site_wide_select_lines(tmp_path: Path) -> None:
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "slurm.conf").write_text(
        "SelectType=select/cons_tres\nSelectTypeParameters=CR_Core_Memory,LL_SHARED_GRES\n"
        "GresTypes=gpu,shard\nJobSubmitPlugins=lua\n")
    plan = site.plan_uninstall(etc, tmp_path / "lib")
    assert plan.slurm_conf_lines == ["JobSubmitPlugins=lua"]
