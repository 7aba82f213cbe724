"""Causal varlen attention over paged KV (chunked prefill; also correct for mixed batches).

q [T, Hq, D] packs S sequences (query_start_loc), each the last q_len positions of its context.
Grid (T // BLOCK_Q + S query tiles, Hkv): tile ids of sequence s start at qsl[s] // BLOCK_Q + s,
found by binary search; a tile's rows are BLOCK_Q tokens x one KV head's GROUP query heads.
Batch-invariant mode (split_len) cuts every row's keys at fixed multiples of split_len.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import fix_interpreter
from .paged_decode import LOG2E, load_kv_tile
from .pdl import enter, pdl_for

fix_interpreter()


@triton.jit
def _attend(q, k_ptr, v_ptr, bt_ptr, seq, kvh, q_pos, k_lo, k_hi, sm_scale_log2, window,
            s_kp, s_ks, s_kh, s_vp, s_vs, s_vh, s_bt,
            BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
            USE_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr):
    """Online softmax of the tile's rows over keys [k_lo, k_hi), causal / windowed -> (m, l, acc)."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(k_lo, k_hi, BLOCK_N):
        pos = n0 + offs_n
        kv_ok = pos < k_hi
        k, v = load_kv_tile(k_ptr, v_ptr, bt_ptr, seq, kvh, n0, pos, kv_ok, s_kp, s_ks, s_kh, s_vp, s_vs, s_vh, s_bt,
                            HEAD_DIM, PAGE_SIZE, BLOCK_N)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * sm_scale_log2
        allowed = kv_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (q_pos[:, None] - pos[None, :] < window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)   # row fully masked so far: keep 0, not NaN
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _merge(m_run, l_run, acc_run, m, l, acc):
    """Fold one KV split's (m, l, acc) into the running ones (the same ops in both invariant paths)."""
    m_new = tl.maximum(m_run, m)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp2(m_run - m_use)
    b = tl.exp2(m - m_use)
    empty = m == float("-inf")
    l_run = tl.where(empty, l_run, l_run * a + l * b)
    acc_run = tl.where(empty[:, None], acc_run, acc_run * a[:, None] + acc * b[:, None])
    return m_new, l_run, acc_run


