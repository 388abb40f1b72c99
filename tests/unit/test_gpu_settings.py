"""Per GPU model and per node overrides of the GPU overheads (issue 26 item 6):
parsing and its errors, precedence (node > GPU model > global), and the readers that
act for one GPU (pinned limit, gres.conf shard counts, epilog fallback, colloc config)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_colloc import config as cfgmod
from slurm_colloc.cli.config_cmd import config as config_cmd
from slurm_colloc.config import ConfigError, GpuOverride, from_mapping
from slurm_colloc.gpu.backend import GpuInfo
from slurm_colloc.gpu.budget import budget, budget_of
from slurm_colloc.gpu_settings import describe, effective, local_node, sources
from slurm_colloc.site.install import gres_conf_lines

H100 = "NVIDIA H100 80GB HBM3"
TEXT = f"""
cuda_context_mib = 500
mps_server_mib = 64
[gpu_types."{H100}"]
cuda_context_mib = 608
gpu_reserved_mib = 480
[gpu_types."Tesla V100-SXM2-32GB"]
mps_server_mib = 48
[nodes."gpu[01-04,07]"]
cuda_context_mib = 640
gpu_memory_mib = 81920
[nodes."old1"]
mps_server_mib = 96
"""
CFG = from_mapping(tomllib.loads(TEXT))


def gpu(name: str, mib: int = 81559, reserved: int = 0) -> GpuInfo:
    return GpuInfo(index=0, uuid="GPU-0", name=name, memory_total_mib=mib,
                   reserved_mib=reserved)


def test_tables_parse_into_overrides() -> None:
    assert CFG.gpu_types[H100] == GpuOverride(cuda_context_mib=608, gpu_reserved_mib=480)
    assert CFG.nodes["old1"].values() == {"mps_server_mib": 96}
    assert cfgmod.CollocConfig().gpu_types == {} and cfgmod.CollocConfig().nodes == {}


@pytest.mark.parametrize(("node", "model", "want"), [
    # node table > GPU model table > global, key by key
    ("gpu03", H100, {"cuda_context_mib": 640, "gpu_reserved_mib": 480, "mps_server_mib": 64,
                     "gpu_memory_mib": 81920}),
    ("gpu05", H100, {"cuda_context_mib": 608, "gpu_reserved_mib": 480, "mps_server_mib": 64,
                     "gpu_memory_mib": 0}),
    ("old1", "tesla  v100-sxm2-32gb", {"cuda_context_mib": 500, "mps_server_mib": 96}),
    ("gpu5", "NVIDIA A100-SXM4-40GB", {"cuda_context_mib": 500, "mps_server_mib": 64,
                                       "gpu_reserved_mib": 0}),
    (None, None, {"cuda_context_mib": 500}),
    ("gpu07", None, {"cuda_context_mib": 640, "gpu_memory_mib": 81920}),
])
def test_precedence(node: str | None, model: str | None, want: dict[str, int]) -> None:
    eff = effective(CFG, node=node, model=model)
    assert {k: getattr(eff, k) for k in want} == want
    assert effective(eff, node=node, model=model) == eff  # idempotent: safe to re-resolve


def test_sources_name_the_table() -> None:
    src = sources(CFG, node="gpu01", model=H100)
    assert src == {"cuda_context_mib": 'nodes."gpu[01-04,07]"',
                   "gpu_reserved_mib": f'gpu_types."{H100}"', "mps_server_mib": "global",
                   "gpu_memory_mib": 'nodes."gpu[01-04,07]"'}
    assert "cuda_context_mib = 640 (nodes." in describe(CFG, node="gpu01", model=H100)


@pytest.mark.parametrize(("text", "message"), [
    ('[gpu_types."X"]\ncuda_contxt_mib = 1', "unknown key(s) cuda_contxt_mib"),
    ('[nodes."n1"]\nshard_mib = 1', "unknown key(s) shard_mib"),
    ('[gpu_types."X"]\ngpu_memory_mib = 1', "set it per node"),
    ('[nodes."n1"]\ncuda_context_mib = -1', "must not be negative"),
    ('[nodes."n1"]\ncuda_context_mib = "5"', "must be an integer"),
    ('[nodes."n[1-"]\ncuda_context_mib = 1', "not a Slurm hostlist"),
    ('[nodes."n[1-3]"]\ncuda_context_mib = 1\n[nodes."n3,n9"]\nmps_server_mib = 1',
     'n3 is also in [nodes."n[1-3]"]'),
    ('[gpu_types."A  B"]\ncuda_context_mib = 1\n[gpu_types."a b"]\nmps_server_mib = 1',
     "name each GPU model once"),
    ("nodes = 3", "must be (at most 1024) tables"),
    ('[nodes]\nn1 = 5', "must be a table of"),
])
def test_bad_tables_name_the_problem(tmp_path: Path, text: str, message: str) -> None:
    p = tmp_path / "c.toml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)")) as e:
        cfgmod.load(p)
    assert str(p) in str(e.value)


def test_dump_round_trips_the_tables() -> None:
    assert from_mapping(tomllib.loads(cfgmod.dump(CFG))) == CFG


def test_pinned_limit_follows_the_node_and_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prolog's limit (budget_of) uses this node's and this GPU's overheads."""
    monkeypatch.setenv("SLURMD_NODENAME", "gpu02")
    assert local_node() == "gpu02"
    assert budget_of(CFG, gpu(H100)).pinned_limit_mib(4) == 4 * 1024 - 640
    assert budget_of(CFG, gpu(H100), node="gpu09").pinned_limit_mib(4) == 4 * 1024 - 608
    assert budget_of(CFG, gpu("other"), node="gpu09").pinned_limit_mib(4) == 4 * 1024 - 500
    monkeypatch.setenv("SLURMD_NODENAME", "old1")
    b = budget_of(CFG, gpu("Tesla V100-SXM2-32GB", 32768))
    assert (b.server_mib, b.context_mib) == (96, 500)


