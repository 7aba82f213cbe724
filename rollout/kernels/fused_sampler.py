"""Fused sampling + full-vocab logprob without an fp32 [R, V] copy of the logits: `fused_sample`
(no truncation) and the helpers kernels/fused_truncation.py shares. Contract: `rollout.sampler.sample`
for rows without a repetition penalty (u bit-identical to `counter_uniform`).

Kernel 1, grid (R, S), streams BLOCK_V chunks of a row's split (online max and sum of exp, per-lane
best perturbed score; chunks that cannot win skip their noise, exactly); with S > 1 kernel 2 merges
the splits. No host syncs; shapes depend only on (R, V, S) and static flags (graph-capturable).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import sm_count


_INTERPRET = bool(triton.knobs.runtime.interpret)
_ON_GPU = tl.constexpr(not _INTERPRET)
_NEG_BIG = tl.constexpr(-1.0e30)  # finite "-inf" for running maxima: never (-inf) - (-inf) = nan
_GUMBEL_MAX = tl.constexpr(17.0)   # > the largest Gumbel noise of a 24-bit u: -log(-log(1 - 2**-24)) = 16.64


@triton.jit
def _log_precise(x):
    # -log(u): libdevice logf, which torch.log calls, so bit-equal to the reference.
    if _ON_GPU:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def _log_fast(x):
    # Outer log of -log(-log u): lg2.approx's error (2**-22.6) is below the scores' fp32 rounding.
    if _ON_GPU:
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1) * 0.6931471805599453
    else:
        return tl.log(x)


@triton.jit
def _fmix32(h):  # murmur3 finaliser on uint32 (wrapping multiply, logical shifts)
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _row_keys(seed, counter):  # = rollout.sampler._hash32's per-row keys (k1, k2)
    a = _fmix32(seed.to(tl.uint32) * 0x27D4EB2F ^ (counter >> 32).to(tl.uint32))
    k1 = _fmix32(a + counter.to(tl.uint32) * 0x165667B1)
    return k1, _fmix32(k1 + 0x7F4A7C15)


@triton.jit
def _uniform(idx, k1, k2):  # = rollout.sampler._to_uniform(_hash32(...)): top 24 bits, > 0
    h = _fmix32(_fmix32(k1 + idx.to(tl.uint32) * 0x9E3779B9) ^ k2)
    return tl.maximum((h >> 8).to(tl.float32) * 5.9604644775390625e-08, 2.9802322387695312e-08)


@triton.jit
def _gumbel_pruned(score, block_max, idx, k1, k2, bound):
    """(score + Gumbel noise, best so far); a block that cannot reach `bound` scores -inf (exact)."""
    if block_max + _GUMBEL_MAX > bound:
        score = score - _log_fast(-_log_precise(_uniform(idx, k1, k2)))
        bound = tl.maximum(bound, tl.max(score, 0))
    else:
        score = tl.where(score == score, float("-inf"), score)
    return score, bound


@triton.jit
def _row_temperature(temp_ptr, row):
    """(T as given, T used, 1/T, log2(e)/T); T <= 0 is greedy (T = 1). x * (1/T) is <= 1 ulp from x / T."""
    t_raw = tl.load(temp_ptr + row)
    t = tl.where(t_raw > 0, t_raw, 1.0)
    inv_t = 1.0 / t
    return t_raw, t, inv_t, inv_t * 1.4426950408889634


@triton.jit
def _finish(row_ptr, t, m, total, tok, tok_out, lp_out, stats_out, R, STATS: tl.constexpr):
    # m / T == max(x / T) bit for bit; STATS: also store (max / T, log sum) for top logprobs.
    xt = tl.math.div_rn(tl.load(row_ptr + tok).to(tl.float32), t)
    mt = tl.math.div_rn(m, t)
    log_z = _log_precise(total)
    lp = (xt - mt) - log_z
    tl.store(tok_out, tok.to(tl.int64))
    tl.store(lp_out, lp)
    if STATS:
        tl.store(stats_out, mt)
        tl.store(stats_out + R, log_z)
    return lp


@triton.jit(do_not_specialize=["R"])   # row counts vary per eager step: one kernel for all
def _sample_kernel(logits_ptr, stride, temp_ptr, seed_ptr, ctr_ptr, tok_ptr, lp_ptr, stats_ptr,
                   pf_ptr, pi_ptr, R, V, SAMPLE: tl.constexpr, STATS: tl.constexpr,
                   SPLITS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    t_raw, t, inv_t, c = _row_temperature(temp_ptr, row)
    k1, k2 = _row_keys(tl.load(seed_ptr + row), tl.load(ctr_ptr + row))
    lanes = tl.arange(0, BLOCK_V)
    m = _NEG_BIG + 0.0  # running max of raw x (scalar); s: per-lane sum of exp((x - m) / T)
    bound = float("-inf")  # best perturbed score so far (scalar), for pruning
    s = tl.zeros([BLOCK_V], tl.float32)
    # Per-lane best with strict '>' then the min index among maxima: torch.argmax's first index.
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    bidx = tl.zeros([BLOCK_V], tl.int32)
    for start in range(0, CHUNK, BLOCK_V):  # static trip count (CHUNK depends on V, S only)
        idx = split * CHUNK + start + lanes
        x = tl.load(row_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        bm = tl.max(x, 0)
        m_new = tl.maximum(m, bm)
        s = s * tl.exp2((m - m_new) * c) + tl.exp2((x - m_new) * c)
        m = m_new
        score = x * inv_t
        if SAMPLE:  # noqa: SIM102 (constexpr test, then a runtime one)
            if t_raw > 0:
                score, bound = _gumbel_pruned(score, bm * inv_t, idx, k1, k2, bound)
        better = score > best
        best = tl.where(better, score, best)
        bidx = tl.where(better, idx, bidx)
    total = tl.sum(s, 0)
    top = tl.max(best, 0)
    tok = tl.min(tl.where(best == top, bidx, 0x7FFFFFFF), 0)
    if SPLITS == 1:
        _finish(row_ptr, t, m, total, tok, tok_ptr + row, lp_ptr + row, stats_ptr + row, R, STATS)
    else:  # partials [3, R, S] f32 (raw max, sum, best score) and [R, S] i32 (index)
        off = row * SPLITS + split
        tl.store(pf_ptr + off, m)
        tl.store(pf_ptr + R * SPLITS + off, total)
        tl.store(pf_ptr + 2 * R * SPLITS + off, top)
        tl.store(pi_ptr + off, tok)


@triton.jit
def _merged_z(pf_ptr, temp_ptr, row, R, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    """A row's split partials merged -> (offsets, mask, row max, sum of exp((x - max) / T), T)."""
    offs = tl.arange(0, BLOCK_S)
    ok = offs < SPLITS
    off = row * SPLITS + offs
    m = tl.load(pf_ptr + off, mask=ok, other=_NEG_BIG)
    s = tl.load(pf_ptr + R * SPLITS + off, mask=ok, other=0.0)
    mx = tl.max(m, 0)
    t_raw, t, inv_t, c = _row_temperature(temp_ptr, row)
    total = tl.sum(s * tl.exp2((m - mx) * (1.4426950408889634 / t)), 0)
    return off, ok, mx, total, t


