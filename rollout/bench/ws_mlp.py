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
launches at the engine's table configs (plain layout). Printed: ms, GB/s, us a layer over copy.
"""
from __future__ import annotations

import argparse
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mbarrier

from ..kernels.ws_mlp import SPIN as SPIN_LIMIT, count_done, gemm_tiles, w_stream, x_stream
from .__main__ import run_meta, write_json

BLOCK_N, BLOCK_K, BLOCK_M = 32, 256, 32


@gluon.jit
def _w_producer(wo_ptr, wgu_ptr, wd_ptr, w_ring, w_full, w_empty, LAYERS, H: gl.constexpr, I: gl.constexpr,
                BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, SLOTS: gl.constexpr, WARPS: gl.constexpr):
    i = 0
    for layer in range(LAYERS):
        i = w_stream(wo_ptr + layer.to(gl.int64) * H * H, i, w_ring, w_full, w_empty, H, H // BLOCK_N, 0, BLOCK_N,
                     BLOCK_K, SLOTS, WARPS)
        i = w_stream(wgu_ptr + layer.to(gl.int64) * 2 * I * H, i, w_ring, w_full, w_empty, H, 2 * I // BLOCK_N, I,
                     BLOCK_N, BLOCK_K, SLOTS, WARPS)
        i = w_stream(wd_ptr + layer.to(gl.int64) * H * I, i, w_ring, w_full, w_empty, I, H // BLOCK_N, 0, BLOCK_N,
                     BLOCK_K, SLOTS, WARPS)


@gluon.jit
def _x_producer(x_ptr, h_ptr, a_ptr, x_ring, x_full, x_empty, cnt_ptr, err_ptr, M, LAYERS, H: gl.constexpr,
                I: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
                SLOTS: gl.constexpr, SPIN: gl.constexpr):
    i = 0
    for layer in range(LAYERS):      # each GEMM's input is ready once all programs counted the phases before
        i = x_stream(x_ptr + layer * M * H, H, M, i, 3 * layer, cnt_ptr, err_ptr, x_ring, x_full, x_empty, H,
                     H // BLOCK_N, BLOCK_M, BLOCK_K, SLOTS, SPIN)
        i = x_stream(h_ptr + layer * M * H, H, M, i, 3 * layer + 1, cnt_ptr, err_ptr, x_ring, x_full, x_empty, H,
                     2 * I // BLOCK_N, BLOCK_M, BLOCK_K, SLOTS, SPIN)
        i = x_stream(a_ptr + layer * M * I, I, M, i, 3 * layer + 2, cnt_ptr, err_ptr, x_ring, x_full, x_empty, I,
                     H // BLOCK_N, BLOCK_M, BLOCK_K, SLOTS, SPIN)


@gluon.jit
def _consumer(x_ptr, h_ptr, a_ptr, w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty, cnt_ptr, M, LAYERS,
              H: gl.constexpr, I: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
              W_SLOTS: gl.constexpr, X_SLOTS: gl.constexpr, num_warps: gl.constexpr):
    last = 3 * LAYERS * gl.num_programs(0) - 1
    i = 0
    for layer in range(LAYERS):
        i = gemm_tiles(h_ptr + layer * M * H, H, M, i, w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty, H,
                       H // BLOCK_N, 0, BLOCK_N, BLOCK_M, BLOCK_K, W_SLOTS, X_SLOTS, num_warps)
        count_done(cnt_ptr, last)
        i = gemm_tiles(a_ptr + layer * M * I, I, M, i, w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty, H,
                       2 * I // BLOCK_N, I, BLOCK_N, BLOCK_M, BLOCK_K, W_SLOTS, X_SLOTS, num_warps)
        count_done(cnt_ptr, last)
        i = gemm_tiles(x_ptr + (layer + 1) * M * H, H, M, i, w_ring, x_ring, acc_s, w_full, w_empty, x_full,
                       x_empty, I, H // BLOCK_N, 0, BLOCK_N, BLOCK_M, BLOCK_K, W_SLOTS, X_SLOTS, num_warps)
        count_done(cnt_ptr, last)


@gluon.jit
def _ws_mlp_kernel(x_ptr, h_ptr, a_ptr, wo_ptr, wgu_ptr, wd_ptr, cnt_ptr, err_ptr, M, LAYERS, H: gl.constexpr,
                   I: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
                   W_SLOTS: gl.constexpr, X_SLOTS: gl.constexpr, SPIN: gl.constexpr, W_WARPS: gl.constexpr,
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
        mbarrier.init(w_full.index(s), count=W_WARPS * 32)
        mbarrier.init(w_empty.index(s), count=1)
    for s in gl.static_range(X_SLOTS):
        mbarrier.init(x_full.index(s), count=32)
        mbarrier.init(x_empty.index(s), count=1)
    gl.warp_specialize([
        (_consumer, (x_ptr, h_ptr, a_ptr, w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty, cnt_ptr, M,
                     LAYERS, H, I, BLOCK_N, BLOCK_M, BLOCK_K, W_SLOTS, X_SLOTS, num_warps)),
        (_w_producer, (wo_ptr, wgu_ptr, wd_ptr, w_ring, w_full, w_empty, LAYERS, H, I, BLOCK_N, BLOCK_K, W_SLOTS,
                       W_WARPS)),
        (_x_producer, (x_ptr, h_ptr, a_ptr, x_ring, x_full, x_empty, cnt_ptr, err_ptr, M, LAYERS, H, I, BLOCK_N,
                       BLOCK_M, BLOCK_K, X_SLOTS, SPIN)),
    ], [W_WARPS, 1], [48, 48])


def ws_mlp(x, h, a, wo, wgu, wd, cnt, err, w_slots: int = 6, x_slots: int = 4, w_warps: int = 4) -> None:
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
                                    W_WARPS=w_warps, num_warps=4)


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
    ap.add_argument("--slots", nargs="+", default=["6,4,4", "6,4,8", "8,4,4", "5,5,4"],
                    help="W_SLOTS,X_SLOTS,W_WARPS (the x producer is one warp)")
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
        ws_, xs_, ww_ = (int(v) for v in sl.split(","))
        out = bufs()
        try:
            ws_mlp(*out, wo, wgu, wd, cnt, err, w_slots=ws_, x_slots=xs_, w_warps=ww_)
            torch.cuda.synchronize()
        except Exception as e:
            print(f"ws {sl}: failed: {type(e).__name__}: {e}"[:400], flush=True)
            rows.append(dict(way=f"ws {sl}", error=f"{type(e).__name__}: {e}"[:300]))
            continue
        same = all(torch.equal(o, r) for o, r in zip(out, ref))
        max_diff = float((out[0].float() - ref[0].float()).abs().max())
        timed(f"ws {sl}", lambda: ws_mlp(*out, wo, wgu, wd, cnt, err, w_slots=ws_, x_slots=xs_, w_warps=ww_),
              same_bits=same, max_abs_diff=max_diff,
              wait_timeouts=int(err.item()), counter_after=int(cnt.item()))
    timed("launches 32,256,4,5", lambda: mlp_launches(*ref, wo, wgu, wd, (tile, tile, tile)))
    write_json(dict(layers=L, m=M, hidden=H, intermediate=I, copy_GBps=copy_gbps, rows=rows,
                    meta=run_meta("rollout.bench.ws_mlp", argv)), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
