"""The decode MLP's three GEMMs as one warp-specialized persistent kernel, against launches.
CUDA (sm_90) only; an experiment for issue 4.

    python -m rollout.bench.ws_mlp --layers 32 --m 32 --norms 0 1 2 --out bench/results/<name>.json

bench.ws_chain showed that on 32 chained o_proj GEMMs a persistent kernel whose weight producer
never waits for data runs ~1.1 us a layer boundary under PDL launches (2.7 against 3.8 us a
layer over the copy rate). This asks the same at the 8B MLP's shapes, where the boundaries are
between different weights: per layer o_proj (4096 x 4096), gate_up + SiLU (28672 x 4096, gate
and up rows paired as skinny_gemm's silu_mul) and down (4096 x 14336). Every GEMM uses 32-row
weight tiles over 256-wide K tiles, so 128 programs take 1, 7 and 1 tiles of the three phases;
per program, a weight producer streams all its tiles of every phase and layer through one
shared-memory ring; an x producer waits until all programs have finished the phase before (one
counter), then streams that phase's input; 4 consumer warps multiply (mma.sync) and store, with
skinny_gemm's SiLU epilogue in phase 2. With `--norms 1` each layer also adds o_proj's and down's
outputs to a residual and normalises after each (two more phases, a row per program, as the
decode layer does), against the launches with fused_ops.add_rmsnorm between the GEMMs. `--norms
2`: the same math with the norms folded in, no norm phases: o_proj's and down's epilogues add the
residual and leave each row's partial sum of squares; the GEMM after takes 1 / rms from them and
norms its x tiles in registers before the MMA (gemm_tiles' NORM_IN / RES_OUT).

Same tiles and K order as skinny_gemm at (32, 256, 4, 5), so without norms the output is compared
bit for bit with those launches (the norms' sums of squares are ordered differently: there the
fraction of equal elements). Also timed: launches at the engine's table configs (plain layout),
and each kernel launched once per layer. Printed: ms, GB/s, us a layer over copy.

Measured without norms (bench/results/README.md, eighteenth session): 5.7-6.6 us a layer over
copy with 4 weight producer warps against 11.6-12.1 for the table's launches; launched once per
layer 10.5. The same design as one engine launch per layer with the two norms as phases read 5.5
points slower in the decode graphs (commit e2e9352); `--norms 1` separates the norms' part, `--norms 2`
says whether folding them removes it.
"""
from __future__ import annotations

import argparse
import functools
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from ..kernels import sm_count
from ..kernels.decode_layers import count_phase as _count
from ..kernels.decode_layers import inv_rms, ring_operands
from ..kernels.decode_layers import SILU, w_tiles, x_tiles
from .__main__ import run_meta, write_json
from .ws_chain import SPIN_LIMIT, _wait_count, rings, time_row

BLOCK_N, BLOCK_K, BLOCK_M = 32, 256, 32
EPS = 1e-5


@gluon.jit
def _w_producer(wo_ptr, wgu_ptr, wd_ptr, w_ring, w_full, w_empty, LAYERS, H: gl.constexpr, I: gl.constexpr,
                BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, SLOTS: gl.constexpr, WARPS: gl.constexpr):
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_K, BLOCK_K // 8], [WARPS, 1], [1, 0])
    r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
    rk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, ld))
    i = 0
    for layer in range(LAYERS):
        i = w_mlp_tiles(wo_ptr, wgu_ptr, wd_ptr, layer, i, r, rk, w_ring, w_full, w_empty, H, I, BLOCK_N, BLOCK_K,
                        SLOTS)


