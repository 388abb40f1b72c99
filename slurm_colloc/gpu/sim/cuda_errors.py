"""CUDA runtime errors a simjob dies of, in PyTorch's words (out of memory: :mod:`.oom`).

PyTorch turns a failed CUDA runtime call into a ``RuntimeError`` built by
``c10_cuda_check_implementation`` (c10/cuda/CUDAException.cpp): ``CUDA error: ``
and ``cudaGetErrorString(err)``, then (``get_cuda_check_suffix``, unless
``CUDA_LAUNCH_BLOCKING=1``) two hint lines, then the device-side-assertion note of
builds without ``TORCH_USE_CUDA_DSA`` (all release wheels)::

    RuntimeError: CUDA error: an illegal memory access was encountered
    CUDA kernel errors might be asynchronously reported at some other API call, so the
    stacktrace below might be incorrect.
    For debugging consider passing CUDA_LAUNCH_BLOCKING=1
    Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.

(Four lines: the first hint is one line. Some PyTorch 2.x releases end the second
hint with a full stop; releases from 2.8 on raise ``torch.AcceleratorError``, a
``RuntimeError`` subclass, instead.)

The errors simulated, from ``cudaError_t`` in the CUDA runtime API (driver_types.h):

* ``cudaErrorIllegalAddress = 700``, "an illegal memory access was encountered": a
  fatal (sticky) GPU exception. Under Volta+ MPS a fatal exception of one client is
  reported to every client of the same server on that GPU, without saying whose it
  was, and all of them must exit.
* ``cudaErrorMpsServerNotReady = 807``, "MPS server is not ready to accept new MPS
  client requests": what a new client gets while its MPS server recovers from a
  fatal exception (until every client of the server has exited).
* ``cudaErrorMemoryAllocation = 2``, "out of memory": the CUDA context itself does
  not fit on the GPU. PyTorch's caching allocator never sees this one (it is not a
  ``torch.OutOfMemoryError``), so the text is the generic CUDA error's.

One error is PyTorch's own, not a ``cudaError_t``: when no device is visible,
``torch.cuda``'s lazy initialisation raises ``RuntimeError: No CUDA GPUs are
available`` (:data:`NO_GPUS`), without the hint lines. Under MPS that is what a client gets whose
``CUDA_VISIBLE_DEVICES`` names no device of its server: CUDA drops the entries of
the list from the first invalid one on, and an empty list means no device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class CudaError:
    """One ``cudaError_t`` value and its ``cudaGetErrorString`` text."""

    code: int
    name: str
    text: str


ILLEGAL_ADDRESS = CudaError(
    700, "cudaErrorIllegalAddress", "an illegal memory access was encountered"
)
MPS_SERVER_NOT_READY = CudaError(
    807,
    "cudaErrorMpsServerNotReady",
    "MPS server is not ready to accept new MPS client requests",
)
MEMORY_ALLOCATION = CudaError(2, "cudaErrorMemoryAllocation", "out of memory")

NO_GPUS = "RuntimeError: No CUDA GPUs are available"
"""PyTorch's text for no visible device (``device_count_ensure_non_zero`` in
c10/cuda/CUDAFunctions.cpp, reached from ``torch.cuda``'s lazy initialisation)."""

_HINTS = (
    "CUDA kernel errors might be asynchronously reported at some other API call, "
    "so the stacktrace below might be incorrect.\n"
    "For debugging consider passing CUDA_LAUNCH_BLOCKING=1"
)
_DSA_NOTE = "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions."


def torch_cuda_error(error: CudaError, env: Mapping[str, str] | None = None) -> str:
    """The ``RuntimeError`` PyTorch raises for ``error`` (several lines, no final newline).

    ``env`` is the job's environment: with ``CUDA_LAUNCH_BLOCKING=1`` PyTorch leaves
    out the two hint lines, as here.
    """
    blocking = (env or {}).get("CUDA_LAUNCH_BLOCKING", "").strip()
    try:
        blocking_on = int(blocking) != 0
    except ValueError:
        blocking_on = False
    lines = [f"RuntimeError: CUDA error: {error.text}"]
    if not blocking_on:
        lines.append(_HINTS)
    lines.append(_DSA_NOTE)
    return "\n".join(lines)
