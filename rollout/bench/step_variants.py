"""Decode-step time of the engine under kernel variants, side by side in one process:

    python -m rollout.bench.step_variants --shape llama3-8b --batch 32 --context 4352

B sequences are prefilled to `--context` tokens once; then, for each variant, the knobs are set,
the decode graphs are captured again, and `--steps` steps are timed (CUDA-event busy time of the
compute stream, as rollout.bench.profile). The context grows by one token per step, so each
window is also given as a fraction of the roofline at its own mean context; the list starts and
ends with the baseline to show the drift. Knobs (cumulative, in this order):
  base          PDL waits before letting dependents launch; no L2 prefetch; SiLU * up its own
                kernel; one RoPE program per token (the state before these knobs existed)
  launch_first  kernels let their dependents launch, then wait (kernels/pdl.py)
  rope_grid     RoPE + KV write over (token, 1 + q-head groups) programs
  silu_down     SiLU * up formed in the down GEMM's x loads
  prefetchN     skinny GEMMs ask L2 for their first N weight K tiles before the PDL wait
"""
from __future__ import annotations

import argparse

import torch

from .__main__ import run_meta, write_json
from .roofline import model_sizes, step_time_s
from .shapes import SHAPES, make_config


def apply(eng, variant: str) -> None:
    from ..kernels import pdl, rope_kv, skinny_gemm
    knobs = variant.split("+")
    pdl.set_enabled(True, launch_first="launch_first" in knobs)
    rope_kv.Q_HEADS_PER_PROGRAM = 8 if "rope_grid" in knobs else 0
    eng.model.fuse_silu_down = "silu_down" in knobs
    pre = [k for k in knobs if k.startswith("prefetch")]
    skinny_gemm.PREFETCH_K_TILES = int(pre[0][len("prefetch"):]) if pre else 0
    eng.pipeline.graphs.graphs.clear()
    eng.pipeline.capture_graphs(progress=False)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=4352)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--variants", nargs="+", default=[
        "base", "launch_first", "launch_first+rope_grid", "launch_first+rope_grid+silu_down",
        "launch_first+rope_grid+silu_down+prefetch4", "launch_first+rope_grid+silu_down+prefetch16",
        "launch_first+rope_grid+silu_down+prefetch1000", "base"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("rollout.bench.step_variants needs CUDA")
    from ..engine import RolloutEngine
    from ..request import SamplingParams
    cfg = make_config(args.shape)
    B, C, K = args.batch, args.context, args.steps
    total = len(args.variants) * (K + 8) + 16
    sizes = model_sizes(cfg)
    eng = RolloutEngine.from_config(cfg, seed=0, device="cuda", dtype="bfloat16", max_model_len=C + total + 64,
                                    max_num_seqs=B, max_num_batched_tokens=4096,
                                    kv_cache_memory=int(sizes["kv_bytes_per_token"] * B * (C + total + 128)),
                                    cuda_graph_modes=("greedy",))
    prompts = torch.randint(10, cfg.vocab_size - 10, (B, C), generator=torch.Generator().manual_seed(0)).tolist()
    eng.add_requests(prompts, SamplingParams(max_new_tokens=total, temperature=0.0, ignore_eos=True))
    p = eng.pipeline
    while p.counts["graph_steps"] < 3:
        eng.step()
    rows = []
    for v in args.variants:
        apply(eng, v)
        for _ in range(5):                       # warm-up on the new graphs
            eng.step()
        busy0, n0 = p.busy_ms, p.counts["graph_steps"]
        ctx0 = C + n0
        for _ in range(K):
            eng.step()
        steps = p.counts["graph_steps"] - n0
        step_ms = (p.busy_ms - busy0) / max(steps, 1)
        roof_ms = 1e3 * step_time_s(sizes, B, ctx0 + steps / 2)
        rows.append(dict(variant=v, steps=steps, mean_context=ctx0 + steps / 2, step_ms=step_ms,
                         roofline_step_ms=roof_ms, fraction=roof_ms / step_ms))
        print(f"{v:55s} {step_ms:7.3f} ms/step  {100 * roof_ms / step_ms:5.1f}% of roofline", flush=True)
    print("\n| variant | mean context | ms/step | roofline ms | fraction |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['mean_context']:.0f} | {r['step_ms']:.3f} | {r['roofline_step_ms']:.3f} | "
              f"{100 * r['fraction']:.1f}% |")
    write_json(dict(shape=args.shape, batch=B, context=C, rows=rows, meta=run_meta("rollout.bench.step_variants", argv)),
               args.out)


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
