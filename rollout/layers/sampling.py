"""Which sampler runs: the fused Triton sampler (kernels/fused_sampler.py, fused_truncation.py) where
it applies, the torch reference (rollout.sampler.sample) for repetition penalties and on CPU."""
from __future__ import annotations

import torch

from ..sampler import SamplerOutput, SamplingTensors, sample

INVARIANT_SAMPLER_SPLITS = 8    # the fused sampler's vocab splits in batch-invariant mode (else per row count)


def sample_step(logits: torch.Tensor, st: SamplingTensors, fused: bool, batch_invariant: bool) -> SamplerOutput:
    """The fused Triton sampler with `fused` and no repetition penalty, else `sample`."""
    if not fused or st.any_penalty:
        return sample(logits, st)
    from ..kernels.fused_truncation import default_row_splits, fused_sample_full
    if batch_invariant:
        return fused_sample_full(logits, st, num_splits=INVARIANT_SAMPLER_SPLITS, row_splits=INVARIANT_SAMPLER_SPLITS)
    return fused_sample_full(logits, st, row_splits=default_row_splits(*logits.shape, logits.device))
