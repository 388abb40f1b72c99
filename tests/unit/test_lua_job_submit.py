"""job_submit.lua against a fake ``slurm`` table (lupa's LuaJIT is Lua 5.1-compatible)."""

from __future__ import annotations

from typing import Any

import pytest

lupa = pytest.importorskip("lupa.lua51", reason="lupa (dev extra) runs the Lua filters")

from slurm_colloc.accounting.submit_record import parse_record  # noqa: E402
from slurm_colloc.site.install import (  # noqa: E402
    SharedPartition,
    SiteScript,
    SiteSettings,
    render_job_submit,
)

NO_VAL = 4294967294
# like the devcluster: its one partition "gpu" (Slurm's default) is listed as shared
SETTINGS = SiteSettings(shard_mib=1024, gpu_memory_mib=40960, trusted_uids=(0, 64030),
                        shared_partitions=(SharedPartition("gpu", 40960, 40960),))


# Slurm 22.05 (src/lua/slurm_lua.c) defines the log functions in Lua as
# ``slurm.user_msg(string.format(unpack({...})))``: the first argument is a FORMAT, so a
# ``%s`` in user text without an argument raises a Lua error inside slurmctld.
_LOG = "function(sink) return function(...) sink(string.format(unpack({...}))) end end"
# job_desc / job_rec are userdata proxies in slurmctld: every assignment goes through the
# C setter, which takes a string or number (nil is an error) and turns "" into NULL.
# Slurm 24.11+ refuses the job when the script wrote a TRES request in the 22.05
# spelling "gres:NAME" ("Invalid Trackable RESource (TRES) specification"); the proxy
# raises at once, so every test that makes the filter write one fails.
_JOB = """function(store)
    return setmetatable({}, {
        __index = store,
        __newindex = function(_, k, v)
            if v == nil then error("bad argument #3 to '__newindex' (got nil)") end
            if string.sub(k, 1, 9) == "tres_per_" and type(v) == "string"
                and string.find(string.lower(v), "gres:", 1, true) then
                error("Invalid Trackable RESource (TRES) specification: " .. v)
            end
            if v == "" then v = nil end
            store[k] = v
        end,
    })
end"""


# part_list as slurmctld 22.05 passes it: partition records keyed by name, read through
# an __index metamethod (job_submit_lua.c _part_rec_field: name, flag_default, ...).
_PART = """function(name, is_default)
    return setmetatable({}, { __index = function(_, k)
        if k == "name" then return name end
        if k == "flag_default" then return is_default end
        return nil
    end })
end"""


class Harness:
    def __init__(self, settings: SiteSettings = SETTINGS, chain: SiteScript | None = None,
                 partitions: tuple[str, ...] = ("gpu",), default: str | None = "gpu") -> None:
        self.lua = lupa.LuaRuntime(unpack_returned_tuples=True)
        self.user_msgs: list[str] = []
        self.info: list[str] = []
        fake = self.lua.eval("{}")
        fake.SUCCESS, fake.ERROR = 0, -1
        log = self.lua.eval(_LOG)
        fake.log_user = log(lambda s: self.user_msgs.append(str(s)))
        fake.log_info = log(lambda s: self.info.append(str(s)))
        fake.log_error = log(lambda s: self.info.append(str(s)))
        fake.log_verbose = log(lambda s: None)
        fake.log_debug = log(lambda s: None)
        self.lua.globals().slurm = fake
        self._job = self.lua.eval(_JOB)
        part = self.lua.eval(_PART)
        self.part_list = self.lua.eval("{}")
        for name in partitions:
            self.part_list[name] = part(name, 1 if name == default else 0)
        self.lua.execute(render_job_submit(settings, chain))

    def job(self, **fields: Any) -> Any:
        """A job_desc/job_rec proxy holding ``fields`` (set as Slurm would, not via Lua)."""
        store = self.lua.eval("{}")
        for k, v in fields.items():
            store[k] = v
        return self._job(store)

    def submit(self, spank: dict[str, str] | None = None, uid: int = 1000, **fields: Any):
        fields.setdefault("min_nodes", NO_VAL)
        if spank is not None:
            env = self.lua.eval("{}")
            for i, (k, v) in enumerate(spank.items()):
                env[i] = f"_SLURM_SPANK_OPTION_colloc_{k}={v}"
            fields["spank_job_env"] = env
        job = self.job(**fields)
        rc = self.lua.globals().slurm_job_submit(job, self.part_list, uid)
        return rc, job


@pytest.fixture
def h() -> Harness:
    return Harness()


