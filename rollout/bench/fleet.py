"""The Ray fleet on several GPUs (issue 9): throughput scaling, and the weight broadcast.

    # P3 GRPO shape per worker, 1, 2, ... workers (one GPU each); efficiency vs linear in 1 worker
    python -m rollout.bench.fleet scaling --shape qwen2.5-1.5b --workers 1 2 --prompts-per-worker 64 \
        --n 8 --prompt-len 256 --gen-len 4096 --out bench/results/<name>.json
    # the Llama-3-8B shape's weights from a trainer process (GPU 0) to workers on the other GPUs,
    # over NCCL, while every worker decodes a batch
    python -m rollout.bench.fleet broadcast --shape llama3-8b --batch 32 --gen-len 1024 --out ...
    # CPU smoke runs (gloo, tiny shape): add --shape tiny --device cpu --dtype float32

Weights are seeded random, drawn on each worker's device. Scaling: a fresh fleet per worker
count, every worker warmed up before the clock starts; tok/s = generated tokens / wall of
`fleet.generate`; efficiency(N) = tok/s(N) / (N * tok/s(first count) / first count). Broadcast:
the trainer (this process) holds another seed's weights; while each worker decodes `--batch`
greedy sequences, `update_weights` broadcasts them; reported: the broadcast wall time, the time
until every worker has committed, each worker's barrier stall and staging time, and whether
the decodes all finished.
"""
from __future__ import annotations

import argparse
import functools
import os
import time

import torch

from ..request import SamplingParams
from .__main__ import run_meta, write_json
from .roofline import roofline
from .shapes import SHAPES, make_config
from .shapes import random_prompts as _prompts


def random_engine(shape: str, seed: int, device: str, dtype: str, engine_kwargs: dict):
    """Built inside each actor (picklable through functools.partial)."""
    from ..engine import RolloutEngine
    from .pressure import random_model
    cfg = make_config(shape)
    return RolloutEngine(random_model(cfg, getattr(torch, dtype), torch.device(device), seed), cfg, seed=seed,
                         **engine_kwargs)


def _fleet(num_workers: int, args, engine_kwargs: dict, seed: int = 0):
    from ..fleet import RolloutFleet
    gpu = args.device == "cuda"
    factory = functools.partial(random_engine, args.shape, seed, args.device, args.dtype, engine_kwargs)
    return RolloutFleet(num_workers, factory, num_gpus_per_worker=1 if gpu else 0,
                        num_cpus_per_worker=args.cpus_per_worker, torch_threads=None if gpu else 1)


def _warm_up(fleet, prompt) -> None:
    import ray
    short = SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True)
    ray.get([s.actor.run.remote(prompt, short) for s in fleet.slots])


