"""Split-KV paged decode attention (one query per sequence), GQA-packed. Kernel 1, grid (B, Hkv,
NUM_SPLITS), takes a KV head's GROUP query heads as a tile's rows over its split of the context
(fp32 online softmax, log2 domain) and writes a normalised partial and its log-sum-exp (the output
with one split); kernel 2 merges. Split bounds come from seq_len in the kernel, so one graph per
batch bucket serves every context; seq_len 0 (padding) writes zeros.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from . import fix_interpreter
from .pdl import enter, pdl_for, sm90_or_later

fix_interpreter()

LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, po_ptr, plse_ptr, sm_scale_log2, window,
        s_qb, s_qh, s_kp, s_ks, s_kh, s_vp, s_vs, s_vh, s_bt, s_ob, s_oh,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr,
        PDL: tl.constexpr):
    enter(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * GROUP
    seq_len = tl.load(lens_ptr + b)

    # Keys attended: [lo, seq_len) (lo > 0 only with a sliding window; q_pos = seq_len - 1).
    if USE_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    else:
        lo = seq_len * 0
    lo_tile = (lo // BLOCK_N) * BLOCK_N          # tiles start on BLOCK_N multiples
    split_len = tl.cdiv(tl.cdiv(seq_len - lo_tile, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo_tile + split * split_len
    end = tl.minimum(start + split_len, seq_len)  # start >= end: empty split (short context)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + rows
    row_ok = rows < GROUP
    q = tl.load(q_ptr + b * s_qb + heads[:, None] * s_qh + dims[None, :], mask=row_ok[:, None], other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        valid = (pos < end) & (pos >= lo)
        k, v = load_kv_tile(k_ptr, v_ptr, bt_ptr, b, kvh, n0, pos, valid, s_kp, s_ks, s_kh, s_vp, s_vs, s_vh, s_bt,
                            HEAD_DIM, PAGE_SIZE, BLOCK_N)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * sm_scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)   # all-masked row: no NaN from -inf - -inf
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)       # empty split / padding row -> acc 0, output 0
    o = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + b * s_ob + heads[:, None] * s_oh + dims[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])
    else:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        part = (b * num_q_heads + heads) * NUM_SPLITS + split
        tl.store(po_ptr + part[:, None] * HEAD_DIM + dims[None, :], o, mask=row_ok[:, None])
        tl.store(plse_ptr + part, lse, mask=row_ok)


@triton.jit
def load_kv_tile(k_ptr, v_ptr, bt_ptr, seq, kvh, n0, pos, valid, s_kp, s_ks, s_kh, s_vp, s_vs, s_vh, s_bt,
                 HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """K and V [BLOCK_N, HEAD_DIM] of keys n0 + arange(BLOCK_N) of sequence `seq` (0 where not `valid`)."""
    dims = tl.arange(0, HEAD_DIM)
    if BLOCK_N <= PAGE_SIZE:
        page = tl.load(bt_ptr + seq * s_bt + n0 // PAGE_SIZE).to(tl.int64)
        slot = (n0 % PAGE_SIZE + tl.arange(0, BLOCK_N))[:, None]
    else:
        page = tl.load(bt_ptr + seq * s_bt + pos // PAGE_SIZE, mask=valid, other=0).to(tl.int64)[:, None]
        slot = (pos % PAGE_SIZE)[:, None]
    k = tl.load(k_ptr + page * s_kp + slot * s_ks + kvh * s_kh + dims[None, :], mask=valid[:, None], other=0.0)
    v = tl.load(v_ptr + page * s_vp + slot * s_vs + kvh * s_vh + dims[None, :], mask=valid[:, None], other=0.0)
    return k, v


@triton.jit
def _decode_merge_kernel(po_ptr, plse_ptr, out_ptr, s_ob, s_oh,
                         HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM)
    ok = sp < NUM_SPLITS
    part = (b * tl.num_programs(1) + h) * NUM_SPLITS + sp
    lse = tl.load(plse_ptr + part, mask=ok, other=float("-inf"))
    o = tl.load(po_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=ok[:, None], other=0.0)
    mx = tl.max(lse, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp2(lse - mx)                       # empty splits (lse -inf) weigh 0
    den = tl.sum(w, 0)
    res = tl.sum(w[:, None] * o, 0) / tl.where(den > 0.0, den, 1.0)
    tl.store(out_ptr + b * s_ob + h * s_oh + dims, res.to(out_ptr.dtype.element_ty))


@functools.lru_cache(maxsize=None)
def _gluon_usable() -> bool:
    """Gluon's API changes between releases: the kernel needs triton >= 3.6."""
    from . import triton_version
    if (triton_version() or (3, 6)) < (3, 6):
        return False
    try:
        from . import gluon_decode  # noqa: F401
    except ImportError:
        return False
    return True


