"""The decode megakernel (kernels/decode_layers.py) alone, under its knobs, on random weights and
a random paged KV cache. CUDA (sm_90) only.

    python -m rollout.bench.decode_layers --layers 32 --batch 32 --context 4352 --variants 1,6,4 2,6,4 0,6,4

A variant is ATTN,W_SLOTS,X_SLOTS[,PAGED]: _attn_phase's mode (1: a key tile an iteration; 2: two,
one cross-warp max for both; 0: the K / V tiles consumed with no math, a timing bound with wrong
output), the two rings' slots, and PAGED 0 for keys read as one contiguous run per (sequence, KV
head) instead of through the block table (a timing bound, wrong output; bench.ws_layer's K / V).
Printed per variant: ms a call (CUDA graph replays, median), the bytes it must read (weights and
the K / V at --context) in TB/s, and that as a fraction of the 4.8 TB/s roofline; the counter and
timed-out waits after. The step's lm_head and sampling are outside it.
"""
from __future__ import annotations

import argparse
import sys

import torch

from .__main__ import run_meta, write_json

ROOFLINE_TBPS = 4.8


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=4352)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--kv-layout", nargs="+", default=["token"], choices=["token", "head", "slab"],
                    help="a page's rows token-major [page, Hkv, D] (the engine's) or head-major [Hkv, page, D], "
                         "or each KV head's pages in a slab of their own [Hkv, pages, page, D]")
    ap.add_argument("--pages", nargs="+", default=["random"], choices=["random", "ordered", "interleaved"],
                    help="each sequence's pages: a random order, one run (as a prefill leaves them), or "
                         "B pages apart (as sequences decoding in step take them)")
    ap.add_argument("--page-size", nargs="+", type=int, default=[16], help="tokens a KV page (the engine's: 16)")
    ap.add_argument("--first-page", nargs="+", type=int, default=[1],
                    help="the first page id the tables use (pages below it unused): 16 puts slab runs, and the "
                         "slabs, on 64 KB boundaries, as KV_PAGED 0's runs are; 1 leaves them 4 KB off")
    ap.add_argument("--variants", nargs="+", default=["1,6,4", "2,6,4", "0,6,4"], help="ATTN,W_SLOTS,X_SLOTS[,PAGED]")
    ap.add_argument("--probe", action="store_true",
                    help="no timing: each variant once more for a profiler (ncu --profile-from-start off)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_layers: CUDA only", file=sys.stderr)
        return 1
    from ..kernels.decode_layers import counters, decode_layers
    from .gemm import graph_time_us, profiled_once
    L, B, H, I, C = args.layers, args.batch, args.hidden, args.intermediate, args.context
    Hq, Hkv, D = args.heads, args.kv_heads, 128
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) * scale
    w = dict(wqkv=rnd(L, (Hq + 2 * Hkv) * D, H, scale=H ** -0.5), wo=rnd(L, H, H, scale=H ** -0.5),
             wgu=rnd(L, 2 * I, H, scale=H ** -0.5), wd=rnd(L, H, I, scale=I ** -0.5),
             n_in=1 + rnd(L + 1, H, scale=0.1), n_post=1 + rnd(L, H, scale=0.1))
    seq_lens = torch.full((B,), C, dtype=torch.int32, device="cuda")
    pos = seq_lens.long() - 1
    emb = rnd(B, H)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device="cuda").float() / D))
    nbytes = sum(w[k].numel() * 2 for k in ("wqkv", "wo", "wgu", "wd")) + L * 2 * B * C * Hkv * D * 2
    cnt, err = counters(emb.device)
    print(f"{torch.cuda.get_device_name()}: {L} layers, batch {B}, context {C}: {nbytes / 1e9:.2f} GB, "
          f"{nbytes / ROOFLINE_TBPS / 1e9:.3f} ms at {ROOFLINE_TBPS} TB/s", flush=True)
    rows = []
    kv_store, page, first_id, first_paged = None, None, None, {}
    for page_size, first, order, layout, v in [(ps, f, o, lay, v) for ps in args.page_size for f in args.first_page
                                               for o in args.pages for lay in args.kv_layout for v in args.variants]:
        if (page, first_id) != (page_size, first):
            page, first_id, kv_store = page_size, first, None      # one cache at a time: each is P1's 18 GB
            per_seq = -(-C // page)
            pages = B * per_seq + first
            kv_store = torch.empty(L, 2, pages, page * Hkv * D, device="cuda", dtype=torch.bfloat16)
            kv_store.normal_(generator=g)
            ids = torch.arange(first, pages, device="cuda")      # page 0: the trash page
            tables = dict(random=(torch.randperm(pages - first, device="cuda", generator=g) + first).view(B, per_seq),
                          ordered=ids.view(B, per_seq), interleaved=ids.view(per_seq, B).t())
        attn, ws, xs, paged = (tuple(int(x) for x in v.split(",")) + (1,))[:4]
        block_tables = tables[order].contiguous().to(torch.int32)
        slots = block_tables[torch.arange(B, device="cuda"), pos // page].long() * page + pos % page
        kv = (kv_store.view(L, 2, pages, page, Hkv, D) if layout == "token" else
              kv_store.view(L, 2, pages, Hkv, page, D).transpose(3, 4) if layout == "head" else
              kv_store.view(L, 2, Hkv, pages, page, D).permute(0, 1, 3, 4, 2, 5))

        def call():
            return decode_layers(emb, pos, inv_freq, w, kv, block_tables, seq_lens, slots, 1e-5, D ** -0.5, Hq,
                                 w_slots=ws, x_slots=xs, attn_mode=attn, kv_paged=paged)
        try:
            out = call()          # KV_PAGED 1 and 4 read the same pages: their outputs must be equal bits
            key = (page, first, order, layout, attn, ws, xs)
            if paged == 1:
                first_paged.setdefault(key, out.clone())
            same = bool(torch.equal(out, first_paged[key])) if paged in (1, 4) and key in first_paged else None
            if args.probe:
                profiled_once(call)
            ms = float("nan") if args.probe else graph_time_us(lambda i: call(), 1) / 1e3
        except Exception as e:
            print(f"{v}: failed: {type(e).__name__}: {e}"[:400], flush=True)
            rows.append(dict(variant=v, error=f"{type(e).__name__}: {e}"[:300]))
            continue
        row = dict(variant=v, page_size=page, first_page=first, pages=order, kv_layout=layout, attn_mode=attn,
                   w_slots=ws, x_slots=xs, kv_paged=paged, equal_to_paged_1=same, ms=ms,
                   TBps=nbytes / ms / 1e9,
                   fraction_of_roofline=nbytes / ROOFLINE_TBPS / 1e9 / ms, counter_after=int(cnt.item()),
                   wait_timeouts=int(err.item()))
        rows.append(row)
        print(f"page {page:3d} from {first:2d} {order:11s} {layout:5s} {v:10s} {ms:.3f} ms {row['TBps']:.2f} TB/s "
              f"{100 * row['fraction_of_roofline']:5.1f}% of roofline  counter {row['counter_after']} "
              f"timeouts {row['wait_timeouts']} bits = KV_PAGED 1: {same}", flush=True)
    write_json(dict(layers=L, batch=B, context=C, hidden=H, intermediate=I, heads=Hq, kv_heads=Hkv, bytes=nbytes,
                    rows=rows, meta=run_meta("rollout.bench.decode_layers", argv)), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
