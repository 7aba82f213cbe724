"""What a decode megakernel could reach at P1: one warp-specialized persistent kernel over all layers
whose phases move P1's bytes. CUDA (sm_90) only; an experiment for issue 4.

    python -m rollout.bench.ws_layer --layers 32 --batch 32 --context 4352 --out bench/results/<name>.json

Per layer, seven phases behind one counter (bench.ws_mlp's design): the fused QKV GEMM (6144 x
4096), an attention-sized stream of K/V bytes (batch * context * 4 KB a layer: P1's KV at its mean
context, read once, summed; no attention math, which is light next to the bytes), o_proj (reading
a fixed attention output), add + RMSNorm, gate_up + SiLU, down, add + RMSNorm. The weight producer
streams weights and K/V through the same ring and never waits for data, so it runs into the
next phase, and the next layer, while a phase drains; the consumers wait for q (the QKV phase)
before the K/V stream, as attention must. Beside it the same bytes as launches the engine uses
(skinny_gemm at the table's configs, bench.attn_ceiling's pure read for the K/V, add_rmsnorm), all
with PDL. `--fold 1`: the norms folded into the GEMMs instead of phases of their own (the GEMM
after a norm takes 1 / rms from partial sums of squares that the GEMM before left in its epilogue
with the residual add, and norms its x tiles in registers: bench.ws_mlp.gemm_tiles), 5 phases a
layer. `--fold 2`: the same phases, the GEMM after a norm scaling its accumulator by 1 / rms once
a tile (the norm's weight taken as folded into the weight; not done here, so the values differ).
Printed: ms, TB/s, and the fraction of the 4.8 TB/s roofline those bytes would take. The gap
between the two is the most a megakernel of this design could gain on these layers; lm_head,
sampling and the attention math are outside both.
"""
from __future__ import annotations

import argparse
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mbarrier

from ..kernels import sm_count
from .__main__ import run_meta, write_json
from .ws_chain import SPIN_LIMIT, _wait_count, rings
from .ws_mlp import (BLOCK_K, BLOCK_M, BLOCK_N, EPS, _count, _norm_phase, gemm_tiles, w_mlp_tiles, w_tiles,
                     x_layout_vectors, x_tiles)

ROOFLINE_TBPS = 4.8
PHASES = 7       # QKV, K/V stream, o_proj, add + norm, gate_up, down, add + norm