def test_gres_conf_counts_shards_with_the_model_reserve() -> None:
    """An H100's 480 MiB reserve (its table) costs it a shard that another model keeps."""
    plain = gres_conf_lines([gpu("other", 82048)], CFG, node_name="x1")[1]
    h100 = gres_conf_lines([gpu(H100, 82048)], CFG, node_name="x1")[1]
    want_plain = budget(effective(CFG, node="x1", model="other"), 82048).shards_per_gpu
    want_h100 = budget(effective(CFG, node="x1", model=H100), 82048).shards_per_gpu
    assert want_h100 < want_plain
    assert f"shard:{want_plain}" in plain and f"shard:{want_h100}" in h100


def test_epilog_fallback_uses_the_node_gpu_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the backend down, the epilog sizes the GPU from the node's gpu_memory_mib."""
    from slurm_colloc.node import epilog

    def broken(*_: object) -> int:
        raise RuntimeError("NVML gone")

    monkeypatch.setattr(epilog, "shards_per_gpu", broken)
    monkeypatch.setenv("SLURMD_NODENAME", "gpu04")
    ctx = type("Ctx", (), {"gpu": 0, "submit": None})()
    result = epilog.EpilogResult(job_id=1)
    got = epilog._shards_per_gpu_or_fallback(ctx, CFG, result)  # type: ignore[arg-type]
    assert got == budget(effective(CFG, node="gpu04", model=None), 81920).shards_per_gpu
    monkeypatch.setenv("SLURMD_NODENAME", "gpu05")  # no node table, global size 0: unknown
    assert epilog._shards_per_gpu_or_fallback(ctx, CFG, result) is None  # type: ignore[arg-type]


