"""Security issue 11, submit path: job_submit.lua, cli_filter.lua, the SPANK plugin, install.

Each test names the finding it covers in its docstring. The test functions failed
before the fix (in at least one of their cases), except the four marked "guard" that
pin behaviour the fix must keep (users could not resize recorded jobs, root could, a
colloc record replaced whatever was in AdminComment, a valid fingerprint is kept).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

lupa = pytest.importorskip("lupa.lua51", reason="lupa (dev extra) runs the Lua filters")

from slurm_colloc.accounting.submit_record import parse_record  # noqa: E402
from slurm_colloc.site import install as site  # noqa: E402
from slurm_colloc.site.install import SiteSettings  # noqa: E402
from tests.unit.test_lua_job_submit import Harness  # noqa: E402

RECORD = "colloc1:mode=explicit,need_mib=2048,shards=2,shard_mib=1024,alloc_mib=2048"
FORGED = "colloc1:mode=whole,need_mib=40960,shards=40,shard_mib=1024,alloc_mib=40960"
RECORD_CHARS = re.compile(r"^colloc1:[a-z0-9._=,:-]+$")


@pytest.fixture
def h() -> Harness:
    return Harness()


def _refused(h: Harness, rc: Any, needle: str) -> None:
    assert rc not in (0, None), h.user_msgs
    assert any(needle in m for m in h.user_msgs), h.user_msgs


def _modify(h: Harness, uid: int, rec: dict[str, Any], **desc: Any) -> int:
    rec.setdefault("job_id", 42)
    return int(h.lua.globals().slurm_job_modify(h.job(**desc), h.job(**rec), None, uid))


# ------------------------------------------------------------------ M4: whole-GPU guard
@pytest.mark.parametrize("fields", [
    {"tres_per_task": "gres/gpu:1"},                      # --gpus-per-task=1
    {"tres_per_socket": "gres/gpu:1"},                    # --gpus-per-socket=1
    {"tres_per_task": "gres/gpu:a100:1", "num_tasks": 4},
    {"tres_per_job": "gres/gpu:1", "tres_per_task": "gres/gpu:1"},
])
def test_m4_gpus_per_task_or_socket_keep_their_gpus(
        h: Harness, fields: dict[str, Any]) -> None:
    """M4: --gpus-per-task/--gpus-per-socket were not seen by the whole-GPU guard.

    Such a job may hold several GPUs of a node, so it must not be squeezed onto the
    shards of one GPU; like any multi-GPU job it keeps its gres/gpu (Slurm 24.11+ keeps
    it off GPUs that shard jobs hold: tests/e2e/test_gpu_shard_overlap.py).
    """
    rc, job = h.submit(None, **fields)
    assert rc == 0, h.user_msgs
    assert job.shared is None and job.admin_comment is None
    assert job.tres_per_node is None  # not turned into shards


@pytest.mark.parametrize("fields", [
    {"tres_per_node": "gres/gpu:1,gres:shard:5"},
    {"tres_per_node": "gres/shard:5,gres:gpu:a100:1"},
    {"tres_per_job": "gres/gpu:1", "tres_per_node": "gres/shard:5"},
    {"tres_per_task": "gres/gpu:1", "tres_per_node": "gres/shard:5"},
    {"tres_per_node": "gres/shard:a100:5", "tres_per_job": "gres/gpu:2"},
])
def test_m4_gpu_and_shard_mix_refused(h: Harness, fields: dict[str, Any]) -> None:
    """M4: a gpu+shard mix was recorded as mode=shards (MPS-limited) while holding a GPU."""
    rc, job = h.submit(None, **fields)
    _refused(h, rc, "whole GPUs and shards together")
    assert job.admin_comment is None


def test_m4_typed_shards_are_counted_and_bounded(h: Harness) -> None:
    """M4: typed shards (gres/shard:a100:60) escaped the count and the one-GPU bound."""
    rc, _ = h.submit(None, tres_per_node="gres/shard:a100:60")
    _refused(h, rc, "does not fit one GPU")
    rc, job = h.submit(None, tres_per_node="gres/shard:a100:5")
    assert rc == 0, h.user_msgs
    rec = parse_record(job.admin_comment)
    assert rec is not None and rec.mode == "shards" and rec.shards == 5


@pytest.mark.parametrize("tres", ["gres/shard:5,gres:shard:36", "gres/shard:2k", "gres/shard:x:y:1"])
def test_m4_shard_requests_that_cannot_be_bounded_are_refused(h: Harness, tres: str) -> None:
    """M4: several shard entries, count suffixes and unreadable entries bypassed the bound."""
    rc, job = h.submit(None, tres_per_node=tres)
    assert rc not in (0, None), h.user_msgs
    assert job.admin_comment is None


@pytest.mark.parametrize("field", ["tres_per_job", "tres_per_task", "tres_per_socket"])
def test_m4_shards_outside_tres_per_node_refused(h: Harness, field: str) -> None:
    """M4: shards asked per job/task/socket were neither counted nor recorded."""
    rc, _ = h.submit(None, **{field: "gres/shard:50"})
    _refused(h, rc, "--gres=shard:N")


@pytest.mark.parametrize("tres", ["gres:gpu:a100", "gres/gpu:a100", "gres/gpu:a100:1", "gres:GPU:1", "gres/GPU:1"])
def test_m4_typed_or_odd_one_gpu_becomes_whole(h: Harness, tres: str) -> None:
    """M4: a typed GPU without a count (gres:gpu:a100) slipped past the guard."""
    rc, job = h.submit(None, tres_per_node=tres)
    assert rc == 0, h.user_msgs
    assert job.tres_per_node == "gres/shard:40"
    rec = parse_record(job.admin_comment)
    assert rec is not None and rec.mode == "whole"


@pytest.mark.parametrize("fields", [
    {"tres_per_node": "gres/gpu:a100:2"},
    {"tres_per_job": "gres/gpu:a100:2"},
    {"tres_per_node": "gres/gpu:1,gres:gpu:1"},
    {"tres_per_job": "gres/gpu:1", "min_nodes": 2},
])
def test_m4_several_gpus_are_not_squeezed(h: Harness, fields: dict[str, Any]) -> None:
    """M4: multi-GPU requests keep their GPUs (as submitted, the node not exclusive)."""
    rc, job = h.submit(None, **fields)
    assert rc == 0 and job.shared is None
    assert "shard" not in str(job.tres_per_node)


def test_m4_whole_gpu_keeps_other_gres(h: Harness) -> None:
    """M4: turning gpu:1 into shards dropped the job's other gres (gres:nvme:1)."""
    rc, job = h.submit(None, tres_per_node="gres/gpu:1,gres:nvme:1")
    assert rc == 0 and job.tres_per_node == "gres/nvme:1,gres/shard:40"


