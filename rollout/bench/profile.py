"""Per-step time breakdown of steady decode: attention / GEMMs / sampling / small ops / gaps.

    python -m rollout.bench.profile --shape llama3-8b --batch 32 --context 1024 [--no-fused-ops]

B sequences are prefilled to `--context` tokens, then decode runs as the engine runs it (async,
CUDA graphs). The step time comes from CUDA events on the compute stream; the kernel split from
the torch profiler over the same steps (kernels inside graph replays are traced one by one).
Gaps = step time - kernel time: launch latency between kernels, and host stalls.
"""
from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict

import torch

from ..engine import RolloutEngine
from ..request import SamplingParams
from .__main__ import run_meta, write_json
from . import timeline
from .roofline import copy_bandwidth, hbm_bandwidth, model_sizes, step_time_s
from .shapes import SHAPES, make_config, random_prompts

CATEGORIES = (   # first match wins; names as CUDA reports them
    # MoE shapes: the fused MoE's sort and grouped GEMMs, and the router's softmax / top-k (its GEMM is a "gemm")
    ("moe experts", r"_moe_"),
    ("moe router", r"_route_kernel"),
    ("attention", r"_decode_split|_decode_keys|_decode_merge|_prefill_kernel"),
    ("sampling", r"_sample_kernel|_merge_kernel|_trunc_kernel|_split_(step|final|merge)_kernel|sort|topk|softmax|"
                 r"gather|argmax|cumsum"),
    # _qkv_rope: the QKV GEMM with its RoPE epilogue
    ("gemm", r"gemm|gemv|cutlass|xmma|nvjet|cublas|splitK|sm90_|_qkv_rope"),
    ("fused small ops", r"_add_rmsnorm|_silu_mul|_rope_kv"),
)


def categorize(name: str) -> str:
    for cat, pattern in CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return cat
    return "other small ops"


PREFILL_BUDGET = 4096     # max_num_batched_tokens of the benches' engine


