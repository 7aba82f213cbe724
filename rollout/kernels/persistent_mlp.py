"""The decode step's MLP half of a layer as one persistent kernel: o_proj, the residual add +
RMSNorm, gate_up with SiLU * up, down_proj and the next residual add + RMSNorm, which the fused
path otherwise runs as five launches (each costs ~4-7 us over its bytes even with PDL, see
`rollout.bench.chain`). An experiment behind `DecoderLM.persistent_mlp` (off by default).

Work items in phase order: o_proj tiles (x K splits), the M norm rows, gate_up tiles, down_proj
tiles (x K splits), the M next-norm rows. A program takes items from an atomic queue one ahead
of its work and asks L2 for an item's weights when it takes it; on an item it loads the first
weight tile, then waits until the phase before is done (a count per phase). Every wait is on
earlier items, which running programs hold, so it cannot deadlock whatever the grid or whatever
else runs on the GPU (under the interpreter the first program does every item). The last
program out zeroes the counters.

The same bits as the launches: the GEMM tiles, K order and split sums of skinny_gemm (o_proj
and down_proj partials are summed in split order by the norm rows, as add_rmsnorm sums them),
SiLU * up through skinny_gemm's `silu_epilogue`, the norms through `rmsnorm_store`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import fix_interpreter
from .fused_ops import rmsnorm_store
from .skinny_gemm import gate_up_rows, silu_epilogue, split_counters

fix_interpreter()

SPIN_LIMIT = 1 << 20    # polls before a wait gives up and counts itself in err (a bug, not a hang)
PHASES = 5
PREFETCH_WEIGHTS = True  # the L2 bulk prefetch of each item's weights (bench.step_variants knob mlp_no_prefetch)


@triton.jit
def prefetch_l2(ptr, nbytes):
    """Ask L2 for nbytes (a multiple of 16) from ptr: bulk prefetches (sm_90) of 32 KB pieces,
    issued by thread 0 only. Nothing is held while the bytes arrive."""
    for off in range(0, nbytes, 32768):
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [ptr + off, tl.minimum(nbytes - off, 32768)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def wait_at_least(ptr, target, err_ptr, SPIN: tl.constexpr):
    """Poll the counter at ptr until it reaches target (or SPIN polls: then count it in err), then
    an acquire, so what the counting programs wrote before their release is visible."""
    polls = 0
    while (tl.load(ptr, volatile=True) < target) & (polls < SPIN):
        polls += 1
    if polls >= SPIN:
        tl.atomic_add(err_ptr, 1)
    tl.atomic_add(ptr, 0, sem="acquire")


@triton.jit
def _gemm_item(x_ptr, s_x, w_ptr, s_w, w_rows, rm, M, kt0, kt1, wait_ptr, wait_target, err_ptr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
               SPIN: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] = w[w_rows] @ x[rm].T over K tiles [kt0, kt1), fp32 in K order
    (skinny_gemm's tiles). The first weight tile is loaded before the wait: weights are no
    phase's output. x comes from L2 (.cg): other SMs wrote it."""
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + w_rows.to(tl.int64)[:, None] * s_w + (kt0 * BLOCK_K + rk)[None, :]
    x_ptrs = x_ptr + rm[:, None] * s_x + (kt0 * BLOCK_K + rk)[None, :]
    m_ok = rm[:, None] < M
    w = tl.load(w_ptrs)
    wait_at_least(wait_ptr, wait_target, err_ptr, SPIN)
    acc = tl.dot(w, tl.trans(tl.load(x_ptrs, mask=m_ok, other=0.0, cache_modifier=".cg")),
                 tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32))
    for _ in tl.range(kt0 + 1, kt1, num_stages=STAGES):
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        acc = tl.dot(tl.load(w_ptrs), tl.trans(tl.load(x_ptrs, mask=m_ok, other=0.0, cache_modifier=".cg")), acc)
    return acc


