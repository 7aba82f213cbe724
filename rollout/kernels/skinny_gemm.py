"""y = x @ w.T for a few rows of x (decode: M <= 64), w an nn.Linear weight [N, K]: each program
streams BLOCK_N weight rows over all of K as the MMA's left operand (so a row's bits do not depend
on M; fp32 in K order), optionally split over K (`split_k`, partials added in split order) or with
a SiLU * up epilogue (`silu_mul`). Which config runs at which shape: rollout/layers/linear.py.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import fix_interpreter
from .fused_ops import silu_times
from .pdl import enter, pdl_for

fix_interpreter()


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, s_xm, s_wn, s_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVEN_N: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                        PARTIALS: tl.constexpr, SILU_MUL: tl.constexpr, PDL: tl.constexpr, TILED: tl.constexpr):
    pid = tl.program_id(0)
    if TILED:     # w packed by pack_weight_tiles: this tile's K tiles are one contiguous run
        w_ptr += pid.to(tl.int64) * BLOCK_N * K
    if SILU_MUL:
        rn, w_rows = gate_up_rows(pid, N, BLOCK_N)               # N: the intermediate size
    else:
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        w_rows = rn
    rm = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)     # one M tile except batch_invariant_gemm's
    # This program's K tiles [kt0, kt1): all of K, or its share of a split.
    k_tiles = K // BLOCK_K                       # K % BLOCK_K == 0 (checked by the wrapper)
    per = tl.cdiv(k_tiles, SPLIT_K)
    kt0 = tl.program_id(1) * per
    acc = weight_rows_times_x(x_ptr, w_ptr, w_rows, rn, rm, M, N, s_xm, s_wn, kt0, tl.minimum(kt0 + per, k_tiles),
                              BLOCK_M, BLOCK_N, BLOCK_K, EVEN_N, PDL, TILED)
    if SPLIT_K > 1:
        if PARTIALS:   # the consumer kernel adds them (in split order)
            tl.store(ws_ptr + (tl.program_id(1) * BLOCK_M + rm[None, :]) * N + rn[:, None], acc, mask=rn[:, None] < N)
        else:          # if/else, not an early return: Triton compiles the code after a return too
            acc, last = splitk_fixup(acc, ws_ptr, cnt_ptr, pid, rn, rm, N, BLOCK_M, SPLIT_K)
            if last:
                _epilogue(acc, b_ptr, y_ptr, rm, rn, M, N, s_ym, HAS_BIAS)
    elif SILU_MUL:
        silu_epilogue(acc, y_ptr, pid, rm, M, N, s_ym, BLOCK_M, BLOCK_N)
    else:
        _epilogue(acc, b_ptr, y_ptr, rm, rn, M, N, s_ym, HAS_BIAS)


@triton.jit
def gate_up_rows(tile, I, BLOCK_N: tl.constexpr):
    """SiLU tile `tile`'s gate rows, then the same columns' up rows -> (output column, weight row)."""
    r = tl.arange(0, BLOCK_N)
    cols = tile * (BLOCK_N // 2) + r % (BLOCK_N // 2)
    return cols, cols + (r >= BLOCK_N // 2).to(tl.int32) * I


@triton.jit
def silu_epilogue(acc, y_ptr, tile, rm, M, I, s_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store silu(gate) * up of a gate_up_rows tile's acc as y[rm, cols] (fused_ops.silu_mul's bits)."""
    dt = y_ptr.dtype.element_ty
    g, u = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N // 2, BLOCK_M)), (1, 2, 0)))
    cols = tile * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    y = silu_times(g.to(dt).to(tl.float32), u.to(dt).to(tl.float32), dt)
    tl.store(y_ptr + rm.to(tl.int64)[None, :] * s_ym + cols[:, None], y, mask=(rm[None, :] < M) & (cols[:, None] < I))


