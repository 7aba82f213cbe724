"""Triton attention / RoPE kernels under the CPU interpreter, against the torch reference.

TRITON_INTERPRET=1 must be set before triton is first imported (triton decorates its own
standard library at import time), so it is set here, at the top. It stays set for the rest of
this process: triton reads it again at every launch. `tests/gpu` must therefore run as its own
pytest invocation (`python -m pytest tests/gpu`); its kernel test skips itself if it finds the
interpreter on. Conversely, if triton was already imported without the interpreter (tests/gpu
collected first on a CUDA machine) this module skips: run it on its own.

Interpreter limits (triton 3.6): bf16 `tl.dot` returns garbage and fp32->bf16 casts truncate,
so low precision is checked in fp16 here and in bf16 by tests/gpu/test_kernels_cuda.py.
"""
import os
import subprocess
import sys
import textwrap

import pytest

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set (tests/gpu in the same "
                "process?); run `pytest tests/kernels/test_kernels_interpret.py` on its own", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fused_cases import fused_ops_cases  # noqa: E402
from paged_cases import make_paged, meta_for, reference  # noqa: E402
from rollout.layers.attention import paged_attention, write_kv  # noqa: E402
from rollout.kernels.paged_decode import paged_decode_attention  # noqa: E402
from rollout.kernels.paged_prefill import paged_prefill_attention  # noqa: E402
from rollout.kernels.rope_kv import rope_and_write_kv  # noqa: E402
from rollout.models.decoder import apply_rope  # noqa: E402

# fp32: the interpreter's fp32 tl.dot is exact fp32 (numpy matmul), so the only differences
# from the reference are summation order (online softmax rescaling, split merge) and exp2 with
# log2(e) folded into the scale: a few ulp on O(1) values, ~1e-6 observed. 1e-5 is 10x that
# and far below any indexing/masking bug (O(0.1-1)).
FP32_TOL = dict(rtol=1e-5, atol=1e-5)
# fp16 (10-bit mantissa): probabilities are rounded to fp16 before the PV dot and the output is
# rounded to fp16: ~2^-11 relative each on |o| <~ 2; 5e-4 observed.
FP16_TOL = dict(rtol=2e-3, atol=2e-3)


# (Hq, Hkv, page_size, block_n, num_splits, window): GQA 1/2/3/4, tile == / > / < page.
DECODE_CASES = [
    (4, 4, 16, 16, 1, None), (4, 4, 16, 16, 3, 5),
    (8, 4, 16, 32, 1, 20), (8, 4, 16, 32, 3, None),
    (8, 2, 32, 16, 1, None), (8, 2, 32, 16, 3, 20),
    (6, 2, 16, 16, 3, None), (8, 2, 16, 16, 2, 17),
    (8, 2, 16, 16, 8, None), (4, 4, 16, 16, 16, 9),     # pick_num_splits' counts at small batches
]


@pytest.mark.parametrize("Hq,Hkv,ps,block_n,num_splits,window", DECODE_CASES)
def test_decode_fp32(Hq, Hkv, ps, block_n, num_splits, window):
    D, scale = 32, 0.3
    # padding row, 1 token, exactly a page, a page + 1, not a multiple of the tile, long.
    lens = [0, 1, ps, ps + 1, 2 * ps + 7, 83]
    caches, poisoned, bt = make_paged(lens, Hkv, D, ps, torch.float32, seed=Hq * 100 + ps + num_splits)
    q = torch.randn(len(lens), Hq, D)
    meta = meta_for(lens, [1] * len(lens), bt, ps)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, *poisoned, bt, meta.seq_lens, scale, window, num_splits, out=out, block_n=block_n)
    torch.testing.assert_close(out, reference(q, caches, meta, scale, window), **FP32_TOL)  # row 0: zeros


def test_decode_fp16():
    lens, ps, Hq, Hkv, D = [0, 1, 16, 17, 45], 16, 8, 2, 64
    caches, poisoned, bt = make_paged(lens, Hkv, D, ps, torch.float16, seed=7)
    q = torch.randn(len(lens), Hq, D).half()
    meta = meta_for(lens, [1] * len(lens), bt, ps)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, *poisoned, bt, meta.seq_lens, 0.125, None, 2, out=out, block_n=16)
    torch.testing.assert_close(out.float(), reference(q, caches, meta, 0.125, None), **FP16_TOL)


# (context, q_len) per sequence: single token, whole prompt == a page, decode row mid-batch,
# chunk after a prefix (context > chunk, crosses pages and tiles), short chunk, empty sequence.
PREFILL_SEQS = [(1, 1), (16, 16), (17, 1), (45, 23), (33, 3), (0, 0), (20, 20)]
# (Hq, Hkv, page_size, block_m, block_n, window)
PREFILL_CASES = [
    (4, 4, 16, 16, 16, None), (8, 4, 16, 32, 16, 7),
    (8, 2, 32, 16, 32, None), (6, 2, 16, 32, 16, 20),
]


@pytest.mark.parametrize("Hq,Hkv,ps,block_m,block_n,window", PREFILL_CASES)
def test_prefill_fp32(Hq, Hkv, ps, block_m, block_n, window):
    D, scale = 32, 0.3
    lens, qlens = [c for c, _ in PREFILL_SEQS], [n for _, n in PREFILL_SEQS]
    caches, poisoned, bt = make_paged(lens, Hkv, D, ps, torch.float32, seed=Hq + ps + block_m)
    meta = meta_for(lens, qlens, bt, ps)
    q = torch.randn(sum(qlens), Hq, D)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, *poisoned, bt, meta.query_start_loc, meta.seq_lens, scale, window, out=out,
                            block_m=block_m, block_n=block_n)
    torch.testing.assert_close(out, reference(q, caches, meta, scale, window), **FP32_TOL)


def test_prefill_fp16_and_dispatch():
    lens, qlens, ps, Hq, Hkv, D = [40, 5, 30], [40, 1, 12], 16, 8, 2, 64
    caches, poisoned, bt = make_paged(lens, Hkv, D, ps, torch.float16, seed=3)
    meta = meta_for(lens, qlens, bt, ps)
    q = torch.randn(sum(qlens), Hq + 4, D).half()[:, :Hq]           # strided, like a view of the QKV output
    out = paged_attention(q, *poisoned, meta, 0.125)                 # mixed batch -> prefill kernel
    torch.testing.assert_close(out.float(), reference(q, caches, meta, 0.125, None), **FP16_TOL)
    dmeta = meta_for(lens, [1, 1, 1], bt, ps)
    qd = q[:3]
    out = paged_attention(qd, *poisoned, dmeta, 0.125)   # all decode -> split-KV kernel (3 rows x 2 heads: 16 splits)
    torch.testing.assert_close(out.float(), reference(qd, caches, dmeta, 0.125, None), **FP16_TOL)


