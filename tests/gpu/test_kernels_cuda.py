"""Triton attention / RoPE kernels on CUDA (bf16 and fp32) against the torch reference, plus the
decode kernel inside a CUDA graph. Skipped without CUDA.

Run as its own pytest invocation: `python -m pytest tests/gpu`. tests/kernels/test_kernels_interpret.py
sets TRITON_INTERPRET=1 for its whole process (triton needs it from its first import on), and in
such a process triton runs every kernel in the CPU interpreter; this module skips itself there.
"""
import os
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
if not torch.cuda.is_available():
    # Skip before importing triton: a triton imported here without the interpreter would make
    # the CPU interpreter tests, collected later in the same process, skip themselves.
    pytest.skip("needs CUDA", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 in this process (set by tests/kernels/test_kernels_interpret.py): run "
                "`python -m pytest tests/gpu` as its own invocation", allow_module_level=True)
pytest.importorskip("triton")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))
from paged_cases import make_paged as _make_paged, meta_for, reference  # noqa: E402
from rollout.layers.attention import write_kv  # noqa: E402
from rollout.kernels.paged_decode import paged_decode_attention  # noqa: E402
from rollout.kernels.paged_prefill import paged_prefill_attention  # noqa: E402
from rollout.kernels.rope_kv import rope_and_write_kv  # noqa: E402
from rollout.models.decoder import apply_rope  # noqa: E402

DEV = "cuda"
# bf16: q/k/v are the same bf16 values in kernel and fp32 reference, so the error is the kernel's
# own rounding: probabilities cast to bf16 for the PV tensor-core dot (2^-9 relative per term,
# averaging out over the keys) and the bf16 output (2^-9 relative on |o| <~ 3, i.e. <= 6e-3).
# 1e-2 is above both; a masking or page-indexing bug gives O(0.1-1). (Measured for our earlier
# split-KV prototype at Llama shape: 5.5e-4 max error, docs/performance.md section 5.)
BF16_TOL = dict(rtol=1e-2, atol=1e-2)
# fp32: ieee tl.dot (no tf32); differences are summation order and ex2/lg2.approx (~2^-22
# relative): ~1e-6 expected, 2e-5 allowed.
FP32_TOL = dict(rtol=2e-5, atol=2e-5)
TOL = {torch.bfloat16: BF16_TOL, torch.float32: FP32_TOL}


def make_paged(lens, Hkv, D, ps, dtype, seed):
    return _make_paged(lens, Hkv, D, ps, dtype, seed, device=DEV, spare_pages=8)


def check(out, ref, dtype):
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])


# (Hq, Hkv, D, page_size, num_splits, window): Llama-3-8B GQA 4, MHA, Qwen2.5-0.5B GQA 7 / d64.
DECODE_CASES = [(32, 8, 128, 16, 1, None), (32, 8, 128, 16, 3, None), (32, 8, 128, 64, 2, 1000),
                (8, 8, 64, 16, 4, None), (14, 2, 64, 32, 1, 100), (14, 2, 64, 32, 3, None),
                (32, 8, 128, 16, 8, None), (32, 8, 128, 16, 16, 300)]     # pick_num_splits at B = 8 / 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("Hq,Hkv,D,ps,num_splits,window", DECODE_CASES)
def test_decode(Hq, Hkv, D, ps, num_splits, window, dtype):
    lens = [0, 1, ps, ps + 1, 63, 65, 1000, 3001, 0]
    clean, poisoned, bt = make_paged(lens, Hkv, D, ps, dtype, seed=Hq + ps + num_splits)
    q = torch.randn(len(lens), Hq, D, device=DEV).to(dtype)
    meta = meta_for(lens, [1] * len(lens), bt, ps)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, *poisoned, bt, meta.seq_lens, D ** -0.5, window, num_splits, out=out)
    check(out, reference(q, clean, meta, D ** -0.5, window), dtype)


