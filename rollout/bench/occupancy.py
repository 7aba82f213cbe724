"""How the decode step's kernels fill an H200, worked out on any machine (no GPU): each GEMM at its
table config (or one given), the QKV GEMM with its RoPE epilogue, gate_up with its SiLU epilogue, and
decode attention at its tile, compiled here for sm_90a (triton's bundled ptxas gives the registers);
from the shared memory and registers, the programs an SM holds; from the grid, the waves it runs in
on `--sms` SMs. A grid of 1.45 waves (192 programs at one an SM on 132) leaves most SMs idle in its
second wave, and a grid of 96 programs at any occupancy leaves 36 idle throughout: what a
step_variants sweep then measures (bench/results/README.md, twenty-fourth session).

    python -m rollout.bench.occupancy --shape llama3-8b --batch 32 --packed --gemm qkv=64,128,4,3,2

Run without TRITON_INTERPRET (the interpreter replaces the kernels these compile).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

SMEM_PER_SM = 233472      # bytes of shared memory on one SM (H100 / H200); each CTA also takes 1 KB
REGS_PER_SM = 65536
PTR_ARGS = {"q_ptr", "k_ptr", "v_ptr", "out_ptr", "x_ptr", "w_ptr", "b_ptr", "y_ptr", "qo_ptr", "kc_ptr",
            "vc_ptr"}
PTR_TYPES = {"bt_ptr": "*i32", "lens_ptr": "*i32", "pos_ptr": "*i64", "inv_freq_ptr": "*fp32",
             "slot_ptr": "*i64", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "po_ptr": "*fp32", "plse_ptr": "*fp32"}


def compile_sm90(fn, const: dict, num_warps: int, num_stages: int = 2, gluon: bool = False,
                 types: dict | None = None) -> tuple:
    """(compiled kernel, registers a thread from ptxas -v) of Triton or Gluon kernel `fn` for sm_90a
    at these constexprs. Argument types: `types` (int32 for any it does not name) where given, else
    pointers bf16 unless PTR_TYPES says otherwise, scalars int32 (fp32 for softmax scales); pointers,
    N and strides 16-divisible, as the JIT specialises them."""
    import triton
    from triton.backends.compiler import GPUTarget
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif types is not None:
            sig[name] = types.get(name, "i32")
        else:
            sig[name] = PTR_TYPES.get(name, "*bf16" if name in PTR_ARGS else "fp32" if "scale" in name else "i32")
        if name.endswith("_ptr") or name == "N" or name.startswith("s_"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as Source
        options = dict(num_warps=num_warps)
    else:
        from triton.compiler import ASTSource as Source
        options = dict(num_warps=num_warps, num_stages=num_stages, launch_pdl=True)
    k = triton.compile(Source(fn=fn, signature=sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=options)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:      # registers: ptxas -v (n_regs needs a GPU to load the kernel)
        with open(os.path.join(d, "k.ptx"), "w") as f:
            f.write(k.asm["ptx"])
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.path.join(d, "k.o")],
                              capture_output=True, text=True, check=True).stderr
    return k, max(int(r) for r in re.findall(r"Used (\d+) registers", info))


def resources(fn, const: dict, num_warps: int, num_stages: int = 2, gluon: bool = False) -> tuple[int, int]:
    """(shared memory bytes, registers a thread) of kernel `fn` compiled for sm_90a (compile_sm90)."""
    k, regs = compile_sm90(fn, const, num_warps, num_stages, gluon)
    return k.metadata.shared, regs


def per_sm(shared: int, regs: int, num_warps: int) -> int:
    """Programs of this size one SM holds at once: what its shared memory, registers and 2,048
    threads allow."""
    return min(SMEM_PER_SM // (shared + 1024), REGS_PER_SM // (regs * 32 * num_warps), 2048 // (32 * num_warps))


def decode_gemms(cfg) -> dict:
    """name -> (N, K) of a decoder's decode GEMMs (the fused QKV and gate_up weights)."""
    h, d = cfg.hidden_size, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    return {"qkv": ((hq + 2 * hkv) * d, h), "o": (h, hq * d), "gate_up": (2 * cfg.intermediate_size, h),
            "down": (h, cfg.intermediate_size), "lm_head": (cfg.vocab_size, h)}


