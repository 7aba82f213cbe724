"""Multi-turn rollouts with the prefix cache on and off, and the cache's cost where nothing is shared.

    python -m rollout.bench.multiturn --shape llama3-8b --out bench/results/<name>.json
    python -m rollout.bench.multiturn --shape tiny --trajectories 4 --n 2 --turns 2 --prompt-len 16 \\
        --obs-len 8 --gen-len 8 --p1-prompts 2 --p1-prompt-len 16 --p1-gen-len 16 --dtype float32 --device cpu

1. Multi-turn: --trajectories (groups of --n samples of one first prompt) of --turns turns, each
   generating --gen-len tokens (EOS off, seeded sampling), then the environment appending
   --obs-len random tokens (rollout.multiturn). Cache on, then off, same weights, prompts and
   seeds: wall s, prefill tokens computed, cache hit tokens, trajectories with identical tokens
   (in bf16 a different prefill split can flip a near tie unless --batch-invariant).
2. P1, nothing shared: --p1-prompts prompts of --p1-prompt-len, --p1-gen-len greedy tokens each,
   cache on and off: wall s, tok/s and their ratio, the cost of entering full pages in the cache.

One set of seeded random weights; each run gets its own engine, freed before the next.
"""
from __future__ import annotations

import argparse
import gc
import random
import time

import torch

from ..engine import RolloutEngine
from ..multiturn import run_trajectories
from ..request import SamplingParams
from .__main__ import run_meta, write_json
from .pressure import random_model
from .shapes import SHAPES, make_config


class RandomObservations:
    """--obs-len seeded random token ids after every turn; never done (max_turns ends it)."""

    def __init__(self, seed: int, length: int, vocab: int):
        self.rng, self.length, self.vocab = random.Random(seed), length, vocab

    def step(self, traj):
        return [self.rng.randrange(10, self.vocab) for _ in range(self.length)], 0.0, False


def _engine(model, cfg, args, caching: bool, max_model_len: int, max_num_seqs: int) -> RolloutEngine:
    return RolloutEngine(model, cfg, device=args.device, seed=args.seed, max_model_len=max_model_len,
                         max_num_seqs=max_num_seqs, enable_prefix_caching=caching, batch_invariant=args.batch_invariant)


def _free(engine, device) -> None:
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def multiturn_run(model, cfg, args, caching: bool, device) -> tuple[dict, list]:
    groups = args.trajectories // args.n
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(10, cfg.vocab_size, (groups, args.prompt_len), generator=g).tolist()
    max_len = args.prompt_len + args.turns * (args.gen_len + args.obs_len) + 16
    engine = _engine(model, cfg, args, caching, max_len, args.trajectories)
    params = SamplingParams(n=args.n, max_new_tokens=args.gen_len, temperature=1.0, seed=args.seed, ignore_eos=True)

    def envs(i, k):
        return RandomObservations(hash((args.seed, i, k)), args.obs_len, cfg.vocab_size)
    _sync(device)
    t0 = time.perf_counter()
    trajs = run_trajectories(engine, prompts, envs, params, max_turns=args.turns)
    _sync(device)
    wall = time.perf_counter() - t0
    st = engine.stats()
    result = {"prefix_caching": caching, "wall_s": wall, "trajectories": len(trajs),
              "generated_tokens": sum(sum(t.generated) for t in trajs),
              **{k: st[k] for k in ("prefill_tokens", "prefix_cache_hit_tokens", "prefix_cache_queries",
                                    "prefix_cache_evictions", "preemptions", "steps")}}
    tokens = [t.token_ids for t in trajs]
    _free(engine, device)
    return result, tokens


def p1_run(model, cfg, args, caching: bool, device) -> tuple[dict, list]:
    g = torch.Generator().manual_seed(args.seed + 1)
    prompts = torch.randint(10, cfg.vocab_size, (args.p1_prompts, args.p1_prompt_len), generator=g).tolist()
    engine = _engine(model, cfg, args, caching, args.p1_prompt_len + args.p1_gen_len + 16, args.p1_prompts)
    params = SamplingParams(max_new_tokens=args.p1_gen_len, temperature=0, ignore_eos=True)
    _sync(device)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=False)
    _sync(device)
    wall = time.perf_counter() - t0
    result = {"prefix_caching": caching, "wall_s": wall, "tok_s": args.p1_prompts * args.p1_gen_len / wall,
              "prefix_cache_pages": engine.stats()["prefix_cache_pages"]}
    tokens = [o.completions[0].token_ids for o in outs]
    _free(engine, device)
    return result, tokens


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--trajectories", type=int, default=64)
    ap.add_argument("--n", type=int, default=8, help="trajectories per first prompt (a GRPO group)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--obs-len", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=512)
    ap.add_argument("--p1-prompts", type=int, default=32)
    ap.add_argument("--p1-prompt-len", type=int, default=256)
    ap.add_argument("--p1-gen-len", type=int, default=8192)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--batch-invariant", action="store_true", help="engine batch_invariant=True (CUDA, bf16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.trajectories % args.n:
        raise SystemExit(f"--trajectories {args.trajectories} is not a multiple of --n {args.n}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.device = str(device)
    cfg = make_config(args.shape)
    model = random_model(cfg, getattr(torch, args.dtype), device, args.seed)
    (mt_on, tok_on), (mt_off, tok_off) = (multiturn_run(model, cfg, args, c, device) for c in (True, False))
    (p1_on, p1_tok_on), (p1_off, p1_tok_off) = (p1_run(model, cfg, args, c, device) for c in (True, False))
    result = {"shape": args.shape, "dtype": args.dtype, "batch_invariant": args.batch_invariant,
              "multiturn": {"cache_on": mt_on, "cache_off": mt_off,
                            "prefill_tokens_ratio": mt_on["prefill_tokens"] / max(mt_off["prefill_tokens"], 1),
                            "wall_ratio": mt_on["wall_s"] / mt_off["wall_s"],
                            "identical_trajectories": sum(a == b for a, b in zip(tok_on, tok_off))},
              "p1": {"cache_on": p1_on, "cache_off": p1_off, "tok_s_ratio": p1_on["tok_s"] / p1_off["tok_s"],
                     "identical_outputs": sum(a == b for a, b in zip(p1_tok_on, p1_tok_off))},
              "meta": run_meta("rollout.bench.multiturn", argv)}
    m, p = result["multiturn"], result["p1"]
    print(f"multi-turn: prefill {mt_on['prefill_tokens']} tokens with the cache, {mt_off['prefill_tokens']} "
          f"without; wall {mt_on['wall_s']:.2f} s vs {mt_off['wall_s']:.2f} s; "
          f"{m['identical_trajectories']}/{mt_on['trajectories']} trajectories identical")
    print(f"P1: {p1_on['tok_s']:.0f} tok/s with the cache, {p1_off['tok_s']:.0f} without "
          f"(ratio {p['tok_s_ratio']:.3f})")
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
