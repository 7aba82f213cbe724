"""The RL-shaped step (workload R1, docs long-tail.md): GRPO groups whose completion lengths are
long-tailed and unknown to the engine, timed end to end, for several admission settings side by
side on the same weights.

    python -m rollout.bench.rl_step --shape llama3-8b --runs adaptive,0,1 --out r1.json --png r1.png
    python -m rollout.bench.rl_step --runs 1 --out r1.json --append        # another call adds a run to the file
    python -m rollout.bench.rl_step --shape tiny --prompts 2 --n 2 --prompt-len 8 --median 8 --cap 24 \\
        --max-new-tokens 24 --dtype float32 --device cpu --runs adaptive,1

Lengths: sequence i (group i // n, sample i % n) draws floor(exp(ln median + sigma * z_i)), clipped
to [1, cap], z_i = random.Random(seed).gauss(0, 1) in order (R1, seed 0: 777,028 tokens). Every
request asks for --max-new-tokens, as a trainer sends its cap.

How a sequence stops at its drawn length: random weights emit no meaningful EOS, so a bench-only
hook on this engine's scheduler (`StepRecorder`, wrapping the instance's update_columns) finishes a
sequence with reason "stop" once its landed tokens reach its length, right after that step's tokens
land: the path an EOS takes (scheduler.finish: pages freed, the token in flight discarded).
Admission reads max_new_tokens and pages only, never the hook's lengths, so it decides as it would
with real EOS. Not used: engine.abort (per request: it would end all n samples at once) and a stop
token id (random weights sample any id by chance, about one in vocab per token: early stops).

Per run: makespan, tok/s over time, mean running sequences per step, preemptions, the time after 90%
of the tokens had landed, and the floor of the schedule it ran: the sum over its steps of the weight
bytes (an MoE's: the experts each step's tokens touch) plus the KV bytes of every scheduled sequence's
context, over the card's peak HBM bandwidth
(4.8 TB/s on the H200, 3.35 on the H100: bench/roofline.py), and
floor / makespan. --png: running sequences and tok/s over time, one line per run.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import random
import time
from pathlib import Path

import torch

from ..engine import RolloutEngine
from ..request import SamplingParams, Status
from .__main__ import run_meta, write_json
from .pressure import random_model
from .roofline import model_sizes, record_steps, schedule_floor_s
from .shapes import SHAPES, make_config

# what --append checks before adding runs to a file's
WORKLOAD = ("shape", "dtype", "prompts", "n", "prompt_len", "median", "sigma", "cap", "max_new_tokens", "drawn_tokens")


def draw_lengths(num: int, median: float, sigma: float, cap: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [min(cap, max(1, int(math.exp(math.log(median) + sigma * rng.gauss(0, 1))))) for _ in range(num)]


class StepRecorder:
    """Bench-only hooks on one engine's scheduler (instance attributes; the class is untouched):
    schedule() records each launched step (roofline.record_steps); update_columns() counts the tokens
    that landed, then finishes each sequence that reached its drawn length."""

    def __init__(self, engine: RolloutEngine, lengths: dict[tuple[int, int], int]):
        sch = engine.scheduler
        inner_update = sch.update_columns
        self.steps, self.landed = record_steps(engine), 0

        def update_columns(out, *cols, **kw):
            discarded = sch.num_discarded_tokens
            finished = inner_update(out, *cols, **kw)
            self.landed += out.num_rows - (sch.num_discarded_tokens - discarded)
            for t in out.targets:
                s = t.seq
                if s.status is Status.RUNNING and len(s.logprobs) >= lengths[s.request.request_id, s.sample_index]:
                    sch.finish(s, "stop")
                    if s.request.finished:
                        finished.append(s.request)
            return finished

        sch.update_columns = update_columns


def timed_run(label: str, fraction, model, cfg, prompts, lengths: list[int], args, device,
              speculative: str = "off") -> dict:
    n, sizes = args.n, model_sizes(cfg, getattr(torch, args.dtype).itemsize)
    engine = RolloutEngine(model, cfg, device=str(device), seed=args.seed, kv_reserve_fraction=fraction,
                           speculative=speculative,
                           max_model_len=args.prompt_len + args.max_new_tokens, num_kv_pages=args.num_kv_pages,
                           max_num_seqs=args.max_num_seqs or len(lengths),
                           max_num_batched_tokens=args.max_num_batched_tokens, preemption_mode=args.preemption_mode,
                           swap_space_gb=args.swap_space_gb, cuda_graph_modes=["sample"])
    warm = torch.randint(10, cfg.vocab_size - 10, (2, args.prompt_len), generator=torch.Generator().manual_seed(1))
    engine.generate(warm.tolist(), SamplingParams(n=2, max_new_tokens=8, seed=1, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(n=n, max_new_tokens=args.max_new_tokens, temperature=1.0, seed=args.seed, ignore_eos=True)
    p0, r0 = engine.scheduler.num_preemptions, engine.scheduler.num_recomputed_tokens
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    ids = engine.add_requests(prompts, params)
    rec = StepRecorder(engine, {(r, j): lengths[g * n + j] for g, r in enumerate(ids) for j in range(n)})
    times, landed, running, outs = [], [], [], []
    while engine.has_unfinished():
        outs += engine.step()
        times.append(time.perf_counter() - t0)
        landed.append(rec.landed)
        running.append(sum(s.fork_count for s in engine.scheduler.running))
    makespan, total = times[-1], landed[-1]
    got = [len(c.token_ids) for o in sorted(outs, key=lambda o: o.request_id) for c in o.completions]
    t90 = next(t for t, k in zip(times, landed) if k >= 0.9 * total)
    width = makespan / args.bins
    tokens_in, running_in = [[] for _ in range(args.bins)], [[] for _ in range(args.bins)]
    for t, k, k0, r in zip(times, landed, [0] + landed[:-1], running):
        tokens_in[min(int(t / width), args.bins - 1)].append(k - k0)
        running_in[min(int(t / width), args.bins - 1)].append(r)
    floor = schedule_floor_s(rec.steps, sizes)
    st = engine.stats()
    result = {
        "kv_reserve_fraction": fraction, "speculative": speculative,
        **{k: v for k, v in st.items() if k.startswith("spec_")}, "admission_fraction_at_end": engine.scheduler.admission_fraction,
        "kv_pages": engine.kv.alloc.num_usable, "makespan_s": makespan,
        "tokens": total, "tok_s": total / makespan, "lengths_honored": got == lengths,
        "finish_reasons": sorted({c.finish_reason for o in outs for c in o.completions}),
        "steps": len(rec.steps), "mean_running_seqs": sum(running) / len(running),
        "peak_running_seqs": max(running), "preemptions": st["preemptions"] - p0,
        "recomputed_tokens": st["recomputed_tokens"] - r0, "time_after_90pct_tokens_s": makespan - t90,
        **floor, "fraction_of_floor": floor["floor_s"] / makespan, "bin_s": width,
        "tok_s_over_time": [sum(b) / width for b in tokens_in],
        "running_over_time": [sum(b) / len(b) if b else 0.0 for b in running_in]}
    print(f"[{label}] makespan {makespan:.2f} s, {result['tok_s']:.0f} tok/s, mean running "
          f"{result['mean_running_seqs']:.1f}, {result['preemptions']} preemptions, floor {floor['floor_s']:.2f} s "
          f"({100 * result['fraction_of_floor']:.0f}% of it reached), last 10% of tokens {makespan - t90:.2f} s",
          flush=True)
    del engine, rec
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def plot(runs: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for label, r in runs.items():
        t = [(i + 0.5) * r["bin_s"] for i in range(len(r["tok_s_over_time"]))]
        top.plot(t, r["running_over_time"], label=f"{label}: {r['makespan_s']:.1f} s")
        bottom.plot(t, r["tok_s_over_time"], label=label)
    top.set_ylabel("running sequences")
    bottom.set_ylabel("tok/s")
    bottom.set_xlabel("s")
    top.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _parse_run(run: str) -> tuple:
    """'adaptive' | a fraction, optionally '+spec' (speculative="ngram"): (fraction, speculative)."""
    base = run.removesuffix("+spec")
    f = None if base == "adaptive" else float(base)
    if f is not None and not 0 <= f <= 1:
        raise ValueError(run)
    return f, "ngram" if run.endswith("+spec") else "off"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (a GRPO group)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--median", type=float, default=2048, help="median completion length")
    ap.add_argument("--sigma", type=float, default=0.9, help="log-normal sigma of the lengths")
    ap.add_argument("--cap", type=int, default=16384, help="longest drawn length")
    ap.add_argument("--max-new-tokens", type=int, default=16384, help="what every request asks for")
    ap.add_argument("--runs", default="adaptive,0,1",
                    help="comma list of kv_reserve_fraction settings: 'adaptive' (None, the default) or a number; "
                         "'+spec' after one: with speculative='ngram' (random weights: what drafting costs)")
    ap.add_argument("--num-kv-pages", type=int, default=None, help="default: the engine's KV sizing")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: prompts x n")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--preemption-mode", default="recompute", choices=("recompute", "swap", "auto"))
    ap.add_argument("--swap-space-gb", type=float, default=0.0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bins", type=int, default=50, help="time bins of the tok/s and running curves")
    ap.add_argument("--out", default=None)
    ap.add_argument("--append", action="store_true",
                    help="keep the runs already in --out (the same workload, checked) and add these: R1's three "
                         "settings take longer together than one 10-minute device call")
    ap.add_argument("--png", default=None)
    args = ap.parse_args(argv)
    if args.cap > args.max_new_tokens:
        ap.error(f"--cap {args.cap} exceeds --max-new-tokens {args.max_new_tokens}")
    try:
        settings = {run: _parse_run(run) for run in args.runs.split(",")}
    except ValueError:
        ap.error(f"--runs: each entry is 'adaptive' or a number in [0, 1], optionally with '+spec', got {args.runs!r}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = make_config(args.shape)
    model = random_model(cfg, getattr(torch, args.dtype), device, args.seed)
    lengths = draw_lengths(args.prompts * args.n, args.median, args.sigma, args.cap, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(10, cfg.vocab_size - 10, (args.prompts, args.prompt_len), generator=gen).tolist()
    result = {"shape": args.shape, "dtype": args.dtype, "prompts": args.prompts, "n": args.n,
              "prompt_len": args.prompt_len, "median": args.median, "sigma": args.sigma, "cap": args.cap,
              "max_new_tokens": args.max_new_tokens, "drawn_tokens": sum(lengths), "drawn_max": max(lengths),
              "runs": {}, "meta": run_meta("rollout.bench.rl_step", argv)}
    if args.append and args.out and Path(args.out).exists():
        earlier = json.loads(Path(args.out).read_text())
        differ = [k for k in WORKLOAD if earlier.get(k) != result[k]]
        if differ:
            raise SystemExit(f"--append: {args.out} holds another workload ({', '.join(differ)} differ)")
        result["runs"] = earlier["runs"]
        result["earlier_meta"] = earlier.get("earlier_meta", []) + [earlier["meta"]]
    for run, (f, spec) in settings.items():
        name = f"kv_reserve_fraction={run.removesuffix('+spec')}" + (" speculative=ngram" if spec != "off" else "")
        result["runs"][name] = timed_run(run, f, model, cfg, prompts, lengths, args, device, spec)
        result["runs"][name]["git_commit"] = result["meta"]["git_commit"]
        write_json(result, args.out)      # after each run: a call cut short keeps the runs it finished
    if args.png:
        plot(result["runs"], args.png)
    return result


if __name__ == "__main__":
    main()
