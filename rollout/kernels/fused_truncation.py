"""Top-k / top-p / min-p for the fused sampler, and `fused_sample_full`, which dispatches a batch.

`_trunc_kernel`, one program per row: max / sum exp; top-k by a radix select of the k-th largest
value over monotone integer keys (4-bit digits, one histogram pass each); top-p by a radix select
of the boundary by cumulative mass, then the first of its ties by index; min-p: e(x) >= min_p; a
final pass samples the kept set. Split rows (`row_splits` S > 1): the same passes over S chunks a
row, one launch per pass, partials reduced in a fixed order by the next launch (deterministic).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from ..sampler import SamplerOutput, SamplingTensors
from . import sm_count
from .fused_sampler import (_NEG_BIG, _finish, _gumbel_pruned, _log_precise, _merged_z, _row_keys, _row_temperature,
                            _sample_kernel, fused_sample, pow2_floor, split_chunks)


@triton.jit
def _key(x, SHIFT: tl.constexpr):
    # Unsigned key in x's float order (-0.0 = +0.0); >> SHIFT drops bits the dtype never sets.
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
    # 16-bin histogram over ptr[:n] of digit D of the keys >= lo with higher digits == pre: counts
    # and (MASS) sums of exp2((x - m) * c), per lane, reduced once. SKIP: skip candidate-free blocks.
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
    b = tl.sum((tl.cumsum(cnt, 0, reverse=True) >= k).to(tl.int32), 0) - 1
    return b, tl.sum(tl.where(tl.arange(0, 16) > b, cnt, 0), 0)


@triton.jit
def _select_mass(cnt, mass, target, above, top_p, FIRST: tl.constexpr):
    # The first non-empty bin (high -> low) whose cumulative mass from `above` reaches target, else
    # the lowest non-empty one (FIRST: target = top_p * total) -> (bin, mass above, count, target).
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
    """One block of the final pass: the kept set (`ties`: v* ties before it), its mass and count, the sample."""
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

    # top-k: radix select of the k-th largest key, top digit first; ties at kth all kept (as HF).
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

    # top-p over the top-k survivors: keys above the boundary v* (a radix select by mass) and the
    # first c of its n ties, c = #{r < n: G(v*) + r e* < top_p * Zk} >= 1.
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

    # Final pass in index order; min-p is e >= min_p (the max survivor has e = 1).
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


# Split rows: pass A (_sample_kernel's partials), one launch per radix digit (NDIG top-k, NDIG
# top-p; launch J selects digit J - 1 in every program, chunk 0 stores slot J), final, merge.
# Buffers: cnt [2 NDIG, R, S, 16] int32, mass [NDIG, R, S, 16] f32, state [2 NDIG, R, 4] int32:
# top-k slots (prefix, remaining rank); top-p slots (prefix, kth, mass above, target) as bits.
@triton.jit
def _psum(ptr, upto, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    # Sum of the [16] histograms of chunks [0, upto) of one row and step ([SPLITS, 16] at ptr).
    s = tl.arange(0, BLOCK_S)[:, None]
    return tl.sum(tl.load(ptr + s * 16 + tl.arange(0, 16)[None, :], mask=s < upto, other=0), 0)


@triton.jit
def _k_advance(state_ptr, cnt_ptr, row, R, top_k, D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    # Top-k (prefix, remaining rank) after the selects of digits 0..D-1 (D >= 1).
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
    # Top-p state after digits 0..D-1 -> (prefix, kth, mass above, target, selected bin, count).
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
    # Radix step J: top-k digit J (J < NDIG), else top-p digit J - NDIG; rows without the phase exit.
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
    # The final pass over one chunk -> fo [2, R, S] (kept mass, best score), io (kept count, index).
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
        # The last digit's per-chunk counts of the bin are the v* ties: their prefix is this chunk's.
        last = _psum(cnt_ptr + ((2 * NDIG - 1) * R + row) * (SPLITS * 16), split, SPLITS, BLOCK_S)
        ties = tl.sum(tl.where(tl.arange(0, 16) == b, last, 0), 0)
    elif do_k:
        kth, _ = _k_advance(state_ptr, cnt_ptr, row, R, top_k, NDIG, SPLITS, BLOCK_S)
    # As _trunc_kernel's final loop; the pruning bound starts afresh per chunk (still exact).
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
    # Per row: Z from pass A's partials, the token (smallest index at the top score), kept mass.
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
    """Chunks per row: >= 8 (fastest on the H200), ~3 programs an SM at small R, <= 32, a power of two."""
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
    fs, ns = [3 * R * S, ndig * R * S * 16, 2 * R * S], [R * S, 2 * ndig * R * S * 16, 2 * ndig * R * 4, 2 * R * S]
    pf, mass, fo = torch.empty(sum(fs), dtype=torch.float32, device=dev).split(fs)      # fp32 buffers' sizes: fs
    pi, cnt, state, io = torch.empty(sum(ns), dtype=torch.int32, device=dev).split(ns)  # int32: ns
    const = {"V": V, "SPLITS": S, "CHUNK": chunk, "BLOCK_S": triton.next_power_of_2(S)}
    # Pass A: per-chunk max and sum-exp.
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
    """`rollout.sampler.sample`'s contract for rows without a repetition penalty: `fused_sample`, or
    `_trunc_kernel`, or with row_splits S > 1 the split kernels (tokens equal up to fp32 rounding at
    the top-p boundary). out: preallocated outputs (top fields ignored); num_splits: fused_sample's."""
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
        # The kernel's formula ((x / T - max / T) - log sum): only log sum's summation order differs.
        vals, top_ids = torch.topk(logits, K, dim=-1)
        t = torch.where(st.temperature > 0, st.temperature, 1.0)[:, None]
        top_lps = (vals.float() / t - stats[0][:, None]) - stats[1][:, None]
    return SamplerOutput(tok, lp, plp, km, top_ids, top_lps)


def fused_kept_mask(logits: torch.Tensor, st: SamplingTensors, **kw) -> tuple[torch.Tensor, SamplerOutput]:
    """Tests: the truncation kernel's kept set as a bool [R, V] tensor, with its outputs."""
    mask = torch.full(logits.shape, -1, dtype=torch.int8, device=logits.device)  # poison: -1
    o = fused_sample_full(logits, replace(st, any_truncation=True), _kept_mask=mask, **kw)
    assert bool(((mask == 0) | (mask == 1)).all()), "kernel did not write every mask entry"
    return mask.bool(), o
