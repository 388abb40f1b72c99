"""job_submit.lua's scope (issue 13, item 4): opt-in by default, shared partitions with
their own GPU sizes, and a site's own job_submit.lua chained before colloc's."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("lupa.lua51", reason="lupa (dev extra) runs the Lua filters")

from slurm_colloc.accounting.submit_record import parse_record
from slurm_colloc.config import CollocConfig
from slurm_colloc.site import install as site
from slurm_colloc.site.install import SiteScript, SiteSettings
from tests.unit.test_lua_job_submit import NO_VAL, Harness

OPT_IN = SiteSettings(shard_mib=1024, gpu_memory_mib=40960, trusted_uids=(0, 64030))
# two shared partitions of different GPU sizes, sized through the budget (2 x 64 MiB of
# MPS servers per GPU): 40832 MiB -> 39 shards, 81792 MiB -> 79 shards
CFG = CollocConfig(shared_partitions=("small:40960", "big:81920"), gpu_memory_mib=40960)
LISTED = site.settings_from_config(CFG, trusted_uids=[64030])
PARTS = ("small", "big", "cpu", "gpu2")

ONE_GPU = [
    {"tres_per_node": "gres/gpu:1"},
    {"tres_per_node": "gres/gpu:a100:1"},
    {"tres_per_job": "gres/gpu:1"},
]
MULTI_GPU = [
    {"tres_per_node": "gres/gpu:4"},
    {"tres_per_job": "gres/gpu:2"},
    {"tres_per_task": "gres/gpu:1"},
    {"tres_per_socket": "gres/gpu:1"},
    {"tres_per_job": "gres/gpu:1", "min_nodes": 2},
]


def listed(default: str | None = "cpu", chain: SiteScript | None = None) -> Harness:
    return Harness(LISTED, chain=chain, partitions=PARTS, default=default)


def _untouched(job: Any, fields: dict[str, Any]) -> None:
    for f in ("tres_per_node", "tres_per_job", "tres_per_task", "tres_per_socket"):
        assert getattr(job, f) == fields.get(f), f
    assert job.admin_comment is None
    assert job.shared is None


def _refused(h: Harness, rc: Any, needle: str) -> None:
    assert rc not in (0, None), h.user_msgs
    assert any(needle in m for m in h.user_msgs), h.user_msgs


# ------------------------------------------------------------------ opt-in (nothing listed)
@pytest.mark.parametrize("fields", ONE_GPU + MULTI_GPU)
@pytest.mark.parametrize("partition", [None, "gpu"])
def test_opt_in_leaves_gpu_jobs_as_submitted(fields: dict[str, Any], partition: str | None
                                             ) -> None:
    h = Harness(OPT_IN)
    extra: dict[str, Any] = {"partition": partition} if partition else {}
    rc, job = h.submit(None, **fields, **extra)
    assert rc == 0, h.user_msgs
    _untouched(job, fields)
    assert job.partition == partition


def test_opt_in_still_handles_colloc_and_shard_jobs() -> None:
    h = Harness(OPT_IN)
    rc, job = h.submit({"colloc_mem": "8G"})
    assert rc == 0 and job.tres_per_node == "gres/shard:8"
    assert job.partition is None  # no partition to send it to: Slurm's default
    rc, job = h.submit({"colloc_mem": "8G"}, partition="anything")
    assert rc == 0 and job.partition == "anything"
    rc, job = h.submit(None, tres_per_node="gres/shard:5")
    assert rc == 0 and parse_record(job.admin_comment).mode == "shards"  # type: ignore[union-attr]
    rc, _ = h.submit(None, tres_per_node="gres/shard:41")
    _refused(h, rc, "does not fit one GPU")
    rc, _ = h.submit(None, tres_per_node="gres/gpu:1,gres:shard:5")
    _refused(h, rc, "whole GPUs and shards together")


def test_opt_in_refuses_unreadable_shards_but_not_unreadable_gpus() -> None:
    h = Harness(OPT_IN)
    rc, job = h.submit(None, tres_per_node="gres/gpu:x:y:1")
    assert rc == 0 and job.tres_per_node == "gres/gpu:x:y:1" and job.admin_comment is None
    rc, _ = h.submit(None, tres_per_node="gres/shard:x:y:1")
    _refused(h, rc, "cannot read")


def test_opt_in_user_may_add_gpus_by_update_but_not_shards() -> None:
    h = Harness(OPT_IN)
    g = h.lua.globals()
    rec = h.job(job_id=7, partition="gpu")
    assert g.slurm_job_modify(h.job(tres_per_node="gres/gpu:2"), rec, None, 1000) == 0
    assert g.slurm_job_modify(h.job(tres_per_node="gres/shard:2"), rec, None, 1000) != 0


# ------------------------------------------------------------------ listed partitions
def test_settings_carry_each_partition_size_through_the_budget() -> None:
    sizes = {p.name: (p.gpu_memory_mib, p.usable_mib, p.shards_per_gpu(1024))
             for p in LISTED.shared_partitions}
    assert sizes == {"small": (40960, 40832, 39), "big": (81920, 81792, 79)}
    js = site.render_job_submit(LISTED)
    assert 'shared_partitions = { "small", "big" },' in js
    assert 'partition_gpu_mib = { ["small"] = 40832, ["big"] = 81792 },' in js


@pytest.mark.parametrize("partition,default,shards", [
    ("small", "cpu", 39), ("big", "cpu", 79), (None, "big", 79), (None, "small", 39),
    ("big,big", "cpu", 79),
])
@pytest.mark.parametrize("fields", ONE_GPU)
def test_one_gpu_in_a_shared_partition_becomes_its_gpu_in_shards(
        fields: dict[str, Any], partition: str | None, default: str, shards: int) -> None:
    h = listed(default)
    extra: dict[str, Any] = {"partition": partition} if partition else {}
    rc, job = h.submit(None, **fields, **extra)
    assert rc == 0, h.user_msgs
    assert job.tres_per_node == f"gres/shard:{shards}"
    assert job.tres_per_job is None
    rec = parse_record(job.admin_comment)
    assert rec is not None and rec.mode == "whole" and rec.shards == shards
    assert job.partition == partition  # the partition stays the job's


@pytest.mark.parametrize("fields", MULTI_GPU)
@pytest.mark.parametrize("partition", ["small", "big", "small,cpu", None])
def test_multi_gpu_in_a_shared_partition_keeps_its_gpus_and_shares_the_node(
        fields: dict[str, Any], partition: str | None) -> None:
    """Slurm 24.11+ keeps gres/gpu and gres/shard of one GPU apart (seen:
    tests/e2e/test_gpu_shard_overlap.py), so a multi-GPU job is left as submitted: no
    shards, no record, and not exclusive (22.05's rule set shared = 0)."""
    h = listed("small")
    extra: dict[str, Any] = {"partition": partition} if partition else {}
    rc, job = h.submit(None, **fields, **extra)
    assert rc == 0, h.user_msgs
    _untouched(job, fields)
    assert job.partition == partition


@pytest.mark.parametrize("partition", ["small,big", "small,cpu", "cpu,big"])
def test_one_gpu_over_mixed_partitions_keeps_its_gpu_and_shares_the_node(partition: str
                                                                          ) -> None:
    """No one shard count is one GPU everywhere it may run: it keeps gres/gpu:1, which
    Slurm never places on a GPU shard jobs hold; the node is not taken exclusively."""
    h = listed()
    rc, job = h.submit(None, partition=partition, tres_per_node="gres/gpu:1")
    assert rc == 0, h.user_msgs
    _untouched(job, {"tres_per_node": "gres/gpu:1"})


@pytest.mark.parametrize("fields", ONE_GPU + MULTI_GPU + [{"tres_per_node": "gres/shard:5"}])
@pytest.mark.parametrize("partition,default", [("cpu", "big"), ("cpu,gpu2", "big"),
                                               (None, "cpu"), (None, None)])
def test_jobs_in_other_partitions_are_never_touched(
        fields: dict[str, Any], partition: str | None, default: str | None) -> None:
    """Slurm's default partition decides for jobs without one; unknown = not listed."""
    h = listed(default)
    extra: dict[str, Any] = {"partition": partition} if partition else {}
    rc, job = h.submit(None, **fields, **extra)
    assert rc == 0, h.user_msgs
    _untouched(job, fields)


def test_default_partition_unknown_without_part_list() -> None:
    h = listed("big")
    job = h.job(tres_per_node="gres/gpu:1", min_nodes=NO_VAL)
    assert h.lua.globals().slurm_job_submit(job, None, 1000) == 0
    _untouched(job, {"tres_per_node": "gres/gpu:1"})


def test_colloc_without_partition_goes_to_every_shared_partition_that_holds_it() -> None:
    h = listed("cpu")
    # in the listed order: Slurm takes the first with room, and a job that ran out of
    # memory on a small GPU can come back on a big one while the small ones are full
    rc, job = h.submit({"colloc_mem": "8G"})
    assert rc == 0 and job.partition == "small,big" and job.tres_per_node == "gres/shard:8"
    # a default-size job gets a whole GPU of the smallest
    rc, job = h.submit({"colloc": "(null)"})
    assert rc == 0 and job.partition == "small,big" and job.tres_per_node == "gres/shard:39"
    # one too large for the small GPUs goes only where it fits
    rc, job = h.submit({"colloc_mem": "60G"})
    assert rc == 0 and job.partition == "big" and job.tres_per_node == "gres/shard:60"


@pytest.mark.parametrize("partition", ["cpu", "cpu,gpu2", "gpu"])
def test_colloc_in_a_partition_without_shared_gpus_is_refused(partition: str) -> None:
    h = listed()
    rc, job = h.submit({"colloc_mem": "8G"}, partition=partition)
    _refused(h, rc, "partitions with shared GPUs (small,big)")
    assert job.admin_comment is None and job.tres_per_node is None


def test_colloc_partitions_narrowed_to_shared_ones_that_hold_it() -> None:
    h = listed()
    rc, job = h.submit({"colloc_mem": "8G"}, partition="cpu,big")
    assert rc == 0 and job.partition == "big"
    rc, job = h.submit({"colloc_mem": "8G"}, partition="big,cpu,small")
    assert rc == 0 and job.partition == "big,small"
    rc, job = h.submit({"colloc_mem": "60G"}, partition="small,big")
    assert rc == 0 and job.partition == "big" and job.tres_per_node == "gres/shard:60"


def test_colloc_need_checked_against_the_largest_shared_gpu() -> None:
    h = listed()
    rc, _ = h.submit({"colloc_mem": "60G"}, partition="small")
    _refused(h, rc, "one GPU offers at most 39936 MiB")
    rc, _ = h.submit({"colloc_mem": "90G"}, partition="small,big")
    _refused(h, rc, "one GPU offers at most 80896 MiB")
    rc, _ = h.submit({"colloc_mem": "90G"})
    _refused(h, rc, "one GPU offers at most 80896 MiB")
    # the default size is a whole GPU of the smallest
    rc, job = h.submit({"colloc": "(null)"}, partition="big,small")
    assert rc == 0 and job.tres_per_node == "gres/shard:39"
    assert parse_record(job.admin_comment).mode == "default"  # type: ignore[union-attr]


def test_plain_shards_bounded_by_their_partition() -> None:
    h = listed()
    rc, job = h.submit(None, tres_per_node="gres/shard:60", partition="big")
    assert rc == 0 and parse_record(job.admin_comment).shards == 60  # type: ignore[union-attr]
    rc, _ = h.submit(None, tres_per_node="gres/shard:60", partition="small")
    _refused(h, rc, "does not fit one GPU (39 shards")


def _modify(h: Harness, uid: int, desc: dict[str, Any], rec: dict[str, Any]) -> int:
    rec.setdefault("job_id", 42)
    return int(h.lua.globals().slurm_job_modify(h.job(**desc), h.job(**rec), None, uid))


def test_modify_keeps_gpu_jobs_out_of_shared_partitions() -> None:
    h = listed()
    # adding GPUs: fine in other partitions, not where GPUs are shared
    assert _modify(h, 1000, {"tres_per_node": "gres/gpu:1"}, {"partition": "cpu"}) == 0
    assert _modify(h, 1000, {"tres_per_node": "gres/gpu:1"}, {"partition": "big"}) != 0
    assert _modify(h, 1000, {"tres_per_node": "gres/gpu:1", "partition": "big"},
                   {"partition": "cpu"}) != 0
    # moving a GPU job into a shared partition would skip the whole-GPU conversion
    gpu_job = {"partition": "cpu", "tres_per_node": "gres/gpu:1"}
    assert _modify(h, 1000, {"partition": "big"}, dict(gpu_job)) != 0
    assert "partition of a GPU job is fixed" in h.user_msgs[-1]
    assert _modify(h, 1000, {"partition": "gpu2"}, dict(gpu_job)) == 0
    assert _modify(h, 1000, {"partition": "big"}, {"partition": "cpu"}) == 0  # no GPUs
    # a recorded job's shards were sized for its partition
    ac = "colloc1:mode=whole,need_mib=39936,shards=39,shard_mib=1024,alloc_mib=39936"
    assert _modify(h, 1000, {"partition": "big"}, {"partition": "small",
                                                   "admin_comment": ac}) != 0
    assert _modify(h, 0, {"partition": "big"}, {"partition": "small", "admin_comment": ac}) == 0


# ------------------------------------------------------------------ chaining
SITE = """-- the site's own job_submit.lua: "]]" and "]==]" must survive embedding
local DENY = "deny]]"
SITE_LOADED = "yes]==]"
function slurm_job_submit(job_desc, part_list, submit_uid)
    if job_desc.comment == DENY then
        slurm.log_user("site: comment %s is not allowed", DENY)
        return slurm.ESLURM_ACCESS_DENIED or 2002
    end
    job_desc.account = "site-acct"
    if job_desc.partition == nil then job_desc.partition = "big" end
    return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
    if job_desc.time_limit == 99 then return slurm.ERROR end
    return slurm.SUCCESS
end
return slurm.SUCCESS
"""


@pytest.fixture
def chained() -> Harness:
    return listed("cpu", chain=site.check_site_job_submit(SITE, "/etc/slurm/site.lua"))


def test_chained_site_script_runs_first_and_its_refusal_wins(chained: Harness) -> None:
    rc, job = chained.submit({"colloc_mem": "8G"}, comment="deny]]")
    assert rc == 2002
    assert chained.user_msgs == ["site: comment deny]] is not allowed"]
    assert job.tres_per_node is None and job.admin_comment is None  # colloc never ran
    assert chained.lua.globals().SITE_LOADED == "yes]==]"


def test_chained_site_changes_survive_and_colloc_sees_them(chained: Harness) -> None:
    rc, job = chained.submit(None, tres_per_node="gres/gpu:1")
    assert rc == 0, chained.user_msgs
    assert job.account == "site-acct" and job.partition == "big"  # the site's
    assert job.tres_per_node == "gres/shard:79"  # colloc's, in the site's partition
    rc, job = chained.submit({"colloc_mem": "8G"}, partition="small")
    assert rc == 0 and job.account == "site-acct" and job.partition == "small"
    assert job.tres_per_node == "gres/shard:8"


def test_chained_site_modify_runs_first(chained: Harness) -> None:
    assert _modify(chained, 1000, {"time_limit": 99}, {"partition": "cpu"}) != 0
    assert _modify(chained, 1000, {"time_limit": 10}, {"partition": "cpu"}) == 0
    assert _modify(chained, 1000, {"tres_per_node": "gres/shard:3"}, {"partition": "cpu"}) != 0


def test_chained_script_without_modify_is_fine() -> None:
    text = "function slurm_job_submit(d, p, u) return slurm.SUCCESS end\n"
    h = listed("cpu", chain=site.check_site_job_submit(text, "s.lua"))
    assert _modify(h, 1000, {"time_limit": 10}, {"partition": "cpu"}) == 0
    rc, job = h.submit(None, tres_per_node="gres/gpu:1", partition="small")
    assert rc == 0 and job.tres_per_node == "gres/shard:39"


def test_chained_script_failing_at_load_refuses_every_job() -> None:
    bad = SiteScript("/etc/slurm/site.lua", 'require("posix")\n'
                     "function slurm_job_submit(d, p, u) return 0 end\n")
    h = listed("cpu", chain=bad)
    assert any("did not load" in m for m in h.info)
    rc, _ = h.submit(None)
    _refused(h, rc, "site's job_submit.lua")


def test_no_chain_renders_no_site_code() -> None:
    js = site.render_job_submit(LISTED)
    assert "SITE_CHAIN = {" not in js and "-- @@SITE_CHAIN@@" in js
    js = site.render_job_submit(LISTED, SiteScript("/x/site.lua", "x = ']]'"))
    assert 'SITE_CHAIN = { name = "/x/site.lua", text = [=[\nx = \']]\'\n]=] }' in js