def test_m4_colloc_with_typed_shards_refused(h: Harness) -> None:
    """M4: --colloc next to typed shards got its own shards added on top of them."""
    rc, _ = h.submit({"colloc_mem": "2G"}, tres_per_node="gres/shard:a100:60")
    _refused(h, rc, "--colloc cannot be combined with --gres=shard")
    rc, _ = h.submit({"colloc_mem": "2G"}, tres_per_socket="gres/gpu:1")
    _refused(h, rc, "--colloc cannot be combined with --gres=gpu")


@pytest.mark.parametrize("desc", [
    {"tres_per_node": "gres/gpu:1"},
    {"tres_per_node": "gres/shard:200"},
    {"tres_per_node": "gres/shard:a100:5"},
    {"tres_per_job": "gres/gpu:1"},
    {"tres_per_task": "gres/gpu:1"},
    {"tres_per_socket": "gres/gpu:2"},
])
def test_m4_user_update_of_plain_job_to_gpus_or_shards_refused(
        h: Harness, desc: dict[str, Any]) -> None:
    """M4: scontrol update of a plain pending job to gres:gpu:1/gres:shard:200 bypassed submit.

    A user's update cannot carry the AdminComment record (Slurm keeps AdminComment to
    admins), so it cannot be normalised like a submission (a new gpu:1 would skip the
    whole-GPU conversion): it is refused and the user told to resubmit.
    """
    assert _modify(h, 1000, {"admin_comment": None}, **desc) != 0
    assert "resubmit" in h.user_msgs[-1]


