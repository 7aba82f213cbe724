"""Ours (sync and async) against HF transformers (`generate` or `generate_batch`) on the same
random weights, side by side, with the HBM roofline of each run.

    python -m rollout.bench --shape qwen2.5-0.5b --batch 16 --prompt-len 128 --gen-len 256 \
        --out bench/results/<name>.json

Correctness first: before timing, our greedy and sampled logprobs are compared with an
HF forward of the same sequences in the same dtype (mean / max |Δlogp|, greedy prefix
agreement). Timing: wall clock around whole generate calls after a warm-up, CUDA
synchronised, median of --repeats. MoE shapes: mode `routed` is `async` with
return_routed_experts=True (what capture costs), and its routing gives the experts each decode
step touched, for a roofline of the bytes actually read (`roofline_routed`). Each timed run also
reports the floor of the schedule it ran (`schedule_floor`: per launched step, the weights and the KV of
the contexts it read), which is the bound to hold a run to when the KV cache cannot hold every
sequence at once and the engine runs fewer (roofline() assumes all B resident).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import platform
import statistics
import subprocess
import sys
import time

import torch

from .. import env
from ..engine import RolloutEngine
from ..models.decoder import is_sparse_layer, num_experts
from ..models.loader import build_model, copy_hf_tensors
from ..request import SamplingParams
from . import clocks, timeline
from .roofline import model_sizes, record_steps, roofline, schedule_floor_s
from .shapes import SHAPES, make_config, random_prompts


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _git_commit() -> str:
    if env.GIT_COMMIT:    # the GPU machine's copy of the tree has no .git
        return env.GIT_COMMIT
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"


def run_meta(module: str, argv) -> dict:
    """Command, commit, date, device and ROLLOUT_* switches stamped into every benchmark JSON."""
    return {"command": f"python -m {module} " + " ".join(argv if argv is not None else sys.argv[1:]),
            "git_commit": _git_commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
            # the switches a run can be under (ROLLOUT_PDL, ROLLOUT_GLUON_DECODE, ...): not in the command line
            "environment": env.rollout_variables()}


def write_json(result: dict, path) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def _token_logp(logits, tok):
    return torch.log_softmax(logits, -1).gather(1, tok[:, None])[:, 0]


def hf_logprob_agreement(hf, prompts, outs, device, hf_fp32=None) -> dict:
    """|Δ| between our per-token logprobs (T = 1) and HF's forward (same dtype) on prompt + completion.
    With `hf_fp32`, both are also measured against an fp32 forward: in bf16 a deep random network
    amplifies rounding, and this tells "as close to the truth as HF" from a real bug."""
    def ref_logp(model, ids, n_prompt, tok):
        with torch.no_grad():
            logits = model(ids).logits[0, n_prompt - 1:-1].float()
        return logits, _token_logp(logits, tok).cpu()

    diffs, prefix_match, ours32, hf32 = [], [], [], []
    for p, o in zip(prompts, outs):
        c = o.completions[0]
        ids = torch.tensor([p + c.token_ids], device=device)
        tok = torch.tensor(c.token_ids, device=device)
        ours = torch.tensor(c.logprobs)
        logits, ref = ref_logp(hf, ids, len(p), tok)
        diffs.append((ref - ours).abs())
        if hf_fp32 is not None:
            _, truth = ref_logp(hf_fp32, ids, len(p), tok)
            ours32.append((ours - truth).abs())
            hf32.append((ref - truth).abs())
        # Greedy agreement: how many leading tokens equal HF's own argmax on our prefix.
        same = (logits.argmax(-1) == tok).int().tolist()
        prefix_match.append(same.index(0) if 0 in same else len(same))
    d = torch.cat(diffs)
    out = {"mean_abs_dlogp": d.mean().item(), "max_abs_dlogp": d.max().item(),
           "p99_abs_dlogp": d.quantile(0.99).item(), "tokens": d.numel(),
           "argmax_agree_prefix_mean": statistics.mean(prefix_match)}
    if hf_fp32 is not None:
        out["ours_vs_fp32_mean_abs_dlogp"] = torch.cat(ours32).mean().item()
        out["hf_vs_fp32_mean_abs_dlogp"] = torch.cat(hf32).mean().item()
    return out


def hf_incremental_vs_fp32(hf, hf_fp32, prompts, max_new_tokens: int, device) -> dict:
    """HF's own KV-cached greedy decode in the bench dtype against an fp32 full forward: the drift
    any incremental low-precision decoder has on these weights, to read `ours_vs_fp32` against."""
    diffs = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                              min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True)
            tok = out.sequences[0, len(p):]
            inc = torch.stack(out.logits, 1)[0].float()
            full = hf_fp32(out.sequences).logits[0, len(p) - 1:-1].float()
        diffs.append((_token_logp(inc, tok) - _token_logp(full, tok)).abs().cpu())
    d = torch.cat(diffs)
    return {"hf_incremental_vs_fp32_mean_abs_dlogp": d.mean().item(), "max_abs_dlogp": d.max().item(),
            "tokens": d.numel()}


def experts_touched(outs, P: int, num_experts: int) -> float:
    """Mean distinct experts per MoE layer per decode step, from the completions' routed experts: the
    union over sequences at each decode position (a step's, while the sequences decode in lockstep)."""
    import numpy as np
    ids = np.stack([c.routed_experts[P:] for o in outs for c in o.completions])     # [S, G - 1, L, k]
    hit = np.zeros(ids.shape[1:3] + (num_experts,), bool)
    g, layer = np.indices(ids.shape[1:3])
    hit[g[None, ..., None], layer[None, ..., None], ids] = True
    return float(hit.sum(-1).mean())


def hf_experts(hf, cfg) -> dict:
    """HF's stacked expert tensors by our parameter names (the same layout), for build_model(adopt=...):
    one copy of an MoE's experts, not two."""
    return {f"layers.{i}.mlp.{ours}": getattr(layer.mlp.experts, theirs).data
            for i, layer in enumerate(hf.model.layers) if is_sparse_layer(cfg, i)
            for ours, theirs in (("gate_up", "gate_up_proj"), ("down", "down_proj"))}


def hf_fastest_experts(hf):
    """An MoE's experts in HF's grouped GEMM (`grouped_mm`) for the baselines, where its version offers it:
    the default of some versions (`batched_mm`) gathers each token's expert weights, which at a 30B MoE's
    prefill needs hundreds of GB. Returns the implementation the baselines ran with (None: not an MoE)."""
    if not num_experts(hf.config):
        return None
    try:
        hf.set_experts_implementation("grouped_mm")
    except (AttributeError, ValueError, ImportError):
        pass                     # this version or device has no grouped GEMM: its default runs, and is named
    return hf.config._experts_implementation


def hf_generate(hf, prompts, G: int, repeats: int, device) -> dict:
    """HF `generate` on all prompts in one batch, greedy, exactly G new tokens: median of `repeats`."""
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)

    def timed():
        _sync()
        t0 = time.perf_counter()
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=G, min_new_tokens=G, do_sample=False, pad_token_id=0)
        _sync()
        assert out.shape[1] == ids.shape[1] + G
        return time.perf_counter() - t0

    with torch.no_grad():
        hf.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=8, do_sample=False, pad_token_id=0)
        wall = statistics.median(timed() for _ in range(repeats))
    return {"wall_s": wall, "tok_s": len(prompts) * G / wall, "gen_len": G,
            "attn_implementation": hf.config._attn_implementation}


