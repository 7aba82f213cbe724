"""Does a weight stream that never stops at a layer boundary close the GEMMs' boundary cost?
CUDA (sm_90) only; an experiment for issue 4.

    python -m rollout.bench.ws_chain --layers 32 --n 4096 --m 32 --out bench/results/<name>.json

bench.chain's 32 dependent o_proj-shaped GEMMs (x[l + 1] = x[l] @ W[l].T, M rows) run ~3.8 us a
layer over the copy rate as PDL launches, and as a persistent kernel with a grid barrier too
(tenth session): there the programs that wait at the barrier are the ones that issue the weight
loads, so HBM idles while the layer drains. Here one persistent program per output tile is
warp-specialized (Gluon):
- a weight producer (W_WARPS warps) streams the program's weight tiles of every layer, in order, into a
  ring of SLOTS shared-memory slots (cp.async, an mbarrier per slot each way). It never waits
  for data, only for a free slot, so across a boundary it keeps loading the next layer's tiles
  while the layer drains: the ring holds up to SLOTS * 16 KB a program (~4 us of HBM);
- an x producer (X_WARPS warps) waits until every program has stored layer l (a counter in global memory,
  released by each program's consumers), then copies x[l]'s K tiles into a second ring;
- 4 consumer warps multiply (mma.sync, the skinny GEMM's 32 x 256 tile, warps 2 x 2) and store
  the output tile, then release the counter.
The product order is the skinny GEMM's (fp32 in K order per tile), so the chain's output is
compared bit for bit with the PDL launches first. Printed: ms, GB/s and us a layer over copy.
Measured (bench/results/README.md, eighteenth session): bits equal; 2.6-2.7 us a layer over copy
with two or more weight producer warps against 3.7-3.9 for the launches; one warp 5.3-6.5 (its
copies in flight cap the stream); FLAGS 14-21 (16 serial polls a layer); MMA=0 2.1.
"""
from __future__ import annotations

import argparse
import functools
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mbarrier, mma_v2

from ..kernels import sm_count
from ..kernels.decode_layers import rings  # noqa: F401  (ws_mlp, ws_layer import it from here)
from ..kernels.decode_layers import wait_count as _wait_count
from .__main__ import run_meta, write_json

SPIN_LIMIT = 1 << 22     # counter polls before the x producer gives up (and counts it): no hang