def gluon_supported(q: torch.Tensor, k_cache: torch.Tensor, sliding_window: Optional[int]) -> bool:
    """The Gluon kernel takes bf16, head_dim 128, GQA groups <= 16, no window, sm_90+, compiled."""
    return (q.is_cuda and not triton.knobs.runtime.interpret and sliding_window is None and q.shape[2] == 128
            and q.dtype == k_cache.dtype == torch.bfloat16 and q.shape[1] // k_cache.shape[2] <= 16
            and sm90_or_later(q) and _gluon_usable())


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           sliding_window: Optional[int] = None, num_splits: int = 1, *,
                           out: Optional[torch.Tensor] = None, block_n: Optional[int] = None,
                           num_warps: int = 4, num_stages: int = 2, gluon: bool = False, form: str = "keys",
                           early: bool = False) -> torch.Tensor:
    """q [B, Hq, D]; caches [num_pages, page_size, Hkv, D]; block_tables [B, P] int32; seq_lens [B]
    int32 (incl. the current token, cached) -> [B, Hq, D]. gluon: gluon_decode's kernel in `form`
    ("keys" becomes "heads" beyond one split or GROUP 8); early: its keys form's EARLY."""
    B, Hq, D = q.shape
    _, page_size, Hkv, Dk = k_cache.shape
    assert Dk == D and v_cache.shape == k_cache.shape and Hq % Hkv == 0, "shape mismatch"
    assert D >= 16 and D & (D - 1) == 0, "head_dim must be a power of two >= 16"
    assert page_size & (page_size - 1) == 0, "page_size must be a power of two"
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and block_tables.stride(1) == 1
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()
    if block_n is None:   # fp32 dots run on FMA units: 64-key tiles spill registers
        block_n = 16 if q.dtype == torch.float32 else 64
    assert block_n >= 16 and num_splits >= 1
    if out is None:
        out = torch.empty((B, Hq, D), dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.stride(2) == 1
    if B == 0:
        return out
    group = Hq // Hkv
    po = plse = out     # unused with one split
    if num_splits > 1:   # fp32 partials; torch.empty is graph-safe
        po = torch.empty((B, Hq, num_splits, D), dtype=torch.float32, device=q.device)
        plse = torch.empty((B, Hq, num_splits), dtype=torch.float32, device=q.device)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"     # fp32: no tf32 rounding (~1e-3) in tl.dot
    pdl = pdl_for(q)
    if gluon:
        if not gluon_supported(q, k_cache, sliding_window):
            raise ValueError(f"the Gluon decode kernel takes bf16, head_dim 128, GQA groups <= 16, no window, sm_90+; "
                             f"got {q.dtype}, head_dim {D}, group {group}, window {sliding_window}")
        from .gluon_decode import HEADS, decode_split
        if form == "keys" and (num_splits > 1 or group > HEADS):   # the keys form: one split, GROUP <= 8
            form = "heads"
        decode_split(q, k_cache, v_cache, block_tables, seq_lens, scale * LOG2E, out, po, plse, num_splits,
                     block_n, num_stages, form, pdl=pdl, num_warps=num_warps, early=early)
    else:
        _decode_split_kernel[(B, Hkv, num_splits)](
            q, k_cache, v_cache, block_tables, seq_lens, out, po, plse, scale * LOG2E, int(sliding_window or 0),
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
            v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
            GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=D, PAGE_SIZE=page_size,
            BLOCK_N=block_n, NUM_SPLITS=num_splits, USE_WINDOW=sliding_window is not None, DOT_PREC=prec,
            PDL=pdl, num_warps=num_warps, num_stages=num_stages, launch_pdl=bool(pdl))
    if num_splits > 1:
        _decode_merge_kernel[(B, Hq)](po, plse, out, out.stride(0), out.stride(1), HEAD_DIM=D,
                                      NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
                                      PDL=pdl, num_warps=1 if D <= 64 else 2, launch_pdl=bool(pdl))
    return out
