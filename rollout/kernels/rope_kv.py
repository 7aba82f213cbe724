"""Fused RoPE on q and k plus the K/V write into the page pool, rounded as `DecoderLM.rope` +
`apply_rope` + `write_kv` round (fp32 angles; cos/sin, products and sums in the activation dtype).
Grid (token, 1 + q head groups): program 0 rotates K and writes K and V. Tokens past
slot_mapping's length or with a negative slot (graph padding) are not written.
`qkv_rope_and_write_kv` does the same in the QKV skinny GEMM's epilogue, with the same bits.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import fix_interpreter
from .pdl import enter, pdl_for
from .skinny_gemm import packed_as_rows, split_counters, splitk_fixup, weight_rows_times_x

fix_interpreter()

PRECISE = tl.constexpr(not triton.knobs.runtime.interpret)   # libdevice cos/sin: full range reduction
Q_HEADS_PER_PROGRAM = 8   # a power of two


@triton.jit
def cos_sin(pos, inv_freq_ptr, f, dt, PRECISE: tl.constexpr):
    """cos and sin of pos * inv_freq[f] (fp32, broadcast), rounded to dt as torch does; fp32 out."""
    ang = pos.to(tl.float32) * tl.load(inv_freq_ptr + f)
    if PRECISE:
        c = libdevice.cos(ang)
        s = libdevice.sin(ang)
    else:
        c = tl.cos(ang)
        s = tl.sin(ang)
    return c.to(dt).to(tl.float32), s.to(dt).to(tl.float32)


@triton.jit
def rotate_halves(x1, x2, c, s, dt):
    """x * cos + rotate_half(x) * sin on the two halves, each product and sum rounded to dt."""
    a1 = (x1 * c).to(dt).to(tl.float32)
    b1 = (x2 * s).to(dt).to(tl.float32)
    a2 = (x2 * c).to(dt).to(tl.float32)
    b2 = (x1 * s).to(dt).to(tl.float32)
    return (a1 - b1).to(dt), (a2 + b2).to(dt)


@triton.jit
def _rotate(x_ptr, o_ptr, heads, h_ok, f, c, s, HALF: tl.constexpr, s_xh, s_oh, n_ptr, eps, NORM: tl.constexpr):
    """Rotate-half RoPE on rows `heads` of one token, stored to o_ptr. NORM: each row RMS-normed first
    with the head_dim weights at n_ptr (Qwen3's QK-norm), rounded as decoder.RMSNorm rounds."""
    m = h_ok[:, None]
    dt = o_ptr.dtype.element_ty
    x1 = tl.load(x_ptr + heads[:, None] * s_xh + f[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + heads[:, None] * s_xh + HALF + f[None, :], mask=m, other=0.0).to(tl.float32)
    if NORM:
        inv = 1.0 / tl.sqrt_rn((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
        w1 = tl.load(n_ptr + f).to(tl.float32)[None, :]
        w2 = tl.load(n_ptr + HALF + f).to(tl.float32)[None, :]
        x1 = (w1 * (x1 * inv[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        x2 = (w2 * (x2 * inv[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    o1, o2 = rotate_halves(x1, x2, c, s, dt)
    tl.store(o_ptr + heads[:, None] * s_oh + f[None, :], o1, mask=m)
    tl.store(o_ptr + heads[:, None] * s_oh + HALF + f[None, :], o2, mask=m)


@triton.jit(do_not_specialize=["n_slots"])   # = the step's token count in eager steps: one kernel for all
def _rope_kv_kernel(
        q_ptr, k_ptr, v_ptr, qo_ptr, pos_ptr, inv_freq_ptr, kc_ptr, vc_ptr, slot_ptr, qn_ptr, kn_ptr, eps, n_slots,
        s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_qot, s_qoh, s_kcs, s_kch, s_vcs, s_vch,
        HQ: tl.constexpr, HKV: tl.constexpr, Q_HEADS: tl.constexpr, HKV_PAD: tl.constexpr,
        HALF: tl.constexpr, QK_NORM: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    t = tl.program_id(0)
    part = tl.program_id(1)
    dt = qo_ptr.dtype.element_ty
    f = tl.arange(0, HALF)
    c, s = cos_sin(tl.load(pos_ptr + t), inv_freq_ptr, f, dt, PRECISE)
    c, s = c[None, :], s[None, :]
    t64 = t.to(tl.int64)

    if part > 0:
        hq = (part - 1) * Q_HEADS + tl.arange(0, Q_HEADS)
        _rotate(q_ptr + t64 * s_qt, qo_ptr + t64 * s_qot, hq, hq < HQ, f, c, s, HALF, s_qh, s_qoh, qn_ptr, eps,
                QK_NORM)
    else:   # K/V -> cache. slot_mapping may be shorter than T; negative slots are skipped.
        slot = tl.load(slot_ptr + t, mask=t < n_slots, other=-1)
        hk = tl.arange(0, HKV_PAD)
        ok = (hk < HKV) & (slot >= 0)
        _rotate(k_ptr + t64 * s_kt, kc_ptr + slot * s_kcs, hk, ok, f, c, s, HALF, s_kh, s_kch, kn_ptr, eps, QK_NORM)
        d = tl.arange(0, 2 * HALF)
        v = tl.load(v_ptr + t64 * s_vt + hk[:, None] * s_vh + d[None, :], mask=ok[:, None])
        tl.store(vc_ptr + slot * s_vcs + hk[:, None] * s_vch + d[None, :], v, mask=ok[:, None])


def rope_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, *, out_q: Optional[torch.Tensor] = None,
                      qk_norm: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] (strided views fine); positions [T]; inv_freq [D/2] fp32; caches
    [num_pages, page_size, Hkv, D]; slot_mapping [n] int64 -> RoPE'd q (`out_q=q`: in place).
    qk_norm: (q weight [D], k weight [D], eps): q and k RMS-normed per head before RoPE (Qwen3)."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    assert D % 2 == 0 and (D // 2) & (D // 2 - 1) == 0 and inv_freq.numel() == D // 2, "head_dim / inv_freq"
    assert k.shape == v.shape == (T, Hkv, D) and k_cache.shape[2:] == (Hkv, D) and v_cache.shape == k_cache.shape
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1 and k_cache.stride(3) == v_cache.stride(3) == 1
    # slot * stride(1) addresses [page, offset] only if a page is page_size contiguous rows.
    assert k_cache.stride(0) == k_cache.shape[1] * k_cache.stride(1)
    assert v_cache.stride(0) == v_cache.shape[1] * v_cache.stride(1)
    assert slot_mapping.dtype == torch.int64 and slot_mapping.numel() <= T
    if out_q is None:
        out_q = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    if T == 0:
        return out_q
    if qk_norm is not None:
        assert all(w.numel() == D and w.is_contiguous() for w in qk_norm[:2]), "qk_norm weights: [head_dim]"
    qn, kn, eps = qk_norm if qk_norm is not None else (q, k, 0.0)     # unread without QK_NORM
    q_heads = min(triton.next_power_of_2(Hq), Q_HEADS_PER_PROGRAM)
    _rope_kv_kernel[(T, 1 + triton.cdiv(Hq, q_heads))](
        q, k, v, out_q, positions, inv_freq.float().contiguous(), k_cache, v_cache, slot_mapping, qn, kn, float(eps),
        slot_mapping.numel(),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out_q.stride(0), out_q.stride(1), k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        HQ=Hq, HKV=Hkv, Q_HEADS=q_heads, HKV_PAD=triton.next_power_of_2(Hkv), HALF=D // 2,
        QK_NORM=qk_norm is not None, PRECISE=PRECISE, PDL=pdl_for(q),
        num_warps=4 if max(q_heads, Hkv) * D >= 1024 else 1, launch_pdl=bool(pdl_for(q)),
        enable_fp_fusion=False)   # no mul+add -> FMA: torch's fp32 path rounds the products
    return out_q


@triton.jit
def _qkv_rope_kernel(
        x_ptr, w_ptr, qo_ptr, pos_ptr, inv_freq_ptr, kc_ptr, vc_ptr, slot_ptr, ws_ptr, cnt_ptr, n_slots, M, K,
        s_xm, s_wn, s_qot, s_qoh, s_kcs, s_kch, s_vcs, s_vch,
        HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr, TILED: tl.constexpr):
    P: tl.constexpr = BLOCK_N // 2              # frequency pairs per program
    pid = tl.program_id(0)
    if TILED:     # w packed by pack_weight_tiles (order "rope"): this program's run
        w_ptr += pid.to(tl.int64) * BLOCK_N * K
    head = pid // (HALF // P)                    # q heads, then k heads, then v heads
    f = (pid % (HALF // P)) * P + tl.arange(0, P)
    r = tl.arange(0, BLOCK_N)
    w_rows = head * 2 * HALF + (pid % (HALF // P)) * P + r % P + (r >= P).to(tl.int32) * HALF   # halves 1, 2
    rm = tl.arange(0, BLOCK_M)
    N = (HQ + 2 * HKV) * 2 * HALF
    per = tl.cdiv(K // BLOCK_K, SPLIT_K)         # this program's K tiles, as in the skinny GEMM
    kt0 = tl.program_id(1) * per
    acc = weight_rows_times_x(x_ptr, w_ptr, w_rows, w_rows, rm, M, N, s_xm, s_wn,
                              kt0, tl.minimum(kt0 + per, K // BLOCK_K), BLOCK_M, BLOCK_N, BLOCK_K, True, PDL, TILED)
    last = True
    if SPLIT_K > 1:   # the tile's last split program sums the partials (skinny_gemm's order) and goes on
        acc, last = splitk_fixup(acc, ws_ptr, cnt_ptr, pid, w_rows, rm, N, BLOCK_M, SPLIT_K)
    if last:
        _rope_epilogue(acc, qo_ptr, pos_ptr, inv_freq_ptr, kc_ptr, vc_ptr, slot_ptr, n_slots, M, head, f, rm,
                       s_qot, s_qoh, s_kcs, s_kch, s_vcs, s_vch, HQ, HKV, HALF, BLOCK_M, P, PRECISE)


@triton.jit
def _rope_epilogue(acc, qo_ptr, pos_ptr, inv_freq_ptr, kc_ptr, vc_ptr, slot_ptr, n_slots, M, head, f, rm,
                   s_qot, s_qoh, s_kcs, s_kch, s_vcs, s_vch, HQ: tl.constexpr, HKV: tl.constexpr,
                   HALF: tl.constexpr, BLOCK_M: tl.constexpr, P: tl.constexpr, PRECISE: tl.constexpr):
    """acc [2P, BLOCK_M] of head `head` rounded as stored, then q rotated, k rotated and cached, or v cached."""
    dt = qo_ptr.dtype.element_ty
    x1, x2 = tl.split(tl.permute(tl.reshape(acc, (2, P, BLOCK_M)), (1, 2, 0)))     # [P, BLOCK_M] halves
    x1 = x1.to(dt).to(tl.float32)                # as the GEMM would store them
    x2 = x2.to(dt).to(tl.float32)
    m_ok = rm[None, :] < M
    slot = tl.load(slot_ptr + rm, mask=(rm < n_slots) & (rm < M), other=-1)[None, :]   # k, v programs use it
    if head < HQ + HKV:
        c, s = cos_sin(tl.load(pos_ptr + rm, mask=rm < M, other=0)[None, :], inv_freq_ptr, f[:, None], dt, PRECISE)
        o1, o2 = rotate_halves(x1, x2, c, s, dt)
        if head < HQ:
            qp = qo_ptr + rm.to(tl.int64)[None, :] * s_qot + head * s_qoh + f[:, None]
            tl.store(qp, o1, mask=m_ok)
            tl.store(qp + HALF, o2, mask=m_ok)
        else:
            kp = kc_ptr + slot * s_kcs + (head - HQ) * s_kch + f[:, None]
            tl.store(kp, o1, mask=slot >= 0)
            tl.store(kp + HALF, o2, mask=slot >= 0)
    else:
        vp = vc_ptr + slot * s_vcs + (head - HQ - HKV) * s_vch + f[:, None]
        tl.store(vp, x1.to(dt), mask=slot >= 0)
        tl.store(vp + HALF, x2.to(dt), mask=slot >= 0)


def qkv_rope_and_write_kv(x: torch.Tensor, w: torch.Tensor, num_heads: int, positions: torch.Tensor,
                          inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, block_n: int, block_k: int, num_warps: int = 4,
                          num_stages: int = 4, split_k: int = 1, tiled: bool = False) -> torch.Tensor:
    """skinny_gemm(x [T <= 64, K], w [(Hq + 2 Hkv) D, K]) then rope_and_write_kv, in one kernel ->
    RoPE'd q [T, Hq, D]. tiled: w is pack_weight_tiles(weight, block_n, block_k, "rope", D)."""
    T, K = x.shape
    Hkv, D = k_cache.shape[2], k_cache.shape[3]
    half, pairs = D // 2, block_n // 2
    if tiled:
        w = packed_as_rows(w, block_n, block_k)
    assert w.shape == ((num_heads + 2 * Hkv) * D, K) and w.is_contiguous() and x.stride(1) == 1 and T <= 64
    assert K % block_k == 0 and half % pairs == 0 and inv_freq.numel() == half, "tile / head_dim"
    assert split_k >= 1 and (K // block_k) % split_k == 0, f"{K // block_k} K tiles do not split {split_k} ways"
    assert k_cache.stride(0) == k_cache.shape[1] * k_cache.stride(1) and v_cache.shape == k_cache.shape
    assert v_cache.stride(0) == v_cache.shape[1] * v_cache.stride(1) and k_cache.stride(3) == v_cache.stride(3) == 1
    assert slot_mapping.dtype == torch.int64 and slot_mapping.numel() <= T
    out_q = torch.empty((T, num_heads, D), dtype=x.dtype, device=x.device)
    if T == 0:
        return out_q
    pdl = pdl_for(x)
    tiles, bm = (num_heads + 2 * Hkv) * (half // pairs), max(16, triton.next_power_of_2(T))
    ws = cnt = out_q   # unused without split-K
    if split_k > 1:   # fp32 partials [split, row tile, N]; torch.empty is graph-safe
        ws = torch.empty((split_k, bm, w.shape[0]), dtype=torch.float32, device=x.device)
        cnt = split_counters(x.device, tiles)
    _qkv_rope_kernel[(tiles, split_k)](
        x, w, out_q, positions, inv_freq.float().contiguous(), k_cache, v_cache, slot_mapping, ws, cnt,
        slot_mapping.numel(),
        T, K, x.stride(0), w.stride(0), out_q.stride(0), out_q.stride(1), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(1), v_cache.stride(2), HQ=num_heads, HKV=Hkv, HALF=half,
        BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, PRECISE=PRECISE, PDL=pdl, TILED=tiled,
        num_warps=num_warps, num_stages=num_stages, launch_pdl=bool(pdl),
        enable_fp_fusion=False)   # the rotation rounds each product, as rope_and_write_kv (the MMA is unaffected)
    return out_q
