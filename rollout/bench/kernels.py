"""Attention-kernel microbenchmark (CUDA only), one layer at Llama-3-8B shape by default:

    python -m rollout.bench.kernels --out bench/results/kernels-h200.json
    python -m rollout.bench.kernels --num-splits 1 2 3 4 8 --block-n 32 64 --num-stages 2 3

Decode: B x ctx in {32x8K, 64x8K, 32x16K}, 32 q heads, 8 KV heads, d 128, bf16, page 16, pages
shuffled (a fragmented pool). Time = median of `triton.testing.do_bench`. KV-read GB/s =
sum(seq_lens) * Hkv * D * 2 (K and V) * 2 bytes / time, next to a measured device-to-device copy
(reported as read + write bytes / time, the same way HBM bandwidth is quoted) and the torch
reference `paged_attention_ref`. Each config is checked against the reference first (max |err|).
Also: chunked prefill (TFLOP/s), the fused RoPE + KV write, and residual add + RMSNorm and
SiLU*up (GB/s of their traffic; correctness: tests/gpu/test_kernels_cuda.py), each against the
torch ops it replaces.
"""
from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys

import torch

from .__main__ import run_meta


def _setup(B, ctx, Hq, Hkv, D, ps, dtype, seed=0, ragged=False, layout="token"):
    """layout 'token': the cache [pages, page, Hkv, D]; 'head': stored [pages, Hkv, page, D] (a page's
    tokens of one KV head contiguous) and passed as the same logical shape through a permuted view."""
    from ..attention import AttentionMetadata
    g = torch.Generator().manual_seed(seed)
    lens = [ctx] * B if not ragged else torch.randint(ctx // 2, ctx + 1, (B,), generator=g).tolist()
    need = [-(-L // ps) for L in lens]
    num_pages = sum(need)
    perm = torch.randperm(num_pages, generator=g)
    bt = torch.zeros(B, max(need), dtype=torch.int32)
    p = 0
    for i, n in enumerate(need):
        bt[i, :n] = perm[p:p + n].int()
        p += n
    if layout == "head":
        kc, vc = (torch.randn(num_pages, Hkv, ps, D, device="cuda", dtype=dtype).permute(0, 2, 1, 3)
                  for _ in range(2))
    else:
        kc, vc = (torch.randn(num_pages, ps, Hkv, D, device="cuda", dtype=dtype) for _ in range(2))
    bt = bt.cuda()
    meta = AttentionMetadata(slot_mapping=None, block_tables=bt,
                             seq_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
                             query_start_loc=torch.arange(B + 1, dtype=torch.int32, device="cuda"),
                             seq_lens_host=lens, query_start_host=list(range(B + 1)), page_size=ps)
    return kc, vc, meta


def _parse_shape(s: str) -> tuple[int, int]:
    """'32x8K' -> (32, 8192)."""
    b, c = s.lower().split("x")
    return int(b), int(c[:-1]) * 1024 if c.endswith("k") else int(c)


def copy_bandwidth(nbytes=2 << 30):
    from triton.testing import do_bench
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * nbytes / (ms * 1e-3) / 1e9          # read + write


def bench_decode(args, results):
    from triton.testing import do_bench

    from ..attention import paged_attention_ref
    from ..kernels.paged_decode import paged_decode_attention, pick_num_splits
    from ..kernels.paged_prefill import paged_prefill_attention
    dtype = torch.bfloat16
    Hq, Hkv, D = args.q_heads, args.kv_heads, args.head_dim
    for shape, ps, layout in itertools.product(args.shapes, args.page_size, args.layout):
        B, ctx = _parse_shape(shape)
        kc, vc, meta = _setup(B, ctx, Hq, Hkv, D, ps, dtype, ragged=args.ragged, layout=layout)
        q = torch.randn(B, Hq, D, device="cuda", dtype=dtype)
        scale = D ** -0.5
        kv_bytes = sum(meta.seq_lens_host) * Hkv * D * 2 * kc.element_size()
        ref = paged_attention_ref(q.float(), kc.float(), vc.float(), meta, scale) if args.check else None
        ref_ms = None
        if not args.skip_ref:
            ref_ms = do_bench(lambda: paged_attention_ref(q, kc, vc, meta, scale), return_mode="median")
        auto = pick_num_splits(B, Hkv)
        splits = sorted(set(args.num_splits + [auto]))
        row = dict(kind="decode", B=B, ctx=ctx, Hq=Hq, Hkv=Hkv, D=D, page_size=ps, layout=layout, kv_bytes=kv_bytes,
                   ragged=args.ragged, torch_ref_us=ref_ms and ref_ms * 1e3,
                   torch_ref_GBps=ref_ms and kv_bytes / (ref_ms * 1e-3) / 1e9, auto_num_splits=auto, configs=[])
        print(f"\ndecode B={B} ctx={ctx} page {ps} {layout}-major ({kv_bytes / 1e9:.2f} GB KV)" +
              (f"  torch ref {ref_ms * 1e3:.0f} us" if ref_ms else ""))
        for ns, bn, nw, st in itertools.product(splits, args.block_n, args.num_warps, args.num_stages):
            kw = dict(block_n=bn, num_warps=nw, num_stages=st)

            def fn():
                return paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, scale, None, ns, **kw)
            try:
                out = fn()
                err = (out.float() - ref).abs().max().item() if ref is not None else None
                ms = do_bench(fn, return_mode="median")
            except Exception as e:  # e.g. out of shared memory for a config: report, go on
                print(f"  ns={ns} block_n={bn} warps={nw} stages={st}: {type(e).__name__}: {e}"[:200])
                continue
            gbps = kv_bytes / (ms * 1e-3) / 1e9
            row["configs"].append(dict(num_splits=ns, **kw, us=ms * 1e3, GBps=gbps, max_err=err))
            print(f"  ns={ns:<2} block_n={bn:<3} warps={nw} stages={st}: {ms * 1e3:7.1f} us  {gbps:6.0f} GB/s"
                  + (f"  max|err| {err:.1e}" if err is not None else "") + ("  (auto ns)" if ns == auto else ""))
        best = min(row["configs"], key=lambda c: c["us"], default=None)
        row["best"] = best
        # batch-invariant mode sends decode rows through the varlen prefill kernel (64-row GQA tiles):
        # one pass per row (split_len 0), or KV splits at fixed positions plus a merge kernel
        row["varlen_invariant"] = []
        for sl, bm, bn, nw, st in itertools.product(args.invariant_split_len, args.invariant_block_m, args.block_n,
                                                    args.num_warps, args.num_stages):
            def varlen():
                return paged_prefill_attention(q, kc, vc, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                               scale, split_len=sl, decode_rows=sl > 0, block_m=bm, block_n=bn,
                                               num_warps=nw, num_stages=st)
            cfg = f"split_len={sl:<4} block_m={bm:<3} block_n={bn:<3} warps={nw} stages={st}"
            try:
                err = (varlen().float() - ref).abs().max().item() if ref is not None else None
                ms = do_bench(varlen, return_mode="median")
            except Exception as e:
                print(f"  varlen {cfg}: {type(e).__name__}: {e}"[:200])
                continue
            gbps = kv_bytes / (ms * 1e-3) / 1e9
            row["varlen_invariant"].append(dict(split_len=sl, block_m=bm, block_n=bn, num_warps=nw, num_stages=st,
                                                us=ms * 1e3, GBps=gbps, max_err=err))
            print(f"  varlen {cfg}: {ms * 1e3:7.1f} us  {gbps:6.0f} GB/s" + (f"  max|err| {err:.1e}" if err is not None else ""))
        results.append(row)


def bench_prefill(args, results):
    from triton.testing import do_bench

    from ..kernels.paged_prefill import paged_prefill_attention
    Hq, Hkv, D, ps = args.q_heads, args.kv_heads, args.head_dim, args.page_size[0]
    for S, qlen, ctx in ((16, 1024, 1024), (4, 2048, 8192)):      # full prompts; chunks after a prefix
        kc, vc, meta = _setup(S, ctx, Hq, Hkv, D, ps, torch.bfloat16)
        qsl = torch.arange(S + 1, dtype=torch.int32, device="cuda") * qlen
        q = torch.randn(S * qlen, Hq, D, device="cuda", dtype=torch.bfloat16)
        # causal FLOPs: 2 matmuls x 2 flops x Hq x D x (keys seen summed over queries)
        keys = sum((ctx - qlen + i + 1) for i in range(qlen)) * S
        flops = 4 * Hq * D * keys
        # normal tiles; then batch-invariant mode's (KV splits of 1024 folded in the tile) per --invariant-block-m
        configs = [(bm, bn, 4 if bm == 64 else 8, 2, 0) for bm, bn in itertools.product((64, 128), (32, 64))]
        configs += [(bm, 64, nw, 3, 1024) for bm, nw in itertools.product(args.invariant_block_m, args.num_warps)]
        for bm, bn, nw, st, sl in configs:
            def fn():
                return paged_prefill_attention(q, kc, vc, meta.block_tables, qsl, meta.seq_lens, D ** -0.5,
                                               block_m=bm, block_n=bn, num_warps=nw, num_stages=st, split_len=sl)
            try:
                ms = do_bench(fn, return_mode="median")
            except Exception as e:
                print(f"  prefill block_m={bm} block_n={bn} split_len={sl}: {type(e).__name__}: {e}"[:200])
                continue
            tf = flops / (ms * 1e-3) / 1e12
            results.append(dict(kind="prefill", S=S, q_len=qlen, ctx=ctx, block_m=bm, block_n=bn, num_warps=nw,
                                num_stages=st, split_len=sl, us=ms * 1e3, TFLOPs=tf))
            print(f"prefill S={S} q_len={qlen} ctx={ctx} block_m={bm} block_n={bn} warps={nw} split_len={sl}: "
                  f"{ms * 1e3:8.1f} us {tf:6.1f} TFLOP/s")


def bench_rope(args, results):
    from triton.testing import do_bench

    from ..attention import write_kv
    from ..kernels.rope_kv import rope_and_write_kv
    from ..models.decoder import apply_rope
    Hq, Hkv, D, ps = args.q_heads, args.kv_heads, args.head_dim, args.page_size[0]
    inv_freq = (1.0 / (500000.0 ** (torch.arange(0, D, 2).float() / D))).cuda()
    for T in (64, 256, 4096):
        qkv = torch.randn(T, (Hq + 2 * Hkv) * D, device="cuda", dtype=torch.bfloat16)
        q, k, v = (t.view(T, -1, D) for t in qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1))
        pos = torch.randint(0, 8192, (T,), device="cuda")
        kc = torch.zeros(-(-T // ps) + 1, ps, Hkv, D, device="cuda", dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
        slots = torch.randperm(T, device="cuda")

        def torch_path():
            f = pos.float()[:, None] * inv_freq[None, :]
            emb = torch.cat((f, f), dim=-1)
            cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
            qr = apply_rope(q, cos, sin)
            write_kv(apply_rope(k, cos, sin), v, kc, vc, slots)
            return qr
        ms_t = do_bench(torch_path, return_mode="median")
        ms_k = do_bench(lambda: rope_and_write_kv(q, k, v, pos, inv_freq, kc, vc, slots), return_mode="median")
        results.append(dict(kind="rope_kv", T=T, us=ms_k * 1e3, torch_us=ms_t * 1e3))
        print(f"rope+kv write T={T}: {ms_k * 1e3:6.1f} us  (torch ops {ms_t * 1e3:6.1f} us)")


def bench_fused_ops(args, results):
    """Residual add + RMSNorm and SiLU*up at decode and prefill row counts, in GB/s of
    their HBM traffic (reads + writes), next to the torch ops they replace."""
    import torch.nn.functional as F
    from triton.testing import do_bench

    from ..kernels.fused_ops import add_rmsnorm, silu_mul
    from ..models.decoder import RMSNorm
    H, inter = args.hidden, args.intermediate
    norm = RMSNorm(H, 1e-5).cuda().bfloat16()
    for T in (32, 256, 2048):
        x, d = (torch.randn(T, H, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        gu = torch.randn(T, 2 * inter, device="cuda", dtype=torch.bfloat16)
        cases = {   # name: (kernel, torch ops, bytes moved)
            "add_rmsnorm": (lambda: add_rmsnorm(x, norm.weight, norm.eps, delta=d),
                            lambda: norm(x + d), 2 * T * H * 2 * 2 + H * 2),
            "silu_mul": (lambda: silu_mul(gu), lambda: F.silu(gu[:, :inter]) * gu[:, inter:], T * 3 * inter * 2),
        }
        for name, (kernel, ref, nbytes) in cases.items():
            ms_k = do_bench(kernel, return_mode="median")
            ms_t = do_bench(ref, return_mode="median")
            gbps = nbytes / ms_k / 1e6
            results.append(dict(kind=name, T=T, hidden=H, intermediate=inter, us=ms_k * 1e3, torch_us=ms_t * 1e3,
                                bytes=nbytes, GBps=gbps))
            print(f"{name:12s} T={T:5d}: {ms_k * 1e3:7.1f} us {gbps:7.0f} GB/s  (torch ops {ms_t * 1e3:7.1f} us)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["32x8K", "64x8K", "32x16K"], help="BxCTX, e.g. 32x8K")
    ap.add_argument("--num-splits", nargs="+", type=int, default=[1, 2, 3, 4, 8])
    ap.add_argument("--block-n", nargs="+", type=int, default=[64])
    ap.add_argument("--num-warps", nargs="+", type=int, default=[4])
    ap.add_argument("--num-stages", nargs="+", type=int, default=[2, 3])
    ap.add_argument("--invariant-split-len", nargs="*", type=int, default=[0, 1024],
                    help="decode rows through the varlen kernel (batch-invariant mode): KV split lengths, 0 = none")
    ap.add_argument("--invariant-block-m", nargs="+", type=int, default=[64],
                    help="batch-invariant tile rows to time (decode rows and the invariant prefill fold)")
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", nargs="+", type=int, default=[16],
                    help="decode sweeps these; the rest use the first")
    ap.add_argument("--layout", nargs="+", choices=["token", "head"], default=["token"],
                    help="decode: KV cache storage order within a page (see _setup)")
    ap.add_argument("--ragged", action="store_true", help="seq lens uniform in [ctx/2, ctx]")
    ap.add_argument("--no-check", dest="check", action="store_false", help="skip the fp32 reference check")
    ap.add_argument("--skip-ref", action="store_true", help="don't time the torch reference")
    ap.add_argument("--hidden", type=int, default=4096, help="fused ops: hidden size")
    ap.add_argument("--intermediate", type=int, default=14336, help="fused ops: MLP intermediate size")
    ap.add_argument("--only", choices=["decode", "prefill", "rope", "fused"], nargs="+",
                    default=["decode", "prefill", "rope", "fused"])
    ap.add_argument("--out", help="write results as JSON here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("rollout.bench.kernels needs a CUDA GPU (the Triton kernels are timed on the device); "
                 "on CPU run `pytest tests/test_kernels_interpret.py` for correctness.")
    try:
        import triton
    except ImportError:
        sys.exit("rollout.bench.kernels needs triton")
    copy_gbps = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {copy_gbps:.0f} GB/s (read + write)")
    results: list = []
    if "decode" in args.only:
        bench_decode(args, results)
    if "prefill" in args.only:
        bench_prefill(args, results)
    if "rope" in args.only:
        bench_rope(args, results)
    if "fused" in args.only:
        bench_fused_ops(args, results)
    if args.out:
        info = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    python=platform.python_version(), copy_GBps=copy_gbps, args=vars(args), results=results,
                    meta=run_meta("rollout.bench.kernels", argv))
        with open(args.out, "w") as f:
            json.dump(info, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
