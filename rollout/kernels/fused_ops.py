"""Fused residual add + RMSNorm and SiLU(gate) * up, one launch each, rounding where torch's eager
ops round (so switching them on moves logprobs by reduction order only)."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import fix_interpreter
from .pdl import enter, pdl_for

fix_interpreter()


@triton.jit
def _add_rmsnorm_kernel(x_ptr, d_ptr, w_ptr, out_ptr, res_ptr, N, eps, s_x, s_d, s_dp, s_o, s_r,
                        HAS_DELTA: tl.constexpr, DELTA_PARTIALS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    x = tl.load(x_ptr + row * s_x + cols, mask=m, other=0.0)
    if HAS_DELTA:
        if DELTA_PARTIALS:   # split-K partials or an MoE's pairs: their sum (in order, fp32) and rounding
            dsum = tl.zeros([BLOCK], tl.float32)
            for sk in tl.static_range(DELTA_PARTIALS):
                dsum += tl.load(d_ptr + sk * s_dp + row * s_d + cols, mask=m, other=0.0).to(tl.float32)
            d = dsum.to(x_ptr.dtype.element_ty)
        else:
            d = tl.load(d_ptr + row * s_d + cols, mask=m, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)   # the residual, rounded
        tl.store(res_ptr + row * s_r + cols, x, mask=m)
    rmsnorm_store(x, w_ptr, out_ptr + row * s_o, cols, m, N, eps)


@triton.jit
def rmsnorm_store(x, w_ptr, out_row_ptr, cols, m, N, eps):
    """Store rmsnorm(x) * w of one row, rounded as HF: the norm in fp32, cast, then times w."""
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt_rn(tl.sum(xf * xf, axis=0) / N + eps)
    y = (xf * inv).to(out_row_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=m, other=0.0)
    tl.store(out_row_ptr + cols, (w.to(tl.float32) * y.to(tl.float32)).to(out_row_ptr.dtype.element_ty), mask=m)


def add_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: Optional[torch.Tensor] = None,
                out: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta [T, N] -> (rmsnorm(r) * weight, r), r = x + delta (or x), in HF's order. delta may be
    [S, T, N] partials summed in fp32 in S order and rounded to x's dtype: a split-K GEMM's fp32 partials
    (as its fix-up would sum them) or an MoE's per-pair outputs (as its combine would). `out`: (normed,
    residual)."""
    T, N = x.shape
    assert x.stride(1) == 1 and weight.is_contiguous() and weight.numel() == N
    parts = delta is not None and delta.dim() == 3
    if parts:
        assert delta.shape[1:] == (T, N) and delta.dtype in (torch.float32, x.dtype) and delta.stride(2) == 1
    out, res = out if out is not None else (torch.empty_like(x), torch.empty_like(x) if delta is not None else x)
    if T:
        block = triton.next_power_of_2(N)
        d = delta if delta is not None else x
        _add_rmsnorm_kernel[(T,)](x, d, weight, out, res, N, eps, x.stride(0), d.stride(-2),
                                  d.stride(0) if parts else 0, out.stride(0), res.stride(0),
                                  HAS_DELTA=delta is not None, DELTA_PARTIALS=delta.shape[0] if parts else 0,
                                  BLOCK=block, PDL=pdl_for(x), num_warps=8 if block >= 4096 else 4,
                                  launch_pdl=bool(pdl_for(x)))
    return out, res


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, s_gu, s_o, BLOCK: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < inter
    g = tl.load(gu_ptr + row * s_gu + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * s_gu + inter + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * s_o + cols, silu_times(g, u, out_ptr.dtype.element_ty), mask=m)


@triton.jit
def silu_times(g, u, dt):
    """silu(g) * u (fp32 in), rounded to dt after each op as torch (shared with the GEMM epilogue)."""
    s = (g / (1.0 + tl.exp(-g))).to(dt)
    return (s.to(tl.float32) * u).to(dt)


def silu_mul(gate_up: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """gate_up [T, 2I] (gate then up, as our fused projection writes them) -> silu(gate) * up."""
    T, inter = gate_up.shape[0], gate_up.shape[1] // 2
    assert gate_up.stride(1) == 1
    if out is None:
        out = torch.empty((T, inter), dtype=gate_up.dtype, device=gate_up.device)
    if T:
        block = 1024
        _silu_mul_kernel[(T, triton.cdiv(inter, block))](gate_up, out, inter, gate_up.stride(0), out.stride(0),
                                                         BLOCK=block, PDL=pdl_for(out), num_warps=4,
                                                         launch_pdl=bool(pdl_for(out)))
    return out