@gluon.jit
def w_mlp_tiles(wo_ptr, wgu_ptr, wd_ptr, layer, i, r, rk, w_ring, w_full, w_empty, H: gl.constexpr, I: gl.constexpr,
                BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, SLOTS: gl.constexpr):
    """w_tiles of one layer's o_proj [L, H, H], gate_up [L, 2I, H] and down [L, H, I], in order."""
    i = w_tiles(wo_ptr + layer.to(gl.int64) * H * H, i, r, rk, w_ring, w_full, w_empty, H, H // BLOCK_N, 0, 0,
                BLOCK_N, BLOCK_K, SLOTS)
    i = w_tiles(wgu_ptr + layer.to(gl.int64) * 2 * I * H, i, r, rk, w_ring, w_full, w_empty, H,
                2 * I // BLOCK_N, SILU, I, BLOCK_N, BLOCK_K, SLOTS)
    return w_tiles(wd_ptr + layer.to(gl.int64) * H * I, i, r, rk, w_ring, w_full, w_empty, I, H // BLOCK_N, 0, 0,
                   BLOCK_N, BLOCK_K, SLOTS)


@gluon.jit
def x_layout_vectors(M, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, WARPS: gl.constexpr):
    """(rows, K offsets, row mask) of an x tile in the x producer's copy layout."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_K, BLOCK_K // 8], [WARPS, 1], [1, 0])
    rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
    rk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, ld))
    return rm, rk, (rm[:, None] < M) & (rk[None, :] < BLOCK_K)


@gluon.jit
def _x_producer(x_ptr, h_ptr, a_ptr, res_ptr, x_ring, x_full, x_empty, cnt_ptr, err_ptr, M, LAYERS, H: gl.constexpr,
                I: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
                SLOTS: gl.constexpr, SPIN: gl.constexpr, WARPS: gl.constexpr, NORMS: gl.constexpr):
    rm, rk, ok = x_layout_vectors(M, BLOCK_M, BLOCK_K, WARPS)
    # phases a layer: o_proj, [add + norm], gate_up, down, [add + norm] (NORMS 1); a GEMM's input is
    # ready once every program has counted the phases before it. NORMS 2: o_proj reads the residual
    # and gate_up the residual after o_proj (h), each normed by its consumer
    PH: gl.constexpr = 5 if NORMS == 1 else 3
    i = 0
    for layer in range(LAYERS):
        i = x_tiles((res_ptr if NORMS == 2 else x_ptr) + layer * M * H, PH * layer, i, rm, rk, ok, x_ring, x_full,
                    x_empty, cnt_ptr, err_ptr, H, H // BLOCK_N, BLOCK_K, SLOTS, SPIN)
        i = x_tiles(h_ptr + layer * M * H, PH * layer + (2 if NORMS == 1 else 1), i, rm, rk, ok, x_ring, x_full,
                    x_empty, cnt_ptr, err_ptr, H, 2 * I // BLOCK_N, BLOCK_K, SLOTS, SPIN)
        i = x_tiles(a_ptr + layer * M * I, PH * layer + (3 if NORMS == 1 else 2), i, rm, rk, ok, x_ring, x_full,
                    x_empty, cnt_ptr, err_ptr, I, H // BLOCK_N, BLOCK_K, SLOTS, SPIN)


@gluon.jit
def gemm_tiles(dst, i, j, om, w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty, M, K: gl.constexpr,
               TILES: gl.constexpr, SILU_I: gl.constexpr, S_DST: gl.constexpr, BLOCK_N: gl.constexpr,
               BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, W_SLOTS: gl.constexpr, X_SLOTS: gl.constexpr,
               num_warps: gl.constexpr, ss_in, nw, res_in, ss_out, eps, NORM_IN: gl.constexpr = False,
               RES_OUT: gl.constexpr = False, SCALE_IN: gl.constexpr = False):
    """The consumers' GEMM phase: dst[:, tile] (row stride S_DST) = x @ w[tile rows].T for this
    program's tiles, from the two rings (skinny_gemm's mma.sync layout, warps 2 x 2), rounded once;
    i, j: the weight and x rings' use counts so far (returned advanced; they differ where the
    weight ring also carries other bytes, bench.ws_layer's K/V);
    with SILU_I the tile's silu(gate) * up (BLOCK_N / 2 columns, fused_ops.silu_times' rounding).
    ss_in, nw, res_in, ss_out, eps: the RMSNorms folded in (no norm phase; unused without the flags):
    NORM_IN: x is an un-normed residual; 1 / rms of each row from the K / BLOCK_N partial sums of
    squares in ss_in [K / BLOCK_N, BLOCK_M] (fp32), and each x tile normed in registers before the
    MMA, rounded as fused_ops.add_rmsnorm (x * 1/rms to bf16, times the weight nw to bf16).
    RES_OUT: the tile stored is res_in + the GEMM's bf16 output (res_in [M, S_DST]), and its rows'
    sums of squares over the tile's columns go to ss_out[tile].
    SCALE_IN: as NORM_IN, but the accumulator is scaled by 1 / rms once a tile instead of x normed
    once a K tile, with the norm's weight taken as folded into w ((x / rms * n) @ W.T equals
    (x @ (W * n).T) / rms; other rounding than HF's). The benches do not fold n into W: same bytes,
    not the same values."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps // 2, 2],
                                                  instr_shape=[16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    out: gl.constexpr = gl.BlockedLayout([8, 1], [4, 8], [num_warps // 4, 4], [0, 1])
    if NORM_IN:       # 1 / rms in the MMA's x-operand layout
        inv = inv_rms(ss_in, j, x_full, eps, gl.SliceLayout(0, b_op), K, BLOCK_N, BLOCK_M, X_SLOTS, num_warps)
        kk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, b_op))
    elif SCALE_IN:    # in the accumulator's
        inv = inv_rms(ss_in, j, x_full, eps, gl.SliceLayout(0, mma), K, BLOCK_N, BLOCK_M, X_SLOTS, num_warps)
    for t in range(gl.program_id(0), TILES, gl.num_programs(0)):
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
        for kt in range(K // BLOCK_K):
            a, b = ring_operands(w_ring, x_ring, w_full, w_empty, x_full, x_empty, i, j, a_op, b_op, W_SLOTS, X_SLOTS)
            if NORM_IN:
                w = gl.load(nw + kt * BLOCK_K + kk).to(gl.float32)
                b = ((b.to(gl.float32) * inv[None, :]).to(gl.bfloat16).to(gl.float32) * w[:, None]).to(gl.bfloat16)
            acc = mma_v2(a, b, acc)
            i += 1
            j += 1
        if SCALE_IN:
            acc = acc * inv[None, :]
        if SILU_I:       # the gate and up halves of acc through shared memory
            acc_s.store(acc)
            g = acc_s.slice(0, BLOCK_N // 2).load(out).to(gl.bfloat16).to(gl.float32)
            u = acc_s.slice(BLOCK_N // 2, BLOCK_N // 2).load(out).to(gl.bfloat16).to(gl.float32)
            y = ((g / (1.0 + gl.exp(-g))).to(gl.bfloat16).to(gl.float32) * u).to(gl.bfloat16)
            on = t * (BLOCK_N // 2) + gl.arange(0, BLOCK_N // 2, layout=gl.SliceLayout(1, out))
        else:
            y = gl.convert_layout(acc, out).to(gl.bfloat16)
            on = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out))
        m_ok = om[None, :] < M
        if RES_OUT:      # the residual add of fused_ops.add_rmsnorm, and this tile's share of the next norm's sum
            r = gl.load(res_in + om[None, :] * S_DST + on[:, None], mask=m_ok, other=0.0, cache_modifier=".cg")
            y = (r.to(gl.float32) + y.to(gl.float32)).to(gl.bfloat16)
            yf = y.to(gl.float32)
            gl.store(ss_out + t * BLOCK_M + om, gl.sum(yf * yf, axis=0))
        gl.store(dst + om[None, :] * S_DST + on[:, None], y, mask=m_ok)
    return i, j


@gluon.jit
def _add_norm_row(res_ptr, d_ptr, w_ptr, res_out_ptr, out_ptr, row, eps, H: gl.constexpr, num_warps: gl.constexpr):
    """r = res[row] + d[row] rounded, stored to res_out[row]; out[row] = rmsnorm(r) * w, rounded as
    fused_ops.add_rmsnorm rounds (its sum of squares in another fp32 order). d from L2."""
    lay: gl.constexpr = gl.BlockedLayout([H // (32 * num_warps)], [32], [num_warps], [0])
    cols = gl.arange(0, H, layout=lay)
    off = row * H + cols
    x = gl.load(res_ptr + off, cache_modifier=".cg")
    d = gl.load(d_ptr + off, cache_modifier=".cg")
    x = (x.to(gl.float32) + d.to(gl.float32)).to(gl.bfloat16)
    gl.store(res_out_ptr + off, x)
    xf = x.to(gl.float32)
    inv = 1.0 / gl.sqrt_rn(gl.sum(xf * xf, axis=0) / H + eps)
    y = (xf * inv).to(gl.bfloat16)
    w = gl.load(w_ptr + cols)
    gl.store(out_ptr + off, (w.to(gl.float32) * y.to(gl.float32)).to(gl.bfloat16))


@gluon.jit
def _norm_phase(res_ptr, d_ptr, w_ptr, res_out_ptr, out_ptr, done, eps, M, cnt_ptr, err_ptr, last, H: gl.constexpr,
                SPIN: gl.constexpr, num_warps: gl.constexpr):
    """Once all programs have counted `done` phases, program r < M adds and normalises row r."""
    _wait_count(cnt_ptr, done * gl.num_programs(0), err_ptr, SPIN)
    gl.thread_barrier()
    if gl.program_id(0) < M:
        _add_norm_row(res_ptr, d_ptr, w_ptr, res_out_ptr, out_ptr, gl.program_id(0), eps, H, num_warps)
    _count(cnt_ptr, last)


@gluon.jit
def _consumer(x_ptr, h_ptr, a_ptr, o_ptr, d_ptr, res_ptr, ss_ptr, nin_ptr, n1_ptr, n2_ptr, eps, w_ring, x_ring, acc_s,
              w_full, w_empty, x_full, x_empty, cnt_ptr, err_ptr, M, LAYERS, H: gl.constexpr, I: gl.constexpr,
              BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, W_SLOTS: gl.constexpr,
              X_SLOTS: gl.constexpr, SPIN: gl.constexpr, NORMS: gl.constexpr, num_warps: gl.constexpr):
    out: gl.constexpr = gl.BlockedLayout([8, 1], [4, 8], [num_warps // 4, 4], [0, 1])
    om = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, out))
    PH: gl.constexpr = 5 if NORMS == 1 else 3
    SS: gl.constexpr = H // BLOCK_N * BLOCK_M            # one set of partial sums of squares
    FOLD: gl.constexpr = NORMS == 2
    last = PH * LAYERS * gl.num_programs(0) - 1
    i = 0
    j = 0
    for layer in range(LAYERS):
        hl, rl, rn = h_ptr + layer * M * H, res_ptr + layer * M * H, res_ptr + (layer + 1) * M * H
        # o_proj: of x[l] to h (NORMS 1: to o, then res[l + 1] = res[l] + o, h = norm1 in a phase; NORMS 2: of
        # norm(res[l]) * nin[l], h = res[l] + it, with its partial sums of squares)
        i, j = gemm_tiles(o_ptr + layer * M * H if NORMS == 1 else hl, i, j, om, w_ring, x_ring, acc_s, w_full,
                          w_empty, x_full, x_empty, M, H, H // BLOCK_N, 0, H, BLOCK_N, BLOCK_M, BLOCK_K, W_SLOTS,
                          X_SLOTS, num_warps, ss_ptr + 2 * layer * SS, nin_ptr + layer * H, rl,
                          ss_ptr + (2 * layer + 1) * SS, eps, NORM_IN=FOLD, RES_OUT=FOLD)
        _count(cnt_ptr, last)
        if NORMS == 1:
            _norm_phase(rl, o_ptr + layer * M * H, n1_ptr + layer * H, rn, hl, PH * layer + 1, eps, M, cnt_ptr,
                        err_ptr, last, H, SPIN, num_warps)
        # gate_up + SiLU of h (NORMS 2: of norm(h) * n1[l])
        i, j = gemm_tiles(a_ptr + layer * M * I, i, j, om, w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty, M,
                          H, 2 * I // BLOCK_N, I, I, BLOCK_N, BLOCK_M, BLOCK_K, W_SLOTS, X_SLOTS, num_warps,
                          ss_ptr + (2 * layer + 1) * SS, n1_ptr + layer * H, rl, rl, eps, NORM_IN=FOLD)
        _count(cnt_ptr, last)
        # down: to x[l + 1] (NORMS 1: to d, then res[l + 1] += d, x[l + 1] = norm2 in a phase; NORMS 2:
        # res[l + 1] = h + it, with its partial sums of squares for the next layer)
        i, j = gemm_tiles(d_ptr + layer * M * H if NORMS == 1 else (rn if FOLD else x_ptr + (layer + 1) * M * H), i, j,
                          om, w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty, M, I, H // BLOCK_N, 0, H,
                          BLOCK_N, BLOCK_M, BLOCK_K, W_SLOTS, X_SLOTS, num_warps, ss_ptr, nin_ptr, hl,
                          ss_ptr + (2 * layer + 2) * SS, eps, RES_OUT=FOLD)
        _count(cnt_ptr, last)
        if NORMS == 1:
            _norm_phase(rn, d_ptr + layer * M * H, n2_ptr + layer * H, rn, x_ptr + (layer + 1) * M * H,
                        PH * layer + 4, eps, M, cnt_ptr, err_ptr, last, H, SPIN, num_warps)


@gluon.jit
def _ws_mlp_kernel(x_ptr, h_ptr, a_ptr, o_ptr, d_ptr, res_ptr, ss_ptr, nin_ptr, n1_ptr, n2_ptr, eps, wo_ptr, wgu_ptr,
                   wd_ptr, cnt_ptr, err_ptr, M, LAYERS, H: gl.constexpr, I: gl.constexpr, BLOCK_N: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, W_SLOTS: gl.constexpr, X_SLOTS: gl.constexpr,
                   SPIN: gl.constexpr, W_WARPS: gl.constexpr, X_WARPS: gl.constexpr, NORMS: gl.constexpr,
                   num_warps: gl.constexpr):
    w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty = rings(W_SLOTS, X_SLOTS, BLOCK_N, BLOCK_M, BLOCK_K,
                                                                    W_WARPS, X_WARPS)
    gl.warp_specialize([
        (_consumer, (x_ptr, h_ptr, a_ptr, o_ptr, d_ptr, res_ptr, ss_ptr, nin_ptr, n1_ptr, n2_ptr, eps, w_ring, x_ring,
                     acc_s, w_full, w_empty, x_full, x_empty, cnt_ptr, err_ptr, M, LAYERS, H, I, BLOCK_N, BLOCK_M,
                     BLOCK_K, W_SLOTS, X_SLOTS, SPIN, NORMS, num_warps)),
        (_w_producer, (wo_ptr, wgu_ptr, wd_ptr, w_ring, w_full, w_empty, LAYERS, H, I, BLOCK_N, BLOCK_K, W_SLOTS,
                       W_WARPS)),
        (_x_producer, (x_ptr, h_ptr, a_ptr, res_ptr, x_ring, x_full, x_empty, cnt_ptr, err_ptr, M, LAYERS, H, I,
                       BLOCK_N, BLOCK_M, BLOCK_K, X_SLOTS, SPIN, X_WARPS, NORMS)),
    ], [W_WARPS, X_WARPS], [48, 48])


def buffers(L: int, M: int, H: int, I: int, norms: int, seed: int = 1) -> dict:
    """x [L + 1, M, H] (x[0] the input, random), h [L, M, H], a [L, M, I]; with norms also o, d
    [L, M, H] and the residual res [L + 1, M, H] (res[0] random); with norms 2 (folded) also ss
    [2L + 1, H / 32, 32] fp32, the partial sums of squares of res[l] (2l) and h[l] (2l + 1), ss[0]
    those of res[0] by 32-column tile, as the kernel's epilogues write them."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    zeros = functools.partial(torch.zeros, device="cuda", dtype=torch.bfloat16)
    b = dict(x=zeros(L + 1, M, H), h=zeros(L, M, H), a=zeros(L, M, I))
    b["x"][0] = torch.randn(M, H, device="cuda", generator=g)
    if norms:
        b.update(o=zeros(L, M, H), d=zeros(L, M, H), res=zeros(L + 1, M, H))
        b["res"][0] = torch.randn(M, H, device="cuda", generator=g)
    if norms == 2:
        b["ss"] = torch.zeros(2 * L + 1, H // BLOCK_N, BLOCK_M, device="cuda")
        b["ss"][0, :, :M] = b["res"][0].float().view(M, H // BLOCK_N, BLOCK_N).pow(2).sum(-1).T
    return b


def one_layer(b: dict, i: int) -> dict:
    """Layer i's views of buffers(): its input and output x / res, its h, a, o, d, ss."""
    return {k: v[i:i + 2] if k in ("x", "res") else v[2 * i:2 * i + 3] if k == "ss" else v[i:i + 1]
            for k, v in b.items()}


def ws_mlp(b: dict, wo, wgu, wd, cnt, err, n1=None, n2=None, nin=None, eps: float = EPS, w_slots: int = 6,
           x_slots: int = 4, w_warps: int = 4, x_warps: int = 1) -> None:
    """For each layer l of buffers() b, in one launch of H / 32 programs (all resident at once):
    without norms h = x[l] @ wo.T, a = silu(gate) * up of h @ wgu.T, x[l + 1] = a @ wd.T; with
    norms n1, n2 [L, H]: o = x[l] @ wo.T, res[l + 1] = res[l] + o, h = rmsnorm(res[l + 1]) * n1[l],
    a as before, d = a @ wd.T, res[l + 1] += d, x[l + 1] = rmsnorm(res[l + 1]) * n2[l], the norms
    as phases of their own; with nin [L, H] too, folded (no norm phases): h = res[l] + (rmsnorm(res[l])
    * nin[l]) @ wo.T, a of rmsnorm(h) * n1[l], res[l + 1] = h + a @ wd.T. wo [L, H, H], wgu [L, 2I,
    H] (gate rows then up rows), wd [L, H, I]. cnt: a zeroed int32 counter (zero again after the
    call); err counts waits that gave up."""
    L, H = wo.shape[0], wo.shape[1]
    I = wd.shape[2]
    x, h, a = b["x"], b["h"], b["a"]
    M = x.shape[1]
    norms = 0 if n1 is None else 1 if nin is None else 2
    o, d, res = (b["o"], b["d"], b["res"]) if norms else (h, h, x)        # unused without norms
    ss, n1, n2, nin = b.get("ss", x), (n1 if norms else wo), (n2 if norms == 1 else wo), (nin if norms == 2 else wo)
    assert wo.shape == (L, H, H) and wgu.shape == (L, 2 * I, H) and wd.shape == (L, H, I)
    assert x.shape == (L + 1, M, H) and h.shape == (L, M, H) and a.shape == (L, M, I) and M <= BLOCK_M
    assert not norms or (n1.shape == (L, H) and res.shape == (L + 1, M, H) and d.shape == o.shape == h.shape)
    assert norms != 2 or (nin.shape == (L, H) and ss.shape == (2 * L + 1, H // BLOCK_N, BLOCK_M))
    assert all(t.is_contiguous() for t in (x, h, a, o, d, res, ss, wo, wgu, wd, n1, n2, nin))
    assert H % BLOCK_K == 0 and I % BLOCK_K == 0 and (2 * I // BLOCK_N) % (H // BLOCK_N) == 0
    assert H // BLOCK_N <= sm_count(x.device)
    _ws_mlp_kernel[(H // BLOCK_N,)](x, h, a, o, d, res, ss, nin, n1, n2, eps, wo, wgu, wd, cnt, err, M, L, H=H, I=I,
                                    BLOCK_N=BLOCK_N, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, W_SLOTS=w_slots,
                                    X_SLOTS=x_slots, SPIN=SPIN_LIMIT, W_WARPS=w_warps, X_WARPS=x_warps, NORMS=norms,
                                    num_warps=4)


def mlp_launches(b: dict, wo, wgu, wd, cfgs, n1=None, n2=None, eps: float = EPS) -> None:
    """The same chain as skinny_gemm launches at configs (o, gate_up, down), with norms two
    fused_ops.add_rmsnorm launches a layer between them (PDL)."""
    from ..kernels.fused_ops import add_rmsnorm
    from ..kernels.skinny_gemm import skinny_gemm
    x, h, a = b["x"], b["h"], b["a"]
    for i in range(wo.shape[0]):
        if n1 is None:
            skinny_gemm(x[i], wo[i], *cfgs[0], out=h[i])
        else:
            o = skinny_gemm(x[i], wo[i], *cfgs[0], out=b["o"][i])
            add_rmsnorm(b["res"][i], n1[i], eps, delta=o, out=(h[i], b["res"][i + 1]))
        skinny_gemm(h[i], wgu[i], *cfgs[1], out=a[i], silu_mul=True)
        if n1 is None:
            skinny_gemm(a[i], wd[i], *cfgs[2], out=x[i + 1])
        else:
            d = skinny_gemm(a[i], wd[i], *cfgs[2], out=b["d"][i])
            add_rmsnorm(b["res"][i + 1], n2[i], eps, delta=d, out=(x[i + 1], b["res"][i + 1]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--m", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--slots", nargs="+", default=["6,4,4,1", "6,4,4,2"], help="W_SLOTS,X_SLOTS,W_WARPS,X_WARPS")
    ap.add_argument("--norms", type=int, nargs="+", default=[0, 1, 2],
                    help="1: each layer also adds to a residual and normalises twice (as the decode layer), as phases; "
                         "2: the same with the norms folded into the GEMMs (no norm phases)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("ws_mlp: CUDA only", file=sys.stderr)
        return 1
    from ..kernels import pdl
    from ..kernels.fused_ops import add_rmsnorm
    from .kernels import copy_bandwidth
    copy_gbps = copy_bandwidth()
    L, M, H, I = args.layers, args.m, args.hidden, args.intermediate
    g = torch.Generator(device="cuda").manual_seed(0)

    def weight(*shape, scale=None):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) * (scale or shape[-1] ** -0.5)
    wo, wgu, wd = weight(L, H, H), weight(L, 2 * I, H), weight(L, H, I)
    n0, n1, n2 = 1 + weight(H, scale=0.1), 1 + weight(L, H, scale=0.1), 1 + weight(L, H, scale=0.1)
    wbytes = (wo.numel() + wgu.numel() + wd.numel()) * 2
    cnt = torch.zeros(1, dtype=torch.int32, device="cuda")
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    pdl.set_enabled(True)
    tile = (BLOCK_N, BLOCK_K, 4, 5)
    table = ((32, 256, 4, 5), (128, 128, 8, 4), (64, 128, 4, 5, 2))       # skinny_gemm's _LLAMA3_8B at M = 32
    rows = []
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbps:.0f} GB/s; {L} MLP layers (H {H}, I {I}), M={M}: "
          f"{wbytes / 1e6:.0f} MB, {wbytes / copy_gbps / 1e6:.3f} ms at the copy rate", flush=True)

    timed = functools.partial(time_row, rows, nbytes=wbytes, copy_gbps=copy_gbps, layers=L, width=34)

    nin = torch.cat([n0[None], n2[:-1]])        # norms 2: the norm before each o_proj (n2[l - 1], n0 first)
    for norms in args.norms:
        nw = [{}, dict(n1=n1, n2=n2), dict(n1=n1, n2=n2, nin=nin)][norms]
        ref_nw = {k: v for k, v in nw.items() if k != "nin"}    # the launches compute what norms 2 folds as 1 does
        tag = ["", " +norms", " +folded norms"][norms]
        ref = buffers(L, M, H, I, norms)
        if norms == 2:      # the input the fold normalises itself: x[0] = rmsnorm(res[0]) * n0
            ref["x"][0] = add_rmsnorm(ref["res"][0], n0, EPS)[0]
        mlp_launches(ref, wo, wgu, wd, (tile, tile, tile), **ref_nw)
        live = int((ref["x"][1:].abs().amax(dim=(1, 2)) > 0).sum())
        key = "res" if norms == 2 else "x"         # what both compute (the fold keeps no normed x)

        def check(b):
            """Without norms the GEMMs' bits are the launches' (without norms silu(g) * u, quadratic,
            shrinks x to 0 after a few layers: `live` layers are nonzero); with them the norms' fp32
            sums of squares are ordered differently, so: the fraction of equal elements."""
            eq = float((b[key] == ref[key]).float().mean())
            return dict(same_bits=eq == 1.0, equal_fraction=round(eq, 4), nonzero_layers=live,
                        max_abs_diff=float((b[key].float() - ref[key].float()).abs().max()),
                        wait_timeouts=int(err.item()), counter_after=int(cnt.item()))
        if norms < 2:       # norms 2's launches are norms 1's
            timed("launches 32,256,4,5" + tag, lambda: mlp_launches(ref, wo, wgu, wd, (tile, tile, tile), **ref_nw))
            eng = buffers(L, M, H, I, norms)
            timed("launches table configs" + tag, lambda: mlp_launches(eng, wo, wgu, wd, table, **ref_nw))
        for sl in args.slots:
            ws_, xs_, ww_, xw_ = (int(v) for v in sl.split(","))
            kw = dict(w_slots=ws_, x_slots=xs_, w_warps=ww_, x_warps=xw_)
            out = buffers(L, M, H, I, norms)
            try:
                ws_mlp(out, wo, wgu, wd, cnt, err, **kw, **nw)
                torch.cuda.synchronize()
            except Exception as e:
                print(f"ws {sl}{tag}: failed: {type(e).__name__}: {e}"[:400], flush=True)
                rows.append(dict(way=f"ws {sl}{tag}", error=f"{type(e).__name__}: {e}"[:300]))
                continue
            timed(f"ws {sl}{tag}", lambda: ws_mlp(out, wo, wgu, wd, cnt, err, **kw, **nw), **check(out))
            # the same kernel launched once per layer (as a decode layer would run it between the
            # attention kernels): what a persistent kernel's own start and end cost a launch
            per = buffers(L, M, H, I, norms)

            def per_layer():
                for i in range(L):
                    ws_mlp(one_layer(per, i), wo[i:i + 1], wgu[i:i + 1], wd[i:i + 1], cnt, err, **kw,
                           **{k: v[i:i + 1] for k, v in nw.items()})
            per_layer()
            torch.cuda.synchronize()
            timed(f"ws {sl}{tag}, a launch per layer", per_layer, **check(per))
    write_json(dict(layers=L, m=M, hidden=H, intermediate=I, copy_GBps=copy_gbps, rows=rows,
                    meta=run_meta("rollout.bench.ws_mlp", argv)), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