def hf_generate_batch(hf, prompts, G: int, attn: str = "paged|sdpa") -> dict:
    """HF transformers' continuous batching (`generate_batch`) with CUDA graphs, greedy, EOS off.
    Options its version does not know are dropped and reported. Async batching stays off: with
    `paged|sdpa` it allocates a dense mask per slot sized from the whole KV cache (out of memory)."""
    import inspect
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig
    known = inspect.signature(ContinuousBatchingConfig).parameters
    # Half the free memory for its KV cache (our engine has released its own by now; its weights stay).
    wanted = dict(use_cuda_graph=True, use_async_batching=False, max_memory_percent=0.5)
    cb = ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in known})
    prev = hf.config._attn_implementation
    hf.set_attn_implementation(attn)

    def run(inputs, new_tokens):
        gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        out = hf.generate_batch(inputs=inputs, generation_config=gen, continuous_batching_config=cb,
                                progress_bar=False)
        _sync()
        return out

    try:
        run(prompts[:2], 8)       # warm-up and graph capture
        t0 = time.perf_counter()
        outs = run(prompts, G)
        wall = time.perf_counter() - t0
    finally:
        hf.set_attn_implementation(prev)
    tokens = sum(len(o.generated_tokens) for o in outs.values())
    return {"wall_s": wall, "tok_s": tokens / wall, "tokens": tokens, "sequences": len(outs),
            "gen_len": G, "attn_implementation": attn,
            "cb_config": {k: v for k, v in wanted.items() if k in known},
            "cb_options_unknown": [k for k in wanted if k not in known]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    ap.add_argument("--batch", type=int, default=16, help="prompts")
    ap.add_argument("--n", type=int, default=1, help="samples per prompt (GRPO groups: one prefill per prompt)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--hf", default="generate",
                    help="the HF baselines timed on the same weights: a comma list of generate, generate_batch; "
                         "or none")
    ap.add_argument("--hf-gen-len", type=int, default=None, help="new tokens for the HF run (default: --gen-len)")
    ap.add_argument("--modes", default="async",
                    help="comma list of ours' modes to time: sync,async,routed (async + return_routed_experts)")
    ap.add_argument("--no-graphs", action="store_true", help="decode eagerly (no CUDA graphs)")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="engine batch_invariant=True (to measure what bit-stable outputs cost)")
    ap.add_argument("--pack-decode-weights", action="store_true",
                    help="engine pack_decode_weights=True (decode GEMMs read packed weight copies)")
    ap.add_argument("--check-seqs", type=int, default=4, help="sequences checked against HF's forward")
    ap.add_argument("--check-gen-len", type=int, default=128, help="new tokens of the checked sequences")
    ap.add_argument("--fp32-reference", action="store_true",
                    help="also measure ours and HF against an fp32 copy of the weights")
    ap.add_argument("--trace", default=None, metavar="PREFIX",
                    help="also trace a short sync and async run: PREFIX.json (Chrome trace) + PREFIX.png")
    ap.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "triton"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    hf_baselines = [b for b in args.hf.split(",") if b != "none"]
    if any(b not in ("generate", "generate_batch") for b in hf_baselines):
        ap.error(f"--hf: a comma list of generate, generate_batch, or none (got {args.hf!r})")

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    cfg = make_config(args.shape, **({"num_hidden_layers": args.layers} if args.layers else {}))
    B, P, G, n = args.batch, args.prompt_len, args.gen_len, args.n
    S = B * n                      # sequences decoding together
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    with torch.device(device):    # random init on the device: an 8B init on CPU takes minutes
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    model = build_model(cfg, dtype, device, adopt=hf_experts(hf, cfg))
    copy_hf_tensors(model, hf.state_dict().items(), "HF model")
    if cuda:
        torch.cuda.empty_cache()
    sizes = model_sizes(cfg, dtype.itemsize)
    kv_bytes = int(sizes["kv_bytes_per_token"] * S * (P + G + 64) * 1.2)     # every sequence's whole length, 20% spare
    if cuda:   # capped at what the device has left (4 GiB kept for activations, logits, graphs): admission copes
        kv_bytes = min(kv_bytes, torch.cuda.mem_get_info(device)[0] - (4 << 30))
    t_engine = time.perf_counter()
    engine = RolloutEngine(model, cfg, max_model_len=P + G + 8, max_num_seqs=max(S, 8),
                           kv_cache_memory=kv_bytes,
                           max_num_batched_tokens=max(2048, P * 4), seed=args.seed,
                           attention_backend=args.attention_backend, cuda_graphs=not args.no_graphs,
                           cuda_graph_modes=("greedy", "truncate"),   # what this bench samples with
                           batch_invariant=args.batch_invariant, pack_decode_weights=args.pack_decode_weights)
    engine_init_s = time.perf_counter() - t_engine
    prompts = random_prompts(B, P, cfg.vocab_size, args.seed)
    greedy = SamplingParams(n=n, max_new_tokens=G, temperature=0.0, ignore_eos=True)
    result = {"shape": args.shape, "attention_backend": engine.runner.attention_backend,
              "cuda_graphs": engine.pipeline.graphs is not None, "batch_invariant": args.batch_invariant,
              "pack_decode_weights": args.pack_decode_weights, "batch": B, "n": n, "prompt_len": P,
              "gen_len": G, "dtype": args.dtype, "engine_init_s": engine_init_s, "kv_cache_bytes": kv_bytes,
              "roofline": roofline(cfg, S, P, G, prefill_seqs=B, dtype_bytes=dtype.itemsize)}

    # Correctness against HF's forward, same weights and dtype.
    k = min(args.check_seqs, B)
    hf32 = None
    if args.fp32_reference and dtype != torch.float32:
        import copy
        hf32 = copy.deepcopy(hf).float()
    cg = min(G, args.check_gen_len)
    outs = engine.generate(prompts[:k], SamplingParams(max_new_tokens=cg, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)
    result["check_greedy"] = hf_logprob_agreement(hf, prompts[:k], outs, device, hf32)
    sampled = SamplingParams(max_new_tokens=min(cg, 64), temperature=1.0, top_p=0.9, seed=1, ignore_eos=True)
    outs = engine.generate(prompts[:k], sampled, use_tqdm=False)
    result["check_sampled_T1_top_p0.9"] = hf_logprob_agreement(hf, prompts[:k], outs, device, hf32)
    if hf32 is not None:
        result["check_hf_incremental"] = hf_incremental_vs_fp32(hf, hf32, prompts[:k], min(G, 32), device)
    del hf32
    if cuda:
        torch.cuda.empty_cache()
    print("check:", json.dumps({k: v for k, v in result.items() if k.startswith("check")}), flush=True)

    launched = record_steps(engine)      # each step's tokens and contexts: the floor of the schedule run

    def time_ours(params):
        engine.reset_prefix_cache()      # each run (mode, repeat) with its whole prefill, as the first one
        _sync()
        launched.clear()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        busy0, counts0 = engine.pipeline.busy_ms, dict(engine.pipeline.counts)
        compiled = []      # Triton kernels compiled (or loaded from disk) inside the timed run: host stalls
        if cuda:
            import triton
            hook = triton.knobs.runtime.jit_cache_hook
            triton.knobs.runtime.jit_cache_hook = lambda *, repr, **_: compiled.append(repr[:160])
        engine.pipeline.start_trace()
        t0 = time.perf_counter()
        try:
            with clocks.logged(device.index or 0) if cuda else contextlib.nullcontext({}) as gpu_clocks:
                o = engine.generate(prompts, params, use_tqdm=True)
                engine.drain()
                _sync()
        finally:
            if cuda:
                triton.knobs.runtime.jit_cache_hook = hook
        wall = time.perf_counter() - t0
        spans, engine.pipeline.gpu_spans = engine.pipeline.gpu_spans, None
        assert all(len(c.token_ids) == G for x in o for c in x.completions)
        steady = spans[len(spans) // 10: len(spans) - len(spans) // 10]   # decode, away from the ends
        floor = schedule_floor_s(launched, sizes)
        return {"wall_s": wall, "tok_s": S * G / wall,
                # where the KV cannot hold every sequence (B=256 at a 30B MoE), roofline() assumes what
                # no schedule could run; this floor is that of the batch sizes the run held
                "schedule_floor": {**floor, "steps": len(launched),
                                   "mean_tokens_per_step": sum(t for t, _ in launched) / max(len(launched), 1)},
                "fraction_of_schedule_floor": floor["floor_s"] / wall,
                "step_ms_curve": timeline.step_ms_curve(spans, 256),
                "longest_steps_ms": sorted(((1e3 * (e - s), i) for i, (s, e) in enumerate(spans)), reverse=True)[:8],
                "triton_compiles": compiled,
                "gpu_busy": (engine.pipeline.busy_ms - busy0) / 1e3 / wall if cuda else None,
                "gpu_busy_steady_decode": timeline.busy_fraction(steady) if cuda else None,
                "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
                "gpu_clocks": gpu_clocks,     # SM clock and power over the run (nvidia-smi): at the power limit?
                **{c: engine.pipeline.counts[c] - counts0[c] for c in counts0},
                **({"experts_touched_per_layer_step": experts_touched(o, P, num_experts(cfg))}
                   if params.return_routed_experts else {}),
                "tokens": [c.token_ids for x in o for c in x.completions]}

    def checkpoint():
        """The JSON so far, marked partial: a run cut off by a time limit keeps what it measured."""
        write_json({**result, "partial": True, "meta": run_meta("rollout.bench", argv)}, args.out)

    # warm-up at the timed run's own prefill chunking (other tokens: no prefix-cache hits later), so the Triton
    # kernels of every chunk size (the MoE's prefill tiles) compile here, not as seconds-long steps inside the run
    warm = random_prompts(B, P, cfg.vocab_size, args.seed + 1)
    engine.generate(warm, dataclasses.replace(greedy, max_new_tokens=2), use_tqdm=False)
    engine.drain()
    tokens = {}
    modes = args.modes.split(",")
    for mode in modes:
        # Same engine, same schedule; async only stops waiting after each launch.
        engine.pipeline.async_mode = mode in ("async", "routed") and cuda
        params = dataclasses.replace(greedy, return_routed_experts=True) if mode == "routed" else greedy
        runs = [time_ours(params) for _ in range(args.repeats)]
        best = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]     # the median run
        best["runs_tok_s"] = [r["tok_s"] for r in runs]
        tokens[mode] = best.pop("tokens")
        best["fraction_of_roofline"] = best["tok_s"] / result["roofline"]["tok_s"]
        best["preemptions"] = engine.scheduler.num_preemptions
        result[f"ours_{mode}"] = best
        if mode == "routed":
            result["roofline_routed"] = roofline(cfg, S, P, G, prefill_seqs=B, dtype_bytes=dtype.itemsize,
                                                 touched=best["experts_touched_per_layer_step"])
            best["fraction_of_roofline_routed"] = best["tok_s"] / result["roofline_routed"]["tok_s"]
        checkpoint()
    result["ours"] = result[f"ours_{modes[-1]}"]
    result["engine_stats"] = engine.stats()
    if len(tokens) > 1:
        result["sync_async_tokens_identical"] = len({str(t) for t in tokens.values()}) == 1
    if "routed" in modes and "async" in modes:      # what returning the routed experts costs
        result["routed_experts_cost"] = result["ours_routed"]["wall_s"] / result["ours_async"]["wall_s"] - 1
    if "sync" in modes and "async" in modes:
        a, s_ = result["ours_async"], result["ours_sync"]
        result["async_speedup"] = s_["wall_s"] / a["wall_s"]
        if s_["gpu_busy"] is not None:
            result["sync_idle_fraction"] = 1 - s_["gpu_busy"]
    if args.trace:
        short = SamplingParams(n=n, max_new_tokens=min(G, 64), temperature=0.0, ignore_eos=True)
        runs = {}
        for mode in ("sync", "async"):
            engine.pipeline.async_mode = mode == "async" and cuda
            runs[mode] = timeline.collect(engine, prompts, short)
        timeline.write_chrome_trace(runs, args.trace + ".json")
        timeline.plot(runs, args.trace + ".png")
        result["trace"] = {m: {"gpu_busy": timeline.busy_fraction(r["gpu"]), "steps": len(r["gpu"])}
                           for m, r in runs.items()}

    hf_G = args.hf_gen_len or G
    if hf_baselines and hf_G != G:
        # Like for like: ours on the same prompts at HF's new-token count (HF's G is short because it is slow,
        # so its context stays near the prompt's; ours grows to P + G). Async, median of three, each with its
        # whole prefill: the prefix cache (which holds these prompts from the runs above) is emptied first.
        engine.pipeline.async_mode = cuda
        short, walls = dataclasses.replace(greedy, max_new_tokens=hf_G), []
        for _ in range(3):
            engine.reset_prefix_cache()
            _sync()
            t0 = time.perf_counter()
            engine.generate(prompts, short, use_tqdm=False)
            engine.drain()
            _sync()
            walls.append(time.perf_counter() - t0)
        wall = statistics.median(walls)
        result["ours_at_hf_gen_len"] = {"gen_len": hf_G, "wall_s": wall, "tok_s": S * hf_G / wall, "runs_wall_s": walls}
        checkpoint()
    if hf_baselines:
        result["hf_experts_implementation"] = hf_fastest_experts(hf)
        # Our timed runs are done: the baselines get our KV cache and graphs' memory (a 30B MoE's HF prefill
        # ran out of it beside them on an 80 GB card). The weights stay: both models share the expert tensors.
        result["engine_sleep_before_hf"] = engine.sleep(1)
    for baseline in hf_baselines:
        try:      # reported, not hidden: the table row says why it is missing
            result[f"hf_{baseline}"] = (
                hf_generate_batch(hf, [p for p in prompts for _ in range(n)], hf_G) if baseline == "generate_batch"
                else hf_generate(hf, prompts, hf_G, args.repeats, device))
        except Exception as exc:
            result[f"hf_{baseline}"] = {"error": f"{type(exc).__name__}: {exc}"}
            if cuda:
                torch.cuda.empty_cache()
        if "tok_s" in result[f"hf_{baseline}"]:
            result[f"speedup_vs_hf_{baseline}"] = result["ours"]["tok_s"] / result[f"hf_{baseline}"]["tok_s"]
            if "ours_at_hf_gen_len" in result:
                result[f"speedup_vs_hf_{baseline}_same_gen_len"] = (result["ours_at_hf_gen_len"]["tok_s"]
                                                                    / result[f"hf_{baseline}"]["tok_s"])
        checkpoint()
    if hf_baselines and f"speedup_vs_hf_{hf_baselines[0]}" in result:     # the first one named
        result["speedup_vs_hf"] = result[f"speedup_vs_hf_{hf_baselines[0]}"]

    result["meta"] = run_meta("rollout.bench", argv)
    print(json.dumps(result, indent=2))
    rf = result["roofline"]
    print(f"\nroofline: {rf['tok_s']:.0f} tok/s ({rf['step_ms']:.2f} ms/step at mean context "
          f"{rf['mean_context']:.0f}, {rf['bytes_per_step'] / 1e9:.2f} GB/step)")
    if "roofline_routed" in result:
        rr = result["roofline_routed"]
        print(f"roofline of the experts touched ({result['ours_routed']['experts_touched_per_layer_step']:.1f} per "
              f"layer per step): {rr['tok_s']:.0f} tok/s ({rr['step_ms']:.2f} ms/step); returning routed experts "
              f"cost {100 * result.get('routed_experts_cost', float('nan')):.1f}% of the async wall time")
    print("| run | wall s | tok/s | % roofline | GPU busy (steady) | SM clock, power, time at the power limit |\n"
          "|---|---|---|---|---|---|")
    for mode in modes:
        r = result[f"ours_{mode}"]
        busy = (f"{100 * r['gpu_busy']:.1f}% ({100 * r['gpu_busy_steady_decode']:.1f}%)"
                if r["gpu_busy"] is not None else "n/a")
        print(f"| ours {mode} | {r['wall_s']:.2f} | {r['tok_s']:.0f} | {100 * r['fraction_of_roofline']:.1f}% | {busy} "
              f"| {clocks.brief(r['gpu_clocks'])} |")
    if "ours_at_hf_gen_len" in result:
        r = result["ours_at_hf_gen_len"]
        print(f"| ours async (G={r['gen_len']}, HF's) | {r['wall_s']:.2f} | {r['tok_s']:.0f} | | | |")
    for key in ("hf_generate", "hf_generate_batch"):
        h = result.get(key)
        if h and "tok_s" in h:
            print(f"| {key} (G={h['gen_len']}) | {h['wall_s']:.2f} | {h['tok_s']:.0f} | "
                  f"{100 * h['tok_s'] / rf['tok_s']:.1f}% | | |")
        elif h:
            print(f"| {key} | failed: {h['error'][:80]} | | | | |")
    for mode in modes:
        r = result[f"ours_{mode}"]
        f = r["schedule_floor"]
        print(f"ours {mode}: the floor of its schedule {f['floor_s']:.2f} s ({f['steps']} steps, "
              f"{f['mean_tokens_per_step']:.1f} tokens a step, {r['preemptions']} preemptions): "
              f"{100 * r['fraction_of_schedule_floor']:.1f}% of it reached")
    write_json(result, args.out)


if __name__ == "__main__":
    main()