@triton.jit(do_not_specialize=["R"])
def _merge_kernel(logits_ptr, stride, temp_ptr, tok_ptr, lp_ptr, stats_ptr, pf_ptr, pi_ptr, R,
                  STATS: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0)
    off, ok, mx, total, t = _merged_z(pf_ptr, temp_ptr, row, R, SPLITS, BLOCK_S)
    best = tl.load(pf_ptr + 2 * R * SPLITS + off, mask=ok, other=float("-inf"))
    bidx = tl.load(pi_ptr + off, mask=ok, other=0x7FFFFFFF)
    top = tl.max(best, 0)
    tok = tl.min(tl.where(best == top, bidx, 0x7FFFFFFF), 0)  # splits in index order: first wins
    _finish(logits_ptr + row.to(tl.int64) * stride, t, mx, total, tok, tok_ptr + row, lp_ptr + row,
            stats_ptr + row, R, STATS)


def pow2_floor(n: int) -> int:
    """The largest power of two <= max(n, 1)."""
    return 1 << (max(n, 1).bit_length() - 1)


def split_chunks(V: int, S: int, block: int) -> tuple[int, int]:
    """-> (chunks, chunk width): V in at most S chunks of whole `block`s, none empty."""
    chunk = triton.cdiv(triton.cdiv(V, max(1, S)), block) * block
    return triton.cdiv(V, chunk), chunk


