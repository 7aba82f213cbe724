"""Microbenchmark: fused Triton sampler + logprob vs the torch reference `rollout.sampler.sample`.

    python -m rollout.bench.sampler [--rows 64 256] [--num-splits 0 1 2 4 8] [--row-splits 1 0] \
        [--dist flat peaked] [--modes sampled greedy top_p top_k min_p combined] [--out <name>.json]

bf16 logits, no penalty. "sampled" (T = 1, the RL case) and "greedy" (T = 0) time `fused_sample`
(one pass) at each --num-splits (0 = `default_num_splits`); the truncation modes ("top_p" 0.9,
"top_k" 50, "min_p" 0.05, "combined" all three; T = 1) time `fused_sample_full` at each
--row-splits S (1: one program per row; S > 1: each row in S chunks; 0 = `default_row_splits`).
Median µs from `do_bench` (eager) and `do_bench_cudagraph` (launch overhead removed, as in the
decode graphs); GB/s = the logits read once / graph time. "flat" logits = N(0, 3^2) (no block can
be pruned), "peaked" = N(0, 2^2) plus one token per row at +20 (LLM-like). Each fused config is
checked against the torch reference (token agreement, max |Δ logprob|, max |Δ kept_mass|; below 1
only from fp32 near-ties and kept-set boundary roundings).
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

from .__main__ import run_meta, write_json

TRUNC_MODES = {"top_p": {"top_p": 0.9}, "top_k": {"top_k": 50}, "min_p": {"min_p": 0.05},
               "combined": {"top_k": 50, "top_p": 0.9, "min_p": 0.05}}


def make_logits(R: int, V: int, dist: str, gen: torch.Generator) -> torch.Tensor:
    if dist == "flat":
        return (torch.randn(R, V, generator=gen, device="cuda") * 3).bfloat16()
    x = torch.randn(R, V, generator=gen, device="cuda") * 2
    x[torch.arange(R, device="cuda"), torch.randint(0, V, (R,), generator=gen, device="cuda")] += 20
    return x.bfloat16()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--num-splits", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    ap.add_argument("--block-v", type=int, default=2048)
    ap.add_argument("--num-warps", type=int, default=8)
    ap.add_argument("--dist", nargs="+", default=["flat", "peaked"], choices=["flat", "peaked"])
    ap.add_argument("--trunc-block-v", type=int, default=1024)
    ap.add_argument("--trunc-num-warps", type=int, default=8)
    ap.add_argument("--row-splits", type=int, nargs="+", default=[1, 0],
                    help="truncation path chunks per row (1: single program; 0: default_row_splits)")
    modes = ["sampled", "greedy", *TRUNC_MODES]
    ap.add_argument("--modes", nargs="+", default=modes, choices=modes)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print("rollout.bench.sampler needs a CUDA GPU (none found); nothing was measured.", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the benchmark times compiled kernels.", file=sys.stderr)
        return 2

    import triton
    from triton.testing import do_bench, do_bench_cudagraph

    from ..kernels.fused_sampler import default_num_splits, fused_sample
    from ..kernels.fused_truncation import _row_chunks, default_row_splits, fused_sample_full
    from ..sampler import SamplingTensors, sample

    V = args.vocab
    trunc_blk = max(args.trunc_block_v, 32 * args.trunc_num_warps)     # the truncation path's chunk granularity
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []

    def record(fn, nbytes, **kw):
        kw["us"] = do_bench(fn, return_mode="median") * 1e3
        kw["us_graph"] = do_bench_cudagraph(fn, return_mode="median") * 1e3
        kw["gbps"] = nbytes / kw["us_graph"] / 1e3
        rows.append(kw)
        extra = "" if kw["impl"] == "torch" else (
            f"  S={kw['num_splits'] or kw.get('row_splits') or '-':<3} tok agree {kw['token_agreement']:.4f}"
            f"  max|dlp| {kw['max_abs_dlogp']:.1e}"
            + (f"  max|dkm| {kw['max_abs_dkept_mass']:.1e}" if "max_abs_dkept_mass" in kw else ""))
        print(f"R={kw['rows']:<4d} {kw['mode']:<8s} {kw['dist']:<7s} {kw['impl']:<6s} eager {kw['us']:8.1f} us  "
              f"graph {kw['us_graph']:8.1f} us {kw['gbps']:7.0f} GB/s{extra}", flush=True)

    for R in args.rows:
        nbytes = R * V * 2
        seeds = torch.randint(0, 2**31, (R,), generator=gen, device="cuda")
        counters = torch.randint(0, 2**40, (R,), generator=gen, device="cuda")
        for dist in args.dist:
            logits = make_logits(R, V, dist, gen)
            for mode in args.modes:
                trunc = TRUNC_MODES.get(mode, {})
                temp = torch.full((R,), 0.0 if mode == "greedy" else 1.0, device="cuda")
                st = SamplingTensors(
                    temperature=temp, top_k=torch.full((R,), trunc.get("top_k", 0), device="cuda"),
                    top_p=torch.full((R,), trunc.get("top_p", 1.0), device="cuda"),
                    min_p=torch.full((R,), trunc.get("min_p", 0.0), device="cuda"),
                    repetition_penalty=torch.ones(R, device="cuda"), seeds=seeds, counters=counters,
                    penalty_token_ids=None, all_greedy=mode == "greedy", any_truncation=bool(trunc),
                    any_penalty=False)
                ref = sample(logits, st)
                case = dict(rows=R, mode=mode, dist=dist)
                record(functools.partial(sample, logits, st), nbytes, **case, impl="torch", num_splits=None)
                if trunc:
                    for S in args.row_splits:
                        S_eff = _row_chunks(V, S or default_row_splits(R, V, logits.device, trunc_blk), trunc_blk)[0]
                        kw = {"block_v": args.trunc_block_v, "num_warps": args.trunc_num_warps, "row_splits": S_eff}
                        o = fused_sample_full(logits, st, **kw)
                        record(functools.partial(fused_sample_full, logits, st, **kw), nbytes, **case, impl="fused",
                               num_splits=None, default_splits=S == 0, **kw,
                               token_agreement=(o.token_ids == ref.token_ids).float().mean().item(),
                               max_abs_dlogp=(o.logprobs - ref.logprobs).abs().max().item(),
                               max_abs_dkept_mass=(o.kept_mass - ref.kept_mass).abs().max().item())
                    continue
                for S in args.num_splits:
                    S_eff = S or default_num_splits(R, V, logits.device, args.block_v)
                    kw = {"greedy_only": mode == "greedy", "num_splits": S_eff, "block_v": args.block_v,
                          "num_warps": args.num_warps}
                    tok, lp = fused_sample(logits, temp, seeds, counters, **kw)
                    record(functools.partial(fused_sample, logits, temp, seeds, counters, **kw), nbytes, **case,
                           impl="fused", num_splits=S_eff, default_splits=S == 0,
                           token_agreement=(tok == ref.token_ids).float().mean().item(),
                           max_abs_dlogp=(lp - ref.logprobs).abs().max().item())

    write_json({"bench": "sampler", "triton": triton.__version__, "vocab": V, "block_v": args.block_v,
                "num_warps": args.num_warps, "trunc_block_v": args.trunc_block_v,
                "trunc_num_warps": args.trunc_num_warps, "row_splits": args.row_splits,
                "default_row_splits": {R: default_row_splits(R, V, "cuda", trunc_blk) for R in args.rows},
                "results": rows, "meta": run_meta("rollout.bench.sampler", argv)}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