def rows(shape: str, batch: int, packed: bool, gemm_configs: dict, sms: int = 132) -> list[dict]:
    """One row per decode GEMM and the decode attention at `batch` rows on `sms` SMs: its config,
    programs, shared memory, registers and programs an SM (main adds the waves). The QKV GEMM is
    compiled with its RoPE epilogue and gate_up with its SiLU epilogue, the engine's defaults."""
    from ..kernels import paged_decode, rope_kv, skinny_gemm
    from ..kernels.gluon_decode import _gluon_decode_keys_kernel, _gluon_decode_split_kernel
    from .shapes import make_config
    cfg = make_config(shape)
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    out = []
    bm = skinny_gemm.pick_block_m(batch)
    for name, (N, K) in decode_gemms(cfg).items():
        conf = gemm_configs.get(name) or skinny_gemm.pick_config(N, K, batch, packed=packed)
        if conf is None:
            out.append(dict(kernel=name, config="cublas"))
            continue
        bn, bk, warps, stages, *split = conf
        split_k = split[0] if split else 1
        common = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split_k, PDL=2, TILED=packed)
        if name == "qkv":
            fn = rope_kv._qkv_rope_kernel
            const = dict(common, HQ=cfg.num_attention_heads, HKV=cfg.num_key_value_heads, HALF=d // 2, PRECISE=False)
        else:
            fn = skinny_gemm._skinny_gemm_kernel
            const = dict(common, EVEN_N=True, HAS_BIAS=False, PARTIALS=split_k > 1 and name in ("o", "down"),
                         SILU_MUL=name == "gate_up")
        shared, regs = resources(fn, const, warps, stages)
        out.append(dict(kernel=name, config=",".join(map(str, conf)), programs=-(-N // bn) * split_k, shared=shared,
                        regs=regs, per_sm=per_sm(shared, regs, warps)))
    hkv = cfg.num_key_value_heads
    splits, gluon = paged_decode.pick_decode(batch, hkv, sms, gluon_ok=True)
    if gluon:
        (block_n, stages, form), warps = paged_decode.GLUON_TILE, paged_decode.GLUON_WARPS
        group = cfg.num_attention_heads // hkv
        const = dict(GROUP=group, HEAD_DIM=d, PAGE_SIZE=16, BLOCK_N=block_n, STAGES=stages, PDL=2)
        if form == "keys":
            fn = _gluon_decode_keys_kernel
            const.update(EARLY=paged_decode.GLUON_EARLY)
        else:
            fn = _gluon_decode_split_kernel
            const.update(NUM_SPLITS=splits, MATH=True, WARP_SCORES=form == "warp_scores")
        shared, regs = resources(fn, dict(const, num_warps=warps), warps, gluon=True)
        out.append(dict(kernel="attention (gluon)", config=f"{block_n},{stages},{form},{warps}",
                        programs=batch * hkv * splits, shared=shared, regs=regs, per_sm=per_sm(shared, regs, warps)))
    else:
        out.append(dict(kernel="attention (triton)", config=f"{splits} splits", programs=batch * hkv * splits))
    return out


def main(argv=None) -> None:
    from .__main__ import run_meta, write_json
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--packed", action="store_true", help="the configs for packed weights (pack_decode_weights)")
    p.add_argument("--gemm", nargs="*", default=[], metavar="NAME=BN,BK,W,S[,SK]",
                   help="a config for a decode GEMM (qkv, o, gate_up, down, lm_head) instead of the table's")
    p.add_argument("--sms", type=int, default=132)
    p.add_argument("--out")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("occupancy: run without TRITON_INTERPRET (it compiles the kernels for sm_90a)")
    configs = {}
    for g in args.gemm:
        name, _, nums = g.partition("=")
        configs[name] = tuple(int(n) for n in nums.split(","))
    table = rows(args.shape, args.batch, args.packed, configs, args.sms)
    print(f"{args.shape}, {args.batch} rows{', packed' if args.packed else ''}, sm_90a, {args.sms} SMs")
    print("| kernel | config | programs | shared KB | registers | per SM | waves |\n|---|---|---|---|---|---|---|")
    for r in table:
        if "per_sm" in r:
            r["waves"] = round(r["programs"] / (r["per_sm"] * args.sms), 2)
        print(f"| {r['kernel']} | {r['config']} | {r.get('programs', '')} | "
              f"{round(r['shared'] / 1024) if 'shared' in r else ''} | {r.get('regs', '')} | {r.get('per_sm', '')} | "
              f"{r.get('waves', '')} |")
    write_json(dict(shape=args.shape, batch=args.batch, packed=args.packed, sms=args.sms, rows=table,
                    meta=run_meta("rollout.bench.occupancy", argv)), args.out)


if __name__ == "__main__":
    main()
