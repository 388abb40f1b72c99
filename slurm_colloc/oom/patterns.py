"""The maintained library of out-of-memory messages the epilog recognises.

Why a library of exact messages rather than a loose ``grep -i "out of memory"``: the
epilog turns a match into a requeue on a whole GPU, so a false GPU-OOM wastes a GPU and
a missed one loses the job. Host-memory failures look similar in text (``Out of
memory: Killed process``) but a bigger GPU share does not cure them, so they are
recognised explicitly and reported as their own cause. MPS faults (a co-tenant's fatal
error taking down every client of the GPU's MPS server) are a third cause: the job did
nothing wrong and deserves a requeue, but not a bigger share. ``cuda-fatal`` is the
fourth: a sticky CUDA error (illegal address, device-side assert, launch failure).
Under MPS (Volta and later) one client's fatal exception is reported to *every* client
of the GPU's MPS server, and nothing says which one caused it, so a collocated job
showing it may be a victim; on a GPU of its own it is the job's own bug.

Each entry carries one real example line; ``tests/unit/test_oom_patterns.py`` checks
every example matches its own entry and no entry of another cause. The ``source``
field says where the text was taken from. ``docs/oom-patterns.md`` explains the
decisions (what is deliberately *not* matched and why).

Matching is done on raw bytes: logs are not guaranteed to be UTF-8, and decoding 64 MiB
just to search it would double the epilog's cost. Each pattern names one or more
literal *needles*; the detector finds needles with ``bytes.find`` (fast) and only runs
the regular expressions on lines that contain one.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Cause = Literal["gpu-oom", "mps-fault", "cuda-fatal", "host-oom"]
"""What a pattern detects."""
AttemptCause = Literal["gpu-oom", "mps-fault", "cuda-fatal", "host-oom", "none"]
"""Why an attempt ended, as the scanner, the epilog, the accounting record and the
report all carry it (one type end to end)."""
CAUSES: tuple[AttemptCause, ...] = ("gpu-oom", "mps-fault", "cuda-fatal", "host-oom", "none")
REQUEUE_CAUSES: tuple[AttemptCause, ...] = ("gpu-oom", "mps-fault", "cuda-fatal")
"""Causes the epilog may requeue a colloc-placed job for (requeue_policy decides)."""
GPU_CRASH_CAUSES: tuple[AttemptCause, ...] = ("gpu-oom", "mps-fault")
"""Causes the reports count as GPU memory crashes of a shared job."""
Confidence = Literal["high", "medium"]

CAUSE_PRIORITY: dict[str, int] = {
    "gpu-oom": 4, "mps-fault": 3, "cuda-fatal": 2, "host-oom": 1, "none": 0}
"""Which cause wins when a log shows several: a GPU OOM is the one colloc can act on
(requeue on a whole GPU); an MPS fault also leads to a requeue; a fatal CUDA error
leads to one only under MPS (see ``cuda-fatal`` below); host OOM is reported."""


@dataclass(frozen=True)
class OomPattern:
    """One framework message: how to find it and where its text comes from."""

    id: str
    cause: Cause
    framework: str
    needles: tuple[bytes, ...]
    """Literal byte strings, one of which occurs in every match (case-sensitive)."""
    regex: re.Pattern[bytes]
    example: str
    """A real line (numbers may differ) that this entry must match."""
    source: str
    """Where the exact text was seen (issue thread or source file)."""
    confidence: Confidence = "high"
    """``medium``: the text can also appear in a run that went on to succeed (e.g. a
    framework that retries a smaller allocation); act on it only if the job failed."""


def _p(
    id: str,
    cause: Cause,
    framework: str,
    needles: Sequence[str],
    regex: str,
    example: str,
    source: str,
    confidence: Confidence = "high",
) -> OomPattern:
    return OomPattern(
        id=id,
        cause=cause,
        framework=framework,
        needles=tuple(n.encode() for n in needles),
        regex=re.compile(regex.encode()),
        example=example,
        source=source,
        confidence=confidence,
    )


# Order matters within a cause: the first entry that matches a line names it, so the
# specific entries come before the general ones.
PATTERNS: tuple[OomPattern, ...] = (
    # ----------------------------------------------------------------- GPU OOM -----
    _p(
        "torch-cuda-oom-legacy",
        "gpu-oom",
        "pytorch<2.1",
        ["CUDA out of memory"],
        r"CUDA out of memory\. Tried to allocate [^(\n]{0,40}\(GPU \d+;",
        "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB "
        "total capacity; 14.24 GiB already allocated; 11.88 MiB free; 14.69 GiB reserved "
        "in total by PyTorch)",
        "c10/cuda/CUDACachingAllocator.cpp before 2.1; seen in "
        "github.com/open-mmlab/mmsegmentation/issues/944, pytorch/pytorch#16417",
    ),
    _p(
        "torch-cuda-oom",
        "gpu-oom",
        "pytorch",
        ["CUDA out of memory"],
        r"(?:OutOfMemoryError: CUDA out of memory|CUDA out of memory\. Tried to allocate)",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has "
        "a total capacity of 39.38 GiB of which 1.58 GiB is free. Including non-PyTorch "
        "memory, this process has 37.80 GiB memory in use.",
        "c10/cuda/CUDACachingAllocator.cpp >= 2.1 (torch.OutOfMemoryError, alias "
        "torch.cuda.OutOfMemoryError); seen in pytorch/pytorch#16417 (2024 comment), "
        "NVIDIA/nccl#1284",
    ),
    _p(
        "torch-hip-oom",
        "gpu-oom",
        "pytorch-rocm",
        ["HIP out of memory"],
        r"(?:OutOfMemoryError: HIP out of memory|HIP out of memory\. Tried to allocate)",
        "torch.OutOfMemoryError: HIP out of memory. Tried to allocate 1.50 GiB. GPU 0 has "
        "a total capacity of 63.98 GiB of which 1.04 GiB is free.",
        "same allocator message on ROCm builds (CUDA -> HIP hipification)",
    ),
    _p(
        "cuda-error-oom",
        "gpu-oom",
        "cuda-runtime",
        ["CUDA error: out of memory"],
        r"CUDA error: out of memory",
        "RuntimeError: CUDA error: out of memory",
        "PyTorch C10_CUDA_CHECK prints 'CUDA error: ' + cudaGetErrorString("
        "cudaErrorMemoryAllocation) == 'out of memory' (c10/cuda/CUDAException.cpp)",
    ),
    _p(
        "cuda-runtime-alloc",
        "gpu-oom",
        "cuda-runtime",
        ["cudaErrorMemoryAllocation"],
        r"\bcudaErrorMemoryAllocation\b",
        "cupy_backends.cuda.api.runtime.CUDARuntimeError: cudaErrorMemoryAllocation: out of memory",
        "CUDA runtime enum cudaErrorMemoryAllocation = 2 (driver_types.h), printed by name "
        "by CuPy, thrust and others; MPS pinned-memory limit overruns surface as this",
    ),
    _p(
        "cuda-driver-oom",
        "gpu-oom",
        "cuda-driver",
        ["CUDA_ERROR_OUT_OF_MEMORY"],
        r"\bCUDA_ERROR_OUT_OF_MEMORY\b",
        "E tensorflow/stream_executor/cuda/cuda_driver.cc:806] failed to allocate 3.77G "
        "(4046333952 bytes) from device: CUDA_ERROR_OUT_OF_MEMORY: out of memory",
        "CUDA driver enum CUDA_ERROR_OUT_OF_MEMORY = 2 (cuda.h); TensorFlow, JAX, numba",
        confidence="medium",  # TF logs it while shrinking its first pool, then carries on
    ),
    _p(
        "cupy-oom",
        "gpu-oom",
        "cupy",
        ["OutOfMemoryError: Out of memory allocating"],
        r"OutOfMemoryError: Out of memory allocating [\d,]+ bytes",
        "cupy.cuda.memory.OutOfMemoryError: Out of memory allocating 1,073,741,824 bytes "
        "(allocated so far: 15,032,385,536 bytes).",
        "cupy/cuda/memory.pyx OutOfMemoryError message",
    ),
    _p(
        "cublas-alloc-failed",
        "gpu-oom",
        "cublas",
        ["CUBLAS_STATUS_ALLOC_FAILED"],
        r"\bCUBLAS_STATUS_ALLOC_FAILED\b",
        "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "QwenLM/Qwen3#873, DeepMotionAIResearch/DenseMatchingBenchmark#20; TF: "
        "'failed to create cublas handle: CUBLAS_STATUS_ALLOC_FAILED' (tensorflow#7072)",
    ),
    _p(
        "cudnn-alloc-failed",
        "gpu-oom",
        "cudnn",
        ["CUDNN_STATUS_ALLOC_FAILED"],
        r"\bCUDNN_STATUS_ALLOC_FAILED\b",
        "RuntimeError: cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
        "pytorch/pytorch#20123, kbardool/Keras-frcnn#97 ('Could not create cudnn handle: "
        "CUDNN_STATUS_ALLOC_FAILED'), microsoft/CNTK#220",
    ),
    _p(
        "cuda-lib-alloc-failed",
        "gpu-oom",
        "cusolver/cusparse/cufft",
        ["ALLOC_FAILED"],
        r"\b(?:CUSOLVER_STATUS|CUSPARSE_STATUS|CURAND_STATUS|CUFFT)_ALLOC_FAILED\b",
        "RuntimeError: cusolver error: CUSOLVER_STATUS_ALLOC_FAILED, when calling "
        "`cusolverDnCreate(handle)`",
        "status enums of cuSOLVER/cuSPARSE/cuRAND/cuFFT (ALLOC_FAILED = 'resource "
        "allocation failed' in their headers), printed by name by PyTorch",
    ),
    _p(
        "tf-oom-gpu",
        "gpu-oom",
        "tensorflow",
        ["OOM when allocating"],
        r"OOM when allocating tensor.{0,400}?device:GPU:\d+",
        "tensorflow.python.framework.errors_impl.ResourceExhaustedError: OOM when "
        "allocating tensor with shape[25088,4096] and type float on "
        "/job:localhost/replica:0/task:0/device:GPU:0 by allocator GPU_0_bfc",
        "tensorflow/models#7142, dBeker/Faster-RCNN-TensorFlow-Python3#110",
    ),
    _p(
        "tf-oom-cpu",
        "host-oom",
        "tensorflow",
        ["OOM when allocating"],
        r"OOM when allocating tensor.{0,400}?(?:device:CPU:\d+|by allocator cpu)",
        "ResourceExhaustedError: OOM when allocating tensor with shape[64,512,512] and "
        "type float on /job:localhost/replica:0/task:0/device:CPU:0 by allocator cpu",
        "same message as tf-oom-gpu with the CPU device and allocator",
    ),
    _p(
        "tf-oom",
        "gpu-oom",
        "tensorflow",
        ["OOM when allocating"],
        r"OOM when allocating tensor",
        "ResourceExhaustedError (see above for traceback): OOM when allocating tensor "
        "with shape[100,4096,32]",
        "older TF 1.x lines without the device (santi-pdp/segan#42)",
        confidence="medium",
    ),
    _p(
        "xla-oom",
        "gpu-oom",
        "jax/xla",
        ["RESOURCE_EXHAUSTED", "Resource exhausted: Out of memory"],
        r"(?:RESOURCE_EXHAUSTED|Resource exhausted): (?:Out of memory (?:while trying to "
        r"allocate|allocating)|Failed to allocate request for)",
        "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while "
        "trying to allocate 7406166528 bytes.",
        "google-deepmind/alphafold#1023, jax-ml/jax#13428; 'Failed to allocate request "
        "for 2.99GiB' from ecmwf-lab/ai-models-graphcast#18; 'Resource exhausted: Out of "
        "memory while trying to allocate' from jax-ml/jax#788",
    ),
    _p(
        "nccl-cuda-oom",
        "gpu-oom",
        "nccl",
        ["NCCL WARN"],
        r"NCCL WARN (?:Cuda failure (?:\d+ )?'out of memory'|Failed to CUDA "
        r"(?:calloc|malloc|host alloc) \d+ bytes)",
        "node:2134736:2285781 [0] include/alloc.h:178 NCCL WARN Cuda failure 'out of memory'",
        "NVIDIA/nccl#962, NVIDIA/nccl#1235, NVIDIA/TensorRT-LLM#1670 (NCCL_DEBUG=WARN)",
    ),
    # -------------------------------------------------------------- MPS faults -----
    _p(
        "mps-server-not-ready",
        "mps-fault",
        "cuda-mps",
        ["MpsServerNotReady", "MPS_SERVER_NOT_READY", "MPS server is not ready"],
        r"cudaErrorMpsServerNotReady|CUDA_ERROR_MPS_SERVER_NOT_READY|MPS server is not "
        r"ready to accept new MPS client requests",
        "E ggml_cuda_init: failed to initialize CUDA: MPS server is not ready to accept "
        "new MPS client requests",
        "CUDA runtime enum 807 and its cudaGetErrorString text (driver_types.h); the "
        "server refuses clients while recovering from a client's fatal fault",
    ),
    _p(
        "mps-client-terminated",
        "mps-fault",
        "cuda-mps",
        ["MpsClientTerminated", "MPS_CLIENT_TERMINATED", "MPS client has been terminated"],
        r"cudaErrorMpsClientTerminated|CUDA_ERROR_MPS_CLIENT_TERMINATED|MPS client has "
        r"been terminated by the server",
        "RuntimeError: CUDA error: the MPS client has been terminated by the server",
        "CUDA runtime enum 810 and its cudaGetErrorString text (driver_types.h)",
    ),
    _p(
        "mps-rpc-failure",
        "mps-fault",
        "cuda-mps",
        ["MpsRpcFailure", "MPS_RPC_FAILURE", "remote procedural call between the MPS"],
        r"cudaErrorMpsRpcFailure|CUDA_ERROR_MPS_RPC_FAILURE|remote procedural call "
        r"between the MPS server and the MPS client failed",
        "RuntimeError: CUDA error: the remote procedural call between the MPS server and "
        "the MPS client failed",
        "CUDA runtime enum 806 and its cudaGetErrorString text (driver_types.h)",
    ),
    _p(
        "mps-connection-failed",
        "mps-fault",
        "cuda-mps",
        ["MpsConnectionFailed", "MPS_CONNECTION_FAILED", "failed to connect to the MPS"],
        r"cudaErrorMpsConnectionFailed|CUDA_ERROR_MPS_CONNECTION_FAILED|MPS client failed "
        r"to connect to the MPS control daemon or the MPS server",
        "RuntimeError: CUDA error: MPS client failed to connect to the MPS control daemon "
        "or the MPS server",
        "CUDA runtime enum 805 and its cudaGetErrorString text (driver_types.h)",
    ),
    _p(
        "mps-max-clients",
        "mps-fault",
        "cuda-mps",
        ["MpsMaxClientsReached", "MPS_MAX_CLIENTS_REACHED", "required to create MPS client"],
        r"cudaErrorMpsMaxClientsReached|CUDA_ERROR_MPS_MAX_CLIENTS_REACHED|hardware "
        r"resources required to create MPS client have been exhausted",
        "RuntimeError: CUDA error: the hardware resources required to create MPS client "
        "have been exhausted",
        "CUDA runtime enum 808 and its cudaGetErrorString text (driver_types.h)",
    ),
    # ------------------------------------------------- fatal (sticky) CUDA errors -----
    _p(
        "cuda-illegal-address",
        "cuda-fatal",
        "cuda",
        ["illegal memory access", "IllegalAddress", "ILLEGAL_ADDRESS"],
        r"an illegal memory access was encountered|cudaErrorIllegalAddress|"
        r"CUDA_ERROR_ILLEGAL_ADDRESS",
        "RuntimeError: CUDA error: an illegal memory access was encountered",
        "CUDA runtime enum 700 and its cudaGetErrorString text (driver_types.h); "
        "pytorch/pytorch#88559; under MPS reported to every client of the server "
        "(NVIDIA MPS docs, error containment)",
    ),
    _p(
        "cuda-device-assert",
        "cuda-fatal",
        "cuda",
        ["device-side assert triggered", "cudaErrorAssert", "CUDA_ERROR_ASSERT"],
        r"device-side assert triggered|cudaErrorAssert\b|CUDA_ERROR_ASSERT\b",
        "RuntimeError: CUDA error: device-side assert triggered",
        "CUDA runtime enum 710 and its cudaGetErrorString text (driver_types.h); "
        "the usual face of an out-of-range class index in PyTorch",
    ),
    _p(
        "cuda-launch-failure",
        "cuda-fatal",
        "cuda",
        ["unspecified launch failure", "cudaErrorLaunchFailure", "CUDA_ERROR_LAUNCH_FAILED"],
        r"unspecified launch failure|cudaErrorLaunchFailure|CUDA_ERROR_LAUNCH_FAILED",
        "RuntimeError: CUDA error: unspecified launch failure",
        "CUDA runtime enum 719 and its cudaGetErrorString text (driver_types.h)",
    ),
    _p(
        "cuda-illegal-instruction",
        "cuda-fatal",
        "cuda",
        ["illegal instruction was encountered", "error: misaligned address",
         "IllegalInstruction", "MisalignedAddress", "ILLEGAL_INSTRUCTION",
         "MISALIGNED_ADDRESS"],
        # "misaligned address" alone is also a CPU bus error: only CUDA's phrasing
        r"an illegal instruction was encountered|CUDA error: misaligned address|"
        r"cudaError(IllegalInstruction|MisalignedAddress)|"
        r"CUDA_ERROR_(ILLEGAL_INSTRUCTION|MISALIGNED_ADDRESS)",
        "RuntimeError: CUDA error: misaligned address",
        "CUDA runtime enums 715 and 716 and their cudaGetErrorString texts (driver_types.h)",
    ),
    # --------------------------------------------------------------- host OOM -----
    _p(
        "slurm-oom-kill",
        "host-oom",
        "slurm",
        ["oom_kill event", "oom-kill event"],
        r"Detected \d+ oom[-_]kill event",
        "slurmstepd: error: Detected 1 oom_kill event in StepId=440575.0. Some of the "
        "step tasks have been OOM Killed.",
        "slurmstepd task/cgroup (>= 21.08 'oom_kill event in StepId='; older "
        "'oom-kill event(s) in step N.0 cgroup'): chrisknewman/tusas#149, "
        "hafs-community/HAFS#101",
    ),
    _p(
        "srun-task-oom",
        "host-oom",
        "slurm",
        ["Out Of Memory"],
        r"srun: error: \S+: tasks? [\d,-]+: Out Of Memory",
        "srun: error: nid001277: tasks 1-3: Out Of Memory",
        "srun after a cgroup OOM kill (chrisknewman/tusas#149)",
    ),
    _p(
        "kernel-oom-killer",
        "host-oom",
        "linux",
        ["Killed process", "oom-kill:"],
        r"(?:Out of memory|Memory cgroup out of memory): Killed process \d+|oom-kill:constraint=",
        "Memory cgroup out of memory: Killed process 2749 (python) total-vm:31234567kB, "
        "anon-rss:16000000kB",
        "mm/oom_kill.c dump lines (dmesg; copied into logs by some site prologs)",
    ),
    _p(
        "dataloader-killed",
        "host-oom",
        "pytorch",
        ["DataLoader worker"],
        r"DataLoader worker \(pids?(?:\(s\))? [\d, ]+\) is killed by signal: Killed",
        "RuntimeError: DataLoader worker (pid 22048) is killed by signal: Killed.",
        "torch/utils/data/_utils/signal_handling.py; mittagessen/kraken#266, pytorch/pytorch#8976",
    ),
    _p(
        "torch-cpu-alloc",
        "host-oom",
        "pytorch",
        ["DefaultCPUAllocator"],
        r"DefaultCPUAllocator: (?:can't allocate memory|not enough memory)",
        "RuntimeError: [enforce fail at alloc_cpu.cpp:75] err == 0. DefaultCPUAllocator: "
        "can't allocate memory: you tried to allocate 132426121216 bytes. Error code 12 "
        "(Cannot allocate memory)",
        "c10/core/impl/alloc_cpu.cpp; pytorch/pytorch#20618, mxfold/mxfold2#20",
    ),
    _p(
        "python-memoryerror",
        "host-oom",
        "python",
        ["MemoryError"],
        r"(?:^|[\s.])(?:_ArrayMemoryError|MemoryError)(?::|\s*$)",
        "numpy.core._exceptions._ArrayMemoryError: Unable to allocate 3.15 GiB for an "
        "array with shape (1024, 1024, 806) and data type float32",
        "Python's MemoryError and numpy's subclass (numpy/core/_exceptions.py)",
    ),
    _p(
        "cpp-bad-alloc",
        "host-oom",
        "c++",
        ["bad_alloc"],
        r"std::bad_alloc",
        "terminate called after throwing an instance of 'std::bad_alloc'",
        "libstdc++ terminate handler text",
    ),
)

BY_ID: dict[str, OomPattern] = {p.id: p for p in PATTERNS}

# Explicitly *not* matched (see docs/oom-patterns.md):
#  - CUDNN_STATUS_NOT_ENOUGH_WORKSPACE / *_INSUFFICIENT_WORKSPACE: the caller passed a
#    smaller workspace than the chosen algorithm needs; a bigger GPU share does not
#    change that.
#  - ncclSystemError / "unhandled cuda error" alone: generic; the NCCL WARN line that
#    precedes it carries the real cause and is matched above.
#  - TensorFlow "Allocator (GPU_0_bfc) ran out of memory ... The caller indicates that
#    this is not a failure": explicitly not a failure.
#  - "cudaErrorMpsMemoryLimitReached": no such CUDA error exists; going over
#    CUDA_MPS_PINNED_DEVICE_MEM_LIMIT is an ordinary out-of-memory error.
#  - a bare "Killed" from the shell: SIGKILL has many senders (scancel, time limit).
