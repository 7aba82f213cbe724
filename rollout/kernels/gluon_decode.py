"""Split-KV paged decode attention in Gluon with a cp.async ring for the K / V tiles (sm_90 only).

Same math and partials as paged_decode's split kernel, but each program keeps STAGES - 1 tiles in
flight (tile t + STAGES - 1 issued, its pages looked up, before tile t is waited for). Two forms
(FORMS): the query heads as the rows of a 16-row MMA tile (_gluon_decode_split_kernel), or keys as
rows and heads as 8 columns (_gluon_decode_keys_kernel: one split, GROUP <= 8, half the MMAs).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

FORMS = ("heads", "keys")   # what is the MMA's rows: the query heads, or the keys (one split, GROUP <= 8)
ROWS = gl.constexpr(16)   # query rows per program: the MMA's M (GROUP <= 16)


@gluon.jit
def _asm(code: gl.constexpr, t):
    """Side-effecting PTX `code` (no operands of its own), once per thread: t is a scalar int32."""
    return gl.inline_asm_elementwise(code + " mov.u32 $0, $1;", "=r,r", [t], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _enter(PDL: gl.constexpr, b):
    """kernels/pdl.py's `enter` in Gluon; b: any scalar int32."""
    if PDL:
        _asm("griddepcontrol.launch_dependents; griddepcontrol.wait;", b)


