"""Decode-step time of the engine under kernel variants, side by side in one process:

    python -m rollout.bench.step_variants --shape llama3-8b --batch 32 --context 4352

B sequences are prefilled to `--context` tokens once; then, for each variant, the knobs are set,
the decode graphs are captured again, and `--steps` steps are timed (CUDA-event busy time of the
compute stream, as rollout.bench.profile). The context grows by one token per step, so each
window is also given as a fraction of the roofline at its own mean context; the first variant is
the baseline (vs_base), and the list should end with it too. A variant is knobs joined by "+", on
top of the defaults:
  base              the defaults (PDL launch-then-wait, RoPE over head groups, swept tables,
                    split-K partials into the norm, SiLU and RoPE in GEMM epilogues)
  wait_first        PDL: wait, then let dependents launch (kernels/pdl.py mode 1)
  no_pdl            no programmatic dependent launch (kernels/pdl.py off)
  rope_token        RoPE + KV write with one program per token
  qkv=BN,BK,W,S[,SK]  a skinny GEMM config for one weight at every M (also o, gate_up, down, lm_head;
                    "cublas" for F.linear)
  attn=NS,BN,W,S    decode attention: splits, key tile, warps, stages
  gattn=BN,S[,NS[,F[,W]]]  decode attention's split kernel in Gluon (kernels/gluon_decode.py): key
                    tile, ring stages, a split count (default: the engine's choice, paged_decode.pick_decode),
                    form F (paged_decode.FORMS): 0 heads as the MMA's rows, 1 the same with every warp
                    computing a tile's scores, 2 keys as the MMA's rows (one split); W warps a program
                    (paged_decode.GLUON_WARPS; 4 unless given, the default tile's is 8)
  no_gattn          Triton's decode attention at every batch (attn= also)
  attn_early        the Gluon keys-form attention issues its first K / V tiles before its PDL wait
                    (paged_decode.GLUON_EARLY; the default; no_attn_early: after it)
  splitk_norm       split-K GEMMs (o_proj, down) leave their partials to the next add + RMSNorm
                    (the default; no_splitk_norm: the GEMM's own fix-up)
  silu_gate_up      SiLU * up in the gate_up GEMM's epilogue, no SiLU kernel (the default;
                    no_silu_gate_up: the SiLU kernel)
  rope_in_qkv       RoPE + the K/V write in the QKV GEMM's epilogue, no RoPE kernel (the default;
                    no_rope_in_qkv: the RoPE kernel)
  packed            the decode GEMMs read copies of their weights packed one contiguous run per
                    program (DecoderLM.pack_decode_weights, the engine's pack_decode_weights, with
                    its configs for packed weights at --batch rows; a GEMM knob's config replaces
                    both tables' entries)
  mega              every layer of a decode step in one kernel (kernels/decode_layers.py, the
                    engine's decode_megakernel; its weights stay stacked for the later variants)
  no_trigger[=K,..] kernels of kinds K (as late_wait below; default qkv) never let the next kernel
                    launch before they exit (kernels/pdl.py set_no_trigger; right results): what
                    the early launch behind them is worth
Two knobs are timing bounds, not modes to run (their tokens are wrong):
  late_wait[=K,..]  kernels of kinds K (gemm: o_proj, gate_up, down, lm_head; qkv; attn; one of
                    o, gate_up, down, lm_head; down0: down's split-0 programs; default the first
                    three) wait for the kernel before only ahead of their first store
                    (kernels/pdl.py set_late): what overlapping each main loop with the previous
                    kernel's tail could gain at most
  skip_norms[=pre|post]  the layers' residual add + RMSNorm kernels (pre: before QKV, post:
                    before gate_up; default both) are not launched (the next GEMM reads the
                    residual as is): what the 64 norm kernels a step cost
"""
from __future__ import annotations

import argparse
import functools
import time

import torch

from ..models import decoder
from . import clocks
from .__main__ import run_meta, write_json
from .profile import decoding_engine, recapture_graphs, step_until_decoding
from .roofline import model_sizes, step_time_s
from .shapes import SHAPES, make_config


GEMMS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
         "lm_head": (128256, 4096)}     # llama3-8b weight shapes (N, K)


_ADD_NORM = decoder.add_norm_of_linear


def _linear_without_norm(lin, x, residual, norm, linear, splitk_into_norm=False, skip=("pre", "post")):
    """skip_norms: add_norm_of_linear's GEMM (its partials where it leaves them to the norm), no
    norm kernel; the residual stands in for both outputs. `skip`: which norms (pre: the one after
    down_proj, before the next QKV; post: after o_proj, told by its square weight as in the
    shapes this bench runs); the others run as usual."""
    if ("post" if lin.weight.shape[0] == lin.weight.shape[1] else "pre") not in skip:
        return _ADD_NORM(lin, x, residual, norm, linear, splitk_into_norm)
    cfg = decoder._fusable_config(lin, x, linear, split_k=True) if splitk_into_norm else None
    if cfg is not None:
        from ..kernels.skinny_gemm import skinny_gemm
        w, tiled = decoder.weight_for(lin, cfg)          # the packed copy under `packed`
        skinny_gemm(x, w, *cfg, partials=True, tiled=tiled)
    else:
        linear(lin, x)
    return residual, residual


