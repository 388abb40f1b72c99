"""``colloc admin doctor --gpus``: Slurm's GPU order and gres.conf against each GPU's budget."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from slurm_colloc.config import CollocConfig
from slurm_colloc.gpu.backend import GpuBackend, GpuInfo, GpuSample
from slurm_colloc.gpu.sim import tools as sim_tools
from slurm_colloc.site import doctor


class Fixed(GpuBackend):
    """A backend that only describes its GPUs (NVML-like: minors, reserve)."""

    name = "fixed"

    def __init__(self, gpus: list[GpuInfo]) -> None:
        self._gpus = gpus

    def gpus(self) -> list[GpuInfo]:
        return self._gpus

    def sample(self, index: int) -> GpuSample:  # pragma: no cover - not sampled here
        raise NotImplementedError


H100 = 81559
TWO = [GpuInfo(0, "GPU-aaa", "H100", H100, minor_number=1, reserved_mib=600),
       GpuInfo(1, "GPU-bbb", "H100", H100, minor_number=0, reserved_mib=600)]


def _run(monkeypatch: pytest.MonkeyPatch, gpus: list[GpuInfo], gres: str | None,
         tmp_path: Path) -> dict[str, doctor.Finding]:
    monkeypatch.setattr("slurm_colloc.gpu.select.backend_from_config",
                        lambda cfg, **kw: Fixed(gpus))
    path = None
    if gres is not None:
        path = tmp_path / "gres.conf"
        path.write_text(gres)
    return {f.what: f for f in doctor.check_gpus(CollocConfig(), path)}


def test_gpu_order_is_reported_by_minor_number(monkeypatch, tmp_path) -> None:
    found = _run(monkeypatch, TWO, None, tmp_path)
    assert found["GPU order"].level == "ok"
    assert "0=GPU-bbb (/dev/nvidia0), 1=GPU-aaa (/dev/nvidia1)" in found["GPU order"].detail


def test_gres_conf_with_more_shards_than_memory_fails(monkeypatch, tmp_path) -> None:
    # (81559 - 600 - 128) // 1024 = 78 shards; 79 (81559 // 1024) would over-commit
    gres = ("Name=gpu File=/dev/nvidia[0-1]\n"
            "Name=shard Count=78 File=/dev/nvidia0\nName=shard Count=79 File=/dev/nvidia1\n")
    found = _run(monkeypatch, TWO, gres, tmp_path)
    assert found["gres.conf GPU order"].level == "ok"
    assert found["gres.conf shards"].level == "fail"
    assert "/dev/nvidia1: Count=79 > 78" in found["gres.conf shards"].detail


def test_gres_conf_naming_other_device_files_fails(monkeypatch, tmp_path) -> None:
    gres = "Name=gpu File=/dev/nvidia2\nName=gpu File=/dev/nvidia3\n"
    found = _run(monkeypatch, TWO, gres, tmp_path)
    assert found["gres.conf GPU order"].level == "fail"


def test_other_nodes_lines_are_ignored(monkeypatch, tmp_path) -> None:
    me = socket.gethostname().split(".")[0]
    gres = ("NodeName=elsewhere Name=gpu File=/dev/nvidia[5-6]\n"
            f"NodeName={me} Name=gpu File=/dev/nvidia[0-1]\n")
    found = _run(monkeypatch, TWO, gres, tmp_path)
    assert found["gres.conf GPU order"].level == "ok"


def test_half_known_minors_fail_the_gpu_order(monkeypatch, tmp_path) -> None:
    gpus = [TWO[0], GpuInfo(1, "GPU-bbb", "H100", H100)]
    found = _run(monkeypatch, gpus, None, tmp_path)
    assert found["GPU order"].level == "fail"


def test_a_gpu_too_small_for_one_shard_fails_its_budget(monkeypatch, tmp_path) -> None:
    found = _run(monkeypatch, [GpuInfo(0, "GPU-t", "tiny", 1000, minor_number=0)], None,
                 tmp_path)
    assert found["GPU 0 memory budget"].level == "fail"


def test_expand_gres_files() -> None:
    assert doctor.expand_gres_files("/dev/nvidia[0-2],/dev/nvidia7") == [
        "/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia2", "/dev/nvidia7"]


V2 = sim_tools.tool("colloc-sim-mps-control")  # the lab's launcher (issue 26 item 7)
V3 = V2.with_name("colloc-sim-mps-control-v3")


def _node(tmp_path: Path, conf_lines: str, **cfg: object) -> dict[str, doctor.Finding]:
    slurm_conf = tmp_path / "slurm.conf"
    slurm_conf.write_text(conf_lines)
    config = CollocConfig(mps_root=str(tmp_path / "mps"), **cfg)  # type: ignore[arg-type]
    dev = tmp_path / "dev"
    dev.mkdir(exist_ok=True)
    (dev / "nvidia0").touch()  # a GPU node
    return {f.what: f for f in doctor.check_node(config, slurm_conf, dev=dev)}


def test_node_wiring_points_at_programs_that_exist_here(tmp_path: Path) -> None:
    prolog = tmp_path / "colloc-prolog"
    prolog.write_text("#!/bin/sh\n")
    prolog.chmod(0o755)
    found = _node(tmp_path, f"Prolog={prolog}\nEpilog=/nowhere/colloc-epilog\n"
                  "PrologFlags=Contain\n", mps_control=str(V2))
    assert found["slurm.conf prolog"].level == "ok"
    assert found["slurm.conf epilog"].level == "fail"
    assert found["slurm.conf taskprolog"].level == "fail"  # not set
    assert found["PrologFlags"].level == "fail"  # no Alloc
    assert found["mps_root"].level == "ok"  # made by the first prolog


def test_mps_protocol_must_match_what_the_node_has(tmp_path: Path) -> None:
    assert _node(tmp_path, "", mps_control=str(V2))["MPS control"].level == "ok"
    wants_v3 = _node(tmp_path, "", mps_control=str(V2), mps_protocol="3")
    assert wants_v3["MPS control"].level == "fail"
    could = _node(tmp_path, "", mps_control=str(V3))
    assert could["MPS control"].level == "warn" and "v3 available" in could["MPS control"].detail
    missing = _node(tmp_path, "", mps_control=str(tmp_path / "none"))
    assert missing["MPS control"].level == "fail"


def test_a_foreign_or_writable_mps_root_fails(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "mps").symlink_to(tmp_path / "elsewhere")
    assert _node(tmp_path, "", mps_control=str(V2))["mps_root"].level == "fail"
    (tmp_path / "mps").unlink()
    (tmp_path / "mps").mkdir(mode=0o777)
    (tmp_path / "mps").chmod(0o777)
    assert _node(tmp_path, "", mps_control=str(V2))["mps_root"].level == "fail"
