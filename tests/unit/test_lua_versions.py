"""The Lua filters load under Lua 5.1 (Debian's Slurm) and 5.4 (EL9's Slurm links the
only Lua EL9 has, 5.4; docs/install-el9.md): a chained site script included.

Lua 5.2 removed ``loadstring``; the chained site script is loaded with ``load`` there.
The behaviour of the filters is tested under 5.1 by test_lua_job_submit.py and
test_lua_cli_filter.py; here the load of each file, as Slurm does it once at start.
"""

from __future__ import annotations

import lupa.lua51
import lupa.lua54
import pytest

from slurm_colloc.site import install as site

SLURM_STUB = ("slurm = {SUCCESS = 0, ERROR = -1, log_info = function(...) end, "
              "log_error = function(...) end, log_debug = function(...) end, "
              "log_verbose = function(...) end, log_user = function(...) end, "
              "user_msg = function(...) end}")
SUBMIT_SITE = ("SITE_LOADED = _VERSION\n"
               "function slurm_job_submit(job_desc, part_list, submit_uid)\n"
               "  return slurm.SUCCESS\nend\n"
               "function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)\n"
               "  return slurm.SUCCESS\nend\n")
CLI_SITE = ("SITE_LOADED = _VERSION\n"
            "function slurm_cli_pre_submit(options, pack_offset)\n"
            "  return slurm.SUCCESS\nend\n")


def _rendered(which: str) -> str:
    s = site.SiteSettings(shard_mib=1024, gpu_memory_mib=40960)
    if which == "job_submit":
        return site.render_job_submit(s, site.check_site_job_submit(SUBMIT_SITE, "site.lua"))
    return site.render_cli_filter(s, site.check_site_cli_filter(CLI_SITE, "site.lua"))


@pytest.mark.parametrize("runtime", [lupa.lua51, lupa.lua54], ids=["lua5.1", "lua5.4"])
@pytest.mark.parametrize("which", ["job_submit", "cli_filter"])
def test_the_filter_and_its_chained_site_script_load(runtime: object, which: str) -> None:
    rt = runtime.LuaRuntime(unpack_returned_tuples=True)  # type: ignore[attr-defined]
    rt.execute(SLURM_STUB)
    rt.execute(_rendered(which))
    # the site's script was loaded and ran, in this Lua (a load error leaves it unset)
    assert rt.eval("_VERSION") == rt.globals().SITE_LOADED


def test_lua_5_4_has_no_loadstring_so_the_check_means_something() -> None:
    rt = lupa.lua54.LuaRuntime()
    assert rt.eval("loadstring") is None and rt.eval("_VERSION") == "Lua 5.4"
