"""GRPO on the embedded tiny arithmetic model with TRL's GRPOTrainer and our rollout worker as its generator.

    python scripts/train.py                      # ~1.5 min on 2 CPU cores; W&B offline under outputs/train
    python scripts/train.py --report-to none --steps 60

The trainer loads rollout/assets/arith-tiny (fp32); a RolloutWorker over the same folder generates the completions
through `trainers.attach_generator` (TRL's vLLM slot: TRL's importance-sampling correction stays on, and
`sampling/sampling_logp_difference` measures our logprobs against the trainer's). The reward is exact match;
prompts are 2-digit subtractions, the problems the model gets wrong most often, so the reward has room to rise.
Writes the per-step rewards and the command to --json and a reward-vs-step plot to --plot (default
<--output-dir>/grpo_arith_reward.{png,json}); bench/results/grpo_arith_reward.* is the published run.

By default only the output head and the final norm are trained (Adam, lr 1e-2): the SFT model sits at a sharp
optimum that full-parameter updates at a useful learning rate break; the head learns to sharpen the sampling
distribution (T=1 accuracy rises toward the greedy accuracy). `--train-params all --lr 1e-5` trains everything.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Import the repo's packages (rollout, trainers), never a sibling script such as scripts/rollout.py.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from rollout.tasks import arith  # noqa: E402  (after the sys.path fix: the package, not scripts/rollout.py)


def make_prompts(n: int, seed: int, sub_frac: float) -> list[dict]:
    """`sub_frac` of the problems are 2-digit subtractions (the weak spot); the rest follow the default mix."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        if rng.random() < sub_frac:
            prompt, answer = arith.make_problem(rng, digits=2)
            if "-" not in prompt:
                continue
        else:
            prompt, answer = arith.make_problem(rng)
        rows.append({"prompt": prompt, "answer": answer})
    return rows


def arith_reward(prompts, completions, **kwargs) -> list[float]:
    return [arith.reward(p, c) for p, c in zip(prompts, completions)]


