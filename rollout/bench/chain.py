"""What a kernel boundary costs the small decode GEMMs, and whether one persistent kernel gets
it back. CUDA only; an experiment for issue 4 (the decode step's GEMMs run ~0.5 ms above their
bytes at the copy rate, ~4-7 us per launch even with PDL).

    python -m rollout.bench.chain --layers 32 --n 4096 --m 32 --out bench/results/<name>.json

A chain of dependent skinny GEMMs, x[i+1] = x[i] @ W[i].T (bf16, W [N, N], M rows), shaped like
o_proj layer after layer, timed inside a CUDA graph:
- `launches`: one skinny_gemm launch per layer, with PDL, as the decode graph runs them
  (`launches_no_pdl`: without);
- `persistent`: one launch of `_chain_kernel`, one program per SM. Each program takes every
  `grid`-th weight tile of a layer; between layers all programs meet at a grid barrier (one
  arrival counter). A program loads its first weight tile of the next layer before it waits, so
  HBM keeps streaming while the layer before drains, and no grid is launched or ramped up;
- `prefetch`: the same, and before waiting each program also asks L2 for its whole next tile;
- `queue` / `queue_prefetch`: one launch whose programs take (layer, tile) items from an atomic
  work queue and wait per layer on a done count (`_chain_queue_kernel`): deadlock-free for any
  grid, which a decode kernel next to other GPU work would need.
All use the same tiles and K order, so their outputs are compared bit for bit first. Printed:
GB/s (weight bytes / time) against the copy rate, and the cost per layer boundary, (time -
bytes at the copy rate) / layers.
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from ..kernels import fix_interpreter
from .__main__ import run_meta, write_json

fix_interpreter()

SPIN_LIMIT = 1 << 20    # barrier polls before a program gives up (and flags it): no hang if not co-resident


@triton.jit
def prefetch_l2(ptr, nbytes):
    """Ask L2 for nbytes (a multiple of 16) from ptr: bulk prefetches (sm_90) of 32 KB pieces,
    issued by thread 0 only. Nothing is held while the bytes arrive."""
    for off in range(0, nbytes, 32768):
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [ptr + off, tl.minimum(nbytes - off, 32768)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def wait_at_least(ptr, target, err_ptr, SPIN: tl.constexpr):
    """Poll the counter at ptr until it reaches target (or SPIN polls: then count it in err), then
    an acquire, so what the counting programs wrote before their release is visible."""
    polls = 0
    while (tl.load(ptr, volatile=True) < target) & (polls < SPIN):
        polls += 1
    if polls >= SPIN:
        tl.atomic_add(err_ptr, 1)
    tl.atomic_add(ptr, 0, sem="acquire")


@triton.jit
def _layer_tile(x_in, w_l, w0, rn, rm, rk, m_ok, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """Output columns rn of the layer: x_in [M, N] @ w_l[rn].T in K order (skinny_gemm's tiles and
    order), stored to the next layer's x. w0: the weight tile at K 0, already loaded. x from L2
    (.cg): other SMs wrote it."""
    w_ptrs = w_l + rn.to(tl.int64)[:, None] * N + rk[None, :]
    x_ptrs = x_in + rm[:, None] * N + rk[None, :]
    acc = tl.dot(w0, tl.trans(tl.load(x_ptrs, mask=m_ok, other=0.0, cache_modifier=".cg")),
                 tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32))
    for _ in range(1, N // BLOCK_K):
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        acc = tl.dot(tl.load(w_ptrs), tl.trans(tl.load(x_ptrs, mask=m_ok, other=0.0, cache_modifier=".cg")), acc)
    tl.store(x_in + M * N + rm[None, :] * N + rn[:, None], acc.to(x_in.dtype.element_ty), mask=rm[None, :] < M)


@triton.jit
def _chain_kernel(x_ptr, w_ptr, bar_ptr, err_ptr, M, N, LAYERS,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPIN: tl.constexpr,
                  PREFETCH: tl.constexpr):
    """x [LAYERS + 1, M, N] (x[0] the input), w [LAYERS, N, N]; x[l + 1] = x[l] @ w[l].T. PREFETCH:
    before waiting, also ask L2 for all of this program's first weight tile of the layer (BLOCK_N
    whole rows: one contiguous range), so HBM streams it during the wait and the drain."""
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm[:, None] < M
    tiles = N // BLOCK_N
    for layer in range(LAYERS):
        w_l = w_ptr + (layer * N).to(tl.int64) * N
        x_in = x_ptr + layer * M * N
        rn0 = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        # The first weight tile does not depend on the layer before: load it, then wait.
        if PREFETCH:
            if pid < tiles:
                prefetch_l2(w_l + pid * BLOCK_N * N, BLOCK_N * N * 2)
        w_first = tl.load(w_l + rn0.to(tl.int64)[:, None] * N + rk[None, :], mask=rn0[:, None] < N, other=0.0)
        if layer > 0:   # every program, with tiles or not, so the count means "layer - 1 finished"
            wait_at_least(bar_ptr, layer * progs, err_ptr, SPIN)
        for t in range(pid, tiles, progs):
            rn = t * BLOCK_N + tl.arange(0, BLOCK_N)
            if t == pid:
                w = w_first
            else:
                w = tl.load(w_l + rn.to(tl.int64)[:, None] * N + rk[None, :])
            _layer_tile(x_in, w_l, w, rn, rm, rk, m_ok, M, N, BLOCK_M, BLOCK_N, BLOCK_K)
        tl.debug_barrier()                           # every thread's stores before the arrival
        if tl.atomic_add(bar_ptr, 1, sem="release") == LAYERS * progs - 1:
            tl.atomic_xchg(bar_ptr, 0)               # the last arrival of all: ready for the next launch


@triton.jit
def _chain_queue_kernel(x_ptr, w_ptr, cnt_ptr, err_ptr, M, N, LAYERS,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPIN: tl.constexpr,
                        PREFETCH: tl.constexpr):
    """The same chain from a work queue: items are (layer, tile) in layer order; a program takes
    the next item (an atomic counter), asks for its weights, then waits until the layer before is
    done (a count per layer). Every wait is on earlier items, which running programs hold, so it
    cannot deadlock whatever the grid (under the interpreter one program does all). A program
    takes its next item before working on this one, so the atomic's latency hides. cnt: int32
    [queue, exited, done per layer], zero between calls: the last program out resets them."""
    progs = tl.num_programs(0)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm[:, None] < M
    tiles = N // BLOCK_N
    item = tl.atomic_add(cnt_ptr, 1)
    while item < LAYERS * tiles:
        nxt = tl.atomic_add(cnt_ptr, 1)
        layer = item // tiles
        rn = (item % tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        w_l = w_ptr + (layer * N).to(tl.int64) * N
        if PREFETCH:
            prefetch_l2(w_l + (item % tiles) * BLOCK_N * N, BLOCK_N * N * 2)
        w0 = tl.load(w_l + rn.to(tl.int64)[:, None] * N + rk[None, :])
        if layer > 0:
            wait_at_least(cnt_ptr + 1 + layer, tiles, err_ptr, SPIN)     # done[layer - 1]
        _layer_tile(x_ptr + layer * M * N, w_l, w0, rn, rm, rk, m_ok, M, N, BLOCK_M, BLOCK_N, BLOCK_K)
        tl.debug_barrier()                       # every thread's stores before the release
        tl.atomic_add(cnt_ptr + 2 + layer, 1, sem="release")
        item = nxt
    if tl.atomic_add(cnt_ptr + 1, 1, sem="acq_rel") == progs - 1:   # the last one out: no one touches them now
        for i in range(LAYERS + 2):
            tl.store(cnt_ptr + i, 0)


def chain_persistent(x: torch.Tensor, w: torch.Tensor, bar: torch.Tensor, err: torch.Tensor, block_n: int,
                     block_k: int, num_warps: int, num_stages: int, grid: int, prefetch: bool = False) -> None:
    """x [L + 1, M, N] (x[0] given), w [L, N, N] -> x[1:], in one launch of `grid` programs, which
    must all be resident at once (grid <= SMs at one program per SM). bar: a zeroed int32 counter
    (zero again after the call); err counts programs that gave up waiting. prefetch: the L2 bulk
    prefetch of each first tile (sm_90 PTX: not under the interpreter)."""
    L, N = w.shape[0], w.shape[1]
    M = x.shape[1]
    assert w.shape == (L, N, N) and x.shape == (L + 1, M, N) and N % block_n == 0 and N % block_k == 0
    assert x.is_contiguous() and w.is_contiguous() and M <= 64
    _chain_kernel[(grid,)](x, w, bar, err, M, N, L, BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=block_n,
                           BLOCK_K=block_k, SPIN=SPIN_LIMIT, PREFETCH=prefetch, num_warps=num_warps,
                           num_stages=num_stages)


def chain_queue(x: torch.Tensor, w: torch.Tensor, cnt: torch.Tensor, err: torch.Tensor, block_n: int, block_k: int,
                num_warps: int, num_stages: int, grid: int, prefetch: bool = False) -> None:
    """As chain_persistent, from a work queue (`_chain_queue_kernel`): any grid is safe. cnt: at
    least L + 2 zeroed int32 counters (zero again after the call)."""
    L, N = w.shape[0], w.shape[1]
    M = x.shape[1]
    assert w.shape == (L, N, N) and x.shape == (L + 1, M, N) and N % block_n == 0 and N % block_k == 0
    assert x.is_contiguous() and w.is_contiguous() and M <= 64 and cnt.numel() >= L + 2
    _chain_queue_kernel[(grid,)](x, w, cnt, err, M, N, L, BLOCK_M=max(16, triton.next_power_of_2(M)),
                                 BLOCK_N=block_n, BLOCK_K=block_k, SPIN=SPIN_LIMIT, PREFETCH=prefetch,
                                 num_warps=num_warps, num_stages=num_stages)


def chain_launches(x: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int, num_warps: int,
                   num_stages: int) -> None:
    """The same chain as one skinny_gemm launch per layer."""
    from ..kernels.skinny_gemm import skinny_gemm
    for i in range(w.shape[0]):
        skinny_gemm(x[i], w[i], block_n, block_k, num_warps, num_stages, out=x[i + 1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--n", type=int, default=4096, help="weights are N x N (o_proj of the 8B shape: 4096)")
    ap.add_argument("--m", type=int, default=32, help="rows (the decode batch)")
    ap.add_argument("--configs", nargs="+", default=["32,256,4,5", "64,128,4,5", "64,128,4,3"],
                    help="BLOCK_N,BLOCK_K,num_warps,num_stages, each timed both ways")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("rollout.bench.chain needs a CUDA GPU")
    from ..kernels import pdl
    from .gemm import graph_time_us
    from .kernels import copy_bandwidth
    copy_gbps = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    L, N, M = args.layers, args.n, args.m
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(L, N, N, device="cuda", dtype=torch.bfloat16, generator=g) * N ** -0.5   # keeps |x| steady
    wbytes = w.numel() * 2
    bar = torch.zeros(1, dtype=torch.int32, device="cuda")
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    cnt = torch.zeros(L + 2, dtype=torch.int32, device="cuda")
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbps:.0f} GB/s; {L} layers of {N}x{N}, M={M}: "
          f"{wbytes / 1e6:.0f} MB, {wbytes / copy_gbps / 1e6:.3f} ms at the copy rate", flush=True)
    rows = []
    pdl.set_enabled(True)
    for cfg in args.configs:
        bn, bk, nw, ns = (int(v) for v in cfg.split(","))
        xs = {k: torch.zeros(L + 1, M, N, device="cuda", dtype=torch.bfloat16) for k in ("launches", "persistent")}
        for x in xs.values():
            x[0] = torch.randn(M, N, device="cuda", generator=g.manual_seed(1)).bfloat16()
        row = dict(config=cfg, grid=sms, weight_bytes=wbytes)
        try:
            chain_launches(xs["launches"], w, bn, bk, nw, ns)
            chain_persistent(xs["persistent"], w, bar, err, bn, bk, nw, ns, sms)
            torch.cuda.synchronize()
        except Exception as e:       # e.g. out of shared memory
            row["error"] = f"{type(e).__name__}: {e}"[:300]
            print(f"{cfg}: failed: {row['error']}", flush=True)
            rows.append(row)
            continue
        row["same_bits"] = bool(torch.equal(xs["launches"], xs["persistent"]))
        row["barrier_timeouts"] = int(err.item())
        row["counter_after"] = int(bar.item())
        ways = {"launches": lambda: chain_launches(xs["launches"], w, bn, bk, nw, ns),
                "launches_no_pdl": lambda: (pdl.set_enabled(False), chain_launches(xs["launches"], w, bn, bk, nw, ns),
                                            pdl.set_enabled(True)),
                "persistent": lambda: chain_persistent(xs["persistent"], w, bar, err, bn, bk, nw, ns, sms),
                "prefetch": lambda: chain_persistent(xs["prefetch"], w, bar, err, bn, bk, nw, ns, sms, prefetch=True),
                "queue": lambda: chain_queue(xs["queue"], w, cnt, err, bn, bk, nw, ns, sms),
                "queue_prefetch": lambda: chain_queue(xs["queue_prefetch"], w, cnt, err, bn, bk, nw, ns, sms,
                                                      prefetch=True)}
        for name in ("prefetch", "queue", "queue_prefetch"):   # checked against the launches first
            xs[name] = xs["persistent"].clone()
            xs[name][1:] = 0
            try:
                ways[name]()
                torch.cuda.synchronize()
                row[f"{name}_same_bits"] = bool(torch.equal(xs[name], xs["launches"]))
            except Exception as e:
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
                print(f"{cfg}: {name} failed: {row[name + '_error']}", flush=True)
                del ways[name]
        row["counters_after"] = int(cnt.abs().sum().item())
        for name, fn in ways.items():
            ms = graph_time_us(lambda i, fn=fn: fn(), 1) / 1e3   # one graph of the whole chain
            row[f"{name}_ms"], row[f"{name}_GBps"] = ms, wbytes / ms / 1e6
            row[f"{name}_us_per_boundary"] = (ms - wbytes / copy_gbps / 1e6) * 1e3 / L
        row["barrier_timeouts_after_timing"] = int(err.item())
        print(f"{cfg}: " + " | ".join(f"{k} {row[k + '_ms']:.3f} ms {row[k + '_GBps']:5.0f} GB/s "
                                      f"({row[k + '_us_per_boundary']:.1f} us/layer over copy)" for k in ways)
              + f" | same bits: {row['same_bits']}, "
              + ", ".join(f"{k} {row.get(k + '_same_bits')}" for k in ("prefetch", "queue", "queue_prefetch"))
              + f"; wait timeouts {row['barrier_timeouts_after_timing']}, counters {int(bar.item())} "
              f"{int(cnt.abs().sum().item())}", flush=True)
        rows.append(row)
    write_json(dict(layers=L, n=N, m=M, copy_GBps=copy_gbps, sms=sms, rows=rows,
                    meta=run_meta("rollout.bench.chain", argv)), args.out)


if __name__ == "__main__":
    main()
