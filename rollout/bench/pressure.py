"""KV pressure: the same greedy prompts twice in one process, on one set of random weights.

    python -m rollout.bench.pressure --shape llama3-8b --batch 64 --prompt-len 256 --gen-len 8192 \
        --out bench/results/<name>.json
    python -m rollout.bench.pressure --shape tiny --batch 4 --prompt-len 16 --gen-len 64 \
        --kv-fraction 0.5 --dtype float32 --device cpu          # the CPU smoke run

1. unpressured: KV for every sequence at once, kv_bytes_per_token * B * (P + G + 64) * 1.1;
2. pressured: --kv-fraction of that, so admission holds requests back and (with
   --reserve-fraction 0, the default) running sequences are preempted and recompute their KV.

Each run gets its own RolloutEngine on the same model, the first freed before the second is
built. Greedy, EOS off, G new tokens each. Reported per run: wall s, tok/s, preemptions,
recomputed tokens, running sequences; then the tok/s ratio and whether the greedy outputs are
equal. In bf16 a different batch composition changes GEMM rounding and can flip a near-tie
argmax, so differing outputs are counted (with where they first differ), not an error; a
request that did not finish with G tokens is (after the JSON is written).

The unpressured KV is checked against the free device memory before it is allocated; the
error names the largest --gen-len that fits. A reference too large for one engine runs in
--reference-chunks engines one after another, or in separate calls (--runs, --chunk,
--reference-file) whose files a pressured call compares against.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch

from ..engine import RolloutEngine
from ..models.loader import build_model
from ..request import SamplingParams
from .__main__ import _sync, run_meta, write_json
from .roofline import model_sizes, roofline
from .shapes import SHAPES, make_config, random_prompts

KV_SLACK_TOKENS = 64     # per sequence, on top of P + G
KV_MARGIN = 1.1          # the unpressured KV is this much more than the sequences need
HEADROOM_BYTES = 3 << 30  # activations, logits, CUDA graph pool, cuBLAS workspace


def unpressured_kv_bytes(cfg, dtype: torch.dtype, B: int, P: int, G: int) -> int:
    per_token = model_sizes(cfg, dtype.itemsize)["kv_bytes_per_token"]
    return int(per_token * B * (P + G + KV_SLACK_TOKENS) * KV_MARGIN)


def max_gen_len_fitting(cfg, dtype: torch.dtype, B: int, P: int, free_bytes: int) -> int:
    per_token = model_sizes(cfg, dtype.itemsize)["kv_bytes_per_token"]
    return int((free_bytes - HEADROOM_BYTES) / (KV_MARGIN * per_token * B)) - P - KV_SLACK_TOKENS


def random_model(cfg, dtype: torch.dtype, device: torch.device, seed: int):
    """Seeded normal(0, initializer_range) weights drawn on the device (an 8B draw on the CPU
    takes minutes), zero biases, unit norms."""
    model = build_model(cfg, dtype, device)
    std = float(getattr(cfg, "initializer_range", 0.02))
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)
    return model


class Occupancy:
    """Running sequences after each schedule() that launched something, and the tokens each
    request had generated when first preempted: this engine's scheduler methods, wrapped."""

    def __init__(self, engine: RolloutEngine):
        self.sched = engine.scheduler
        self._inner = self.sched.schedule
        self.sched.schedule = self._schedule
        self._inner_preempt = self.sched._preempt
        self.sched._preempt = self._preempt
        self.first_preempt: dict[int, int] = {}    # request id -> tokens generated then
        self.peak = self.total = self.steps = self.peak_waiting = 0

    def _preempt(self, seq, out=None):
        self._inner_preempt(seq, out)  # drops the in-flight placeholder: count real tokens only
        self.first_preempt.setdefault(seq.request.request_id, seq.num_generated)

    def _schedule(self, drafts=None):
        out = self._inner(drafts)
        if out.items:
            running = sum(s.fork_count for s in self.sched.running)
            self.peak = max(self.peak, running)
            self.total += running
            self.steps += 1
            self.peak_waiting = max(self.peak_waiting, len(self.sched.waiting))
        return out

    def summary(self) -> dict:
        return {"peak_running_seqs": self.peak, "mean_running_seqs": self.total / max(self.steps, 1),
                "peak_waiting_seqs": self.peak_waiting}