@gluon.jit
def _w_producer(w_ptr, w_ring, w_full, w_empty, N, LAYERS, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                SLOTS: gl.constexpr, WARPS: gl.constexpr):
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_K, BLOCK_K // 8], [WARPS, 1], [1, 0])
    rn = gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
    rk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, ld))
    ptrs = w_ptr + rn.to(gl.int64)[:, None] * N + rk[None, :]
    k_tiles = N // BLOCK_K
    for i in range(LAYERS * k_tiles):
        s = i % SLOTS
        mbarrier.wait(w_empty.index(s), ((i // SLOTS) & 1) ^ 1)     # a fresh slot passes at once
        layer = i // k_tiles
        async_copy.async_copy_global_to_shared(
            w_ring.index(s), ptrs + layer.to(gl.int64) * N * N + (i % k_tiles) * BLOCK_K)
        async_copy.mbarrier_arrive(w_full.index(s), increment_count=False)


@gluon.jit
def _x_producer(x_ptr, x_ring, x_full, x_empty, cnt_ptr, err_ptr, M, N, LAYERS, BLOCK_N: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, SLOTS: gl.constexpr, SPIN: gl.constexpr,
                WARPS: gl.constexpr, FLAGS: gl.constexpr):
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_K, BLOCK_K // 8], [WARPS, 1], [1, 0])
    rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
    rk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, ld))
    ptrs = x_ptr + rm[:, None] * N + rk[None, :]
    ok = (rm[:, None] < M) & (rk[None, :] < BLOCK_K)
    tiles = gl.num_programs(0)
    k_tiles = N // BLOCK_K
    for layer in range(LAYERS):
        if not FLAGS:
            if layer > 0:             # every program has stored layer - 1's tile
                _wait_count(cnt_ptr, layer * tiles, err_ptr, SPIN)
        for kt in range(k_tiles):
            if FLAGS:
                if layer > 0:         # the BLOCK_K / BLOCK_N programs that store this K tile of x have
                    _wait_count(cnt_ptr + 1 + (layer - 1) * k_tiles + kt, BLOCK_K // BLOCK_N, err_ptr, SPIN)
            i = layer * k_tiles + kt
            s = i % SLOTS
            mbarrier.wait(x_empty.index(s), ((i // SLOTS) & 1) ^ 1)
            async_copy.async_copy_global_to_shared(x_ring.index(s), ptrs + layer * M * N + kt * BLOCK_K, mask=ok,
                                                   cache_modifier=".cg")     # from L2: other SMs wrote it
            async_copy.mbarrier_arrive(x_full.index(s), increment_count=False)


@gluon.jit
def _consumer(x_ptr, w_ring, x_ring, w_full, w_empty, x_full, x_empty, cnt_ptr, M, N, LAYERS,
              BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, W_SLOTS: gl.constexpr,
              X_SLOTS: gl.constexpr, FLAGS: gl.constexpr, MMA: gl.constexpr, num_warps: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps // 2, 2],
                                                  instr_shape=[16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    out: gl.constexpr = gl.BlockedLayout([8, 1], [4, 8], [num_warps // 4, 4], [0, 1])
    om = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, out))
    on = gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out))
    tiles = gl.num_programs(0)
    k_tiles = N // BLOCK_K
    for layer in range(LAYERS):
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
        for kt in range(k_tiles):
            i = layer * k_tiles + kt
            ws = i % W_SLOTS
            xs = i % X_SLOTS
            mbarrier.wait(w_full.index(ws), (i // W_SLOTS) & 1)
            mbarrier.wait(x_full.index(xs), (i // X_SLOTS) & 1)
            if MMA:
                a = w_ring.index(ws).load(a_op)
                b = x_ring.index(xs).permute((1, 0)).load(b_op)
            mbarrier.arrive(w_empty.index(ws))
            mbarrier.arrive(x_empty.index(xs))
            if MMA:       # (else a timing diagnostic: the tiles are waited for and released, not read)
                acc = mma_v2(a, b, acc)
        y = gl.convert_layout(acc, out).to(gl.bfloat16)
        gl.store(x_ptr + (layer + 1) * M * N + om[None, :] * N + on[:, None], y, mask=(om[None, :] < M))
        gl.thread_barrier()                          # every consumer thread's stores before the release
        if FLAGS:                                    # the count of this K tile of the next layer's x
            gl.atomic_add(cnt_ptr + 1 + layer * k_tiles + gl.program_id(0) * BLOCK_N // BLOCK_K, 1, sem="release")
        elif gl.atomic_add(cnt_ptr, 1, sem="release") == LAYERS * tiles - 1:
            gl.atomic_xchg(cnt_ptr, 0)               # the last arrival of all: zero for the next launch
    if FLAGS:   # the last program out zeroes the flags: every x producer has read its last one by now
        if gl.atomic_add(cnt_ptr, 1, sem="acq_rel") == tiles - 1:
            for j in range(LAYERS * k_tiles + 1):
                gl.atomic_xchg(cnt_ptr + j, 0)


@gluon.jit
def _ws_chain_kernel(x_ptr, w_ptr, cnt_ptr, err_ptr, M, N, LAYERS, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_K: gl.constexpr, W_SLOTS: gl.constexpr, X_SLOTS: gl.constexpr, SPIN: gl.constexpr,
                     W_WARPS: gl.constexpr, X_WARPS: gl.constexpr, FLAGS: gl.constexpr, MMA: gl.constexpr,
                     num_warps: gl.constexpr):
    w_ring, x_ring, _, w_full, w_empty, x_full, x_empty = rings(W_SLOTS, X_SLOTS, BLOCK_N, BLOCK_M, BLOCK_K, W_WARPS,
                                                                X_WARPS)
    gl.warp_specialize([
        (_consumer, (x_ptr, w_ring, x_ring, w_full, w_empty, x_full, x_empty, cnt_ptr, M, N, LAYERS, BLOCK_N,
                     BLOCK_M, BLOCK_K, W_SLOTS, X_SLOTS, FLAGS, MMA, num_warps)),
        (_w_producer, (w_ptr, w_ring, w_full, w_empty, N, LAYERS, BLOCK_N, BLOCK_K, W_SLOTS, W_WARPS)),
        (_x_producer, (x_ptr, x_ring, x_full, x_empty, cnt_ptr, err_ptr, M, N, LAYERS, BLOCK_N, BLOCK_M, BLOCK_K,
                       X_SLOTS, SPIN, X_WARPS, FLAGS)),
    ], [W_WARPS, X_WARPS], [48, 48])


def ws_chain(x: torch.Tensor, w: torch.Tensor, cnt: torch.Tensor, err: torch.Tensor, block_n: int = 32,
             block_k: int = 256, w_slots: int = 8, x_slots: int = 4, w_warps: int = 1, x_warps: int = 1,
             flags: bool = False, mma: bool = True) -> None:
    """x [L + 1, M, N] (x[0] given), w [L, N, N] -> x[1:] in one launch of N / block_n programs,
    which must all be resident at once (one per SM). cnt: zeroed int32 counters (zero again after
    the call): one, or with `flags` L * N / block_k + 1 (a count per K tile of each layer's output,
    so a K tile of x is loaded once the block_k / block_n programs that store it have, not the
    whole layer); err counts x producers that gave up waiting. mma=False: a timing diagnostic, the
    consumers wait for each tile and release it without reading it (x[1:] is then zeros)."""
    L, N = w.shape[0], w.shape[1]
    M = x.shape[1]
    assert w.shape == (L, N, N) and x.shape == (L + 1, M, N) and N % block_n == 0 and N % block_k == 0
    assert x.is_contiguous() and w.is_contiguous() and M <= 32 and x.dtype == w.dtype == torch.bfloat16
    assert N // block_n <= sm_count(x.device)
    assert cnt.numel() >= (L * (N // block_k) + 1 if flags else 1) and block_k % block_n == 0
    _ws_chain_kernel[(N // block_n,)](x, w, cnt, err, M, N, L, BLOCK_N=block_n, BLOCK_M=32, BLOCK_K=block_k,
                                      W_SLOTS=w_slots, X_SLOTS=x_slots, SPIN=SPIN_LIMIT, W_WARPS=w_warps,
                                      X_WARPS=x_warps, FLAGS=flags, MMA=mma, num_warps=4)


def time_row(rows: list, name: str, fn, nbytes: int, copy_gbps: float, layers: int, width: int, **kw) -> None:
    """Time fn() (one CUDA graph of it) and append and print its row: ms, GB/s (nbytes / time), us
    a layer over the copy rate; kw are stored and printed beside."""
    from .gemm import graph_time_us
    ms = graph_time_us(lambda i: fn(), 1) / 1e3
    row = dict(way=name, ms=ms, GBps=nbytes / ms / 1e6,
               us_per_layer_over_copy=(ms - nbytes / copy_gbps / 1e6) * 1e3 / layers, **kw)
    print(f"{name:{width}s} {ms:.3f} ms {row['GBps']:5.0f} GB/s {row['us_per_layer_over_copy']:5.2f} us/layer over copy"
          + "".join(f"  {k} {v}" for k, v in kw.items()), flush=True)
    rows.append(row)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--m", type=int, default=32)
    ap.add_argument("--slots", nargs="+", default=["6,4,2,1,0,1", "6,4,2,1,0,0", "6,6,2,1,0,1", "4,4,2,1,0,1",
                                                   "4,4,2,1,0,0", "8,4,2,1,0,0"],
                    help="W_SLOTS,X_SLOTS,W_WARPS,X_WARPS,FLAGS,MMA (producer warps: one warp's cp.async in flight is "
                         "capped; FLAGS: per K tile counts instead of one per layer; MMA 0: tiles not read)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("ws_chain: CUDA only", file=sys.stderr)
        return 1
    from ..kernels import pdl
    from .chain import chain_launches
    from .kernels import copy_bandwidth
    copy_gbps = copy_bandwidth()
    L, N, M = args.layers, args.n, args.m
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(L, N, N, device="cuda", dtype=torch.bfloat16, generator=g) * N ** -0.5
    wbytes = w.numel() * 2
    cnt = torch.zeros(L * (N // 256) + 1, dtype=torch.int32, device="cuda")
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    x_ref = torch.zeros(L + 1, M, N, device="cuda", dtype=torch.bfloat16)
    x_ref[0] = torch.randn(M, N, device="cuda", generator=g).bfloat16()
    pdl.set_enabled(True)
    chain_launches(x_ref, w, 32, 256, 4, 5)
    rows = []

    timed = functools.partial(time_row, rows, nbytes=wbytes, copy_gbps=copy_gbps, layers=L, width=24)

    print(f"{torch.cuda.get_device_name()}: copy {copy_gbps:.0f} GB/s; {L} layers of {N}x{N}, M={M}: "
          f"{wbytes / 1e6:.0f} MB, {wbytes / copy_gbps / 1e6:.3f} ms at the copy rate", flush=True)
    timed("launches 32,256,4,5", lambda: chain_launches(x_ref, w, 32, 256, 4, 5))
    for sl in args.slots:
        ws_, xs_, ww_, xw_, fl_, mma_ = (int(v) for v in sl.split(","))
        x = x_ref.clone()
        x[1:] = 0
        try:
            ws_chain(x, w, cnt, err, w_slots=ws_, x_slots=xs_, w_warps=ww_, x_warps=xw_, flags=bool(fl_),
                     mma=bool(mma_))
            torch.cuda.synchronize()
        except Exception as e:
            print(f"ws {sl}: failed: {type(e).__name__}: {e}"[:400], flush=True)
            rows.append(dict(way=f"ws {sl}", error=f"{type(e).__name__}: {e}"[:300]))
            continue
        same = bool(torch.equal(x, x_ref))
        max_diff = float((x.float() - x_ref.float()).abs().max())
        timed(f"ws {sl}", lambda: ws_chain(x, w, cnt, err, w_slots=ws_, x_slots=xs_, w_warps=ww_, x_warps=xw_,
                                           flags=bool(fl_), mma=bool(mma_)), same_bits=same,
              max_abs_diff=max_diff, wait_timeouts=int(err.item()), counters_after=int(cnt.abs().sum().item()))
    timed("launches 32,256,4,5", lambda: chain_launches(x_ref, w, 32, 256, 4, 5))
    write_json(dict(layers=L, n=N, m=M, copy_GBps=copy_gbps, rows=rows, meta=run_meta("rollout.bench.ws_chain", argv)),
               args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
