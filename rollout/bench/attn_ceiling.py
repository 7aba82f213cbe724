"""Decode attention against what HBM gives a pure read, inside CUDA graphs. CUDA only; an
experiment for issue 4 (P1's attention reads the KV cache at ~4.3 TB/s, cuDNN's dense decode
reached 4.5-4.6 TB/s in performance.md; how much of that gap is ours to take?).

    python -m rollout.bench.attn_ceiling --batch 32 --context 4352 --out bench/results/<name>.json

L layers, each its own paged KV cache (bf16, page 16, Llama-3-8B heads: 32 q, 8 KV, d 128), are
chained in one graph the way the decode step runs them: layer l + 1's query is layer l's output,
so each launch depends on the one before (PDL as in the engine). Per layer, timed with events
over graph replays (median of --repeats):
- `ours`: paged_decode_attention for each --config NS,BLOCK_N,WARPS,STAGES, with the block
  tables' pages shuffled (a fragmented pool, as after hours of serving) and in order;
- `read`: a Triton kernel that only reads the same bytes (K then V of the layer, each program a
  contiguous share, summed in fp32) for each --read-grid (programs per SM) and --read-stages,
  launched with PDL like ours: the ceiling for a kernel that reads those bytes once, with no
  attention math. At small contexts (32 x 256: 34 MB, o_proj's weight size) it also shows what
  a kernel boundary costs a kernel that does nothing but stream;
- `sdpa_cudnn`: torch SDPA on a dense equal-length cache [B, Hkv, ctx, D] with the cuDNN back-end
  (where torch has it), the dense-cache reference of performance.md.
Outputs are checked against the fp32 torch reference before timing (ours and SDPA). ROLLOUT_PDL=0
launches ours without programmatic dependent launch (kernels/pdl.py).
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time

import torch
import triton
import triton.language as tl

from ..kernels import fix_interpreter, pdl
from ..kernels.pdl import enter, pdl_for
from .__main__ import run_meta, write_json
from .gemm import profiled_once
from .kernels import copy_bandwidth

fix_interpreter()


@triton.jit
def _read_kernel(k_ptr, v_ptr, out_ptr, n_per_prog, n_total, BLOCK: tl.constexpr, STAGES: tl.constexpr,
                 PRE: tl.constexpr, PDL: tl.constexpr):
    """Program p sums elements [p * n_per_prog, (p + 1) * n_per_prog) of k and then of v. With PDL
    it waits for the kernel before, as a dependent layer would (its out buffer is reused). PRE
    blocks of k are loaded before that wait, as a GEMM may load weights that are not the previous
    kernel's output: what reads in flight across the boundary save (n_per_prog >= PRE * BLOCK)."""
    pid = tl.program_id(0)
    lo = pid.to(tl.int64) * n_per_prog
    acc = tl.zeros([BLOCK], tl.float32)
    offs = tl.arange(0, BLOCK)
    for j in tl.static_range(PRE):
        idx = lo + j * BLOCK + offs
        acc += tl.load(k_ptr + idx, mask=idx < n_total, other=0.0).to(tl.float32)
    enter(PDL)
    for i in tl.range(PRE * BLOCK, n_per_prog, BLOCK, num_stages=STAGES):
        idx = lo + i + offs
        acc += tl.load(k_ptr + idx, mask=idx < n_total, other=0.0).to(tl.float32)
    for i in tl.range(0, n_per_prog, BLOCK, num_stages=STAGES):
        idx = lo + i + offs
        acc += tl.load(v_ptr + idx, mask=idx < n_total, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def read_bytes(k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, programs: int, stages: int,
               block: int = 4096, pre: int = 0) -> torch.Tensor:
    n = k.numel()
    per = triton.cdiv(triton.cdiv(n, programs), block) * block
    if per < pre * block:
        raise ValueError(f"{pre} blocks before the wait: more than a program's {per // block}")
    pdl = pdl_for(k)
    _read_kernel[(programs,)](k, v, out, per, n, BLOCK=block, STAGES=stages, PRE=pre, PDL=pdl, num_warps=4,
                              launch_pdl=bool(pdl))
    return out


def graph_us(chain, layers: int, replays: int, repeats: int) -> float:
    """Median over `repeats` of the per-layer time of `replays` replays of a graph of chain()."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        chain()                                        # compile + warm up
        chain()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        chain()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / (replays * layers))
    return sorted(times)[len(times) // 2]


def hold(chain, layers: int, seconds: float) -> dict:
    """Replays of a graph of chain() for `seconds`: a window long enough for an nvidia-smi log
    beside the run to show its clocks and power (bench.clocks), and the time a layer takes over its
    last half, once the GPU's power limit has had time to act (graph_us's short runs end before)."""
    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        chain()
    torch.cuda.synchronize()
    t0 = time.time()
    n = n_half = 0
    t_half = None
    while time.time() - t0 < seconds:
        for _ in range(50):
            g.replay()
        torch.cuda.synchronize()
        n += 50
        if t_half is None and time.time() - t0 >= seconds / 2:
            t_half, n_half = time.time(), n
    t1 = time.time()
    return dict(unix_time_start=t0, unix_time_end=t1,
                held_us_per_layer=(t1 - t_half) * 1e6 / ((n - n_half) * layers) if n > n_half else None)


def make_layers(B: int, ctx: int, L: int, ps: int, Hkv: int, D: int, pages_order: str, layout: str = "token",
                seed: int = 0, first_page: int = 1):
    """L (k_cache, v_cache) pairs and one block table [B, ctx / ps] (the same for every layer,
    as in the engine: one table, a cache per layer). pages_order: ordered (each sequence's pages
    one run), interleaved (B apart, as sequences decoding in step take them) or shuffled. layout:
    token (the engine's [pages, ps, Hkv, D]) or slab (stored [Hkv, pages, ps, D]: a KV head's pages
    in one slab, so a sequence's pages in order are one contiguous run a head; passed as the
    [pages, ps, Hkv, D] view the kernels take). Tables use pages first_page.. (page 0 the trash page)."""
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-ctx // ps)
    pages = B * per_seq + first_page
    ids = torch.arange(first_page, pages)
    bt = dict(ordered=ids.view(B, per_seq), interleaved=ids.view(per_seq, B).t(),
              shuffled=(torch.randperm(pages - first_page, generator=g) + first_page).view(B, per_seq))[pages_order]
    bt = bt.contiguous().int().cuda()

    def cache():
        if layout == "slab":
            return torch.randn(Hkv, pages, ps, D, device="cuda", dtype=torch.bfloat16).permute(1, 2, 0, 3)
        return torch.randn(pages, ps, Hkv, D, device="cuda", dtype=torch.bfloat16)
    return [(cache(), cache()) for _ in range(L)], bt


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=4352)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--configs", nargs="+", default=["2,64,4,2", "4,64,4,2", "2,64,4,3", "2,128,8,2"],
                    help="NS,BLOCK_N,WARPS,STAGES (Triton's kernel); gluon: the Gluon kernel at the engine's tile; "
                         "gluon=BLOCK_N,STAGES[,ws|keys][,nomath]: at that tile, one split (ws: every warp computes "
                         "the scores; keys: keys as the MMA's rows; nomath: its copies only)")
    ap.add_argument("--pages", nargs="+", choices=["shuffled", "ordered", "interleaved"],
                    default=["shuffled", "ordered"])
    ap.add_argument("--layout", nargs="+", choices=["token", "slab"], default=["token"],
                    help="KV pages [pages, ps, Hkv, D] (the engine's) or a slab a KV head (make_layers)")
    ap.add_argument("--first-page", type=int, default=1,
                    help="first page id the tables use: 16 puts slab runs on 64 KB boundaries (bench.decode_layers)")
    ap.add_argument("--read-grid", nargs="+", type=int, default=[2, 4, 8], help="read kernel programs per SM")
    ap.add_argument("--read-stages", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--read-pre", nargs="+", type=int, default=[0],
                    help="blocks of k each read program loads before its PDL wait")
    ap.add_argument("--read-block", nargs="+", type=int, default=[4096], help="elements a read program loads at once")
    ap.add_argument("--no-sdpa", dest="sdpa", action="store_false")
    ap.add_argument("--hold", type=float, default=0.0,
                    help="seconds of replays after each timing, for clocks and power (bench.clocks)")
    ap.add_argument("--probe", action="store_true",
                    help="no timing: one layer of each config and read once more for a profiler "
                         "(ncu --profile-from-start off)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("rollout.bench.attn_ceiling needs a CUDA GPU")
    from ..attention import AttentionMetadata, paged_attention_ref
    from ..kernels.gluon_decode import decode_split
    from ..kernels.paged_decode import LOG2E, paged_decode_attention

    B, ctx, L, ps, Hq, Hkv, D = args.batch, args.context, args.layers, args.page_size, 32, 8, 128
    scale = D ** -0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy = copy_bandwidth()
    kv_bytes = 2 * B * ctx * Hkv * D * 2
    print(f"{torch.cuda.get_device_name()}: copy {copy:.0f} GB/s; B={B} ctx={ctx}: {kv_bytes / 1e6:.0f} MB KV a layer, "
          f"{L} layers a graph")
    rows = []

    def report(name, us, **kw):
        gbps = kv_bytes / (us * 1e-6) / 1e9
        rows.append(dict(name=name, us_per_layer=us, GBps=gbps, of_copy=gbps / copy, **kw))
        print(f"  {name:<44} {us:8.1f} us/layer  {gbps:6.0f} GB/s  {gbps / copy:6.1%} of copy", flush=True)

    def held(chain):
        """--hold: the row's window, and its time a layer held that long (at the GPU's power limit)."""
        if args.hold:
            rows[-1].update(hold(chain, L, args.hold))
            print(f"  {'':<44} {rows[-1]['held_us_per_layer'] or float('nan'):8.1f} us/layer over the last "
                  f"{args.hold / 2:.0f} s "
                  f"of {args.hold:.0f} s of replays", flush=True)

    q0 = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    for layout, pages in itertools.product(args.layout, args.pages):
        caches, bt = make_layers(B, ctx, L, ps, Hkv, D, pages, layout, first_page=args.first_page)
        meta = AttentionMetadata(slot_mapping=None, block_tables=bt, seq_lens=lens,
                                 query_start_loc=torch.arange(B + 1, dtype=torch.int32, device="cuda"),
                                 seq_lens_host=[ctx] * B, query_start_host=list(range(B + 1)), page_size=ps)
        ref = paged_attention_ref(q0.float(), caches[0][0].float(), caches[0][1].float(), meta, scale)
        for cfg in args.configs:
            outs = [torch.empty_like(q0) for _ in range(L)]
            if cfg.startswith("gluon="):   # the Gluon kernel at its own tile, one split; "nomath": copies only
                bn, st, *flags = cfg[6:].split(",")
                gkw = dict(num_splits=1, block_n=int(bn), stages=int(st), math="nomath" not in flags,
                           form="warp_scores" if "ws" in flags else "keys" if "keys" in flags else "heads")

                def attend(q, kc, vc, out=None, gkw=gkw):
                    out = torch.empty_like(q) if out is None else out
                    decode_split(q, kc, vc, bt, lens, scale * LOG2E, out, out, out,
                                 pdl=min(pdl_for(q, late=("attn",)), 2), **gkw)
                    return out
            else:
                ns, bn, w, st = (1, 0, 0, 0) if cfg == "gluon" else (int(x) for x in cfg.split(","))
                kw = dict(gluon=True) if cfg == "gluon" else dict(block_n=bn, num_warps=w, num_stages=st)

                def attend(q, kc, vc, out=None, ns=ns, kw=kw):
                    return paged_decode_attention(q, kc, vc, bt, lens, scale, None, ns, out=out, **kw)

            def chain(attend=attend, outs=outs):
                q = q0
                for (kc, vc), o in zip(caches, outs):
                    q = attend(q, kc, vc, out=o)
            try:
                out0 = attend(q0, *caches[0])
                err = (out0.float() - ref).abs().max()
                if args.probe:
                    profiled_once(lambda: attend(q0, *caches[0]))
                    print(f"  probed ours {layout} {pages} {cfg}")
                    continue
                report(f"ours {layout} {pages} {cfg}", graph_us(chain, L, args.replays, args.repeats),
                       layout=layout, pages=pages, config=cfg, max_err=err.item(), first_page=args.first_page)
                held(chain)
            except Exception as e:       # e.g. out of shared memory: report, go on
                print(f"  ours {pages} {cfg}: {type(e).__name__}: {e}"[:200])
        if pages == args.pages[0] and layout == args.layout[0]:
            sums = torch.empty(max(args.read_grid) * sms, dtype=torch.float32, device="cuda")
            for per_sm, st, blk, pre in itertools.product(args.read_grid, args.read_stages, args.read_block,
                                                          args.read_pre):
                def reads(per_sm=per_sm, st=st, blk=blk, pre=pre, caches=caches):
                    for kc, vc in caches:
                        read_bytes(kc, vc, sums, per_sm * sms, st, block=blk, pre=pre)
                if args.probe:
                    reads(caches=caches[:1])
                    profiled_once(lambda: reads(caches=caches[:1]))
                    print(f"  probed read {per_sm}/SM {st} stages {blk} a block")
                    continue
                try:
                    report(f"read {per_sm} programs/SM, {st} stages, {blk} a block, {pre} before the wait",
                           graph_us(reads, L, args.replays, args.repeats), programs=per_sm * sms, stages=st,
                           block=blk, pre=pre)
                    held(reads)
                except ValueError as e:       # more blocks before the wait than a program reads
                    print(f"  read {per_sm}/SM pre={pre}: {e}")
        caches.clear()                  # free this page order's caches before the next
        torch.cuda.empty_cache()

    if args.sdpa and not args.probe:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        dense = [tuple(torch.randn(B, Hkv, ctx, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                 for _ in range(L)]
        q4 = q0.unsqueeze(2)

        def sdpa_chain():
            q = q4
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                for kc, vc in dense:
                    q = torch.nn.functional.scaled_dot_product_attention(q, kc, vc, scale=scale, enable_gqa=True)
        try:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = torch.nn.functional.scaled_dot_product_attention(q4, *dense[0], scale=scale, enable_gqa=True)
            kr = dense[0][0].float().repeat_interleave(Hq // Hkv, 1)
            vr = dense[0][1].float().repeat_interleave(Hq // Hkv, 1)
            r = torch.softmax(q4.float() @ kr.transpose(-1, -2) * scale, -1) @ vr
            report("sdpa cudnn dense", graph_us(sdpa_chain, L, args.replays, args.repeats),
                   max_err=(o.float() - r).abs().max().item())
            held(sdpa_chain)
        except Exception as e:
            print(f"  sdpa cudnn: {type(e).__name__}: {e}"[:300])
    write_json(dict(batch=B, context=ctx, layers=L, page_size=ps, kv_bytes_per_layer=kv_bytes, copy_GBps=copy,
                    pdl=pdl.enabled(),
                    rows=rows, meta=run_meta("rollout.bench.attn_ceiling", argv)), args.out)


if __name__ == "__main__":
    main()
