"""Decode-step time of the engine under kernel variants, side by side in one process:

    python -m rollout.bench.step_variants --shape llama3-8b --batch 32 --context 4352 \
        --variants base no_gluon base packed packed+qkv=64,128,4,3,2 packed

B sequences are prefilled to `--context` tokens once; then for each variant the engine's model takes
its KernelSwitches, the decode graphs are captured again, and `--steps` steps are timed (compute-stream
busy time, as rollout.bench.profile), also as a fraction of the roofline at the window's own mean
context. The first variant is the baseline (vs_base); the list should end with it too. A variant is
knobs joined by "+", on top of the engine's switches (rollout.env):
  base              no change
  no_pdl            kernels launch without programmatic dependent launch (kernels/pdl.py)
  no_gluon          Triton's decode attention at every batch size (KernelSwitches.gluon_decode)
  no_attn_early     the Gluon decode kernel issues its first K / V tiles after its PDL wait
  no_splitk_norm    split-K GEMMs (o_proj, down) sum their own partials, not the next add + RMSNorm
  no_silu_gate_up   SiLU * up in a kernel of its own, not the gate_up GEMM's epilogue
  no_rope_in_qkv    RoPE + the K/V write in a kernel of its own, not the QKV GEMM's epilogue
  packed            the decode GEMMs read weight copies packed one contiguous run per program
                    (the engine's pack_decode_weights, at --batch rows)
  qkv=BN,BK,W,S[,SK]  a skinny GEMM config for one weight at every row count, packed or not (also
                    o, gate_up, down, lm_head; "cublas" for F.linear): KernelSwitches.skinny_configs
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from ..env import KernelSwitches
from . import clocks
from .__main__ import run_meta, write_json
from .profile import decoding_engine, recapture_graphs, step_until_decoding
from .roofline import model_sizes, step_time_s
from .shapes import SHAPES, make_config

SWITCHED_OFF = {"no_gluon": "gluon_decode", "no_attn_early": "gluon_early", "no_splitk_norm": "splitk_into_norm",
                "no_silu_gate_up": "silu_in_gate_up", "no_rope_in_qkv": "rope_in_qkv"}


def gemm_shapes(model) -> dict[str, tuple[int, int]]:
    """GEMM knob name -> (N, K) of that decode weight in this model."""
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    head = model.embed_tokens if model.tie_word_embeddings else model.lm_head
    return {name: tuple(lin.weight.shape) for name, lin in (("qkv", attn.qkv_proj), ("o", attn.o_proj),
                                                             ("gate_up", mlp.gate_up_proj), ("down", mlp.down_proj),
                                                             ("lm_head", head))}


def parse_variant(variant: str, shapes: dict, base: KernelSwitches) -> tuple[KernelSwitches, bool, bool]:
    """(switches, PDL on, packed) of a variant on top of `base`. Unknown knobs raise SystemExit; a
    malformed GEMM config raises ValueError (KernelSwitches checks it)."""
    off, configs, pdl_on, packed = {}, [], True, False
    for knob in variant.split("+"):
        name, _, value = knob.partition("=")
        if knob == "no_pdl":
            pdl_on = False
        elif knob == "packed":
            packed = True
        elif knob in SWITCHED_OFF:
            off[SWITCHED_OFF[knob]] = False
        elif name in shapes and value:
            configs.append("{}x{}={}".format(*shapes[name], value))
        elif knob != "base":
            raise SystemExit(f"unknown knob {knob!r}; known: base, no_pdl, packed, {', '.join(SWITCHED_OFF)}, "
                             f"{'=, '.join(shapes)}=")
    skinny = " ".join(filter(None, [base.skinny_configs, *configs]))    # later entries win
    return dataclasses.replace(base, skinny_configs=skinny, **off), pdl_on, packed


def apply(eng, variant: str, base: KernelSwitches, base_pdl: bool, rows: int) -> None:
    """Give the engine's model the variant's kernel forms, then capture its decode graphs again."""
    from ..kernels import pdl
    switches, pdl_on, packed = parse_variant(variant, gemm_shapes(eng.model), base)
    pdl.set_enabled(base_pdl and pdl_on)             # read at capture
    eng.model.use_kernel_switches(switches)
    eng.model.pack_decode_weights(rows=rows, on=packed)   # after the switches: their configs, their orders
    recapture_graphs(eng)


def relayout_pages(eng, order: str, seed: int = 0) -> None:
    """Move every running sequence's KV pages to a new physical order (data copied, block tables
    rewritten). The prefill leaves each sequence's pages in one run; sequences decoding in step take
    their next pages in turn, so a long run's pages are `interleaved`, one sequence's neighbours B
    pages apart. `shuffled`: a random order. The pages in use become 1..n, the free list the rest in
    order, so the timed steps' new pages follow the same rule."""
    eng.drain()                                  # nothing in flight reads or writes the pages
    seqs = list(eng.scheduler.running)
    alloc = eng.kv.alloc
    old = [p for s in seqs for p in s.block_table]
    assert all(alloc.refcount[p] == 1 for p in old), "shared pages: relayout is for n = 1 batches"
    slots = [(i, j) for i, s in enumerate(seqs) for j in range(len(s.block_table))]
    if order == "interleaved":
        slots.sort(key=lambda ij: (ij[1], ij[0]))
    ids = list(range(1, len(old) + 1))
    if order == "shuffled":
        ids = [ids[k] for k in torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed))]
    src = []
    for (i, j), new in zip(slots, ids):        # each (i, j) once: read the old page, then rewrite it
        src.append(seqs[i].block_table[j])
        seqs[i].block_table[j] = new
    src, dst = (torch.tensor(x, device=eng.runner.kv_pool.device) for x in (src, ids))
    for layer in eng.runner.kv_pool:             # one layer at a time: the copy is [2, n, ...]
        layer[:, dst] = layer[:, src]            # advanced indexing reads the source first
    for s in seqs:
        s.table_version += 1
    alloc.refcount[:] = [0] * alloc.num_pages
    for p in ids:
        alloc.refcount[p] = 1
    alloc._free = type(alloc._free)(range(len(ids) + 1, alloc.num_pages))


