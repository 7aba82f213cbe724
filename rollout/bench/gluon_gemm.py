"""A skinny decode GEMM in Gluon whose first weight stages are in flight before its PDL wait.
CUDA (sm_90) only; an experiment for issue 4, timed by `python -m rollout.bench.chain --gluon ...`.

y = x @ w.T for M <= 32 rows, as kernels/skinny_gemm.py computes it: program p takes weight rows
[p * BLOCK_N, (p + 1) * BLOCK_N) over all of K, fp32 in K order, one bf16 rounding. It is written
to be the kernel Triton 3.6 builds from skinny_gemm at the o_proj tile (32 x 256, 4 warps, 5
stages; its TTGIR compiled for sm_90a here): the same mma.sync layout (warps 2 x 2, kWidth 2),
the same swizzled shared layout (so the operands load with ldmatrix), a ring of STAGES - 1
slots, one copy group per K tile, STAGES - 2 tiles pending while one is multiplied. The one
change: Triton's pipeliner issues its prologue after `griddepcontrol.wait`; here the ring's
weight tiles are issued before it (weights are no kernel's output), their x tiles after it.

Copy groups complete in order: group 0 = the ring's weight tiles, group 1 = their x tiles, then
one group per K tile i (tile i + SLOTS into the slot tile i used; empty past the end, so the
count stays exact). Tile t >= SLOTS is in the group of iteration t - SLOTS, which has SLOTS - 1
newer groups when tile t is needed: `wait_group(SLOTS - 1)`; tile 0 waits for everything.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2


@gluon.jit
def _asm(code: gl.constexpr, t):
    """Side-effecting PTX `code` (no operands of its own), once per thread: t is a scalar int32."""
    return gl.inline_asm_elementwise(code + " mov.u32 $0, $1;", "=r,r", [t], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _prewait_gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                         BLOCK_K: gl.constexpr, SLOTS: gl.constexpr, EARLY: gl.constexpr, PDL: gl.constexpr,
                         num_warps: gl.constexpr):
    pid = gl.program_id(0)
    # One warp per 8-element run of a row, 16-byte copies (Triton's #blocked for this tile).
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_K, BLOCK_K // 8], [num_warps, 1], [1, 0])
    smem: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, order=[1, 0])
    w_ring = gl.allocate_shared_memory(gl.bfloat16, [SLOTS, BLOCK_N, BLOCK_K], smem)
    x_ring = gl.allocate_shared_memory(gl.bfloat16, [SLOTS, BLOCK_M, BLOCK_K], smem)
    rn = pid * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
    rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
    rk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, ld))
    w_ptrs = w_ptr + rn.to(gl.int64)[:, None] * K + rk[None, :]
    x_ptrs = x_ptr + rm.to(gl.int64)[:, None] * K + rk[None, :]
    x_ok = rm[:, None] < M
    k_tiles = K // BLOCK_K
    if EARLY:                                             # before the wait: weights are nobody's output
        for j in gl.static_range(SLOTS):
            async_copy.async_copy_global_to_shared(w_ring.index(j), w_ptrs + j * BLOCK_K)
        async_copy.commit_group()
    if PDL == 2:                                          # let the next kernel launch, then wait (pdl.py's order)
        _asm("griddepcontrol.launch_dependents; griddepcontrol.wait;", pid)
    elif PDL == 1:
        _asm("griddepcontrol.wait;", pid)
    if not EARLY:
        for j in gl.static_range(SLOTS):
            async_copy.async_copy_global_to_shared(w_ring.index(j), w_ptrs + j * BLOCK_K)
        async_copy.commit_group()
    for j in gl.static_range(SLOTS):
        async_copy.async_copy_global_to_shared(x_ring.index(j), x_ptrs + j * BLOCK_K, mask=x_ok)
    async_copy.commit_group()
    if PDL == 1:                                          # wait, then let the next kernel launch
        _asm("griddepcontrol.launch_dependents;", pid)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[2, 2], instr_shape=[16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
    for i in range(k_tiles):
        s = i % SLOTS
        if i == 0:
            async_copy.wait_group(0)
        else:
            async_copy.wait_group(SLOTS - 1)
        # (Triton's membar pass puts a CTA barrier after the wait and another before the refill.)
        a = w_ring.index(s).load(a_op)
        b = x_ring.index(s).permute((1, 0)).load(b_op)
        nxt = i + SLOTS
        if nxt < k_tiles:
            async_copy.async_copy_global_to_shared(w_ring.index(s), w_ptrs + nxt * BLOCK_K)
            async_copy.async_copy_global_to_shared(x_ring.index(s), x_ptrs + nxt * BLOCK_K, mask=x_ok)
        async_copy.commit_group()                         # empty at the tail: the group count stays exact
        acc = mma_v2(a, b, acc)
    out: gl.constexpr = gl.BlockedLayout([8, 1], [4, 8], [1, num_warps], [0, 1])   # runs along N, as Triton's
    y = gl.convert_layout(acc, out).to(gl.bfloat16)
    on = pid * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out))
    om = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, out))
    gl.store(y_ptr + om.to(gl.int64)[None, :] * N + on[:, None], y, mask=(om[None, :] < M) & (on[:, None] < N))


def prewait_gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, block_n: int = 32, block_k: int = 256,
                 slots: int = 4, early: bool = True, pdl: int = 2) -> torch.Tensor:
    """out [M, N] = x [M, K] @ w [N, K].T in bf16, M <= 32, N % block_n == 0, K % block_k == 0,
    K / block_k >= slots. early: the ring's weight tiles before the PDL wait (False: after, as
    Triton's pipeliner orders them). pdl: 0 off, 1 wait then launch dependents, 2 launch then wait."""
    M, K = x.shape
    N = w.shape[0]
    assert x.dtype == w.dtype == out.dtype == torch.bfloat16 and M <= 32 and N % block_n == 0
    assert K % block_k == 0 and K // block_k >= slots and x.is_contiguous() and w.is_contiguous()
    _prewait_gemm_kernel[(N // block_n,)](x, w, out, M, N, K, BLOCK_N=block_n, BLOCK_M=32, BLOCK_K=block_k,
                                          SLOTS=slots, EARLY=early, PDL=pdl, num_warps=4, launch_pdl=bool(pdl))
    return out