@pytest.mark.parametrize("ac", [
    "colloc1:mode=shards,need_mib=5120,shards=5,shard_mib=1024,alloc_mib=5120",
    FORGED,
])
def test_m4_user_update_of_recorded_job_refused(h: Harness, ac: str) -> None:
    """M4 (guard, passed before): users may not change the GPU request of a recorded job."""
    assert _modify(h, 1000, {"admin_comment": ac}, tres_per_node="gres/shard:41") != 0
    assert _modify(h, 1000, {"admin_comment": ac}, tres_per_node="") != 0


def test_m4_modify_still_lets_root_and_slurmuser_and_harmless_updates_through(h: Harness) -> None:
    """M4 (guard, passed before): the epilog's requeue (root) raises shards and rewrites
    the record; updates that touch no GPU request stay allowed."""
    rec = {"admin_comment": RECORD}
    assert _modify(h, 0, rec, tres_per_node="gres/shard:40") == 0
    assert _modify(h, 64030, rec, tres_per_node="gres/shard:40") == 0
    assert _modify(h, 0, rec, admin_comment=FORGED) == 0
    assert _modify(h, 1000, rec, time_limit=10) == 0
    assert _modify(h, 1000, {"admin_comment": None}, tres_per_node="gres/nvme:1") == 0
    assert _modify(h, 1000, {"admin_comment": None}, tres_per_node="") == 0


def test_m4_user_cannot_rewrite_the_record_by_update(h: Harness) -> None:
    """M4 / AdminComment: a user's update may not write or replace a colloc1 record."""
    assert _modify(h, 1000, {"admin_comment": RECORD}, admin_comment=FORGED) != 0
    assert _modify(h, 1000, {"admin_comment": None}, admin_comment=FORGED) != 0
    assert "AdminComment" in h.user_msgs[-1]


# ------------------------------------------------------------------ AdminComment
@pytest.mark.parametrize("fields", [
    {},
    {"tres_per_node": "gres/gpu:4"},
    {"tres_per_node": "gres/license:1"},
    {"tres_per_task": "gres/gpu:1"},
])
def test_admin_comment_from_user_is_cleared(h: Harness, fields: dict[str, Any]) -> None:
    """AdminComment: a user-supplied admin_comment (forged colloc1 record) survived submit."""
    rc, job = h.submit(None, admin_comment=FORGED, **fields)
    assert rc == 0 and job.admin_comment is None


def test_admin_comment_replaced_on_recorded_jobs(h: Harness) -> None:
    """AdminComment (guard, passed before): on recorded jobs only the computed record is left."""
    rc, job = h.submit({"colloc_mem": "2G"}, admin_comment=FORGED + " extra")
    assert rc == 0 and job.admin_comment == RECORD


def test_admin_comment_of_trusted_submitters(h: Harness) -> None:
    """AdminComment: root may keep its own note, never a colloc1 record it did not compute."""
    rc, job = h.submit(None, uid=0, admin_comment="site note")
    assert rc == 0 and job.admin_comment == "site note"
    rc, job = h.submit(None, uid=0, admin_comment=FORGED)
    assert rc == 0 and job.admin_comment is None


@pytest.mark.parametrize("comment,needle", [
    ("colloc-estimate:v1:mib=7000,margin=0,est=x,fp=00,mib=1", "twice"),
    ("colloc-estimate:v1:mib=7000,margin=0,est=x,fp=00,mode=whole", "unknown"),
    ("colloc-estimate:v1:mib=7000,margin=0,est=x,fp=00,,", "malformed"),
    ("colloc-estimate:v1:mib=7000,margin=0,est=x", "fingerprint"),
    ("colloc-estimate:v1:mib=7000,margin=0,est=x,fp=" + "a" * 65, "fingerprint"),
    ("colloc-estimate:v1:mib=7000,margin=0,est=x,fp=0x12", "fingerprint"),
    ("colloc-estimate:v1:mib=0007000,margin=0,est=x,fp=00" + "0" * 300, "malformed"),
])
def test_estimate_record_is_strict(h: Harness, comment: str, needle: str) -> None:
    """AdminComment / fp: the estimate record is parsed strictly (no duplicate or unknown
    keys, fp 1-64 hex digits, bounded length), so nothing user-written reaches the record
    beyond validated values."""
    rc, job = h.submit({"colloc": "m", "colloc_batch_size": "1"}, comment=comment)
    _refused(h, rc, needle)
    assert job.admin_comment is None


