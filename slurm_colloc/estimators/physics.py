"""What PyTorch training keeps on the GPU, independent of any calibration.

* Weights, gradients and optimizer state are exact multiples of the parameter count:
  fp32 weights and gradients (also under AMP, where the optimizer sees fp32 master
  weights) and 0 / 1 / 2 fp32 buffers for sgd / momentum / adam(w). The ``foreach``
  Adam step makes one more parameter-sized temporary list. AMP adds a cached half
  copy of the weights.
* The caching allocator never hands back a raw size: requests are rounded to 512 B;
  requests under 1 MiB share 2 MiB segments, requests up to 10 MiB are carved out of
  20 MiB segments, larger ones get their own segment rounded to 2 MiB. What
  nvidia-smi sees is the reserved segments, not the allocated bytes.
"""

from __future__ import annotations

import math
from typing import Literal

Optimizer = Literal["sgd", "momentum", "adam", "adamw"]
Precision = Literal["fp32", "amp-fp16", "amp-bf16"]
OPTIMIZERS: tuple[str, ...] = ("sgd", "momentum", "adam", "adamw")
PRECISIONS: tuple[str, ...] = ("fp32", "amp-fp16", "amp-bf16")

MIB = 1024 * 1024
SMALL_SIZE = 1 * MIB
SMALL_SEGMENT = 2 * MIB
LARGE_SEGMENT = 20 * MIB
MIN_LARGE_ALLOC = 10 * MIB
ROUND_LARGE = 2 * MIB

OPTIMIZER_STATE_BYTES: dict[str, int] = {"sgd": 0, "momentum": 4, "adam": 8, "adamw": 8}
"""fp32 state buffers per trainable parameter (momentum: 1 buffer; Adam: exp_avg and
exp_avg_sq)."""
OPTIMIZER_STEP_TEMP_BYTES: dict[str, int] = {"sgd": 0, "momentum": 0, "adam": 4, "adamw": 4}
"""Parameter-sized temporaries of one ``foreach`` optimizer step (Adam's denominator)."""


def activation_bytes_per_elem(precision: str) -> float:
    """Bytes per saved activation element. Under autocast most saved tensors are half
    precision, but normalisation and softmax outputs stay fp32: 2.5 is a conservative
    mean (no measured AMP data here; the uncertainty says so)."""
    return 4.0 if precision == "fp32" else 2.5


def param_bytes(total: int, trainable: int, optimizer: str, precision: str) -> dict[str, int]:
    """Bytes for weights, gradients, optimizer state and step temporaries."""
    amp_copy = 2 * total if precision != "fp32" else 0
    return {
        "weights": 4 * total + amp_copy,
        "gradients": 4 * trainable,
        "optimizer_state": OPTIMIZER_STATE_BYTES[optimizer] * trainable,
        "optimizer_step": OPTIMIZER_STEP_TEMP_BYTES[optimizer] * trainable,
    }


def round_request(nbytes: float) -> int:
    """Bytes the caching allocator reserves for one request on its own."""
    n = max(512, math.ceil(nbytes / 512) * 512)
    if n >= MIN_LARGE_ALLOC:
        return math.ceil(n / ROUND_LARGE) * ROUND_LARGE
    return n


class SegmentPacker:
    """Accumulate tensors the way the allocator's small / large pools hold them."""

    def __init__(self) -> None:
        self.small = 0
        self.mid = 0
        self.large = 0
        self.raw = 0.0

    def add(self, nbytes: float, count: int = 1) -> None:
        """Add ``count`` tensors of ``nbytes`` each."""
        if nbytes <= 0 or count <= 0:
            return
        self.raw += nbytes * count
        r = round_request(nbytes)
        if r < SMALL_SIZE:
            self.small += r * count
        elif r < MIN_LARGE_ALLOC:
            self.mid += r * count
        else:
            self.large += r * count

    def reserved(self) -> int:
        """Reserved bytes: pools rounded up to whole segments."""
        small = math.ceil(self.small / SMALL_SEGMENT) * SMALL_SEGMENT
        mid = math.ceil(self.mid / LARGE_SEGMENT) * LARGE_SEGMENT
        return small + mid + self.large
