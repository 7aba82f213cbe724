"""Decode GEMMs at small M: cuBLAS (F.linear) against the skinny Triton kernel, CUDA only.

    python -m rollout.bench.gemm --shape llama3-8b --out bench/results/<name>.json

`--epilogues-only`: the fused GEMM epilogues (RoPE + K/V write, SiLU * up) against the two
kernels each replaces (`bench_epilogues`).

`--moe` (an MoE shape): the fused MoE's tiles swept at each --m tokens (`bench_moe`), GB/s counted
over the experts the routing actually touched.

For each linear of the shape (fused QKV, o_proj, fused gate_up, down_proj, lm_head) and each M:
the time per call inside a CUDA graph, cycling over enough weight copies that none sits in L2.
GB/s = weight bytes / time, next to a device-to-device copy. The Triton configs are swept at the
first M, the best few timed at the others, each checked against an fp32 reference first. Printed
last: the model's GEMM time per decode step with cuBLAS only and with the faster of the two.
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch

from .__main__ import run_meta, write_json
from .roofline import copy_bandwidth
from .shapes import SHAPES, make_config

L2_BYTES = 64 << 20


def linear_shapes(cfg) -> dict[str, tuple[int, int, int]]:
    """name -> (N, K, uses per step)."""
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    H, Hkv, L = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers
    return {"qkv": ((H + 2 * Hkv) * D, cfg.hidden_size, L), "o_proj": (cfg.hidden_size, H * D, L),
            "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size, L),
            "down": (cfg.hidden_size, cfg.intermediate_size, L), "lm_head": (cfg.vocab_size, cfg.hidden_size, 1)}


def graph_time_us(fn_per_copy, copies: int) -> float:
    """Median over 20 replays of a graph that calls fn(i) for each weight copy i."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(copies):
            fn_per_copy(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(copies):
            fn_per_copy(i)
    g.replay()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / copies)
    return sorted(times)[len(times) // 2]


def sweep_configs(N: int, K: int, split_k: tuple[int, ...] = (1,), quick: bool = False) -> list[tuple[int, ...]]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, split_k). Split-K only where N / BLOCK_N leaves
    SMs idle (< 2 x 132 programs) and K's tiles divide evenly, wide tiles included (they re-read
    less of x). quick: BLOCK_N 32 / 64 with 4 warps only (each config compiles for ~1 s)."""
    out = []
    for bn, bk, st in itertools.product((32, 64) if quick else (16, 32, 64, 128, 256), (64, 128, 256), (3, 5)):
        for nw in ((4, 8) if bn >= 64 and not quick else (4,)):
            for sk in split_k:
                if sk == 1 or (bn >= 32 and -(-N // bn) < 264 and (K // bk) % sk == 0):
                    out.append((bn, bk, nw, st, sk))
    return out


def _config(key: str) -> tuple[int, ...]:
    """A config back from its JSON key, str(tuple)."""
    return tuple(int(v) for v in key.strip("()").split(", "))


def bench_shape(name, N, K, Ms, configs, top, dtype, results, check=True, pdl_top=0):
    from ..kernels import pdl
    from ..kernels.skinny_gemm import skinny_gemm
    wbytes = N * K * torch.finfo(dtype).bits // 8
    copies = max(2, -(-2 * L2_BYTES // wbytes))
    ws = [torch.randn(N, K, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
    best_at_32 = None
    for M in Ms:
        x = torch.randn(M, K, device="cuda", dtype=dtype)
        y = torch.empty(M, N, device="cuda", dtype=dtype)
        ref = (x.float() @ ws[0].float().T) if check else None
        cublas = graph_time_us(lambda i: torch.matmul(x, ws[i].T, out=y), copies)
        row = dict(linear=name, N=N, K=K, M=M, weight_bytes=wbytes, cublas_us=cublas,
                   cublas_GBps=wbytes / cublas / 1e3, triton={})
        cands = configs if best_at_32 is None else best_at_32
        for c in cands:
            if K % c[1]:
                continue
            try:
                out = skinny_gemm(x, ws[0], *c)
                torch.cuda.synchronize()
            except Exception as e:        # e.g. out of shared memory for big tiles x stages
                row["triton"][str(c)] = {"error": type(e).__name__}
                continue
            err = (out.float() - ref).abs().max().item() if check else None
            us = graph_time_us(lambda i: skinny_gemm(x, ws[i], *c, out=y), copies)
            row["triton"][str(c)] = {"us": us, "GBps": wbytes / us / 1e3, "max_abs_err": err}
        ok = {k: v for k, v in row["triton"].items() if "us" in v}
        if ok:
            bk_ = min(ok, key=lambda k: ok[k]["us"])
            row["best"], row["best_us"] = bk_, ok[bk_]["us"]
            row["best_GBps"], row["speedup_vs_cublas"] = ok[bk_]["GBps"], cublas / ok[bk_]["us"]
            if best_at_32 is None:
                ranked = sorted(ok, key=lambda k: ok[k]["us"])[:top]
                best_at_32 = [_config(k) for k in ranked]
            # The fastest few again with programmatic dependent launch: each call's first weight
            # tile loads while the previous call drains (kernels/pdl.py), as in the decode graph.
            if pdl_top:
                was = pdl.enabled()
                pdl.set_enabled(True)
                try:
                    for k in sorted(ok, key=lambda k: ok[k]["us"])[:pdl_top]:
                        c = _config(k)
                        ok[k]["pdl_us"] = graph_time_us(lambda i: skinny_gemm(x, ws[i], *c, out=y), copies)
                finally:
                    pdl.set_enabled(was)
                kp = min((k for k in ok if "pdl_us" in ok[k]), key=lambda k: ok[k]["pdl_us"])
                row["best_pdl"], row["best_pdl_us"] = kp, ok[kp]["pdl_us"]
        print(f"{name:8s} N={N:6d} K={K:5d} M={M:3d}: cuBLAS {cublas:7.1f} us {row['cublas_GBps']:5.0f} GB/s | "
              f"triton best {row.get('best')} {row.get('best_us', float('nan')):7.1f} us "
              f"{row.get('best_GBps', float('nan')):5.0f} GB/s  x{row.get('speedup_vs_cublas', float('nan')):.2f}"
              + (f" | PDL {row['best_pdl']} {row['best_pdl_us']:7.1f} us" if "best_pdl" in row else ""),
              flush=True)
        results.append(row)
    ws.clear()   # free the weight copies (the lambdas above are done with them)


def bench_epilogues(cfg, M: int, copy_gbps: float, results: list, dtype=torch.bfloat16) -> None:
    """The decode path's GEMM epilogue fusions at batch M with the table's configs, each against
    the two kernels it replaces, with PDL on as in the decode graph: the QKV GEMM then RoPE + K/V
    write vs `qkv_rope_and_write_kv`, and the gate_up GEMM then SiLU * up vs `silu_mul=True`. The
    bits are compared first. GB/s = weight bytes / time; `of_copy` = that over the copy rate."""
    from ..kernels import pdl
    from ..kernels.fused_ops import silu_mul
    from ..kernels.rope_kv import qkv_rope_and_write_kv, rope_and_write_kv
    from ..kernels.skinny_gemm import skinny_gemm
    from ..layers.linear import pick_config
    from ..models.decoder import rope_inv_freq
    shapes = linear_shapes(cfg)
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    x = torch.randn(M, cfg.hidden_size, device="cuda", dtype=dtype)
    pos = torch.randint(0, 8192, (M,), device="cuda")
    inv = rope_inv_freq(cfg, D).cuda()
    slots = torch.arange(M, device="cuda") * 16           # each token in a page of its own
    caches = [torch.zeros(M, 16, Hkv, D, device="cuda", dtype=dtype) for _ in range(4)]

    def qkv_two(w, c, kc, vc):
        q, k, v = skinny_gemm(x, w, *c[:4]).view(M, H + 2 * Hkv, D).split([H, Hkv, Hkv], 1)
        return rope_and_write_kv(q, k, v, pos, inv, kc, vc, slots)

    def qkv_fused(w, c, kc, vc):
        return qkv_rope_and_write_kv(x, w, H, pos, inv, kc, vc, slots, *c[:4])

    cases = {"qkv+rope_kv": ("qkv", qkv_two, qkv_fused),
             "gate_up+silu": ("gate_up", lambda w, c, *_: silu_mul(skinny_gemm(x, w, *c[:4])),
                              lambda w, c, *_: skinny_gemm(x, w, *c[:4], silu_mul=True))}
    was = pdl.enabled()
    pdl.set_enabled(True)
    try:
        for fusion, (lin, two, fused) in cases.items():
            N, K, _ = shapes[lin]
            c = pick_config(N, K, M)
            if c is None or (len(c) > 4 and c[4] > 1):
                print(f"{fusion}: M={M} takes cuBLAS or split-K here, not the fused path", flush=True)
                continue
            wbytes = N * K * torch.finfo(dtype).bits // 8
            copies = max(2, -(-2 * L2_BYTES // wbytes))
            ws = [torch.randn(N, K, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
            for t in caches:       # the caches of an earlier case's timing loop differ: start equal
                t.zero_()
            a, b = two(ws[0], c, *caches[:2]), fused(ws[0], c, *caches[2:])
            same = torch.equal(a, b) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
            row = dict(fusion=fusion, M=M, config=list(c), weight_bytes=wbytes, same_bits=same)
            for name, fn in (("two_kernels", two), ("fused", fused)):
                us = graph_time_us(lambda i: fn(ws[i], c, *caches[:2]), copies)
                row[f"{name}_us"], row[f"{name}_GBps"] = us, wbytes / us / 1e3
                row[f"{name}_of_copy"] = row[f"{name}_GBps"] / copy_gbps
            print(f"{fusion:13s} M={M:3d} {c}: two kernels {row['two_kernels_us']:6.1f} us "
                  f"{row['two_kernels_GBps']:5.0f} GB/s | fused {row['fused_us']:6.1f} us "
                  f"{row['fused_GBps']:5.0f} GB/s "
                  f"({row['fused_of_copy']:.0%} of copy) | same bits {same}", flush=True)
            results.append(row)
            ws.clear()   # free the weight copies (the lambdas above are done with them)
    finally:
        pdl.set_enabled(was)


def moe_sweep_configs(pairs_per_expert: float) -> list[tuple[int, int, int, int, int]]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): short row blocks where each expert has a few
    pairs (decode: the weights are the bytes), tall ones where it has many (prefill: reuse per tile)."""
    rows = (16, 32) if pairs_per_expert <= 16 else (64, 128)
    out = []
    for bm, bn, bk, st in itertools.product(rows, (32, 64, 128), (64, 128, 256), (3, 4, 5)):
        if bm >= 64 and (bk == 256 or st == 5 or bn == 32):    # shared memory; tall tiles want wide ones
            continue
        if bm < 64 and bk == 64:       # decode streams weights: short K steps only add loop overhead
            continue
        for nw in ((4, 8) if bn == 128 or bm >= 64 else (4,)):
            out.append((bm, bn, bk, nw, st))
    return out


