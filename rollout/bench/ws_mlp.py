"""The decode MLP's three GEMMs as one warp-specialized persistent kernel, against launches.
CUDA (sm_90) only; an experiment for issue 4.

    python -m rollout.bench.ws_mlp --layers 32 --m 32 --out bench/results/<name>.json

bench.ws_chain showed that on 32 chained o_proj GEMMs a persistent kernel whose weight producer
never waits for data runs ~1.1 us a layer boundary under PDL launches (2.7 against 3.8 us a
layer over the copy rate). This asks the same at the 8B MLP's shapes, where the boundaries are
between different weights: per layer o_proj (4096 x 4096), gate_up + SiLU (28672 x 4096, gate
and up rows paired as skinny_gemm's silu_mul) and down (4096 x 14336), x[l + 1] = down(silu(
gate_up(o(x[l])))), no norms or residuals (what they cost is measured elsewhere). Every GEMM
uses 32-row weight tiles over 256-wide K tiles, so 128 programs take 1, 7 and 1 tiles of the
three phases; per program, a weight producer streams all its tiles of every phase and layer
through one shared-memory ring; an x producer waits until all programs have finished the phase
before (one counter), then streams that phase's input; 4 consumer warps multiply (mma.sync) and
store, with skinny_gemm's SiLU epilogue in phase 2. Same tiles and K order as skinny_gemm at
(32, 256, 4, 5), so the output is compared bit for bit with those launches first. Also timed:
launches at the engine's table configs (plain layout), and the kernel launched once per layer.
Printed: ms, GB/s, us a layer over copy. Measured (bench/results/README.md, eighteenth session):
5.7-6.6 us a layer over copy with 4 weight producer warps against 11.6-12.1 for the table's
launches; launched once per layer 10.5. (The same design as one engine launch per layer, with the
two norms as phases, read 5.5 points slower in the decode graphs: commit e2e9352.)
"""
from __future__ import annotations

import argparse
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mbarrier, mma_v2

from .__main__ import run_meta, write_json
from .ws_chain import SPIN_LIMIT, _wait_count

BLOCK_N, BLOCK_K, BLOCK_M = 32, 256, 32


