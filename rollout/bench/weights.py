"""Weight update during async decode: staging time, the compute-stream stall at the barrier, and
step times around it; then the updated engine must produce what a fresh engine on the new weights does.

    python -m rollout.bench.weights --shape llama3-8b --batch 32 --out bench/results/<name>.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ..engine import RolloutEngine
from ..request import SamplingParams
from ..worker import RolloutWorker
from .__main__ import run_meta, write_json
from .shapes import SHAPES, make_config, random_prompts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=256)
    ap.add_argument("--update-at-step", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("rollout.bench.weights needs CUDA")
    cfg = make_config(args.shape)
    B, P, G = args.batch, args.prompt_len, args.gen_len
    kw = dict(device="cuda", dtype="bfloat16", max_model_len=P + G + 8, max_num_seqs=B,
              kv_cache_memory=8 << 30, max_num_batched_tokens=max(2048, B * P // 2), async_pipeline=True)
    worker = RolloutWorker(RolloutEngine.from_config(cfg, seed=0, **kw))
    # the new weights' engine, whose parameters are the update's source (on the GPU, as a trainer's would be),
    # checks 8 sequences at the end: a small KV cache (the whole bench fits an 80 GB card)
    new = RolloutEngine.from_config(cfg, seed=1, **{**kw, "kv_cache_memory": 1 << 30})
    update = list(new.model.hf_targets().items())
    prompts = random_prompts(B, P, cfg.vocab_size, 0)
    params = SamplingParams(max_new_tokens=G, temperature=0, ignore_eos=True)

    worker.generate(prompts[:2], SamplingParams(max_new_tokens=8))   # warm-up
    ids = worker.add_requests(prompts, params)
    k = args.update_at_step
    step_ms, done, t_stage = [], 0, None
    while done < len(ids):
        if len(step_ms) == k:
            t0 = time.perf_counter()
            worker.update_weights(update, version=1)
            t_stage = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        done += len(worker.step())
        step_ms.append((time.perf_counter() - t0) * 1e3)
    worker.weights.verify(block=True)
    steady = statistics.median(step_ms[k - 20:k - 1])

    check = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
    got = worker.generate(prompts[:8], check)
    fresh = new.generate(prompts[:8], check, use_tqdm=False)
    wm = worker.weights.metrics
    result = {
        "shape": args.shape, "batch": B, "prompt_len": P, "gen_len": G,
        "weights_bytes": wm["bytes"], "staging_call_ms": t_stage, "staging_ms": wm["staging_ms"],
        "barrier_stall_ms": wm["barrier_ms"], "committed_while_in_flight": wm["committed_while_in_flight"],
        "verified": wm["verified"], "pipeline_counts": dict(worker.engine.pipeline.counts),
        "steady_step_ms": steady, "step_ms_around_update": step_ms[k - 1:k + 3],
        "outputs_equal_fresh_engine": [o.completions[0].token_ids for o in got]
        == [o.completions[0].token_ids for o in fresh],
        "meta": run_meta("rollout.bench.weights", argv),
    }
    print(json.dumps(result, indent=2))
    print(f"\n| bytes | staging ms | barrier stall ms | steady step ms | equal fresh |\n|---|---|---|---|---|\n"
          f"| {wm['bytes'] / 1e9:.1f} GB | {wm['staging_ms']:.1f} | {wm['barrier_ms']:.2f} | {steady:.1f} | "
          f"{result['outputs_equal_fresh_engine']} |")
    write_json(result, args.out)


if __name__ == "__main__":
    main()