def test_estimate_becomes_shards_and_record(h: Harness) -> None:
    rc, job = h.submit({"colloc": "m.txt", "colloc_batch_size": "32"},
                       comment="colloc-estimate:v1:mib=7000,margin=500,est=layer-aware,"
                       "fp=ABCD12 mine")
    assert rc == 0
    assert job.tres_per_node == "gres/shard:7"
    assert job.comment == "mine"
    assert job.max_nodes == 1
    rec = parse_record(job.admin_comment)
    assert rec is not None and rec.mode == "estimate"
    assert (rec.need_mib, rec.shards, rec.alloc_mib) == (7000, 7, 7168)  # margin is inside mib
    assert (rec.estimator, rec.est_mib, rec.margin_mib, rec.fingerprint) == (
        "layer-aware", 7000, 500, "abcd12")
    assert set(job.admin_comment) <= set("abcdefghijklmnopqrstuvwxyz0123456789._=,:-")


@pytest.mark.parametrize("size,shards", [("8G", 8), ("7500M", 8), ("1024", 1), ("1", 1),
                                         ("1.5GiB", 2), ("40G", 40), ("512K", 1)])
def test_explicit_sizes(h: Harness, size: str, shards: int) -> None:
    rc, job = h.submit({"colloc_mem": size})
    assert rc == 0, h.user_msgs
    assert job.tres_per_node == f"gres/shard:{shards}"
    assert parse_record(job.admin_comment).mode == "explicit"  # type: ignore[union-attr]


def test_no_estimate_gets_whole_gpu_and_says_so(h: Harness) -> None:
    rc, job = h.submit({"colloc": "m.txt", "colloc_batch_size": "8"})
    assert rc == 0
    assert job.tres_per_node == "gres/shard:40"
    rec = parse_record(job.admin_comment)
    assert rec is not None and rec.mode == "default" and rec.why == "no-estimate"
    assert any("whole GPU" in m and "bypassed" in m for m in h.user_msgs)


def test_bare_colloc_null_value(h: Harness) -> None:
    rc, job = h.submit({"colloc": "(null)"})
    assert rc == 0 and job.tres_per_node == "gres/shard:40"
    assert parse_record(job.admin_comment).why == "no-size"  # type: ignore[union-attr]


def test_site_default_size() -> None:
    h = Harness(SiteSettings(shard_mib=1024, gpu_memory_mib=40960, default_colloc_mib=10000))
    rc, job = h.submit({"colloc": "(null)"})
    assert rc == 0 and job.tres_per_node == "gres/shard:10"


def test_keeps_other_gres(h: Harness) -> None:
    rc, job = h.submit({"colloc_mem": "2G"}, tres_per_node="gres/nvme:1")
    assert rc == 0 and job.tres_per_node == "gres/nvme:1,gres/shard:2"


@pytest.mark.parametrize("fields,spank,needle", [
    ({"tres_per_node": "gres/gpu:1"}, {"colloc_mem": "2G"}, "--gres=gpu"),
    ({"tres_per_job": "gres/gpu:2"}, {"colloc": "(null)"}, "--gres=gpu"),
    ({"tres_per_task": "gres/gpu:1"}, {"colloc": "(null)"}, "--gres=gpu"),
    ({"tres_per_node": "gres/shard:4"}, {"colloc": "(null)"}, "--colloc-mem"),
    ({"min_nodes": 2}, {"colloc": "(null)"}, "one node"),
    ({}, {"colloc_mem": "41G"}, "one GPU offers at most 40960 MiB"),
    ({}, {"colloc_mem": "8X"}, "expected a size"),
    ({}, {"colloc_mem": "-3"}, "expected a size"),
    ({"comment": "colloc-estimate:v1:mib=42000,margin=2000,est=x,fp=00"},
     {"colloc": "m", "colloc_batch_size": "1"}, "needs 42000 MiB"),
    ({"comment": "colloc-estimate:v1:mib=100,margin=200,est=x,fp=00"}, {"colloc": "m"},
     "within mib"),
    ({"comment": "colloc-estimate:v1:mib=abc,margin=0,est=x,fp=00"}, {"colloc": "m"},
     "malformed"),
    ({"comment": "colloc-estimate:v1:mib=10,margin=0,est=BAD NAME,fp=00"}, {"colloc": "m"},
     "malformed"),
    ({"comment": "colloc-estimate:v1:mib=10,margin=0,est=x,fp=xyz"}, {"colloc": "m"},
     "fingerprint"),
    ({"comment": "colloc-estimate:v9:mib=10"}, {"colloc": "m"}, "version"),
    ({"comment": "colloc-estimate:v1:mib=0,margin=0,est=x,fp=00"}, {"colloc": "m"},
     "positive"),
])
def test_rejections(h: Harness, fields: dict[str, Any], spank: dict[str, str],
                    needle: str) -> None:
    rc, _job = h.submit(spank, **fields)
    assert rc not in (0, None)
    assert any(needle in m for m in h.user_msgs), h.user_msgs
    assert all(m.startswith("colloc: ") for m in h.user_msgs)