def evaluate(worker, prompts: list[str], temperature: float, n: int, seed: int) -> float:
    from rollout import SamplingParams

    outs = worker.generate(prompts, SamplingParams(n=n, temperature=temperature, max_new_tokens=8, seed=seed))
    scores = [arith.reward(p, c.text) for p, o in zip(prompts, outs) for c in o.completions]
    return sum(scores) / len(scores)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--prompts-per-step", type=int, default=32, help="unique prompts per step (x num-generations)")
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--warmup-steps", type=int, default=0)
    ap.add_argument("--lr-schedule", default="constant_with_warmup", help="transformers lr_scheduler_type")
    ap.add_argument("--optim", default="adamw_torch", help="transformers optimizer name (e.g. adamw_torch, sgd)")
    ap.add_argument("--train-params", default="lm_head,model.norm",
                    help="'all', or a comma-separated list of parameter-name substrings to train (others frozen)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-completion-length", type=int, default=8)
    ap.add_argument("--sub-frac", type=float, default=1.0, help="share of 2-digit subtraction prompts")
    ap.add_argument("--is-mode", default="token_truncate",
                    choices=["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for the trainer and the engine (1: robust to a busy machine)")
    ap.add_argument("--report-to", default="wandb", choices=["wandb", "none"],
                    help="wandb runs offline (WANDB_MODE=offline) unless WANDB_MODE is set")
    ap.add_argument("--output-dir", default=str(ROOT / "outputs" / "train"), help="trainer, W&B, plot and JSON")
    ap.add_argument("--plot", default=None, help="default: <output-dir>/grpo_arith_reward.png")
    ap.add_argument("--json", default=None, help="default: --plot with .json")
    args = ap.parse_args(argv)

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer
    import trl

    from rollout import RolloutEngine
    from rollout.worker import RolloutWorker
    from trainers import attach_generator

    hf_logging.set_verbosity_error()
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_path = Path(args.plot or out_dir / "grpo_arith_reward.png")
    if args.report_to == "wandb":
        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_DIR", str(out_dir))
        os.environ.setdefault("WANDB_PROJECT", "rollout-grpo-arith")
        os.environ.setdefault("WANDB_SILENT", "true")

    path = arith.ensure_default_model()
    G = args.num_generations
    rows = make_prompts(args.steps * args.prompts_per_step + 64, args.seed, args.sub_frac)
    held_out = [r["prompt"] for r in make_prompts(200, args.seed + 10_000, 1.0)]
    config = GRPOConfig(
        output_dir=str(out_dir), max_steps=args.steps, per_device_train_batch_size=args.prompts_per_step * G,
        num_generations=G, max_completion_length=args.max_completion_length, temperature=args.temperature,
        learning_rate=args.lr, lr_scheduler_type=args.lr_schedule, warmup_steps=args.warmup_steps, optim=args.optim,
        beta=0.0, bf16=False, use_cpu=True,
        logging_steps=1, save_strategy="no", report_to=args.report_to, run_name="grpo-arith", seed=args.seed,
        vllm_importance_sampling_mode=args.is_mode, dataloader_num_workers=0, disable_tqdm=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if args.train_params != "all":
        keep = [k for k in args.train_params.split(",") if k]
        for name, p in model.named_parameters():
            p.requires_grad_(any(k in name for k in keep))
    trainer = GRPOTrainer(model=model, reward_funcs=arith_reward, args=config,
                          train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    # The engine sets torch's thread count process-wide (cpu_threads), so it holds for the trainer's steps too.
    worker = RolloutWorker(RolloutEngine.from_pretrained(path, device="cpu", dtype="float32", seed=args.seed,
                                                         cpu_threads=args.threads))
    adapter = attach_generator(trainer, worker)          # the one-line change from use_vllm=True

    before = {"greedy": evaluate(worker, held_out, 0.0, 1, 1), "t1": evaluate(worker, held_out, 1.0, 8, 1)}
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    adapter.sync_weights()        # push the last optimizer step too, then evaluate the trained policy
    after = {"greedy": evaluate(worker, held_out, 0.0, 1, 1), "t1": evaluate(worker, held_out, 1.0, 8, 1)}

    hist = [h for h in trainer.state.log_history if "reward" in h]
    steps = [int(h["step"]) for h in hist]
    rewards = [float(h["reward"]) for h in hist]
    k = max(1, min(10, len(rewards) // 5))
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    cmd = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT)] + (argv or sys.argv[1:]))
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = None
    result = {
        "command": cmd, "git_commit": commit, "wall_time_s": round(wall, 1), "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus", "trl": trl.__version__, "torch": torch.__version__,
        "config": {k_: v for k_, v in vars(args).items() if k_ not in ("plot", "json", "output_dir")},
        "steps": steps, "reward": rewards,
        "reward_first_k_mean": first, "reward_last_k_mean": last, "k": k,
        "sampling_logp_difference_max": [h.get("sampling/sampling_logp_difference/max") for h in hist],
        "importance_sampling_ratio_mean": [h.get("sampling/importance_sampling_ratio/mean") for h in hist],
        "policy_version": [h.get("gen/policy_version") for h in hist],
        "policy_version_lag": [h.get("gen/policy_version_lag") for h in hist],
        "tokens_per_s": [h.get("gen/tokens_per_s") for h in hist],
        "held_out_2digit_sub": {"n": len(held_out), "before": before, "after": after},
    }
    json_path = Path(args.json or plot_path.with_suffix(".json"))
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    _plot(steps, rewards, k, plot_path, result)
    print(f"reward (mean of first/last {k} steps): {first:.3f} -> {last:.3f}; wall {wall:.0f}s; "
          f"held-out greedy {before['greedy']:.3f} -> {after['greedy']:.3f}, "
          f"T=1 {before['t1']:.3f} -> {after['t1']:.3f}; max |dlogp| "
          f"{max(x for x in result['sampling_logp_difference_max'] if x is not None):.2e}")
    print(f"wrote {json_path} and {plot_path}")
    return result


def _plot(steps, rewards, k, path: Path, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = max(1, k)
    smooth = [sum(rewards[max(0, i - w + 1):i + 1]) / len(rewards[max(0, i - w + 1):i + 1])
              for i in range(len(rewards))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, color="tab:blue", alpha=0.35, lw=1, label="mean reward per step")
    ax.plot(steps, smooth, color="tab:blue", lw=2, label=f"moving mean ({w} steps)")
    ho = result["held_out_2digit_sub"]
    ax.set_title(f"GRPO (TRL {result['trl']}) on arith-tiny, rollout worker as generator\n"
                 f"held-out 2-digit subtraction, T=1: {ho['before']['t1']:.2f} -> {ho['after']['t1']:.2f}, "
                 f"greedy: {ho['before']['greedy']:.2f} -> {ho['after']['greedy']:.2f}", fontsize=9)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("exact-match reward (T=1 samples)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
