"""Top-k / top-p / min-p in Triton for the fused sampler (see kernels/fused_sampler.py for the
contract and the one-pass kernel), and `fused_sample_full`, which dispatches a batch to them.

Truncation (`_trunc_kernel`, grid (R,), one program per row, re-reading the row from L2): pass 1
max / sum exp; top-k: a radix select of the k-th largest value over monotone integer keys of x
(4-bit digits, one histogram pass each: 4 for bf16, 5 fp16, 8 fp32); top-p: a radix select of the
boundary value by cumulative mass over the top-k survivors, then the first c of its ties by
index; min-p: e(x) >= min_p; final pass: kept set, its mass, Gumbel-max over it. Passes for bf16:
2 without truncation or with min-p alone, 6 with top-k or top-p, 10 with both (past the top
digits most blocks hold no candidate and skip the histogram). Exact up to fp32 rounding of masses
at the top-p / min-p boundaries (the reference rounds too, differently).
Cost (sm_90 SASS loop sizes, not yet timed; 8 warps, 80 regs): per element ~21 instructions in
pass 1, ~85 per count pass, ~150 per mass pass (16 compare-and-adds each), up to ~150 in the final
pass (less where a block's noise is pruned): ALU-bound, unlike the one-pass kernel.
Measured (H200, V = 151,936, bf16, graphs, R = 64 / 256): top-p 0.9 1,440 / 2,196 us, top-k 50
1,088 / 1,719, all three 1,978 / 3,158: one SM per row, its passes serial.
Split rows (`row_splits` S > 1; the engine's default, `default_row_splits`): the same passes over S contiguous chunks per
row, grid (R, S), one launch per pass (2 * digits + 3: 11 for bf16), the cross-chunk sums reduced
in a fixed order by the next launch (deterministic, no atomics); the top-p tie rank of a chunk
starts at the boundary ties of the chunks before it (the last digit's per-chunk counts). sm_90
registers (ptxas, not timed): radix steps 38-64, final pass 92 (sampled bf16), merge 31.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from ..sampler import SamplerOutput, SamplingTensors
from . import sm_count
from .fused_sampler import (_NEG_BIG, _finish, _gumbel_pruned, _log_precise, _merged_z,
                            _row_keys, _row_temperature, _sample_kernel, fused_sample, pow2_floor,
                            split_chunks)


@triton.jit
def _key(x, SHIFT: tl.constexpr):
    # Integer key whose unsigned order is x's float order: negatives get every bit flipped,
    # non-negatives the sign bit set; -0.0 takes +0.0's key (the reference compares them equal).
    # >> SHIFT drops low bits the input dtype never sets (bf16: 16, fp16: 12): after the flip they
    # are constant within each sign, so the order is kept and the key is exact.
    b = x.to(tl.uint32, bitcast=True)
    k = tl.where((b >> 31) != 0, b ^ 0xFFFFFFFF, b | 0x80000000)
    return tl.where(x == 0, 0x80000000, k) >> SHIFT


@triton.jit
def _key_value(k, SHIFT: tl.constexpr):  # the x whose _key is k
    k = k << SHIFT
    b = tl.where((k >> 31) != 0, k ^ 0x80000000, (k | ((1 << SHIFT) - 1)) ^ 0xFFFFFFFF)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _radix_hist(row_ptr, V: tl.constexpr, lo, pre, m, c, D: tl.constexpr, NDIG: tl.constexpr,
                SHIFT: tl.constexpr, MASS: tl.constexpr, SKIP: tl.constexpr, HBLOCK: tl.constexpr):
    return _hist_range(row_ptr, V, lo, pre, m, c, D, NDIG, SHIFT, MASS, SKIP, V, HBLOCK)


@triton.jit
def _hist_range(ptr, n, lo, pre, m, c, D: tl.constexpr, NDIG: tl.constexpr, SHIFT: tl.constexpr,
                MASS: tl.constexpr, SKIP: tl.constexpr, LOOP: tl.constexpr, HBLOCK: tl.constexpr):
    # One pass over ptr[:n] (LOOP >= n, static): 16-bin histogram of digit D (top first) of the
    # keys >= lo whose higher digits equal pre: counts and, with MASS, sums of
    # e(x) = exp2((x - m) * c). A compare-and-add into [16, HBLOCK] per-lane accumulators reduced
    # once at the end: deterministic, weightable, and no per-block cross-thread reductions (they
    # cost more than the compares). SKIP: blocks without a candidate skip the compares (past the
    # top digits most blocks have none). n: the row (V) or one chunk of it (split path).
    TOP: tl.constexpr = 4 * NDIG - 4
    lanes = tl.arange(0, HBLOCK)
    bins = tl.arange(0, 16)[:, None]
    cnt = tl.zeros([16, HBLOCK], tl.int32)
    mass = tl.zeros([16, HBLOCK], tl.float32)
    for start in range(0, LOOP, HBLOCK):
        idx = start + lanes
        ok = idx < n
        x = tl.load(ptr + idx, mask=ok, other=float("-inf")).to(tl.float32)
        key = _key(x, SHIFT)
        ok = ok & (key >= lo)
        if D > 0:
            ok = ok & ((key >> (TOP + 4 - 4 * D)) == pre)
        go = True
        if SKIP:
            go = tl.max(ok.to(tl.int32), 0) > 0
        if go:
            hit = ((key >> (TOP - 4 * D)) & 15).to(tl.int32)[None, :] == bins
            hit = hit & ok[None, :]
            cnt += hit.to(tl.int32)
            if MASS:
                mass += tl.where(hit, tl.exp2((x - m) * c)[None, :], 0.0)
    return tl.sum(cnt, 1), tl.sum(mass, 1)


@triton.jit
def _select_count(cnt, k):
    # Highest bin b with sum(cnt[b:]) >= k (it holds the k-th largest), and sum(cnt[b + 1:]).
    # The suffix sums are exact integers and fall with b, so b = #{b: suffix >= k} - 1.
    b = tl.sum((tl.cumsum(cnt, 0, reverse=True) >= k).to(tl.int32), 0) - 1
    return b, tl.sum(tl.where(tl.arange(0, 16) > b, cnt, 0), 0)


@triton.jit
def _select_mass(cnt, mass, target, above, top_p, FIRST: tl.constexpr):
    # Bins scanned high -> low from `above` (the mass above this key prefix): the first non-empty
    # bin whose inclusive cumulative mass reaches target; if rounding keeps every bin below it,
    # the lowest non-empty one (nothing under it is cut). FIRST (top digit): target = top_p * the
    # cumulative mass at the lowest non-empty bin (= Zk), so that bin always qualifies.
    # -> (bin, mass strictly above it, its count, target).
    bins = tl.arange(0, 16)
    incl = above + tl.cumsum(mass, 0, reverse=True)
    low = tl.min(tl.where(cnt > 0, bins, 16), 0)
    if FIRST:
        target = top_p * tl.sum(tl.where(bins == low, incl, 0.0), 0)
    sel = tl.max(tl.where((cnt > 0) & (incl >= target), bins, -1), 0)
    sel = tl.where(sel >= 0, sel, low)
    return (sel, above + tl.sum(tl.where(bins > sel, mass, 0.0), 0), tl.sum(tl.where(bins == sel, cnt, 0), 0),
            target)


@triton.jit
def _final_block(row_ptr, idx, V, m, c, inv_t, kth, min_p, vstar, n_keep, do_p, ties, t_raw, k1, k2, bound,
                 kept_e, kept_n, best, bidx, mask_ptr, row, SHIFT: tl.constexpr, MASK: tl.constexpr,
                 SAMPLE: tl.constexpr):
    """One block of the final pass (single-program and split-row kernels alike): the kept set
    (top-k key, min-p mass, top-p boundary with its ties kept in index order: `ties` counts the
    boundary ties before this block), kept mass and count, and Gumbel-max over the kept tokens."""
    ok = idx < V
    x = tl.load(row_ptr + idx, mask=ok, other=float("-inf")).to(tl.float32)
    key = _key(x, SHIFT)
    e = tl.exp2((x - m) * c)
    keep = ok & (key >= kth) & (e >= min_p)
    if do_p:  # the scan only where top-p cuts
        tie = (ok & (key == vstar)).to(tl.int32)
        rank = ties + tl.cumsum(tie, 0) - 1  # index order among the ties
        ties += tl.sum(tie, 0)
        keep = keep & ((key > vstar) | ((tie != 0) & (rank < n_keep)))
    if MASK:
        tl.store(mask_ptr + row.to(tl.int64) * V + idx, keep.to(tl.int8), mask=ok)
    kept_e += tl.where(keep, e, 0.0)
    kept_n += keep.to(tl.int32)
    score = tl.where(keep, x * inv_t, float("-inf"))
    if SAMPLE:  # noqa: SIM102 (constexpr test, then a runtime one)
        if t_raw > 0:
            score, bound = _gumbel_pruned(score, tl.max(score, 0), idx, k1, k2, bound)
    better = score > best
    best = tl.where(better, score, best)
    bidx = tl.where(better, idx, bidx)
    return ties, bound, kept_e, kept_n, best, bidx


@triton.jit(do_not_specialize=["R"])
def _trunc_kernel(logits_ptr, stride, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, ctr_ptr,
                  tok_ptr, lp_ptr, plp_ptr, km_ptr, stats_ptr, mask_ptr, R,
                  V: tl.constexpr, SAMPLE: tl.constexpr, STATS: tl.constexpr, MASK: tl.constexpr,
                  NDIG: tl.constexpr, SHIFT: tl.constexpr, BLOCK_V: tl.constexpr, HBLOCK: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    t_raw, t, inv_t, c = _row_temperature(temp_ptr, row)  # e(x) = exp((x - m) / T) = exp2((x - m) * c)
    top_k = tl.load(topk_ptr + row)
    top_p = tl.load(topp_ptr + row)
    min_p = tl.load(minp_ptr + row)
    do_k = (top_k > 0) & (top_k < V)
    do_p = top_p < 1.0
    lanes = tl.arange(0, BLOCK_V)

    # Pass 1: max and sum exp as _sample_kernel (online per lane).
    m = _NEG_BIG + 0.0
    s = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, V, BLOCK_V):
        idx = start + lanes
        x = tl.load(row_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp2((m - m_new) * c) + tl.exp2((x - m_new) * c)
        m = m_new
    total = tl.sum(s, 0)

    # top-k: radix select of the k-th largest key, one 4-bit digit per pass, top digit first;
    # kept <=> key >= kth, so ties at the boundary are all kept (the reference's vals >= kth).
    kth = tl.full([], 0, tl.uint32)
    if do_k:
        krem = top_k.to(tl.int32)  # rank of the k-th largest among keys with the prefix so far
        pre = tl.full([], 0, tl.uint32)
        for d in tl.static_range(NDIG):
            cnt, _ = _radix_hist(row_ptr, V, kth, pre, m, c, d, NDIG, SHIFT, MASS=False, SKIP=d > 0,
                                 HBLOCK=HBLOCK)  # kth is still 0 here: no lower bound
            b, above = _select_count(cnt, krem)
            pre = (pre << 4) | b.to(tl.uint32)
            krem -= above
        kth = pre

    # top-p over the top-k survivors (mass Zk). In the reference's stable descending order a token
    # is kept iff the mass before it is < top_p * Zk. With G(v) = survivor mass above value v, the
    # boundary v* is the lowest value with G(v*) < top_p * Zk: keep every key above it, and of its
    # n ties (equal mass e*) the first c by index, c = #{r < n: G(v*) + r e* < top_p * Zk} >= 1.
    # v* = the first key, scanning down, whose inclusive cumulative mass reaches top_p * Zk: a
    # radix select with per-bin masses.
    vstar = tl.full([], 0, tl.uint32)
    n_keep = V
    if do_p:
        above = 0.0
        target = 0.0
        n = 0
        pre = tl.full([], 0, tl.uint32)
        for d in tl.static_range(NDIG):
            cnt, mass = _radix_hist(row_ptr, V, kth, pre, m, c, d, NDIG, SHIFT, MASS=True, SKIP=True,
                                    HBLOCK=HBLOCK)
            b, above, n, target = _select_mass(cnt, mass, target, above, top_p, FIRST=d == 0)
            pre = (pre << 4) | b.to(tl.uint32)
        vstar = pre
        e_star = tl.exp2((_key_value(pre, SHIFT) - m) * c)
        # c = ceil((target - G) / e*) clamped to [1, n] (e* == 0: its ties add no mass, keep all n).
        q = tl.where(e_star > 0, (target - above) / e_star, n.to(tl.float32))
        n_keep = tl.minimum(tl.maximum(tl.ceil(q), 1.0), n.to(tl.float32)).to(tl.int32)

    # Final pass, blocks in index order: the kept set, its mass, and the Gumbel-max / greedy argmax
    # over it (same noise and pruning as _sample_kernel). min-p: the max survivor is the global max
    # (e = 1), so probs >= min_p * max prob <=> e >= min_p.
    k1, k2 = _row_keys(tl.load(seed_ptr + row), tl.load(ctr_ptr + row))
    bound = float("-inf")
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    bidx = tl.zeros([BLOCK_V], tl.int32)
    kept_e = tl.zeros([BLOCK_V], tl.float32)
    kept_n = tl.zeros([BLOCK_V], tl.int32)
    ties = 0  # v* ties seen in earlier blocks
    for start in range(0, V, BLOCK_V):
        idx = start + lanes
        ties, bound, kept_e, kept_n, best, bidx = _final_block(
            row_ptr, idx, V, m, c, inv_t, kth, min_p, vstar, n_keep, do_p, ties, t_raw, k1, k2, bound,
            kept_e, kept_n, best, bidx, mask_ptr, row, SHIFT, MASK, SAMPLE)
    top = tl.max(best, 0)
    tok = tl.min(tl.where(best == top, bidx, 0x7FFFFFFF), 0)
    lp = _finish(row_ptr, t, m, total, tok, tok_ptr + row, lp_ptr + row, stats_ptr + row, R, STATS)
    # kept_mass = log(kept / all), exactly 0 when nothing was cut (as the reference).
    km = tl.where(tl.sum(kept_n, 0) == V, 0.0, _log_precise(tl.sum(kept_e, 0) / total))
    tl.store(km_ptr + row, km)
    tl.store(plp_ptr + row, lp - km)


# ------------------------------------------------ split rows: S programs per row (grid (R, S))
# The same passes as _trunc_kernel, each a launch over (row, chunk): chunk s owns
# [s * CHUNK, (s + 1) * CHUNK) of its row. Cross-chunk results are per-chunk partials reduced by
# later launches in a fixed order (no atomics): bitwise deterministic, eager == graph replay.
# Ordering between passes is stream order (each launch sees every write of the launches before
# it); within a launch no program reads what another one writes. Launches: pass A (max / sum-exp
# partials, _sample_kernel), one per radix digit (NDIG top-k, then NDIG top-p), the final pass and
# a per-row merge: 2 * NDIG + 3 for every batch (11 for bf16). Step J's select of digit J - 1 is
# done at the start of launch J by each of the row's S programs (same inputs, same code, same
# bits; S * 16 loads each), instead of a separate select launch; chunk 0 stores the resulting
# state (slot J) for launch J + 1.
# Buffers: cnt [2 NDIG, R, S, 16] int32 (per-chunk counts of each step), mass [NDIG, R, S, 16]
# f32 (top-p steps), state [2 NDIG, R, 4] int32: top-k slots (prefix, remaining rank); top-p
# slots (prefix, kth, mass above, target) with the floats as bits.
@triton.jit
def _psum(ptr, upto, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    # Sum of the [16] histograms of chunks [0, upto) of one row and step ([SPLITS, 16] at ptr).
    # One deterministic tree per kernel: identical bits in every program that computes it.
    s = tl.arange(0, BLOCK_S)[:, None]
    return tl.sum(tl.load(ptr + s * 16 + tl.arange(0, 16)[None, :], mask=s < upto, other=0), 0)


@triton.jit
def _k_advance(state_ptr, cnt_ptr, row, R, top_k, D: tl.constexpr, SPLITS: tl.constexpr,
               BLOCK_S: tl.constexpr):
    # Top-k (prefix, remaining rank) after the selects of digits 0..D-1 (D >= 1): digit D-1's
    # starting state (slot D-1; the initial one for D = 1) and its histogram summed over chunks.
    if D == 1:
        pre = tl.full([], 0, tl.uint32)
        krem = top_k.to(tl.int32)
    else:
        st = state_ptr + ((D - 1) * R + row) * 4
        pre = tl.load(st).to(tl.uint32, bitcast=True)
        krem = tl.load(st + 1)
    cnt = _psum(cnt_ptr + ((D - 1) * R + row) * (SPLITS * 16), SPLITS, SPLITS, BLOCK_S)
    b, above = _select_count(cnt, krem)
    return (pre << 4) | b.to(tl.uint32), krem - above


@triton.jit
def _p_advance(state_ptr, cnt_ptr, mass_ptr, row, R, top_p, D: tl.constexpr, NDIG: tl.constexpr,
               SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    # Top-p state after the selects of digits 0..D-1 (D >= 1) -> (prefix, kth, mass above,
    # target, selected bin, its count).
    J: tl.constexpr = NDIG + D - 1
    st = state_ptr + (J * R + row) * 4
    pre = tl.load(st).to(tl.uint32, bitcast=True)
    kth = tl.load(st + 1).to(tl.uint32, bitcast=True)
    above = tl.load(st + 2).to(tl.float32, bitcast=True)
    target = tl.load(st + 3).to(tl.float32, bitcast=True)
    cnt = _psum(cnt_ptr + (J * R + row) * (SPLITS * 16), SPLITS, SPLITS, BLOCK_S)
    mass = _psum(mass_ptr + ((D - 1) * R + row) * (SPLITS * 16), SPLITS, SPLITS, BLOCK_S)
    b, above, n, target = _select_mass(cnt, mass, target, above, top_p, FIRST=D == 1)
    return (pre << 4) | b.to(tl.uint32), kth, above, target, b, n


@triton.jit
def _row_max(pf_ptr, row, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    offs = tl.arange(0, BLOCK_S)  # pass A's chunk maxima: their max is exact (= _trunc_kernel's m)
    return tl.max(tl.load(pf_ptr + row * SPLITS + offs, mask=offs < SPLITS, other=_NEG_BIG), 0)


@triton.jit(do_not_specialize=["R"])
def _split_step_kernel(logits_ptr, stride, temp_ptr, topk_ptr, topp_ptr, pf_ptr, cnt_ptr, mass_ptr,
                       state_ptr, R, V: tl.constexpr, J: tl.constexpr, NDIG: tl.constexpr,
                       SHIFT: tl.constexpr, SPLITS: tl.constexpr, CHUNK: tl.constexpr,
                       HBLOCK: tl.constexpr, BLOCK_S: tl.constexpr):
    # Radix step J: top-k digit J (J < NDIG), else top-p digit J - NDIG. Rows that do not use the
    # phase exit at once (their slots stay unwritten and are never read).
    row = tl.program_id(0)
    split = tl.program_id(1)
    PHASE_P: tl.constexpr = J >= NDIG
    D: tl.constexpr = J % NDIG
    top_k = tl.load(topk_ptr + row)
    top_p = tl.load(topp_ptr + row)
    do_k = (top_k > 0) & (top_k < V)
    if PHASE_P:
        active = top_p < 1.0
    else:
        active = do_k
    if active:
        st = state_ptr + (J * R + row) * 4
        first = split == 0  # one writer per row and slot
        lo = tl.full([], 0, tl.uint32)
        pre = lo
        m = 0.0
        c = 0.0
        if PHASE_P:
            t_raw, t, inv_t, c = _row_temperature(temp_ptr, row)  # as _trunc_kernel
            m = _row_max(pf_ptr, row, SPLITS, BLOCK_S)
            above = 0.0
            target = 0.0
            if D == 0:
                if do_k:
                    lo, _ = _k_advance(state_ptr, cnt_ptr, row, R, top_k, NDIG, SPLITS, BLOCK_S)
            else:
                pre, lo, above, target, _, _ = _p_advance(state_ptr, cnt_ptr, mass_ptr, row, R, top_p, D,
                                                          NDIG, SPLITS, BLOCK_S)
            tl.store(st + 1, lo.to(tl.int32, bitcast=True), mask=first)
            tl.store(st + 2, above.to(tl.int32, bitcast=True), mask=first)
            tl.store(st + 3, target.to(tl.int32, bitcast=True), mask=first)
        elif D > 0:
            pre, krem = _k_advance(state_ptr, cnt_ptr, row, R, top_k, D, SPLITS, BLOCK_S)
            tl.store(st + 1, krem, mask=first)
        tl.store(st, pre.to(tl.int32, bitcast=True), mask=first)
        base = split * CHUNK
        cnt, mass = _hist_range(logits_ptr + row.to(tl.int64) * stride + base, V - base, lo, pre, m, c, D,
                                NDIG, SHIFT, MASS=PHASE_P, SKIP=PHASE_P or D > 0, LOOP=CHUNK, HBLOCK=HBLOCK)
        bins = tl.arange(0, 16)
        tl.store(cnt_ptr + ((J * R + row) * SPLITS + split) * 16 + bins, cnt)
        if PHASE_P:
            tl.store(mass_ptr + ((D * R + row) * SPLITS + split) * 16 + bins, mass)


@triton.jit(do_not_specialize=["R"])
def _split_final_kernel(logits_ptr, stride, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, ctr_ptr,
                        pf_ptr, cnt_ptr, mass_ptr, state_ptr, fo_ptr, io_ptr, mask_ptr, R,
                        V: tl.constexpr, SAMPLE: tl.constexpr, MASK: tl.constexpr, NDIG: tl.constexpr,
                        SHIFT: tl.constexpr, SPLITS: tl.constexpr, CHUNK: tl.constexpr,
                        BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr):
    # _trunc_kernel's final pass over one chunk -> partials fo [2, R, S] f32 (kept mass, best
    # score), io [2, R, S] int32 (kept count, best index).
    row = tl.program_id(0)
    split = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    t_raw, t, inv_t, c = _row_temperature(temp_ptr, row)
    top_k = tl.load(topk_ptr + row)
    top_p = tl.load(topp_ptr + row)
    min_p = tl.load(minp_ptr + row)
    do_k = (top_k > 0) & (top_k < V)
    do_p = top_p < 1.0
    m = _row_max(pf_ptr, row, SPLITS, BLOCK_S)
    kth = tl.full([], 0, tl.uint32)
    vstar = kth
    n_keep = V
    ties = 0  # v* ties in the chunks before this one
    if do_p:
        vstar, kth, above, target, b, n = _p_advance(state_ptr, cnt_ptr, mass_ptr, row, R, top_p, NDIG, NDIG,
                                                     SPLITS, BLOCK_S)
        e_star = tl.exp2((_key_value(vstar, SHIFT) - m) * c)
        q = tl.where(e_star > 0, (target - above) / e_star, n.to(tl.float32))
        n_keep = tl.minimum(tl.maximum(tl.ceil(q), 1.0), n.to(tl.float32)).to(tl.int32)
        # The last digit's per-chunk count of the selected bin counts exactly the keys == v*
        # (>= kth, prefix and digit equal): its exclusive prefix over chunks is this chunk's offset.
        last = _psum(cnt_ptr + ((2 * NDIG - 1) * R + row) * (SPLITS * 16), split, SPLITS, BLOCK_S)
        ties = tl.sum(tl.where(tl.arange(0, 16) == b, last, 0), 0)
    elif do_k:
        kth, _ = _k_advance(state_ptr, cnt_ptr, row, R, top_k, NDIG, SPLITS, BLOCK_S)
    # As _trunc_kernel's final loop; the noise pruning bound starts afresh per chunk (still exact:
    # a pruned block cannot beat this chunk's best, so not the row's).
    k1, k2 = _row_keys(tl.load(seed_ptr + row), tl.load(ctr_ptr + row))
    lanes = tl.arange(0, BLOCK_V)
    bound = float("-inf")
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    bidx = tl.zeros([BLOCK_V], tl.int32)
    kept_e = tl.zeros([BLOCK_V], tl.float32)
    kept_n = tl.zeros([BLOCK_V], tl.int32)
    for start in range(0, CHUNK, BLOCK_V):
        idx = split * CHUNK + start + lanes
        ties, bound, kept_e, kept_n, best, bidx = _final_block(
            row_ptr, idx, V, m, c, inv_t, kth, min_p, vstar, n_keep, do_p, ties, t_raw, k1, k2, bound,
            kept_e, kept_n, best, bidx, mask_ptr, row, SHIFT, MASK, SAMPLE)
    top = tl.max(best, 0)
    off = row * SPLITS + split
    tl.store(fo_ptr + off, tl.sum(kept_e, 0))
    tl.store(fo_ptr + R * SPLITS + off, top)
    tl.store(io_ptr + off, tl.sum(kept_n, 0))
    tl.store(io_ptr + R * SPLITS + off, tl.min(tl.where(best == top, bidx, 0x7FFFFFFF), 0))


@triton.jit(do_not_specialize=["R"])
def _split_merge_kernel(logits_ptr, stride, temp_ptr, pf_ptr, fo_ptr, io_ptr, tok_ptr, lp_ptr, plp_ptr,
                        km_ptr, stats_ptr, R, V: tl.constexpr, STATS: tl.constexpr, SPLITS: tl.constexpr,
                        BLOCK_S: tl.constexpr):
    # Per row: Z from pass A's partials (as _merge_kernel), the token (chunks are contiguous, so
    # the smallest index among the chunk winners at the top score is the row's first), the kept
    # mass and count.
    row = tl.program_id(0)
    off, ok, mx, total, t = _merged_z(pf_ptr, temp_ptr, row, R, SPLITS, BLOCK_S)
    best = tl.load(fo_ptr + R * SPLITS + off, mask=ok, other=float("-inf"))
    top = tl.max(best, 0)
    tok = tl.min(tl.where(best == top, tl.load(io_ptr + R * SPLITS + off, mask=ok, other=0x7FFFFFFF), 0x7FFFFFFF), 0)
    kept_e = tl.sum(tl.load(fo_ptr + off, mask=ok, other=0.0), 0)
    kept_n = tl.sum(tl.load(io_ptr + off, mask=ok, other=0), 0)
    lp = _finish(logits_ptr + row.to(tl.int64) * stride, t, mx, total, tok, tok_ptr + row, lp_ptr + row,
                 stats_ptr + row, R, STATS)
    km = tl.where(kept_n == V, 0.0, _log_precise(kept_e / total))
    tl.store(km_ptr + row, km)
    tl.store(plp_ptr + row, lp - km)


_DIGITS = {torch.bfloat16: (4, 16), torch.float16: (5, 12), torch.float32: (8, 0)}
_MAX_ROW_SPLITS = 32  # every program of a step sums its row's S x 16 partials: keep that << a chunk


def default_row_splits(R: int, V: int, device, block: int = 1024) -> int:
    """Chunks per row for the split truncation path: at least 8, and more at small R for about 3
    programs per SM (the histogram passes are ALU-bound; ~80 registers x 256 threads fit 3 CTAs
    an SM); at least one `block` per chunk, at most 32. Measured on the H200 (V = 151,936, bf16,
    graphs; bench/results/2026-11-29_kernels_fused-sampler-truncation_row-splits_315b2bc.json):
    S = 8 was the fastest or within 1% of it for top-k, top-p, min-p and all three at R = 64 and
    256 (R = 64 top-p 1,439 -> 377 us, top-k 1,087 -> 231; R = 256 top-k 1,757 -> 909), where
    3 programs per SM alone would take 7 and 2. Rounded down to a power of two (8, 16, 32): the
    split kernels are compiled per chunk width, and few classes keep eager steps from compiling
    (`fused_sampler.default_num_splits`)."""
    by_sms = pow2_floor(min(max(8, triton.cdiv(3 * sm_count(torch.device(device)), max(R, 1))), _MAX_ROW_SPLITS))
    return max(1, min(by_sms, triton.cdiv(V, block)))


def _row_chunks(V: int, S: int, block: int) -> tuple[int, int]:
    """-> (chunks, chunk width): S chunks of whole blocks, fewer where V is too short (none empty)."""
    return split_chunks(V, min(S, _MAX_ROW_SPLITS), block)


def _trunc_split(logits, st, S, chunk, tok, lp, plp, km, stats, mask, block_v, hblock, num_warps):
    R, V = logits.shape
    dev = logits.device
    ndig, shift = _DIGITS[logits.dtype]
    temp, top_k, top_p = st.temperature.float(), st.top_k.long(), st.top_p.float()
    seeds, counters = st.seeds.long(), st.counters.long()
    f32 = torch.empty(3 * R * S + ndig * R * S * 16 + 2 * R * S, dtype=torch.float32, device=dev)
    i32 = torch.empty(R * S + 2 * ndig * R * S * 16 + 2 * ndig * R * 4 + 2 * R * S, dtype=torch.int32, device=dev)
    pf, mass, fo = f32.split([3 * R * S, ndig * R * S * 16, 2 * R * S])
    pi, cnt, state, io = i32.split([R * S, 2 * ndig * R * S * 16, 2 * ndig * R * 4, 2 * R * S])
    const = {"V": V, "SPLITS": S, "CHUNK": chunk, "BLOCK_S": triton.next_power_of_2(S)}
    # Pass A: per-chunk max and sum-exp (its argmax / index partials are unused).
    _sample_kernel[(R, S)](logits, logits.stride(0), temp, seeds, counters, tok, lp, lp, pf, pi, R, V,
                           SAMPLE=False, STATS=False, SPLITS=S, CHUNK=chunk, BLOCK_V=block_v, num_warps=num_warps)
    for j in range(2 * ndig):
        _split_step_kernel[(R, S)](logits, logits.stride(0), temp, top_k, top_p, pf, cnt, mass, state, R, J=j,
                                   NDIG=ndig, SHIFT=shift, HBLOCK=hblock, num_warps=num_warps, **const)
    _split_final_kernel[(R, S)](logits, logits.stride(0), temp, top_k, top_p, st.min_p.float(), seeds, counters,
                                pf, cnt, mass, state, fo, io, mask if mask is not None else lp, R,
                                SAMPLE=not st.all_greedy, MASK=mask is not None, NDIG=ndig, SHIFT=shift,
                                BLOCK_V=block_v, num_warps=num_warps, **const)
    _split_merge_kernel[(R,)](logits, logits.stride(0), temp, pf, fo, io, tok, lp, plp, km,
                              stats if stats is not None else lp, R, V=V, STATS=stats is not None, SPLITS=S,
                              BLOCK_S=const["BLOCK_S"], num_warps=1)


def fused_sample_full(logits: torch.Tensor, st: SamplingTensors, *, out: SamplerOutput | None = None,
                      block_v: int = 1024, num_warps: int = 8, hist_block: int | None = None,
                      num_splits: int | None = None, row_splits: int | None = None,
                      _kept_mask: torch.Tensor | None = None) -> SamplerOutput:
    """`rollout.sampler.sample`'s contract (tokens, logprobs, processed_logprobs, kept_mass, top
    logprobs) for rows without a repetition penalty, without an fp32 copy of the logits.
    st.any_truncation False: `fused_sample` (one pass; processed = logprobs, kept_mass = 0).
    True: `_trunc_kernel`, one program per row and several passes over it (rows without top-k /
    top-p / min-p take two: max / sum, then the sample). Top logprobs: torch.topk of the raw
    logits, turned into logprobs with the kernel's per-row (max / T, log sum): the values are the
    reference's; on exact ties torch.topk may order (or, at the K-th place, pick) other indices of
    the same value. out: preallocated token_ids / logprobs / processed_logprobs / kept_mass written
    in place (its top fields are ignored). block_v / num_warps / hist_block: the truncation
    kernel's block for its first and last passes, warps, and block for its histogram passes
    (default 32 * num_warps: one element per thread, [16, hist_block] accumulators = 32 registers);
    num_splits: the no-truncation kernel's.
    row_splits (truncation only): None or 1 = `_trunc_kernel`, one program per row (the engine
    passes `default_row_splits`: 3.6-4.7x faster at R = 64 on the H200, 1.2-1.9x at 256);
    S > 1 = each row in S contiguous chunks (fewer where V / block is smaller; 1 chunk falls back
    to `_trunc_kernel`), one program each per pass, 2 * digits + 3 launches. Same kept sets and
    tokens as S = 1 (counts are exact; top-p masses are fp32 sums in another order, so a token
    within rounding of the top-p boundary may flip, as between the kernel and the reference);
    logprob / kept_mass differ from S = 1 in the last ulps (summation order); deterministic."""
    if st.any_penalty:
        raise ValueError("repetition penalty rows take rollout.sampler.sample")
    R, V = logits.shape
    assert all(t.shape == (R,) for t in (st.temperature, st.top_k, st.top_p, st.min_p, st.seeds, st.counters))
    dev = logits.device
    if out is None:
        tok = torch.empty(R, dtype=torch.int64, device=dev)
        lp = torch.empty(R, dtype=torch.float32, device=dev)
        plp = lp if not st.any_truncation else torch.empty_like(lp)
        km = torch.empty_like(lp)
    else:
        tok, lp, plp, km = out.token_ids, out.logprobs, out.processed_logprobs, out.kept_mass
    K = st.num_top_logprobs
    stats = torch.empty(2, R, dtype=torch.float32, device=dev) if K else None
    if R and not st.any_truncation:
        fused_sample(logits, st.temperature, st.seeds, st.counters, greedy_only=st.all_greedy,
                     num_splits=num_splits, out=(tok, lp), stats=stats)
        km.zero_()
        if plp is not lp:
            plp.copy_(lp)
    elif R:
        assert logits.stride(1) == 1 and logits.dtype in _DIGITS
        ndig, shift = _DIGITS[logits.dtype]
        hblock = hist_block or 32 * num_warps
        S, chunk = _row_chunks(V, row_splits or 1, max(block_v, hblock))
        if S > 1:
            _trunc_split(logits, st, S, chunk, tok, lp, plp, km, stats, _kept_mask, block_v, hblock, num_warps)
        else:
            _trunc_kernel[(R,)](
                logits, logits.stride(0), st.temperature.float(), st.top_k.long(), st.top_p.float(),
                st.min_p.float(), st.seeds.long(), st.counters.long(), tok, lp, plp, km,
                stats if stats is not None else lp, _kept_mask if _kept_mask is not None else lp, R, V,
                SAMPLE=not st.all_greedy, STATS=stats is not None, MASK=_kept_mask is not None,
                NDIG=ndig, SHIFT=shift, BLOCK_V=block_v, HBLOCK=hblock, num_warps=num_warps)
    top_ids = top_lps = None
    if K:
        # Same formula as the kernel's logprob ((x / T - max / T) - log sum); x / T divides as the
        # reference does, and bf16 -> fp32 is exact, so only log sum's summation order differs.
        vals, top_ids = torch.topk(logits, K, dim=-1)
        t = torch.where(st.temperature > 0, st.temperature, 1.0)[:, None]
        top_lps = (vals.float() / t - stats[0][:, None]) - stats[1][:, None]
    return SamplerOutput(tok, lp, plp, km, top_ids, top_lps)


def fused_kept_mask(logits: torch.Tensor, st: SamplingTensors, **kw) -> tuple[torch.Tensor, SamplerOutput]:
    """Debug / tests: the truncation kernel's kept set as a bool [R, V] tensor (compiled only
    here), with its outputs."""
    mask = torch.full(logits.shape, -1, dtype=torch.int8, device=logits.device)  # poison: -1
    o = fused_sample_full(logits, replace(st, any_truncation=True), _kept_mask=mask, **kw)
    assert bool(((mask == 0) | (mask == 1)).all()), "kernel did not write every mask entry"
    return mask.bool(), o