def test_plain_shard_job_is_recorded(h: Harness) -> None:
    rc, job = h.submit(None, tres_per_node="gres/shard:5")
    assert rc == 0 and job.tres_per_node == "gres/shard:5"
    rec = parse_record(job.admin_comment)
    assert rec is not None and rec.mode == "shards" and rec.alloc_mib == 5120


def test_plain_shard_job_larger_than_gpu_refused(h: Harness) -> None:
    rc, _ = h.submit(None, tres_per_node="gres/shard:41")
    assert rc != 0 and "does not fit one GPU" in h.user_msgs[0]


def test_ordinary_job_untouched(h: Harness) -> None:
    rc, job = h.submit(None, tres_per_node="gres/gpu:2", comment="hello")
    assert rc == 0 and job.tres_per_node == "gres/gpu:2" and job.admin_comment is None
    assert job.comment == "hello"


def test_other_spank_plugins_ignored(h: Harness) -> None:
    env = h.lua.eval("{[0] = '_SLURM_SPANK_OPTION_pyxis_image=x', [1] = 'SPANK_FOO=1'}")
    rc, job = h.submit(None, spank_job_env=env)
    assert rc == 0 and job.admin_comment is None and job.tres_per_node is None


def _modify(h: Harness, uid: int, admin_comment: str | None, **fields: Any) -> int:
    desc, rec = h.job(**fields), h.job(admin_comment=admin_comment, job_id=42)
    return int(h.lua.globals().slurm_job_modify(desc, rec, None, uid))


def test_modify_guards_colloc_jobs(h: Harness) -> None:
    ac = "colloc1:mode=explicit,need_mib=2048,shards=2,shard_mib=1024,alloc_mib=2048"
    assert _modify(h, 1000, ac, tres_per_node="gres/shard:40") != 0
    assert "fixed at submission" in h.user_msgs[-1]
    assert _modify(h, 1000, ac, time_limit=10) == 0
    assert _modify(h, 0, ac, tres_per_node="gres/shard:40") == 0  # the epilog's requeue
    assert _modify(h, 64030, ac, tres_per_node="gres/shard:40") == 0  # SlurmUser
    # a user's update cannot turn a plain job into a GPU job (security issue 11, M4)
    assert _modify(h, 1000, None, tres_per_node="gres/gpu:1") != 0
    assert _modify(h, 1000, None, tres_per_node="gres/nvme:1") == 0


def test_log_lines_have_prefix(h: Harness) -> None:
    h.submit({"colloc_mem": "2G"})
    assert any(s.startswith("colloc: job_submit: uid 1000: colloc1:") for s in h.info)


@pytest.mark.parametrize("fields", [
    {"tres_per_node": "gres/gpu:1"},
    {"tres_per_node": "gres/gpu:a100:1"},
    {"tres_per_job": "gres/gpu:1"},
    {"tres_per_node": "gres/gpu"},
])
def test_one_whole_gpu_becomes_all_shards_of_one_gpu(h: Harness, fields: dict[str, Any]) -> None:
    rc, job = h.submit(None, **fields)
    assert rc == 0
    assert job.tres_per_node == "gres/shard:40"
    assert job.tres_per_job in (None, "")
    rec = parse_record(job.admin_comment)
    assert rec is not None and rec.mode == "whole" and rec.shards == 40


@pytest.mark.parametrize("fields", [
    {"tres_per_node": "gres/gpu:4"},
    {"tres_per_node": "gres/gpu:2"},
    {"tres_per_job": "gres/gpu:2"},
    {"tres_per_node": "gres/gpu:a100:2", "shared": 65534},  # NO_VAL16: Slurm's "not given"
])
def test_several_gpus_keep_their_gpus_and_share_the_node(h: Harness,
                                                        fields: dict[str, Any]) -> None:
    """Slurm 24.11+ never gives a shard GPU to a gres/gpu job (tests/e2e/
    test_gpu_shard_overlap.py): a multi-GPU job keeps gres/gpu:N as submitted and is no
    longer given its nodes exclusively (the 22.05 rule set job_desc.shared = 0)."""
    rc, job = h.submit(None, **fields)
    assert rc == 0, h.user_msgs
    for f in ("tres_per_node", "tres_per_job", "tres_per_task", "tres_per_socket"):
        assert getattr(job, f) == fields.get(f), f
    assert job.shared == fields.get("shared")  # never set to 0 (exclusive)
    assert job.admin_comment is None
    assert any("left as submitted (gres/gpu)" in m for m in h.info), h.info