@gluon.jit
def _tile_pages(bt_ptr, row_b, n0, rows, end, PAGE_SIZE: gl.constexpr):
    """The page of each key n0 + rows (0 past the split's end: the trash page, never read as data)."""
    pos = n0 + rows
    return gl.load(bt_ptr + row_b + pos // PAGE_SIZE, mask=pos < end, other=0).to(gl.int64)


@gluon.jit
def _issue_tile(k_ring, v_ring, slot, k_ptr, v_ptr, pages, n0, rows, dims, end, kv_off, s_kp, s_ks, s_vp, s_vs,
                PAGE_SIZE: gl.constexpr):
    """cp.async the K and V rows of keys n0 + rows into ring slot `slot`; keys past `end` zero-fill."""
    pos = n0 + rows
    ok = (pos < end)[:, None]
    slot_in_page = (pos % PAGE_SIZE).to(gl.int64)
    k_rows = pages * s_kp + slot_in_page * s_ks + kv_off
    v_rows = pages * s_vp + slot_in_page * s_vs + kv_off
    async_copy.async_copy_global_to_shared(k_ring.index(slot), k_ptr + k_rows[:, None] + dims[None, :], mask=ok)
    async_copy.async_copy_global_to_shared(v_ring.index(slot), v_ptr + v_rows[:, None] + dims[None, :], mask=ok)
    async_copy.commit_group()


@gluon.jit
def _ring_alloc(BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """The K and V rings and the copy layout's key rows and head dims: (k_ring, v_ring, rows, dims)."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // HEAD_DIM, HEAD_DIM // 8], [num_warps, 1], [1, 0])
    smem: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, order=[1, 0])
    k_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], smem)
    v_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], smem)
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld))
    return k_ring, v_ring, rows, dims


@gluon.jit
def _ring_fill(k_ring, v_ring, rows, dims, k_ptr, v_ptr, bt_ptr, row_b, kv_off, start, end, s_kp, s_ks, s_vp, s_vs,
               PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Issue the first STAGES - 1 tiles from key `start`; return the next tile's pages."""
    for j in gl.static_range(STAGES - 1):
        n0 = start + j * BLOCK_N
        _issue_tile(k_ring, v_ring, j, k_ptr, v_ptr, _tile_pages(bt_ptr, row_b, n0, rows, end, PAGE_SIZE), n0, rows,
                    dims, end, kv_off, s_kp, s_ks, s_vp, s_vs, PAGE_SIZE)
    return _tile_pages(bt_ptr, row_b, start + (STAGES - 1) * BLOCK_N, rows, end, PAGE_SIZE)


@gluon.jit
def key_scores(q, k_t, n0, end, cols, scale_log2, mma: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr):
    """q . k of keys n0 + cols, in the log2 domain; keys at or past `end` -inf."""
    s = mma_v2(q, k_t, gl.zeros([ROWS, BLOCK_N], gl.float32, mma)) * scale_log2
    return gl.where(((n0 + cols) < end)[None, :], s, float("-inf"))


@gluon.jit
def softmax_step(s, m_i, l_cols):
    """One key tile of the online softmax -> (new max, weights p, rescale alpha, per-column sums)."""
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)   # all-masked row: no NaN from -inf - -inf
    p = gl.exp2(s - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    return m_new, p, alpha, l_cols * alpha[:, None] + p


@gluon.jit
def _gluon_decode_split_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, po_ptr, plse_ptr, sm_scale_log2,
                               s_qb, s_qh, s_kp, s_ks, s_kh, s_vp, s_vs, s_bt, s_ob, s_oh,
                               GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr,
                               BLOCK_N: gl.constexpr, STAGES: gl.constexpr, NUM_SPLITS: gl.constexpr,
                               PDL: gl.constexpr, num_warps: gl.constexpr):
    b = gl.program_id(0)
    kvh = gl.program_id(1)
    split = gl.program_id(2)
    num_q_heads = gl.num_programs(1) * GROUP
    _enter(PDL, b)                             # q and the cache are the last kernels' output
    seq_len = gl.load(lens_ptr + b)
    split_len = (((seq_len + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    start = split * split_len
    end = gl.minimum(start + split_len, seq_len)
    n_tiles = (gl.maximum(end - start, 0) + BLOCK_N - 1) // BLOCK_N

    row_b = b * s_bt
    kv_off = (kvh * s_kh).to(gl.int64)
    k_ring, v_ring, rows, dims = _ring_alloc(BLOCK_N, HEAD_DIM, STAGES, num_warps)
    pages_next = _ring_fill(k_ring, v_ring, rows, dims, k_ptr, v_ptr, bt_ptr, row_b, kv_off, start, end, s_kp, s_ks,
                            s_vp, s_vs, PAGE_SIZE, BLOCK_N, STAGES)

    # p @ V: the warps split the head dim; q . k: the keys.
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, num_warps], instr_shape=[16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, num_warps], instr_shape=[16, 8])
    a_s: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_s, k_width=2)
    b_s: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma_s, k_width=2)
    q_ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    qr = gl.arange(0, ROWS, layout=gl.SliceLayout(1, q_ld))
    qd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_ld))
    q = gl.load(q_ptr + b * s_qb + (kvh * GROUP + qr)[:, None] * s_qh + qd[None, :], mask=(qr < GROUP)[:, None],
                other=0.0)
    q = gl.convert_layout(q, a_s)

    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_s))
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, mma_s))
    l_cols = gl.zeros([ROWS, BLOCK_N], gl.float32, mma_s)    # running row sums, per column
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, mma)
    for t in range(n_tiles):
        n_issue = start + (t + STAGES - 1) * BLOCK_N
        _issue_tile(k_ring, v_ring, (t + STAGES - 1) % STAGES, k_ptr, v_ptr, pages_next, n_issue, rows, dims, end,
                    kv_off, s_kp, s_ks, s_vp, s_vs, PAGE_SIZE)
        pages_next = _tile_pages(bt_ptr, row_b, n_issue + BLOCK_N, rows, end, PAGE_SIZE)
        async_copy.wait_group(STAGES - 1)
        slot = t % STAGES
        k_t = k_ring.index(slot).permute((1, 0)).load(b_s)
        s = key_scores(q, k_t, start + t * BLOCK_N, end, cols, sm_scale_log2, mma_s, ROWS, BLOCK_N)
        m_i, p, alpha, l_cols = softmax_step(s, m_i, l_cols)
        v_t = v_ring.index(slot).load(b_op)
        alpha = gl.convert_layout(alpha, gl.SliceLayout(1, mma))
        acc = mma_v2(gl.convert_layout(p.to(gl.bfloat16), a_op), v_t, acc * alpha[:, None])
    async_copy.wait_group(0)                   # the zero-filled tail copies, before the program exits

    l_i = gl.convert_layout(gl.sum(l_cols, 1), gl.SliceLayout(1, mma))
    m_i = gl.convert_layout(m_i, gl.SliceLayout(1, mma))
    l_safe = gl.where(l_i > 0.0, l_i, 1.0)     # empty split / padding row -> output 0, lse -inf
    o = acc / l_safe[:, None]
    orow = gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
    od = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, mma))
    if NUM_SPLITS == 1:                        # the output itself, rounded once as Triton's kernel does
        heads = kvh * GROUP + orow
        gl.store(out_ptr + b * s_ob + heads[:, None] * s_oh + od[None, :], o.to(gl.bfloat16),
                 mask=(orow < GROUP)[:, None])
    else:
        lse = gl.where(l_i > 0.0, m_i + gl.log2(l_safe), float("-inf"))
        part = (b * num_q_heads + kvh * GROUP + orow) * NUM_SPLITS + split
        gl.store(po_ptr + part[:, None] * HEAD_DIM + od[None, :], o, mask=(orow < GROUP)[:, None])
        gl.store(plse_ptr + part, lse, mask=orow < GROUP)


