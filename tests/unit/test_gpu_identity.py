"""Slurm's GPU index -> physical GPU: minor-number order, and the gres.conf cross-check."""

from __future__ import annotations

import pytest

from slurm_colloc.gpu.backend import GpuBackend, GpuInfo, GpuSample
from slurm_colloc.gpu.identity import (
    GpuIdentityError,
    GpuMap,
    check_gres_files,
    device_file_minor,
    gpu_for_slurm_index,
    slurm_order,
)


def gpu(index: int, minor: int | None, pci: str = "") -> GpuInfo:
    return GpuInfo(index=index, uuid=f"GPU-{index:08x}-aaaa", name="NVIDIA H100 NVL",
                   memory_total_mib=95830, minor_number=minor, pci_bus_id=pci)


# Four H100 NVL whose kernel minors do not follow PCI (= NVML) order, the shape of the
# case in ceems-dev/ceems discussion 513: NVML index i has minor PERMUTED[i].
PERMUTED = (2, 0, 3, 1)
NODE = [gpu(i, m, f"00000000:{0x1b + 0x20 * i:02x}:00.0") for i, m in enumerate(PERMUTED)]


def test_slurm_order_is_minor_number_order_not_nvml_order():
    assert [g.index for g in slurm_order(NODE)] == [1, 3, 0, 2]
    assert [g.minor_number for g in slurm_order(NODE)] == [0, 1, 2, 3]
    assert [g.index for g in slurm_order(list(reversed(NODE)))] == [1, 3, 0, 2]


def test_slurm_order_with_a_gap_in_the_minors():
    node = [gpu(0, 0), gpu(1, 3), gpu(2, 2)]  # /dev/nvidia1 gone (GPU fell off the bus)
    assert [g.minor_number for g in slurm_order(node)] == [0, 2, 3]
    assert gpu_for_slurm_index(node, 1).index == 2


def test_no_minors_at_all_means_nvml_order():
    node = [gpu(2, None), gpu(0, None), gpu(1, None)]  # a backend without device files
    assert [g.index for g in slurm_order(node)] == [0, 1, 2]
    assert slurm_order([]) == []


def test_some_minors_unknown_is_an_error_naming_the_gpu():
    with pytest.raises(GpuIdentityError, match=r"NVML index 1 \(/dev/nvidia\?"):
        slurm_order([gpu(0, 0), gpu(1, None), gpu(2, 1)])


def test_duplicate_minor_numbers_are_an_error():
    with pytest.raises(GpuIdentityError, match="two GPUs report minor number 1"):
        slurm_order([gpu(0, 1), gpu(1, 1)])


def test_gpu_for_slurm_index():
    assert gpu_for_slurm_index(NODE, 0).index == 1
    assert gpu_for_slurm_index(NODE, 3).uuid == NODE[2].uuid


@pytest.mark.parametrize("index", [4, -1, 99])
def test_slurm_index_out_of_range_is_actionable(index):
    with pytest.raises(GpuIdentityError) as ei:
        gpu_for_slurm_index(NODE, index)
    msg = str(ei.value)
    assert f"index {index}" in msg and "4 GPU(s)" in msg and "0-3" in msg
    assert "nvidia-smi -L" in msg
    assert isinstance(ei.value, RuntimeError)


def test_no_gpus_at_all():
    with pytest.raises(GpuIdentityError, match="NVML sees no GPUs"):
        gpu_for_slurm_index([], 0)


def test_gpu_map_lookups():
    m = GpuMap.from_gpus(NODE)
    assert m.by_minor and len(m) == 4
    assert [m.nvml_index(i) for i in range(4)] == [1, 3, 0, 2]
    assert m.uuid(0) == "GPU-00000001-aaaa"
    assert m.by_slurm_index(2) is NODE[0]
    assert m.slurm_index_of_uuid("GPU-00000003-aaaa") == 1
    assert m.slurm_index_of_uuid("  gpu-00000003-AAAA\n") == 1  # case, whitespace
    assert [m.slurm_index_of_nvml(n) for n in range(4)] == [2, 0, 3, 1]
    for i in range(4):  # the two directions agree
        assert m.slurm_index_of_uuid(m.uuid(i)) == i
        assert m.slurm_index_of_nvml(m.nvml_index(i)) == i


