"""The pattern library: every example matches its own entry, host OOM never reads as GPU."""

from __future__ import annotations

import re

import pytest

from slurm_colloc.oom.detector import _DEFAULT_LIBRARY
from slurm_colloc.oom.patterns import BY_ID, PATTERNS

# Real lines (numbers as seen in the cited threads) and the id each must get.
REAL_LINES = [
    ("RuntimeError: CUDA error: an illegal memory access was encountered",
     "cuda-illegal-address"),
    ("terminate called after throwing an instance of 'c10::Error'  what():  CUDA error: "
     "unspecified launch failure", "cuda-launch-failure"),
    ("../aten/src/ATen/native/cuda/Loss.cu:240: nll_loss_forward_reduce_cuda_kernel_2d: "
     "block: [0,0,0], thread: [5,0,0] Assertion `t >= 0 && t < n_classes` failed. "
     "RuntimeError: CUDA error: device-side assert triggered", "cuda-device-assert"),
    (
        "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total "
        "capacity; 14.2 GiB already allocated; 3.56 MiB free; 787.74 MiB cached)",
        "torch-cuda-oom-legacy",
    ),
    (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 22.00 MiB. GPU 0 has a "
        "total capacity of 23.65 GiB of which 11.06 MiB is free.",
        "torch-cuda-oom",
    ),
    (
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate more than 1EB memory.",
        "torch-cuda-oom",
    ),
    ("RuntimeError: CUDA error: out of memory", "cuda-error-oom"),
    (
        "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported",
        "cuda-error-oom",
    ),
    (
        "cupy_backends.cuda.api.runtime.CUDARuntimeError: cudaErrorMemoryAllocation: out of memory",
        "cuda-runtime-alloc",
    ),
    (
        "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "cublas-alloc-failed",
    ),
    (
        "E tensorflow/stream_executor/cuda/cuda_blas.cc:372] failed to create cublas handle: "
        "CUBLAS_STATUS_ALLOC_FAILED",
        "cublas-alloc-failed",
    ),
    ("Could not create cudnn handle: CUDNN_STATUS_ALLOC_FAILED", "cudnn-alloc-failed"),
    (
        "  (0) Resource exhausted: OOM when allocating tensor with shape[16,112,112,147] and type "
        "float on /job:localhost/replica:0/task:0/device:GPU:0 by allocator GPU_0_bfc",
        "tf-oom-gpu",
    ),
    (
        "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to "
        "allocate 4770354232 bytes.",
        "xla-oom",
    ),
    (
        "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Failed to allocate request for "
        "2.99GiB (3206250496B) on device ordinal 0",
        "xla-oom",
    ),
    (
        "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory allocating "
        "20029400304 bytes.",
        "xla-oom",
    ),
    (
        "ins-7df6:3018451:3018451 [0] enqueue.cc:1085 NCCL WARN Cuda failure 'out of memory'",
        "nccl-cuda-oom",
    ),
    (
        "ng30903:3063028:3066152 [3] include/alloc.h:185 NCCL WARN Failed to CUDA calloc 6291456 "
        "bytes",
        "nccl-cuda-oom",
    ),
    ("node:1:2 [0] include/alloc.h:102 NCCL WARN Cuda failure 2 'out of memory'", "nccl-cuda-oom"),
    (
        "RuntimeError: CUDA error: MPS client failed to connect to the MPS control daemon or the "
        "MPS server",
        "mps-connection-failed",
    ),
    ("cudaErrorMpsServerNotReady", "mps-server-not-ready"),
    ("CUDA_ERROR_MPS_CLIENT_TERMINATED", "mps-client-terminated"),
    (
        "slurmstepd: error: Detected 2 oom_kill events in StepId=JOBID.13. Some of the step tasks "
        "have been OOM Killed.",
        "slurm-oom-kill",
    ),
    (
        "slurmstepd: error: Detected 1 oom-kill event(s) in step 3495064.0 cgroup. Some of your "
        "processes may have been killed by the cgroup out-of-memory handler.",
        "slurm-oom-kill",
    ),
    ("srun: error: Orion-01-01: task 4: Out Of Memory", "srun-task-oom"),
    ("Out of memory: Killed process 1234 (python) total-vm:1kB", "kernel-oom-killer"),
    (
        "RuntimeError: DataLoader worker (pid 1817) is killed by signal: Killed. ",
        "dataloader-killed",
    ),
    ("MemoryError", "python-memoryerror"),
    ("MemoryError: Unable to allocate array", "python-memoryerror"),
    ("  what():  std::bad_alloc", "cpp-bad-alloc"),
    (
        "RuntimeError: [enforce fail at CPUAllocator.cpp:64] . DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 1178729664 bytes. Error code 12 (Cannot allocate memory)",
        "torch-cpu-alloc",
    ),
]

