"""Token sampling and the logprob contract: the torch reference (`sample`), and which sampler a
step runs (`sample_step`: the fused Triton kernels where they apply).

What RL trainers recompute, so it must be exact:
  * ``logprobs``: log_softmax(logits.float() / T) over the full vocab at the sampled
    token -- no penalty, no truncation (T = 1 for greedy rows).
  * ``processed_logprobs`` / ``kept_mass``: the same token under the distribution that
    was actually sampled from, i.e. HF's chain repetition penalty -> temperature ->
    top_k -> top_p -> min_p, renormalised over the kept tokens.

Sampling is Gumbel-max with noise from a counter-based hash of (seed, counter, vocab
index), so a row's token depends only on its own (seed, counter, logits, params): not
on batch composition, batch size, device or global RNG state.

CUDA-graph friendly: no host syncs, every shape depends only on R, V and the static
``num_top_logprobs``; the fast-path flags are static Python bools set by the caller.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # odd: v -> v * _GOLDEN is a bijection mod 2**32


@dataclass
class SamplingTensors:
    """One row per logits row to sample (R rows), all on the logits' device."""

    temperature: torch.Tensor  # [R] float32, 0 => greedy
    top_k: torch.Tensor  # [R] int64, 0 => off
    top_p: torch.Tensor  # [R] float32, 1.0 => off
    min_p: torch.Tensor  # [R] float32, 0.0 => off
    repetition_penalty: torch.Tensor  # [R] float32, 1.0 => off
    seeds: torch.Tensor  # [R] int64 in [0, 2**31)
    counters: torch.Tensor  # [R] int64: absolute position of the token being sampled
    penalty_token_ids: torch.Tensor | None  # [R, L] int64, -1 padded; None if no penalty
    num_top_logprobs: int = 0  # static: max top logprobs requested (0 = none)
    all_greedy: bool = False  # static fast-path flags, set by the caller
    any_truncation: bool = True  # any top_k / top_p / min_p active
    any_penalty: bool = False


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [R] int64
    logprobs: torch.Tensor  # [R] float32, full-vocab log_softmax(x / T)
    processed_logprobs: torch.Tensor  # [R] float32, under the truncated distribution
    kept_mass: torch.Tensor  # [R] float32, log of the kept probability mass
    top_ids: torch.Tensor | None  # [R, K] int64
    top_logprobs: torch.Tensor | None  # [R, K] float32


# ---------------------------------------------------------------- counter-based RNG
def _fmix32(h: torch.Tensor) -> torch.Tensor:
    # murmur3 finaliser on int64 tensors holding 32-bit values. Wrapping int64
    # multiplication keeps the low 32 bits right; the mask restores the invariant so
    # every right shift is a logical one.
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def _hash32(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, V] int64 of 32 random bits each, a pure function of (seed, counter, v)."""
    c_lo, c_hi = counters & _M32, (counters >> 32) & _M32
    a = _fmix32(((seeds & _M32) * 0x27D4EB2F) & _M32 ^ c_hi)  # per-seed key
    k1 = _fmix32((a + c_lo * 0x165667B1) & _M32)  # distinct per counter for one seed
    k2 = _fmix32((k1 + 0x7F4A7C15) & _M32)
    v = (torch.arange(vocab_size, device=seeds.device, dtype=torch.int64) * _GOLDEN) & _M32
    # Two keyed rounds: the first alone would make rows whose k1 differ by a multiple of
    # _GOLDEN produce shifted copies of each other; xor-ing an unrelated k2 breaks that.
    h = _fmix32((k1[:, None] + v[None, :]) & _M32)
    return _fmix32(h ^ k2[:, None])


def _to_uniform(bits: torch.Tensor) -> torch.Tensor:
    # Top 24 bits -> k * 2**-24, exact in fp32 (no rounding up to 1.0); k == 0 maps to
    # 2**-25 instead of 0, so u is strictly inside (0, 1) and -log(-log u) is finite.
    return ((bits >> 8).to(torch.float32) * 2.0**-24).clamp_min(2.0**-25)


def counter_uniform(
    seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int, device=None
) -> torch.Tensor:
    """u[r, v] = uniform(seed_r, counter_r, v) in (0, 1), float32 [R, V]."""
    device = seeds.device if device is None else torch.device(device)
    bits = _hash32(seeds.to(device, torch.int64), counters.to(device, torch.int64), vocab_size)
    return _to_uniform(bits)


# ---------------------------------------------------------------------- processing
def _apply_repetition_penalty(x: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    R, V = x.shape
    ids = st.penalty_token_ids
    # -1 padding (and out-of-range ids, as HF) go to a dummy column V that is dropped.
    ids = torch.where((ids < 0) | (ids >= V), V, ids)
    hit = torch.zeros(R, V + 1, dtype=torch.bool, device=x.device).scatter_(1, ids, True)[:, :V]
    p = st.repetition_penalty[:, None]
    # HF semantics; p == 1 is an exact no-op (x/1 == x*1 == x), so unpenalised rows
    # sharing a batch with penalised ones are bit-identical to the fast path.
    return torch.where(hit, torch.where(x > 0, x / p, x * p), x)


def _truncation_mask(scores: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Bool [R, V] of tokens kept by top_k -> top_p -> min_p (HF order and semantics)."""
    R, V = scores.shape
    # Stable sort: ties keep index order, so sorted position 0 is torch.argmax's choice
    # and the always-kept top-1 is the greedy token.
    vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    # top_k: keep values >= k-th largest (ties at the boundary kept, as HF).
    k = torch.where(st.top_k > 0, st.top_k.clamp(max=V), V)
    keep = vals >= vals.gather(1, (k - 1)[:, None])
    # top_p on softmax of the top-k-masked scores: keep while the mass strictly before
    # the token is < top_p. Exclusive prefix sum by shifting (not cumsum - p, which
    # cancels badly); top_p >= 1 is "off" so fp rounding can never drop a tail token.
    probs = torch.softmax(vals.masked_fill(~keep, float("-inf")), dim=-1)
    before = torch.cat([torch.zeros_like(probs[:, :1]), probs.cumsum(-1)[:, :-1]], dim=-1)
    keep = keep & ((before < st.top_p[:, None]) | (st.top_p[:, None] >= 1.0))
    keep[:, 0] = True
    # min_p on the renormalised survivors; the max prob sits at sorted position 0.
    probs = torch.softmax(vals.masked_fill(~keep, float("-inf")), dim=-1)
    keep = keep & (probs >= st.min_p[:, None] * probs[:, :1])
    keep[:, 0] = True
    return torch.zeros_like(keep).scatter_(1, idx, keep)