@gluon.jit
def _w_producer(wqkv_ptr, wo_ptr, wgu_ptr, wd_ptr, kv_ptr, w_ring, w_full, w_empty, LAYERS, KV_CHUNKS,
                H: gl.constexpr, I: gl.constexpr, NQKV: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                SLOTS: gl.constexpr, WARPS: gl.constexpr):
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_K, BLOCK_K // 8], [WARPS, 1], [1, 0])
    r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
    rk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, ld))
    chunk = r[:, None] * BLOCK_K + rk[None, :]
    i = 0
    for layer in range(LAYERS):
        i = w_tiles(wqkv_ptr + layer.to(gl.int64) * NQKV * H, i, r, rk, w_ring, w_full, w_empty, H, NQKV // BLOCK_N,
                    0, 0, BLOCK_N, BLOCK_K, SLOTS)
        # this program's share of the layer's K/V: KV_CHUNKS contiguous tile-sized chunks
        base = kv_ptr + ((layer * gl.num_programs(0) + gl.program_id(0)) * KV_CHUNKS).to(gl.int64) * BLOCK_N * BLOCK_K
        for c in range(KV_CHUNKS):
            s = i % SLOTS
            mbarrier.wait(w_empty.index(s), ((i // SLOTS) & 1) ^ 1)
            async_copy.async_copy_global_to_shared(w_ring.index(s), base + c * BLOCK_N * BLOCK_K + chunk)
            async_copy.mbarrier_arrive(w_full.index(s), increment_count=False)
            i += 1
        i = w_mlp_tiles(wo_ptr, wgu_ptr, wd_ptr, layer, i, r, rk, w_ring, w_full, w_empty, H, I, BLOCK_N, BLOCK_K,
                        SLOTS)


@gluon.jit
def _x_producer(x_ptr, attn_ptr, h_ptr, a_ptr, res_ptr, x_ring, x_full, x_empty, cnt_ptr, err_ptr, M, LAYERS,
                H: gl.constexpr, I: gl.constexpr, NQKV: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                BLOCK_K: gl.constexpr, SLOTS: gl.constexpr, SPIN: gl.constexpr, FOLD: gl.constexpr):
    # each GEMM's input is ready once every program counted the phases before it (PH a layer: QKV, K/V,
    # o_proj, [norm], gate_up, down, [norm]); FOLD: QKV reads the residual, gate_up h, each normed by its consumer
    PH: gl.constexpr = 5 if FOLD else 7
    rm, rk, ok = x_layout_vectors(M, BLOCK_M, BLOCK_K, 1)
    i = 0
    for layer in range(LAYERS):
        i = x_tiles((res_ptr if FOLD else x_ptr) + layer * M * H, PH * layer, i, rm, rk, ok, x_ring, x_full, x_empty,
                    cnt_ptr, err_ptr, H, NQKV // BLOCK_N, BLOCK_K, SLOTS, SPIN)
        i = x_tiles(attn_ptr, PH * layer + 2, i, rm, rk, ok, x_ring, x_full, x_empty, cnt_ptr, err_ptr, H,
                    H // BLOCK_N, BLOCK_K, SLOTS, SPIN)
        i = x_tiles(h_ptr + layer * M * H, PH * layer + (3 if FOLD else 4), i, rm, rk, ok, x_ring, x_full, x_empty,
                    cnt_ptr, err_ptr, H, 2 * I // BLOCK_N, BLOCK_K, SLOTS, SPIN)
        i = x_tiles(a_ptr + layer * M * I, PH * layer + (4 if FOLD else 5), i, rm, rk, ok, x_ring, x_full, x_empty,
                    cnt_ptr, err_ptr, I, H // BLOCK_N, BLOCK_K, SLOTS, SPIN)


@gluon.jit
def _kv_phase(i, n, done, w_ring, w_full, w_empty, sink_ptr, cnt_ptr, err_ptr, last, BLOCK_N: gl.constexpr,
              BLOCK_K: gl.constexpr, W_SLOTS: gl.constexpr, SPIN: gl.constexpr, num_warps: gl.constexpr):
    """Once q exists (all programs counted `done` phases), sum this program's n K/V chunks from the
    ring (what attention reads; its math left out) into sink[program]."""
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_K, BLOCK_K // 8], [num_warps, 1], [1, 0])
    _wait_count(cnt_ptr, done * gl.num_programs(0), err_ptr, SPIN)
    gl.thread_barrier()
    acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, lay)
    for c in range(n):
        s = i % W_SLOTS
        mbarrier.wait(w_full.index(s), (i // W_SLOTS) & 1)
        acc += w_ring.index(s).load(lay).to(gl.float32)
        mbarrier.arrive(w_empty.index(s))
        i += 1
    gl.atomic_add(sink_ptr + gl.program_id(0), gl.sum(gl.sum(acc, 1), 0))
    _count(cnt_ptr, last)
    return i


@gluon.jit
def _consumer(x_ptr, qkv_ptr, h_ptr, a_ptr, o_ptr, d_ptr, res_ptr, ss_ptr, nin_ptr, n1_ptr, n2_ptr, sink_ptr, eps,
              w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty, cnt_ptr, err_ptr, M, LAYERS, KV_CHUNKS,
              H: gl.constexpr, I: gl.constexpr, NQKV: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_K: gl.constexpr, W_SLOTS: gl.constexpr, X_SLOTS: gl.constexpr, SPIN: gl.constexpr,
              FOLD: gl.constexpr, num_warps: gl.constexpr):
    out: gl.constexpr = gl.BlockedLayout([8, 1], [4, 8], [num_warps // 4, 4], [0, 1])
    om = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, out))
    PH: gl.constexpr = 5 if FOLD else 7
    SS: gl.constexpr = H // BLOCK_N * BLOCK_M            # one set of partial sums of squares
    last = PH * LAYERS * gl.num_programs(0) - 1
    i = 0       # weight ring uses (weights and K/V)
    j = 0       # x ring uses
    for layer in range(LAYERS):
        hl, rl, rn = h_ptr + layer * M * H, res_ptr + layer * M * H, res_ptr + (layer + 1) * M * H
        # QKV of x[l] (FOLD: of rmsnorm(res[l]) * nin[l], from the sums the down phase left)
        i, j = gemm_tiles(qkv_ptr + layer * M * NQKV, i, j, om, w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty,
                          M, H, NQKV // BLOCK_N, 0, NQKV, BLOCK_N, BLOCK_M, BLOCK_K, W_SLOTS, X_SLOTS, num_warps,
                          ss_ptr + 2 * layer * SS, nin_ptr + layer * H, rl, rl, eps, NORM_IN=FOLD == 1,
                          SCALE_IN=FOLD == 2)
        _count(cnt_ptr, last)
        i = _kv_phase(i, KV_CHUNKS, PH * layer + 1, w_ring, w_full, w_empty, sink_ptr, cnt_ptr, err_ptr, last, BLOCK_N,
                      BLOCK_K, W_SLOTS, SPIN, num_warps)
        # o_proj of attn: FOLD h = res[l] + it, with its sums of squares; else o, then a norm phase
        i, j = gemm_tiles(hl if FOLD else o_ptr + layer * M * H, i, j, om, w_ring, x_ring, acc_s, w_full, w_empty,
                          x_full, x_empty, M, H, H // BLOCK_N, 0, H, BLOCK_N, BLOCK_M, BLOCK_K, W_SLOTS, X_SLOTS,
                          num_warps, ss_ptr, nin_ptr, rl, ss_ptr + (2 * layer + 1) * SS, eps, RES_OUT=FOLD > 0)
        _count(cnt_ptr, last)
        if not FOLD:
            _norm_phase(rl, o_ptr + layer * M * H, n1_ptr + layer * H, rn, hl, PH * layer + 3, eps, M, cnt_ptr,
                        err_ptr, last, H, SPIN, num_warps)
        i, j = gemm_tiles(a_ptr + layer * M * I, i, j, om, w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty, M,
                          H, 2 * I // BLOCK_N, I, I, BLOCK_N, BLOCK_M, BLOCK_K, W_SLOTS, X_SLOTS, num_warps,
                          ss_ptr + (2 * layer + 1) * SS, n1_ptr + layer * H, rl, rl, eps, NORM_IN=FOLD == 1,
                          SCALE_IN=FOLD == 2)
        _count(cnt_ptr, last)
        # down of a: FOLD res[l + 1] = h + it, with its sums of squares for the next QKV; else d, then a norm phase
        i, j = gemm_tiles(rn if FOLD else d_ptr + layer * M * H, i, j, om, w_ring, x_ring, acc_s, w_full, w_empty,
                          x_full, x_empty, M, I, H // BLOCK_N, 0, H, BLOCK_N, BLOCK_M, BLOCK_K, W_SLOTS, X_SLOTS,
                          num_warps, ss_ptr, nin_ptr, hl, ss_ptr + (2 * layer + 2) * SS, eps, RES_OUT=FOLD > 0)
        _count(cnt_ptr, last)
        if not FOLD:
            _norm_phase(rn, d_ptr + layer * M * H, n2_ptr + layer * H, rn, x_ptr + (layer + 1) * M * H,
                        PH * layer + 6, eps, M, cnt_ptr, err_ptr, last, H, SPIN, num_warps)


@gluon.jit
def _ws_layer_kernel(x_ptr, qkv_ptr, attn_ptr, h_ptr, a_ptr, o_ptr, d_ptr, res_ptr, ss_ptr, nin_ptr, n1_ptr, n2_ptr,
                     sink_ptr, eps, wqkv_ptr, wo_ptr, wgu_ptr, wd_ptr, kv_ptr, cnt_ptr, err_ptr, M, LAYERS, KV_CHUNKS,
                     H: gl.constexpr, I: gl.constexpr, NQKV: gl.constexpr, BLOCK_N: gl.constexpr,
                     BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, W_SLOTS: gl.constexpr, X_SLOTS: gl.constexpr,
                     SPIN: gl.constexpr, W_WARPS: gl.constexpr, FOLD: gl.constexpr, num_warps: gl.constexpr):
    w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty = rings(W_SLOTS, X_SLOTS, BLOCK_N, BLOCK_M, BLOCK_K,
                                                                    W_WARPS, 1)
    gl.warp_specialize([
        (_consumer, (x_ptr, qkv_ptr, h_ptr, a_ptr, o_ptr, d_ptr, res_ptr, ss_ptr, nin_ptr, n1_ptr, n2_ptr, sink_ptr,
                     eps, w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty, cnt_ptr, err_ptr, M, LAYERS,
                     KV_CHUNKS, H, I, NQKV, BLOCK_N, BLOCK_M, BLOCK_K, W_SLOTS, X_SLOTS, SPIN, FOLD, num_warps)),
        (_w_producer, (wqkv_ptr, wo_ptr, wgu_ptr, wd_ptr, kv_ptr, w_ring, w_full, w_empty, LAYERS, KV_CHUNKS, H, I,
                       NQKV, BLOCK_N, BLOCK_K, W_SLOTS, W_WARPS)),
        (_x_producer, (x_ptr, attn_ptr, h_ptr, a_ptr, res_ptr, x_ring, x_full, x_empty, cnt_ptr, err_ptr, M, LAYERS, H,
                       I, NQKV, BLOCK_N, BLOCK_M, BLOCK_K, X_SLOTS, SPIN, FOLD)),
    ], [W_WARPS, 1], [48, 48])


def ws_layers(b: dict, w: dict, cnt, err, w_slots: int = 6, x_slots: int = 4, w_warps: int = 4,
              fold: int = 0) -> None:
    """All layers of buffers b (x, qkv, attn, h, a, o, d, res, ss, sink) and weights w (wqkv, wo,
    wgu, wd, kv, n1, n2, nin) in one launch of H / 32 programs (all resident at once). fold 1 / 2:
    the norms folded into the GEMMs, x normed in registers / the accumulator scaled
    (bench.ws_mlp.gemm_tiles; nin[l] the norm before layer l's QKV, ss[0] the sums of squares of
    res[0]) instead of phases of their own; res is then the output."""
    L, H = w["wo"].shape[0], w["wo"].shape[1]
    I, NQKV, M = w["wd"].shape[2], w["wqkv"].shape[1], b["x"].shape[1]
    programs = H // BLOCK_N
    chunk = BLOCK_N * BLOCK_K
    assert w["kv"].numel() % (L * programs * chunk) == 0 and M <= BLOCK_M and NQKV % BLOCK_N == 0
    assert programs <= sm_count(b["x"].device)
    assert all(t.is_contiguous() for t in list(b.values()) + list(w.values()))
    kv_chunks = w["kv"].numel() // (L * programs * chunk)
    _ws_layer_kernel[(programs,)](b["x"], b["qkv"], b["attn"], b["h"], b["a"], b["o"], b["d"], b["res"], b["ss"],
                                  w["nin"], w["n1"], w["n2"], b["sink"], EPS, w["wqkv"], w["wo"], w["wgu"], w["wd"],
                                  w["kv"], cnt, err, M, L, kv_chunks, H=H, I=I, NQKV=NQKV, BLOCK_N=BLOCK_N,
                                  BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, W_SLOTS=w_slots, X_SLOTS=x_slots, SPIN=SPIN_LIMIT,
                                  W_WARPS=w_warps, FOLD=fold, num_warps=4)


def launches(b: dict, w: dict, read_programs: int) -> None:
    """The same bytes as the engine's kernels: skinny_gemm at the table's configs (cuBLAS where it
    has none), bench.attn_ceiling's pure read for each layer's K/V, add_rmsnorm; PDL between them."""
    from ..kernels.fused_ops import add_rmsnorm
    from ..kernels.skinny_gemm import pick_config, skinny_gemm
    from .attn_ceiling import read_bytes
    L, M = w["wo"].shape[0], b["x"].shape[1]
    kv = w["kv"].view(L, 2, -1)

    def gemm(x, wt, out, silu=False):
        cfg = pick_config(wt.shape[0], wt.shape[1], M)
        if cfg is None:
            out.copy_(torch.nn.functional.linear(x, wt))      # a shape the table leaves to cuBLAS
            return out
        return skinny_gemm(x, wt, *cfg, out=out, silu_mul=silu)
    for i in range(L):
        gemm(b["x"][i], w["wqkv"][i], b["qkv"][i])
        read_bytes(kv[i, 0], kv[i, 1], b["sink"], read_programs, 4)
        o = gemm(b["attn"], w["wo"][i], b["o"][i])
        add_rmsnorm(b["res"][i], w["n1"][i], EPS, delta=o, out=(b["h"][i], b["res"][i + 1]))
        gemm(b["h"][i], w["wgu"][i], b["a"][i], silu=True)
        d = gemm(b["a"][i], w["wd"][i], b["d"][i])
        add_rmsnorm(b["res"][i + 1], w["n2"][i], EPS, delta=d, out=(b["x"][i + 1], b["res"][i + 1]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=4352, help="tokens of K/V a sequence reads (P1's mean: 4352)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--qkv", type=int, default=6144, help="fused QKV rows (32 + 2 x 8 heads of 128)")
    ap.add_argument("--kv-bytes-per-token", type=int, default=4096,
                    help="a layer's K and V of one token (8 heads x 128 x 2 x 2 bytes)")
    ap.add_argument("--slots", nargs="+", default=["6,4,4", "8,4,4"], help="W_SLOTS,X_SLOTS,W_WARPS")
    ap.add_argument("--fold", type=int, nargs="+", default=[0, 1, 2], choices=[0, 1, 2],
                    help="0: norm phases; the norms folded into the GEMMs (no norm phases), x normed in registers "
                         "(1) or the accumulator scaled by 1 / rms (2)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("ws_layer: CUDA only", file=sys.stderr)
        return 1
    from ..kernels import pdl
    from ..kernels.fused_ops import add_rmsnorm
    from .gemm import graph_time_us
    L, M, H, I, NQKV = args.layers, args.batch, args.hidden, args.intermediate, args.qkv
    programs = H // BLOCK_N
    kv_per_layer = M * args.context * args.kv_bytes_per_token // 2          # bf16 elements
    unit = programs * BLOCK_N * BLOCK_K
    kv_per_layer = -(-kv_per_layer // unit) * unit                           # whole chunks per program
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) * scale
    w = dict(wqkv=rnd(L, NQKV, H, scale=H ** -0.5), wo=rnd(L, H, H, scale=H ** -0.5),
             wgu=rnd(L, 2 * I, H, scale=H ** -0.5), wd=rnd(L, H, I, scale=I ** -0.5),
             n0=1 + rnd(H, scale=0.1), n1=1 + rnd(L, H, scale=0.1), n2=1 + rnd(L, H, scale=0.1),
             kv=torch.empty(L * kv_per_layer, device="cuda", dtype=torch.bfloat16).normal_(generator=g))
    w["nin"] = torch.cat([w["n0"][None], w["n2"][:-1]])      # fold: the norm before each QKV
    nbytes = sum(t.numel() * 2 for k, t in w.items() if k in ("wqkv", "wo", "wgu", "wd", "kv"))

    attn0, res0 = rnd(M, H), rnd(M, H)           # the same inputs in every run

    def buffers():
        z = lambda *s: torch.zeros(*s, device="cuda", dtype=torch.bfloat16)  # noqa: E731
        b = dict(x=z(L + 1, M, H), qkv=z(L, M, NQKV), attn=attn0.clone(), h=z(L, M, H), a=z(L, M, I), o=z(L, M, H),
                 d=z(L, M, H), res=z(L + 1, M, H), sink=torch.zeros(4 * 132 * 4, device="cuda"),
                 ss=torch.zeros(2 * L + 1, programs, BLOCK_M, device="cuda"))
        b["res"][0] = res0
        b["x"][0] = add_rmsnorm(b["res"][0], w["n0"], EPS)[0]           # the first QKV's input, either way
        b["ss"][0, :, :M] = b["res"][0].float().view(M, programs, BLOCK_N).pow(2).sum(-1).T
        return b
    cnt = torch.zeros(1, dtype=torch.int32, device="cuda")
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    sms = sm_count(w["wo"].device)
    pdl.set_enabled(True)
    rows = []
    print(f"{torch.cuda.get_device_name()}: {L} layers, batch {M}, context {args.context}: {nbytes / 1e9:.2f} GB "
          f"(K/V {L * kv_per_layer * 2 / 1e9:.2f} GB), {nbytes / ROOFLINE_TBPS / 1e9:.3f} ms at "
          f"{ROOFLINE_TBPS} TB/s", flush=True)

    def timed(name, fn, **kw):
        ms = graph_time_us(lambda i: fn(), 1) / 1e3
        row = dict(way=name, ms=ms, TBps=nbytes / ms / 1e9, fraction_of_roofline=nbytes / ROOFLINE_TBPS / 1e9 / ms,
                   **kw)
        print(f"{name:24s} {ms:.3f} ms {row['TBps']:.2f} TB/s {100 * row['fraction_of_roofline']:5.1f}% of "
              f"{ROOFLINE_TBPS} TB/s" + "".join(f"  {k} {v}" for k, v in kw.items()), flush=True)
        rows.append(row)
    ref = buffers()
    launches(ref, w, 4 * sms)
    timed("launches", lambda: launches(ref, w, 4 * sms))
    for fold in args.fold:
        key = "res" if fold else "x"        # the fold keeps no normed x; the launches have both
        for sl in args.slots:
            ws_, xs_, ww_ = (int(v) for v in sl.split(","))
            name = f"ws {sl}" + ("", " folded norms", " norms as 1/rms scale")[fold]
            out = buffers()
            try:
                ws_layers(out, w, cnt, err, w_slots=ws_, x_slots=xs_, w_warps=ww_, fold=fold)
                torch.cuda.synchronize()
            except Exception as e:
                print(f"{name}: failed: {type(e).__name__}: {e}"[:400], flush=True)
                rows.append(dict(way=name, error=f"{type(e).__name__}: {e}"[:300]))
                continue
            # The GEMMs have skinny_gemm's (32, 256) tiles here and the table's there, and the norms'
            # sums run in another order: the outputs agree to bf16 rounding, not bit for bit.
            diff = (out[key][L].float() - ref[key][L].float()).abs()
            timed(name, lambda: ws_layers(out, w, cnt, err, w_slots=ws_, x_slots=xs_, w_warps=ww_, fold=fold),
                  last_layer_max_abs_diff=float(diff.max()),
                  last_layer_mean_abs=float(ref[key][L].float().abs().mean()),
                  wait_timeouts=int(err.item()), counter_after=int(cnt.item()))
    timed("launches", lambda: launches(ref, w, 4 * sms))
    write_json(dict(layers=L, batch=M, context=args.context, bytes=nbytes, rows=rows,
                    meta=run_meta("rollout.bench.ws_layer", argv)), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