PREFILL_SEQS = [(1, 1), (16, 16), (17, 1), (700, 300), (333, 3), (0, 0), (129, 129), (2000, 1000)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("Hq,Hkv,D,ps,window", [(32, 8, 128, 16, None), (32, 8, 128, 64, 200),
                                                (14, 2, 64, 16, None), (8, 8, 64, 32, 50)])
def test_prefill(Hq, Hkv, D, ps, window, dtype):
    lens, qlens = [c for c, _ in PREFILL_SEQS], [n for _, n in PREFILL_SEQS]
    clean, poisoned, bt = make_paged(lens, Hkv, D, ps, dtype, seed=Hq + ps)
    meta = meta_for(lens, qlens, bt, ps)
    q = torch.randn(sum(qlens), Hq, D, device=DEV).to(dtype)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, *poisoned, bt, meta.query_start_loc, meta.seq_lens, D ** -0.5, window, out=out)
    check(out, reference(q, clean, meta, D ** -0.5, window), dtype)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_cuda_graph(num_splits):
    """One graph per batch bucket: replay after editing seq_lens / block_tables in place (longer
    contexts, other pages, a padding row) must equal an eager call on the same inputs."""
    Hq, Hkv, D, ps, B = 32, 8, 128, 16, 6
    lens0 = [1, 17, 300, 64, 0, 5]
    lens1 = [2000, 0, 301, 1, 777, 4096]
    clean, _, bt_big = make_paged(lens1, Hkv, D, ps, torch.bfloat16, seed=11)
    kc, vc = clean
    q = torch.randn(B, Hq, D, device=DEV, dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens0, dtype=torch.int32, device=DEV)
    bt = bt_big.clone()
    bt[:, :] = bt_big.flip(0)                          # other pages at capture time
    out = torch.empty_like(q)
    paged_decode_attention(q, kc, vc, bt, seq_lens, D ** -0.5, None, num_splits, out=out)   # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, kc, vc, bt, seq_lens, D ** -0.5, None, num_splits, out=out)
    for lens, table in ((lens0, bt_big.flip(0)), (lens1, bt_big)):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        bt.copy_(table)
        q.normal_()
        graph.replay()
        eager = paged_decode_attention(q, kc, vc, bt, seq_lens, D ** -0.5, None, num_splits)
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        check(out, reference(q, clean, meta_for(lens, [1] * B, bt, ps), D ** -0.5, None), torch.bfloat16)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "qk_norm"])   # Qwen3's per-head RMSNorm first
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_rope_kv(dtype, qk_norm):
    T, Hq, Hkv, D, ps, pages = 300, 32, 8, 128, 16, 32
    inv_freq = (1.0 / (500000.0 ** (torch.arange(0, D, 2).float() / D))).to(DEV)
    positions = torch.randint(0, 32768, (T,), device=DEV)
    freqs = positions.float()[:, None] * inv_freq[None, :]            # DecoderLM.rope
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, device=DEV).to(dtype)
    q, k, v = (t.view(T, -1, D) for t in qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1))
    n = T - 5                                                         # padding tokens get no slot
    slots = torch.randperm(pages * ps, device=DEV)[:n]
    slots[7] = -1
    kc = torch.zeros(pages, ps, Hkv, D, device=DEV, dtype=dtype)
    vc = torch.zeros_like(kc)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    keep = slots >= 0
    q_in, k_in, norms = q, k, None
    if qk_norm:
        from rollout.models.decoder import RMSNorm
        qn, kn = RMSNorm(D, 1e-6).to(DEV, dtype), RMSNorm(D, 1e-6).to(DEV, dtype)
        with torch.no_grad():
            qn.weight.copy_(torch.rand(D, device=DEV) + 0.5)
            kn.weight.copy_(torch.rand(D, device=DEV) + 0.5)
            q, k = qn(q), kn(k)              # the reference rotates the normed q and k
        norms = (qn.weight.detach(), kn.weight.detach(), 1e-6)
    write_kv(apply_rope(k, cos, sin)[:n][keep], v[:n][keep], kc_ref, vc_ref, slots[keep])
    q_ref = apply_rope(q, cos, sin)
    out = rope_and_write_kv(q_in, k_in, v, positions, inv_freq, kc, vc, slots, qk_norm=norms)
    assert torch.equal(vc, vc_ref)
    for got, want in ((out, q_ref), (kc, kc_ref)):
        # The kernel rounds like torch's eager ops. libdevice's and torch's fp32 cos/sin may differ
        # by an ulp (fp32: ~1e-7 differences, fine); in bf16 such an ulp flips a rounding only
        # next to a tie (~2^-16 odds), so nearly all values must match bit for bit. With QK-norm torch's
        # rsqrt and the kernel's 1/sqrt may differ by an fp32 ulp or two: the same odds of a bf16 flip,
        # but a flip in the normed q or k is then rotated. Values here stay below 8 in magnitude, so an
        # ulp is <= 2^-5: flips in x1 and x2 move x1*cos - x2*sin by <= sqrt(2) * 2^-5, and the output's
        # rounding may add one ulp more: (1 + sqrt(2)) * 2^-5 < 0.08. On an H100, 2 of 1.2M values
        # differed, by 0.0156 (relative 0.013 next to a cancellation). The bit-for-bit share below stays
        # the strict check.
        atol = 0.08 if dtype == torch.bfloat16 and qk_norm else 1e-5
        torch.testing.assert_close(got, want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=atol)
        if dtype == torch.bfloat16:
            assert (got != want).float().mean().item() < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_ops_cuda(dtype):
    from fused_cases import fused_ops_cases
    for name, got, want in fused_ops_cases(DEV, dtype):
        # fp32: summation order only. bf16: round-to-nearest at the same points as torch's
        # eager ops, so at most one bf16 ulp (2**-7 relative at worst) where fp32 sums differ.
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2 ** -8, rtol=2 ** -7)
        torch.testing.assert_close(got, want, **tol, msg=name)
