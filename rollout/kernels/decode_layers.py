"""Every decoder layer of a decode step in one persistent, warp-specialized Gluon kernel (the decode
megakernel). CUDA (sm_90) only; the engine takes it with `decode_megakernel=True` (DecoderLM's
`use_decode_megakernel`) for decode-only steps of at most 32 rows.

Why: a decode step of the 8B shape as launches is ~290 kernels, and each boundary costs a pure
stream ~3 us while HBM idles (bench/results/README.md, twelfth session). Here nothing drains at a
boundary: per program (H / 32 programs, one per SM, all resident), a weight producer streams every
weight tile and K / V tile the program will read, layer after layer, through one shared-memory
ring and never waits for data; an x producer copies each phase's input once every program has
finished the phase before (one counter in global memory); the consumer warps multiply (mma.sync)
and run the epilogues. bench.ws_layer timed these bytes at +4.6 points of the roofline over its own
launches of them (nineteenth session), which are ~0.2 ms a step slower than the engine's.
Measured (bench/results/README.md, twentieth session): correct, at parity with the launches in the
decode graphs at P1's mean context, 2.1 points slower end to end (P1 80.0% against 82.1%), so off
by default.

Per layer, five phases (PH), with the RMSNorms folded away:
  0. QKV = xn @ Wqkv.T, scaled by 1 / rms per row, where xn = res * n_in (the norm's weight times
     the un-normed residual, stored by the phase that made res); RoPE on q and k (a tile holds 16
     frequency pairs' two halves of one head), q to a buffer, k and v into the paged cache.
  1. attention: a program per (sequence, KV head) pair in turn, its GROUP query heads as the rows
     of a 16-row MMA tile (kernels.gluon_decode's math); K and V of 32 keys arrive as one ring slot
     (K in columns 0-127, V in 128-255). The weight producer streams them during the QKV phase and
     waits for it only before the tile that holds the new token.
  2. o_proj, epilogue h = res + o, and h's partial sums of squares and hn = h * n_post.
  3. gate_up scaled by 1 / rms(h), epilogue silu(gate) * up.
  4. down, epilogue res = h + d, its partial sums of squares and xn = res * n_in of the next layer.
The product rounds differently from HF's norm (bf16(x * n) @ W.T / rms against bf16(bf16(x / rms)
* n) @ W.T): the engine test against HF measures what that costs.

The prologue kernel (Triton) gives layer 0 its res, xn and sums of squares from the embeddings and
the step's cos / sin table; the final norm is fused_ops.add_rmsnorm on the returned residual.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mbarrier, mma_v2

from .gluon_decode import key_scores, softmax_step
from .rope_kv import PRECISE, cos_sin

BLOCK_N, BLOCK_K, BLOCK_M = 32, 256, 32     # weight rows a tile, K a tile, rows (sequences) at most
PH = gl.constexpr(5)                        # phases a layer
HEAD_DIM = gl.constexpr(128)
SPIN_LIMIT = 1 << 20                        # counter polls before a wait gives up (counted in err): no hang
W_SLOTS, X_SLOTS = 6, 4                     # ring slots of 16 KB (bench.ws_layer's best: 6, 4)
ROPE, SILU, RES = gl.constexpr(1), gl.constexpr(2), gl.constexpr(3)      # a GEMM phase's epilogue
ROWS = gl.constexpr(16)                     # query rows of an attention tile (GROUP <= 16)
ATTN_MODE = 2                               # _attn_phase: two key tiles an iteration (the faster)


@gluon.jit
def wait_count(ptr, target, err_ptr, SPIN: gl.constexpr):
    """Poll the counter at ptr (acquire) until it reaches target, or SPIN polls (then count it in err)."""
    polls = 0
    while (gl.atomic_add(ptr, 0, sem="acquire") < target) & (polls < SPIN):
        polls += 1
    if polls >= SPIN:
        gl.atomic_add(err_ptr, 1)


@gluon.jit
def count_phase(cnt_ptr, last):
    """This program has finished a phase (its stores before the release); the last arrival of the
    launch (`last` = phases * programs - 1) zeroes the counter for the next launch."""
    gl.thread_barrier()
    if gl.atomic_add(cnt_ptr, 1, sem="release") == last:
        gl.atomic_xchg(cnt_ptr, 0)


@gluon.jit
def rings(W_SLOTS: gl.constexpr, X_SLOTS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
          BLOCK_K: gl.constexpr, W_WARPS: gl.constexpr, X_WARPS: gl.constexpr):
    """The weight and x rings in shared memory (skinny_gemm's swizzle, so ldmatrix), the SiLU /
    RoPE epilogues' fp32 tile, and each ring's full / empty mbarriers: a slot is full once every
    producer thread's copies have landed, empty after the consumers' one arrival (Gluon: a
    partition barrier, then one thread). Also the benches' (bench.ws_chain, ws_mlp, ws_layer)."""
    smem: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, order=[1, 0])
    w_ring = gl.allocate_shared_memory(gl.bfloat16, [W_SLOTS, BLOCK_N, BLOCK_K], smem)
    x_ring = gl.allocate_shared_memory(gl.bfloat16, [X_SLOTS, BLOCK_M, BLOCK_K], smem)
    acc_s = gl.allocate_shared_memory(gl.float32, [BLOCK_N, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    bars: gl.constexpr = mbarrier.MBarrierLayout()
    w_full = gl.allocate_shared_memory(gl.int64, [W_SLOTS, 1], bars)
    w_empty = gl.allocate_shared_memory(gl.int64, [W_SLOTS, 1], bars)
    x_full = gl.allocate_shared_memory(gl.int64, [X_SLOTS, 1], bars)
    x_empty = gl.allocate_shared_memory(gl.int64, [X_SLOTS, 1], bars)
    for s in gl.static_range(W_SLOTS):
        mbarrier.init(w_full.index(s), count=W_WARPS * 32)
        mbarrier.init(w_empty.index(s), count=1)
    for s in gl.static_range(X_SLOTS):
        mbarrier.init(x_full.index(s), count=X_WARPS * 32)
        mbarrier.init(x_empty.index(s), count=1)
    return w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty


@gluon.jit
def _w_rows(t, r, MODE: gl.constexpr, HALF: gl.constexpr, BLOCK_N: gl.constexpr):
    """Weight rows of tile t. SILU (HALF = I): BLOCK_N / 2 gate rows and their up rows of the fused
    [gate; up] weight. ROPE (HALF = head_dim / 2): BLOCK_N / 2 frequencies' first-half rows of one
    head and their second-half rows. Else BLOCK_N consecutive rows."""
    P: gl.constexpr = BLOCK_N // 2
    if MODE == SILU:
        return t * P + r % P + (r >= P).to(gl.int32) * HALF
    elif MODE == ROPE:
        return (t // (HALF // P)) * 2 * HALF + (t % (HALF // P)) * P + r % P + (r >= P).to(gl.int32) * HALF
    else:
        return t * BLOCK_N + r


@gluon.jit
def w_tiles(base, i, r, rk, w_ring, w_full, w_empty, K: gl.constexpr, TILES: gl.constexpr, MODE: gl.constexpr,
             HALF: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, SLOTS: gl.constexpr):
    """Stream this program's weight tiles of one GEMM (base: its [rows, K] weight; tiles program,
    + programs, ...; rows by _w_rows' MODE) into the ring, K tile by K tile; i counts slot uses
    across phases. Also the benches' (bench.ws_mlp, ws_layer)."""
    for t in range(gl.program_id(0), TILES, gl.num_programs(0)):
        rows = _w_rows(t, r, MODE, HALF, BLOCK_N)
        ptrs = base + rows.to(gl.int64)[:, None] * K + rk[None, :]
        for kt in range(K // BLOCK_K):
            s = i % SLOTS
            mbarrier.wait(w_empty.index(s), ((i // SLOTS) & 1) ^ 1)      # a fresh slot passes at once
            async_copy.async_copy_global_to_shared(w_ring.index(s), ptrs + kt * BLOCK_K)
            async_copy.mbarrier_arrive(w_full.index(s), increment_count=False)
            i += 1
    return i


@gluon.jit
def _pages(bt_ptr, row, pos, seq_len, PAGE: gl.constexpr, KV_PAGED: gl.constexpr):
    """The page of each key pos (0, the trash page, past the sequence: never read as data).
    KV_PAGED 3, a timing bound: no lookup, the page a block table in order would hold."""
    if KV_PAGED == 3:
        return gl.where(pos < seq_len, row + 1 + pos // PAGE, 0)
    return gl.load(bt_ptr + row + pos // PAGE, mask=pos < seq_len, other=0)


@gluon.jit
def _kv_issue(kv_ptr, pages, t, n_tiles, seq_len, head, roff, i, r, col, w_ring, w_full, w_empty, cnt_ptr, err_ptr,
              qkv_done, s_kp, s_ks, p, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, SLOTS: gl.constexpr,
              SPIN: gl.constexpr, KV_PAGED: gl.constexpr):
    """Copy key tile t (if the sequence has it) into the next ring slot; the tile holding the
    step's own key first waits until every program has finished the QKV phase (it wrote that key).
    A row's address is its page's plus roff, its offset in the page, computed once a pair (143
    SASS instructions a tile against 263 with the per-row modulo and multiplies; the time did not
    change: bench/results/README.md, twenty-first session).
    KV_PAGED 2, a timing bound: the pages looked up and waited for, the addresses KV_PAGED 0's.
    KV_PAGED 4: each row's offset computed every tile, as before (the same bits)."""
    if t < n_tiles:
        pos = t * BLOCK_N + r
        if KV_PAGED == 2:
            rows = ((p.to(gl.int64) * n_tiles + t) * BLOCK_N + r + (pages < 0).to(gl.int64)) * HEAD_DIM
        elif KV_PAGED == 4:
            rows = pages.to(gl.int64) * s_kp + (pos % PAGE).to(gl.int64) * s_ks + head
        elif PAGE > BLOCK_N:         # the tile is one slice of its page
            rows = pages.to(gl.int64) * s_kp + roff + (t % (PAGE // BLOCK_N)).to(gl.int64) * (BLOCK_N * s_ks)
        else:
            rows = pages.to(gl.int64) * s_kp + roff
        if t == n_tiles - 1:
            wait_count(cnt_ptr, qkv_done, err_ptr, SPIN)
        s = i % SLOTS
        mbarrier.wait(w_empty.index(s), ((i // SLOTS) & 1) ^ 1)
        async_copy.async_copy_global_to_shared(w_ring.index(s), kv_ptr + rows[:, None] + col[None, :],
                                               mask=(pos < seq_len)[:, None], cache_modifier=".cg")
        async_copy.mbarrier_arrive(w_full.index(s), increment_count=False)
        i += 1
    return i


@gluon.jit
def _kv_tiles(kv_ptr, bt_ptr, lens_ptr, i, r, rk, w_ring, w_full, w_empty, cnt_ptr, err_ptr, qkv_done, B,
              s_kv, s_kp, s_ks, s_kh, s_bt, HKV: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
              SLOTS: gl.constexpr, SPIN: gl.constexpr, KV_PAGED: gl.constexpr):
    """Stream the K and V of this program's (sequence, KV head) pairs, BLOCK_N keys a slot (K in
    columns 0-127, V in 128-255; keys past the sequence zero-filled). Old keys do not wait for the
    QKV phase (_kv_issue). This is the SM's only K / V stream and a block-table lookup outlasts a
    tile's copy, so tiles go in groups of four whose pages were looked up a group early (written
    out, not a rotation of registers, which would wait for the newest lookup every tile).
    KV_PAGED 0, a timing bound (wrong output): each pair's keys read as if its pages were
    consecutive and its head's rows contiguous (bench.ws_layer's stream), no lookups. 2 and 3
    split that bound: the lookups without their addresses (_kv_issue), the addresses without
    the lookups (_pages); 4 is the default with _kv_issue's old per-row address math; 5 and 6 are
    KV_PAGED 0 with each pair's run placed elsewhere (by KV head; scattered)."""
    col = (rk % HEAD_DIM).to(gl.int64) + (rk >= HEAD_DIM).to(gl.int64) * s_kv
    for p in range(gl.program_id(0), B * HKV, gl.num_programs(0)):
        b = p // HKV
        head = (p % HKV) * s_kh
        seq_len = gl.load(lens_ptr + b)
        n_tiles = (seq_len + BLOCK_N - 1) // BLOCK_N
        row = b * s_bt
        if PAGE <= BLOCK_N:     # a row's offset in its page (KV_PAGED 0 and 2 do not use it)
            roff = (r % PAGE).to(gl.int64) * s_ks + head
        else:
            roff = r.to(gl.int64) * s_ks + head
        if KV_PAGED != 0 and KV_PAGED < 5:
            n0 = _pages(bt_ptr, row, r, seq_len, PAGE, KV_PAGED)
            n1 = _pages(bt_ptr, row, r + BLOCK_N, seq_len, PAGE, KV_PAGED)
            n2 = _pages(bt_ptr, row, r + 2 * BLOCK_N, seq_len, PAGE, KV_PAGED)
            n3 = _pages(bt_ptr, row, r + 3 * BLOCK_N, seq_len, PAGE, KV_PAGED)
            for g in range((n_tiles + 3) // 4):
                c0, c1, c2, c3 = n0, n1, n2, n3
                base = (4 * g + 4) * BLOCK_N + r
                n0 = _pages(bt_ptr, row, base, seq_len, PAGE, KV_PAGED)
                n1 = _pages(bt_ptr, row, base + BLOCK_N, seq_len, PAGE, KV_PAGED)
                n2 = _pages(bt_ptr, row, base + 2 * BLOCK_N, seq_len, PAGE, KV_PAGED)
                n3 = _pages(bt_ptr, row, base + 3 * BLOCK_N, seq_len, PAGE, KV_PAGED)
                i = _kv_issue(kv_ptr, c0, 4 * g, n_tiles, seq_len, head, roff, i, r, col, w_ring, w_full, w_empty,
                              cnt_ptr, err_ptr, qkv_done, s_kp, s_ks, p, PAGE, BLOCK_N, SLOTS, SPIN,
                              KV_PAGED)
                i = _kv_issue(kv_ptr, c1, 4 * g + 1, n_tiles, seq_len, head, roff, i, r, col, w_ring, w_full, w_empty,
                              cnt_ptr, err_ptr, qkv_done, s_kp, s_ks, p, PAGE, BLOCK_N, SLOTS, SPIN,
                              KV_PAGED)
                i = _kv_issue(kv_ptr, c2, 4 * g + 2, n_tiles, seq_len, head, roff, i, r, col, w_ring, w_full, w_empty,
                              cnt_ptr, err_ptr, qkv_done, s_kp, s_ks, p, PAGE, BLOCK_N, SLOTS, SPIN,
                              KV_PAGED)
                i = _kv_issue(kv_ptr, c3, 4 * g + 3, n_tiles, seq_len, head, roff, i, r, col, w_ring, w_full, w_empty,
                              cnt_ptr, err_ptr, qkv_done, s_kp, s_ks, p, PAGE, BLOCK_N, SLOTS, SPIN,
                              KV_PAGED)
        else:
            q = p                          # where the pair's keys lie: 5 and 6 move KV_PAGED 0's runs
            if KV_PAGED == 5:              # a KV head's runs together, as a slab per head would
                q = (p % HKV) * B + p // HKV
            if KV_PAGED == 6:              # scattered
                q = (p * 97) % (B * HKV)
            for t in range(n_tiles):       # (q * n_tiles + t) * BLOCK_N "pages" of one key, head rows contiguous
                i = _kv_issue(kv_ptr, (q.to(gl.int64) * n_tiles + t) * BLOCK_N + r, t, n_tiles, seq_len, 0, 0, i,
                              r, col, w_ring, w_full, w_empty, cnt_ptr, err_ptr, qkv_done, HEAD_DIM, 0, p,
                              PAGE, BLOCK_N, SLOTS, SPIN, 4)
    return i


@gluon.jit
def _w_producer(wqkv_ptr, wo_ptr, wgu_ptr, wd_ptr, kv_ptr, bt_ptr, lens_ptr, w_ring, w_full, w_empty, cnt_ptr,
                err_ptr, B, LAYERS, s_kl, s_kv, s_kp, s_ks, s_kh, s_bt, H: gl.constexpr, I: gl.constexpr,
                NQKV: gl.constexpr, HKV: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
                BLOCK_K: gl.constexpr, SLOTS: gl.constexpr, SPIN: gl.constexpr, WARPS: gl.constexpr,
                KV_PAGED: gl.constexpr):
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_K, BLOCK_K // 8], [WARPS, 1], [1, 0])
    r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
    rk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, ld))
    P = gl.num_programs(0)
    i = 0
    for layer in range(LAYERS):
        i = w_tiles(wqkv_ptr + layer.to(gl.int64) * NQKV * H, i, r, rk, w_ring, w_full, w_empty, H, NQKV // BLOCK_N,
                     ROPE, HEAD_DIM // 2, BLOCK_N, BLOCK_K, SLOTS)
        i = _kv_tiles(kv_ptr + layer.to(gl.int64) * s_kl, bt_ptr, lens_ptr, i, r, rk, w_ring, w_full, w_empty,
                      cnt_ptr, err_ptr, (PH * layer + 1) * P, B, s_kv, s_kp, s_ks, s_kh, s_bt, HKV, PAGE, BLOCK_N,
                      SLOTS, SPIN, KV_PAGED)
        i = w_tiles(wo_ptr + layer.to(gl.int64) * H * H, i, r, rk, w_ring, w_full, w_empty, H, H // BLOCK_N, 0, 0,
                     BLOCK_N, BLOCK_K, SLOTS)
        i = w_tiles(wgu_ptr + layer.to(gl.int64) * 2 * I * H, i, r, rk, w_ring, w_full, w_empty, H,
                     2 * I // BLOCK_N, SILU, I, BLOCK_N, BLOCK_K, SLOTS)
        i = w_tiles(wd_ptr + layer.to(gl.int64) * H * I, i, r, rk, w_ring, w_full, w_empty, I, H // BLOCK_N, 0, 0,
                     BLOCK_N, BLOCK_K, SLOTS)


@gluon.jit
def x_tiles(src, done, j, rm, rk, ok, x_ring, x_full, x_empty, cnt_ptr, err_ptr, K: gl.constexpr,
             TILES: gl.constexpr, BLOCK_K: gl.constexpr, SLOTS: gl.constexpr, SPIN: gl.constexpr):
    """Once all programs have counted `done` phases, copy the GEMM's input src [M, K] into the x
    ring, K tile by K tile, once for each of this program's tiles (from L2: other SMs wrote it)."""
    wait_count(cnt_ptr, done * gl.num_programs(0), err_ptr, SPIN)
    ptrs = src + rm[:, None] * K + rk[None, :]
    for t in range(gl.program_id(0), TILES, gl.num_programs(0)):
        for kt in range(K // BLOCK_K):
            s = j % SLOTS
            mbarrier.wait(x_empty.index(s), ((j // SLOTS) & 1) ^ 1)
            async_copy.async_copy_global_to_shared(x_ring.index(s), ptrs + kt * BLOCK_K, mask=ok,
                                                   cache_modifier=".cg")
            async_copy.mbarrier_arrive(x_full.index(s), increment_count=False)
            j += 1
    return j


@gluon.jit
def _x_producer(xn_ptr, attn_ptr, hn_ptr, a_ptr, x_ring, x_full, x_empty, cnt_ptr, err_ptr, M, LAYERS,
                H: gl.constexpr, I: gl.constexpr, NQKV: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                BLOCK_K: gl.constexpr, SLOTS: gl.constexpr, SPIN: gl.constexpr):
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_K, BLOCK_K // 8], [1, 1], [1, 0])
    rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
    rk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, ld))
    ok = (rm[:, None] < M) & (rk[None, :] < BLOCK_K)
    j = 0
    for layer in range(LAYERS):    # each input is ready once every program counted the phases before it
        j = x_tiles(xn_ptr, PH * layer, j, rm, rk, ok, x_ring, x_full, x_empty, cnt_ptr, err_ptr, H,
                     NQKV // BLOCK_N, BLOCK_K, SLOTS, SPIN)
        j = x_tiles(attn_ptr, PH * layer + 2, j, rm, rk, ok, x_ring, x_full, x_empty, cnt_ptr, err_ptr, H,
                     H // BLOCK_N, BLOCK_K, SLOTS, SPIN)
        j = x_tiles(hn_ptr, PH * layer + 3, j, rm, rk, ok, x_ring, x_full, x_empty, cnt_ptr, err_ptr, H,
                     2 * I // BLOCK_N, BLOCK_K, SLOTS, SPIN)
        j = x_tiles(a_ptr, PH * layer + 4, j, rm, rk, ok, x_ring, x_full, x_empty, cnt_ptr, err_ptr, I,
                     H // BLOCK_N, BLOCK_K, SLOTS, SPIN)


@gluon.jit
def inv_rms(ss_in, j, x_full, eps, layout: gl.constexpr, K: gl.constexpr, BLOCK_N: gl.constexpr,
            BLOCK_M: gl.constexpr, X_SLOTS: gl.constexpr, num_warps: gl.constexpr):
    """Each row's 1 / rms, in `layout`, from the K / BLOCK_N partial sums of squares in ss_in, once
    the phase's first x tile is in: its producer has seen every program count the phase that
    wrote the sums (the caller waits on that slot again: the same phase). Also bench.ws_mlp's."""
    mbarrier.wait(x_full.index(j % X_SLOTS), (j // X_SLOTS) & 1)
    parts: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [num_warps, 1], [1, 0])
    pp = gl.arange(0, K // BLOCK_N, layout=gl.SliceLayout(1, parts))
    pm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, parts))
    sq = gl.sum(gl.load(ss_in + pp[:, None] * BLOCK_M + pm[None, :], cache_modifier=".cg"), axis=0)
    return gl.convert_layout(1.0 / gl.sqrt_rn(sq / K + eps), layout)


@gluon.jit
def ring_operands(w_ring, x_ring, w_full, w_empty, x_full, x_empty, i, j, a_op: gl.constexpr, b_op: gl.constexpr,
                  W_SLOTS: gl.constexpr, X_SLOTS: gl.constexpr):
    """The next weight and x tiles (slot uses i, j) as the MMA's operands, both slots released
    once read (Gluon: a partition barrier, then one thread). Also bench.ws_mlp's."""
    ws = i % W_SLOTS
    xs = j % X_SLOTS
    mbarrier.wait(w_full.index(ws), (i // W_SLOTS) & 1)
    mbarrier.wait(x_full.index(xs), (j // X_SLOTS) & 1)
    a = w_ring.index(ws).load(a_op)
    b = x_ring.index(xs).permute((1, 0)).load(b_op)
    mbarrier.arrive(w_empty.index(ws))
    mbarrier.arrive(x_empty.index(xs))
    return a, b


@gluon.jit
def _gemm_phase(dst, i, j, om, w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty, M, ss_in, res_in, nw, dst_n,
                ss_out, cs_ptr, q_ptr, kv_ptr, slot_ptr, eps, s_kv, s_kp, s_ks, s_kh, PAGE: gl.constexpr,
                K: gl.constexpr, TILES: gl.constexpr,
                EPI: gl.constexpr, HALF: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr, S_DST: gl.constexpr,
                SCALE_IN: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
                W_SLOTS: gl.constexpr, X_SLOTS: gl.constexpr, num_warps: gl.constexpr):
    """The consumers' GEMM phase: x @ w[tile rows].T for this program's tiles from the two rings
    (skinny_gemm's mma.sync layout, warps 2 x 2, fp32 in K order), then the epilogue EPI:
    ROPE: RoPE'd q to q_ptr [M, HQ, 128], RoPE'd k / v to the cache slots slot_ptr[m] (cos / sin
    from cs_ptr [M, 2, HALF]); SILU: silu(gate) * up to dst [M, S_DST]; RES: y = res_in + out to dst,
    its rows' sums of squares over the tile's columns to ss_out[tile], y * nw to dst_n. Each value
    is rounded to bf16 where the launches round it. SCALE_IN: x is res * n, and the accumulator is
    scaled by each row's 1 / rms from the H / BLOCK_N partial sums of squares in ss_in."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps // 2, 2],
                                                  instr_shape=[16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    out: gl.constexpr = gl.BlockedLayout([8, 1], [4, 8], [num_warps // 4, 4], [0, 1])
    half: gl.constexpr = gl.BlockedLayout([4, 1], [4, 8], [num_warps // 4, 4], [0, 1])
    P: gl.constexpr = BLOCK_N // 2
    if SCALE_IN:
        inv = inv_rms(ss_in, j, x_full, eps, gl.SliceLayout(0, mma), K, BLOCK_N, BLOCK_M, X_SLOTS, num_warps)
    m_ok = om[None, :] < M
    for t in range(gl.program_id(0), TILES, gl.num_programs(0)):
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
        for kt in range(K // BLOCK_K):
            a, b = ring_operands(w_ring, x_ring, w_full, w_empty, x_full, x_empty, i, j, a_op, b_op, W_SLOTS, X_SLOTS)
            acc = mma_v2(a, b, acc)
            i += 1
            j += 1
        if SCALE_IN:
            acc = acc * inv[None, :]
        if EPI == RES:
            y = gl.convert_layout(acc, out).to(gl.bfloat16)
            on = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out))
            r = gl.load(res_in + om[None, :] * S_DST + on[:, None], mask=m_ok, other=0.0, cache_modifier=".cg")
            y = (r.to(gl.float32) + y.to(gl.float32)).to(gl.bfloat16)
            yf = y.to(gl.float32)
            gl.store(ss_out + t * BLOCK_M + om, gl.sum(yf * yf, axis=0))
            gl.store(dst + om[None, :] * S_DST + on[:, None], y, mask=m_ok)
            n = gl.load(nw + on).to(gl.float32)
            gl.store(dst_n + om[None, :] * S_DST + on[:, None], (yf * n[:, None]).to(gl.bfloat16), mask=m_ok)
        else:            # the two halves of acc (gate / up, or a head's two RoPE halves) through shared memory
            acc_s.store(acc)
            x1 = acc_s.slice(0, P).load(half).to(gl.bfloat16).to(gl.float32)
            x2 = acc_s.slice(P, P).load(half).to(gl.bfloat16).to(gl.float32)
            hm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, half))
            h_ok = hm[None, :] < M
            f = gl.arange(0, P, layout=gl.SliceLayout(1, half))
            if EPI == SILU:      # fused_ops.silu_times' rounding
                y = ((x1 / (1.0 + gl.exp(-x1))).to(gl.bfloat16).to(gl.float32) * x2).to(gl.bfloat16)
                gl.store(dst + hm[None, :] * S_DST + (t * P + f)[:, None], y, mask=h_ok)
            else:                # ROPE: rope_kv._rope_epilogue's rounding
                head = t // (HALF // P)
                f = (t % (HALF // P)) * P + f
                slot = gl.load(slot_ptr + hm, mask=hm < M, other=0)[None, :]
                slot = (slot // PAGE) * s_kp + (slot % PAGE) * s_ks         # the row's offset in the cache
                if head < HQ + HKV:
                    c = gl.load(cs_ptr + hm[None, :] * 2 * HALF + f[:, None], mask=h_ok, other=0.0).to(gl.float32)
                    s = gl.load(cs_ptr + hm[None, :] * 2 * HALF + HALF + f[:, None], mask=h_ok,
                                other=0.0).to(gl.float32)
                    o1 = ((x1 * c).to(gl.bfloat16).to(gl.float32) - (x2 * s).to(gl.bfloat16).to(gl.float32))
                    o2 = ((x2 * c).to(gl.bfloat16).to(gl.float32) + (x1 * s).to(gl.bfloat16).to(gl.float32))
                    if head < HQ:
                        qp = q_ptr + hm[None, :] * (HQ * 2 * HALF) + head * 2 * HALF + f[:, None]
                    else:
                        qp = kv_ptr + slot + (head - HQ) * s_kh + f[:, None]
                    gl.store(qp, o1.to(gl.bfloat16), mask=h_ok)
                    gl.store(qp + HALF, o2.to(gl.bfloat16), mask=h_ok)
                else:
                    vp = kv_ptr + s_kv + slot + (head - HQ - HKV) * s_kh + f[:, None]
                    gl.store(vp, x1.to(gl.bfloat16), mask=h_ok)
                    gl.store(vp + HALF, x2.to(gl.bfloat16), mask=h_ok)
    return i, j


@gluon.jit
def _kv_slot(w_ring, w_full, w_empty, i, b_op: gl.constexpr, W_SLOTS: gl.constexpr):
    """K^T [128, BLOCK_N] and V [BLOCK_N, 128] of ring use i, in registers; the slot is released."""
    s = i % W_SLOTS
    mbarrier.wait(w_full.index(s), (i // W_SLOTS) & 1)
    kv = w_ring.index(s)
    k_t = kv.slice(0, HEAD_DIM, dim=1).permute((1, 0)).load(b_op)
    v_t = kv.slice(HEAD_DIM, HEAD_DIM, dim=1).load(b_op)
    mbarrier.arrive(w_empty.index(s))
    return k_t, v_t


@gluon.jit
def _attn_phase(q_ptr, attn_ptr, lens_ptr, i, w_ring, w_full, w_empty, B, scale_log2, HQ: gl.constexpr,
                HKV: gl.constexpr, BLOCK_N: gl.constexpr, W_SLOTS: gl.constexpr, ATTN: gl.constexpr,
                num_warps: gl.constexpr):
    """Decode attention of this program's (sequence, KV head) pairs over the K / V tiles the weight
    producer streams (kernels.gluon_decode's one-split math: fp32 online softmax in the log2
    domain, row sums kept per column); q is complete (the caller waited for the QKV phase).
    ATTN 2: two tiles an iteration, one cross-warp max for both; 0: the tiles consumed, no math
    (a timing bound: wrong output)."""
    GROUP: gl.constexpr = HQ // HKV
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, num_warps], instr_shape=[16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    q_ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    qr = gl.arange(0, ROWS, layout=gl.SliceLayout(1, q_ld))
    qd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_ld))
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    orow = gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
    od = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, mma))
    for p in range(gl.program_id(0), B * HKV, gl.num_programs(0)):
        b = p // HKV
        kvh = p % HKV
        seq_len = gl.load(lens_ptr + b)
        n_tiles = (seq_len + BLOCK_N - 1) // BLOCK_N
        q = gl.load(q_ptr + (b * HQ + kvh * GROUP + qr)[:, None] * HEAD_DIM + qd[None, :],
                    mask=(qr < GROUP)[:, None], other=0.0, cache_modifier=".cg")
        q = gl.convert_layout(q, a_op)
        m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, mma))
        l_cols = gl.zeros([ROWS, BLOCK_N], gl.float32, mma)
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, mma)
        if ATTN == 0:
            for t in range(n_tiles):
                k_t, v_t = _kv_slot(w_ring, w_full, w_empty, i, b_op, W_SLOTS)
                i += 1
        if ATTN == 2:
            for t in range(n_tiles // 2):
                k_a, v_a = _kv_slot(w_ring, w_full, w_empty, i, b_op, W_SLOTS)
                k_b, v_b = _kv_slot(w_ring, w_full, w_empty, i + 1, b_op, W_SLOTS)
                s_a = key_scores(q, k_a, 2 * t * BLOCK_N, seq_len, cols, scale_log2, mma, ROWS, BLOCK_N)
                s_b = key_scores(q, k_b, (2 * t + 1) * BLOCK_N, seq_len, cols, scale_log2, mma, ROWS, BLOCK_N)
                m_new = gl.maximum(m_i, gl.max(gl.maximum(s_a, s_b), 1))
                p_a = gl.exp2(s_a - m_new[:, None])
                p_b = gl.exp2(s_b - m_new[:, None])
                alpha = gl.exp2(m_i - m_new)
                l_cols = l_cols * alpha[:, None] + p_a + p_b
                acc = mma_v2(gl.convert_layout(p_a.to(gl.bfloat16), a_op), v_a, acc * alpha[:, None])
                acc = mma_v2(gl.convert_layout(p_b.to(gl.bfloat16), a_op), v_b, acc)
                m_i = m_new
                i += 2
        for t in range((n_tiles // 2) * 2 if ATTN == 2 else (0 if ATTN == 1 else n_tiles), n_tiles):
            k_t, v_t = _kv_slot(w_ring, w_full, w_empty, i, b_op, W_SLOTS)
            s = key_scores(q, k_t, t * BLOCK_N, seq_len, cols, scale_log2, mma, ROWS, BLOCK_N)
            m_i, p_, alpha, l_cols = softmax_step(s, m_i, l_cols)
            acc = mma_v2(gl.convert_layout(p_.to(gl.bfloat16), a_op), v_t, acc * alpha[:, None])
            i += 1
        l_i = gl.sum(l_cols, 1)
        o = acc / gl.where(l_i > 0.0, l_i, 1.0)[:, None]         # no keys (a padding row): 0
        heads = b * HQ + kvh * GROUP + orow
        gl.store(attn_ptr + heads[:, None] * HEAD_DIM + od[None, :], o.to(gl.bfloat16), mask=(orow < GROUP)[:, None])
    return i


@gluon.jit
def _consumer(xn_ptr, q_ptr, attn_ptr, hn_ptr, a_ptr, res_ptr, h_ptr, ss_ptr, cs_ptr, nin_ptr, npost_ptr, kv_ptr,
              slot_ptr, lens_ptr, eps, scale_log2, w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty, cnt_ptr,
              err_ptr, M, LAYERS, s_kl, s_kv, s_kp, s_ks, s_kh, H: gl.constexpr, I: gl.constexpr, NQKV: gl.constexpr,
              HQ: gl.constexpr, HKV: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, W_SLOTS: gl.constexpr, X_SLOTS: gl.constexpr,
              SPIN: gl.constexpr, ATTN: gl.constexpr, num_warps: gl.constexpr):
    out: gl.constexpr = gl.BlockedLayout([8, 1], [4, 8], [num_warps // 4, 4], [0, 1])
    om = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, out))
    SS: gl.constexpr = H // BLOCK_N * BLOCK_M            # one set of partial sums of squares
    HALF: gl.constexpr = HEAD_DIM // 2
    P = gl.num_programs(0)
    last = PH * LAYERS * P - 1
    ss_res = ss_ptr
    ss_h = ss_ptr + SS
    i = 0       # weight ring uses (weights and K / V)
    j = 0       # x ring uses
    for layer in range(LAYERS):
        kv = kv_ptr + layer.to(gl.int64) * s_kl
        i, j = _gemm_phase(q_ptr, i, j, om, w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty, M, ss_res,
                           res_ptr, nin_ptr, q_ptr, ss_h, cs_ptr, q_ptr, kv, slot_ptr, eps, s_kv, s_kp, s_ks, s_kh,
                           PAGE, H, NQKV // BLOCK_N, ROPE, HALF, HQ, HKV, H, True, BLOCK_N, BLOCK_M, BLOCK_K, W_SLOTS,
                           X_SLOTS, num_warps)
        count_phase(cnt_ptr, last)
        wait_count(cnt_ptr, (PH * layer + 1) * P, err_ptr, SPIN)       # every q and new key is stored
        i = _attn_phase(q_ptr, attn_ptr, lens_ptr, i, w_ring, w_full, w_empty, M, scale_log2, HQ, HKV, BLOCK_N,
                        W_SLOTS, ATTN, num_warps)
        count_phase(cnt_ptr, last)
        # o_proj: h = res + attn @ Wo.T, hn = h * n_post, h's sums of squares
        i, j = _gemm_phase(h_ptr, i, j, om, w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty, M, ss_res,
                           res_ptr, npost_ptr + layer * H, hn_ptr, ss_h, cs_ptr, q_ptr, kv, slot_ptr, eps, s_kv, s_kp,
                           s_ks, s_kh, PAGE, H, H // BLOCK_N, RES, HALF, HQ, HKV, H, False, BLOCK_N, BLOCK_M, BLOCK_K,
                           W_SLOTS, X_SLOTS, num_warps)
        count_phase(cnt_ptr, last)
        i, j = _gemm_phase(a_ptr, i, j, om, w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty, M, ss_h,
                           res_ptr, nin_ptr, q_ptr, ss_h, cs_ptr, q_ptr, kv, slot_ptr, eps, s_kv, s_kp, s_ks, s_kh,
                           PAGE, H, 2 * I // BLOCK_N, SILU, I, HQ, HKV, I, True, BLOCK_N, BLOCK_M, BLOCK_K, W_SLOTS,
                           X_SLOTS, num_warps)
        count_phase(cnt_ptr, last)
        # down: res = h + a @ Wd.T, xn = res * n_in[layer + 1] (the final norm's weight after the last), sums
        i, j = _gemm_phase(res_ptr, i, j, om, w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty, M, ss_h,
                           h_ptr, nin_ptr + (layer + 1) * H, xn_ptr, ss_res, cs_ptr, q_ptr, kv, slot_ptr, eps, s_kv,
                           s_kp, s_ks, s_kh, PAGE, I, H // BLOCK_N, RES, HALF, HQ, HKV, H, False, BLOCK_N, BLOCK_M,
                           BLOCK_K, W_SLOTS, X_SLOTS, num_warps)
        count_phase(cnt_ptr, last)


@gluon.jit
def _decode_layers_kernel(xn_ptr, q_ptr, attn_ptr, hn_ptr, a_ptr, res_ptr, h_ptr, ss_ptr, cs_ptr, nin_ptr, npost_ptr,
                          wqkv_ptr, wo_ptr, wgu_ptr, wd_ptr, kv_ptr, bt_ptr, lens_ptr, slot_ptr, cnt_ptr, err_ptr, eps,
                          scale_log2, M, LAYERS, s_kl, s_kv, s_kp, s_ks, s_kh, s_bt, H: gl.constexpr, I: gl.constexpr,
                          HQ: gl.constexpr, HKV: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
                          BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, W_SLOTS: gl.constexpr,
                          X_SLOTS: gl.constexpr, SPIN: gl.constexpr, W_WARPS: gl.constexpr, ATTN: gl.constexpr,
                          KV_PAGED: gl.constexpr, num_warps: gl.constexpr):
    NQKV: gl.constexpr = (HQ + 2 * HKV) * HEAD_DIM
    w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty = rings(W_SLOTS, X_SLOTS, BLOCK_N, BLOCK_M, BLOCK_K,
                                                                    W_WARPS, 1)
    gl.warp_specialize([
        (_consumer, (xn_ptr, q_ptr, attn_ptr, hn_ptr, a_ptr, res_ptr, h_ptr, ss_ptr, cs_ptr, nin_ptr, npost_ptr, kv_ptr,
                     slot_ptr, lens_ptr, eps, scale_log2, w_ring, x_ring, acc_s, w_full, w_empty, x_full, x_empty,
                     cnt_ptr, err_ptr, M, LAYERS, s_kl, s_kv, s_kp, s_ks, s_kh, H, I, NQKV, HQ, HKV, PAGE, BLOCK_N,
                     BLOCK_M, BLOCK_K,
                     W_SLOTS, X_SLOTS, SPIN, ATTN, num_warps)),
        (_w_producer, (wqkv_ptr, wo_ptr, wgu_ptr, wd_ptr, kv_ptr, bt_ptr, lens_ptr, w_ring, w_full, w_empty, cnt_ptr,
                       err_ptr, M, LAYERS, s_kl, s_kv, s_kp, s_ks, s_kh, s_bt, H, I, NQKV, HKV, PAGE, BLOCK_N, BLOCK_K,
                       W_SLOTS, SPIN, W_WARPS, KV_PAGED)),
        (_x_producer, (xn_ptr, attn_ptr, hn_ptr, a_ptr, x_ring, x_full, x_empty, cnt_ptr, err_ptr, M, LAYERS, H, I,
                       NQKV, BLOCK_N, BLOCK_M, BLOCK_K, X_SLOTS, SPIN)),
    ], [W_WARPS, 1], [160, 48])


@triton.jit
def _prologue_kernel(emb_ptr, n_ptr, pos_ptr, inv_freq_ptr, res_ptr, xn_ptr, ss_ptr, cs_ptr, H: tl.constexpr,
                     HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, PRECISE: tl.constexpr):
    """Row m of layer 0's inputs: res = emb, xn = emb * n_in[0], the partial sums of squares of res
    by BLOCK_N-column tile (ss [H / BLOCK_N, BLOCK_M]), and the step's cos / sin (cs [M, 2, HALF])."""
    m = tl.program_id(0)
    cols = tl.arange(0, H)
    x = tl.load(emb_ptr + m * H + cols)
    tl.store(res_ptr + m * H + cols, x)
    xf = x.to(tl.float32)
    tl.store(ss_ptr + tl.arange(0, H // BLOCK_N) * BLOCK_M + m, tl.sum(tl.reshape(xf * xf, (H // BLOCK_N, BLOCK_N)), 1))
    tl.store(xn_ptr + m * H + cols, (xf * tl.load(n_ptr + cols).to(tl.float32)).to(x.dtype))
    f = tl.arange(0, HALF)
    c, s = cos_sin(tl.load(pos_ptr + m), inv_freq_ptr, f, x.dtype, PRECISE)
    tl.store(cs_ptr + m * 2 * HALF + f, c.to(x.dtype))
    tl.store(cs_ptr + m * 2 * HALF + HALF + f, s.to(x.dtype))


def prologue(emb: torch.Tensor, n_in0: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
             res: torch.Tensor, xn: torch.Tensor, ss: torch.Tensor, cs: torch.Tensor) -> None:
    """_prologue_kernel over emb's rows (Triton; also runs under the CPU interpreter)."""
    M, H = emb.shape
    half = inv_freq.numel()
    _prologue_kernel[(M,)](emb, n_in0, positions, inv_freq, res, xn, ss, cs, H=H, HALF=half, BLOCK_N=BLOCK_N,
                           BLOCK_M=BLOCK_M, PRECISE=PRECISE, num_warps=4)


_counters: dict = {}


def counters(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(phase counter, timed-out waits) of a device: zeroed int32s the kernel keeps (the counter is
    zero again after every launch; err counts waits that gave up, 0 unless something is wrong).
    One counter a device: two megakernels must not run at once on one GPU (one engine's steps are
    serial on its compute stream; two engines stepping concurrently on one GPU would share it)."""
    key = (device.type, device.index)
    if key not in _counters:
        _counters[key] = (torch.zeros(1, dtype=torch.int32, device=device),
                          torch.zeros(1, dtype=torch.int32, device=device))
    return _counters[key]


def supported(hidden: int, intermediate: int, num_heads: int, num_kv_heads: int, head_dim: int, rows: int,
              num_sms: int) -> str:
    """'' where the kernel takes this shape, else why not."""
    if head_dim != HEAD_DIM.value:
        return f"head_dim {head_dim} (needs {HEAD_DIM.value})"
    if num_heads * head_dim != hidden:
        return f"{num_heads} heads x {head_dim} != hidden {hidden}"
    if hidden % BLOCK_K or intermediate % BLOCK_K:
        return f"hidden {hidden} / intermediate {intermediate} not multiples of {BLOCK_K}"
    if num_heads % num_kv_heads or num_heads // num_kv_heads > ROWS.value:
        return f"{num_heads} query heads over {num_kv_heads} KV heads"
    if hidden // BLOCK_N > num_sms:
        return f"hidden {hidden} needs {hidden // BLOCK_N} programs resident, the GPU has {num_sms} SMs"
    if rows > BLOCK_M:
        return f"{rows} rows (at most {BLOCK_M})"
    return ""


def decode_layers(emb: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, w: dict, kv: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, slot_mapping: torch.Tensor, eps: float,
                  scale: float, num_heads: int, w_slots: int = W_SLOTS, x_slots: int = X_SLOTS,
                  attn_mode: int = ATTN_MODE, kv_paged: int = 1) -> torch.Tensor:
    """All decoder layers of a decode step (one token per row; rows = sequences, M <= 32) in two
    launches: the prologue and the megakernel. emb [M, H] bf16: the step's embeddings. w: stacked
    weights wqkv [L, (Hq + 2 Hkv) 128, H] (q, k, v heads in order), wo [L, H, Hq 128], wgu [L, 2I, H]
    (gate rows, then up rows), wd [L, H, I], n_in [L + 1, H] (each layer's input norm, then the
    final norm), n_post [L, H]. kv [L, 2, pages, page, Hkv, 128] (each layer's K, then V cache, any
    strides but the last; this step's keys are written through slot_mapping). Returns the last
    residual [M, H] (the final norm is left to the caller). w_slots, x_slots, attn_mode, kv_paged: the rings' slots,
    _attn_phase's ATTN and _kv_tiles' KV_PAGED (bench.decode_layers times them)."""
    M, H = emb.shape
    L, NQKV, _ = w["wqkv"].shape
    I = w["wd"].shape[2]
    _, _, _, page, Hkv, D = kv.shape
    assert D == HEAD_DIM.value and NQKV == (num_heads + 2 * Hkv) * D and M <= BLOCK_M
    assert w["wo"].shape == (L, H, num_heads * D) and w["wgu"].shape == (L, 2 * I, H) and w["wd"].shape == (L, H, I)
    assert w["n_in"].shape == (L + 1, H) and w["n_post"].shape == (L, H)
    assert all(t.is_contiguous() and t.dtype == torch.bfloat16 for t in w.values()) and kv.stride(5) == 1
    assert emb.dtype == kv.dtype == torch.bfloat16 and num_heads * D == H
    assert slot_mapping.dtype == torch.int64 and seq_lens.shape[0] == M and block_tables.stride(1) == 1
    dev = emb.device
    bf = dict(dtype=torch.bfloat16, device=dev)
    res, h, xn, hn, attn = (torch.empty(M, H, **bf) for _ in range(5))
    q = torch.empty(M, num_heads, D, **bf)
    a = torch.empty(M, I, **bf)
    ss = torch.empty(2, H // BLOCK_N, BLOCK_M, dtype=torch.float32, device=dev)
    cs = torch.empty(M, D, **bf)
    prologue(emb, w["n_in"][0], positions, inv_freq.float().contiguous(), res, xn, ss[0], cs)
    cnt, err = counters(dev)
    _decode_layers_kernel[(H // BLOCK_N,)](
        xn, q, attn, hn, a, res, h, ss, cs, w["n_in"], w["n_post"], w["wqkv"], w["wo"], w["wgu"], w["wd"], kv,
        block_tables, seq_lens, slot_mapping, cnt, err, eps, scale * 1.4426950408889634, M, L,
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), kv.stride(4), block_tables.stride(0), H=H, I=I,
        HQ=num_heads,
        HKV=Hkv, PAGE=page, BLOCK_N=BLOCK_N, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, W_SLOTS=w_slots, X_SLOTS=x_slots,
        SPIN=SPIN_LIMIT, W_WARPS=4, ATTN=attn_mode, KV_PAGED=int(kv_paged), num_warps=4)
    return res


def stacked_kv(kv_caches: list) -> torch.Tensor:
    """The layers' (K, V) caches as one [L, 2, pages, page, Hkv, D] view: they must be equal-strided
    views of one allocation, evenly spaced (ModelRunner.kv_pool), else ValueError."""
    k0 = kv_caches[0][0]
    elem = k0.element_size()
    s_v = (kv_caches[0][1].data_ptr() - k0.data_ptr()) // elem
    s_l = (kv_caches[1][0].data_ptr() - k0.data_ptr()) // elem if len(kv_caches) > 1 else 2 * s_v
    for layer, (k, v) in enumerate(kv_caches):
        if (k.data_ptr() != k0.data_ptr() + layer * s_l * elem or v.data_ptr() != k.data_ptr() + s_v * elem
                or k.stride() != k0.stride() or v.stride() != k0.stride() or k.shape != k0.shape
                or v.shape != k0.shape or k.untyped_storage().data_ptr() != k0.untyped_storage().data_ptr()):
            raise ValueError("decode_megakernel: the KV caches are not views of one [L, 2, ...] allocation")
    return torch.as_strided(k0, (len(kv_caches), 2) + tuple(k0.shape), (s_l, s_v) + tuple(k0.stride()),
                            k0.storage_offset())
