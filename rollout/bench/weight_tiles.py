"""Does the weights' layout in HBM cost the decode GEMMs? CUDA only; an experiment for issue 4.

    python -m rollout.bench.weight_tiles --shape llama3-8b --m 32 --out bench/results/<name>.json
    python -m rollout.bench.weight_tiles --m 1 16 32 --linears o_proj gate_up   # how x's rows weigh

The skinny GEMM reads a BLOCK_N x BLOCK_K weight tile as BLOCK_N rows of BLOCK_K * 2 bytes, each
K * 2 bytes apart; a pure read kernel (bench.attn_ceiling) streams one contiguous run per program
and reaches 4.5 TB/s, while the GEMMs at the same bytes run 2-6 us slower a launch (twelfth
session). `pack_weight_tiles` stores each program's tiles as one contiguous run, in the order it
reads them. For each linear of the shape at M rows and a few configs: the plain layout against
the packed one (same kernel, same bits: checked first), each call inside a CUDA graph with PDL, as
decode runs it, cycling over enough weight copies that none stays in L2. Then a layer's four
GEMMs (QKV, o_proj, gate_up + SiLU, down) back to back, plain and packed.
"""
from __future__ import annotations

import argparse
import sys

import torch

from .__main__ import run_meta, write_json
from .gemm import L2_BYTES, graph_time_us, linear_shapes
from .kernels import copy_bandwidth
from .shapes import SHAPES, make_config

# name -> configs (BLOCK_N, BLOCK_K, warps, stages, split_k); the first is the engine's at M = 32.
CONFIGS = {
    "qkv": ((64, 128, 4, 5), (64, 128, 4, 4), (128, 128, 8, 4), (64, 256, 4, 3), (32, 512, 4, 3), (16, 512, 4, 4)),
    "o_proj": ((32, 256, 4, 5), (64, 128, 4, 5, 2), (32, 128, 4, 5), (64, 256, 4, 3, 2), (32, 512, 4, 3),
               (16, 512, 4, 4)),
    "gate_up": ((128, 128, 8, 4), (64, 128, 4, 5), (128, 64, 8, 5), (256, 64, 8, 4), (64, 512, 4, 2), (32, 512, 4, 3)),
    "down": ((64, 128, 4, 5, 2), (32, 256, 4, 5), (64, 256, 4, 3, 2), (128, 128, 8, 4, 4), (32, 512, 4, 3),
             (32, 512, 4, 3, 2)),
    "lm_head": ((64, 128, 4, 3), (128, 128, 8, 4), (64, 128, 4, 5), (64, 256, 4, 3)),
}


def _call(name, x, w, cfg, out, tiled):
    from ..kernels.skinny_gemm import skinny_gemm
    return skinny_gemm(x, w, *cfg, out=out, silu_mul=name == "gate_up", tiled=tiled)