def apply(eng, variant: str, defaults: dict) -> None:
    from ..kernels import paged_decode, pdl, rope_kv, skinny_gemm
    pdl.set_enabled(True, launch_first=True)
    pdl.set_late(())
    pdl.set_no_trigger(())
    decoder.add_norm_of_linear = defaults["add_norm"]
    rope_kv.Q_HEADS_PER_PROGRAM = defaults["rope"]
    skinny_gemm._LLAMA3_8B = dict(defaults["table"])
    skinny_gemm._LLAMA3_8B_PACKED = dict(defaults["packed_table"])
    paged_decode.DECODE_TILE = dict(defaults["tile"])
    paged_decode.GLUON_TILE = defaults["gluon_tile"]
    paged_decode.GLUON_WARPS = defaults["gluon_warps"]
    paged_decode.GLUON_EARLY = defaults["gluon_early"]
    paged_decode.pick_decode = defaults["decode"]
    paged_decode.pick_num_splits = defaults["splits"]
    eng.model.splitk_into_norm = defaults["splitk_norm"]
    eng.model.silu_in_gate_up = defaults["silu_gate_up"]
    eng.model.rope_in_qkv = defaults["rope_in_qkv"]
    eng.model.decode_megakernel = False
    packed = False
    for knob in variant.split("+"):
        name, _, val = knob.partition("=")
        numeric = (name in GEMMS or name in ("attn", "gattn")) and val != "cublas"
        nums = tuple(int(v) for v in val.split(",")) if numeric else None
        if knob == "base":
            pass
        elif knob == "no_pdl":
            pdl.set_enabled(False)
        elif knob == "wait_first":
            pdl.set_enabled(True, launch_first=False)
        elif name == "late_wait":
            kinds = val.split(",") if val else ("gemm", "qkv", "attn")
            pdl.set_late([f"gemm:{GEMMS[k][0]},{GEMMS[k][1]}" if k in GEMMS and k != "qkv" else
                          f"split0:{GEMMS['down'][0]},{GEMMS['down'][1]}" if k == "down0" else k for k in kinds])
        elif name == "no_trigger":
            pdl.set_no_trigger([f"gemm:{GEMMS[k][0]},{GEMMS[k][1]}" if k in GEMMS and k != "qkv" else k
                                for k in (val.split(",") if val else ("qkv",))])
        elif name == "skip_norms":
            decoder.add_norm_of_linear = functools.partial(_linear_without_norm, skip=val or ("pre", "post"))
        elif knob in ("splitk_norm", "no_splitk_norm"):
            eng.model.splitk_into_norm = knob == "splitk_norm"
        elif knob in ("rope_in_qkv", "no_rope_in_qkv"):
            eng.model.rope_in_qkv = knob == "rope_in_qkv"
        elif knob in ("silu_gate_up", "no_silu_gate_up"):
            eng.model.silu_in_gate_up = knob == "silu_gate_up"
        elif knob == "rope_token":
            rope_kv.Q_HEADS_PER_PROGRAM = 0
        elif name in GEMMS:
            skinny_gemm.set_config(*GEMMS[name], nums)     # the knob's config, packed or not
        elif knob == "packed":
            packed = True
        elif knob == "mega":
            from ..kernels import sm_count
            eng.model.use_decode_megakernel(sm_count(eng.device))
        elif name == "gattn":
            paged_decode.GLUON_TILE = nums[:2] + (paged_decode.FORMS[nums[3] if len(nums) > 3 else 0],)
            if len(nums) > 2:
                paged_decode.pick_decode = lambda *a, ns=nums[2], **k: (ns, True)
            paged_decode.GLUON_WARPS = nums[4] if len(nums) > 4 else 4
        elif knob in ("attn_early", "no_attn_early"):
            paged_decode.GLUON_EARLY = knob == "attn_early"
        elif knob == "no_gattn":
            paged_decode.GLUON_TILE = None
        elif name == "attn":
            paged_decode.GLUON_TILE = None
            paged_decode.pick_num_splits = lambda *a, ns=nums[0], **k: ns
            paged_decode.DECODE_TILE = dict(block_n=nums[1], num_warps=nums[2], num_stages=nums[3])
        else:
            raise SystemExit(f"unknown knob {knob!r}")
    eng.model.pack_decode_weights(rows=defaults["batch"], on=packed)   # after the knobs: their configs
    recapture_graphs(eng)