@triton.jit
def _partial_item(i, x_ptr, w_ptr, part_ptr, K, H, rm, M, wait_ptr, wait_target, err_ptr, BLOCK_M: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr,
                  SPIN: tl.constexpr):
    """Item i of a GEMM phase x [M, K] @ w.T -> [M, H] split SPLIT ways in K: output tile
    i // SPLIT, split i % SPLIT, stored as fp32 partial [split, BLOCK_M, H] (summed by the norm
    rows in split order)."""
    tile = i // SPLIT
    sk = i % SPLIT
    rn = tile * BN + tl.arange(0, BN)
    per = tl.cdiv(K // BK, SPLIT)
    acc = _gemm_item(x_ptr, K, w_ptr, K, rn, rm, M, sk * per, tl.minimum(sk * per + per, K // BK),
                     wait_ptr, wait_target, err_ptr, BLOCK_M, BN, BK, STAGES, SPIN)
    tl.store(part_ptr + (sk * BLOCK_M + rm[None, :]) * H + rn[:, None], acc)


@triton.jit
def _prefetch_rows(w_ptr, i, K, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr):
    """L2 prefetch of the weights of item i of a split GEMM phase (see _partial_item)."""
    per = tl.cdiv(K // BK, SPLIT)
    for r in range(BN):
        prefetch_l2(w_ptr + ((i // SPLIT) * BN + r).to(tl.int64) * K + (i % SPLIT) * per * BK, per * BK * 2)


@triton.jit
def _prefetch_item(i, p1, p2, p3, p4, wo_ptr, wgu_ptr, wd_ptr, H, KA, I, O_BN: tl.constexpr, O_BK: tl.constexpr,
                   O_SPLIT: tl.constexpr, G_BN: tl.constexpr, D_BN: tl.constexpr, D_BK: tl.constexpr,
                   D_SPLIT: tl.constexpr):
    """Ask L2 for queue item i's weights (none for norm rows or past the end): issued when the
    item is taken, one item ahead of its work."""
    if i < p1:
        _prefetch_rows(wo_ptr, i, KA, O_BN, O_BK, O_SPLIT)
    elif i < p2:
        pass
    elif i < p3:          # gate rows and the matching up rows: two contiguous blocks
        prefetch_l2(wgu_ptr + ((i - p2) * (G_BN // 2)).to(tl.int64) * H, (G_BN // 2) * H * 2)
        prefetch_l2(wgu_ptr + (I + (i - p2) * (G_BN // 2)).to(tl.int64) * H, (G_BN // 2) * H * 2)
    elif i < p4:
        _prefetch_rows(wd_ptr, i - p3, I, D_BN, D_BK, D_SPLIT)


@triton.jit
def _norm_row(r, res_ptr, part_ptr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, w_ptr, eps, newres_ptr, out_ptr,
              H, BLOCK_H: tl.constexpr):
    """Row r: residual + the GEMM's fp32 partials summed in split order and rounded (add_rmsnorm's
    DELTA_PARTIALS sum), rounded, stored as the new residual; then its RMSNorm times w."""
    cols = tl.arange(0, BLOCK_H)
    m = cols < H
    x = tl.load(res_ptr + r * H + cols, mask=m, other=0.0, cache_modifier=".cg")   # phase 4: r1, from other SMs
    dsum = tl.zeros([BLOCK_H], tl.float32)
    for sk in tl.static_range(SPLITS):
        dsum += tl.load(part_ptr + (sk * BLOCK_M + r) * H + cols, mask=m, other=0.0, cache_modifier=".cg")
    dt = res_ptr.dtype.element_ty
    x = (x.to(tl.float32) + dsum.to(dt).to(tl.float32)).to(dt)
    tl.store(newres_ptr + r * H + cols, x, mask=m)
    rmsnorm_store(x, w_ptr, out_ptr + r * H, cols, m, H, eps)


@triton.jit
def _mlp_kernel(a_ptr, wo_ptr, res_ptr, n2w_ptr, wgu_ptr, wd_ptr, n3w_ptr,
                po_ptr, r1_ptr, x2_ptr, act_ptr, pd_ptr, r2_ptr, x3_ptr, cnt_ptr, err_ptr,
                M, H, KA, I, eps2, eps3,
                BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
                O_BN: tl.constexpr, O_BK: tl.constexpr, O_SPLIT: tl.constexpr, O_ST: tl.constexpr,
                G_BN: tl.constexpr, G_BK: tl.constexpr, G_ST: tl.constexpr,
                D_BN: tl.constexpr, D_BK: tl.constexpr, D_SPLIT: tl.constexpr, D_ST: tl.constexpr,
                PREFETCH: tl.constexpr, SPIN: tl.constexpr):
    progs = tl.num_programs(0)
    rm = tl.arange(0, BLOCK_M)
    # Items per phase and where each phase starts in the queue.
    n_o = (H // O_BN) * O_SPLIT
    n_g = I // (G_BN // 2)
    n_d = (H // D_BN) * D_SPLIT
    p1 = n_o
    p2 = p1 + M
    p3 = p2 + n_g
    p4 = p3 + n_d
    done = cnt_ptr + 2                            # done[phase]
    item = tl.atomic_add(cnt_ptr, 1)
    if PREFETCH:
        _prefetch_item(item, p1, p2, p3, p4, wo_ptr, wgu_ptr, wd_ptr, H, KA, I, O_BN, O_BK, O_SPLIT, G_BN, D_BN, D_BK,
                       D_SPLIT)
    while item < p4 + M:
        nxt = tl.atomic_add(cnt_ptr, 1)           # the next item, taken now: its atomic and weights
        if PREFETCH:                              # arrive while this one works
            _prefetch_item(nxt, p1, p2, p3, p4, wo_ptr, wgu_ptr, wd_ptr, H, KA, I, O_BN, O_BK, O_SPLIT, G_BN, D_BN,
                           D_BK, D_SPLIT)
        if item < p1:                             # o_proj tile x split -> fp32 partial (no phase before)
            _partial_item(item, a_ptr, wo_ptr, po_ptr, KA, H, rm, M, done, 0, err_ptr,
                          BLOCK_M, O_BN, O_BK, O_SPLIT, O_ST, SPIN)
        elif item < p2:                           # residual + o_proj, post-attention norm
            wait_at_least(done, n_o, err_ptr, SPIN)
            _norm_row(item - p1, res_ptr, po_ptr, O_SPLIT, BLOCK_M, n2w_ptr, eps2, r1_ptr, x2_ptr, H, BLOCK_H)
        elif item < p3:                           # gate_up tile: half gate rows, half the matching up rows
            _, w_rows = gate_up_rows(item - p2, I, G_BN)
            acc = _gemm_item(x2_ptr, H, wgu_ptr, H, w_rows, rm, M, 0, H // G_BK, done + 1, M, err_ptr,
                             BLOCK_M, G_BN, G_BK, G_ST, SPIN)
            silu_epilogue(acc, act_ptr, item - p2, rm, M, I, I, BLOCK_M, G_BN)
        elif item < p4:                           # down_proj tile x split -> fp32 partial
            _partial_item(item - p3, act_ptr, wd_ptr, pd_ptr, I, H, rm, M, done + 2, n_g, err_ptr,
                          BLOCK_M, D_BN, D_BK, D_SPLIT, D_ST, SPIN)
        else:                                     # residual + down_proj, the next norm
            wait_at_least(done + 3, n_d, err_ptr, SPIN)
            _norm_row(item - p4, r1_ptr, pd_ptr, D_SPLIT, BLOCK_M, n3w_ptr, eps3, r2_ptr, x3_ptr, H, BLOCK_H)
        tl.debug_barrier()                        # every thread's stores before the release
        phase = (item >= p1).to(tl.int32) + (item >= p2).to(tl.int32) + (item >= p3).to(tl.int32) \
            + (item >= p4).to(tl.int32)
        tl.atomic_add(done + phase, 1, sem="release")
        item = nxt
    if tl.atomic_add(cnt_ptr + 1, 1, sem="acq_rel") == progs - 1:   # the last one out: no one touches them now
        for i in range(2 + 5):
            tl.store(cnt_ptr + i, 0)


def mlp_block(a: torch.Tensor, residual: torch.Tensor, wo: torch.Tensor, norm2: tuple, wgu: torch.Tensor,
              wd: torch.Tensor, norm3: tuple, cfg_o: tuple, cfg_g: tuple, cfg_d: tuple, *, grid: int = 0,
              num_warps: int = 0, prefetch: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """a [M, KA] (attention output), residual [M, H] -> (normed [M, H], new residual [M, H]) =
    add_rmsnorm(r1, norm3, delta=down(silu(gate_up(x2)))) with (x2, r1) =
    add_rmsnorm(residual, norm2, delta=o_proj(a)); norm2 / norm3 = (weight, eps). cfg_*: the
    skinny-GEMM configs (BLOCK_N, BLOCK_K, num_warps, num_stages[, split_k]) of o_proj, gate_up
    (no split) and down_proj. grid: programs (default: one per SM; any count is safe). num_warps:
    default gate_up's, the add + RMSNorm kernel's 8 at 4096-wide rows. prefetch: the L2 bulk
    prefetch of each item's weights (sm_90; never under the interpreter); None: PREFETCH_WEIGHTS."""
    M, KA = a.shape
    H, I = residual.shape[1], wd.shape[1]
    (o_bn, o_bk, _, o_st, *o_sp), (g_bn, g_bk, g_w, g_st, *g_sp), (d_bn, d_bk, _, d_st, *d_sp) = cfg_o, cfg_g, cfg_d
    o_split, d_split = (o_sp or [1])[0], (d_sp or [1])[0]
    assert M <= 64 and a.stride(1) == 1 and residual.is_contiguous() and a.is_contiguous()
    assert wo.shape == (H, KA) and wgu.shape == (2 * I, H) and wd.shape == (H, I)
    assert all(w.is_contiguous() for w in (wo, wgu, wd)) and (g_sp or [1])[0] == 1, "gate_up: no split-K"
    assert H % o_bn == 0 and KA % o_bk == 0 and (KA // o_bk) % o_split == 0
    assert I % (g_bn // 2) == 0 and H % g_bk == 0 and H % d_bn == 0 and I % d_bk == 0 and (I // d_bk) % d_split == 0
    bm = max(16, triton.next_power_of_2(M))
    f32 = dict(dtype=torch.float32, device=a.device)
    po, pd = torch.empty((o_split, bm, H), **f32), torch.empty((d_split, bm, H), **f32)
    r1, x2, r2, x3 = (torch.empty_like(residual) for _ in range(4))
    act = torch.empty((bm, I), dtype=a.dtype, device=a.device)
    cnt = split_counters(a.device, 2 + PHASES + 1, pool="mlp_queue")   # queue, exited, done[5], err
    interpret = triton.knobs.runtime.interpret
    if not grid:
        grid = 2 if interpret else torch.cuda.get_device_properties(a.device).multi_processor_count
    prefetch = (PREFETCH_WEIGHTS if prefetch is None else prefetch) and not interpret
    if M:
        _mlp_kernel[(grid,)](
            a, wo, residual, norm2[0], wgu, wd, norm3[0], po, r1, x2, act, pd, r2, x3, cnt, cnt[2 + PHASES:],
            M, H, KA, I, float(norm2[1]), float(norm3[1]), BLOCK_M=bm, BLOCK_H=triton.next_power_of_2(H),
            O_BN=o_bn, O_BK=o_bk, O_SPLIT=o_split, O_ST=o_st, G_BN=g_bn, G_BK=g_bk, G_ST=g_st,
            D_BN=d_bn, D_BK=d_bk, D_SPLIT=d_split, D_ST=d_st, PREFETCH=prefetch, SPIN=SPIN_LIMIT,
            num_warps=num_warps or g_w, num_stages=max(o_st, g_st, d_st))
    return x3, r2


def wait_timeouts(device) -> int:
    """How many waits of the MLP kernel gave up since the process started (0 unless a bug)."""
    return int(split_counters(device, 2 + PHASES + 1, pool="mlp_queue")[2 + PHASES].item())


def mlp_launches(a, residual, wo, norm2, wgu, wd, norm3, cfg_o, cfg_g, cfg_d):
    """What mlp_block replaces: the fused path's five launches (decoder._forward_fused with split-K
    partials into the norms and SiLU in the gate_up epilogue). The reference its tests compare to."""
    from .fused_ops import add_rmsnorm
    from .skinny_gemm import skinny_gemm

    def delta(x, w, cfg):
        return skinny_gemm(x, w, *cfg, partials=True) if len(cfg) > 4 and cfg[4] > 1 else skinny_gemm(x, w, *cfg)
    x2, r1 = add_rmsnorm(residual, norm2[0], norm2[1], delta=delta(a, wo, cfg_o))
    act = skinny_gemm(x2, wgu, *cfg_g, silu_mul=True)
    return add_rmsnorm(r1, norm3[0], norm3[1], delta=delta(act, wd, cfg_d))