@pytest.mark.parametrize("qk_norm", [False, True])      # True: Qwen3's per-head RMSNorm of q and k first
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_kv(dtype, qk_norm):
    T, Hq, Hkv, D, ps, pages = 9, 6, 2, 64, 16, 4
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    positions = torch.randint(0, 30000, (T,))
    freqs = positions.float()[:, None] * inv_freq[None, :]          # DecoderLM.rope
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D).to(dtype)             # strided views, as in Attention
    q, k, v = (t.view(T, -1, D) for t in qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1))
    slots = torch.randperm(pages * ps)[:T - 2]                      # last 2 tokens: padding, no slot
    slots[3] = -1                                                   # skipped
    kc, vc = torch.zeros(pages, ps, Hkv, D, dtype=dtype), torch.zeros(pages, ps, Hkv, D, dtype=dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    keep = slots >= 0
    norm, q_in, k_in = None, q, k
    if qk_norm:
        from rollout.models.decoder import RMSNorm
        qn, kn = RMSNorm(D, 1e-6), RMSNorm(D, 1e-6)
        with torch.no_grad():
            qn.weight.copy_(torch.rand(D) + 0.5)
            kn.weight.copy_(torch.rand(D) + 0.5)
        qn, kn = qn.to(dtype), kn.to(dtype)
        norm = (qn.weight.detach(), kn.weight.detach(), 1e-6)
        with torch.no_grad():
            q, k = qn(q), kn(k)           # the reference rotates the normed q and k
    write_kv(apply_rope(k, cos, sin)[:T - 2][keep], v[:T - 2][keep], kc_ref, vc_ref, slots[keep])
    out = rope_and_write_kv(q_in, k_in, v, positions, inv_freq, kc, vc, slots, qk_norm=norm)
    # fp32: numpy's and torch's fp32 cos/sin may differ by an ulp. fp16: casts round to nearest
    # even in both, so the per-op rounding emulation is bit-exact (observed; cos/sin ulp flips
    # could rarely break a tie, hence a one-ulp-sized tolerance rather than equality). With QK-norm the
    # mean of squares is summed in another order than torch's: the normed value may round an ulp apart.
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(out, apply_rope(q, cos, sin), **tol)
    torch.testing.assert_close(kc, kc_ref, **tol)
    assert torch.equal(vc, vc_ref)


@pytest.mark.parametrize("block_n,T,split_k", [(32, 5, 1), (16, 16, 1), (32, 1, 1), (32, 5, 2), (16, 3, 4)])
def test_qkv_gemm_with_rope_epilogue_gives_the_two_kernel_bits(block_n, T, split_k):
    """qkv_rope_and_write_kv: the QKV GEMM whose epilogue rotates q and k and writes K/V to the
    cache gives the same q, cache and untouched-slot bits as skinny_gemm (with the same split-K)
    then rope_and_write_kv. block_n / 2 = 16 frequency pairs (a whole half-head, D = 32) or 8
    (two programs per head); with split-K the tile's last program sums the partials, resets the
    counters (a second call gives the same bits) and does the epilogue. Slot -1 and tokens past
    slot_mapping are not written. fp16 (the interpreter's bf16 dot is broken). Rotating with the
    wrong half is caught."""
    from rollout.kernels import skinny_gemm as sg
    from rollout.kernels.rope_kv import qkv_rope_and_write_kv
    Hq, Hkv, D, ps, K = 4, 2, 32, 16, 256
    g = torch.Generator().manual_seed(block_n + T)
    x = torch.randn(T, K, generator=g).half()
    w = (torch.randn((Hq + 2 * Hkv) * D, K, generator=g) / 8).half()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    positions = torch.randint(0, 3000, (T,), generator=g)
    slots = torch.tensor([3, -1, 40, 8, 17][:max(T - 1, 1)])
    caches = {k: [torch.full((4, ps, Hkv, D), float("nan"), dtype=torch.float16) for _ in range(2)] for k in "ab"}
    qkv = sg.skinny_gemm(x, w, block_n, 64, 4, 2, split_k)
    q, k, v = (t.view(T, -1, D) for t in qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1))
    want = rope_and_write_kv(q, k, v, positions, inv_freq, *caches["a"], slots)
    got = qkv_rope_and_write_kv(x, w, Hq, positions, inv_freq, *caches["b"], slots, block_n, 64, 4, 2, split_k)
    assert torch.equal(got, want)
    for a, b in zip(caches["a"], caches["b"]):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    assert caches["b"][0].isnan().sum() == caches["a"][0].isnan().sum() > 0   # only the slots given
    if split_k > 1:
        assert int(sg._COUNTERS[x.device][:(Hq + 2 * Hkv) * D // block_n].abs().sum()) == 0
        again = qkv_rope_and_write_kv(x, w, Hq, positions, inv_freq, *caches["b"], slots, block_n, 64, 4, 2, split_k)
        assert torch.equal(again, want)
    w_swapped = w.view(Hq + 2 * Hkv, 2, D // 2, K).flip(1).reshape(w.shape)
    bad = qkv_rope_and_write_kv(x, w_swapped, Hq, positions, inv_freq, *caches["b"], slots, block_n, 64, 4, 2,
                                split_k)
    assert not torch.equal(bad, want)


def test_pack_weight_tiles_puts_each_programs_rows_in_reading_order():
    """pack_weight_tiles' strided views against the rows each program reads, written out: tile t,
    K tile j holds rows rows[t] and columns [j BK, (j + 1) BK). Packing into `out` keeps its storage."""
    from rollout.kernels import skinny_gemm as sg
    N, K, BN, BK, D = 96, 64, 16, 16, 32
    w = torch.arange(N * K, dtype=torch.float32).view(N, K)
    t, r = torch.arange(N // BN)[:, None], torch.arange(BN)[None, :]
    half, pairs = D // 2, BN // 2
    rows = {"rows": t * BN + r,
            "silu": torch.where(r < BN // 2, t * (BN // 2) + r, N // 2 + t * (BN // 2) + r - BN // 2),
            "rope": (t // (half // pairs)) * D + (t % (half // pairs)) * pairs + r % pairs + (r >= pairs) * half}
    for order, idx in rows.items():
        want = w[idx.reshape(-1)].view(N // BN, BN, K // BK, BK).permute(0, 2, 1, 3)
        out = torch.empty(N // BN, K // BK, BN, BK)
        got = sg.pack_weight_tiles(w, BN, BK, order, D, out=out)
        assert got.data_ptr() == out.data_ptr() and torch.equal(got, want), order
        assert sorted(idx.reshape(-1).tolist()) == list(range(N))      # every row once
    with pytest.raises(ValueError, match="unknown packing order"):
        sg.pack_weight_tiles(w, BN, BK, "cols")


@pytest.mark.parametrize("order,cfg,M", [("rows", (32, 64, 4, 2, 1), 5), ("rows", (64, 64, 4, 2, 2), 16),
                                         ("partials", (32, 64, 4, 2, 4), 3), ("silu", (64, 64, 4, 2, 1), 7),
                                         ("rope", (32, 64, 4, 2, 1), 5), ("rope", (16, 64, 4, 2, 2), 3)])
def test_packed_weight_tiles_give_the_plain_layout_bits(order, cfg, M):
    """The skinny GEMM (plain, split-K, its partials, the SiLU epilogue) and the QKV + RoPE kernel
    read a pack_weight_tiles weight with TILED and give the plain layout's bits; a weight packed
    in another order does not. fp16 (the interpreter's bf16 dot is broken)."""
    from rollout.kernels import skinny_gemm as sg
    from rollout.kernels.rope_kv import qkv_rope_and_write_kv
    g = torch.Generator().manual_seed(M + cfg[0])
    Hq, Hkv, D, K = 4, 2, 32, 256
    x = torch.randn(M, K, generator=g).half()
    w = (torch.randn((Hq + 2 * Hkv) * D, K, generator=g) / 8).half()
    if order == "rope":
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
        positions, slots = torch.randint(0, 3000, (M,), generator=g), torch.arange(M) * 3

        def run(weight, tiled):
            caches = [torch.zeros((4, 16, Hkv, D), dtype=torch.float16) for _ in range(2)]
            q = qkv_rope_and_write_kv(x, weight, Hq, positions, inv_freq, *caches, slots, *cfg, tiled=tiled)
            return torch.cat([q.reshape(-1), caches[0].reshape(-1), caches[1].reshape(-1)])
    else:
        def run(weight, tiled):
            return sg.skinny_gemm(x, weight, *cfg, tiled=tiled, partials=order == "partials",
                                  silu_mul=order == "silu")
    kernel_order = "rows" if order == "partials" else order
    want = run(w, False)
    assert torch.equal(run(sg.pack_weight_tiles(w, cfg[0], cfg[1], kernel_order, D), True), want)
    other = "rows" if kernel_order == "silu" else "silu"   # ("rope" with a whole head per tile is "rows")
    assert not torch.equal(run(sg.pack_weight_tiles(w, cfg[0], cfg[1], other, D), True), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_ops(dtype):
    for name, got, want in fused_ops_cases("cpu", dtype):
        # fp32: summation order only (~1e-6). bf16: the interpreter truncates on bf16 casts
        # where the GPU rounds to nearest (measured: 1-ulp differences in 26-72% of elements,
        # even for the plain add), and "normed" rounds twice: two ulps (< 2**-6 relative).
        # tests/gpu/test_kernels_cuda.py holds the GPU to one ulp.
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2 ** -7, rtol=2 ** -6)
        torch.testing.assert_close(got, want, **tol, msg=name)


@pytest.mark.parametrize("split_k", [1, 2, 4])
def test_skinny_gemm_split_k(split_k):
    """The decode GEMM (fp32 here: the interpreter's fp32 dot is exact numpy, so only summation
    order differs from torch, ~1e-6 on these O(1) sums; 1e-5 catches a lost or doubled split).
    N = 96 is not a multiple of BLOCK_N (masked tail); the counters are back at 0 after each
    call, so a second call (as a graph replay would) gives the same bits."""
    from rollout.kernels import skinny_gemm as sg
    g = torch.Generator().manual_seed(split_k)
    x, w, b = torch.randn(5, 512, generator=g), torch.randn(96, 512, generator=g) / 16, torch.randn(96, generator=g)
    out = torch.full((5, 96), float("nan"))
    sg.skinny_gemm(x, w, 64, 64, 4, 2, split_k, out=out, bias=b)
    torch.testing.assert_close(out, x @ w.T + b, atol=1e-5, rtol=1e-5)
    if split_k > 1:
        assert int(sg._COUNTERS[x.device][:2].abs().sum()) == 0
    again = sg.skinny_gemm(x, w, 64, 64, 4, 2, split_k, bias=b)
    assert torch.equal(again, out)
    with pytest.raises(AssertionError, match="do not split"):
        sg.skinny_gemm(x, w, 64, 64, 4, 2, 3)

@pytest.mark.parametrize("split_k", [2, 4])
def test_split_k_partials_summed_by_the_norm_give_the_fixup_bits(split_k):
    """skinny_gemm(partials=True) leaves its split-K partials to add_rmsnorm, which sums them in
    split order and rounds once: the same bits (normed and residual) as the GEMM's own fix-up
    followed by the plain add_rmsnorm. fp16 (the interpreter's bf16 dot is broken). The partials
    path refuses what it cannot do (no split, a bias)."""
    from rollout.kernels import skinny_gemm as sg
    from rollout.kernels.fused_ops import add_rmsnorm
    g = torch.Generator().manual_seed(split_k)
    x = torch.randn(5, 512, generator=g).half()
    w = (torch.randn(96, 512, generator=g) / 16).half()
    res, nw = torch.randn(5, 96, generator=g).half(), (1 + 0.1 * torch.randn(96, generator=g)).half()
    parts = sg.skinny_gemm(x, w, 64, 64, 4, 2, split_k, partials=True)
    assert parts.shape == (split_k, 5, 96) and parts.dtype == torch.float32
    want = add_rmsnorm(res, nw, 1e-5, delta=sg.skinny_gemm(x, w, 64, 64, 4, 2, split_k))
    got = add_rmsnorm(res, nw, 1e-5, delta=parts)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[1].float(), res.float() + (x.float() @ w.float().T), **FP16_TOL)
    with pytest.raises(AssertionError, match="partials"):
        sg.skinny_gemm(x, w, 64, 64, 4, 2, 1, partials=True)
    with pytest.raises(AssertionError, match="partials"):
        sg.skinny_gemm(x, w, 64, 64, 4, 2, split_k, partials=True, bias=nw)



@pytest.mark.parametrize("block_n,M", [(64, 5), (128, 16), (32, 33)])
def test_gate_up_gemm_with_silu_epilogue_gives_the_two_kernel_bits(block_n, M):
    """skinny_gemm(silu_mul=True) on a fused gate_up weight (gate rows, then up rows): each program
    takes block_n / 2 gate rows and their up rows as one tile and writes silu(gate) * up, the bits
    of the plain GEMM followed by fused_ops.silu_mul. I = 96 is not a multiple of block_n / 2 = 64
    (masked tail). fp16 (the interpreter's bf16 dot is broken). Swapping gate and up is caught."""
    from rollout.kernels import skinny_gemm as sg
    from rollout.kernels.fused_ops import silu_mul
    inter, K = 96, 256
    g = torch.Generator().manual_seed(block_n + M)
    x = torch.randn(M, K, generator=g).half()
    w = (torch.randn(2 * inter, K, generator=g) / 8).half()
    want = silu_mul(sg.skinny_gemm(x, w, block_n, 64, 4, 2))
    out = sg.skinny_gemm(x, w, block_n, 64, 4, 2, silu_mul=True)
    assert out.shape == (M, inter)
    assert torch.equal(out, want)
    swapped = sg.skinny_gemm(x, torch.cat([w[inter:], w[:inter]]), block_n, 64, 4, 2, silu_mul=True)
    assert not torch.equal(swapped, want)
    gu = x.float() @ w.float().T
    torch.testing.assert_close(out.float(), F.silu(gu[:, :inter]) * gu[:, inter:], **FP16_TOL)
    with pytest.raises(AssertionError, match="silu_mul"):
        sg.skinny_gemm(x, w, block_n, 64, 4, 2, 2, silu_mul=True)


def test_splitk_into_norm_takes_the_partials_path_with_the_same_bits(monkeypatch):
    """Gemms.add_norm with splitk_into_norm: where the skinny config splits K (here a split-K
    config stands in for the GPU-only table lookup), the GEMM's partials go to the norm kernel,
    and the result equals the fix-up GEMM then add_rmsnorm bit for bit."""
    from rollout.env import KernelSwitches
    from rollout.kernels import skinny_gemm as sg
    from rollout.layers import linear
    from rollout.models import decoder
    monkeypatch.setattr(linear, "skinny_config", lambda lin, x, overrides=None: (64, 64, 4, 2, 2))
    calls = []
    inner = sg.skinny_gemm
    monkeypatch.setattr(sg, "skinny_gemm", lambda *a, **k: (calls.append(k.get("partials", False)), inner(*a, **k))[1])
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(512, 96, bias=False).half()
    with torch.no_grad():
        lin.weight.copy_(torch.randn(96, 512, generator=g) / 16)
    norm = decoder.RMSNorm(96, 1e-5).half()
    x, res = torch.randn(5, 512, generator=g).half(), torch.randn(5, 96, generator=g).half()
    want = linear.Gemms("skinny", KernelSwitches(splitk_into_norm=False)).add_norm(lin, x, res, norm)
    got = linear.Gemms("skinny", KernelSwitches(splitk_into_norm=True)).add_norm(lin, x, res, norm)
    assert calls == [False, True]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])



@pytest.mark.parametrize("qkv_split", [1, 2])
def test_engine_fused_gemm_paths_give_the_same_bits(monkeypatch, qkv_split):
    """The tiny model through the engine on the Triton backend (fp32, interpreter), with configs
    standing in for the GPU-only skinny-GEMM table (split-K for o_proj and down_proj; none for
    gate_up, and for qkv a 32-row tile, 16 frequency pairs of a 32-wide head, split-K or not): with
    `splitk_into_norm` the o_proj and down_proj partials go to the add + RMSNorm kernel, with
    `silu_in_gate_up` the gate_up GEMM writes SiLU * up itself, with `rope_in_qkv` the QKV GEMM
    rotates q and k and writes the K/V cache. Tokens and logprobs are bit-equal to the plain
    kernels'."""
    from engine_ab import TINY_PROMPTS, tiny_params, tiny_triton_engine
    from rollout.env import KernelSwitches
    from rollout.kernels import skinny_gemm as sg
    from rollout.layers import linear

    def config(lin, x, overrides=None):
        n, k = lin.weight.shape
        return (None if x.shape[0] > 64 or k % 128 else (64, 64, 4, 2, 1) if n == 2 * 768 else
                (32, 64, 4, 2, qkv_split) if n == (8 + 2 * 2) * 32 else (64, 64, 4, 2, 2))
    monkeypatch.setattr(linear, "skinny_config", config)
    calls = []
    inner = sg.skinny_gemm
    monkeypatch.setattr(sg, "skinny_gemm", lambda *a, **k: (calls.append((a[1].shape[0], k)), inner(*a, **k))[1])
    from rollout.kernels import rope_kv
    rope_inner = rope_kv.qkv_rope_and_write_kv
    monkeypatch.setattr(rope_kv, "qkv_rope_and_write_kv",
                        lambda *a, **k: (calls.append((-1, {})), rope_inner(*a, **k))[1])
    outs = {}
    for on in (False, True):
        eng = tiny_triton_engine()
        eng.model.use_kernel_switches(KernelSwitches(splitk_into_norm=on, silu_in_gate_up=on, rope_in_qkv=on))
        calls.clear()
        outs[on] = eng.generate(TINY_PROMPTS, tiny_params(), use_tqdm=False)
        assert {n for n, kw in calls if kw.get("partials")} == ({256} if on else set())   # o_proj, down_proj
        assert any(kw.get("silu_mul") for _, kw in calls) == on    # gate_up (intermediate 768, K 256)
        assert any(n == -1 for n, _ in calls) == on                # the QKV GEMM with the RoPE epilogue
    for a, b in zip(outs[False], outs[True]):
        assert a.completions[0].token_ids == b.completions[0].token_ids
        assert a.completions[0].logprobs == b.completions[0].logprobs


def test_batch_invariant_gemm_rows_do_not_depend_on_their_batch():
    """Batch-invariant mode's GEMM (fixed weight tiles; 16- to 64-row x tiles): each row of x gives the same bits
    alone, in any subset and in the full 150-row product (3 M tiles, a masked tail), and matches
    torch. fp16 (the interpreter's bf16 dot is broken): one rounding of an fp32 sum of 256
    products of O(1/16) values, ~1e-3 relative; 2e-3 is FP16_TOL. On the GPU the same property is
    tests/gpu/test_batch_invariant_cuda.py's, where tile shapes do change the MMA schedule."""
    from rollout.layers.linear import batch_invariant_gemm
    g = torch.Generator().manual_seed(3)
    x = torch.randn(150, 256, generator=g).half()
    w, b = (torch.randn(96, 256, generator=g) / 16).half(), torch.randn(96, generator=g).half()
    full = batch_invariant_gemm(x, w, b)
    torch.testing.assert_close(full.float(), x.float() @ w.float().T + b.float(), **FP16_TOL)
    for rows in ([0], [149], [5, 17, 140], list(range(64, 130))):
        assert torch.equal(batch_invariant_gemm(x[rows], w, b), full[rows]), rows
    with pytest.raises(ValueError, match="bf16 or fp16"):
        batch_invariant_gemm(x.float(), w.float())


def test_batch_invariant_gemm_configs_come_from_the_swept_decode_table():
    """Each 8B weight's invariant config is one of its swept decode configs without split-K, the
    one for the largest M <= 32 where there is one (down_proj's M = 32 config splits K)."""
    from rollout.layers import linear
    assert set(linear.INVARIANT_CONFIGS) == set(linear.SKINNY_CONFIGS)
    for nk, cfg in linear.INVARIANT_CONFIGS.items():
        assert len(cfg) == 4 and cfg in [c[:4] for _, c in linear.SKINNY_CONFIGS[nk]
                                         if c is not None and c[4:] in ((), (1,))]
    assert linear.INVARIANT_CONFIGS[(4096, 14336)] == linear.pick_config(4096, 14336, 16)
    assert linear.INVARIANT_CONFIGS[(28672, 4096)] == linear.pick_config(28672, 4096, 32)


@pytest.mark.parametrize("dtype,window", [(torch.float16, None), (torch.float16, 50), (torch.float32, 50)])
def test_batch_invariant_attention_rows_are_the_same_bits_in_every_batch(monkeypatch, dtype, window):
    """With meta.batch_invariant every batch takes the varlen kernel with KV cut at fixed
    positions (split_len 64 here, so contexts of up to 200 keys span 4 splits): a decode step
    runs a program per split plus a merge kernel, any other step folds the splits in the tile.
    A sequence's row must be the same bits alone, in a decode batch, beside another sequence's
    prefill chunk, and as the last query of a re-prefill of its own sequence (recompute).
    fp32 outputs show every bit of the fp32 arithmetic (fp16 would round most differences away)."""
    from dataclasses import replace

    from rollout.layers import attention
    monkeypatch.setattr(attention, "INVARIANT_SPLIT_LEN", 64)
    lens, ps, Hq, Hkv, D = [200, 5, 130, 64], 16, 8, 2, 64
    caches, poisoned, bt = make_paged(lens, Hkv, D, ps, dtype, seed=9)
    q = torch.randn(4, Hq, D).to(dtype)
    tol = FP32_TOL if dtype == torch.float32 else FP16_TOL
    dmeta = replace(meta_for(lens, [1, 1, 1, 1], bt, ps), batch_invariant=True)
    out = paged_attention(q, *poisoned, dmeta, 0.125, window)
    torch.testing.assert_close(out.float(), reference(q, caches, dmeta, 0.125, window), **tol)
    # the decode path (split programs + merge) against the folding path on the same rows
    fold = paged_prefill_attention(q, *poisoned, bt, dmeta.query_start_loc, dmeta.seq_lens, 0.125, window,
                                   split_len=64, out=torch.full_like(q, float("nan")), **attention.INVARIANT_TILE)
    split = paged_prefill_attention(q, *poisoned, bt, dmeta.query_start_loc, dmeta.seq_lens, 0.125, window,
                                    split_len=64, decode_rows=True, out=torch.full_like(q, float("nan")),
                                    **attention.INVARIANT_TILE)       # poisoned outputs: every row is written
    assert torch.equal(out, fold) and torch.equal(out, split)
    for i in range(4):      # each row alone
        alone = replace(meta_for(lens[i:i + 1], [1], bt[i:i + 1], ps), batch_invariant=True)
        assert torch.equal(paged_attention(q[i:i + 1], *poisoned, alone, 0.125, window), out[i:i + 1]), i
    # sequence 2's decode row next to a 12-token chunk of sequence 0 (a mixed step)
    mixed = replace(meta_for([lens[0], lens[2]], [12, 1], bt[[0, 2]], ps), batch_invariant=True)
    qm = torch.cat([torch.randn(12, Hq, D).to(dtype), q[2:3]])
    assert torch.equal(paged_attention(qm, *poisoned, mixed, 0.125, window)[12:], out[2:3])
    # recompute: sequence 0 re-prefilled in one 40-query chunk ending at its decode position,
    # its decode row the last query of a 64-row tile whose other rows see fewer keys
    chunk = replace(meta_for(lens[:1], [40], bt[:1], ps), batch_invariant=True)
    qc = torch.cat([torch.randn(39, Hq, D).to(dtype), q[:1]])
    res = paged_attention(qc, *poisoned, chunk, 0.125, window)
    assert torch.equal(res[39:], out[:1])
    torch.testing.assert_close(res.float(), reference(qc, caches, chunk, 0.125, window), **tol)


def test_decode_split_count_fills_the_gpu_once():
    """pick_num_splits: the most splits whose grid fits on the GPU at once (PROGRAMS_PER_SM per
    SM): the old ~2-waves rule gave B = 8 five splits and B = 16 three (320 and 384 programs), and
    the H200's decode graphs were 4 and 2 points of roofline faster at 8 and 4 (512 programs);
    no grid above one resident wave unless one split is already too many."""
    from rollout.layers.attention import PROGRAMS_PER_SM, pick_num_splits
    got = {B: pick_num_splits(B, 8, num_sms=132) for B in (1, 2, 4, 8, 16, 24, 32, 64, 512)}
    assert got == {1: 16, 2: 16, 4: 16, 8: 8, 16: 4, 24: 2, 32: 2, 64: 1, 512: 1}
    for B, ns in got.items():
        assert ns == 1 or B * 8 * ns <= PROGRAMS_PER_SM * 132
    assert pick_num_splits(64, 2, num_sms=132) == 4 and pick_num_splits(8, 8, num_sms=66) == 4


def test_decode_kernel_choice_takes_gluon_with_one_split_only_where_that_is_one_wave_of_two_a_sm(monkeypatch):
    """pick_decode: the Gluon kernel, one split, where batch x KV heads programs fill the GPU at 1-2
    a SM (P1 / P5: 32 x 8 on 132 SMs); Triton at pick_num_splits elsewhere, where the Gluon kernel
    is not supported or switched off (gluon_ok False)."""
    from rollout.kernels import paged_decode
    from rollout.layers.attention import pick_decode, pick_num_splits
    got = {B: pick_decode(B, 8, num_sms=132, gluon_ok=True) for B in (8, 16, 17, 24, 32, 33, 64, 512)}
    assert got == {8: (8, False), 16: (4, False), 17: (1, True), 24: (1, True), 32: (1, True), 33: (1, True),
                   64: (1, False), 512: (1, False)}
    assert pick_decode(32, 8, num_sms=132) == (pick_num_splits(32, 8, num_sms=132), False) == (2, False)
    q = torch.zeros(2, 32, 128, dtype=torch.bfloat16)         # CPU (and the interpreter): never Gluon
    assert not paged_decode.gluon_supported(q, torch.zeros(4, 16, 8, 128, dtype=torch.bfloat16), None)


def test_gluon_call_takes_the_keys_form_only_where_it_applies(monkeypatch):
    """paged_decode_attention(gluon=True) in the keys form: the keys kernel for one split
    at GROUP <= 8, the heads form at the same tile for several splits or GROUP > 8 (the kernel
    itself is GPU-only: decode_split is recorded here, not run)."""
    from rollout.kernels import gluon_decode, paged_decode
    calls = []
    monkeypatch.setattr(paged_decode, "gluon_supported", lambda *a: True)
    monkeypatch.setattr(gluon_decode, "decode_split", lambda *a, **k: calls.append((a[9],) + a[10:13]))
    bt, lens = torch.zeros(2, 4, dtype=torch.int32), torch.full((2,), 30, dtype=torch.int32)
    for Hq, Hkv, ns in ((32, 8, 1), (32, 8, 2), (16, 1, 1), (16, 2, 1)):
        q = torch.zeros(2, Hq, 128, dtype=torch.bfloat16)
        cache = torch.zeros(4, 16, Hkv, 128, dtype=torch.bfloat16)
        paged_decode.paged_decode_attention(q, cache, cache, bt, lens, 0.1, None, ns, gluon=True, block_n=64,
                                            num_stages=3, form="keys")
    assert calls == [(1, 64, 3, "keys"), (2, 64, 3, "heads"), (1, 64, 3, "heads"), (1, 64, 3, "keys")]


def test_gluon_decode_refuses_more_warps_than_its_key_tile_spreads_over():
    """gluon_decode.decode_split: every warp takes whole MMA tiles of keys (16 keys a warp as the
    keys form's rows, 8 as the heads forms' columns), so 8 warps need 128- / 64-key tiles; refused
    before any launch."""
    from rollout.kernels import gluon_decode
    q = torch.zeros(2, 32, 128, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 8, 128, dtype=torch.bfloat16)
    bt, lens = torch.zeros(2, 4, dtype=torch.int32), torch.full((2,), 30, dtype=torch.int32)
    for block_n, form in ((64, "keys"), (32, "heads")):
        with pytest.raises(AssertionError, match="8 warps need key tiles"):
            gluon_decode.decode_split(q, cache, cache, bt, lens, 0.1, q, q, q, 1, block_n, 2, form, pdl=0, num_warps=8)


def test_compiles_for_sm90(tmp_path):
    """The interpreter runs kernels as Python: it misses compile-time errors (loop-carried
    constexprs, layout/shape rules of tl.dot). Compile each kernel ahead of time for sm_90 with
    triton's bundled ptxas, in a subprocess without the interpreter. No GPU needed.
    The decode kernels are also compiled with programmatic dependent launch (kernels/pdl.py),
    and their PTX must keep its rule: `griddepcontrol.wait` before the first global store, and
    (except the GEMM, which loads its first weight tile early) before the first global load;
    and `griddepcontrol.launch_dependents`."""
    code = textwrap.dedent("""
        import re
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from rollout.kernels import paged_decode as pd, paged_prefill as pp, rope_kv as rk, fused_ops as fo
        from rollout.kernels import skinny_gemm as sg
        from rollout.layers import linear as li
        PTR = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16", "qo_ptr": "*bf16",
               "kc_ptr": "*bf16", "vc_ptr": "*bf16", "po_ptr": "*fp32", "plse_ptr": "*fp32", "bt_ptr": "*i32",
               "lens_ptr": "*i32", "qsl_ptr": "*i32", "pos_ptr": "*i64", "inv_freq_ptr": "*fp32", "slot_ptr": "*i64",
               "x_ptr": "*bf16", "d_ptr": "*bf16", "w_ptr": "*bf16", "res_ptr": "*bf16", "gu_ptr": "*bf16",
               "b_ptr": "*bf16", "y_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "wml_ptr": "*fp32",
               "ids_ptr": "*i64", "sorted_ptr": "*i32", "expert_ptr": "*i32", "npost_ptr": "*i32", "counts_ptr": "*i32",
               "a_ptr": "*bf16", "topw_ptr": "*fp32", "qn_ptr": "*bf16", "kn_ptr": "*bf16"}
        def compile_(fn, pdl=False, early_loads=False, ptrs=None, **const):
            const = dict(const, PDL=pdl) if "PDL" in fn.arg_names else const
            if "TILED" in fn.arg_names:     # the plain weight layout unless a call says packed
                const.setdefault("TILED", False)
            sig, attrs = {}, {}
            for i, name in enumerate(fn.arg_names):
                scalar = "fp32" if name in ("sm_scale_log2", "eps") else "i32"
                sig[name] = "constexpr" if name in const else (ptrs or {}).get(name, PTR.get(name, scalar))
                if name in PTR or name.startswith("s_"):     # as the JIT specialises 16-divisible args
                    attrs[(i,)] = [["tt.divisibility", 16]]
            k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                               target=GPUTarget("cuda", 90, 32),
                               options=dict(num_warps=4, num_stages=2, launch_pdl=bool(pdl)))
            if pdl:
                ptx = k.asm["ptx"]
                wait = ptx.find("griddepcontrol.wait")
                assert wait >= 0 and "griddepcontrol.launch_dependents" in ptx, fn.__name__
                first = lambda *ops: min([ptx.find(op) for op in ops if op in ptx] or [len(ptx)])
                assert wait < first("st.global"), fn.__name__ + ": a store before the wait"
                if not early_loads:
                    assert wait < first("ld.global", "cp.async"), fn.__name__ + ": a load before the wait"
        common = dict(HEAD_DIM=128, PAGE_SIZE=16, BLOCK_N=64, DOT_PREC="tf32")
        compile_(pd._decode_split_kernel, GROUP=4, GROUP_PAD=16, NUM_SPLITS=2, USE_WINDOW=True, **common)
        compile_(pd._decode_merge_kernel, HEAD_DIM=128, NUM_SPLITS=3, SPLITS_PAD=4)
        for split, programs in ((0, False), (1024, False), (1024, True)):    # normal; batch-invariant
            compile_(pp._prefill_kernel, split > 0, GROUP=7, BLOCK_Q=9, BLOCK_M=64, USE_WINDOW=True,
                     SPLIT_LEN=split, SPLIT_PROGRAMS=programs, MAX_SPLITS=17, **common)
        compile_(pp._decode_merge_kernel, True, GROUP=4, GROUP_PAD=4, HEAD_DIM=128, SPLIT_LEN=1024, MAX_SPLITS=17)
        compile_(rk._rope_kv_kernel, HQ=28, HKV=4, Q_HEADS=8, HKV_PAD=4, HALF=64, QK_NORM=False, PRECISE=True)
        compile_(rk._rope_kv_kernel, HQ=32, HKV=4, Q_HEADS=8, HKV_PAD=4, HALF=64, QK_NORM=True, PRECISE=True)
        compile_(fo._add_rmsnorm_kernel, HAS_DELTA=True, DELTA_PARTIALS=0, BLOCK=4096)
        compile_(fo._silu_mul_kernel, BLOCK=1024)
        for pdl in (0, 1):    # off; launch dependents, then wait
            compile_(pd._decode_split_kernel, pdl, GROUP=4, GROUP_PAD=16, NUM_SPLITS=3, USE_WINDOW=False, **common)
            compile_(pd._decode_merge_kernel, pdl, HEAD_DIM=128, NUM_SPLITS=3, SPLITS_PAD=4)
            compile_(rk._rope_kv_kernel, pdl, HQ=32, HKV=8, Q_HEADS=8, HKV_PAD=8, HALF=64, QK_NORM=pdl == 1,
                     PRECISE=False)
            for split in (1, 2):     # QKV GEMM + RoPE + K/V write epilogue (after the split-K fix-up)
                compile_(rk._qkv_rope_kernel, pdl, early_loads=True, HQ=32, HKV=8, HALF=64, BLOCK_M=32,
                         BLOCK_N=64 * split, BLOCK_K=128, SPLIT_K=split, PRECISE=True, TILED=split == 2,
                         ptrs=None if split > 1 else {"ws_ptr": "*bf16", "cnt_ptr": "*bf16"})   # as passed
            compile_(fo._add_rmsnorm_kernel, pdl, HAS_DELTA=True, DELTA_PARTIALS=2 if pdl else 0, BLOCK=4096)
            compile_(fo._silu_mul_kernel, pdl, BLOCK=1024)
            for split in (1, 2):
                compile_(sg._skinny_gemm_kernel, pdl, early_loads=True, BLOCK_M=32, BLOCK_N=64, BLOCK_K=128,
                         EVEN_N=split == 1, HAS_BIAS=split == 2, SPLIT_K=split, PARTIALS=False, SILU_MUL=False,
                         TILED=split == 1)
            compile_(sg._skinny_gemm_kernel, pdl, early_loads=True, BLOCK_M=32, BLOCK_N=64, BLOCK_K=128,
                     EVEN_N=True, HAS_BIAS=False, SPLIT_K=2, PARTIALS=True, SILU_MUL=False, TILED=False,
                     ptrs={"cnt_ptr": "*bf16"})   # as skinny_gemm passes it (unused): no fix-up atomics built
            compile_(sg._skinny_gemm_kernel, pdl, early_loads=True, BLOCK_M=li.INVARIANT_BLOCK_M,   # batch-invariant
                     BLOCK_N=li.invariant_block_n(4096), BLOCK_K=128, EVEN_N=True, HAS_BIAS=False, SPLIT_K=1,
                     PARTIALS=False, SILU_MUL=False)
            compile_(sg._skinny_gemm_kernel, pdl, early_loads=True, BLOCK_M=32, BLOCK_N=128, BLOCK_K=128,   # gate_up
                     EVEN_N=True, HAS_BIAS=False, SPLIT_K=1, PARTIALS=False, SILU_MUL=True)    # + SiLU epilogue
        from rollout.kernels import fused_moe as fm
        from rollout.layers import moe
        compile_(fm._moe_count_kernel, E_PAD=128, CHUNK=128)     # fused MoE: the sort, both grouped GEMMs
        compile_(fm._moe_offsets_kernel, BLOCK_M=16, E_PAD=128, ROWS=16)
        compile_(fm._moe_offsets_kernel, BLOCK_M=128, E_PAD=128, ROWS=16)     # long prefill's padding fill
        compile_(fm._moe_align_one_kernel, BLOCK_M=16, E_PAD=128, CHUNK=128, ROWS=16)     # decode's one program
        compile_(fm._route_kernel, TOP_K=8, K_PAD=8, RENORM=True, E_PAD=128,
                 ptrs={"logits_ptr": "*bf16", "w_ptr": "*fp32", "ids_ptr": "*i64"})
        compile_(fm._moe_scatter_kernel, E_PAD=128, CHUNK=128)
        for bm, bn, bk, _, _ in (moe.DECODE_TILES, moe.PREFILL_TILES, moe.LONG_PREFILL_TILES):
            compile_(fm._moe_gate_up_kernel, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
            compile_(fm._moe_down_kernel, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env["TRITON_CACHE_DIR"] = str(tmp_path)            # compile for real, not from a cache hit
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and ("ptxas" in r.stderr and "not found" in r.stderr.lower()):
        pytest.skip("no ptxas in this triton install")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_engine_truncating_sampler_takes_the_split_rows_and_matches_torch():
    """The engine's default truncation path on the Triton backend: `default_row_splits` chunks
    per row (V = 4096: 4 chunks of 1024). Seeded top-k / top-p / min-p sampling gives the torch
    sampler's tokens, and logprobs within fp32 summation-order noise."""
    import rollout.kernels.fused_truncation as ft
    from rollout import RolloutEngine, SamplingParams
    from rollout.bench.shapes import make_config
    assert ft._row_chunks(4096, ft.default_row_splits(6, 4096, "cpu"), 1024)[0] == 4
    calls = []
    orig = ft._trunc_split
    prompts = [[5, 9, 200, 31], [7] * 11, [1000, 2000, 3000]]
    p = SamplingParams(n=2, max_new_tokens=6, temperature=0.9, top_k=50, top_p=0.9, min_p=0.01, seed=3,
                       ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        ft._trunc_split = lambda *a, **k: (calls.append(a[2]), orig(*a, **k))[1]   # record S
        try:
            eng = RolloutEngine.from_config(make_config("tiny"), seed=0, device="cpu", dtype="float32",
                                            max_model_len=64, num_kv_pages=32, attention_backend=backend)
            outs[backend] = eng.generate(prompts, p, use_tqdm=False)
        finally:
            ft._trunc_split = orig
    assert calls and set(calls) == {4}            # every triton step took the split path, 4 chunks
    for a, b in zip(outs["torch"], outs["triton"]):
        for ca, cb in zip(a.completions, b.completions):
            assert ca.token_ids == cb.token_ids
            # fp32 both ways, different summation order: ~1e-6.
            assert max(abs(x - y) for x, y in zip(ca.logprobs, cb.logprobs)) < 1e-5


def test_engine_with_triton_backend_matches_torch_backend(model_dir, tiny_tokenizer, monkeypatch):
    """End to end under the interpreter: the engine's attention through the Triton kernels
    (decode, split, and chunked prefill) gives the torch reference's tokens and logprobs."""
    from hf_reference import random_prompts
    from rollout import RolloutEngine, SamplingParams
    from rollout.kernels import paged_decode
    calls = []
    inner = paged_decode.paged_decode_attention
    monkeypatch.setattr(paged_decode, "paged_decode_attention",
                        lambda *a, **k: (calls.append(a[7]), inner(*a, **k))[1])   # num_splits
    path = model_dir("mistral")              # sliding window 24 < sequence length
    prompts = random_prompts(tiny_tokenizer, 3, 5, 40, seed=4)
    p = SamplingParams(n=2, max_new_tokens=8, temperature=0.8, seed=2, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        eng = RolloutEngine.from_pretrained(path, device="cpu", dtype="float32", max_model_len=128, num_kv_pages=64,
                                            max_num_batched_tokens=32, attention_backend=backend)
        outs[backend] = eng.generate(prompts, p, use_tqdm=False)
    assert calls and max(calls) > 1                     # decode steps took the decode kernel, split
    for a, b in zip(outs["torch"], outs["triton"]):
        for ca, cb in zip(a.completions, b.completions):
            assert ca.token_ids == cb.token_ids
            # fp32 kernels vs fp32 reference, different summation order: ~1e-6.
            assert max(abs(x - y) for x, y in zip(ca.logprobs, cb.logprobs)) < 1e-5


def test_skinny_configs_override_the_tables_per_engine():
    """KernelSwitches.skinny_configs (ROLLOUT_SKINNY_CONFIGS' form) sets a weight shape's decode GEMM
    config at every row count, packed or not (a cublas entry sends it to F.linear), for the engine
    whose switches carry it; the tables stay as they are. Bad entries are refused with the form named."""
    from rollout.env import KernelSwitches, parse_skinny_configs
    from rollout.layers.linear import pick_config
    assert parse_skinny_configs("") == {}
    assert parse_skinny_configs("6144x4096=64,128,4,3,2; 4096x4096=cublas") == {
        (6144, 4096): (64, 128, 4, 3, 2), (4096, 4096): None}
    for bad in ("6144=64,128,4,3", "6144x4096=64,128,4", "6144x4096=a,b,c,d", "6144x4096x1=64,128,4,3"):
        with pytest.raises(ValueError, match="ROLLOUT_SKINNY_CONFIGS"):
            parse_skinny_configs(bad)
        with pytest.raises(ValueError, match="ROLLOUT_SKINNY_CONFIGS"):
            KernelSwitches(skinny_configs=bad)
    over = KernelSwitches(skinny_configs="6144x4096=32,128,4,5 4096x4096=cublas").gemm_overrides()
    # QKV's override everywhere up to 64 rows, o_proj on cuBLAS even packed, down_proj's packed entry untouched
    assert [pick_config(6144, 4096, m, p, over) for m in (1, 32, 64, 65) for p in (False, True)] == \
        [(32, 128, 4, 5)] * 6 + [None] * 2
    assert pick_config(4096, 4096, 32, True, over) is None and pick_config(4096, 14336, 32, True, over) == \
        (64, 128, 4, 5, 2)
    assert pick_config(6144, 4096, 32) == (64, 128, 4, 5) and pick_config(4096, 4096, 32, True) == (64, 128, 4, 5, 2)


def test_kernel_switches_from_the_environment():
    """Every ROLLOUT_* kernel switch is read by rollout.env: "0" turns one off, anything else leaves it on."""
    from rollout.env import KernelSwitches
    assert KernelSwitches.from_environ({}) == KernelSwitches()
    names = ("ROLLOUT_GLUON_DECODE", "ROLLOUT_GLUON_EARLY", "ROLLOUT_SPLITK_NORM", "ROLLOUT_SILU_GATE_UP",
             "ROLLOUT_ROPE_QKV")
    off = KernelSwitches.from_environ(dict.fromkeys(names, "0"))
    assert not any([off.gluon_decode, off.gluon_early, off.splitk_into_norm, off.silu_in_gate_up, off.rope_in_qkv])


@triton.jit
def _tile_dot(x_ptr, w_ptr, o_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    rm, rk, rn = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    x = tl.load(x_ptr + rm[:, None] * K + rk[None, :])
    w = tl.load(w_ptr + rk[:, None] * N + rn[None, :])
    tl.store(o_ptr + rm[:, None] * N + rn[None, :], tl.dot(x, w))


def test_interpreter_dot_sums_in_k_order_whatever_the_tile():
    """kernels.fix_interpreter's tl.dot: a row has the same bits in a 16- or 64-row tile, those of
    an fp32 sum in K order. numpy's matmul (BLAS) picks its summation order by shape: with
    OpenBLAS 0.3.31 a row's bits differed between M = 1 and M = 16, breaking the bit-equality
    tests above on some machines."""
    from rollout.kernels import fix_interpreter
    fix_interpreter()
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 256, generator=g), torch.randn(256, 32, generator=g)
    outs = {}
    for M in (16, 64):
        outs[M] = torch.empty(M, 32)
        _tile_dot[(1,)](x[:M].contiguous(), w, outs[M], M=M, K=256, N=32)
    assert torch.equal(outs[16], outs[64][:16])
    want = torch.zeros(32)
    for k in range(256):
        want += x[0, k] * w[k]
    assert torch.equal(outs[16][0], want)


def test_speculation_in_the_verify_graphs_padded_layout_on_the_triton_kernels(model_dir, tiny_tokenizer):
    """The layout CUDA's verify graphs replay (a drafted step padded to a token bucket: one inert
    sequence holding the padding tokens on the trash page, empty sequences after it), run through the
    Triton attention kernels under the interpreter: the tokens and logprobs of plain decoding on the
    same kernels. Round 2 drafts from round 1's completions (the same seed: accepted)."""
    from hf_reference import random_prompts
    from rollout import RolloutEngine, SamplingParams
    path = model_dir("llama")
    prompts = [q + q[1:] + q[1:] for q in random_prompts(tiny_tokenizer, 2, 6, 10, seed=3)]
    kw = dict(device="cpu", dtype="float32", max_model_len=128, num_kv_pages=64, max_num_batched_tokens=64,
              attention_backend="triton")
    p = SamplingParams(n=2, max_new_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    want = RolloutEngine.from_pretrained(path, **kw).generate(prompts, p, use_tqdm=False)
    spec = RolloutEngine.from_pretrained(path, **kw, speculative="ngram", spec_max_draft=4, spec_history_prompts=4)
    spec.pipeline.pad_verify = True
    for _ in range(2):
        for a, b in zip(spec.generate(prompts, p, use_tqdm=False), want):
            for ca, cb in zip(a.completions, b.completions):
                assert ca.token_ids == cb.token_ids
                # the verify forward sums k+1 positions in one pass: fp32 order only, ~1e-6
                assert max(abs(x - y) for x, y in zip(ca.logprobs, cb.logprobs)) < 1e-5
    st = spec.stats()
    assert st["spec_accepted"] > 0 and st["verify_padded_steps"] > 0, st
