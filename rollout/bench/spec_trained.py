"""Speculative decoding on a trained model (issue R1's acceptance run): train a small Llama on a task
whose completions end by EOS with long-tailed lengths and repeated structure, then run GRPO-shaped
batches on it (groups of n, lengths set by its own EOS) with speculation off and on, in one call.

    python -m rollout.bench.spec_trained --out bench/results/<name>.json          # H200: ~90 s of training
    python -m rollout.bench.spec_trained --hidden 768 --layers 8 --widen 4096,14336,32   # memory-bound steps
    python -m rollout.bench.spec_trained --device cpu --dtype float32 --train-steps 150 --hidden 64 \\
        --prompts 4 --n 4 --digits-cap 6                                          # a smoke run

The task: column addition worked digit by digit, least significant first, then the sum:
    prompt "4071+865="   completion "1+5+0=6 7+6+0=13 0+8+1=9 4+0+0=4 4936<eos>"
Operand digits are log-normal (median --digits-median, sigma --digits-sigma, clipped to [1, --digits-cap]),
so a completion's length (~8 tokens a digit) is long-tailed, and each step repeats the step before's shape.
The defaults give R1's length shape (sigma 0.9, the cap 8x the median): most of the batch ends early and a
few long sequences set the makespan.
The recipe and seed make the run repeatable; the model is not kept.

Both engines first run the timed batches once, untimed (kernels compiled, decode and verify graphs captured),
then --repeats rounds of (each run's median makespan is reported; the prompts are each asked --n times,
temperature 1, max_new_tokens --max-new-tokens):
    off      speculation off, sampling seed S
    on       speculative="ngram" (drafts from the sequence and its group), seed S
    off2     off again with seed S + 1 (a fresh GRPO step's samples)
    on2      speculation on, seed S + 1, the drafter holding run "on"'s completions of each prompt as earlier
             rollouts (spec_history_prompts): the SPEC-RL / DAS source; the weights did not change between
             the two, which an RL step would do, so this is the best case of that source
    on_ungated, on2_ungated   (--speed-gate both, the default) "on" and "on2" again on the same engine with
             its spec_speed_gate switched off: what the gate keeps or gives up
--widen HIDDEN,INTERMEDIATE,LAYERS runs the batches on a wider, deeper model that computes the trained one's
function: its weights sit in the corner of zero-padded matrices (extra heads, hidden and intermediate
dims zero; the norms' gains and eps rescaled for the wider RMS), and the extra layers' output projections are zero.
The trained model is tiny, so its decode steps are host-bound (~1 ms, whatever the batch); widened to an
8B-like size (4096,14336,32: 7.2B parameters, ~4 ms a step on an H100) each step reads as many weight
bytes as a real policy's, as in R1, while acceptance stays the trained model's.

Reported per run: makespan (the generate call's wall), tokens, tok/s, engine steps, the speculator's
counters (drafted, accepted, acceptance, tokens per drafted sequence-step), tokens per sequence-step by
running batch size, and the task's accuracy (the final sum right); between each off / on pair: the share
of sequences whose tokens are identical (exact by construction in fp32 and under batch_invariant; bf16
otherwise: drafted rows are verified in another batch shape, so the logits may round apart) and the
makespan ratio (target <= 0.7).
"""
from __future__ import annotations

import argparse
import math
import random
import tempfile
import time
from collections import OrderedDict

import torch

from ..engine import RolloutEngine
from ..request import SamplingParams
from .__main__ import run_meta, write_json

ROW_BINS = ((1, 8), (9, 32), (33, 64), (65, 128), (129, 1 << 30))


def draw_digits(rng: random.Random, median: float, sigma: float, cap: int) -> int:
    return min(cap, max(1, int(math.exp(math.log(median) + sigma * rng.gauss(0, 1)))))


def number(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10 ** digits - 1)


def worked_sum(a: int, b: int) -> str:
    """Column addition, least significant digit first: 'x+y+carry=s ' a column, then the sum."""
    da, db = str(a)[::-1], str(b)[::-1]
    steps, carry = [], 0
    for k in range(max(len(da), len(db))):
        x, y = int(da[k]) if k < len(da) else 0, int(db[k]) if k < len(db) else 0
        s = x + y + carry
        steps.append(f"{x}+{y}+{carry}={s} ")
        carry = s // 10
    return "".join(steps) + str(a + b)


