"""Token sampling and the logprob contract: the torch reference (`sample`) and a step's choice of
sampler (`sample_step`: the fused Triton kernels where they apply).

  * ``logprobs``: log_softmax(logits.float() / T) at the sampled token over the full vocab, no
    penalty or truncation (T = 1 when greedy): what RL trainers recompute.
  * ``processed_logprobs`` / ``kept_mass``: under the distribution sampled from (HF's penalty ->
    temperature -> top_k -> top_p -> min_p). Gumbel-max with counter-hash noise of (seed, counter,
    vocab index): a row's token depends only on its own inputs. No host syncs (graph-capturable).
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


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    # murmur3 finaliser on int64 tensors holding 32-bit values (the mask keeps shifts logical).
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
    # A second keyed round (k2): with k1 alone, rows could be shifted copies of each other.
    h = _fmix32((k1[:, None] + v[None, :]) & _M32)
    return _fmix32(h ^ k2[:, None])


def _to_uniform(bits: torch.Tensor) -> torch.Tensor:
    # Top 24 bits -> k * 2**-24, exact in fp32; k == 0 maps to 2**-25, so u is inside (0, 1).
    return ((bits >> 8).to(torch.float32) * 2.0**-24).clamp_min(2.0**-25)


def counter_uniform(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int, device=None) -> torch.Tensor:
    """u[r, v] = uniform(seed_r, counter_r, v) in (0, 1), float32 [R, V]."""
    device = seeds.device if device is None else torch.device(device)
    return _to_uniform(_hash32(seeds.to(device, torch.int64), counters.to(device, torch.int64), vocab_size))


def _apply_repetition_penalty(x: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    R, V = x.shape
    ids = st.penalty_token_ids
    # -1 padding (and out-of-range ids, as HF) go to a dummy column V that is dropped.
    ids = torch.where((ids < 0) | (ids >= V), V, ids)
    hit = torch.zeros(R, V + 1, dtype=torch.bool, device=x.device).scatter_(1, ids, True)[:, :V]
    p = st.repetition_penalty[:, None]
    # HF semantics; p == 1 is an exact no-op, so unpenalised rows match the fast path bit for bit.
    return torch.where(hit, torch.where(x > 0, x / p, x * p), x)


def _truncation_mask(scores: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Bool [R, V] of tokens kept by top_k -> top_p -> min_p (HF order and semantics)."""
    R, V = scores.shape
    # Stable sort: sorted position 0 is torch.argmax's choice, the always-kept greedy token.
    vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    k = torch.where(st.top_k > 0, st.top_k.clamp(max=V), V)     # top_k: ties at the boundary kept, as HF
    keep = vals >= vals.gather(1, (k - 1)[:, None])
    # top_p: keep while the mass before the token (shifted cumsum) is < top_p; top_p >= 1 is off.
    probs = torch.softmax(vals.masked_fill(~keep, float("-inf")), dim=-1)
    before = torch.cat([torch.zeros_like(probs[:, :1]), probs.cumsum(-1)[:, :-1]], dim=-1)
    keep = keep & ((before < st.top_p[:, None]) | (st.top_p[:, None] >= 1.0))
    keep[:, 0] = True
    probs = torch.softmax(vals.masked_fill(~keep, float("-inf")), dim=-1)    # min_p on the survivors
    keep = keep & (probs >= st.min_p[:, None] * probs[:, :1])
    keep[:, 0] = True
    return torch.zeros_like(keep).scatter_(1, idx, keep)


def sample(logits: torch.Tensor, st: SamplingTensors) -> SamplerOutput:
    x = logits.float()
    greedy = st.temperature <= 0
    # Greedy rows use T = 1 everywhere. Divide (not multiply by 1/T): bit-equal to log_softmax(x / T).
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
    # Greedy: truncation keeps sorted position 0, so this is the penalised logits' first argmax.
    if st.all_greedy:
        token_ids = scores.argmax(dim=-1)
    else:
        # Gumbel-max: argmax(s - log(-log u)) draws from softmax(s); greedy rows get no noise.
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
