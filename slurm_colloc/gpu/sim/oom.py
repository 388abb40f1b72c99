"""The out-of-memory text a simjob prints: PyTorch 2.x's, byte for byte in form.

The epilog recognises GPU OOM crashes by their text, so the simulation must fail the
way a real training job fails. Format of ``torch.OutOfMemoryError`` as raised by the
CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, PyTorch >= 2.1)::

    torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a
    total capacity of 39.38 GiB of which 1.58 GiB is free. Process 2493055 has 12.02 GiB
    memory in use. Including non-PyTorch memory, this process has 966.00 MiB memory in
    use. Of the allocated memory ... is allocated by PyTorch, and ... is reserved by
    PyTorch but unallocated. If reserved but unallocated memory is large try setting
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See
    documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)

(one line; the double spaces are PyTorch's).
"""

from __future__ import annotations

from slurm_colloc.units import MIB, torch_format_size

_TAIL = (
    "If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  "
    "See documentation for Memory Management  "
    "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)


def torch_oom_message(
    request_mib: int,
    device: int,
    total_mib: int,
    free_mib: int,
    own_mib: int,
    others: list[tuple[int, int]],
    *,
    torch_mib: int | None = None,
) -> str:
    """The ``torch.OutOfMemoryError`` line for a failed allocation.

    ``device`` is the index the process sees (0 under ``CUDA_VISIBLE_DEVICES=3``);
    ``others`` are (pid, MiB) of the GPU's other processes, listed as PyTorch lists
    what NVML reports. ``own_mib`` is the process's whole footprint ("including
    non-PyTorch memory": its CUDA context too), ``torch_mib`` what of it PyTorch
    allocated (default: all of it).
    """
    parts = [
        "torch.OutOfMemoryError: CUDA out of memory. "
        f"Tried to allocate {torch_format_size(request_mib * MIB)}. "
        f"GPU {device} has a total capacity of {torch_format_size(total_mib * MIB)} "
        f"of which {torch_format_size(max(0, free_mib) * MIB)} is free. "
    ]
    parts += [
        f"Process {pid} has {torch_format_size(mib * MIB)} memory in use. " for pid, mib in others
    ]
    parts.append(
        f"Including non-PyTorch memory, this process has {torch_format_size(own_mib * MIB)} "
        f"memory in use. Of the allocated memory "
        f"{torch_format_size(max(0, own_mib if torch_mib is None else torch_mib) * MIB)} is "
        f"allocated by PyTorch, and {torch_format_size(0)} is reserved by PyTorch but "
        "unallocated. "
    )
    parts.append(_TAIL)
    return "".join(parts)


def torch_traceback(message: str) -> str:
    """The message as an uncaught exception would print it (traceback header first)."""
    return (
        "Traceback (most recent call last):\n"
        '  File "colloc-simjob", line 1, in <module>\n'
        f"{message}\n"
    )
