"""A skinny decode GEMM in Gluon whose first weight stages are in flight before its PDL wait.
CUDA (sm_90) only. An experiment for issue 4: `skinny_gemm.GLUON` routes weight shapes here
(`bench.step_variants` knob `gluon=...`); `bench.chain --gluon` times it alone.

y = x @ w.T for M <= 32 rows, as kernels/skinny_gemm.py computes it: program p takes BLOCK_N
weight rows over all of K, fp32 in K order, one rounding; with SILU_MUL the rows are the fused
gate_up weight's (BLOCK_N / 2 gate rows, then the matching up rows) and the epilogue writes
silu(gate) * up with fused_ops.silu_times' rounding. It is Triton 3.6's kernel for skinny_gemm's
o_proj tile (32 x 256, 4 warps, 5 stages; TTGIR compiled for sm_90a here) written out: mma.sync
with warps 2 x 2 (2 x 4 with 8 warps) and kWidth 2, the same swizzled shared layout (operands
load with ldmatrix), a ring of SLOTS tiles, one copy group per K tile, SLOTS - 1 tiles pending
while one is multiplied. At that tile its bits equal skinny_gemm's. The change: Triton's
pipeliner issues its prologue after `griddepcontrol.wait`; here (EARLY) the ring's weight tiles
are issued before it, since weights are no kernel's output, and only the x tiles wait.

Copy groups complete in order. Each of the ring's x tiles (after the wait) is its own group, as
is each later K tile (tile i + SLOTS goes into the slot tile i used, one group per iteration,
empty past the end so the count stays exact); the ring's weight tiles are in older groups (or in
their x tile's group without EARLY). When tile i is multiplied exactly SLOTS - 1 newer groups
exist, so every iteration waits `wait_group(SLOTS - 1)`: tile 0 does not wait for the whole
ring (a first version did, and lost 2 us a launch to Triton's kernel).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

BLOCK_M = 32


@gluon.jit
def _asm(code: gl.constexpr, t):
    """Side-effecting PTX `code` (no operands of its own), once per thread: t is a scalar int32."""
    return gl.inline_asm_elementwise(code + " mov.u32 $0, $1;", "=r,r", [t], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _prewait_gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, s_xm, s_ym, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                         BLOCK_K: gl.constexpr, SLOTS: gl.constexpr, EARLY: gl.constexpr, SILU_MUL: gl.constexpr,
                         PDL: gl.constexpr, num_warps: gl.constexpr):
    pid = gl.program_id(0)
    # 16-byte copies, a warp along a row's K run (Triton's #blocked for the o_proj tile).
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_K, BLOCK_K // 8], [num_warps, 1], [1, 0])
    smem: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, order=[1, 0])
    w_ring = gl.allocate_shared_memory(gl.bfloat16, [SLOTS, BLOCK_N, BLOCK_K], smem)
    x_ring = gl.allocate_shared_memory(gl.bfloat16, [SLOTS, BLOCK_M, BLOCK_K], smem)
    r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
    if SILU_MUL:     # skinny_gemm.gate_up_rows: gate rows, then the up rows of the same columns (N = I)
        w_rows = pid * (BLOCK_N // 2) + r % (BLOCK_N // 2) + (r >= BLOCK_N // 2).to(gl.int32) * N
    else:
        w_rows = pid * BLOCK_N + r
    rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
    rk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, ld))
    w_ptrs = w_ptr + w_rows.to(gl.int64)[:, None] * K + rk[None, :]
    x_ptrs = x_ptr + rm.to(gl.int64)[:, None] * s_xm + rk[None, :]
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
    for j in gl.static_range(SLOTS):
        if not EARLY:
            async_copy.async_copy_global_to_shared(w_ring.index(j), w_ptrs + j * BLOCK_K)
        async_copy.async_copy_global_to_shared(x_ring.index(j), x_ptrs + j * BLOCK_K, mask=x_ok)
        async_copy.commit_group()
    if PDL == 1:                                          # wait, then let the next kernel launch
        _asm("griddepcontrol.launch_dependents;", pid)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps // 2, 2],
                                                  instr_shape=[16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
    for i in range(k_tiles):
        s = i % SLOTS
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
    out: gl.constexpr = gl.BlockedLayout([8, 1], [4, 8], [num_warps // 4, 4], [0, 1])   # runs along N, as Triton's
    om = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, out))
    if SILU_MUL:     # the gate and up halves of acc through shared memory, then skinny_gemm.silu_epilogue's bits
        acc_s = gl.allocate_shared_memory(gl.float32, [BLOCK_N, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        acc_s.store(acc)
        g = acc_s.slice(0, BLOCK_N // 2).load(out).to(gl.bfloat16).to(gl.float32)
        u = acc_s.slice(BLOCK_N // 2, BLOCK_N // 2).load(out).to(gl.bfloat16).to(gl.float32)
        y = ((g / (1.0 + gl.exp(-g))).to(gl.bfloat16).to(gl.float32) * u).to(gl.bfloat16)
        on = pid * (BLOCK_N // 2) + gl.arange(0, BLOCK_N // 2, layout=gl.SliceLayout(1, out))
    else:
        y = gl.convert_layout(acc, out).to(gl.bfloat16)
        on = pid * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out))
    gl.store(y_ptr + om.to(gl.int64)[None, :] * s_ym + on[:, None], y, mask=(om[None, :] < M) & (on[:, None] < N))


def prewait_gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, block_n: int = 32, block_k: int = 256,
                 slots: int = 4, num_warps: int = 4, early: bool = True, silu_mul: bool = False,
                 pdl: int = 2) -> torch.Tensor:
    """out [M, N] = x [M, K] @ w [N, K].T in bf16 (silu_mul: w the fused gate_up weight [2I, K],
    out [M, I] = silu(gate) * up), M <= 32, N a multiple of the tile's output columns, K / block_k
    >= slots. early: the ring's weight tiles before the PDL wait (False: after it, as Triton's
    pipeliner orders them). pdl: 0 off, 1 wait then launch dependents, 2 launch then wait."""
    M, K = x.shape
    N = w.shape[0] // 2 if silu_mul else w.shape[0]
    cols = block_n // 2 if silu_mul else block_n
    assert x.dtype == w.dtype == out.dtype == torch.bfloat16 and M <= BLOCK_M and N % cols == 0
    assert out.shape == (M, N) and out.stride(1) == 1 and x.stride(1) == 1 and w.is_contiguous()
    assert K % block_k == 0 and K // block_k >= slots and num_warps in (4, 8)
    _prewait_gemm_kernel[(N // cols,)](x, w, out, M, N, K, x.stride(0), out.stride(0), BLOCK_N=block_n,
                                       BLOCK_M=BLOCK_M, BLOCK_K=block_k, SLOTS=slots, EARLY=early,
                                       SILU_MUL=silu_mul, PDL=pdl, num_warps=num_warps, launch_pdl=bool(pdl))
    return out
