"""Programmatic dependent launch (kernels/pdl.py) on the GPU: the same kernels with and without
PDL must give the same bits, since PDL only changes when a kernel's programs start, never what
they compute. A kernel that read its input or wrote its output before `griddepcontrol.wait`
would race with the kernel before it; the chains below make every kernel consume the previous
one's output at once, in a CUDA graph, replayed many times. Skipped without an sm_90+ GPU."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                reason="needs an sm_90+ GPU")
MODES = (0, 1)   # pdl_for's values: off, on (launch dependents, then wait)


def _mlp_chain(x, norm_w, w_gu, w_down, layers):
    """The fused decode path's MLP half, repeated: add+RMSNorm -> gate_up GEMM -> SiLU*up ->
    down GEMM (both skinny, their swept configs at M = 32) -> the next add+RMSNorm."""
    from rollout.kernels.fused_ops import add_rmsnorm, silu_mul
    from rollout.kernels.skinny_gemm import skinny_gemm
    res, f = x, torch.zeros_like(x)
    for _ in range(layers):
        h, res = add_rmsnorm(res, norm_w, 1e-5, delta=f)
        f = skinny_gemm(silu_mul(skinny_gemm(h, w_gu, 64, 64, 8, 3)), w_down, 32, 256, 4, 5)
    return add_rmsnorm(res, norm_w, 1e-5, delta=f)[0]


def test_kernel_chain_in_a_graph_equal_bits_with_and_without_pdl():
    from rollout.kernels import pdl
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(32, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    norm_w = 1 + 0.1 * torch.randn(4096, device="cuda", dtype=torch.bfloat16, generator=g)
    w_gu = 0.02 * torch.randn(28672, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    w_down = 0.02 * torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16, generator=g)
    outs = {}
    was = pdl.pdl_for(x)
    try:
        for on in MODES:
            pdl.set_enabled(bool(on))
            assert pdl.pdl_for(x) == on
            _mlp_chain(x, norm_w, w_gu, w_down, 2)          # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = _mlp_chain(x, norm_w, w_gu, w_down, 8)
            replays = []
            for _ in range(20):
                y.fill_(float("nan"))                        # a replay that skips a write shows
                graph.replay()
                replays.append(y.clone())
            torch.cuda.synchronize()
            outs[on] = replays
            del graph
    finally:
        pdl.set_enabled(bool(was))
    ref = outs[0][0]
    assert torch.isfinite(ref.float()).all()
    for on in MODES:
        for y in outs[on]:
            assert torch.equal(y, ref), f"pdl={on}: a replay differs"


def test_engine_decode_graphs_equal_bits_with_and_without_pdl():
    """Two layers of the Llama-3-8B shape through the engine (fused small ops, skinny GEMMs,
    RoPE + KV write, split-KV decode attention, all in the decode graphs): greedy tokens and
    logprobs identical with PDL on and off."""
    from engine_ab import assert_same_tokens_and_logprobs, generate_per_setting, llama8b_model
    from rollout.kernels import pdl
    model, cfg = llama8b_model(2)
    was = pdl.pdl_for(torch.empty(0, device="cuda"))
    try:   # each mode set before its engine captures its graphs
        outs = generate_per_setting(
            model, cfg, {on: lambda on=on: pdl.set_enabled(bool(on)) for on in MODES},
            prompt_lens=(5, 90), max_new_tokens=48, seed=0, max_model_len=256, num_kv_pages=512)
    finally:
        pdl.set_enabled(bool(was))
    for on in MODES[1:]:
        assert_same_tokens_and_logprobs(outs[0], outs[on])