@triton.jit(do_not_specialize=["num_seqs"])   # varies per step: one kernel for every count
def _prefill_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, qsl_ptr, lens_ptr, ws_ptr, wml_ptr, sm_scale_log2, window, num_seqs,
        s_qt, s_qh, s_kp, s_ks, s_kh, s_vp, s_vs, s_vh, s_bt, s_ot, s_oh,
        GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
        PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr,
        SPLIT_LEN: tl.constexpr, SPLIT_PROGRAMS: tl.constexpr, MAX_SPLITS: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    # Binary search: last s with first_tile(s) = qsl[s] // BLOCK_Q + s <= tile.
    lo_s = tile * 0            # tensors, not constexprs: loop-carried values must stay one type
    hi_s = tile * 0 + num_seqs
    while lo_s < hi_s:
        mid = (lo_s + hi_s) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= tile:
            lo_s = mid + 1
        else:
            hi_s = mid
    seq = lo_s - 1
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    ctx = tl.load(lens_ptr + seq)
    t0 = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q      # first query (within the chunk) of this tile

    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    t_loc = t0 + rows // GROUP
    heads = kvh * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (t_loc < q_len)
    q_pos = ctx - q_len + t_loc                                # absolute position of each row's query
    tok = (q_start + t_loc).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * s_qt + heads[:, None] * s_qh + dims[None, :],
                mask=row_ok[:, None], other=0.0)

    # Keys [k_lo, k_hi): causal up to the tile's last query; window from its first query.
    n_rows = tl.minimum(q_len - t0, BLOCK_Q)                  # <= 0: tile past the sequence
    k_hi = tl.where(n_rows > 0, ctx - q_len + t0 + n_rows, 0)
    if USE_WINDOW:
        k_lo = tl.maximum(ctx - q_len + t0 - window + 1, 0)
    else:
        k_lo = k_hi * 0
    k_lo = (k_lo // BLOCK_N) * BLOCK_N
    if SPLIT_LEN == 0:      # one pass over the tile's keys
        m_i, l_i, acc = _attend(q, k_ptr, v_ptr, bt_ptr, seq, kvh, q_pos, k_lo, k_hi, sm_scale_log2, window,
                                s_kp, s_ks, s_kh, s_vp, s_vs, s_vh, s_bt, BLOCK_M, HEAD_DIM, PAGE_SIZE, BLOCK_N,
                                USE_WINDOW, DOT_PREC)
    elif not SPLIT_PROGRAMS:    # batch-invariant prefill: fixed-length KV splits, folded here in position order
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for split in range(k_lo // SPLIT_LEN, tl.cdiv(k_hi, SPLIT_LEN)):
            m_s, l_s, acc_s = _attend(q, k_ptr, v_ptr, bt_ptr, seq, kvh, q_pos, tl.maximum(k_lo, split * SPLIT_LEN),
                                      tl.minimum(k_hi, (split + 1) * SPLIT_LEN), sm_scale_log2, window,
                                      s_kp, s_ks, s_kh, s_vp, s_vs, s_vh, s_bt, BLOCK_M, HEAD_DIM, PAGE_SIZE,
                                      BLOCK_N, USE_WINDOW, DOT_PREC)
            m_i, l_i, acc = _merge(m_i, l_i, acc, m_s, l_s, acc_s)
    if SPLIT_PROGRAMS:      # batch-invariant decode: this program's split only; _decode_merge_kernel folds them
        split = tl.program_id(2)
        if split * SPLIT_LEN < k_hi:
            m_s, l_s, acc_s = _attend(q, k_ptr, v_ptr, bt_ptr, seq, kvh, q_pos, tl.maximum(k_lo, split * SPLIT_LEN),
                                      tl.minimum(k_hi, (split + 1) * SPLIT_LEN), sm_scale_log2, window,
                                      s_kp, s_ks, s_kh, s_vp, s_vs, s_vh, s_bt, BLOCK_M, HEAD_DIM, PAGE_SIZE,
                                      BLOCK_N, USE_WINDOW, DOT_PREC)
            part = (tok * (tl.num_programs(1) * GROUP) + heads) * MAX_SPLITS + split
            tl.store(ws_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc_s, mask=row_ok[:, None])
            tl.store(wml_ptr + 2 * part, m_s, mask=row_ok)
            tl.store(wml_ptr + 2 * part + 1, l_s, mask=row_ok)
    else:
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]           # no key at all (ctx 0): 0
        tl.store(out_ptr + tok[:, None] * s_ot + heads[:, None] * s_oh + dims[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _decode_merge_kernel(ws_ptr, wml_ptr, lens_ptr, out_ptr, s_ot, s_oh,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         SPLIT_LEN: tl.constexpr, MAX_SPLITS: tl.constexpr, PDL: tl.constexpr):
    """Grid (B, Hkv), token b is sequence b: fold its splits in position order, then normalise."""
    enter(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + rows
    row_ok = rows < GROUP
    ctx = tl.load(lens_ptr + b)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for split in range(0, tl.cdiv(ctx, SPLIT_LEN)):
        part = (b * (tl.num_programs(1) * GROUP) + heads) * MAX_SPLITS + split
        m_s = tl.load(wml_ptr + 2 * part, mask=row_ok, other=float("-inf"))
        l_s = tl.load(wml_ptr + 2 * part + 1, mask=row_ok, other=0.0)
        acc_s = tl.load(ws_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=row_ok[:, None], other=0.0)
        m_i, l_i, acc = _merge(m_i, l_i, acc, m_s, l_s, acc_s)
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + b * s_ot + heads[:, None] * s_oh + dims[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, sliding_window: Optional[int] = None, *,
                            out: Optional[torch.Tensor] = None, block_m: Optional[int] = None,
                            block_n: Optional[int] = None, num_warps: int = 4, num_stages: int = 2,
                            split_len: int = 0, decode_rows: bool = False) -> torch.Tensor:
    """q [T, Hq, D] (S sequences packed by query_start_loc [S+1] int32); seq_lens [S] int32, each
    context after this chunk; caches [num_pages, page_size, Hkv, D]; block_tables [S, P] int32
    -> [T, Hq, D]. split_len > 0 (batch-invariant): keys cut at multiples of split_len, folded in
    position order (no fp contraction); decode_rows (T == S): one program a split and a merge kernel."""
    T, Hq, D = q.shape
    _, page_size, Hkv, Dk = k_cache.shape
    S = seq_lens.shape[0]
    group = Hq // Hkv
    fp32 = q.dtype == torch.float32     # fp32 dots run on FMA units: smaller tiles or registers spill
    block_m = block_m or max(32 if fp32 else 64, triton.next_power_of_2(group))
    block_n = block_n or (16 if fp32 else 64)
    assert Dk == D and v_cache.shape == k_cache.shape and Hq % Hkv == 0, "shape mismatch"
    assert D >= 16 and D & (D - 1) == 0, "head_dim must be a power of two >= 16"
    assert page_size & (page_size - 1) == 0, "page_size must be a power of two"
    assert block_m >= 16 and block_m & (block_m - 1) == 0 and group <= block_m and block_n >= 16
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and block_tables.stride(1) == 1
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
    assert query_start_loc.dtype == torch.int32 and query_start_loc.shape[0] == S + 1
    assert split_len % block_n == 0 and (split_len or not decode_rows), "split_len: a multiple of block_n"
    if out is None:
        out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    assert out.stride(2) == 1
    if T == 0 or S == 0:
        return out
    block_q = block_m // group
    prec = "ieee" if fp32 else "tf32"     # fp32: no tf32 rounding in tl.dot
    max_splits = triton.cdiv(block_tables.shape[1] * page_size, split_len) if decode_rows else 1
    ws = wml = out      # unused without decode_rows
    if decode_rows:   # fp32 partials (acc; m and l interleaved); graph-safe like the decode kernel's
        ws = torch.empty((T, Hq, max_splits, D), dtype=torch.float32, device=q.device)
        wml = torch.empty((T, Hq, max_splits, 2), dtype=torch.float32, device=q.device)
    pdl = pdl_for(q) if split_len > 0 else 0
    _prefill_kernel[(T // block_q + S, Hkv, max_splits)](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, ws, wml, scale * LOG2E,
        int(sliding_window or 0), S, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=D, PAGE_SIZE=page_size, BLOCK_N=block_n,
        USE_WINDOW=sliding_window is not None, DOT_PREC=prec, SPLIT_LEN=split_len, SPLIT_PROGRAMS=decode_rows,
        MAX_SPLITS=max_splits, PDL=pdl, num_warps=num_warps, num_stages=num_stages, launch_pdl=bool(pdl),
        enable_fp_fusion=split_len == 0)
    if decode_rows:
        _decode_merge_kernel[(S, Hkv)](ws, wml, seq_lens, out, out.stride(0), out.stride(1), GROUP=group,
                                       GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=D, SPLIT_LEN=split_len,
                                       MAX_SPLITS=max_splits, PDL=pdl, num_warps=2, launch_pdl=bool(pdl),
                                       enable_fp_fusion=False)
    return out