def compare_outputs(ref_tokens: list[list[int]], got_tokens: list[list[int]],
                    ref_logprobs: list[list[float]] | None = None,
                    got_logprobs: list[list[float]] | None = None, keep: int = 16,
                    first_preempt: list[int | None] | None = None) -> dict:
    """How many sequences differ and where each first differs; |Δlogprob| over the tokens before
    the first difference. With `first_preempt` (tokens generated when first preempted, None if
    never), a difference at or after that position may come from the recompute; one before it
    (or in a sequence never preempted) comes from the batch composition (bf16 GEMM rounding)."""
    if len(ref_tokens) != len(got_tokens):
        raise ValueError(f"{len(ref_tokens)} reference sequences, {len(got_tokens)} to compare")
    diffs, dlp = [], []
    for i, (a, b) in enumerate(zip(ref_tokens, got_tokens)):
        same = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if same < max(len(a), len(b)):
            d = {"seq": i, "position": same}
            if first_preempt is not None:
                d["first_preempted_at"] = first_preempt[i]
            diffs.append(d)
        if ref_logprobs is not None and got_logprobs is not None:
            dlp += [abs(x - y) for x, y in zip(ref_logprobs[i][:same], got_logprobs[i][:same])]
    out = {"sequences": len(ref_tokens), "sequences_differ": len(diffs), "identical": not diffs,
           "first_diff_position": min((d["position"] for d in diffs), default=None),
           "first_diffs": diffs[:keep]}
    if first_preempt is not None:
        after = [d for d in diffs if d["first_preempted_at"] is not None
                 and d["position"] >= d["first_preempted_at"]]
        out["sequences_preempted"] = sum(p is not None for p in first_preempt)
        out["differ_at_or_after_first_preemption"] = len(after)
        out["differ_before_any_preemption"] = len(diffs) - len(after)
    if dlp:
        out["max_abs_dlogprob_same_tokens"] = max(dlp)
        out["mean_abs_dlogprob_same_tokens"] = sum(dlp) / len(dlp)
    return out


def _counters(engine) -> dict:
    sched = engine.scheduler
    return {"preemptions": sched.num_preemptions, "recomputed_tokens": sched.num_recomputed_tokens,
            "swap_outs": sched.num_swap_outs, "swapped_pages": sched.num_swapped_pages,
            "discarded_tokens": sched.num_discarded_tokens, "steps": engine.metrics["steps"],
            "prefill_tokens": engine.metrics["prefill_tokens"], **engine.pipeline.counts}