def test_colloc_config_shows_effective_values_and_check_sizes_them(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text(TEXT)
    out = CliRunner().invoke(config_cmd, ["-f", str(good)])
    assert out.exit_code == 0, out.output
    assert f'[gpu_types."{H100}"]' in out.output
    assert (f'#   nodes."gpu[01-04,07]", gpu_types."{H100}": cuda_context_mib = 640, '
            "mps_server_mib = 64, gpu_reserved_mib = 480, gpu_memory_mib = 81920") in out.output
    assert CliRunner().invoke(config_cmd, ["--check", "-f", str(good)]).exit_code == 0
    bad = tmp_path / "bad.toml"
    bad.write_text('gpu_memory_mib = 4096\n[nodes."n1"]\ncuda_context_mib = 8000\n')
    res = CliRunner().invoke(config_cmd, ["--check", "-f", str(bad)])
    assert res.exit_code == 2
    assert 'nodes."n1", any other GPU model: cuda_context_mib = 8000' in res.output


def test_doctor_says_which_table_each_value_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    from slurm_colloc.site import doctor
    from tests.unit.test_doctor_node import Fixed

    gpus = [GpuInfo(0, "GPU-a", H100, 81559, minor_number=0),
            GpuInfo(1, "GPU-b", "other", 81559, minor_number=1)]
    monkeypatch.setattr("slurm_colloc.gpu.select.backend_from_config",
                        lambda cfg, **kw: Fixed(gpus))
    monkeypatch.setenv("SLURMD_NODENAME", "gpu01")
    found = {f.what: f for f in doctor.check_gpus(CFG, None)}
    assert found["GPU 0 settings"].detail.startswith(f"{H100} on gpu01: cuda_context_mib = 640 "
                                                     '(nodes."gpu[01-04,07]")')
    assert f'gpu_reserved_mib = 480 (gpu_types."{H100}")' in found["GPU 0 settings"].detail
    assert "gpu_reserved_mib = 0 (global)" in found["GPU 1 settings"].detail
    plain = {f.what for f in doctor.check_gpus(cfgmod.CollocConfig(), None)}
    assert "GPU 0 settings" not in plain  # no tables: nothing to explain


def test_selftest_names_the_model_table_for_its_suggestions() -> None:
    from rich.console import Console

    from slurm_colloc.selftest import report
    from slurm_colloc.selftest.gpu_kit import KitResult

    res = KitResult(exit_code=0, refusal=None, host="h", started=0.0, finished=1.0,
                    options={}, environment={"gpu": {"name": H100}},
                    suggested_config=["cuda_context_mib = 608"])
    console = Console(record=True, width=200)
    report.render(res, console, None)
    assert f'under [gpu_types."{H100}"]' in console.export_text()


def test_colloc_config_node_view_names_the_sources(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text(TEXT)
    out = CliRunner().invoke(config_cmd, ["-f", str(good), "--node", "gpu07",
                                          "--gpu-model", H100.lower()])
    assert out.exit_code == 0, out.output
    assert out.output.splitlines() == [
        'cuda_context_mib = 640  # nodes."gpu[01-04,07]"', "mps_server_mib = 64  # global",
        f'gpu_reserved_mib = 480  # gpu_types."{H100}"',
        'gpu_memory_mib = 81920  # nodes."gpu[01-04,07]"']


def test_check_warns_when_a_table_has_fewer_shards_than_job_submit_assumes(
    tmp_path: Path,
) -> None:
    """job_submit.lua sizes a whole GPU with the global keys: a larger server or reserve
    in a table means a whole-GPU job may never fit that table's GPUs."""
    conf = tmp_path / "c.toml"
    conf.write_text(TEXT)  # old1: mps_server_mib 96 > global 64; H100's reserve vs global 0
    res = CliRunner().invoke(config_cmd, ["--check", "-f", str(conf)])
    assert res.exit_code == 0
    warnings = [line for line in res.output.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and '[nodes."old1"] mps_server_mib = 96' in warnings[0]
    conf.write_text(TEXT.replace("mps_server_mib = 64", "mps_server_mib = 96"))
    res = CliRunner().invoke(config_cmd, ["--check", "-f", str(conf)])
    assert "warning:" not in res.output
