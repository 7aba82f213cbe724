"""The warp-specialized MLP block (kernels/ws_mlp.py) on the GPU: against the kernels it replaces
and an fp32 reference at the Llama-3-8B shapes, inside a CUDA graph, and in the engine's decode
graphs on a two-layer 8B-shape model. Skipped without an sm_90 GPU."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/: engine_ab

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                reason="needs an sm_90 GPU")

H, I, EPS = 4096, 14336, 1e-5


def _inputs(M, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) * scale
    return dict(a=rnd(M, H), residual=rnd(M, H), wo=rnd(H, H, scale=H ** -0.5), n1=1 + rnd(H, scale=0.1),
                wgu=rnd(2 * I, H, scale=H ** -0.5), wd=rnd(H, I, scale=I ** -0.5), n2=1 + rnd(H, scale=0.1))


def _kernels(a, residual, wo, n1, wgu, wd, n2):
    """The engine's kernels for the same math, at skinny_gemm's (32, 256, 4, 5) tile: the block's
    GEMM tile, so only the norms' fp32 sums of squares are ordered differently."""
    from rollout.kernels.fused_ops import add_rmsnorm
    from rollout.kernels.skinny_gemm import skinny_gemm
    tile = (32, 256, 4, 5)
    h1, r1 = add_rmsnorm(residual, n1, EPS, delta=skinny_gemm(a, wo, *tile))
    act = skinny_gemm(h1, wgu, *tile, silu_mul=True)
    return add_rmsnorm(r1, n2, EPS, delta=skinny_gemm(act, wd, *tile))


def _fp32(a, residual, wo, n1, wgu, wd, n2):
    f = {k: v.float() for k, v in dict(a=a, residual=residual, wo=wo, n1=n1, wgu=wgu, wd=wd, n2=n2).items()}

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w
    r1 = f["residual"] + f["a"] @ f["wo"].T
    gu = norm(r1, f["n1"]) @ f["wgu"].T
    r = r1 + (torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]) @ f["wd"].T
    return norm(r, f["n2"]), r


@pytest.mark.parametrize("M", [1, 5, 32])
def test_block_matches_the_kernels_it_replaces_and_fp32(M):
    from rollout.kernels.ws_mlp import counters, mlp_block
    x = _inputs(M, seed=M)
    cnt = counters(torch.device("cuda"))
    h, r = mlp_block(x["a"], x["residual"], x["wo"], x["n1"], x["wgu"], x["wd"], x["n2"], EPS, cnt)
    want_h, want_r = _kernels(**x)
    ref_h, ref_r = _fp32(**x)
    torch.cuda.synchronize()
    assert cnt.tolist() == [0, 0]                      # counter zeroed by the last arrival; no wait gave up
    assert h.shape == r.shape == (M, H) and torch.isfinite(h).all() and torch.isfinite(r).all()
    # Both paths round at the same places (GEMM outputs, the residual adds, the normed x, SiLU and
    # its product); only the norms' fp32 sums of squares differ in order, which moves a normed
    # value by at most one bf16 rounding now and then. So: most elements have the kernels' bits,
    # and the mean error against fp32 is the kernels' own (bf16 rounding, ~2^-9 relative), not more.
    for got, want, ref in ((h, want_h, ref_h), (r, want_r, ref_r)):
        assert (got == want).float().mean() > 0.9
        err, err_kernels = (got.float() - ref).abs().mean(), (want.float() - ref).abs().mean()
        assert err <= 1.1 * err_kernels + 1e-6, (float(err), float(err_kernels))


def test_block_in_a_cuda_graph_gives_eager_bits_on_new_inputs():
    """Captured once, replayed on new inputs copied into the captured buffers: the eager bits,
    and the phase counter back at zero after every replay."""
    from rollout.kernels.ws_mlp import counters, mlp_block
    x = _inputs(32, seed=7)
    cnt = counters(torch.device("cuda"))
    args = lambda: (x["a"], x["residual"], x["wo"], x["n1"], x["wgu"], x["wd"], x["n2"], EPS, cnt)  # noqa: E731
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        mlp_block(*args())
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h, r = mlp_block(*args())
    for seed in (8, 9):
        new = _inputs(32, seed)
        x["a"].copy_(new["a"])
        x["residual"].copy_(new["residual"])
        graph.replay()
        want_h, want_r = mlp_block(*args())
        torch.cuda.synchronize()
        assert torch.equal(h, want_h) and torch.equal(r, want_r)
        assert cnt.tolist() == [0, 0]


def test_engine_with_the_block_matches_the_engine_without():
    """Two 8B-shape layers through the engine's decode graphs (32 sequences: the block takes
    every decode step; prefill keeps the other kernels), greedy: the first token comes from the
    same prefill, so its logprob is equal; later tokens may differ where the norms' rounding
    flips a near-tie of random weights, so nearly all, not all, must agree."""
    from engine_ab import generate_per_setting, llama8b_model
    model, cfg = llama8b_model(2)
    outs = generate_per_setting(model, cfg, {on: lambda on=on: model.enable_mlp_block(on) for on in (False, True)},
                                prompt_lens=(3, 40), seed=4)
    assert model.mlp_block_counters.tolist() == [0, 0]
    same = total = 0
    for a, b in zip(outs[False], outs[True], strict=True):
        ta, tb = a.completions[0].token_ids, b.completions[0].token_ids
        assert ta[0] == tb[0] and a.completions[0].logprobs[0] == b.completions[0].logprobs[0]
        # the second token's logprob: one decode step of rounding differences; logits of magnitude
        # ~2-4 have a bf16 spacing of 2^-7 to 2^-6, four spacings bound it (as the skinny GEMM test)
        assert abs(a.completions[0].logprobs[1] - b.completions[0].logprobs[1]) < 4 * 2.0 ** -6
        same += sum(x == y for x, y in zip(ta, tb))
        total += len(ta)
    assert same / total >= 0.9, (same, total)