def test_recorded_values_are_computed_or_validated(h: Harness) -> None:
    """AdminComment / fp (guard, passed before): the record holds the validated
    fingerprint, lowercased, and nothing else from the comment."""
    rc, job = h.submit({"colloc": "m", "colloc_batch_size": "1"},
                       comment="colloc-estimate:v1:mib=7000,margin=10,est=layer-aware,fp="
                       + "AB" * 32 + " x")
    assert rc == 0 and RECORD_CHARS.match(job.admin_comment)
    rec = parse_record(job.admin_comment)
    assert rec is not None and rec.fingerprint == "ab" * 32 and rec.estimator == "layer-aware"
    assert rec.extra == {}


# ------------------------------------------------------------------ log_user format strings
@pytest.mark.parametrize("spank,fields,needle", [
    ({"colloc_mem": "8%s"}, {}, "--colloc-mem=8%s"),
    ({"colloc_mem": "%d%n%s%%"}, {}, "expected a size"),
    ({"colloc": "m"}, {"comment": "colloc-estimate:v1:mib=%s,margin=0,est=x,fp=00"}, "mib=%s"),
    ({"colloc": "m"}, {"comment": "colloc-estimate:v1:mib=1,margin=0,est=%s,fp=00"}, "est=%s"),
    ({"colloc": "m"}, {"comment": "colloc-estimate:v1:mib=1,margin=0,est=x,fp=%s"}, "fp=%s"),
])
def test_percent_in_user_text_reaches_the_user(
        h: Harness, spank: dict[str, str], fields: dict[str, Any], needle: str) -> None:
    """Low (log_user format): user text with %s raised a Lua error inside slurmctld."""
    rc, _ = h.submit(spank, **fields)
    _refused(h, rc, needle)


def test_percent_in_modify_messages(h: Harness) -> None:
    """Low (log_user format): messages on the modify path format user data as arguments."""
    assert _modify(h, 1000, {"admin_comment": RECORD, "job_id": "%s"},
                   tres_per_node="gres/shard:3") != 0
    assert "%s" in h.user_msgs[-1]