def timed_run(label: str, model, cfg, prompts, G: int, kv_bytes: int, args, device) -> tuple[dict, list, list, list]:
    """An engine with `kv_bytes` of KV, warmed up, timing generate() on all prompts. Returns the
    result, tokens and logprobs per prompt, and the tokens each had when first preempted (or None)."""
    B, P = len(prompts), len(prompts[0])
    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    engine = RolloutEngine(model, cfg, max_model_len=P + G + 8, max_num_seqs=B, kv_cache_memory=kv_bytes,
                           max_num_batched_tokens=args.max_batched_tokens, seed=args.seed,
                           kv_reserve_fraction=args.reserve_fraction, attention_backend=args.attention_backend,
                           preemption_mode=args.preemption_mode, swap_space_gb=args.swap_space_gb,
                           cuda_graphs=not args.no_graphs, cuda_graph_modes=("greedy",),
                           batch_invariant=args.batch_invariant)
    init_s = time.perf_counter() - t0
    capacity = engine.kv.alloc.num_usable * engine.page_size
    kv_alloc_gb = torch.cuda.memory_allocated(device) / 1e9 if cuda else None
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    occ = Occupancy(engine)
    before, busy0 = _counters(engine), engine.pipeline.busy_ms
    print(f"[{label}] KV {capacity} tokens = {capacity / (B * (P + G)):.2f} of the {B} x {P + G} "
          f"the sequences need; timing", flush=True)
    _sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=G, temperature=0.0, ignore_eos=True), use_tqdm=True)
    engine.drain()
    _sync()
    wall = time.perf_counter() - t0
    now = _counters(engine)
    comps = [c for o in outs for c in o.completions]
    complete = [len(c.token_ids) == G and c.finish_reason == "length" for c in comps]
    result = {
        "kv_cache_bytes": kv_bytes, "kv_pages": engine.kv.alloc.num_usable, "kv_tokens": capacity,
        "kv_fraction_of_demand": capacity / (B * (P + G)), "reserve_fraction": args.reserve_fraction,
        "engine_init_s": init_s, "graph_capture_s": engine.stats()["graph_capture_s"],
        "cuda_graphs": engine.pipeline.graphs is not None, "attention_backend": engine.runner.attention_backend,
        "wall_s": wall, "tokens": sum(len(c.token_ids) for c in comps), "tok_s": B * G / wall,
        **{k: now[k] - before[k] for k in now}, **occ.summary(),
        "completed": sum(complete), "all_completed": all(complete) and len(comps) == B,
        "errors": sorted({o.error for o in outs if o.error}),
        "gpu_busy": (engine.pipeline.busy_ms - busy0) / 1e3 / wall if cuda else None,
        "memory_allocated_gb_after_init": kv_alloc_gb,
        "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None,
    }
    tokens, logprobs = [c.token_ids for c in comps], [c.logprobs for c in comps]
    first_preempt = [occ.first_preempt.get(o.request_id) for o in outs]
    # Free this engine (KV pool, graphs, buffers) before the caller builds the next one.
    occ.sched = None
    del engine, occ, outs, comps
    gc.collect()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    return result, tokens, logprobs, first_preempt


