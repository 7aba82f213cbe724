"""Fused sampling + full-vocab logprob without an fp32 [R, V] copy of the logits.

`fused_sample_full` (kernels/fused_truncation.py, which also holds the top-k / top-p / min-p
kernels) has the contract of `rollout.sampler.sample` for rows without a repetition penalty
(those keep the torch path):
  * logprob = log_softmax(x / T)[token] in fp32 (T = 1 for greedy rows, temperature <= 0);
  * greedy rows: argmax x over the kept tokens, first index on ties (= argmax x: the top-1 is
    always kept);
  * sampled rows: argmax over the kept tokens of x_v / T - log(-log u_v), u from the same 32-bit
    counter hash and the same (0, 1) mapping as `rollout.sampler.counter_uniform` (bit-identical u);
  * kept = top_k -> top_p -> min_p with the reference's tie rules; processed_logprob = logprob -
    kept_mass, kept_mass = log(kept mass / all), exactly 0 when nothing is cut.

No truncation in the batch (static flag): `fused_sample`, one pass. Kernel 1, grid (R, S): a
program streams BLOCK_V-wide chunks of its split of a row. Per chunk: one CTA max of the raw x
(running max m), per-lane sums of exp((x - m) / T) rescaled when m grows, and a per-lane best
(perturbed score, index). With S == 1 it finishes the row, else it writes per-split partials that
kernel 2 (grid R) merges. The winner's x is re-read once at the end instead of being carried
through the loop. Sampled rows skip the noise of chunks that cannot win (max x / T + max Gumbel <
best so far): exact, and most chunks for peaked LLM logits.
Cost (sm_90 SASS, BLOCK_V 2048, 8 warps, 72 regs): ~24 instructions per element, ~72 with the
noise (hash ~20, libdevice logf ~20): sampled rows are ALU-bound, greedy rows ~memory-bound.

No host syncs; shapes depend only on (R, V, S) and static flags: CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import sm_count


# Read once, as triton.jit does at decoration time.
_INTERPRET = bool(triton.knobs.runtime.interpret)
_ON_GPU = tl.constexpr(not _INTERPRET)
_NEG_BIG = tl.constexpr(-1.0e30)  # finite "-inf" for running maxima: never (-inf) - (-inf) = nan
# Largest Gumbel noise a 24-bit u can give: -log(-log(1 - 2**-24)) = 16.64. A block whose max
# x / T is this far below the best score so far cannot win, so its noise is skipped (exact).
_GUMBEL_MAX = tl.constexpr(17.0)


@triton.jit
def _log_precise(x):
    # -log(u): libdevice logf is CUDA's logf, which torch.log calls, so -log u is bit-equal to the
    # reference. (tl.log is the same code in triton 3.6; approximate lg2 would be useless here:
    # its ~2**-22 absolute error near u = 1, where -log u ~ 6e-8, is where Gumbel winners live.)
    if _ON_GPU:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def _log_fast(x):
    # Outer log of -log(-log u): lg2.approx's absolute error (2**-22.6) is below the fp32 rounding
    # of the scores it feeds; 1 MUFU op instead of ~20 instructions.
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
    """score + Gumbel noise, and the best perturbed score so far. A block whose best unperturbed
    score is more than the largest possible noise below `bound` cannot win: its noise is skipped
    and it scores -inf (exact, and most blocks for peaked LLM logits)."""
    if block_max + _GUMBEL_MAX > bound:
        score = score - _log_fast(-_log_precise(_uniform(idx, k1, k2)))
        bound = tl.maximum(bound, tl.max(score, 0))
    else:
        score = tl.where(score == score, float("-inf"), score)
    return score, bound


@triton.jit
def _row_temperature(temp_ptr, row):
    """(T as given, T used, 1/T, log2(e)/T) for a row: T <= 0 is greedy and uses T = 1.
    Scores use x * (1/T) (1 op vs ~8 for IEEE x / T): <= 1 ulp from the reference's x / T, so
    only near-ties can flip; greedy rows (T = 1) are exact. Sums of exp work on raw x:
    exp2((x - m) * log2(e)/T) never rounds a large x / T before the subtraction."""
    t_raw = tl.load(temp_ptr + row)
    t = tl.where(t_raw > 0, t_raw, 1.0)
    inv_t = 1.0 / t
    return t_raw, t, inv_t, inv_t * 1.4426950408889634


@triton.jit
def _finish(row_ptr, t, m, total, tok, tok_out, lp_out, stats_out, R, STATS: tl.constexpr):
    # m = max raw x. Division is monotone, so m / T == max(x / T) bit for bit, and
    # (x_tok / T - max) is exactly the reference's; only log(sum) differs (summation order).
    # x_tok is re-read once instead of being carried through the loop. STATS: also store
    # (max / T, log sum) so any x's logprob is (x / T - max / T) - log sum (top logprobs).
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
    # Per-lane best: lane j sees j, j+BLOCK_V, ... in order, so strict '>' keeps its first best
    # index; the final min-index-among-maxima restores torch.argmax's first index globally.
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
    """A row's split partials (raw max, sum of exp) merged at its temperature -> (the partials'
    offsets and mask, the row max, the sum Z of exp((x - max) / T), T)."""
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
    """About 4 programs per SM (the sampled-row loop is ALU-bound: hash + 2 logs per element),
    at least one BLOCK_V chunk per split, rounded down to a power of two: SPLITS and CHUNK are
    constexprs, so each value is its own compiled kernel (~0.4 s on the H200 when first met; an
    eager step with a row count of a new class stalled the GPU for that long), and powers of two
    leave 8 classes on 132 SMs, which the decode graphs' buckets compile at capture. Depends only on
    (R, V, device): static under CUDA graphs. Logprobs vary in the last ulp with S (summation
    order); tokens never do. Pass a fixed num_splits for bit-level batch-size invariance."""
    return max(1, min(pow2_floor(triton.cdiv(4 * sm_count(torch.device(device)), max(R, 1))), triton.cdiv(V, block_v)))


def fused_sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                 counters: torch.Tensor, *, greedy_only: bool = False, num_splits: int | None = None,
                 block_v: int = 2048, num_warps: int = 8, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                 stats: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (token_ids [R] int64, logprobs [R] float32). logits [R, V] bf16/fp16/fp32 (unit
    stride along V), temperature [R] f32 (<= 0: greedy), seeds / counters [R] int64.
    greedy_only: every row is greedy (no noise code compiled). out: optional preallocated
    (token_ids, logprobs) written in place (e.g. static CUDA-graph outputs). block_v / num_warps:
    2048 / 8 keeps ~71 registers (3 CTAs per SM on sm_90); to be tuned on the GPU.
    stats: optional [2, R] float32 written with (max x / T, log sum exp(x / T - max x / T)) per row."""
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
    """The kernel's u[r, v] as a float32 [R, V] tensor: tests check it equals
    `rollout.sampler.counter_uniform` bit for bit."""
    u = torch.empty(seeds.shape[0], vocab_size, dtype=torch.float32, device=seeds.device)
    if seeds.shape[0]:
        _uniform_kernel[(seeds.shape[0], triton.cdiv(vocab_size, 1024))](seeds, counters, u, vocab_size,
                                                                         BLOCK_V=1024)
    return u


# 4-bit radix digits covering the fp32 bits an input dtype can set -> (digits, low bits dropped).
