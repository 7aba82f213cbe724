"""Host (CPU) time per decode step, by stage, at a GRPO-sized batch: what bounds small models.

    python -m rollout.bench.host --prompts 64 --n 8 --out bench/results/<name>.json

A one-layer, 64-wide model on the CPU keeps the forward cheap, so what is timed is the Python
around it: scheduler.schedule, the batch builder, turning sampled rows into Python, and
scheduler.update_columns (medians over --steps decode steps, after --warmup steps). On the H200 the
Qwen2.5-1.5B GRPO shape (512 sequences) was host-bound at 86% GPU busy: these stages run once
per step while the GPU runs the previous one.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from ..engine import RolloutEngine
from ..request import SamplingParams
from .__main__ import run_meta, write_json
from .shapes import make_config


def _timed(obj, name: str, into: list) -> None:
    inner = getattr(obj, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        out = inner(*a, **k)
        into.append(time.perf_counter() - t0)
        return out
    setattr(obj, name, wrapper)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--no-fast-decode", action="store_true", help="the batch builder's general path only")
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="prefix cache off (its cost here: random prompts share nothing but a group's)")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = make_config("tiny", num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=512)
    S = args.prompts * args.n
    G = args.warmup + args.steps + 8
    eng = RolloutEngine.from_config(cfg, seed=0, device="cpu", dtype="float32", max_model_len=args.prompt_len + G + 8,
                                    num_kv_pages=S * ((args.prompt_len + G) // 16 + 2) + 64, max_num_seqs=S,
                                    max_num_batched_tokens=args.prompts * args.prompt_len,
                                    enable_prefix_caching=not args.no_prefix_caching)
    times: dict[str, list] = {k: [] for k in ("schedule", "build", "rows", "update")}
    _timed(eng.scheduler, "schedule", times["schedule"])
    _timed(eng.scheduler, "update_columns", times["update"])
    _timed(eng, "_columns", times["rows"])
    cache_s: list = []          # the prefix cache's own work (entering pages, lookups), inside schedule / update
    _timed(eng.kv, "cache_full_pages", cache_s)
    _timed(eng.kv, "reuse_prefix", cache_s)
    for slot in eng.pipeline.slots:
        slot.builder.fast_decode = not args.no_fast_decode
        _timed(slot.builder, "build", times["build"])
    prompts = torch.randint(3, 500, (args.prompts, args.prompt_len), generator=torch.Generator().manual_seed(0)).tolist()
    eng.add_requests(prompts, SamplingParams(n=args.n, max_new_tokens=G, temperature=1.0, ignore_eos=True))
    for _ in range(args.warmup):
        eng.step()
    for v in (*times.values(), cache_s):
        v.clear()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    step_ms = (time.perf_counter() - t0) / args.steps * 1e3
    running = sum(s.fork_count for s in eng.scheduler.running)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    result = {"sequences": running, "step_ms_incl_cpu_forward": step_ms, "median_ms": med,
              "host_ms": sum(med.values()), "fast_decode": not args.no_fast_decode,
              "prefix_caching": not args.no_prefix_caching, "prefix_cache_ms_per_step": sum(cache_s) / args.steps * 1e3,
              "meta": run_meta("rollout.bench.host", argv)}
    print(f"{running} sequences: " + ", ".join(f"{k} {v:.3f} ms" for k, v in med.items())
          + f"; host total {result['host_ms']:.2f} ms per step, of which the prefix cache "
          f"{result['prefix_cache_ms_per_step']:.3f} ms")
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