# Lines that mention memory but are no OOM of any kind (or not one we act on).
NOT_OOM = [
    "If you encounter CUDA out of memory, try to set --tile with a smaller number.",
    "W tensorflow/core/common_runtime/bfc_allocator.cc:275] Allocator (GPU_0_bfc) ran out of "
    "memory trying to allocate 2.20GiB with freed_by_count=0. The caller indicates that this "
    "is not a failure, but may mean that there could be performance gains if more memory were "
    "available.",
    "ubuntu:9621:9688 [3] misc/shmutils.cc:112 NCCL WARN Error while creating shared memory "
    "segment /dev/shm/nccl-KWfVyt (size 5967872)",
    "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1296, unhandled "
    "cuda error, NCCL version 2.18.1",
    "RuntimeError: DataLoader worker (pid 25902) is killed by signal: Segmentation fault",
    "/var/spool/slurm/job1/slurm_script: line 12:  4242 Killed   python train.py",
    "cudnn error: CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
    "epoch 3: memory 12.1 GiB, OOM-safe batch size 64",
    "torch.cuda.memory_summary(): |===== PyTorch CUDA memory summary =====|",
    "Bus error (core dumped): misaligned address in memcpy",
]


def classify(line: str) -> str | None:
    p = _DEFAULT_LIBRARY.classify(line.encode())
    return p.id if p else None


def test_ids_unique_and_fields_filled() -> None:
    assert len(BY_ID) == len(PATTERNS)
    for p in PATTERNS:
        assert re.fullmatch(r"[a-z0-9-]+", p.id)
        assert p.needles and p.example and p.source and p.framework
        assert p.cause in ("gpu-oom", "mps-fault", "cuda-fatal", "host-oom")


@pytest.mark.parametrize("pattern", PATTERNS, ids=lambda p: p.id)
def test_example_matches_own_entry(pattern) -> None:
    assert classify(pattern.example) == pattern.id


@pytest.mark.parametrize("pattern", PATTERNS, ids=lambda p: p.id)
def test_every_match_contains_a_needle(pattern) -> None:
    """The detector only runs a regex where a needle is: each match must hold one."""
    m = pattern.regex.search(pattern.example.encode())
    assert m is not None
    assert any(n in pattern.example.encode() for n in pattern.needles)


@pytest.mark.parametrize(("line", "expected"), REAL_LINES)
def test_real_lines(line: str, expected: str) -> None:
    assert classify(line) == expected


@pytest.mark.parametrize("line", NOT_OOM)
def test_not_oom(line: str) -> None:
    assert classify(line) is None


@pytest.mark.parametrize(
    "pattern", [p for p in PATTERNS if p.cause == "host-oom"], ids=lambda p: p.id
)
def test_host_examples_never_gpu(pattern) -> None:
    hit = _DEFAULT_LIBRARY.classify(pattern.example.encode())
    assert hit is not None and hit.cause == "host-oom"


def test_tf_cpu_oom_is_host() -> None:
    line = (
        "ResourceExhaustedError: OOM when allocating tensor with shape[64,512] and type float "
        "on /job:localhost/replica:0/task:0/device:CPU:0 by allocator cpu"
    )
    assert classify(line) == "tf-oom-cpu"