def problem(rng: random.Random, args) -> tuple[str, str]:
    a = number(rng, draw_digits(rng, args.digits_median, args.digits_sigma, args.digits_cap))
    b = number(rng, draw_digits(rng, args.digits_median, args.digits_sigma, args.digits_cap))
    return f"{a}+{b}=", worked_sum(a, b)


def correct(prompt: str, completion: str) -> bool:
    a, b = (int(x) for x in prompt.rstrip("=").split("+"))
    return completion.rsplit(" ", 1)[-1] == str(a + b)


def train(args, device: torch.device, out_dir: str) -> dict:
    """A Llama trained from scratch on worked sums (loss on the completion and its EOS), saved to out_dir."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..tasks.arith_train import BOS, EOS, PAD, VOCAB, build_tokenizer
    longest = 2 * args.digits_cap + 2 + 9 * (args.digits_cap + 1) + args.digits_cap + 2
    ids = dict(bos_token_id=VOCAB[BOS], eos_token_id=VOCAB[EOS], pad_token_id=VOCAB[PAD])
    torch.manual_seed(args.seed)
    cfg = LlamaConfig(vocab_size=len(VOCAB), hidden_size=args.hidden, num_hidden_layers=args.layers,
                      num_attention_heads=max(1, args.hidden // 64), num_key_value_heads=max(1, args.hidden // 128),
                      intermediate_size=3 * args.hidden, max_position_embeddings=max(64, 1 << (longest - 1).bit_length()),
                      tie_word_embeddings=False, **ids)
    model = LlamaForCausalLM(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    rng = random.Random(args.seed)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    t0, step, losses = time.perf_counter(), 0, []
    while (args.train_steps is None and time.perf_counter() - t0 < args.train_s) or \
            (args.train_steps is not None and step < args.train_steps):
        frac = (time.perf_counter() - t0) / args.train_s if args.train_steps is None else step / args.train_steps
        for g in opt.param_groups:          # warm-up, then cosine over the budget
            g["lr"] = args.lr * min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        batch = [problem(rng, args) for _ in range(args.batch)]
        seqs = [([VOCAB[BOS]] + [VOCAB[c] for c in p], [VOCAB[c] for c in c_] + [VOCAB[EOS]]) for p, c_ in batch]
        T = max(len(p) + len(c) for p, c in seqs)
        x = torch.full((len(seqs), T), VOCAB[PAD], dtype=torch.long)
        y = torch.full((len(seqs), T), -100, dtype=torch.long)
        for i, (p, c) in enumerate(seqs):
            x[i, :len(p) + len(c)] = torch.tensor(p + c)
            y[i, len(p):len(p) + len(c)] = torch.tensor(c)
        x, y = x.to(device), y.to(device)
        with amp:
            loss = model(input_ids=x, attention_mask=(x != VOCAB[PAD]).long(), labels=y).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        step += 1
        if step % args.log_every == 0:
            print(f"train step {step}: loss {sum(losses[-args.log_every:]) / args.log_every:.4f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    model.to(torch.float32).save_pretrained(out_dir, safe_serialization=True)
    build_tokenizer().save_pretrained(out_dir)
    return {"steps": step, "seconds": time.perf_counter() - t0, "final_loss": sum(losses[-20:]) / len(losses[-20:]),
            "params": sum(p.numel() for p in model.parameters()), "config": {
                "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
                "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
                "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size}}


def widened(folder: str, hidden: int, intermediate: int, layers: int, device: torch.device, dtype: torch.dtype):
    """(config, HF state dict) of a model computing the trained model's function at a larger size (module doc).
    Zero rows / columns leave each sum unchanged: extra heads have zero queries, keys and values (uniform
    attention over zero values, then zero output columns), extra intermediate units a zero gate (silu(0) = 0),
    extra hidden dims stay zero down the residual; an RMSNorm over the padded width divides by
    sqrt(hidden / h) less, so its gain is scaled by sqrt(h / hidden) and its eps by h / hidden. Head size
    and RoPE are unchanged."""
    from transformers import LlamaConfig, LlamaForCausalLM
    small = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    c = small.config
    h, hd = c.hidden_size, c.hidden_size // c.num_attention_heads
    group = c.num_attention_heads // c.num_key_value_heads
    if hidden < h or intermediate < c.intermediate_size or layers < c.num_hidden_layers or hidden % (hd * group):
        raise ValueError(f"--widen {hidden},{intermediate},{layers}: each at least the trained model's "
                         f"({h},{c.intermediate_size},{c.num_hidden_layers}), hidden a multiple of {hd * group}")
    big = LlamaConfig(**{**c.to_dict(), "hidden_size": hidden, "intermediate_size": intermediate,
                         "num_hidden_layers": layers, "num_attention_heads": hidden // hd,
                         "num_key_value_heads": hidden // hd // group, "head_dim": hd,
                         "rms_norm_eps": c.rms_norm_eps * h / hidden})     # mean over more zeros: eps scaled alike
    gain = math.sqrt(h / hidden)
    shapes = {"q_proj": (hidden, hidden), "k_proj": (hidden // group, hidden), "v_proj": (hidden // group, hidden),
              "o_proj": (hidden, hidden), "gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden),
              "down_proj": (hidden, intermediate)}
    out = {}

    def padded(t, shape, fill=0.0):
        z = torch.full(shape, fill, dtype=dtype, device=device)
        z[tuple(slice(0, n) for n in t.shape)] = t.to(device, dtype)
        return z
    sd = small.state_dict()
    out["model.embed_tokens.weight"] = padded(sd["model.embed_tokens.weight"], (c.vocab_size, hidden))
    out["lm_head.weight"] = padded(sd["lm_head.weight"], (c.vocab_size, hidden))
    out["model.norm.weight"] = padded(sd["model.norm.weight"] * gain, (hidden,))
    for i in range(layers):
        pre = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            src = sd.get(pre + norm + ".weight")
            out[pre + norm + ".weight"] = (padded(src * gain, (hidden,)) if src is not None
                                           else torch.ones(hidden, dtype=dtype, device=device))
        for name, shape in shapes.items():
            part = "self_attn." if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp."
            src = sd.get(pre + part + name + ".weight")
            out[pre + part + name + ".weight"] = (padded(src, shape) if src is not None
                                                  else torch.zeros(shape, dtype=dtype, device=device))
    return big, out


class StepLog:
    """Per engine step (a bench-only wrapper on this engine's step): running sequences, tokens landed and
    the step call's wall time (in async mode a call launches one batch and waits for the one before, so its
    wall is the device's time per step once the pipeline is full)."""

    def __init__(self, engine: RolloutEngine):
        self.engine, self.rows = engine, []
        real = engine.step

        def step():
            running, busy = len(engine.scheduler.running), engine.pipeline.busy_ms
            before, t0 = engine.metrics["generated_tokens"], time.perf_counter()
            out = real()
            self.rows.append((running, engine.metrics["generated_tokens"] - before, time.perf_counter() - t0,
                              (engine.pipeline.busy_ms - busy) / 1e3))
            return out
        engine.step = step

    def by_batch_size(self) -> dict:
        """Per bin of running batch size: steps, tokens per sequence-step, the seconds spent there and the
        device's compute time in them (CUDA; the batches the steps waited for): the rest is the device idle,
        e.g. a drafted step's host work, which does not overlap a batch in flight."""
        out = {}
        for lo, hi in ROW_BINS:
            # (a last call with nothing left running collects the final batch in flight: the first bin's)
            sel = [row for row in self.rows if lo <= max(row[0], 1) <= hi]
            if sel:
                rows = sum(r for r, *_ in sel)
                out[f"{lo}-{hi if hi < 1 << 30 else 'up'}"] = {
                    "steps": len(sel), "tokens_per_seq_step": sum(t for _, t, _, _ in sel) / rows,
                    "seconds": sum(s for _, _, s, _ in sel), "gpu_seconds": sum(g for *_, g in sel)}
        return out


def run(label: str, engine: RolloutEngine, prompts: list[list[int]], texts: list[str], args, seed: int) -> dict:
    log = StepLog(engine)
    spec0 = {k: v for k, v in engine.stats().items() if k.startswith("spec_")}
    counts0 = dict(engine.pipeline.counts)
    capture0 = engine.stats().get("graph_capture_on_use_s") or 0.0
    params = SamplingParams(n=args.n, temperature=1.0, seed=seed, max_new_tokens=args.max_new_tokens)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    engine.step = type(engine).step.__get__(engine)       # the hook off
    comps = [c for o in outs for c in o.completions]
    tokens = sum(len(c.token_ids) for c in comps)
    tok = engine.tokenizer
    right = sum(correct(t, tok.decode(c.token_ids, skip_special_tokens=True))
                for t, o in zip(texts, outs) for c in o.completions)
    counters = engine.speculator.counts if engine.speculator is not None else {}
    spec = {k: v - spec0.get(k, 0) if k in counters else v for k, v in engine.stats().items() if k.startswith("spec_")}
    lengths = sorted(len(c.token_ids) for c in comps)
    res = {"makespan_s": wall, "tokens": tokens, "tok_s": tokens / wall, "steps": len(log.rows),
           "finished_by_eos": sum(c.finish_reason == "stop" for c in comps) / len(comps),
           "length_p50": lengths[len(lengths) // 2], "length_p99": lengths[int(0.99 * (len(lengths) - 1))],
           "length_max": lengths[-1], "accuracy": right / len(comps), "tokens_by_batch_size": log.by_batch_size(),
           "gpu_busy": sum(row[3] for row in log.rows) / wall if engine.pipeline.cuda else None,
           **spec, "completions": [c.token_ids for c in comps],
           # how the steps ran: decode graphs, drafted steps' verify graphs, graphs captured on first use
           "pipeline": {k: v - counts0[k] for k, v in engine.pipeline.counts.items()},
           "graph_capture_on_use_s": (engine.stats().get("graph_capture_on_use_s") or 0.0) - capture0}
    if spec.get("spec_drafted"):
        res["acceptance_rate"] = spec["spec_accepted"] / spec["spec_drafted"]
    print(f"{label:5s} {wall:.2f} s, {tokens} tokens ({tokens / wall:.0f} tok/s), {len(log.rows)} steps, "
          f"accuracy {res['accuracy']:.2f}, EOS {res['finished_by_eos']:.2f}, lengths p50 {res['length_p50']} "
          f"max {res['length_max']}" + (f"; drafted {spec['spec_drafted']}, accepted {spec['spec_accepted']}"
                                        if spec.get("spec_drafted") else ""), flush=True)
    return res


def compare(off: dict, on: dict) -> dict:
    same = sum(a == b for a, b in zip(off["completions"], on["completions"]))
    return {"identical_sequences": same / len(off["completions"]), "makespan_ratio": on["makespan_s"] / off["makespan_s"],
            "target_makespan_ratio": 0.7}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="the engine's: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--batch-invariant", action="store_true", help="the engine's batch_invariant (bf16: exact)")
    ap.add_argument("--seed", type=int, default=0)
    # the model and its training
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--train-s", type=float, default=90.0, help="training wall-clock budget")
    ap.add_argument("--train-steps", type=int, default=None, help="a step count instead of --train-s")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--log-every", type=int, default=100)
    # the task and the batch
    # R1's length shape: sigma 0.9, the cap 8x the median (~1% of draws clipped)
    ap.add_argument("--digits-median", type=float, default=4.0)
    ap.add_argument("--digits-sigma", type=float, default=0.9)
    ap.add_argument("--digits-cap", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (a GRPO group)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: the longest completion the task has")
    ap.add_argument("--spec-max-draft", type=int, default=5)
    ap.add_argument("--spec-min-acceptance", type=float, default=None, help="the engine's (default: its default)")
    ap.add_argument("--speed-gate", choices=("on", "off", "both"), default="both",
                    help="the on-engine's spec_speed_gate; both: runs on_ungated / on2_ungated too (the same "
                         "engine, its gate switched off for them)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed rounds of the four runs; each run's median makespan is reported (short runs are noisy)")
    ap.add_argument("--widen", default=None, metavar="HIDDEN,INTERMEDIATE,LAYERS",
                    help="run the batches on the trained model widened to this size (module doc), e.g. 4096,14336,32")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    args.max_new_tokens = args.max_new_tokens or 9 * (args.digits_cap + 1) + args.digits_cap + 2
    with tempfile.TemporaryDirectory() as folder:
        trained = train(args, device, folder)
        print(f"trained {trained['steps']} steps in {trained['seconds']:.0f} s, loss {trained['final_loss']:.4f}",
              flush=True)
        rng = random.Random(args.seed + 1)
        texts = [problem(rng, args)[0] for _ in range(args.prompts)]
        common = dict(device=args.device, dtype=dtype, batch_invariant=args.batch_invariant,
                      max_num_seqs=args.prompts * args.n, max_model_len=trained["config"]["max_position_embeddings"])
        spec = {"speculative": "ngram", "spec_max_draft": args.spec_max_draft, "spec_history_prompts": args.prompts,
                **({} if args.spec_min_acceptance is None else {"spec_min_acceptance": args.spec_min_acceptance})}
        if args.widen:
            from ..models.loader import build_model, copy_hf_tensors, parameter_bytes
            from ..tasks.arith_train import build_tokenizer
            torch_dtype = getattr(torch, dtype)
            engines = []
            if device.type == "cuda":      # two engines share the card: 12 GiB of KV each holds the whole batch
                common["kv_cache_memory"] = 12 << 30
            cfg, tensors = widened(folder, *map(int, args.widen.split(",")), device, torch_dtype)
            for extra in ({}, spec):         # a model each: the engines share nothing
                model = build_model(cfg, torch_dtype, device)
                copy_hf_tensors(model, tensors.items(), "widened model")
                engines.append(RolloutEngine(model, cfg, tokenizer=build_tokenizer(), **common, **extra))
            del tensors
            off_engine, on_engine = engines
            trained["widened"] = {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
                                  "num_hidden_layers": cfg.num_hidden_layers, "weight_bytes": parameter_bytes(model)}
        else:
            off_engine = RolloutEngine.from_pretrained(folder, **common)
            on_engine = RolloutEngine.from_pretrained(folder, **common, **spec)
        prompts = [off_engine.tokenizer(t).input_ids for t in texts]
        # warm-up: kernels, and the decode and verify graphs (captured on first use) of the timed runs' shapes
        # (their seeds: another seed's batches leave some verify shapes uncaptured, and an 8B-sized capture
        # inside a 1 s run is a large share of it); an RL loop captures each once in its first steps. The
        # drafter forgets these completions.
        for seed in (args.seed, args.seed + 1):
            for name, e in (("warm-up off", off_engine), ("warm-up on", on_engine)):
                run(name, e, prompts, texts, args, seed)
        sp = on_engine.speculator
        gated = {"on": (True,), "off": (False,), "both": (True, False)}[args.speed_gate]
        plan = [("off", off_engine, args.seed, None)]
        plan += [("on" if g == gated[0] else "on_ungated", on_engine, args.seed, g) for g in gated]
        plan += [("off2", off_engine, args.seed + 1, None)]
        plan += [("on2" if g == gated[0] else "on2_ungated", on_engine, args.seed + 1, g) for g in gated]
        tried: dict[str, list[dict]] = {name: [] for name, *_ in plan}
        earlier: OrderedDict = OrderedDict()      # this round's S completions, the S+1 runs' history
        for _ in range(args.repeats):     # interleaved, so a drifting clock or a busy host hits both sides
            for name, engine, seed, gate in plan:
                # The S runs draft from their own batch only; each S+1 run from this round's S completions
                # (not from another S+1 run's: the same seed's samples would be accepted whole).
                if engine is on_engine:
                    sp.drafter.history = OrderedDict() if seed == args.seed else OrderedDict(earlier)
                if gate is not None:
                    sp.speed_gate, sp.wait = gate, sp.wait if gate else 0    # ungated: no back-off carried in
                tried[name].append(run(name, engine, prompts, texts, args, seed))
                if engine is on_engine and seed == args.seed:
                    earlier = OrderedDict(sp.drafter.history)
        runs = {}
        for name, rs in tried.items():    # each run's median-makespan repeat, with every repeat's makespan
            runs[name] = sorted(rs, key=lambda r: r["makespan_s"])[len(rs) // 2]
            runs[name]["makespans_s"] = [r["makespan_s"] for r in rs]
    pairs = {f"{on}_vs_{off}": compare(runs[off], runs[on]) for on, off in
             (("on", "off"), ("on2", "off2"), ("on_ungated", "off"), ("on2_ungated", "off2")) if on in runs}
    for name, p in pairs.items():
        print(f"{name}: makespan x{p['makespan_ratio']:.2f} (target <= 0.7), identical sequences "
              f"{p['identical_sequences']:.1%}", flush=True)
    for r in runs.values():
        r.pop("completions")
    result = {"device": args.device, "dtype": dtype, "batch_invariant": args.batch_invariant, "trained": trained,
              "prompts": args.prompts, "n": args.n, "max_new_tokens": args.max_new_tokens,
              "digits": {"median": args.digits_median, "sigma": args.digits_sigma, "cap": args.digits_cap},
              "runs": runs, **pairs, "meta": run_meta("rollout.bench.spec_trained", argv)}
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
