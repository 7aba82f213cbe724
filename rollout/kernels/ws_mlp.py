"""A decode layer's second half as one warp-specialized persistent kernel (Gluon, sm_90).

One launch replaces five: o_proj, residual add + post-attention RMSNorm, gate_up + SiLU, down,
residual add + the next RMSNorm. Between kernels a decode GEMM loses ~3-4 us to ramp-up and
drain even under PDL (bench/results/README.md, twelfth session): HBM idles while the last tiles
finish and the next grid starts. Here each of the H / 32 programs (one per SM, all resident) has
- a weight producer (W_WARPS warps) streaming its 32-row weight tiles of o_proj, then gate_up,
  then down through a ring of shared-memory slots. Weights are nobody's output, so it only waits
  for a free slot: across a phase boundary it keeps loading the next phase's tiles while the
  other programs finish, and HBM keeps streaming;
- an x producer (1 warp) that waits until every program has finished the phases before (one
  counter in global memory) and then streams the phase's input tiles from L2;
- 4 consumer warps that multiply (mma.sync, skinny_gemm's 32 x 256 tile, fp32 in K order), store
  the phase's output (gate_up: silu(gate) * up with fused_ops.silu_times' rounding), and do the
  two add + RMSNorm phases (a row per program, HF's rounding as fused_ops.add_rmsnorm).
Measured at the 8B shapes as a 32-layer chain (bench.ws_mlp): 5.5 us a layer under skinny_gemm
launches at the table's configs. The GEMM phases have skinny_gemm's bits at (32, 256, 4, 5);
the norms differ from add_rmsnorm only in the fp32 order of the sum of squares.

All programs must be resident at once (they wait on each other): H / 32 <= SMs, and nothing
else may hold the SMs; a wait gives up after SPIN polls and counts it in `err` (wrong results
rather than a hang). The kernel is launched without PDL, so it starts after the kernel before
has finished, when every SM is free.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mbarrier, mma_v2

BLOCK_N, BLOCK_K, BLOCK_M = 32, 256, 32
W_SLOTS, X_SLOTS, W_WARPS = 6, 4, 4          # bench.ws_mlp: 4 producer warps 6.1 us a layer over copy, 2: 16.8
SPIN = 1 << 22                               # counter polls before a wait gives up (~seconds)


@gluon.jit
def wait_count(ptr, target, err_ptr, SPIN: gl.constexpr):
    """Poll the counter at ptr (acquire) until it reaches target, or SPIN polls (then count it in err)."""
    polls = 0
    while (gl.atomic_add(ptr, 0, sem="acquire") < target) & (polls < SPIN):
        polls += 1
    if polls >= SPIN:
        gl.atomic_add(err_ptr, 1)


@gluon.jit
def w_stream(w_ptr, i, w_ring, w_full, w_empty, K: gl.constexpr, TILES: gl.constexpr, SILU_I: gl.constexpr,
             BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, SLOTS: gl.constexpr, WARPS: gl.constexpr):
    """Copy this program's weight tiles of one GEMM (w [rows, K]; tiles t = program, + programs, ...)
    into the ring, K tile by K tile; slot use i counts on across GEMMs. SILU_I: the fused gate_up
    weight (I gate rows, then I up rows): a tile is BLOCK_N / 2 gate rows and their up rows."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_K, BLOCK_K // 8], [WARPS, 1], [1, 0])
    r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
    rk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, ld))
    for t in range(gl.program_id(0), TILES, gl.num_programs(0)):
        if SILU_I:
            rows = t * (BLOCK_N // 2) + r % (BLOCK_N // 2) + (r >= BLOCK_N // 2).to(gl.int32) * SILU_I
        else:
            rows = t * BLOCK_N + r
        ptrs = w_ptr + rows.to(gl.int64)[:, None] * K + rk[None, :]
        for kt in range(K // BLOCK_K):
            s = i % SLOTS
            mbarrier.wait(w_empty.index(s), ((i // SLOTS) & 1) ^ 1)      # a fresh slot passes at once
            async_copy.async_copy_global_to_shared(w_ring.index(s), ptrs + kt * BLOCK_K)
            async_copy.mbarrier_arrive(w_full.index(s), increment_count=False)
            i += 1
    return i


@gluon.jit
def x_stream(x_ptr, s_x, M, i, done, cnt_ptr, err_ptr, x_ring, x_full, x_empty, K: gl.constexpr,
             TILES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, SLOTS: gl.constexpr,
             SPIN: gl.constexpr):
    """Once all programs have counted `done` phases, copy x [M, K] (row stride s_x) into the ring,
    K tile by K tile, once for each of this program's tiles (from L2: other SMs wrote it)."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_K, BLOCK_K // 8], [1, 1], [1, 0])
    rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
    rk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, ld))
    ok = (rm[:, None] < M) & (rk[None, :] < BLOCK_K)
    wait_count(cnt_ptr, done * gl.num_programs(0), err_ptr, SPIN)
    ptrs = x_ptr + rm.to(gl.int64)[:, None] * s_x + rk[None, :]
    for t in range(gl.program_id(0), TILES, gl.num_programs(0)):
        for kt in range(K // BLOCK_K):
            s = i % SLOTS
            mbarrier.wait(x_empty.index(s), ((i // SLOTS) & 1) ^ 1)
            async_copy.async_copy_global_to_shared(x_ring.index(s), ptrs + kt * BLOCK_K, mask=ok, cache_modifier=".cg")
            async_copy.mbarrier_arrive(x_full.index(s), increment_count=False)
            i += 1
    return i


@gluon.jit
def gemm_tiles(y_ptr, s_y, M, i, w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty, K: gl.constexpr,
               TILES: gl.constexpr, SILU_I: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_K: gl.constexpr, W_SLOTS: gl.constexpr, X_SLOTS: gl.constexpr, num_warps: gl.constexpr):
    """The consumers' GEMM phase: y[:, tile] = x @ w[tile rows].T for this program's tiles, from the
    two rings (skinny_gemm's mma.sync layout, warps 2 x 2), rounded once; with SILU_I the tile's
    silu(gate) * up (BLOCK_N / 2 columns)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps // 2, 2],
                                                  instr_shape=[16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    out: gl.constexpr = gl.BlockedLayout([8, 1], [4, 8], [num_warps // 4, 4], [0, 1])
    om = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, out))
    for t in range(gl.program_id(0), TILES, gl.num_programs(0)):
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
        for kt in range(K // BLOCK_K):
            ws = i % W_SLOTS
            xs = i % X_SLOTS
            mbarrier.wait(w_full.index(ws), (i // W_SLOTS) & 1)
            mbarrier.wait(x_full.index(xs), (i // X_SLOTS) & 1)
            a = w_ring.index(ws).load(a_op)
            b = x_ring.index(xs).permute((1, 0)).load(b_op)
            mbarrier.arrive(w_empty.index(ws))                # (Gluon: a partition barrier, then one thread)
            mbarrier.arrive(x_empty.index(xs))
            acc = mma_v2(a, b, acc)
            i += 1
        if SILU_I:      # the gate and up halves of acc through shared memory
            acc_s.store(acc)
            g = acc_s.slice(0, BLOCK_N // 2).load(out).to(gl.bfloat16).to(gl.float32)
            u = acc_s.slice(BLOCK_N // 2, BLOCK_N // 2).load(out).to(gl.bfloat16).to(gl.float32)
            y = ((g / (1.0 + gl.exp(-g))).to(gl.bfloat16).to(gl.float32) * u).to(gl.bfloat16)
            on = t * (BLOCK_N // 2) + gl.arange(0, BLOCK_N // 2, layout=gl.SliceLayout(1, out))
        else:
            y = gl.convert_layout(acc, out).to(gl.bfloat16)
            on = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out))
        gl.store(y_ptr + om.to(gl.int64)[None, :] * s_y + on[:, None], y, mask=om[None, :] < M)
    return i


@gluon.jit
def count_done(cnt_ptr, last):
    """This program has finished a phase (its stores before the release); the last arrival of the
    launch (`last` = phases * programs - 1) zeroes the counter for the next launch."""
    gl.thread_barrier()
    if gl.atomic_add(cnt_ptr, 1, sem="release") == last:
        gl.atomic_xchg(cnt_ptr, 0)


@gluon.jit
def add_norm_row(res_ptr, d_ptr, w_ptr, res_out_ptr, out_ptr, row, eps, H: gl.constexpr, num_warps: gl.constexpr):
    """r = res[row] + d[row] rounded, stored to res_out[row]; out[row] = rmsnorm(r) * w, rounded as
    fused_ops.add_rmsnorm rounds (its sum of squares in another fp32 order). d from L2."""
    lay: gl.constexpr = gl.BlockedLayout([H // (32 * num_warps)], [32], [num_warps], [0])
    cols = gl.arange(0, H, layout=lay)
    off = row.to(gl.int64) * H + cols
    x = gl.load(res_ptr + off, cache_modifier=".cg")
    d = gl.load(d_ptr + off, cache_modifier=".cg")
    x = (x.to(gl.float32) + d.to(gl.float32)).to(gl.bfloat16)
    gl.store(res_out_ptr + off, x)
    xf = x.to(gl.float32)
    inv = 1.0 / gl.sqrt_rn(gl.sum(xf * xf, axis=0) / H + eps)
    y = (xf * inv).to(gl.bfloat16)
    w = gl.load(w_ptr + cols)
    gl.store(out_ptr + off, (w.to(gl.float32) * y.to(gl.float32)).to(gl.bfloat16))


@gluon.jit
def _w_producer(wo_ptr, wgu_ptr, wd_ptr, w_ring, w_full, w_empty, H: gl.constexpr, Q: gl.constexpr,
                I: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, SLOTS: gl.constexpr,
                WARPS: gl.constexpr):
    i = w_stream(wo_ptr, gl.to_tensor(0), w_ring, w_full, w_empty, Q, H // BLOCK_N, 0, BLOCK_N, BLOCK_K, SLOTS, WARPS)
    i = w_stream(wgu_ptr, i, w_ring, w_full, w_empty, H, 2 * I // BLOCK_N, I, BLOCK_N, BLOCK_K, SLOTS, WARPS)
    w_stream(wd_ptr, i, w_ring, w_full, w_empty, I, H // BLOCK_N, 0, BLOCK_N, BLOCK_K, SLOTS, WARPS)


@gluon.jit
def _x_producer(a_ptr, s_a, h_ptr, act_ptr, M, cnt_ptr, err_ptr, x_ring, x_full, x_empty, H: gl.constexpr,
                Q: gl.constexpr, I: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                BLOCK_K: gl.constexpr, SLOTS: gl.constexpr, SPIN: gl.constexpr):
    # phases: 0 o_proj, 1 add + norm, 2 gate_up, 3 down, 4 add + norm; a GEMM's input is ready once
    # every program has counted the phases before it
    i = x_stream(a_ptr, s_a, M, gl.to_tensor(0), 0, cnt_ptr, err_ptr, x_ring, x_full, x_empty, Q, H // BLOCK_N, BLOCK_M,
                 BLOCK_K, SLOTS, SPIN)
    i = x_stream(h_ptr, H, M, i, 2, cnt_ptr, err_ptr, x_ring, x_full, x_empty, H, 2 * I // BLOCK_N, BLOCK_M,
                 BLOCK_K, SLOTS, SPIN)
    x_stream(act_ptr, I, M, i, 3, cnt_ptr, err_ptr, x_ring, x_full, x_empty, I, H // BLOCK_N, BLOCK_M,
             BLOCK_K, SLOTS, SPIN)


@gluon.jit
def _consumer(res_ptr, o_ptr, h_ptr, act_ptr, d_ptr, res_out_ptr, out_ptr, n1_ptr, n2_ptr, eps, M, cnt_ptr,
              err_ptr, w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty, H: gl.constexpr,
              Q: gl.constexpr, I: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_K: gl.constexpr, W_SLOTS: gl.constexpr, X_SLOTS: gl.constexpr, SPIN: gl.constexpr,
              num_warps: gl.constexpr):
    pid = gl.program_id(0)
    last = 5 * gl.num_programs(0) - 1
    i = gemm_tiles(o_ptr, H, M, gl.to_tensor(0), w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty, Q, H // BLOCK_N, 0,
                   BLOCK_N, BLOCK_M, BLOCK_K, W_SLOTS, X_SLOTS, num_warps)
    count_done(cnt_ptr, last)
    wait_count(cnt_ptr, gl.num_programs(0), err_ptr, SPIN)           # all of o_proj's columns stored
    gl.thread_barrier()
    if pid < M:
        add_norm_row(res_ptr, o_ptr, n1_ptr, res_out_ptr, h_ptr, pid, eps, H, num_warps)
    count_done(cnt_ptr, last)
    i = gemm_tiles(act_ptr, I, M, i, w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty, H, 2 * I // BLOCK_N,
                   I, BLOCK_N, BLOCK_M, BLOCK_K, W_SLOTS, X_SLOTS, num_warps)
    count_done(cnt_ptr, last)
    gemm_tiles(d_ptr, H, M, i, w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty, I, H // BLOCK_N, 0,
               BLOCK_N, BLOCK_M, BLOCK_K, W_SLOTS, X_SLOTS, num_warps)
    count_done(cnt_ptr, last)
    wait_count(cnt_ptr, 4 * gl.num_programs(0), err_ptr, SPIN)       # all of down's columns stored
    gl.thread_barrier()
    if pid < M:     # this program wrote res_out[pid] in phase 1: add down's output to it in place
        add_norm_row(res_out_ptr, d_ptr, n2_ptr, res_out_ptr, out_ptr, pid, eps, H, num_warps)
    count_done(cnt_ptr, last)


@gluon.jit
def _mlp_block_kernel(a_ptr, s_a, res_ptr, wo_ptr, wgu_ptr, wd_ptr, n1_ptr, n2_ptr, o_ptr, h_ptr, act_ptr, d_ptr,
                      res_out_ptr, out_ptr, cnt_ptr, err_ptr, eps, M, H: gl.constexpr, Q: gl.constexpr,
                      I: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
                      W_SLOTS: gl.constexpr, X_SLOTS: gl.constexpr, W_WARPS: gl.constexpr, SPIN: gl.constexpr,
                      num_warps: gl.constexpr):
    smem: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, order=[1, 0])     # skinny_gemm's, so ldmatrix
    w_ring = gl.allocate_shared_memory(gl.bfloat16, [W_SLOTS, BLOCK_N, BLOCK_K], smem)
    x_ring = gl.allocate_shared_memory(gl.bfloat16, [X_SLOTS, BLOCK_M, BLOCK_K], smem)
    acc_s = gl.allocate_shared_memory(gl.float32, [BLOCK_N, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    bars: gl.constexpr = mbarrier.MBarrierLayout()
    w_full = gl.allocate_shared_memory(gl.int64, [W_SLOTS, 1], bars)
    w_empty = gl.allocate_shared_memory(gl.int64, [W_SLOTS, 1], bars)
    x_full = gl.allocate_shared_memory(gl.int64, [X_SLOTS, 1], bars)
    x_empty = gl.allocate_shared_memory(gl.int64, [X_SLOTS, 1], bars)
    for s in gl.static_range(W_SLOTS):
        mbarrier.init(w_full.index(s), count=W_WARPS * 32)     # every producer thread's copies landed
        mbarrier.init(w_empty.index(s), count=1)               # the consumers' one arrival
    for s in gl.static_range(X_SLOTS):
        mbarrier.init(x_full.index(s), count=32)
        mbarrier.init(x_empty.index(s), count=1)
    gl.warp_specialize([
        (_consumer, (res_ptr, o_ptr, h_ptr, act_ptr, d_ptr, res_out_ptr, out_ptr, n1_ptr, n2_ptr, eps, M, cnt_ptr,
                     err_ptr, w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty, H, Q, I, BLOCK_N, BLOCK_M,
                     BLOCK_K, W_SLOTS, X_SLOTS, SPIN, num_warps)),
        (_w_producer, (wo_ptr, wgu_ptr, wd_ptr, w_ring, w_full, w_empty, H, Q, I, BLOCK_N, BLOCK_K, W_SLOTS,
                       W_WARPS)),
        (_x_producer, (a_ptr, s_a, h_ptr, act_ptr, M, cnt_ptr, err_ptr, x_ring, x_full, x_empty, H, Q, I, BLOCK_N,
                       BLOCK_M, BLOCK_K, X_SLOTS, SPIN)),
    ], [W_WARPS, 1], [48, 48])


def fits(M: int, hidden: int, q_size: int, inter: int, device: torch.device) -> bool:
    """Whether mlp_block takes this decode shape on this device."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9 and 0 < M <= BLOCK_M
            and hidden % BLOCK_K == 0 and q_size % BLOCK_K == 0 and inter % BLOCK_K == 0
            and hidden // BLOCK_N <= torch.cuda.get_device_properties(device).multi_processor_count)


def counters(device: torch.device) -> torch.Tensor:
    """[phase counter, wait timeouts]: int32 zeros that mlp_block's launches share (the counter is
    zero again after each; a nonzero timeout count means the programs were not all resident)."""
    return torch.zeros(2, dtype=torch.int32, device=device)


def mlp_block(a: torch.Tensor, residual: torch.Tensor, wo: torch.Tensor, n1: torch.Tensor, wgu: torch.Tensor,
              wd: torch.Tensor, n2: torch.Tensor, eps: float, cnt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, r) of one decode layer's second half: r1 = residual + a @ wo.T; x = rmsnorm(r1) * n1;
    r = r1 + (silu(gate) * up of x @ wgu.T) @ wd.T; h = rmsnorm(r) * n2, in one launch (bf16; wgu
    the fused [2I, H] weight, gate rows first; eps shared by both norms). cnt: from `counters`."""
    M, Q = a.shape
    H, I = wo.shape[0], wd.shape[1]
    assert a.stride(1) == 1 and residual.is_contiguous() and residual.shape == (M, H)
    assert wo.shape == (H, Q) and wgu.shape == (2 * I, H) and wd.shape == (H, I) and n1.shape == n2.shape == (H,)
    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in (wo, wgu, wd, n1, n2))
    assert a.dtype == residual.dtype == torch.bfloat16 and fits(M, H, Q, I, a.device)
    o, h, d, res_out, out = (torch.empty(M, H, device=a.device, dtype=a.dtype) for _ in range(5))
    act = torch.empty(M, I, device=a.device, dtype=a.dtype)
    _mlp_block_kernel[(H // BLOCK_N,)](a, a.stride(0), residual, wo, wgu, wd, n1, n2, o, h, act, d, res_out, out,
                                       cnt, cnt[1:], eps, M, H=H, Q=Q, I=I, BLOCK_N=BLOCK_N, BLOCK_M=BLOCK_M,
                                       BLOCK_K=BLOCK_K, W_SLOTS=W_SLOTS, X_SLOTS=X_SLOTS, W_WARPS=W_WARPS,
                                       SPIN=SPIN, num_warps=4)
    return out, res_out
