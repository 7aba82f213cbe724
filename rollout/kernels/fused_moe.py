"""Fused mixture-of-experts MLP: y[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = ids[t, j].

    moe_align    one program: the T*k (token, expert) pairs sorted by expert (stable), each expert's run
                 padded to BLOCK_M, and the expert of every BLOCK_M block; padding slots hold T*k
    gate_up      grouped GEMM over the sorted blocks, silu(gate) * up in its epilogue -> [T*k, I] by pair
    down         grouped GEMM, times the routing weight in its epilogue -> [T*k, H] by pair
    combine      sum over each token's k pairs in pair order (deterministic; no atomics)

Every buffer and grid is sized from T alone (the sorted buffer holds T*k + E*(BLOCK_M - 1) slots, the most
any routing pads to; blocks past the padded total exit at once), and nothing reads back to the host, so a
step with it can be captured in a CUDA graph. Which tiles run at which shape: rollout/layers/moe.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import fix_interpreter
from .fused_ops import silu_times

fix_interpreter()


@triton.jit
def _moe_align_kernel(ids_ptr, sorted_ptr, expert_ptr, npost_ptr, N, E, SLOTS, BLOCKS,
                      BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    experts = tl.arange(0, E_PAD)
    lane = tl.arange(0, CHUNK)
    counts = tl.zeros([E_PAD], tl.int32)
    for c0 in range(0, N, CHUNK):
        ids = tl.load(ids_ptr + c0 + lane, mask=c0 + lane < N, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    tl.store(npost_ptr, total)
    for b0 in range(0, BLOCKS, CHUNK):     # block b's expert: how many experts' runs end at or before it
        b = b0 + lane
        owner = tl.sum((ends[None, :] <= b[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(expert_ptr + b, tl.minimum(owner, E), mask=b < BLOCKS)
    for s0 in range(0, SLOTS, CHUNK):
        tl.store(sorted_ptr + s0 + lane, N, mask=s0 + lane < SLOTS)
    tl.debug_barrier()                     # the padding fill lands before the scatter over it
    base = ends - padded                   # next free slot of each expert's run
    for c0 in range(0, N, CHUNK):
        ids = tl.load(ids_ptr + c0 + lane, mask=c0 + lane < N, other=-1).to(tl.int32)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        rank = tl.sum((tl.cumsum(onehot, axis=0) - onehot) * onehot, axis=1)    # same expert, earlier in chunk
        slot = tl.sum(base[None, :] * onehot, axis=1) + rank
        tl.store(sorted_ptr + slot, c0 + lane, mask=c0 + lane < N)
        base += tl.sum(onehot, axis=0)


@triton.jit
def _block_pairs(sorted_ptr, expert_ptr, npost_ptr, N, BLOCK_M: tl.constexpr):
    """(this block's expert, its pair ids, which are real pairs, live block) for program_id(0)."""
    pid = tl.program_id(0)
    pairs = tl.load(sorted_ptr + pid * BLOCK_M + tl.arange(0, BLOCK_M))
    return tl.load(expert_ptr + pid).to(tl.int64), pairs, pairs < N, pid * BLOCK_M < tl.load(npost_ptr)


@triton.jit
def _moe_gate_up_kernel(x_ptr, w_ptr, y_ptr, sorted_ptr, expert_ptr, npost_ptr, N, I, H, TOP_K,
                        s_xm, s_we, s_wn, s_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    e, pairs, ok, live = _block_pairs(sorted_ptr, expert_ptr, npost_ptr, N, BLOCK_M)
    if live:
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < I
        x_ptrs = x_ptr + (pairs // TOP_K).to(tl.int64)[:, None] * s_xm + rk[None, :]
        g_ptrs = w_ptr + e * s_we + rn.to(tl.int64)[None, :] * s_wn + rk[:, None]     # gate rows, [BLOCK_K, BLOCK_N]
        u_ptrs = g_ptrs + I * s_wn                                                   # the same columns' up rows
        gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k_ok = rk < H - k0
            x = tl.load(x_ptrs, mask=ok[:, None] & k_ok[None, :], other=0.0)
            gate = tl.dot(x, tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0), gate)
            up = tl.dot(x, tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0), up)
            x_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        dt = y_ptr.dtype.element_ty     # rounded where torch's eager gate_up, silu and mul round
        y = silu_times(gate.to(dt).to(tl.float32), up.to(dt).to(tl.float32), dt)
        tl.store(y_ptr + pairs.to(tl.int64)[:, None] * s_ym + rn[None, :], y, mask=ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_down_kernel(a_ptr, w_ptr, y_ptr, topw_ptr, sorted_ptr, expert_ptr, npost_ptr, N, H, I,
                     s_am, s_we, s_wn, s_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    e, pairs, ok, live = _block_pairs(sorted_ptr, expert_ptr, npost_ptr, N, BLOCK_M)
    if live:
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < H
        a_ptrs = a_ptr + pairs.to(tl.int64)[:, None] * s_am + rk[None, :]
        w_ptrs = w_ptr + e * s_we + rn.to(tl.int64)[None, :] * s_wn + rk[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k_ok = rk < I - k0
            a = tl.load(a_ptrs, mask=ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(a, tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0), acc)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        acc *= tl.load(topw_ptr + pairs, mask=ok, other=0.0)[:, None]
        tl.store(y_ptr + pairs.to(tl.int64)[:, None] * s_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=ok[:, None] & n_ok[None, :])


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (sorted pair ids [T*k + E*(block_m - 1)], expert of each block, padded total [1])."""
    n = ids.numel()
    slots = n + num_experts * (block_m - 1)
    blocks = triton.cdiv(slots, block_m)
    sorted_ids = torch.empty(blocks * block_m, dtype=torch.int32, device=ids.device)
    expert_ids = torch.empty(blocks, dtype=torch.int32, device=ids.device)
    npost = torch.empty(1, dtype=torch.int32, device=ids.device)
    _moe_align_kernel[(1,)](ids.contiguous(), sorted_ids, expert_ids, npost, n, num_experts, blocks * block_m, blocks,
                            BLOCK_M=block_m, E_PAD=triton.next_power_of_2(num_experts), CHUNK=64)
    return sorted_ids, expert_ids, npost


def fused_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
              w_down: torch.Tensor, config: tuple[int, int, int, int, int]) -> torch.Tensor:
    """x [T, H]; weights (fp32), ids [T, k]; w_gate_up [E, 2I, H], w_down [E, H, I];
    config (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) -> [T, H] in x's dtype."""
    T, H = x.shape
    E, I = w_gate_up.shape[0], w_down.shape[2]
    top_k = ids.shape[1]
    bm, bn, bk, warps, stages = config
    assert x.stride(1) == 1 and w_gate_up.is_contiguous() and w_down.is_contiguous()
    sorted_ids, expert_ids, npost = moe_align(ids, E, bm)
    blocks, n = expert_ids.numel(), T * top_k
    act = torch.empty(n, I, dtype=x.dtype, device=x.device)
    _moe_gate_up_kernel[(blocks, triton.cdiv(I, bn))](
        x, w_gate_up, act, sorted_ids, expert_ids, npost, n, I, H, top_k, x.stride(0), w_gate_up.stride(0),
        w_gate_up.stride(1), act.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    out = torch.empty(n, H, dtype=x.dtype, device=x.device)
    _moe_down_kernel[(blocks, triton.cdiv(H, bn))](
        act, w_down, out, weights.float().contiguous(), sorted_ids, expert_ids, npost, n, H, I, act.stride(0),
        w_down.stride(0), w_down.stride(1), out.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
        num_stages=stages)
    return out.view(T, top_k, H).sum(1, dtype=torch.float32).to(x.dtype)
