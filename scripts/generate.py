"""Generate completions with the rollout engine and score them.

Default: the embedded tiny arithmetic model (rollout/assets/arith-tiny, built on first
use if missing) answers GRPO-style groups of arithmetic prompts; the reward is exact
match. With --model PATH any local Hugging Face folder works (text prompts from --prompt).

    python scripts/generate.py
    python scripts/generate.py --num-prompts 64 --n 8 --temperature 1.0
    python scripts/generate.py --model /path/to/ckpt --prompt "Hello" --max-new-tokens 64
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from rollout import RolloutEngine, SamplingParams
from rollout.tasks import arith


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="local HF checkpoint folder (default: embedded arith-tiny)")
    ap.add_argument("--prompt", action="append", default=None, help="text prompt (repeatable); with --model")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt (GRPO group size)")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None)
    ap.add_argument("--show", type=int, default=8, help="completions to print")
    args = ap.parse_args(argv)

    path = args.model or arith.ensure_default_model()
    engine = RolloutEngine.from_pretrained(path, device=args.device, seed=args.seed)
    rng = random.Random(args.seed)
    scored = not args.prompt            # arithmetic problems: scored by exact match
    prompts = args.prompt or [arith.make_problem(rng)[0] for _ in range(args.num_prompts)]
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, seed=args.seed)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for o in outs for c in o.completions)

    rewards = []
    for i, o in enumerate(outs):
        for c in o.completions:
            rewards.append(arith.reward(o.prompt, c.text) if scored else None)
            if i < args.show:
                print(f"{o.prompt!r:>12} -> {c.text!r:<8} reward={rewards[-1]} logp={sum(c.logprobs):.3f} "
                      f"finish={c.finish_reason}")
    print(f"\n{len(outs)} prompts x {args.n} samples, {tokens} tokens in {wall:.2f} s "
          f"({tokens / wall:.0f} tok/s), KV pages in use after: {engine.kv.alloc.num_used}")
    if scored:
        print(f"mean reward (exact-match accuracy): {statistics.mean(rewards):.3f}")


if __name__ == "__main__":
    main()