def bench_linear(name, N, K, M, copy_gbps, results, dtype=torch.bfloat16):
    from ..kernels.skinny_gemm import pack_weight_tiles
    wbytes = N * K * 2
    copies = max(2, -(-2 * L2_BYTES // wbytes))
    ws = [torch.randn(N, K, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    out = torch.empty(M, N // 2 if name == "gate_up" else N, device="cuda", dtype=dtype)
    for cfg in CONFIGS[name]:
        row = dict(linear=name, N=N, K=K, M=M, config=list(cfg), weight_bytes=wbytes)
        try:
            want = _call(name, x, ws[0], cfg, None, False)
        except Exception as e:        # e.g. out of shared memory (gate_up 64,512,4,2): report it, go on
            print(f"{name:8s} M={M:2d} {str(cfg):22s} failed: {type(e).__name__}", flush=True)
            results.append(dict(row, error=type(e).__name__))
            continue
        packed = [pack_weight_tiles(w, cfg[0], cfg[1], "silu" if name == "gate_up" else "rows") for w in ws]
        same = row["bits_equal"] = torch.equal(want, _call(name, x, packed[0], cfg, None, True))
        for tiled, wl in ((False, ws), (True, packed)):
            us = graph_time_us(lambda i: _call(name, x, wl[i], cfg, out, tiled), copies)
            row["packed_us" if tiled else "plain_us"] = us
        row["gain_us"] = row["plain_us"] - row["packed_us"]
        row["plain_GBps"], row["packed_GBps"] = wbytes / row["plain_us"] / 1e3, wbytes / row["packed_us"] / 1e3
        row["copy_us"] = wbytes / copy_gbps / 1e3
        print(f"{name:8s} M={M:2d} {str(cfg):22s} bits {'=' if same else 'DIFFER'}  plain {row['plain_us']:7.2f} us "
              f"({row['plain_GBps']:5.0f} GB/s)  packed {row['packed_us']:7.2f} us ({row['packed_GBps']:5.0f} GB/s)"
              f"  gain {row['gain_us']:+6.2f} us   copy {row['copy_us']:6.2f}", flush=True)
        results.append(row)
        del packed
    ws.clear()


def bench_layer(cfg_model, M, results, dtype=torch.bfloat16):
    """The engine's configs of QKV -> o_proj -> gate_up + SiLU -> down, each output the next input
    (QKV's first K columns feed o_proj), `copies` layers of distinct weights in one graph."""
    from ..kernels.skinny_gemm import pack_weight_tiles
    shapes = linear_shapes(cfg_model)
    order = ("qkv", "o_proj", "gate_up", "down")
    layer_bytes = sum(shapes[n][0] * shapes[n][1] * 2 for n in order)
    copies = max(2, -(-2 * L2_BYTES // layer_bytes))
    layers = [{n: torch.randn(shapes[n][0], shapes[n][1], device="cuda", dtype=dtype) * 0.02 for n in order}
              for _ in range(copies)]
    packed = [{n: pack_weight_tiles(lw[n], *CONFIGS[n][0][:2], "silu" if n == "gate_up" else "rows")
               for n in order} for lw in layers]
    H = cfg_model.hidden_size
    x = torch.randn(M, H, device="cuda", dtype=dtype)

    def layer(i, tiled):
        wl = packed[i] if tiled else layers[i]
        q = _call("qkv", x, wl["qkv"], CONFIGS["qkv"][0], None, tiled)
        o = _call("o_proj", q[:, :H], wl["o_proj"], CONFIGS["o_proj"][0], None, tiled)
        h = _call("gate_up", o, wl["gate_up"], CONFIGS["gate_up"][0], None, tiled)
        return _call("down", h, wl["down"], CONFIGS["down"][0], None, tiled)

    same = torch.equal(layer(0, False), layer(0, True))
    row = dict(linear="layer", M=M, weight_bytes=layer_bytes, bits_equal=same)
    for tiled in (False, True):
        row["packed_us" if tiled else "plain_us"] = graph_time_us(lambda i: layer(i, tiled), copies)
    row["gain_us"] = row["plain_us"] - row["packed_us"]
    print(f"layer    M={M:2d} (4 GEMMs) bits {'=' if same else 'DIFFER'}  plain {row['plain_us']:7.2f} us  packed "
          f"{row['packed_us']:7.2f} us  gain {row['gain_us']:+6.2f} us a layer", flush=True)
    results.append(row)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--m", type=int, nargs="+", default=[32],
                    help="row counts (x is re-read from L2 by every program: fewer rows, fewer bytes)")
    ap.add_argument("--linears", nargs="*", default=list(CONFIGS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("weight_tiles: CUDA only", file=sys.stderr)
        return 1
    cfg = make_config(args.shape)
    copy_gbps = copy_bandwidth()             # read + write bytes / time, as bench.gemm's copy column
    results = []
    shapes = linear_shapes(cfg)
    for m in args.m:
        for name in args.linears:
            bench_linear(name, shapes[name][0], shapes[name][1], m, copy_gbps, results)
        bench_layer(cfg, m, results)
    write_json(dict(shape=args.shape, m=args.m, copy_read_GBps=copy_gbps, results=results,
                    meta=run_meta("rollout.bench.weight_tiles", argv)), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