def sample(logits: torch.Tensor, st: SamplingTensors) -> SamplerOutput:
    x = logits.float()
    greedy = st.temperature <= 0
    # Greedy rows use T = 1 everywhere: logprobs, and processed_logprobs / kept_mass from
    # the same penalty -> truncation chain, so they are what a T=1 sampler would report.
    # Divide (not multiply by 1/T) so it matches a reference log_softmax(x / T) bit-for-bit.
    temp = torch.where(greedy, 1.0, st.temperature)[:, None]
    xt = x / temp
    lp_full = torch.log_softmax(xt, dim=-1)

    if st.any_penalty and st.penalty_token_ids is not None:
        scaled = _apply_repetition_penalty(x, st) / temp
        lp_proc = torch.log_softmax(scaled, dim=-1)
    else:
        scaled, lp_proc = xt, lp_full

    if st.any_truncation:
        keep = _truncation_mask(scaled, st)
        scores = scaled.masked_fill(~keep, float("-inf"))
        lse = torch.logsumexp(lp_proc.masked_fill(~keep, float("-inf")), dim=-1)
        # Exactly 0 when nothing was cut, so the no-truncation fast path is identical.
        kept_mass = torch.where(keep.all(dim=-1), 0.0, lse)
    else:
        scores = scaled
        kept_mass = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)

    # Greedy: argmax of the truncated scores == argmax of the penalized logits, first
    # index on ties, since truncation always keeps sorted position 0 (stable sort).
    if st.all_greedy:
        token_ids = scores.argmax(dim=-1)
    else:
        # Gumbel-max: argmax(s + G), G = -log(-log u) ~ Gumbel(0, 1), draws from
        # softmax(s). Greedy rows get zero noise (same as the all_greedy path).
        u = counter_uniform(st.seeds, st.counters, x.shape[1], x.device)
        gumbel = torch.where(greedy[:, None], 0.0, -torch.log(-torch.log(u)))
        token_ids = (scores + gumbel).argmax(dim=-1)

    tok = token_ids[:, None]
    logprobs = lp_full.gather(1, tok).squeeze(1)
    processed = lp_proc.gather(1, tok).squeeze(1) - kept_mass

    top_ids = top_lps = None
    if st.num_top_logprobs > 0:
        top_lps, top_ids = torch.topk(lp_full, st.num_top_logprobs, dim=-1)
    return SamplerOutput(token_ids, logprobs, processed, kept_mass, top_ids, top_lps)


# The fused sampler's vocab splits (one-pass and truncation kernels) in batch-invariant mode: by
# default they follow the row count, which moves logprobs by an ulp (tokens never move).
INVARIANT_SAMPLER_SPLITS = 8


def sample_step(logits: torch.Tensor, st: SamplingTensors, fused: bool, batch_invariant: bool) -> SamplerOutput:
    """A step's sampler: with `fused` (the Triton backend) and no repetition penalty (the torch
    path's only), the fused Triton kernels (`sample`'s contract, truncation and top logprobs
    included, without an fp32 copy of the logits or a sort), their vocab splits fixed in
    batch-invariant mode; else `sample`."""
    if not fused or st.any_penalty:
        return sample(logits, st)
    from .kernels.fused_truncation import default_row_splits, fused_sample_full
    if batch_invariant:
        return fused_sample_full(logits, st, num_splits=INVARIANT_SAMPLER_SPLITS, row_splits=INVARIANT_SAMPLER_SPLITS)
    return fused_sample_full(logits, st, row_splits=default_row_splits(*logits.shape, logits.device))