HEADS = gl.constexpr(8)   # keys-as-rows form: the query heads of a KV head are the MMA's N (GROUP <= 8)


@gluon.jit
def _gluon_decode_keys_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, sm_scale_log2,
                              s_qb, s_qh, s_kp, s_ks, s_kh, s_vp, s_vs, s_bt, s_ob, s_oh,
                              GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr,
                              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr,
                              EARLY: gl.constexpr, num_warps: gl.constexpr):
    """The one-split kernel with the MMAs transposed (s^T = K q^T, o^T = V^T p^T): the GROUP query
    heads are the MMA's N (8). EARLY: the ring's first tiles are issued before the PDL wait where
    they cannot hold the step's own key (seq_lens and block tables must be uploaded, not computed)."""
    b = gl.program_id(0)
    kvh = gl.program_id(1)
    row_b = b * s_bt
    kv_off = (kvh * s_kh).to(gl.int64)
    k_ring, v_ring, rows, dims = _ring_alloc(BLOCK_N, HEAD_DIM, STAGES, num_warps)
    if EARLY:
        end = gl.load(lens_ptr + b)
        if end > (STAGES - 1) * BLOCK_N:         # both branches commit STAGES - 1 copy groups
            pages_next = _ring_fill(k_ring, v_ring, rows, dims, k_ptr, v_ptr, bt_ptr, row_b, kv_off, 0, end, s_kp,
                                    s_ks, s_vp, s_vs, PAGE_SIZE, BLOCK_N, STAGES)
            _enter(PDL, b)
        else:
            _enter(PDL, b)
            pages_next = _ring_fill(k_ring, v_ring, rows, dims, k_ptr, v_ptr, bt_ptr, row_b, kv_off, 0, end, s_kp,
                                    s_ks, s_vp, s_vs, PAGE_SIZE, BLOCK_N, STAGES)
    else:
        _enter(PDL, b)
        end = gl.load(lens_ptr + b)
        pages_next = _ring_fill(k_ring, v_ring, rows, dims, k_ptr, v_ptr, bt_ptr, row_b, kv_off, 0, end, s_kp, s_ks,
                                s_vp, s_vs, PAGE_SIZE, BLOCK_N, STAGES)
    n_tiles = (end + BLOCK_N - 1) // BLOCK_N

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    q_ld: gl.constexpr = gl.BlockedLayout([8, 1], [16, 2], [1, num_warps], [0, 1])
    qd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, q_ld))
    qh = gl.arange(0, HEADS, layout=gl.SliceLayout(0, q_ld))
    q_t = gl.load(q_ptr + b * s_qb + (kvh * GROUP + qh)[None, :] * s_qh + qd[:, None], mask=(qh < GROUP)[None, :],
                  other=0.0)
    q_t = gl.convert_layout(q_t, b_op)                        # [HEAD_DIM, HEADS], the B operand

    keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    m_i = gl.full([HEADS], float("-inf"), gl.float32, gl.SliceLayout(0, mma))
    l_rows = gl.zeros([BLOCK_N, HEADS], gl.float32, mma)     # running sums, per key row
    acc = gl.zeros([HEAD_DIM, HEADS], gl.float32, mma)       # o^T
    for t in range(n_tiles):
        n_issue = (t + STAGES - 1) * BLOCK_N
        _issue_tile(k_ring, v_ring, (t + STAGES - 1) % STAGES, k_ptr, v_ptr, pages_next, n_issue, rows, dims, end,
                    kv_off, s_kp, s_ks, s_vp, s_vs, PAGE_SIZE)
        pages_next = _tile_pages(bt_ptr, row_b, n_issue + BLOCK_N, rows, end, PAGE_SIZE)
        async_copy.wait_group(STAGES - 1)
        slot = t % STAGES
        s = mma_v2(k_ring.index(slot).load(a_op), q_t, gl.zeros([BLOCK_N, HEADS], gl.float32, mma)) * sm_scale_log2
        s = gl.where(((t * BLOCK_N + keys) < end)[:, None], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 0))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_use[None, :])
        alpha = gl.exp2(m_i - m_use)
        l_rows = l_rows * alpha[None, :] + p
        m_i = m_new
        v_t = v_ring.index(slot).permute((1, 0)).load(a_op)   # V^T [HEAD_DIM, BLOCK_N], the A operand
        acc = mma_v2(v_t, gl.convert_layout(p.to(gl.bfloat16), b_op), acc * alpha[None, :])
    async_copy.wait_group(0)

    l_i = gl.sum(l_rows, 0)
    o = acc / gl.where(l_i > 0.0, l_i, 1.0)[None, :]         # padding row (length 0): output 0
    od = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, mma))
    oh = gl.arange(0, HEADS, layout=gl.SliceLayout(0, mma))
    gl.store(out_ptr + b * s_ob + (kvh * GROUP + oh)[None, :] * s_oh + od[:, None], o.to(gl.bfloat16),
             mask=(oh < GROUP)[None, :])


