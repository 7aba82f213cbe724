"""The Gluon decode GEMM (kernels/gluon_gemm.py, issue 4's early-weight experiment) on the GPU:
against an fp32 reference on fresh random inputs with poisoned outputs, bit for bit against the
Triton skinny GEMM at the tile it rebuilds, its SiLU epilogue, PDL launches inside a CUDA graph,
and the `skinny_gemm.GLUON` routing. Skipped without CUDA (sm_90 for the kernel)."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                reason="needs an sm_90 GPU")

TILES = [(32, 256, 4, 4), (32, 256, 2, 4), (32, 128, 6, 4), (64, 128, 4, 4), (128, 128, 4, 8)]


def _inputs(M, N, K, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
    w = 0.02 * torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g)
    return x, w


def _within_one_rounding(out, ref):
    # One bf16 rounding (8-bit mantissa) of an fp32 accumulation: within 2^-8 relative of the
    # fp32 result, plus a 1e-3 floor near zero where summation orders differ (test_skinny_gemm).
    err = (out.float() - ref).abs()
    assert (err <= ref.abs() * 2.0 ** -8 + 1e-3).all(), err.max().item()


@pytest.mark.parametrize("M", [1, 17, 32])
@pytest.mark.parametrize("early", [True, False])
@pytest.mark.parametrize("tile", TILES)
def test_matches_fp32_reference(M, early, tile):
    from rollout.kernels.gluon_gemm import prewait_gemm
    bn, bk, slots, warps = tile
    x, w = _inputs(M, 512, 2048, seed=M + bn + slots)
    out = torch.full((M, 512), float("nan"), device="cuda", dtype=torch.bfloat16)
    prewait_gemm(x, w, out, bn, bk, slots, warps, early, pdl=0)
    assert not out.isnan().any()
    _within_one_rounding(out, x.float() @ w.float().T)


@pytest.mark.parametrize("N,K", [(4096, 4096), (4096, 14336)])      # o_proj, down_proj of the 8B shape
def test_same_bits_as_the_triton_tile_it_rebuilds(N, K):
    """Same MMA layout, K order and rounding as skinny_gemm at 32 x 256 (4 warps): equal bits,
    whether the ring's weight tiles are loaded before the wait or after, with a strided x."""
    from rollout.kernels.gluon_gemm import prewait_gemm
    from rollout.kernels.skinny_gemm import skinny_gemm
    for M in (5, 32):
        x, w = _inputs(M, N, 2 * K, seed=M)
        x = x[:, :K]                                           # row stride 2K
        ref = skinny_gemm(x, w, 32, 256, 4, 5)
        for early in (True, False):
            out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            assert torch.equal(prewait_gemm(x, w, out, 32, 256, 4, 4, early, pdl=0), ref)


@pytest.mark.parametrize("M", [1, 32])
def test_silu_epilogue(M):
    """gate_up with silu_mul: silu(gate) * up with the SiLU kernel's roundings, against the
    fp32 GEMM through fused_ops.silu_mul's formula, and against the Triton GEMM's epilogue."""
    from rollout.kernels.fused_ops import silu_mul
    from rollout.kernels.gluon_gemm import prewait_gemm
    from rollout.kernels.skinny_gemm import skinny_gemm
    inter, K = 1024, 4096
    x, w = _inputs(M, 2 * inter, K, seed=7 + M)
    out = torch.full((M, inter), float("nan"), device="cuda", dtype=torch.bfloat16)
    prewait_gemm(x, w, out, 128, 128, 4, 8, True, silu_mul=True, pdl=0)
    assert not out.isnan().any()
    gate_up = (x.float() @ w.float().T).bfloat16()        # the GEMM's one rounding, then the SiLU kernel's
    ref = silu_mul(gate_up).float()
    # gate and up each within one bf16 rounding of the reference's (different K order inside
    # the MMA), which moves silu(gate) * up by at most ~2 roundings: 2^-7 relative, 1e-3 floor.
    err = (out.float() - ref).abs()
    assert (err <= ref.abs() * 2.0 ** -7 + 1e-3).all(), err.max().item()
    triton_out = skinny_gemm(x, w, 128, 128, 8, 4, silu_mul=True)
    err = (out.float() - triton_out.float()).abs()
    assert (err <= triton_out.float().abs() * 2.0 ** -7 + 1e-3).all(), err.max().item()


def test_pdl_chain_in_a_graph_equals_eager():
    """Eight dependent GEMMs launched with PDL (launch dependents, then wait) and their weight
    tiles issued before the wait: 20 replays of the captured chain give the eager chain's bits,
    so no program reads its x before the previous GEMM wrote it."""
    from rollout.kernels.gluon_gemm import prewait_gemm
    x, w = _inputs(32, 4096, 4096, seed=3)
    ys = [torch.empty(32, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(8)]

    def chain(pdl):
        prev = x
        for y in ys:
            prewait_gemm(prev, w, y, 32, 256, 4, 4, True, pdl=pdl)
            prev = y
        return ys[-1].clone()

    ref = chain(0)
    for y in ys:
        y.fill_(float("nan"))
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        chain(2)                                     # compile and warm up off the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            chain(2)
    for _ in range(20):
        for y in ys:
            y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(ys[-1], ref)


def test_skinny_gemm_routes_listed_shapes(monkeypatch):
    """skinny_gemm.GLUON sends a listed weight shape to the Gluon kernel (its result, one call),
    but not a call with a bias or with more than 32 rows."""
    from rollout.kernels import gluon_gemm
    from rollout.kernels import skinny_gemm as sg
    calls = []
    real = gluon_gemm.prewait_gemm
    monkeypatch.setattr(gluon_gemm, "prewait_gemm", lambda *a, **k: calls.append(a[3:]) or real(*a, **k))
    monkeypatch.setattr(sg, "GLUON", {(512, 1024): (32, 128, 6, 4, True)})
    x, w = _inputs(64, 512, 1024, seed=11)
    direct = real(x[:32], w, torch.empty(32, 512, device="cuda", dtype=torch.bfloat16), 32, 128, 6, 4, True, pdl=0)
    assert torch.equal(sg.skinny_gemm(x[:32], w, 32, 128, 4, 3), direct) and len(calls) == 1
    assert calls[0][:4] == (32, 128, 6, 4)
    sg.skinny_gemm(x[:32], w, 32, 128, 4, 3, bias=torch.zeros(512, device="cuda", dtype=torch.bfloat16))
    sg.skinny_gemm(x, w, 32, 128, 4, 3)
    assert len(calls) == 1