@triton.jit
def splitk_fixup(acc, ws_ptr, cnt_ptr, tile, cols, rm, N, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr):
    """Store this program's fp32 partial of tile `tile`; the last of its SPLIT_K programs to arrive
    (an arrival counter it resets) adds them in split order. -> (the sum, or acc; is_last)."""
    n_ok = cols[:, None] < N
    tl.store(ws_ptr + (tl.program_id(1) * BLOCK_M + rm[None, :]) * N + cols[:, None], acc, mask=n_ok)
    tl.debug_barrier()                        # every thread's partial before the release
    last = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1
    if last:
        acc = tl.zeros_like(acc)
        for sk in range(SPLIT_K):              # .cg: from L2, where the other SMs wrote
            acc += tl.load(ws_ptr + (sk * BLOCK_M + rm[None, :]) * N + cols[:, None], mask=n_ok, other=0.0,
                           cache_modifier=".cg")
        tl.atomic_xchg(cnt_ptr + tile, 0)
    return acc, last


@triton.jit
def weight_rows_times_x(x_ptr, w_ptr, w_rows, rn, rm, M, N, s_xm, s_wn, kt0, kt1, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, PDL: tl.constexpr,
                        TILED: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] = w[w_rows] @ x[rm].T over K tiles [kt0, kt1), the first weight tile
    loaded before the PDL wait. TILED: w points at this tile's packed run (w_rows, s_wn unused)."""
    rk = tl.arange(0, BLOCK_K)
    if TILED:
        W_KT: tl.constexpr = BLOCK_N * BLOCK_K
        w_ptrs = w_ptr + kt0.to(tl.int64) * W_KT + tl.arange(0, BLOCK_N)[:, None] * BLOCK_K + rk[None, :]
    else:
        W_KT: tl.constexpr = BLOCK_K
        w_ptrs = w_ptr + w_rows.to(tl.int64)[:, None] * s_wn + (kt0 * BLOCK_K + rk)[None, :]
    x_ptrs = x_ptr + rm.to(tl.int64)[:, None] * s_xm + (kt0 * BLOCK_K + rk)[None, :]
    m_ok = rm[:, None] < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if PDL:
        w = _load_w(w_ptrs, rn, N, EVEN_N)
        enter(PDL)
        acc = tl.dot(w, tl.trans(tl.load(x_ptrs, mask=m_ok, other=0.0)), acc)
        w_ptrs += W_KT
        x_ptrs += BLOCK_K
        kt0 += 1
    for _ in range(kt0, kt1):
        w = _load_w(w_ptrs, rn, N, EVEN_N)
        x = tl.load(x_ptrs, mask=m_ok, other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
        w_ptrs += W_KT
        x_ptrs += BLOCK_K
    return acc


@triton.jit
def _load_w(w_ptrs, rn, N, EVEN_N: tl.constexpr):
    if EVEN_N:
        return tl.load(w_ptrs)
    return tl.load(w_ptrs, mask=rn[:, None] < N, other=0.0)


@triton.jit
def _epilogue(acc, b_ptr, y_ptr, rm, rn, M, N, s_ym, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:      # in fp32 before the one rounding, like cuBLAS's bias epilogue
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + rm.to(tl.int64)[None, :] * s_ym + rn[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rm[None, :] < M) & (rn[:, None] < N))


MAX_M = 64          # rows of one M tile: the decode path's limit


def pick_block_m(M: int) -> int:
    """The MMA needs >= 16 rows; round M up to a power of two so few variants compile."""
    return max(16, triton.next_power_of_2(M))


def pack_weight_tiles(w: torch.Tensor, block_n: int, block_k: int, order: str = "rows", head_dim: int = 0,
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """w [N, K] -> [tiles, k_tiles, block_n, block_k] (into `out` in place if given): each program's
    weight tiles as one contiguous run in read order. The program's rows, by `order`: "rows"
    consecutive (skinny_gemm); "silu" block_n / 2 gate rows then the same up rows (silu_mul);
    "rope" block_n / 2 frequency pairs of one head, first halves then second (the QKV kernel)."""
    N, K = w.shape
    kt = K // block_k
    assert K % block_k == 0 and N % block_n == 0, f"[{N}, {K}] does not make {block_n} x {block_k} tiles"
    if out is None:
        out = torch.empty((N // block_n, kt, block_n, block_k), dtype=w.dtype, device=w.device)
    assert out.shape == (N // block_n, kt, block_n, block_k) and out.is_contiguous() and out.dtype == w.dtype
    if order == "rows":
        out.copy_(w.view(N // block_n, block_n, kt, block_k).permute(0, 2, 1, 3))
    elif order == "silu":            # rows [gate (N / 2) | up (N / 2)]
        h = block_n // 2
        out.view(N // block_n, kt, 2, h, block_k).copy_(w.view(2, N // block_n, h, kt, block_k).permute(1, 3, 0, 2, 4))
    elif order == "rope":            # row = head * D + half_index * D / 2 + pair_block * P + pair
        pairs, half = block_n // 2, head_dim // 2
        assert head_dim and half % pairs == 0 and N % head_dim == 0, "rope: tiles of whole pair blocks of a head"
        shape = (N // head_dim, 2, half // pairs, pairs, kt, block_k)
        out.view(N // head_dim, half // pairs, kt, 2, pairs, block_k).copy_(w.view(shape).permute(0, 2, 4, 1, 3, 5))
    else:
        raise ValueError(f"unknown packing order {order!r}")
    return out


def packed_as_rows(w: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """A pack_weight_tiles weight viewed [N, K], the plain weight's shape, for the wrappers."""
    assert w.dim() == 4 and w.shape[2:] == (block_n, block_k) and w.is_contiguous(), \
        "tiled: a pack_weight_tiles weight of this config"
    return w.view(w.shape[0] * block_n, w.shape[1] * block_k)


_COUNTERS: dict = {}     # device -> int32 arrival counters (zero between calls)


def split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """One zeroed counter per output tile (`splitk_fixup` resets it), one buffer per device, made on
    the first eager call; split-K calls on one device must not overlap on two streams."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < tiles:
        if torch.cuda.is_available() and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("split-K GEMM: run this shape once eagerly before capturing a CUDA graph")
        buf = _COUNTERS[device] = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
    return buf


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int, num_warps: int = 4,
                num_stages: int = 4, split_k: int = 1, out: Optional[torch.Tensor] = None,
                bias: Optional[torch.Tensor] = None, block_m: Optional[int] = None,
                partials: bool = False, silu_mul: bool = False, tiled: bool = False) -> torch.Tensor:
    """x [M, K] (unit stride in K), w [N, K] contiguous, bias [N] or None -> y [M, N] in x's dtype.
    block_m: None = one M tile (M <= 64), else tiles of block_m rows. partials: return the fp32
    split-K partials [split_k, M, N] for add_rmsnorm to sum. silu_mul: w is the fused gate_up weight
    [2I, K] -> silu(gate) * up [M, I]. tiled: w is pack_weight_tiles(weight, block_n, block_k, order)."""
    if tiled:
        assert block_m is None, "tiled: decode rows (one M tile)"
        w = packed_as_rows(w, block_n, block_k)
    M, K = x.shape
    N = w.shape[0] // 2 if silu_mul else w.shape[0]
    assert not silu_mul or (split_k == 1 and bias is None and not partials and w.shape[0] % 2 == 0
                            and block_n >= 2), "silu_mul: no split-K, bias or partials; an even weight"
    assert not partials or (split_k > 1 and bias is None and out is None), "partials: split-K, no bias, no out"
    assert (M <= MAX_M or block_m) and w.shape[1] == K and x.stride(1) == 1 and w.is_contiguous()
    assert split_k == 1 or triton.cdiv(M, block_m or MAX_M) == 1, "split-K takes one M tile"
    assert K % block_k == 0, f"K={K} is not a multiple of BLOCK_K={block_k}"
    assert split_k >= 1 and (K // block_k) % split_k == 0, f"{K // block_k} K tiles do not split {split_k} ways"
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    cols_per_tile = block_n // 2 if silu_mul else block_n
    bm, tiles = block_m or pick_block_m(M), triton.cdiv(N, cols_per_tile)
    ws = torch.empty((split_k, bm, N), dtype=torch.float32, device=x.device) if split_k > 1 else out
    if M:
        pdl = pdl_for(x)
        cnt = split_counters(x.device, tiles) if split_k > 1 and not partials else out   # else unused
        _skinny_gemm_kernel[(tiles, split_k, triton.cdiv(M, bm))](
            x, w, bias if bias is not None else w, out, ws, cnt, M, N, K, x.stride(0), w.stride(0), out.stride(0),
            BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_N=N % cols_per_tile == 0, HAS_BIAS=bias is not None,
            SPLIT_K=split_k, PARTIALS=partials, SILU_MUL=silu_mul, PDL=pdl, TILED=tiled, num_warps=num_warps,
            num_stages=num_stages, launch_pdl=bool(pdl))
    return ws[:, :M] if partials else out