def scaling(args) -> dict:
    cfg = make_config(args.shape)
    P, G, n = args.prompt_len, args.gen_len, args.n
    per_worker_seqs = args.prompts_per_worker * n
    engine_kwargs = dict(max_model_len=P + G + 8, max_num_seqs=per_worker_seqs,
                         max_num_batched_tokens=args.max_batched_tokens, kv_cache_memory=args.kv_bytes)
    one = roofline(cfg, per_worker_seqs, P, G, prefill_seqs=args.prompts_per_worker,
                   dtype_bytes=getattr(torch, args.dtype).itemsize)
    params = SamplingParams(n=n, max_new_tokens=G, temperature=1.0, ignore_eos=True)
    runs = []
    for w in args.workers:
        prompts = _prompts(args.prompts_per_worker * w, P, cfg.vocab_size, seed=w)
        t0 = time.perf_counter()
        fleet = _fleet(w, args, engine_kwargs)
        start_s = time.perf_counter() - t0
        try:
            _warm_up(fleet, prompts[0])
            before = fleet.stats()["workers"]
            t0 = time.perf_counter()
            outs = fleet.generate(prompts, params)
            wall = time.perf_counter() - t0
            st = fleet.stats()
            # compute-stream busy time (CUDA events) and preemptions over the timed run, per worker
            busy = {i: (s["gpu_busy_ms"] - before[i]["gpu_busy_ms"]) / 1e3 / wall for i, s in st["workers"].items()}
            preempted = {i: s["preemptions"] - before[i]["preemptions"] for i, s in st["workers"].items()}
            placed = [sum(1 for slot in fleet.placement.values() if slot == i) for i in range(w)]
        finally:
            fleet.shutdown()
        tokens = sum(len(c.token_ids) for o in outs for c in o.completions)
        complete = all(len(c.token_ids) == G for o in outs for c in o.completions)
        r = dict(workers=w, prompts=len(prompts), sequences=len(prompts) * n, fleet_start_s=start_s, wall_s=wall,
                 tokens=tokens, tok_s=tokens / wall, all_completed=complete and tokens == len(prompts) * n * G,
                 prompts_per_worker=placed, errors=sorted({o.error for o in outs if o.error}),
                 worker_tok_s={i: s["tok_s"] for i, s in st["workers"].items()},
                 worker_gpu_busy=busy, worker_preemptions=preempted,
                 fraction_of_roofline=tokens / wall / (w * one["tok_s"]))
        runs.append(r)
        print(f"{w} worker(s): {r['tok_s']:.0f} tok/s in {wall:.1f} s, {r['fraction_of_roofline']:.1%} of "
              f"{w} x roofline, prompts per worker {placed}, GPU busy {[round(b, 3) for b in busy.values()]}, "
              f"preemptions {list(preempted.values())}", flush=True)
    base = runs[0]["tok_s"] / runs[0]["workers"]
    for r in runs:
        r["scaling_efficiency"] = r["tok_s"] / (r["workers"] * base)
    print("| workers | tok/s | efficiency vs linear | of roofline | prompts per worker |\n|---|---|---|---|---|")
    for r in runs:
        print(f"| {r['workers']} | {r['tok_s']:.0f} | {r['scaling_efficiency']:.1%} | "
              f"{r['fraction_of_roofline']:.1%} | {r['prompts_per_worker']} |")
    return dict(mode="scaling", roofline_one_worker=one, runs=runs,
                all_completed=all(r["all_completed"] for r in runs))