# ------------------------------------------------------------------ cli_filter
def test_cli_filter_refuses_estimator_output_that_would_inject_record_syntax(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """AdminComment / fp: cli_filter put the estimator's fingerprint/name into the record
    unchecked (fp "00,mib=1" overrode mib in job_submit's old parser)."""
    pytest.importorskip("lupa.luajit21")
    from tests.unit.test_lua_cli_filter import Harness as CliHarness

    monkeypatch.delenv("COLLOC_ESTIMATOR_COMMAND", raising=False)
    s = tmp_path / "m.txt"
    s.write_text("x\n")
    for est, fp in (("fake", "00,mib=1"), ("a b", "00"), ("fake", "zz"), ("x" * 40, "00"),
                    ("fake", "0" * 65), ("fake", "")):
        tool = tmp_path / "est"
        tool.write_text("#!/bin/sh\nprintf '%s\\n' '{\"estimate_mib\": 7000, \"margin_mib\": 0, "
                        f'"estimator": "{est}", "fingerprint": "{fp}"}}\'\n')
        tool.chmod(0o755)
        ch = CliHarness(estimator=tool)
        rc, opts = ch.pre_submit({"colloc": str(s), "colloc-batch-size": "1"})
        assert rc == -1 and opts.comment is None, (est, fp, opts.comment)
        assert "estimator" in ch.errors[0]


# ------------------------------------------------------------------ SPANK size parser
SIZES = [
    "8G", "7500M", "7500", "1", "1.5GiB", "40G", "512K", "1.", "0.5", "8gib", "8Gb", "8GIB",
    "16T", "16385G", "1e3", "1E3", "0x10", "0X1A", "inf", "nan", "infinity", "1e400", "-3", "+3",
    " 8G", "8G ", "8 G", ".5", "1.5.3", "8X", "8B", "8iB", "8Gx", "8GBi", "0", "0.0", "",
    "99999999999999999999", "1" + "0" * 31, "1" + "0" * 32, "8%s", "0001", "0.0001K", "1,5G",
]


def _lua_size_mib(size: str) -> int:
    """job_submit.lua's parse_size_mib through --colloc-mem (one shard = 1 MiB)."""
    h = Harness(SiteSettings(shard_mib=1, gpu_memory_mib=16 * 1024 * 1024))
    rc, job = h.submit({"colloc_mem": size})
    if rc != 0:
        return -1
    rec = parse_record(job.admin_comment)
    assert rec is not None
    return rec.need_mib


def _build_size_parser(tmp_path: Path, *flags: str) -> Path:
    """The SPANK plugin's size parser alone, compiled into a tool that prints one MiB
    figure (or -1) per argument."""
    src = Path(site.__file__).parent / "spank" / "colloc_spank.c"
    main = tmp_path / "t.c"
    main.write_text(
        "#define COLLOC_SIZE_PARSER_ONLY 1\n"
        f'#include "{src}"\n'
        "#include <stdio.h>\n"
        "int main(int argc, char **argv)\n{\n"
        "\tfor (int i = 1; i < argc; i++)\n\t\tprintf(\"%ld\\n\", parse_size_mib(argv[i]));\n"
        "\treturn 0;\n}\n")
    exe = tmp_path / "t"
    cp = subprocess.run(["gcc", *flags, "-O2", "-o", str(exe), str(main)],
                        capture_output=True, text=True, check=False)
    assert cp.returncode == 0, cp.stderr
    return exe


@pytest.mark.skipif(not shutil.which("gcc"), reason="needs gcc")
def test_spank_size_parser_accepts_exactly_what_lua_accepts(tmp_path: Path) -> None:
    """Low (SPANK strtod): the C parser took 1e3, 0x10 (and the like) that job_submit.lua
    refuses; it must accept exactly the Lua grammar and give the same MiB."""
    exe = _build_size_parser(tmp_path, "-Wall", "-Wextra", "-Werror")
    out = subprocess.run([str(exe), *SIZES], capture_output=True, text=True, check=True)
    c_mib = [int(x) for x in out.stdout.split()]
    lua_mib = [_lua_size_mib(s) for s in SIZES]
    assert dict(zip(SIZES, c_mib, strict=True)) == dict(zip(SIZES, lua_mib, strict=True))
    assert lua_mib[SIZES.index("1e3")] == -1 and lua_mib[SIZES.index("8G")] == 8192


# ------------------------------------------------------------------ plugstack
def test_plugstack_loads_the_plugin_optional() -> None:
    """Low (plugstack required): a broken plugin must not fail every srun/sbatch."""
    assert site.plugstack_line(Path("/usr/lib/slurm/colloc_spank.so")) == (
        "optional /usr/lib/slurm/colloc_spank.so")


@pytest.mark.skipif(not shutil.which("gcc"), reason="needs gcc")
def test_spank_and_lua_size_parsers_agree_on_fuzzed_sizes(tmp_path: Path) -> None:
    """Hypothesis over the SPANK/Lua size boundary: on any text the C parser and
    job_submit.lua give the same answer (MiB, or both refuse)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    exe = _build_size_parser(tmp_path)
    h = Harness(SiteSettings(shard_mib=1, gpu_memory_mib=16 * 1024 * 1024))

    def lua(size: str) -> int:
        rc, job = h.submit({"colloc_mem": size})
        rec = parse_record(job.admin_comment) if rc == 0 else None
        return rec.need_mib if rec is not None else -1

    sizes = st.text(alphabet="0123456789.eExXkKmMgGtTiIbB+- ", min_size=1, max_size=12)

    @settings(max_examples=25, deadline=None)
    @given(st.lists(sizes, min_size=1, max_size=12))
    def agree(batch: list[str]) -> None:
        out = subprocess.run([str(exe), *batch], capture_output=True, text=True, check=True)
        c_mib = [int(x) for x in out.stdout.split()]
        assert c_mib == [lua(s) for s in batch], batch

    agree()