def relayout_pages(eng, order: str, seed: int = 0) -> None:
    """Move every running sequence's KV pages to a new physical order (data copied, block tables
    rewritten, so the tokens stay right). The prefill leaves each sequence's pages in one run;
    a long generation does not: sequences decoding in step take their next pages in turn, so
    P1's pages past the prompt are `interleaved`, one sequence's neighbours B pages apart.
    `shuffled`: a random order. The pages in use become 1..n; the free list is the rest, in
    order, so the timed steps' new pages follow the same rule as P1's."""
    eng.drain()                                  # nothing in flight reads or writes the pages
    seqs = list(eng.scheduler.running)
    alloc = eng.kv.alloc
    old = [p for s in seqs for p in s.block_table]
    assert all(alloc.refcount[p] == 1 for p in old), "shared pages: relayout is for n = 1 batches"
    slots = [(i, j) for j in range(max(len(s.block_table) for s in seqs)) for i, s in enumerate(seqs)
             if j < len(s.block_table)] if order == "interleaved" else \
            [(i, j) for i, s in enumerate(seqs) for j in range(len(s.block_table))]
    ids = list(range(1, len(old) + 1))
    if order == "shuffled":
        ids = [ids[k] for k in torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed))]
    tables = [list(s.block_table) for s in seqs]
    src, dst = [], []
    for (i, j), new in zip(slots, ids):
        src.append(tables[i][j])
        dst.append(new)
        seqs[i].block_table[j] = new
    src, dst = (torch.tensor(x, device=eng.runner.kv_pool.device) for x in (src, dst))
    for layer in eng.runner.kv_pool:             # one layer at a time: the copy is [2, n, ...]
        layer[:, dst] = layer[:, src]            # advanced indexing reads the source first
    for s in seqs:
        s.table_version += 1
    alloc.refcount[:] = [0] * alloc.num_pages
    for p in ids:
        alloc.refcount[p] = 1
    alloc._free = type(alloc._free)(range(len(ids) + 1, alloc.num_pages))


def vs_base(rows: list[dict]) -> None:
    """Give each timed row other than the baseline `vs_base`: its roofline fraction minus that of
    the nearest timed baseline rows before and after it, interpolated linearly to its mean context
    (the fraction grows with the context, ~0.1 points per 100 tokens in P1's 500-step windows:
    bench/results/README.md, twenty-third session); one side where only one exists. The baseline
    is the first timed row's variant: `base`, or e.g. `packed` in a sweep of packed variants.
    Alternating the baseline with the variants keeps the comparison at nearly the same GPU state."""
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
                         "short windows (40 steps, ~0.35 s) time it unthrottled (bench/results/README.md, "
                         "twenty-second session)")
    ap.add_argument("--variants", nargs="+", default=["base", "wait_first", "rope_token", "base"])
    ap.add_argument("--pages", default="prefilled", choices=["prefilled", "interleaved", "shuffled"],
                    help="the KV pages' physical order for the timed steps (relayout_pages)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("rollout.bench.step_variants needs CUDA")
    cfg = make_config(args.shape)
    B, C, K = args.batch, args.context, args.steps
    sizes = model_sizes(cfg)
    eng = decoding_engine(cfg, B, C, len(args.variants) * (K + 5) + 64)   # + the prefill phase's headroom
    p = eng.pipeline
    step_until_decoding(eng, B)
    if args.pages != "prefilled":
        relayout_pages(eng, args.pages)
    from ..kernels import paged_decode, rope_kv, skinny_gemm
    defaults = dict(rope=rope_kv.Q_HEADS_PER_PROGRAM, table=dict(skinny_gemm._LLAMA3_8B),
                    packed_table=dict(skinny_gemm._LLAMA3_8B_PACKED),
                    tile=dict(paged_decode.DECODE_TILE), splits=paged_decode.pick_num_splits,
                    gluon_tile=paged_decode.GLUON_TILE, gluon_warps=paged_decode.GLUON_WARPS,
                    gluon_early=paged_decode.GLUON_EARLY,
                    decode=paged_decode.pick_decode,
                    splitk_norm=eng.model.splitk_into_norm, silu_gate_up=eng.model.silu_in_gate_up,
                    rope_in_qkv=eng.model.rope_in_qkv, add_norm=decoder.add_norm_of_linear, batch=B)
    rows = []
    for v in args.variants:
        try:
            apply(eng, v, defaults)
        except Exception as e:      # e.g. a config out of shared memory: report it, go on
            print(f"{v:45s} failed: {type(e).__name__}: {e}"[:300], flush=True)
            rows.append(dict(variant=v, error=f"{type(e).__name__}: {e}"[:300]))
            apply(eng, "base", defaults)
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
    import sys
    main(sys.argv[1:])
