"""Fused mixture-of-experts MLP: y[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = ids[t, j].

    route        the router's softmax (fp32), top-k and renormalisation in one launch
    moe_align    the T*k (token, expert) pairs sorted by expert (stable), each expert's run padded to
                 BLOCK_M, and the expert of every BLOCK_M block; padding slots hold T*k. Decode sizes
                 take one program, prefill sizes count and scatter in parallel
    gate_up      grouped GEMM over the sorted blocks, silu(gate) * up in its epilogue -> [T*k, I] by pair
    down         grouped GEMM, times the routing weight in its epilogue -> [T*k, H] by pair
    combine      sum over each token's k pairs in pair order (deterministic; no atomics), here or in the
                 next residual add + RMSNorm (`combine=False`)

Every buffer and grid is sized from T alone (the sorted buffer holds T*k + E*(BLOCK_M - 1) slots, the most
any routing pads to; blocks past the padded total exit at once), and nothing reads back to the host, so a
step with it can be captured in a CUDA graph. Which tiles run at which shape: rollout/layers/moe.py.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import fix_interpreter
from .fused_ops import silu_times

fix_interpreter()


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, E, s_l, s_w, s_i, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                  RENORM: tl.constexpr, E_PAD: tl.constexpr):
    """One token: softmax over its E logits in fp32, the top-k (highest first; the lowest expert id of a
    tie), renormalised if asked, rounded to the logits' dtype as transformers rounds them."""
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, E_PAD)
    logits = tl.load(logits_ptr + row * s_l + experts, mask=experts < E, other=-float("inf")).to(tl.float32)
    num = tl.exp(logits - tl.max(logits, axis=0))
    probs = num / tl.sum(num, axis=0)
    slots = tl.arange(0, K_PAD)
    top_w = tl.zeros([K_PAD], tl.float32)
    top_i = tl.zeros([K_PAD], tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, axis=0)
        idx = tl.min(tl.where(probs == best, experts, E_PAD), axis=0)
        top_w = tl.where(slots == j, best, top_w)
        top_i = tl.where(slots == j, idx, top_i)
        probs = tl.where(experts == idx, -1.0, probs)
    if RENORM:
        top_w = top_w / tl.sum(top_w, axis=0)
    top_w = top_w.to(logits_ptr.dtype.element_ty).to(tl.float32)
    tl.store(w_ptr + row * s_w + slots, top_w, mask=slots < TOP_K)
    tl.store(ids_ptr + row * s_i + slots, top_i.to(ids_ptr.dtype.element_ty), mask=slots < TOP_K)


@triton.jit(do_not_specialize=["N"])   # the pair and block counts vary per step: one kernel for all
def _moe_count_kernel(ids_ptr, counts_ptr, N, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """counts[c, e]: pairs of chunk c routed to expert e."""
    c = tl.program_id(0)
    pairs = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + pairs, mask=pairs < N, other=-1).to(tl.int32)
    experts = tl.arange(0, E_PAD)
    tl.store(counts_ptr + c * E_PAD + experts, tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0))