def bench_moe(cfg, Ts, copy_gbps: float, results: list, dtype=torch.bfloat16) -> None:
    """The fused MoE (one layer's experts) at T tokens each, every sweep config checked against the
    reference loop first (max |err| relative to the output's scale), then timed in a CUDA graph over
    two layers' expert copies (one layer's experts are ~50x L2). GB/s = bytes of the experts the
    routing touched / time; `of_copy` = that over the copy rate; what layers/moe.py picks is marked."""
    from ..kernels.fused_moe import fused_moe
    from ..layers.moe import experts_reference, moe_tiles, route
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    H, inter = cfg.hidden_size, cfg.moe_intermediate_size
    expert_bytes = 3 * inter * H * torch.finfo(dtype).bits // 8
    layers = [(torch.randn(E, 2 * inter, H, device="cuda", dtype=dtype) * 0.02,
               torch.randn(E, H, inter, device="cuda", dtype=dtype) * 0.02) for _ in range(2)]
    for T in Ts:
        x = torch.randn(T, H, device="cuda", dtype=dtype)
        weights, ids = route(torch.randn(T, E, device="cuda", dtype=dtype), k, cfg.norm_topk_prob)
        touched = ids.unique().numel()
        ref = experts_reference(x.float(), weights, ids, layers[0][0].float(), layers[0][1].float())
        scale = ref.abs().max().item()
        row = {"T": T, "pairs": T * k, "experts_touched": touched, "touched_bytes": touched * expert_bytes,
               "default": str(moe_tiles(T, k, E)), "configs": {}}
        for c in moe_sweep_configs(T * k / E):
            try:
                err = (fused_moe(x, weights, ids, *layers[0], c).float() - ref).abs().max().item() / scale
                torch.cuda.synchronize()
            except Exception as e:        # out of shared memory for big tiles x stages
                row["configs"][str(c)] = {"error": type(e).__name__}
                continue
            us = graph_time_us(lambda i, x=x, weights=weights, ids=ids, c=c: fused_moe(x, weights, ids, *layers[i], c),
                               len(layers))
            row["configs"][str(c)] = {"us": us, "GBps": row["touched_bytes"] / us / 1e3, "rel_err": err}
        ok = {c: v for c, v in row["configs"].items() if "us" in v and v["rel_err"] < 2e-2}   # bf16 output: ~4e-3
        if ok:
            best = min(ok, key=lambda c: ok[c]["us"])
            row.update(best=best, best_us=ok[best]["us"], best_of_copy=ok[best]["GBps"] / copy_gbps)
        d = row["configs"].get(row["default"], {})
        print(f"moe T={T:5d} ({touched:3d} experts touched): best {row.get('best')} "
              f"{row.get('best_us', float('nan')):8.1f} us {100 * row.get('best_of_copy', float('nan')):4.0f}% of copy"
              f" | default {row['default']} {d.get('us', float('nan')):8.1f} us", flush=True)
        results.append(row)
    layers.clear()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--m", nargs="+", type=int, default=[32, 1, 16, 64], help="first one is the sweep point")
    ap.add_argument("--top", type=int, default=6, help="configs from the sweep timed at the other M")
    ap.add_argument("--linears", nargs="+", default=None, help="subset of qkv o_proj gate_up down lm_head")
    ap.add_argument("--no-check", dest="check", action="store_false")
    ap.add_argument("--split-k", nargs="+", type=int, default=[1, 2, 4], help="split-K factors swept")
    ap.add_argument("--quick", action="store_true", help="a smaller config space (see sweep_configs)")
    ap.add_argument("--pdl-top", type=int, default=3,
                    help="time the fastest N configs again with programmatic dependent launch (0: off)")
    ap.add_argument("--epilogues-only", action="store_true",
                    help="only the fused-epilogue GEMMs against their two-kernel form, at each --m")
    ap.add_argument("--moe", action="store_true", help="only the fused MoE's tiles, at each --m tokens")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("rollout.bench.gemm needs a CUDA GPU")
    cfg = make_config(args.shape)
    if args.moe:
        copy_gbps = copy_bandwidth()
        results: list = []
        bench_moe(cfg, args.m, copy_gbps, results)
        write_json({"shape": args.shape, "copy_GBps": copy_gbps, "moe": results,
                    "meta": run_meta("rollout.bench.gemm", argv)}, args.out)
        return
    shapes = linear_shapes(cfg)
    copy_gbps = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbps:.0f} GB/s (read + write)", flush=True)
    results: list = []
    if args.epilogues_only:
        for M in args.m:
            bench_epilogues(cfg, M, copy_gbps, results)
        write_json(dict(shape=args.shape, copy_GBps=copy_gbps, epilogues=results,
                        meta=run_meta("rollout.bench.gemm", argv)), args.out)
        return
    from ..kernels import pdl
    pdl.set_enabled(False)       # the sweep itself: one launch at a time, as before PDL existed
    for name, (N, K, _) in shapes.items():
        if args.linears is None or name in args.linears:
            bench_shape(name, N, K, args.m, sweep_configs(N, K, tuple(args.split_k), args.quick), args.top,
                        torch.bfloat16, results, args.check, args.pdl_top)
    def per_step(rows, *keys):      # each linear's fastest of `keys` times its uses in a decode step
        return sum(min(r.get(k, float("inf")) for k in keys) * shapes[r["linear"]][2] for r in rows)

    step = {}
    for M in args.m:
        rows = [r for r in results if r["M"] == M]
        wbytes = per_step(rows, "weight_bytes")
        step[M] = dict(cublas_ms=per_step(rows, "cublas_us") / 1e3,
                       best_ms=per_step(rows, "cublas_us", "best_us") / 1e3,
                       best_with_pdl_ms=per_step(rows, "cublas_us", "best_us", "best_pdl_us") / 1e3,
                       weight_bytes=wbytes, at_copy_bw_ms=wbytes / copy_gbps / 1e6)
    print("| M | cuBLAS ms/step | best-of-both ms/step | with PDL ms/step | weights at copy BW ms |\n"
          "|---|---|---|---|---|")
    for M, s in step.items():
        print(f"| {M} | {s['cublas_ms']:.3f} | {s['best_ms']:.3f} | {s['best_with_pdl_ms']:.3f} | "
              f"{s['at_copy_bw_ms']:.3f} |")
    write_json(dict(shape=args.shape, copy_GBps=copy_gbps, per_step=step, results=results,
                    meta=run_meta("rollout.bench.gemm", argv)), args.out)


if __name__ == "__main__":
    main()