@gluon.jit
def _w_phase(PHASE: gl.constexpr, base, i, r, rk, w_ring, w_full, w_empty, H: gl.constexpr, I: gl.constexpr,
             BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, SLOTS: gl.constexpr):
    """Stream this program's weight tiles of one phase (0 o_proj, 1 gate_up, 2 down) of a layer."""
    K: gl.constexpr = I if PHASE == 2 else H
    tiles: gl.constexpr = 2 * I // BLOCK_N if PHASE == 1 else H // BLOCK_N
    for t in range(gl.program_id(0), tiles, gl.num_programs(0)):
        if PHASE == 1:      # BLOCK_N / 2 gate rows, then the matching up rows (skinny_gemm.gate_up_rows)
            rows = t * (BLOCK_N // 2) + r % (BLOCK_N // 2) + (r >= BLOCK_N // 2).to(gl.int32) * I
        else:
            rows = t * BLOCK_N + r
        ptrs = base + rows.to(gl.int64)[:, None] * K + rk[None, :]
        for kt in range(K // BLOCK_K):
            s = i % SLOTS
            mbarrier.wait(w_empty.index(s), ((i // SLOTS) & 1) ^ 1)
            async_copy.async_copy_global_to_shared(w_ring.index(s), ptrs + kt * BLOCK_K)
            async_copy.mbarrier_arrive(w_full.index(s), increment_count=False)
            i += 1
    return i


@gluon.jit
def _w_producer(wo_ptr, wgu_ptr, wd_ptr, w_ring, w_full, w_empty, LAYERS, H: gl.constexpr, I: gl.constexpr,
                BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, SLOTS: gl.constexpr, WARPS: gl.constexpr):
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_K, BLOCK_K // 8], [WARPS, 1], [1, 0])
    r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
    rk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, ld))
    i = 0
    for layer in range(LAYERS):
        i = _w_phase(0, wo_ptr + layer.to(gl.int64) * H * H, i, r, rk, w_ring, w_full, w_empty, H, I, BLOCK_N,
                     BLOCK_K, SLOTS)
        i = _w_phase(1, wgu_ptr + layer.to(gl.int64) * 2 * I * H, i, r, rk, w_ring, w_full, w_empty, H, I, BLOCK_N,
                     BLOCK_K, SLOTS)
        i = _w_phase(2, wd_ptr + layer.to(gl.int64) * H * I, i, r, rk, w_ring, w_full, w_empty, H, I, BLOCK_N,
                     BLOCK_K, SLOTS)


@gluon.jit
def _x_phase(PHASE: gl.constexpr, src, done, i, rm, rk, ok, x_ring, x_full, x_empty, cnt_ptr, err_ptr,
             H: gl.constexpr, I: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, SLOTS: gl.constexpr,
             SPIN: gl.constexpr):
    """Once `done` phases of all programs are finished, stream this phase's input tiles."""
    K: gl.constexpr = I if PHASE == 2 else H
    tiles: gl.constexpr = 2 * I // BLOCK_N if PHASE == 1 else H // BLOCK_N
    _wait_count(cnt_ptr, done * gl.num_programs(0), err_ptr, SPIN)
    ptrs = src + rm[:, None] * K + rk[None, :]
    for t in range(gl.program_id(0), tiles, gl.num_programs(0)):
        for kt in range(K // BLOCK_K):
            s = i % SLOTS
            mbarrier.wait(x_empty.index(s), ((i // SLOTS) & 1) ^ 1)
            async_copy.async_copy_global_to_shared(x_ring.index(s), ptrs + kt * BLOCK_K, mask=ok,
                                                   cache_modifier=".cg")     # from L2: other SMs wrote it
            async_copy.mbarrier_arrive(x_full.index(s), increment_count=False)
            i += 1
    return i


@gluon.jit
def _x_producer(x_ptr, h_ptr, a_ptr, x_ring, x_full, x_empty, cnt_ptr, err_ptr, M, LAYERS, H: gl.constexpr,
                I: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
                SLOTS: gl.constexpr, SPIN: gl.constexpr, WARPS: gl.constexpr):
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_K, BLOCK_K // 8], [WARPS, 1], [1, 0])
    rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
    rk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, ld))
    ok = (rm[:, None] < M) & (rk[None, :] < BLOCK_K)
    i = 0
    for layer in range(LAYERS):
        i = _x_phase(0, x_ptr + layer * M * H, 3 * layer, i, rm, rk, ok, x_ring, x_full, x_empty, cnt_ptr, err_ptr,
                     H, I, BLOCK_N, BLOCK_K, SLOTS, SPIN)
        i = _x_phase(1, h_ptr + layer * M * H, 3 * layer + 1, i, rm, rk, ok, x_ring, x_full, x_empty, cnt_ptr,
                     err_ptr, H, I, BLOCK_N, BLOCK_K, SLOTS, SPIN)
        i = _x_phase(2, a_ptr + layer * M * I, 3 * layer + 2, i, rm, rk, ok, x_ring, x_full, x_empty, cnt_ptr,
                     err_ptr, H, I, BLOCK_N, BLOCK_K, SLOTS, SPIN)


@gluon.jit
def _c_phase(PHASE: gl.constexpr, dst, i, om, w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty, cnt_ptr, M,
             LAYERS, H: gl.constexpr, I: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_K: gl.constexpr, W_SLOTS: gl.constexpr, X_SLOTS: gl.constexpr, num_warps: gl.constexpr):
    """Multiply this program's tiles of one phase, store them to dst ([M, H], or [M, I] after the
    SiLU of phase 1), then count the phase done."""
    K: gl.constexpr = I if PHASE == 2 else H
    tiles: gl.constexpr = 2 * I // BLOCK_N if PHASE == 1 else H // BLOCK_N
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps // 2, 2],
                                                  instr_shape=[16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    out: gl.constexpr = gl.BlockedLayout([8, 1], [4, 8], [num_warps // 4, 4], [0, 1])
    for t in range(gl.program_id(0), tiles, gl.num_programs(0)):
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
        for kt in range(K // BLOCK_K):
            ws = i % W_SLOTS
            xs = i % X_SLOTS
            mbarrier.wait(w_full.index(ws), (i // W_SLOTS) & 1)
            mbarrier.wait(x_full.index(xs), (i // X_SLOTS) & 1)
            a = w_ring.index(ws).load(a_op)
            b = x_ring.index(xs).permute((1, 0)).load(b_op)
            mbarrier.arrive(w_empty.index(ws))
            mbarrier.arrive(x_empty.index(xs))
            acc = mma_v2(a, b, acc)
            i += 1
        if PHASE == 1:   # silu(gate) * up with fused_ops.silu_times' rounding, via shared memory
            acc_s.store(acc)
            g = acc_s.slice(0, BLOCK_N // 2).load(out).to(gl.bfloat16).to(gl.float32)
            u = acc_s.slice(BLOCK_N // 2, BLOCK_N // 2).load(out).to(gl.bfloat16).to(gl.float32)
            y = ((g / (1.0 + gl.exp(-g))).to(gl.bfloat16).to(gl.float32) * u).to(gl.bfloat16)
            on = t * (BLOCK_N // 2) + gl.arange(0, BLOCK_N // 2, layout=gl.SliceLayout(1, out))
            gl.store(dst + om[None, :] * I + on[:, None], y, mask=om[None, :] < M)
        else:
            y = gl.convert_layout(acc, out).to(gl.bfloat16)
            on = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out))
            gl.store(dst + om[None, :] * H + on[:, None], y, mask=om[None, :] < M)
    gl.thread_barrier()                          # every consumer thread's stores before the release
    if gl.atomic_add(cnt_ptr, 1, sem="release") == 3 * LAYERS * gl.num_programs(0) - 1:
        gl.atomic_xchg(cnt_ptr, 0)               # the last arrival of all: zero for the next launch
    return i


@gluon.jit
def _consumer(x_ptr, h_ptr, a_ptr, w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty, cnt_ptr, M, LAYERS,
              H: gl.constexpr, I: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
              W_SLOTS: gl.constexpr, X_SLOTS: gl.constexpr, num_warps: gl.constexpr):
    out: gl.constexpr = gl.BlockedLayout([8, 1], [4, 8], [num_warps // 4, 4], [0, 1])
    om = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, out))
    i = 0
    for layer in range(LAYERS):
        i = _c_phase(0, h_ptr + layer * M * H, i, om, w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty,
                     cnt_ptr, M, LAYERS, H, I, BLOCK_N, BLOCK_M, BLOCK_K, W_SLOTS, X_SLOTS, num_warps)
        i = _c_phase(1, a_ptr + layer * M * I, i, om, w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty,
                     cnt_ptr, M, LAYERS, H, I, BLOCK_N, BLOCK_M, BLOCK_K, W_SLOTS, X_SLOTS, num_warps)
        i = _c_phase(2, x_ptr + (layer + 1) * M * H, i, om, w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty,
                     cnt_ptr, M, LAYERS, H, I, BLOCK_N, BLOCK_M, BLOCK_K, W_SLOTS, X_SLOTS, num_warps)


@gluon.jit
def _ws_mlp_kernel(x_ptr, h_ptr, a_ptr, wo_ptr, wgu_ptr, wd_ptr, cnt_ptr, err_ptr, M, LAYERS, H: gl.constexpr,
                   I: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
                   W_SLOTS: gl.constexpr, X_SLOTS: gl.constexpr, SPIN: gl.constexpr, W_WARPS: gl.constexpr,
                   X_WARPS: gl.constexpr, num_warps: gl.constexpr):
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
        mbarrier.init(w_full.index(s), count=W_WARPS * 32)   # each producer thread's copies landed
        mbarrier.init(w_empty.index(s), count=1)             # the consumers' one arrival (thread 0 after a barrier)
    for s in gl.static_range(X_SLOTS):
        mbarrier.init(x_full.index(s), count=X_WARPS * 32)
        mbarrier.init(x_empty.index(s), count=1)
    gl.warp_specialize([
        (_consumer, (x_ptr, h_ptr, a_ptr, w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty, cnt_ptr, M,
                     LAYERS, H, I, BLOCK_N, BLOCK_M, BLOCK_K, W_SLOTS, X_SLOTS, num_warps)),
        (_w_producer, (wo_ptr, wgu_ptr, wd_ptr, w_ring, w_full, w_empty, LAYERS, H, I, BLOCK_N, BLOCK_K, W_SLOTS,
                       W_WARPS)),
        (_x_producer, (x_ptr, h_ptr, a_ptr, x_ring, x_full, x_empty, cnt_ptr, err_ptr, M, LAYERS, H, I, BLOCK_N,
                       BLOCK_M, BLOCK_K, X_SLOTS, SPIN, X_WARPS)),
    ], [W_WARPS, X_WARPS], [48, 48])


def ws_mlp(x, h, a, wo, wgu, wd, cnt, err, w_slots: int = 6, x_slots: int = 4, w_warps: int = 2,
           x_warps: int = 1) -> None:
    """x [L + 1, M, H] (x[0] given), h [L, M, H], a [L, M, I]; wo [L, H, H], wgu [L, 2I, H] (gate
    rows then up rows), wd [L, H, I]: for each layer h = x @ wo.T, a = silu(gate) * up of h @ wgu.T,
    x[l + 1] = a @ wd.T, in one launch of H / 32 programs (all resident at once). cnt: a zeroed
    int32 counter (zero again after the call); err counts x producers that gave up waiting."""
    L, H = wo.shape[0], wo.shape[1]
    I = wd.shape[2]
    M = x.shape[1]
    assert wo.shape == (L, H, H) and wgu.shape == (L, 2 * I, H) and wd.shape == (L, H, I)
    assert x.shape == (L + 1, M, H) and h.shape == (L, M, H) and a.shape == (L, M, I) and M <= BLOCK_M
    assert all(t.is_contiguous() and t.dtype == torch.bfloat16 for t in (x, h, a, wo, wgu, wd))
    assert H % BLOCK_K == 0 and I % BLOCK_K == 0 and (2 * I // BLOCK_N) % (H // BLOCK_N) == 0
    assert H // BLOCK_N <= torch.cuda.get_device_properties(x.device).multi_processor_count
    _ws_mlp_kernel[(H // BLOCK_N,)](x, h, a, wo, wgu, wd, cnt, err, M, L, H=H, I=I, BLOCK_N=BLOCK_N, BLOCK_M=BLOCK_M,
                                    BLOCK_K=BLOCK_K, W_SLOTS=w_slots, X_SLOTS=x_slots, SPIN=SPIN_LIMIT,
                                    W_WARPS=w_warps, X_WARPS=x_warps, num_warps=4)


def mlp_launches(x, h, a, wo, wgu, wd, cfgs) -> None:
    """The same chain as three skinny_gemm launches a layer (PDL), at configs (o, gate_up, down)."""
    from ..kernels.skinny_gemm import skinny_gemm
    for i in range(wo.shape[0]):
        skinny_gemm(x[i], wo[i], *cfgs[0], out=h[i])
        skinny_gemm(h[i], wgu[i], *cfgs[1], out=a[i], silu_mul=True)
        skinny_gemm(a[i], wd[i], *cfgs[2], out=x[i + 1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--m", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--slots", nargs="+", default=["6,4,4,1", "6,4,8,1", "6,4,4,2"],
                    help="W_SLOTS,X_SLOTS,W_WARPS,X_WARPS")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("ws_mlp: CUDA only", file=sys.stderr)
        return 1
    from ..kernels import pdl
    from .gemm import graph_time_us
    from .kernels import copy_bandwidth
    copy_gbps = copy_bandwidth()
    L, M, H, I = args.layers, args.m, args.hidden, args.intermediate
    g = torch.Generator(device="cuda").manual_seed(0)

    def weight(*shape):      # scaled so activations stay O(1) through the layers
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) * shape[-1] ** -0.5
    wo, wgu, wd = weight(L, H, H), weight(L, 2 * I, H), weight(L, H, I)
    wbytes = (wo.numel() + wgu.numel() + wd.numel()) * 2
    cnt = torch.zeros(1, dtype=torch.int32, device="cuda")
    err = torch.zeros(1, dtype=torch.int32, device="cuda")

    def bufs():
        x = torch.zeros(L + 1, M, H, device="cuda", dtype=torch.bfloat16)
        x[0] = torch.randn(M, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)).bfloat16()
        return x, torch.zeros(L, M, H, device="cuda", dtype=torch.bfloat16), torch.zeros(L, M, I, device="cuda",
                                                                                          dtype=torch.bfloat16)
    pdl.set_enabled(True)
    tile = (BLOCK_N, BLOCK_K, 4, 5)
    table = ((32, 256, 4, 5), (128, 128, 8, 4), (64, 128, 4, 5, 2))       # skinny_gemm's _LLAMA3_8B at M = 32
    ref = bufs()
    mlp_launches(*ref, wo, wgu, wd, (tile, tile, tile))
    rows = []

    def timed(name, fn, **kw):
        ms = graph_time_us(lambda i: fn(), 1) / 1e3
        row = dict(way=name, ms=ms, GBps=wbytes / ms / 1e6, us_per_layer_over_copy=(ms - wbytes / copy_gbps / 1e6)
                   * 1e3 / L, **kw)
        print(f"{name:26s} {ms:.3f} ms {row['GBps']:5.0f} GB/s {row['us_per_layer_over_copy']:5.2f} us/layer over copy"
              + "".join(f"  {k} {v}" for k, v in kw.items()), flush=True)
        rows.append(row)

    print(f"{torch.cuda.get_device_name()}: copy {copy_gbps:.0f} GB/s; {L} MLP layers (H {H}, I {I}), M={M}: "
          f"{wbytes / 1e6:.0f} MB, {wbytes / copy_gbps / 1e6:.3f} ms at the copy rate; layers with a nonzero "
          f"output (silu(g) * u is quadratic, so x shrinks to 0 without norms; the bits check means those): "
          f"{int((ref[0][1:].abs().amax(dim=(1, 2)) > 0).sum())}", flush=True)
    timed("launches 32,256,4,5", lambda: mlp_launches(*ref, wo, wgu, wd, (tile, tile, tile)))
    eng = bufs()
    timed("launches table configs", lambda: mlp_launches(*eng, wo, wgu, wd, table))
    for sl in args.slots:
        ws_, xs_, ww_, xw_ = (int(v) for v in sl.split(","))
        out = bufs()
        try:
            ws_mlp(*out, wo, wgu, wd, cnt, err, w_slots=ws_, x_slots=xs_, w_warps=ww_, x_warps=xw_)
            torch.cuda.synchronize()
        except Exception as e:
            print(f"ws {sl}: failed: {type(e).__name__}: {e}"[:400], flush=True)
            rows.append(dict(way=f"ws {sl}", error=f"{type(e).__name__}: {e}"[:300]))
            continue
        same = all(torch.equal(o, r) for o, r in zip(out, ref))
        max_diff = float((out[0].float() - ref[0].float()).abs().max())
        timed(f"ws {sl}", lambda: ws_mlp(*out, wo, wgu, wd, cnt, err, w_slots=ws_, x_slots=xs_, w_warps=ww_,
                                         x_warps=xw_), same_bits=same, max_abs_diff=max_diff,
              wait_timeouts=int(err.item()), counter_after=int(cnt.item()))
    # The same kernel launched once per layer (as a decode layer would run it between attention
    # kernels): what a persistent kernel's own start and end cost at each launch.
    ws_, xs_, ww_, xw_ = (int(v) for v in args.slots[0].split(","))
    per = bufs()

    def per_layer():
        for i in range(L):
            ws_mlp(per[0][i:i + 2], per[1][i:i + 1], per[2][i:i + 1], wo[i:i + 1], wgu[i:i + 1], wd[i:i + 1], cnt,
                   err, w_slots=ws_, x_slots=xs_, w_warps=ww_, x_warps=xw_)
    per_layer()
    torch.cuda.synchronize()
    timed(f"ws {args.slots[0]} a launch per layer", per_layer,
          same_bits=all(torch.equal(o, r) for o, r in zip(per, ref)), wait_timeouts=int(err.item()),
          counter_after=int(cnt.item()))
    timed("launches 32,256,4,5", lambda: mlp_launches(*ref, wo, wgu, wd, (tile, tile, tile)))
    write_json(dict(layers=L, m=M, hidden=H, intermediate=I, copy_GBps=copy_gbps, rows=rows,
                    meta=run_meta("rollout.bench.ws_mlp", argv)), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