def chunk_bounds(B: int, chunks: int) -> list[tuple[int, int]]:
    size = -(-B // chunks)
    return [(lo, min(lo + size, B)) for lo in range(0, B, size)]


def reference_run(model, cfg, prompts, G: int, lo: int, hi: int, args, device) -> tuple[dict, list, list]:
    """One engine with KV for prompts[lo:hi] at once (unpressured), with its own roofline."""
    P, dtype = len(prompts[0]), next(model.parameters()).dtype
    kv = unpressured_kv_bytes(cfg, dtype, hi - lo, P, G)
    r, tok, lp, _ = timed_run(f"unpressured [{lo}:{hi}]", model, cfg, prompts[lo:hi], G, kv, args, device)
    rf = roofline(cfg, hi - lo, P, G, dtype_bytes=dtype.itemsize)
    r.update(prompts_from=lo, prompts_to=hi, batch=hi - lo, roofline_tok_s=rf["tok_s"],
             fraction_of_roofline=r["tok_s"] / rf["tok_s"])
    return r, tok, lp


def merge_chunks(parts: list[dict], B: int, G: int) -> dict:
    """The reference of all B prompts from engines run one after another."""
    if len(parts) == 1:
        return parts[0]
    wall = sum(r["wall_s"] for r in parts)
    return {"chunks": parts, "wall_s": wall, "tok_s": B * G / wall,
            "kv_fraction_of_demand": min(r["kv_fraction_of_demand"] for r in parts),
            **{k: sum(r[k] for r in parts) for k in ("tokens", "preemptions", "recomputed_tokens", "completed")},
            "peak_running_seqs": max(r["peak_running_seqs"] for r in parts),
            "all_completed": all(r["all_completed"] for r in parts),
            "errors": sorted({e for r in parts for e in r["errors"]})}


def save_reference(path: str, prompts, tokens, logprobs, summary: dict) -> None:
    """One reference chunk for a later --runs pressured call; its prompts are kept to check the seed."""
    import numpy as np
    tmp = path + ".part.npz"       # renamed when whole: a pressured run may be polling for it
    np.savez_compressed(tmp, prompts=np.asarray(prompts, dtype=np.int64),
                        tokens=np.asarray(tokens, dtype=np.int64), logprobs=np.asarray(logprobs, dtype=np.float32),
                        summary=json.dumps(summary))
    os.replace(tmp, path)


def wait_for_files(paths: list[str], timeout_s: float) -> None:
    """For a pressured run started beside its reference chunks (other GPUs of one machine)."""
    deadline = time.time() + timeout_s
    while any(not os.path.exists(p) for p in paths) and time.time() < deadline:
        time.sleep(2.0)


def load_reference(paths: list[str], prompts, G: int) -> tuple[list, list, dict]:
    """Reference chunk files -> tokens and logprobs of every prompt, and the merged summary."""
    import numpy as np
    tokens, logprobs, parts = [None] * len(prompts), [None] * len(prompts), []
    for path in paths:
        if not os.path.exists(path):
            raise SystemExit(f"reference file {path} not found (run its --runs unpressured chunk first)")
        ref = np.load(path)
        summary = json.loads(str(ref["summary"]))
        lo, hi = summary["prompts_from"], summary["prompts_to"]
        if ref["prompts"].tolist() != prompts[lo:hi]:
            raise SystemExit(f"{path} was made from other prompts (another --seed, --batch or --prompt-len)")
        tokens[lo:hi], logprobs[lo:hi] = ref["tokens"].tolist(), ref["logprobs"].tolist()
        parts.append(summary)
    missing = [i for i, t in enumerate(tokens) if t is None]
    if missing:
        raise SystemExit(f"the reference files cover no output for prompts {missing[:8]}...")
    parts.sort(key=lambda r: r["prompts_from"])
    return tokens, logprobs, merge_chunks(parts, len(prompts), G)


def markdown_table(result: dict) -> str:
    rows = ["| run | KV / demand | wall s | tok/s | preemptions | recomputed tokens | peak running | completed |",
            "|---|---|---|---|---|---|---|---|"]
    for label in ("unpressured", "pressured"):
        r = result[label]
        rows.append(f"| {label} | {r['kv_fraction_of_demand']:.2f} | {r['wall_s']:.2f} | {r['tok_s']:.0f} | "
                    f"{r['preemptions']} | {r['recomputed_tokens']} | {r['peak_running_seqs']} | "
                    f"{r['completed']}/{result['batch']} |")
    c = result["outputs"]
    first = "" if c["identical"] else f", first at token {c['first_diff_position']}"
    rows += ["", f"pressured / unpressured tok/s: {result['tok_s_ratio']:.3f}; greedy outputs "
                 f"{'identical' if c['identical'] else 'differ'} ({c['sequences_differ']}/{c['sequences']} "
                 f"sequences differ{first})"]
    return "\n".join(rows)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=64, help="prompts (one sequence each)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=16384)
    ap.add_argument("--kv-fraction", type=float, default=0.5, help="pressured KV as a fraction of the unpressured KV")
    ap.add_argument("--reserve-fraction", type=float, default=0.0,
                    help="engine kv_reserve_fraction in both runs: 0 admits by the next chunk and preempts "
                         "when pages run out; 1 admits only what fits at full length (no preemption)")
    ap.add_argument("--max-batched-tokens", type=int, default=2048, help="per-step token budget")
    ap.add_argument("--preemption-mode", default="recompute", choices=("recompute", "swap", "auto"))
    ap.add_argument("--swap-space-gb", type=float, default=0.0, help="host memory for swapped-out KV")
    ap.add_argument("--dtype", default="bfloat16", help="weights and KV (float32 for the CPU smoke run)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "triton"))
    ap.add_argument("--no-graphs", action="store_true", help="decode eagerly (no CUDA graphs)")
    ap.add_argument("--linear", default="auto", choices=("auto", "cublas"),
                    help="decode GEMMs: auto = the skinny Triton GEMM where its table says it wins; cublas = F.linear")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="engine batch_invariant=True: bf16 greedy outputs under pressure compare exactly")
    ap.add_argument("--reference-chunks", type=int, default=1,
                    help="run the unpressured reference as this many engines one after another, each with "
                         "KV for its share of the prompts")
    ap.add_argument("--runs", default="both", choices=("both", "unpressured", "pressured"),
                    help="'unpressured' runs the reference chunks named by --chunk and saves each to its "
                         "--reference-file; 'pressured' compares against those files")
    ap.add_argument("--chunk", type=int, nargs="+", default=None,
                    help="with --runs unpressured: which reference chunks to run (default all)")
    ap.add_argument("--reference-file", nargs="+", default=None,
                    help=".npz files of the unpressured tokens and logprobs, one per chunk")
    ap.add_argument("--wait-reference-s", type=float, default=0.0,
                    help="with --runs pressured: wait this long after the run for reference files not there yet")
    ap.add_argument("--skip-fit-check", action="store_true",
                    help="build the unpressured engine even if its KV looks larger than the free memory")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not 0.0 < args.kv_fraction < 1.0:
        ap.error(f"--kv-fraction must be in (0, 1), got {args.kv_fraction}")
    if not 0.0 <= args.reserve_fraction <= 1.0:
        ap.error(f"--reserve-fraction must be in [0, 1], got {args.reserve_fraction}")
    if args.runs != "both" and not args.reference_file:
        ap.error(f"--runs {args.runs} needs --reference-file")
    if not 1 <= args.reference_chunks <= args.batch:
        ap.error(f"--reference-chunks must be in [1, --batch], got {args.reference_chunks}")
    bounds = chunk_bounds(args.batch, args.reference_chunks)
    run_chunks = args.chunk if args.chunk is not None else list(range(len(bounds)))
    if any(not 0 <= c < len(bounds) for c in run_chunks):
        ap.error(f"--chunk must be in [0, {len(bounds)}), got {args.chunk}")
    if args.runs == "unpressured" and len(args.reference_file) != len(run_chunks):
        ap.error(f"--runs unpressured writes one --reference-file per chunk run ({len(run_chunks)})")

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype)
    cfg = make_config(args.shape)
    B, P, G = args.batch, args.prompt_len, args.gen_len
    chunk = bounds[0][1] - bounds[0][0]          # the largest reference run
    full_kv = unpressured_kv_bytes(cfg, dtype, B, P, G)
    tight_kv = int(full_kv * args.kv_fraction)
    rf = roofline(cfg, B, P, G, dtype_bytes=dtype.itemsize)
    print(f"{args.shape} B={B} P={P} G={G} {args.dtype} on {device}: unpressured KV {full_kv / 1e9:.2f} GB "
          f"(in {args.reference_chunks} run(s) of {chunk} prompts), pressured {tight_kv / 1e9:.2f} GB; roofline "
          f"{rf['tok_s']:.0f} tok/s at B={B}", flush=True)

    t0 = time.perf_counter()
    model = random_model(cfg, dtype, device, args.seed)
    model.skinny_gemm = args.linear == "auto"
    _sync()
    model_init_s = time.perf_counter() - t0
    weights_gb = None
    if device.type == "cuda":
        weights_gb = torch.cuda.memory_allocated(device) / 1e9
        free, _ = torch.cuda.mem_get_info(device)
        chunk_kv = unpressured_kv_bytes(cfg, dtype, chunk, P, G)
        if args.runs != "pressured" and chunk_kv + HEADROOM_BYTES > free and not args.skip_fit_check:
            fit = max_gen_len_fitting(cfg, dtype, chunk, P, free)
            raise SystemExit(f"the unpressured KV ({chunk_kv / 1e9:.1f} GB) + {HEADROOM_BYTES / 2**30:.0f} GiB "
                             f"headroom exceeds the {free / 1e9:.1f} GB free after the weights: at {chunk} prompts "
                             f"per run, --prompt-len {P}, the largest --gen-len that fits is {fit} "
                             f"(or pass --reference-chunks, or --skip-fit-check)")
    prompts = random_prompts(B, P, cfg.vocab_size, args.seed)

    result = {"shape": args.shape, "batch": B, "prompt_len": P, "gen_len": G, "dtype": args.dtype,
              "device_type": device.type, "kv_fraction": args.kv_fraction, "reserve_fraction": args.reserve_fraction,
              "reference_chunks": args.reference_chunks, "runs": args.runs, "batch_invariant": args.batch_invariant,
              "max_batched_tokens": args.max_batched_tokens, "seed": args.seed, "model_init_s": model_init_s,
              "weights_gb": weights_gb, "roofline": rf}
    if args.runs in ("both", "unpressured"):
        parts, ref_tok, ref_lp = [], [], []
        for i, c in enumerate(run_chunks):
            lo, hi = bounds[c]
            r, tok, lp = reference_run(model, cfg, prompts, G, lo, hi, args, device)
            if args.runs == "unpressured":     # written at once: a later chunk timing out loses only itself
                save_reference(args.reference_file[i], prompts[lo:hi], tok, lp, r)
            parts.append(r)
            ref_tok += tok
            ref_lp += lp
        result["unpressured"] = merge_chunks(parts, sum(r["batch"] for r in parts), G)
        if device.type == "cuda":   # what is left once the engines are gone: the weights (and caches)
            result["memory_allocated_gb_between_runs"] = torch.cuda.memory_allocated(device) / 1e9
    if args.runs != "unpressured":
        # Files already there are read before the long run; others (chunks still running on other
        # GPUs, --wait-reference-s) after it.
        ready = args.runs == "pressured" and all(os.path.exists(p) for p in args.reference_file)
        if ready:
            ref_tok, ref_lp, result["unpressured"] = load_reference(args.reference_file, prompts, G)
        result["pressured"], tok, lp, first_preempt = timed_run("pressured", model, cfg, prompts, G, tight_kv,
                                                                args, device)
        if args.runs == "pressured" and not ready:
            wait_for_files(args.reference_file, args.wait_reference_s)
            ref_tok, ref_lp, result["unpressured"] = load_reference(args.reference_file, prompts, G)
        result["pressured"]["fraction_of_roofline"] = result["pressured"]["tok_s"] / rf["tok_s"]
        result["tok_s_ratio"] = result["pressured"]["tok_s"] / result["unpressured"]["tok_s"]
        result["outputs"] = compare_outputs(ref_tok, tok, ref_lp, lp, first_preempt=first_preempt)
        result["all_completed"] = result["unpressured"]["all_completed"] and result["pressured"]["all_completed"]
    result["meta"] = run_meta("rollout.bench.pressure", argv)
    print(json.dumps(result, indent=2))
    for r in result["unpressured"].get("chunks", [result["unpressured"]]) if args.runs == "unpressured" else []:
        print(f"reference [{r['prompts_from']}:{r['prompts_to']}]: {r['wall_s']:.1f} s, {r['tok_s']:.0f} tok/s = "
              f"{r['fraction_of_roofline']:.1%} of {r['roofline_tok_s']:.0f}, {r['preemptions']} preemptions, "
              f"busy {r['gpu_busy']}, completed {r['completed']}/{r['batch']}")
    if "pressured" in result:
        print(markdown_table(result))
    write_json(result, args.out)
    if not result.get("all_completed", result["unpressured"]["all_completed"]):
        got = {k: result[k]["completed"] for k in ("unpressured", "pressured") if k in result}
        raise SystemExit(f"not every request finished with {G} tokens (completed of {B}): {got}")
    return result


if __name__ == "__main__":
    main()