def broadcast(args) -> dict:
    """Trainer = this process; workers on the other GPUs (NCCL rejects two ranks on one GPU)."""
    import ray

    from .pressure import random_model
    cfg = make_config(args.shape)
    gpu = args.device == "cuda"
    dtype = getattr(torch, args.dtype)
    if gpu:
        ngpu = torch.cuda.device_count()
        if ngpu < 2:
            raise SystemExit("broadcast needs 2+ GPUs: the trainer on GPU 0, workers on the others")
        torch.cuda.set_device(0)          # the trainer's CUDA context is made on GPU 0 now ...
        trainer_device = torch.device("cuda", 0)
        workers = args.num_workers or ngpu - 1
        # ... and Ray, started after this, hands the actors only GPUs 1..N-1.
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(1, ngpu))
        ray.init(num_gpus=ngpu - 1, include_dashboard=False)
    else:
        trainer_device, workers = torch.device("cpu"), args.num_workers or 2
    update = list(random_model(cfg, dtype, trainer_device, seed=1).hf_targets().items())
    update_bytes = sum(t.numel() * t.element_size() for _, t in update)
    P, G, B = args.prompt_len, args.gen_len, args.batch
    engine_kwargs = dict(max_model_len=P + G + 8, max_num_seqs=B, kv_cache_memory=args.kv_bytes,
                         max_num_batched_tokens=args.max_batched_tokens)
    fleet = _fleet(workers, args, engine_kwargs)
    try:
        prompts = _prompts(B, P, cfg.vocab_size, seed=0)
        _warm_up(fleet, prompts[0])
        fleet._ensure_group()             # the process group once, outside the timed broadcast
        greedy = SamplingParams(max_new_tokens=G, temperature=0.0, ignore_eos=True)
        # Every worker gets the whole batch (one request each), so each is decoding when the update lands.
        running = [s.actor.run.remote(p, greedy) for s in fleet.slots for p in prompts]
        time.sleep(args.update_after_s)
        before = fleet.stats()["workers"]
        t0 = time.perf_counter()
        sent = fleet.update_weights(update, version=1, wait_commit=False)
        sent_s = time.perf_counter() - t0
        committed = ray.get([s.actor.wait_version.remote(1, 300.0) for s in fleet.slots])
        commit_s = time.perf_counter() - t0
        outs = ray.get(running)
        after = fleet.stats()["workers"]
    finally:
        fleet.shutdown()
    per_worker = {i: {**{k: after[i].get(f"weights/{k}", 0.0) - before[i].get(f"weights/{k}", 0.0)
                         for k in ("barrier_ms", "staging_ms", "updates")},
                      "policy_version": after[i]["policy_version"]} for i in after}
    comps = [c for o, _ in outs for c in o.completions]
    generated = [len(c.token_ids) for c in comps]
    # The update landed mid-decode where a completion has tokens of both versions.
    straddle = sum(1 for c in comps if set(c.policy_versions) == {0, 1})
    r = dict(mode="broadcast", workers=workers, backend="nccl" if gpu else "gloo", update_tensors=len(update),
             update_bytes=update_bytes, sent_bytes=sent, broadcast_s=sent_s,
             broadcast_GBps=sent / sent_s / 1e9, all_committed_s=commit_s, committed_versions=committed,
             per_worker=per_worker, decodes_completed=all(g == G for g in generated) and len(generated) == B * workers,
             sequences_spanning_the_update=straddle,
             max_barrier_ms=max(d["barrier_ms"] for d in per_worker.values()))
    print(f"broadcast {update_bytes / 1e9:.2f} GB to {workers} worker(s) over {r['backend']}: {sent_s:.2f} s "
          f"({r['broadcast_GBps']:.1f} GB/s), all committed after {commit_s:.2f} s; barrier stall per worker "
          f"(ms): {[round(d['barrier_ms'], 2) for d in per_worker.values()]}; decodes completed: "
          f"{r['decodes_completed']}, {straddle} of {len(comps)} sequences span the update", flush=True)
    return r


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("scaling", "broadcast"))
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES),
                    help="default: qwen2.5-1.5b for scaling, llama3-8b for broadcast")
    ap.add_argument("--device", default=None, help="cuda (one GPU per worker) or cpu; default cuda if available")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--workers", type=int, nargs="+", default=None,
                    help="scaling: worker counts to run (default 1 .. number of GPUs, doubling)")
    ap.add_argument("--num-workers", type=int, default=None, help="broadcast: workers (default GPUs - 1)")
    ap.add_argument("--prompts-per-worker", type=int, default=64)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (the GRPO group)")
    ap.add_argument("--batch", type=int, default=32, help="broadcast: sequences decoding on each worker")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=None, help="default 4096 (scaling) / 1024 (broadcast)")
    ap.add_argument("--update-after-s", type=float, default=20.0,
                    help="broadcast: seconds of decoding before the update is sent")
    ap.add_argument("--kv-bytes", type=int, default=None, help="KV cache bytes per worker (default: engine's)")
    ap.add_argument("--max-batched-tokens", type=int, default=4096)
    ap.add_argument("--cpus-per-worker", type=float, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.shape = args.shape or ("qwen2.5-1.5b" if args.mode == "scaling" else "llama3-8b")
    args.gen_len = args.gen_len or (4096 if args.mode == "scaling" else 1024)
    if args.workers is None:
        top = torch.cuda.device_count() if args.device == "cuda" else 2
        args.workers = [w for w in (1, 2, 4, 8) if w <= top] or [1]
    result = scaling(args) if args.mode == "scaling" else broadcast(args)
    result.update(shape=args.shape, device=args.device, dtype=args.dtype, prompt_len=args.prompt_len,
                  gen_len=args.gen_len, meta=run_meta("rollout.bench.fleet", argv))
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