def decode_split(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale_log2: float, out: torch.Tensor, po: torch.Tensor, plse: torch.Tensor,
                 num_splits: int, block_n: int, stages: int, form: str = "heads", *, pdl: int,
                 num_warps: int = 4, early: bool = False) -> None:
    """paged_decode's split kernel (bf16, head_dim 128, GROUP <= 16, no window) into `out` with one
    split, else fp32 partials po [B, Hq, splits, D] and plse [B, Hq, splits]. form: one of FORMS."""
    B, Hq, D = q.shape
    _, page_size, Hkv, _ = k_cache.shape
    assert q.dtype == k_cache.dtype == v_cache.dtype == out.dtype == torch.bfloat16 and D == 128
    assert Hq // Hkv <= ROWS and v_cache.stride(2) == k_cache.stride(2) and block_n >= 32 and stages >= 2
    assert form in FORMS, form
    keys_a_warp = 16 if form == "keys" else 8       # the MMA's rows (keys form) or columns (heads forms)
    assert block_n % (keys_a_warp * num_warps) == 0, \
        f"{form} form: {num_warps} warps need key tiles of a multiple of {keys_a_warp * num_warps}, got {block_n}"
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
               v_cache.stride(0), v_cache.stride(1), block_tables.stride(0), out.stride(0), out.stride(1))
    if form == "keys":
        assert num_splits == 1 and Hq // Hkv <= HEADS and block_n % 64 == 0, "keys form: one split, GROUP <= 8"
        _gluon_decode_keys_kernel[(B, Hkv)](
            q, k_cache, v_cache, block_tables, seq_lens, out, scale_log2, *strides,
            GROUP=Hq // Hkv, HEAD_DIM=D, PAGE_SIZE=page_size, BLOCK_N=block_n, STAGES=stages, PDL=pdl,
            EARLY=early and bool(pdl), num_warps=num_warps, launch_pdl=bool(pdl))
        return
    _gluon_decode_split_kernel[(B, Hkv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, po, plse, scale_log2, *strides,
        GROUP=Hq // Hkv, HEAD_DIM=D, PAGE_SIZE=page_size, BLOCK_N=block_n, STAGES=stages, NUM_SPLITS=num_splits,
        PDL=pdl, num_warps=num_warps, launch_pdl=bool(pdl))