def test_gpu_map_unknowns_are_errors():
    m = GpuMap.from_gpus(NODE)
    with pytest.raises(GpuIdentityError, match="no GPU with UUID 'GPU-ffff'"):
        m.slurm_index_of_uuid("GPU-ffff")
    with pytest.raises(GpuIdentityError, match="NVML index 7"):
        m.slurm_index_of_nvml(7)
    for bad in (4, -1):
        with pytest.raises(GpuIdentityError, match="0-3"):
            m.uuid(bad)
        with pytest.raises(GpuIdentityError):
            m.nvml_index(bad)


class StubBackend(GpuBackend):
    name = "stub"

    def __init__(self, gpus: list[GpuInfo]) -> None:
        self._gpus = gpus

    def gpus(self) -> list[GpuInfo]:
        return list(self._gpus)

    def sample(self, index: int) -> GpuSample:
        raise NotImplementedError


def test_gpu_map_from_backends():
    assert GpuMap.from_backend(StubBackend(NODE)).nvml_index(0) == 1
    sim = GpuMap.from_backend(StubBackend([gpu(0, None), gpu(1, None)]))
    assert not sim.by_minor and sim.nvml_index(1) == 1
    with pytest.raises(GpuIdentityError):
        GpuMap.from_backend(StubBackend([gpu(0, 0), gpu(1, None)]))


@pytest.mark.parametrize(("path", "minor"), [
    ("/dev/nvidia0", 0), ("/dev/nvidia13", 13), ("nvidia3", 3), (" /dev/nvidia2\n", 2),
    ("/dev/nvidiactl", None), ("/dev/nvidia-uvm", None), ("/dev/nvidia-caps/nvidia-cap21", None),
    ("/dev/nvidia", None), ("/dev/dri/card1", None),
])
def test_device_file_minor(path, minor):
    assert device_file_minor(path) == minor


FILES = [f"/dev/nvidia{i}" for i in range(4)]


def test_gres_files_in_minor_order_agree():
    assert check_gres_files(NODE, FILES) == []


def test_gres_files_out_of_minor_order_are_reported_per_position():
    problems = check_gres_files(NODE, ["/dev/nvidia1", "/dev/nvidia0", *FILES[2:]])
    assert len(problems) == 2
    assert problems[0].startswith("Slurm GPU 0 is /dev/nvidia1 (NVML index 3")
    assert "colloc maps Slurm GPU 0 to NVML index 1 (/dev/nvidia0" in problems[0]
    assert problems[1].startswith("Slurm GPU 1 is /dev/nvidia0 (NVML index 1")


def test_gres_files_count_mismatch_and_missing_gpu():
    problems = check_gres_files(NODE, FILES[:3])
    assert any("3 GPU device file(s)" in p and "NVML sees 4" in p for p in problems)
    assert any(p.startswith("NVML index 2 (/dev/nvidia3") and "no device file" in p
               for p in problems)


def test_gres_files_unknown_duplicate_and_non_device_entries():
    problems = check_gres_files(NODE, ["/dev/nvidia0", "/dev/nvidia0", "/dev/nvidiactl",
                                       "/dev/nvidia7"])
    assert any("Slurm GPU 1: /dev/nvidia0 is listed again (already Slurm GPU 0)" in p
               for p in problems)
    assert any("Slurm GPU 2: '/dev/nvidiactl' is not a whole-GPU device file" in p
               for p in problems)
    assert any("Slurm GPU 3: /dev/nvidia7 belongs to no GPU NVML sees (minors: 0, 1, 2, 3)"
               in p for p in problems)
    assert sum("has no device file" in p for p in problems) == 3  # minors 1, 2, 3


def test_gres_files_cannot_be_checked_without_minors():
    sim = [gpu(0, None), gpu(1, None)]
    (only,) = check_gres_files(sim, FILES[:2])
    assert "no minor numbers" in only
    assert check_gres_files([], []) == []
    (mixed,) = check_gres_files([gpu(0, 0), gpu(1, None)], FILES[:2])
    assert "gave no minor number" in mixed  # the GpuIdentityError, as a problem