def decoding_engine(cfg, batch: int, context: int, new_tokens: int, device: str = "cuda",
                    dtype: str = "bfloat16", n: int = 1, prompt_len: int | None = None,
                    **engine_kw) -> RolloutEngine:
    """An engine (random weights, greedy decode graphs, KV sized for the run) with `batch` random
    prompts of `context` tokens, each queued for `new_tokens` greedy tokens after the last prompt
    is prefilled. Chunked prefill lets the first prompts decode while later ones prefill, for
    ~batch * context / (budget - batch) steps: that much headroom is added, or the first ones
    finish before the last start and the timed batch is smaller than `batch`. GRPO groups (n > 1):
    batch / n prompts of `prompt_len` tokens, n samples each sharing the prompt's pages, decoding
    from prompt_len to `context` first (step_until_decoding's `context`)."""
    P = prompt_len or context
    assert batch % n == 0 and P <= context, "batch must be a multiple of n, prompt_len <= context"
    prefill_steps = -(-(batch // n) * P // max(256, PREFILL_BUDGET - batch)) + 8
    total_new = new_tokens + prefill_steps + context - P
    eng = RolloutEngine.from_config(
        cfg, seed=0, device=device, dtype=dtype, max_model_len=context + total_new + 64, max_num_seqs=batch,
        max_num_batched_tokens=PREFILL_BUDGET, cuda_graph_modes=("greedy",),
        kv_cache_memory=int(model_sizes(cfg)["kv_bytes_per_token"] * batch * (context + total_new + 128)), **engine_kw)
    greedy = SamplingParams(n=n, max_new_tokens=total_new, temperature=0.0, ignore_eos=True)
    eng.add_requests(random_prompts(batch // n, P, cfg.vocab_size, 0), greedy)
    return eng


def step_until_decoding(eng: RolloutEngine, batch: int, extra_steps: int = 3, context: int = 0) -> None:
    """Step until every prompt is prefilled (and every sequence holds `context` tokens), then
    `extra_steps` more (graph replays on CUDA): what is timed next is the whole batch decoding."""
    sched = eng.scheduler
    while sched.waiting or any(s.num_computed < s.num_prompt or s.num_tokens < context for s in sched.running):
        eng.step()
    for _ in range(extra_steps):
        eng.step()
    assert len(sched.running) == batch, f"{len(sched.running)} of {batch} sequences decoding: too little headroom"


def recapture_graphs(eng) -> None:
    """Capture the decode graphs again (where the engine has them) after a knob that changes them."""
    if eng.pipeline.graphs is not None:
        eng.pipeline.graphs.graphs.clear()
        eng.pipeline.capture_graphs(progress=False)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--n", type=int, default=1, help="GRPO groups: batch / n prompts, n samples sharing each prompt")
    ap.add_argument("--prompt-len", type=int, default=None,
                    help="decode from this prompt length up to --context first (default: prompts of --context)")
    ap.add_argument("--no-fused-ops", action="store_true",
                    help="torch RMSNorm / RoPE / SiLU ops (Triton attention kept)")
    ap.add_argument("--batch-invariant", action="store_true", help="engine batch_invariant=True (its kernels' cost)")
    ap.add_argument("--pack-decode-weights", action="store_true",
                    help="engine pack_decode_weights=True (P1's best configuration)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("rollout.bench.profile needs CUDA")
    cfg = make_config(args.shape)
    B, C, K = args.batch, args.context, args.steps
    P = args.prompt_len or C
    eng = decoding_engine(cfg, B, C, 4 * K, n=args.n, prompt_len=P, batch_invariant=args.batch_invariant,
                          pack_decode_weights=args.pack_decode_weights)
    if args.no_fused_ops:       # graphs were captured with the fused ops: capture them again
        eng.model.fused_small_ops = False
        recapture_graphs(eng)
    p = eng.pipeline
    p.start_trace()             # every step's compute-stream span, prefill and decode up to C
    step_until_decoding(eng, B, extra_steps=5, context=C)
    curve, p.gpu_spans = timeline.step_ms_curve(p.gpu_spans, 128), None
    busy0, n0 = p.busy_ms, p.counts["graph_steps"]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(K):
            eng.step()
        torch.cuda.synchronize()
    steps = p.counts["graph_steps"] - n0
    # busy_ms counts completed steps only (one is still in flight); close enough over K steps.
    step_ms = (p.busy_ms - busy0) / max(steps, 1)
    per_cat, count = defaultdict(float), defaultdict(int)
    per_name = defaultdict(lambda: [0.0, 0])    # kernel name -> [ms / step, launches / step]
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            per_cat[categorize(ev.name)] += ev.device_time_total / 1e3 / steps
            count[categorize(ev.name)] += 1
            per_name[ev.name][0] += ev.device_time_total / 1e3 / steps
            per_name[ev.name][1] += 1 / steps
    kernels_ms = sum(per_cat.values())
    sizes = model_sizes(cfg)
    copy_Bps = copy_bandwidth() * 1e9
    hbm_Bps = hbm_bandwidth()
    # A group's prompt pages are read by its n rows; counted once (the rows run side by side).
    kv_bytes = (B // args.n * P + B * (C - P + 2 * K)) * sizes["kv_bytes_per_token"]
    result = {
        "shape": args.shape, "batch": B, "context": C, "n": args.n, "prompt_len": P, "steps": steps,
        "fused_small_ops": not args.no_fused_ops, "batch_invariant": args.batch_invariant,
        # mean compute-stream ms of each 128 steps from the first (prefill, then decode up to C)
        "step_ms_curve": curve, "step_ms": step_ms, "kernel_ms": dict(per_cat),
        "kernels_per_step": {k: v / steps for k, v in count.items()},
        "gaps_ms": step_ms - kernels_ms,
        "kernels": {n: dict(ms=v[0], per_step=v[1])
                    for n, v in sorted(per_name.items(), key=lambda kv: -kv[1][0])[:30]},
        "roofline_step_ms": 1e3 * step_time_s(sizes, B, C + 2 * K),    # prompt pages not shared
        "hbm_TBps": hbm_Bps / 1e12, "weights_at_hbm_ms": 1e3 * sizes["weight_bytes"] / hbm_Bps,
        "kv_at_hbm_ms": 1e3 * kv_bytes / hbm_Bps,
        # The practical ceiling: every byte moved at the measured device copy bandwidth.
        "copy_GBps": copy_Bps / 1e9, "weights_at_copy_ms": 1e3 * sizes["weight_bytes"] / copy_Bps,
        "kv_at_copy_ms": 1e3 * kv_bytes / copy_Bps,
        "meta": run_meta("rollout.bench.profile", argv),
    }
    print(json.dumps(result, indent=1))
    print("step ms by step index:", " ".join(f"{i}:{ms:.2f}" for i, ms in curve))
    print("\n| part | ms/step | kernels/step |\n|---|---|---|")
    for cat in sorted(per_cat, key=per_cat.get, reverse=True):
        print(f"| {cat} | {per_cat[cat]:.3f} | {count[cat] / steps:.0f} |")
    for name, v in list(result["kernels"].items())[:12]:
        print(f"| - {name[:60]} | {v['ms']:.3f} | {v['per_step']:.0f} |")
    print(f"| gaps | {result['gaps_ms']:.3f} | |\n| **step** | **{step_ms:.3f}** | |\n"
          f"| roofline step ({result['hbm_TBps']:.2f} TB/s) | {result['roofline_step_ms']:.3f} | |\n"
          f"| weights + KV at the measured copy bandwidth ({result['copy_GBps']:.0f} GB/s) | "
          f"{result['weights_at_copy_ms']:.3f} + {result['kv_at_copy_ms']:.3f} | |")
    write_json(result, args.out)


if __name__ == "__main__":
    main()