def test_jobs_without_gpus_are_untouched(h: Harness) -> None:
    rc, job = h.submit(None, tres_per_node="gres/license:1")
    assert rc == 0 and job.tres_per_node == "gres/license:1" and job.shared is None


# ------------------------------------------------------------------ TRES spelling (24.11+)
# Slurm 24.11+ hands a user's --gres=gpu:1 / --gpus=1 to job_submit.lua as "gres/gpu:1"
# and refuses a job whose job_submit.lua wrote "gres:shard:K" ("Invalid Trackable
# RESource (TRES) specification"). The filter reads both spellings and writes only
# the slash form.
SPELLINGS = ["gres/", "gres:", "GRES/"]


def _slash_only(job: Any) -> None:
    for f in ("tres_per_node", "tres_per_job", "tres_per_task", "tres_per_socket"):
        value = getattr(job, f)
        assert value is None or "gres:" not in value.lower(), (f, value)


@pytest.mark.parametrize("prefix", SPELLINGS)
@pytest.mark.parametrize("field", ["tres_per_node", "tres_per_job"])
def test_one_gpu_in_either_spelling_becomes_slash_shards(h: Harness, prefix: str,
                                                         field: str) -> None:
    rc, job = h.submit(None, **{field: f"{prefix}gpu:1"})
    assert rc == 0, h.user_msgs
    assert job.tres_per_node == "gres/shard:40"
    assert parse_record(job.admin_comment).mode == "whole"  # type: ignore[union-attr]
    _slash_only(job)


@pytest.mark.parametrize("prefix", SPELLINGS)
def test_colloc_job_writes_slash_shards_and_normalises_kept_gres(h: Harness,
                                                                 prefix: str) -> None:
    rc, job = h.submit({"colloc_mem": "3G"}, tres_per_node=f"{prefix}nvme:1")
    assert rc == 0, h.user_msgs
    assert job.tres_per_node == "gres/nvme:1,gres/shard:3"


@pytest.mark.parametrize("prefix", SPELLINGS)
def test_whole_gpu_keeps_other_gres_in_slash_form(h: Harness, prefix: str) -> None:
    rc, job = h.submit(None, tres_per_node=f"{prefix}nvme:2,{prefix}gpu:a100:1")
    assert rc == 0, h.user_msgs
    assert job.tres_per_node == "gres/nvme:2,gres/shard:40"


@pytest.mark.parametrize("prefix", SPELLINGS)
def test_gpu_requests_in_either_spelling_are_seen(h: Harness, prefix: str) -> None:
    # a --colloc job with a GPU request is refused whichever way Slurm spells it
    rc, _ = h.submit({"colloc_mem": "2G"}, tres_per_node=f"{prefix}gpu:1")
    assert rc not in (0, None) and "--gres=gpu" in h.user_msgs[-1]
    # several GPUs: the request as Slurm gave it, the node shared (not exclusive)
    rc, job = h.submit(None, tres_per_node=f"{prefix}gpu:4")
    assert rc == 0 and job.shared is None and job.tres_per_node == f"{prefix}gpu:4"
    # a user's update adding a GPU is refused in either spelling
    assert _modify(h, 1000, None, tres_per_node=f"{prefix}gpu:1") != 0


@pytest.mark.parametrize("prefix", SPELLINGS)
def test_plain_shards_in_either_spelling_are_recorded_and_bounded(h: Harness,
                                                                  prefix: str) -> None:
    rc, job = h.submit(None, tres_per_node=f"{prefix}shard:5")
    assert rc == 0 and parse_record(job.admin_comment).shards == 5  # type: ignore[union-attr]
    rc, _ = h.submit(None, tres_per_node=f"{prefix}shard:41")
    assert rc not in (0, None) and "does not fit one GPU" in h.user_msgs[-1]


def test_unreadable_gpu_request_names_the_slash_form(h: Harness) -> None:
    rc, _ = h.submit({"colloc_mem": "2G"}, tres_per_node="gres/gpu:x:y:1")
    assert rc not in (0, None)
    assert "expected gres/NAME[:TYPE][:COUNT]" in h.user_msgs[-1]
