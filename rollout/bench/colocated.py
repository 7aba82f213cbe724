"""Colocated GRPO: TRL's GRPOTrainer and the generator on one GPU, in one process, variant after variant
on the same random weights (a fresh trainer and model each):

    trl     TRL's own generation (use_vllm=False, nothing attached: transformers' generate)
    ours    our RolloutWorker via attach_generator, awake throughout
    sleep1  ours, asleep at level 1 between generations (KV cache, graphs and cached blocks given back;
            each graph captured again on its first use after a wake)
    sleep1-recapture  the same, every graph captured again at each wake instead (the other choice)
    sleep2  ours, asleep at level 2 (the weights dropped too; each sync refills them)
    http    our server in another process (on --server-gpu, 1; CPU: the same device) through the HTTP adapter,
            weights over a torch.distributed group (NCCL / gloo) each step: TRL's server mode, not colocated

    python -m rollout.bench.colocated --shape qwen2.5-0.5b --steps 4 --out bench/results/colocated.json
    python -m rollout.bench.colocated --device cpu --shape tiny --steps 2       # a smoke run
    NCCL_NVLS_ENABLE=0 python -m rollout.bench.colocated --shape qwen2.5-1.5b --variants http,trl   # two GPUs

The reward is a hash of the completion's token ids (it varies within a group, so the policy gradient is
real; random weights say nothing meaningful anyway). Per variant: seconds per GRPO step (median over the
steps after the first), the share of it inside TRL's generation call (weight sync, wake and sleep included),
peak GPU memory (allocated / reserved, reset per variant) and what is held at the optimizer step, TRL's
logged `sampling/importance_sampling_ratio/*` and `sampling/sampling_logp_difference/*` (our variants:
TRL's recompute in the trainer's dtype vs our sampling logprobs), and for the sleep variants the bytes
freed, the sleep / wake seconds and the graphs captured on first use. Needs trl (1.16), datasets and accelerate.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from .__main__ import run_meta, write_json
from .shapes import SHAPES, make_config

# -> the adapter's sleep_level (None: TRL's). sleep1-recapture: level 1, every graph key captured again at each
# wake (the alternative to capturing each key on first use, measured beside it)
VARIANTS = {"trl": None, "ours": 0, "sleep1": 1, "sleep1-recapture": 1, "sleep2": 2, "http": 0}
COLOCATED = "trl,ours,sleep1,sleep1-recapture,sleep2"
TOKENIZER = Path(__file__).resolve().parents[1] / "assets" / "arith-tiny"   # character-level, offline


def _reward(prompts, completions, completion_ids, **kw):
    return [(sum(ids) % 97) / 97.0 for ids in completion_ids]


def _dataset(rows: int, prompt_len: int, seed: int):
    import random

    from datasets import Dataset
    rng = random.Random(seed)
    return Dataset.from_list([{"prompt": "".join(rng.choice("0123456789+-=") for _ in range(prompt_len))}
                              for _ in range(rows)])


def _callback(record: dict, worker):
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            record["t0"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            record["step_s"].append(time.perf_counter() - record["t0"])

        def on_pre_optimizer_step(self, args, state, control, **kw):
            if torch.cuda.is_available():
                record["at_optimizer_step"].append({"allocated_gb": torch.cuda.memory_allocated() / 1e9,
                                                    "reserved_gb": torch.cuda.memory_reserved() / 1e9})
            if worker is not None and not getattr(worker, "remote", False):
                record["sleep_level_at_optimizer_step"].append(worker.engine.sleep_level)
    return Timer()


def _timed(fn, into: list):
    def call(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            into.append(time.perf_counter() - t0)
    return call


def _median_after_first(xs: list) -> float:
    return statistics.median(xs[1:] if len(xs) > 1 else xs)


def _summary(reports: list, key: str):
    vals = [r[key] for r in reports if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def _server_worker(args):
    from ..engine import RolloutEngine
    from ..worker import RolloutWorker
    return RolloutWorker(RolloutEngine.from_config(
        make_config(args.shape), seed=args.seed, device=args.device, dtype=args.dtype,
        max_model_len=args.prompt_len + args.completion_len + 8, max_num_seqs=args.max_num_seqs))


def _serve_child(args, port: int) -> None:     # as `python -m rollout.serve`: the engine in its own process
    from ..serve import ServeOptions, serve
    from ..serve.remote import EngineProcess
    serve(EngineProcess(partial(_server_worker, args)), ServeOptions(served_model_name="bench"), port=port,
          log_level="warning")


def run_variant(name: str, args, cfg, tokenizer, dataset) -> dict:
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from ..engine import RolloutEngine
    from ..worker import RolloutWorker
    from trainers import attach_generator

    cuda = args.device == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(args.device)
    record = {"step_s": [], "gen_s": [], "sync_s": [], "at_optimizer_step": [], "sleep_level_at_optimizer_step": []}
    worker = None
    level = VARIANTS[name]
    stack = contextlib.ExitStack()
    if name == "http":
        from trainers.trl_http import HTTPWorker

        from ..client import RolloutClient
        from .serve import server_process
        url = stack.enter_context(server_process(_serve_child, args, gpu=args.server_gpu if cuda else None))
        worker = HTTPWorker(RolloutClient(url))
        stack.callback(worker.close)           # leaves the weight group before the server stops
    elif level is not None:
        engine = RolloutEngine.from_config(
            cfg, seed=args.seed, device=args.device, dtype=args.dtype,
            max_model_len=args.prompt_len + args.completion_len + 8, max_num_seqs=args.max_num_seqs,
            gpu_memory_utilization=args.gpu_memory_utilization if cuda else None)
        worker = RolloutWorker(engine)
        if name == "sleep1-recapture" and engine.pipeline.graphs is not None:
            wake = worker.wake

            def wake_and_recapture(tags=None):
                t0 = time.perf_counter()
                out = wake(tags)
                if not engine.asleep:         # the graphs read the KV pool too: once everything is back
                    engine.pipeline.graphs.capture(progress=False)
                return {**out, "seconds": time.perf_counter() - t0}
            worker.wake = wake_and_recapture
    with stack, tempfile.TemporaryDirectory() as out:
        gargs = GRPOConfig(output_dir=out, per_device_train_batch_size=args.batch, num_generations=args.num_generations,
                           max_completion_length=args.completion_len, learning_rate=args.lr, max_steps=args.steps,
                           logging_steps=1, bf16=cuda and args.dtype == "bfloat16", use_cpu=not cuda, beta=args.beta,
                           temperature=1.0, report_to="none", save_strategy="no", seed=args.seed, disable_tqdm=True,
                           dataloader_num_workers=0, lr_scheduler_type="constant")
        trainer = GRPOTrainer(model=model, reward_funcs=_reward, args=gargs, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[_callback(record, worker)])
        adapter = None
        if worker is not None:
            adapter = attach_generator(trainer, worker, sleep_level=level or None)
            adapter.sync_weights = _timed(adapter.sync_weights, record["sync_s"])
        trainer._generate_single_turn = _timed(trainer._generate_single_turn, record["gen_s"])
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0
    step_s, gen_s = _median_after_first(record["step_s"]), _median_after_first(record["gen_s"])
    logs = [h for h in trainer.state.log_history if "reward" in h]
    keys = sorted({k for h in logs for k in h if k.startswith(("sampling/", "gen/"))})
    res = {"steps": len(record["step_s"]), "wall_s": wall, "step_s": step_s, "step_s_all": record["step_s"],
           "generation_s": gen_s, "generation_share": gen_s / step_s, "generation_s_all": record["gen_s"],
           "weight_sync_s": _median_after_first(record["sync_s"]) if record["sync_s"] else None,
           "logged": {k: [h.get(k) for h in logs] for k in keys}}
    if cuda:
        res.update(peak_allocated_gb=torch.cuda.max_memory_allocated() / 1e9,
                   peak_reserved_gb=torch.cuda.max_memory_reserved() / 1e9,
                   at_optimizer_step=record["at_optimizer_step"])
    if adapter is not None and adapter.sleep_level:
        sleeps, wakes = adapter.sleep_reports, adapter.wake_reports
        res.update(sleep_level_at_optimizer_step=record["sleep_level_at_optimizer_step"],
                   sleeps=len(sleeps), wakes=len(wakes),
                   released_gb=_summary(sleeps, "released_bytes") / 1e9,
                   device_freed_gb=(_summary(sleeps, "device_freed_bytes") or 0) / 1e9 if cuda else None,
                   sleep_s=_summary(sleeps, "seconds"), wake_s=_summary(wakes, "seconds"),
                   sleep_reports=sleeps, wake_reports=wakes)
        if isinstance(worker, RolloutWorker):      # after a wake, each graph key is captured on its first use
            st = worker.engine.stats()
            res.update(graph_captures_on_use=st["graph_captures"], graph_capture_on_use_s=st["graph_capture_on_use_s"])
    del trainer, model, adapter, worker
    gc.collect()
    return res


def _line(name: str, r: dict) -> str:
    is_mean = (r["logged"].get("sampling/importance_sampling_ratio/mean") or [None])[-1]
    dlogp = (r["logged"].get("sampling/sampling_logp_difference/max") or [None])[-1]
    mem = f" peak {r['peak_reserved_gb']:.1f} GB reserved" if "peak_reserved_gb" in r else ""
    sl = (f" sleep {r['sleep_s']:.3f} s wake {r['wake_s']:.3f} s freed {r['released_gb']:.2f} GB"
          if "sleep_s" in r else "")
    if r.get("graph_captures_on_use"):
        sl += f", {r['graph_captures_on_use']} graphs captured on first use in {r['graph_capture_on_use_s']:.2f} s"
    return (f"{name:7s} {r['step_s']:.2f} s/step, generation {100 * r['generation_share']:.0f}%{mem}; "
            f"IS ratio mean {is_mean}, max |dlogp| {dlogp}{sl}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64, help="per_device_train_batch_size (rows per step)")
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128, help="characters = tokens (+ <bos>)")
    ap.add_argument("--completion-len", type=int, default=256)
    ap.add_argument("--beta", type=float, default=0.0, help="KL coefficient (> 0 adds TRL's reference model)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="the engine's share (TRL's default)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--variants", default=COLOCATED, help=f"comma-separated, from {list(VARIANTS)}")
    ap.add_argument("--server-gpu", type=int, default=1, help="http: the server's GPU (the trainer takes cuda:0)")
    ap.add_argument("--warmup", default="ours", help="a variant run first and not reported ('none': skip): the "
                    "process's first trainer steps and first-seen shapes compile kernels, which would land on "
                    "whichever variant ran first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or args.warmup not in (*VARIANTS, "none"):
        raise SystemExit(f"unknown variants {unknown or [args.warmup]}; choose from {list(VARIANTS)}")
    if "http" in names and args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit("the http variant on CUDA needs two GPUs: the trainer on cuda:0, the server on --server-gpu")
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    cfg = make_config(args.shape)
    dataset = _dataset(max(64, args.steps * args.batch // args.num_generations * 2), args.prompt_len, args.seed)
    result = {"shape": args.shape, "device": args.device, "dtype": args.dtype, "steps": args.steps, "batch": args.batch,
              "num_generations": args.num_generations, "prompt_len": args.prompt_len,
              "completion_len": args.completion_len, "beta": args.beta,
              "gpu_memory_utilization": args.gpu_memory_utilization, "variants": {},
              "meta": run_meta("rollout.bench.colocated", argv)}
    if args.warmup != "none":
        warm = run_variant(args.warmup, args, cfg, tokenizer, dataset)
        result["warmup"] = {"variant": args.warmup, "step_s_all": warm["step_s_all"]}
        print("warm-up", _line(args.warmup, warm), flush=True)
    for name in names:
        result["variants"][name] = r = run_variant(name, args, cfg, tokenizer, dataset)
        print(_line(name, r), flush=True)
        write_json(result, args.out)      # after each variant: a later failure keeps the earlier ones
    return result


if __name__ == "__main__":
    main()
