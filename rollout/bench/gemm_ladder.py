"""Where a packed skinny GEMM's time goes above a pure read of its weight. CUDA only; issue 4.

    python -m rollout.bench.gemm_ladder --m 32 --out bench/results/<name>.json

The packed decode GEMMs run ~3 us a launch above a pure read of the same bytes (seventeenth
session: o_proj 12.9 against 9.8 us). For each linear at the engine's packed config, one rung
at a time is taken away, same grid, tiles, warps and stages, each call in a CUDA graph with PDL
(as decode runs them), cycling over enough weight copies that none stays in L2:
- `engine`: skinny_gemm on the packed weight (what the decode graphs run);
- `x_once`: the same loop, x's first K tile loaded once and reused (no x traffic from L2);
- `no_mma`: the weight tiles summed in fp32 registers (no x, no MMA; same loads);
- `read_grid`: bench.attn_ceiling's pure read kernel with the GEMM's program count, stages and
  tile bytes (4 warps);
- `read_4_per_sm`: the same kernel at 4 programs per SM, 4 stages (the twelfth session's ceiling);
- `x_left[config]`: the whole product with x as the MMA's left operand (wgmma for 32-row weight
  tiles, which get mma.sync as the left operand), beside `engine[config]`, the engine's kernel
  at that config.
The step between two rungs is what that part costs.
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from ..kernels import fix_interpreter, sm_count
from ..kernels.pdl import enter, pdl_for
from .__main__ import run_meta, write_json
from .attn_ceiling import read_bytes
from .gemm import L2_BYTES, graph_time_us, linear_shapes
from .shapes import SHAPES, make_config

fix_interpreter()

# name -> the engine's config at M = 32 on a packed weight (skinny_gemm.pick_config(..., packed=True)),
# where that config reads all of K: the rungs have no split-K, so o_proj and down keep the whole-K
# tiles they had before the engine split them in two (twenty-third session)
CONFIGS = {"qkv": (64, 128, 4, 5), "o_proj": (32, 256, 4, 5), "gate_up": (128, 64, 8, 5),
           "down": (32, 256, 4, 5), "lm_head": (64, 128, 4, 3)}
# configs for the x_left rung (x as wgmma's 64-row left operand, half of it masked rows at M = 32, so
# the 32-row weight tiles get wgmma instead of mma.sync); its shared memory caps BLOCK_K * stages
X_LEFT = {"qkv": ((64, 128, 4, 4),), "o_proj": ((32, 128, 4, 6), (32, 128, 4, 8), (32, 64, 4, 10)),
          "gate_up": ((128, 64, 8, 4),), "down": ((32, 128, 4, 6), (32, 128, 4, 8), (32, 64, 4, 10)),
          "lm_head": ((64, 128, 4, 3),)}


@triton.jit
def _rung_kernel(x_ptr, w_ptr, y_ptr, M, K, s_xm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, STAGES: tl.constexpr, X_ONCE: tl.constexpr, NO_MMA: tl.constexpr,
                 X_LEFT: tl.constexpr, PDL: tl.constexpr):
    """Program p reads packed weight tile p ([K / BLOCK_K, BLOCK_N, BLOCK_K], contiguous) as the
    skinny GEMM does; X_ONCE: x's first K tile only; NO_MMA: the tiles summed, x not read;
    X_LEFT: the full product with x as the MMA's left operand (acc [BLOCK_M, BLOCK_N])."""
    pid = tl.program_id(0)
    rn, rk, rm = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_M)
    w_ptrs = w_ptr + pid.to(tl.int64) * BLOCK_N * K + rn[:, None] * BLOCK_K + rk[None, :]
    x_ptrs = x_ptr + rm[:, None] * s_xm + rk[None, :]
    m_ok = rm[:, None] < M
    w = tl.load(w_ptrs)                             # first tile before the wait, as the GEMM does
    enter(PDL)
    if NO_MMA:
        acc = w.to(tl.float32)
        for kt in tl.range(1, K // BLOCK_K, num_stages=STAGES):
            acc += tl.load(w_ptrs + kt * BLOCK_N * BLOCK_K).to(tl.float32)
        tl.store(y_ptr + pid * BLOCK_N + rn, tl.sum(acc, 1))
    elif X_LEFT:
        acc = tl.dot(tl.load(x_ptrs, mask=m_ok, other=0.0), tl.trans(w), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32))
        for kt in tl.range(1, K // BLOCK_K, num_stages=STAGES):
            acc = tl.dot(tl.load(x_ptrs + kt * BLOCK_K, mask=m_ok, other=0.0),
                         tl.trans(tl.load(w_ptrs + kt * BLOCK_N * BLOCK_K)), acc)
        tl.store(y_ptr + pid * BLOCK_N + rn, tl.sum(acc, 0))
    else:
        xt = tl.load(x_ptrs, mask=m_ok, other=0.0)
        acc = tl.dot(w, tl.trans(xt), tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32))
        for kt in tl.range(1, K // BLOCK_K, num_stages=STAGES):
            if not X_ONCE:
                xt = tl.load(x_ptrs + kt * BLOCK_K, mask=m_ok, other=0.0)
            acc = tl.dot(tl.load(w_ptrs + kt * BLOCK_N * BLOCK_K), tl.trans(xt), acc)
        tl.store(y_ptr + pid * BLOCK_N + rn, tl.sum(acc, 1))


def rung(x, w, y, cfg, x_once=False, no_mma=False, x_left=False):
    bn, bk, warps, stages = cfg[:4]
    tiles, k_tiles = w.shape[:2]               # packed: [tiles, k_tiles, BLOCK_N, BLOCK_K]
    N, K = tiles * bn, k_tiles * bk
    pdl = pdl_for(w)
    bm = max(64 if x_left else 16, triton.next_power_of_2(x.shape[0]))      # wgmma's left operand: 64 rows
    _rung_kernel[(N // bn,)](x, w, y, x.shape[0], K, x.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                             STAGES=stages, X_ONCE=x_once, NO_MMA=no_mma, X_LEFT=x_left, PDL=pdl,
                             num_warps=warps, num_stages=stages, launch_pdl=bool(pdl))


def ladder(name, N, K, M, results, dtype=torch.bfloat16):
    from ..kernels.skinny_gemm import pack_weight_tiles, skinny_gemm
    cfg = CONFIGS[name]
    wbytes = N * K * 2
    copies = max(2, -(-2 * L2_BYTES // wbytes))
    order = "silu" if name == "gate_up" else "rows"
    plain = [torch.randn(N, K, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
    ws = [pack_weight_tiles(w.clone(), cfg[0], cfg[1], order) for w in plain]
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    out = torch.empty(M, N // 2 if name == "gate_up" else N, device="cuda", dtype=dtype)
    y = torch.empty(N, device="cuda", dtype=torch.float32)
    sms = sm_count(x.device)
    sums = torch.empty(max(N // cfg[0], 4 * sms), device="cuda", dtype=torch.float32)   # one per read program
    half = N * K // 2                     # the read kernel reads two arrays: a weight's two halves
    rungs = {
        "engine": lambda i: skinny_gemm(x, ws[i], *cfg, out=out, silu_mul=name == "gate_up", tiled=True),
        "x_once": lambda i: rung(x, ws[i], y, cfg, x_once=True),
        "no_mma": lambda i: rung(x, ws[i], y, cfg, no_mma=True),
        "read_grid": lambda i: read_bytes(ws[i].view(-1)[:half], ws[i].view(-1)[half:], sums, N // cfg[0], cfg[3],
                                          block=cfg[0] * cfg[1]),
        "read_4_per_sm": lambda i: read_bytes(ws[i].view(-1)[:half], ws[i].view(-1)[half:], sums, 4 * sms, 4),
    }
    for xc in X_LEFT[name]:
        wx = [pack_weight_tiles(w.clone(), xc[0], xc[1], order) for w in plain]
        rungs[f"x_left{list(xc)}"] = lambda i, wx=wx, xc=xc: rung(x, wx[i], y, xc, x_left=True)
        if xc != cfg:
            rungs[f"engine{list(xc)}"] = lambda i, wx=wx, xc=xc: skinny_gemm(x, wx[i], *xc, out=out,
                                                                          silu_mul=name == "gate_up", tiled=True)
    row = dict(linear=name, N=N, K=K, M=M, config=list(cfg), programs=N // cfg[0], weight_bytes=wbytes)
    for rname, fn in rungs.items():
        row[rname + "_us"] = us = graph_time_us(fn, copies)
        row[rname + "_GBps"] = wbytes / us / 1e3
    print(f"{name:8s} M={M:2d} {str(cfg):18s} " + "  ".join(f"{r} {row[r + '_us']:6.2f}" for r in rungs), flush=True)
    plain.clear()
    results.append(row)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--m", type=int, nargs="+", default=[32])
    ap.add_argument("--linears", nargs="*", default=list(CONFIGS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemm_ladder: CUDA only", file=sys.stderr)
        return 1
    shapes, results = linear_shapes(make_config(args.shape)), []
    for m in args.m:
        for name in args.linears:
            ladder(name, shapes[name][0], shapes[name][1], m, results)
    write_json(dict(shape=args.shape, m=args.m, configs=CONFIGS, results=results,
                    meta=run_meta("rollout.bench.gemm_ladder", argv)), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