def default_num_splits(R: int, V: int, device, block_v: int = 2048) -> int:
    """About 4 programs per SM, at least one BLOCK_V chunk each, a power of two (few compiles).
    Logprobs vary in the last ulp with S, tokens never; fix num_splits for batch invariance."""
    return max(1, min(pow2_floor(triton.cdiv(4 * sm_count(torch.device(device)), max(R, 1))), triton.cdiv(V, block_v)))


def fused_sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                 counters: torch.Tensor, *, greedy_only: bool = False, num_splits: int | None = None,
                 block_v: int = 2048, num_warps: int = 8, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                 stats: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V], temperature [R] f32 (<= 0: greedy), seeds / counters [R] int64 -> (token_ids
    int64, logprobs f32) [R], into `out` if given. stats: [2, R] f32 <- (max x / T, log sum exp)."""
    R, V = logits.shape
    assert logits.stride(1) == 1 and logits.dtype in (torch.bfloat16, torch.float16, torch.float32)
    dev = logits.device
    tok, lp = out if out is not None else (torch.empty(R, dtype=torch.int64, device=dev),
                                           torch.empty(R, dtype=torch.float32, device=dev))
    if R == 0:
        return tok, lp
    S = num_splits if num_splits is not None else default_num_splits(R, V, dev, block_v)
    S, chunk = split_chunks(V, S, block_v)
    pf = torch.empty((3, R, S) if S > 1 else (1,), dtype=torch.float32, device=dev)
    pi = torch.empty((R, S) if S > 1 else (1,), dtype=torch.int32, device=dev)
    temperature, seeds, counters = temperature.float(), seeds.long(), counters.long()  # no-ops
    st = stats if stats is not None else lp  # never written when STATS is off
    _sample_kernel[(R, S)](logits, logits.stride(0), temperature, seeds, counters, tok, lp, st, pf, pi,
                           R, V, SAMPLE=not greedy_only, STATS=stats is not None, SPLITS=S, CHUNK=chunk,
                           BLOCK_V=block_v, num_warps=num_warps)
    if S > 1:
        _merge_kernel[(R,)](logits, logits.stride(0), temperature, tok, lp, st, pf, pi, R,
                            STATS=stats is not None, SPLITS=S, BLOCK_S=triton.next_power_of_2(S), num_warps=1)
    return tok, lp


@triton.jit
def _uniform_kernel(seed_ptr, ctr_ptr, u_ptr, V, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    k1, k2 = _row_keys(tl.load(seed_ptr + row), tl.load(ctr_ptr + row))
    idx = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    tl.store(u_ptr + row.to(tl.int64) * V + idx, _uniform(idx, k1, k2), mask=idx < V)


def counter_uniform_triton(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The kernel's u[r, v] as float32 [R, V] (tests compare it with counter_uniform)."""
    u = torch.empty(seeds.shape[0], vocab_size, dtype=torch.float32, device=seeds.device)
    if seeds.shape[0]:
        _uniform_kernel[(seeds.shape[0], triton.cdiv(vocab_size, 1024))](seeds, counters, u, vocab_size, BLOCK_V=1024)
    return u

