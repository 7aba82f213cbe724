"""Causal varlen attention over paged KV (chunked prefill; also correct for mixed batches).

q [T, Hq, D] packs S sequences (query_start_loc). Sequence s's queries are the last
q_len = qsl[s+1] - qsl[s] positions of its context seq_lens[s]; their K/V are already in the
pages. Grid (cdiv-free upper bound T // BLOCK_Q + S query tiles, Hkv): each sequence's tiles
start at its own first token, tile ids of sequence s start at qsl[s] // BLOCK_Q + s (vLLM's
unified-attention numbering), and a program finds its sequence by binary search over that.
Tile ids past a sequence's last tile do nothing. A tile's rows are BLOCK_Q tokens x GROUP
query heads of one KV head (GQA-packed, works for any GROUP <= BLOCK_M), so each K/V tile
read through the block table serves all heads of the group.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import fix_interpreter

fix_interpreter()

LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, qsl_ptr, lens_ptr,
        sm_scale_log2, window, num_seqs,
        s_qt, s_qh, s_kp, s_ks, s_kh, s_vp, s_vs, s_vh, s_bt, s_ot, s_oh,
        GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
        PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr):
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

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(k_lo, k_hi, BLOCK_N):
        pos = n0 + offs_n
        kv_ok = pos < k_hi
        page = tl.load(bt_ptr + seq * s_bt + pos // PAGE_SIZE, mask=kv_ok, other=0).to(tl.int64)
        slot = pos % PAGE_SIZE
        k = tl.load(k_ptr + page[:, None] * s_kp + slot[:, None] * s_ks + kvh * s_kh + dims[None, :],
                    mask=kv_ok[:, None], other=0.0)
        v = tl.load(v_ptr + page[:, None] * s_vp + slot[:, None] * s_vs + kvh * s_vh + dims[None, :],
                    mask=kv_ok[:, None], other=0.0)
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

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]           # no key at all (ctx 0): 0
    tl.store(out_ptr + tok[:, None] * s_ot + heads[:, None] * s_oh + dims[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, sliding_window: Optional[int] = None, *,
                            out: Optional[torch.Tensor] = None, block_m: Optional[int] = None,
                            block_n: Optional[int] = None,
                            num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """q [T, Hq, D] (S sequences packed by query_start_loc [S+1] int32); seq_lens [S] int32 is
    each context after this chunk; caches [num_pages, page_size, Hkv, D]; block_tables [S, P]
    int32. -> [T, Hq, D] in q's dtype (rows past query_start_loc[S] are left unwritten)."""
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
    if out is None:
        out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    assert out.stride(2) == 1
    if T == 0 or S == 0:
        return out
    block_q = block_m // group
    prec = "ieee" if fp32 else "tf32"     # fp32: no tf32 rounding in tl.dot
    _prefill_kernel[(T // block_q + S, Hkv)](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens,
        scale * LOG2E, int(sliding_window or 0), S,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=D, PAGE_SIZE=page_size, BLOCK_N=block_n,
        USE_WINDOW=sliding_window is not None, DOT_PREC=prec, num_warps=num_warps, num_stages=num_stages)
    return out