@triton.jit
def _expert_runs(total, sorted_ptr, expert_ptr, npost_ptr, N, E, BLOCKS, BLOCK_M: tl.constexpr, ROWS: tl.constexpr):
    """From each expert's pair count: its run padded to BLOCK_M (the padding slots get N), the padded
    total, the expert of every block (E past the padded total). Returns each run's first slot."""
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(npost_ptr, tl.sum(padded, axis=0))
    base = ends - padded
    pad = tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + (base + total)[:, None] + pad[None, :], N, mask=pad[None, :] < (padded - total)[:, None])
    rows = tl.arange(0, ROWS)
    for b0 in range(0, BLOCKS, ROWS):    # block b's expert: how many experts' runs end at or before it
        b = b0 + rows
        owner = tl.sum((ends[None, :] <= b[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(expert_ptr + b, tl.minimum(owner, E), mask=b < BLOCKS)
    return base


@triton.jit(do_not_specialize=["N", "CHUNKS", "BLOCKS"])
def _moe_offsets_kernel(counts_ptr, sorted_ptr, expert_ptr, npost_ptr, N, E, CHUNKS, BLOCKS, BLOCK_M: tl.constexpr,
                        E_PAD: tl.constexpr, ROWS: tl.constexpr):
    """One program: the expert runs from the chunks' counts; counts[c, e] becomes the first slot of
    chunk c's pairs of expert e."""
    experts = tl.arange(0, E_PAD)
    rows = tl.arange(0, ROWS)
    total = tl.zeros([E_PAD], tl.int32)
    for r0 in range(0, CHUNKS, ROWS):
        total += tl.sum(tl.load(counts_ptr + (r0 + rows)[:, None] * E_PAD + experts[None, :],
                                mask=(r0 + rows)[:, None] < CHUNKS, other=0), axis=0)
    base = _expert_runs(total, sorted_ptr, expert_ptr, npost_ptr, N, E, BLOCKS, BLOCK_M, ROWS)
    for r0 in range(0, CHUNKS, ROWS):
        ptrs = counts_ptr + (r0 + rows)[:, None] * E_PAD + experts[None, :]
        ok = (r0 + rows)[:, None] < CHUNKS
        counts = tl.load(ptrs, mask=ok, other=0)
        tl.store(ptrs, base[None, :] + tl.cumsum(counts, axis=0) - counts, mask=ok)
        base += tl.sum(counts, axis=0)


@triton.jit(do_not_specialize=["N", "BLOCKS"])
def _moe_align_one_kernel(ids_ptr, sorted_ptr, expert_ptr, npost_ptr, N, E, BLOCKS, BLOCK_M: tl.constexpr,
                          E_PAD: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr):
    """moe_align in one program (decode sizes: a few chunks, where three launches cost more than the work):
    count, the expert runs, then each chunk's pairs to their slots."""
    experts = tl.arange(0, E_PAD)
    total = tl.zeros([E_PAD], tl.int32)
    for c0 in range(0, N, CHUNK):
        pairs = c0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + pairs, mask=pairs < N, other=-1).to(tl.int32)
        total += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    base = _expert_runs(total, sorted_ptr, expert_ptr, npost_ptr, N, E, BLOCKS, BLOCK_M, ROWS)
    for c0 in range(0, N, CHUNK):
        pairs = c0 + tl.arange(0, CHUNK)
        ok = pairs < N
        ids = tl.load(ids_ptr + pairs, mask=ok, other=-1).to(tl.int32)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        # the pairs of the same expert before this one in the chunk: a row sum, not a scan down the chunk.
        # Padding pairs come after every real one, so `earlier` never counts them.
        earlier = pairs[None, :] < pairs[:, None]
        rank = tl.sum(((ids[:, None] == ids[None, :]) & earlier).to(tl.int32), axis=1)
        tl.store(sorted_ptr + tl.sum(onehot * base[None, :], axis=1) + rank, pairs, mask=ok)
        base += tl.sum(onehot, axis=0)


@triton.jit(do_not_specialize=["N"])
def _moe_scatter_kernel(ids_ptr, counts_ptr, sorted_ptr, N, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Each pair of chunk c to its slot: its chunk's first slot for its expert + earlier same-expert pairs."""
    c = tl.program_id(0)
    pairs = c * CHUNK + tl.arange(0, CHUNK)
    ok = pairs < N
    ids = tl.load(ids_ptr + pairs, mask=ok, other=-1).to(tl.int32)
    onehot = (ids[:, None] == tl.arange(0, E_PAD)[None, :]).to(tl.int32)
    rank = tl.sum((tl.cumsum(onehot, axis=0) - onehot) * onehot, axis=1)
    slot = tl.load(counts_ptr + c * E_PAD + ids, mask=ok, other=0) + rank
    tl.store(sorted_ptr + slot, pairs, mask=ok)


@triton.jit
def _block_pairs(sorted_ptr, expert_ptr, npost_ptr, N, BLOCK_M: tl.constexpr):
    """(this block's expert, its pair ids, which are real pairs, live block) for program_id(0)."""
    pid = tl.program_id(0)
    pairs = tl.load(sorted_ptr + pid * BLOCK_M + tl.arange(0, BLOCK_M))
    return tl.load(expert_ptr + pid).to(tl.int64), pairs, pairs < N, pid * BLOCK_M < tl.load(npost_ptr)


@triton.jit(do_not_specialize=["N"])
def _moe_gate_up_kernel(x_ptr, w_ptr, y_ptr, sorted_ptr, expert_ptr, npost_ptr, N, INTER, H, TOP_K,
                        s_xm, s_we, s_wn, s_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    e, pairs, ok, live = _block_pairs(sorted_ptr, expert_ptr, npost_ptr, N, BLOCK_M)
    if live:
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < INTER
        x_ptrs = x_ptr + (pairs // TOP_K).to(tl.int64)[:, None] * s_xm + rk[None, :]
        g_ptrs = w_ptr + e * s_we + rn.to(tl.int64)[None, :] * s_wn + rk[:, None]     # gate rows, [BLOCK_K, BLOCK_N]
        u_ptrs = g_ptrs + INTER * s_wn                                                   # the same columns' up rows
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


@triton.jit(do_not_specialize=["N"])
def _moe_down_kernel(a_ptr, w_ptr, y_ptr, topw_ptr, sorted_ptr, expert_ptr, npost_ptr, N, H, INTER,
                     s_am, s_we, s_wn, s_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    e, pairs, ok, live = _block_pairs(sorted_ptr, expert_ptr, npost_ptr, N, BLOCK_M)
    if live:
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < H
        a_ptrs = a_ptr + pairs.to(tl.int64)[:, None] * s_am + rk[None, :]
        w_ptrs = w_ptr + e * s_we + rn.to(tl.int64)[None, :] * s_wn + rk[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            k_ok = rk < INTER - k0
            a = tl.load(a_ptrs, mask=ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(a, tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0), acc)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        acc *= tl.load(topw_ptr + pairs, mask=ok, other=0.0)[:, None]
        tl.store(y_ptr + pairs.to(tl.int64)[:, None] * s_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=ok[:, None] & n_ok[None, :])


ONE_PROGRAM_PAIRS = 512     # moe_align in one launch up to this many pairs (decode), else three


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (sorted pair ids [T*k + E*(block_m - 1), rounded up to blocks], expert of each block,
    padded total [1]). Slots past the padded total are left unset (blocks there are not live: never used).
    Up to ONE_PROGRAM_PAIRS pairs one program sorts them; above, pairs are counted and scattered by 128-pair
    chunks in parallel, and one program in between turns the counts into offsets."""
    n, chunk = ids.numel(), 128
    chunks, e_pad = triton.cdiv(n, chunk), triton.next_power_of_2(num_experts)
    blocks = triton.cdiv(n + num_experts * (block_m - 1), block_m)
    sorted_ids = torch.empty(blocks * block_m, dtype=torch.int32, device=ids.device)
    expert_ids = torch.empty(blocks, dtype=torch.int32, device=ids.device)
    npost = torch.empty(1, dtype=torch.int32, device=ids.device)
    ids = ids.contiguous()
    if n <= ONE_PROGRAM_PAIRS:
        _moe_align_one_kernel[(1,)](ids, sorted_ids, expert_ids, npost, n, num_experts, blocks, BLOCK_M=block_m,
                                    E_PAD=e_pad, CHUNK=chunk, ROWS=16, num_warps=8)
        return sorted_ids, expert_ids, npost
    counts = torch.empty(chunks, e_pad, dtype=torch.int32, device=ids.device)
    _moe_count_kernel[(chunks,)](ids, counts, n, E_PAD=e_pad, CHUNK=chunk)
    _moe_offsets_kernel[(1,)](counts, sorted_ids, expert_ids, npost, n, num_experts, chunks, blocks, BLOCK_M=block_m,
                              E_PAD=e_pad, ROWS=16)
    _moe_scatter_kernel[(chunks,)](ids, counts, sorted_ids, n, E_PAD=e_pad, CHUNK=chunk)
    return sorted_ids, expert_ids, npost


def route(logits: torch.Tensor, top_k: int, renormalize: bool, ids_out: Optional[torch.Tensor] = None):
    """layers.moe.route's contract in one launch: logits [T, E] -> (weights [T, k] fp32 rounded to the
    logits' dtype, ids [T, k] int64, highest first); ids_out: where the ids go."""
    T, E = logits.shape
    assert logits.stride(1) == 1 and top_k <= E
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = ids_out if ids_out is not None else torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    assert ids.shape == (T, top_k) and ids.stride(1) == 1
    if T:
        _route_kernel[(T,)](logits, weights, ids, E, logits.stride(0), weights.stride(0), ids.stride(0),
                            TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), RENORM=renormalize,
                            E_PAD=triton.next_power_of_2(E))
    return weights, ids


def fused_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
              w_down: torch.Tensor, config: tuple[int, int, int, int, int], combine: bool = True) -> torch.Tensor:
    """x [T, H]; weights (fp32), ids [T, k]; w_gate_up [E, 2I, H], w_down [E, H, I];
    config (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) -> [T, H] in x's dtype; combine=False: each
    pair's weighted output as [k, T, H] (a view), for kernels.fused_ops.add_rmsnorm to sum in its add."""
    T, H = x.shape
    E, inter = w_gate_up.shape[0], w_down.shape[2]
    top_k = ids.shape[1]
    bm, bn, bk, warps, stages = config
    assert x.stride(1) == 1 and w_gate_up.is_contiguous() and w_down.is_contiguous()
    sorted_ids, expert_ids, npost = moe_align(ids, E, bm)
    blocks, n = expert_ids.numel(), T * top_k
    act = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    _moe_gate_up_kernel[(blocks, triton.cdiv(inter, bn))](
        x, w_gate_up, act, sorted_ids, expert_ids, npost, n, inter, H, top_k, x.stride(0), w_gate_up.stride(0),
        w_gate_up.stride(1), act.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    out = torch.empty(n, H, dtype=x.dtype, device=x.device)
    _moe_down_kernel[(blocks, triton.cdiv(H, bn))](
        act, w_down, out, weights.float().contiguous(), sorted_ids, expert_ids, npost, n, H, inter, act.stride(0),
        w_down.stride(0), w_down.stride(1), out.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
        num_stages=stages)
    if not combine:
        return out.view(T, top_k, H).transpose(0, 1)
    return out.view(T, top_k, H).sum(1, dtype=torch.float32).to(x.dtype)