def vs_base(rows: list[dict]) -> None:
    """Give each timed row other than the baseline `vs_base`: its roofline fraction minus that of the
    nearest timed baseline rows before and after it, interpolated linearly to its mean context (the
    fraction grows with the context); one side where only one exists. The baseline is the first
    timed row's variant (`base`, or e.g. `packed` in a sweep of packed variants)."""
    timed = [i for i, r in enumerate(rows) if "fraction" in r]
    if not timed:
        return
    baseline = rows[timed[0]]["variant"]
    bases = [i for i in timed if rows[i]["variant"] == baseline]
    for i in timed:
        if rows[i]["variant"] == baseline:
            continue
        near = [b for b in (max((b for b in bases if b < i), default=None),
                            min((b for b in bases if b > i), default=None)) if b is not None]
        if not near:
            continue
        ctx = [rows[b].get("mean_context") for b in near] + [rows[i].get("mean_context")]
        f = [rows[b]["fraction"] for b in near]
        if len(near) == 2 and None not in ctx and ctx[0] != ctx[1]:
            ref = f[0] + (f[1] - f[0]) * (ctx[2] - ctx[0]) / (ctx[1] - ctx[0])
        else:
            ref = sum(f) / len(f)
        rows[i]["vs_base"] = rows[i]["fraction"] - ref


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=4352)
    ap.add_argument("--steps", type=int, default=400,
                    help="steps a window; a board that reaches its power limit does so ~0.5-1 s into a load, so "
                         "short windows (40 steps, ~0.35 s) time it unthrottled")
    ap.add_argument("--variants", nargs="+", default=["base", "no_gluon", "base"])
    ap.add_argument("--pages", default="prefilled", choices=["prefilled", "interleaved", "shuffled"],
                    help="the KV pages' physical order for the timed steps (relayout_pages)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("rollout.bench.step_variants needs CUDA")
    from ..kernels import pdl
    cfg = make_config(args.shape)
    B, C, K = args.batch, args.context, args.steps
    sizes = model_sizes(cfg)
    eng = decoding_engine(cfg, B, C, len(args.variants) * (K + 5) + 64)   # + the prefill phase's headroom
    p = eng.pipeline
    step_until_decoding(eng, B)
    if args.pages != "prefilled":
        relayout_pages(eng, args.pages)
    base, base_pdl = eng.model.kernels, pdl.enabled()
    rows = []
    for v in args.variants:
        try:
            apply(eng, v, base, base_pdl, B)
        except Exception as e:      # e.g. a config out of shared memory: report it, go on
            print(f"{v:45s} failed: {type(e).__name__}: {e}"[:300], flush=True)
            rows.append(dict(variant=v, error=f"{type(e).__name__}: {e}"[:300]))
            apply(eng, "base", base, base_pdl, B)
            continue
        for _ in range(5):                       # warm-up on the new graphs
            eng.step()
        busy0, n0 = p.busy_ms, p.counts["graph_steps"]
        ctx0 = C + n0
        with clocks.logged(torch.cuda.current_device()) as gpu_clocks:
            for _ in range(K):
                eng.step()
        steps = p.counts["graph_steps"] - n0
        assert len(eng.scheduler.running) == B, "a sequence finished inside the window: more headroom needed"
        step_ms = (p.busy_ms - busy0) / max(steps, 1)
        roof_ms = 1e3 * step_time_s(sizes, B, ctx0 + steps / 2)
        rows.append(dict(variant=v, steps=steps, mean_context=ctx0 + steps / 2, step_ms=step_ms,
                         roofline_step_ms=roof_ms, fraction=roof_ms / step_ms, unix_time_end=time.time(),
                         gpu_clocks=gpu_clocks))
        print(f"{v:45s} {step_ms:7.3f} ms/step  {100 * roof_ms / step_ms:5.1f}% of roofline", flush=True)
    vs_base(rows)
    print("\n| variant | mean context | ms/step | roofline ms | fraction | vs base "
          "| SM clock, power, time at the power limit |\n"
          "|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | failed | | | | | |")
            continue
        delta = f"{100 * r['vs_base']:+.1f}" if "vs_base" in r else ""
        print(f"| {r['variant']} | {r['mean_context']:.0f} | {r['step_ms']:.3f} | {r['roofline_step_ms']:.3f} | "
              f"{100 * r['fraction']:.1f}% | {delta} | {clocks.brief(r['gpu_clocks'])} |")
    write_json(dict(shape=args.shape, batch=B, context=C, pages=args.pages, rows=rows,
                    meta=run_meta("rollout.bench.step_variants", argv)), args.out)


if __name__ == "__main__":
    main()
