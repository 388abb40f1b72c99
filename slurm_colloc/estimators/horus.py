"""The Horus formula (Yeung et al., "Horus: interference-aware and prediction-based
scheduling in deep learning systems", IEEE TPDS 2022), kept as a published baseline.

``memory = 4 bytes x [(activations x batch + params) + batch x params]``, where
activations are the summed layer output elements per sample. No context, no
optimizer state, no allocator: it is here to be compared against, not trusted.
"""

from __future__ import annotations

import math

from slurm_colloc.estimators.base import Estimate, Job
from slurm_colloc.estimators.features import seq_scale
from slurm_colloc.estimators.model import ModelSummary
from slurm_colloc.estimators.physics import MIB


class HorusEstimator:
    """The published formula, verbatim."""

    name = "horus"

    def estimate(self, summary: ModelSummary, job: Job) -> Estimate:
        """Apply the formula to the summary's leaf outputs and total parameters."""
        scale, seq, _ = seq_scale(summary, job.seq_len)
        acts = sum(layer.out_elems(seq) for layer in summary.leaves) * scale
        p = summary.total_params
        b = job.batch_size
        act_mib = 4 * acts * b / MIB
        w_mib = 4 * p / MIB
        bp_mib = 4 * b * p / MIB
        total = math.ceil(act_mib + w_mib + bp_mib)
        return Estimate(
            estimate_mib=total,
            estimator=self.name,
            breakdown={"activations": act_mib, "weights": w_mib, "batch_x_params": bp_mib},
            margin_mib=0,
            fingerprint=summary.fingerprint(),
            uncertainty={"notes": ["published baseline; no CUDA context, optimizer state "
                                   "or allocator overhead"]},
        )
