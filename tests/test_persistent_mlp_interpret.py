"""kernels/persistent_mlp.py under the Triton interpreter: the MLP half of a layer in one
persistent launch against the five launches it replaces, bit for bit (fp16: the interpreter's
bf16 dot is broken). The interpreter runs programs one after another, so the first takes every
queue item; real concurrency is the GPU test's (tests/gpu/test_skinny_gemm_cuda.py)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from rollout.kernels import skinny_gemm as sg  # noqa: E402
from rollout.kernels.persistent_mlp import PHASES, mlp_block, mlp_launches, wait_timeouts  # noqa: E402


@pytest.mark.parametrize("o_split,d_split,grid,M", [(1, 2, 1, 5), (2, 1, 3, 16), (1, 1, 2, 1)])
def test_mlp_block_gives_the_launches_bits(o_split, d_split, grid, M):
    """o_proj with and without split-K, down_proj with and without, 1-3 programs, 1-16 rows
    (row tile padding): normed output and residual bit-equal to the launches, twice in a row
    (the queue counters are zero again after each call, no wait gave up). Swapping gate and up
    is caught."""
    H, KA, I = 64, 64, 128
    g = torch.Generator().manual_seed(o_split * 10 + d_split + M)
    a = torch.randn(M, KA, generator=g).half()
    residual = torch.randn(M, H, generator=g).half()
    wo = (torch.randn(H, KA, generator=g) / 8).half()
    wgu = (torch.randn(2 * I, H, generator=g) / 8).half()
    wd = (torch.randn(H, I, generator=g) / 11).half()
    n2 = ((1 + torch.randn(H, generator=g) / 4).half(), 1e-5)
    n3 = ((1 + torch.randn(H, generator=g) / 4).half(), 1e-6)
    cfg_o, cfg_g, cfg_d = (16, 32, 4, 2, o_split), (32, 32, 4, 2), (16, 32, 4, 2, d_split)
    want = mlp_launches(a, residual, wo, n2, wgu, wd, n3, cfg_o, cfg_g, cfg_d)
    for _ in range(2):
        got = mlp_block(a, residual, wo, n2, wgu, wd, n3, cfg_o, cfg_g, cfg_d, grid=grid)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert int(sg._COUNTERS[(a.device, "mlp_queue")][:2 + PHASES].abs().sum()) == 0
    assert wait_timeouts(a.device) == 0
    swapped = torch.cat([wgu[I:], wgu[:I]])
    bad = mlp_block(a, residual, wo, n2, swapped, wd, n3, cfg_o, cfg_g, cfg_d, grid=grid)
    assert not torch.equal(bad[0], want[0])


def test_engine_with_the_persistent_mlp_gives_the_same_bits(monkeypatch):
    """The tiny model through the engine on the Triton backend (fp32, interpreter), with configs
    standing in for the GPU-only skinny-GEMM table (split-K for o_proj and down_proj, none for
    gate_up) and norm weights made to differ: with `persistent_mlp` every layer's MLP half is one
    mlp_block launch, and tokens and logprobs are bit-equal to the five launches'."""
    from engine_ab import TINY_PROMPTS, tiny_params, tiny_triton_engine
    from rollout.kernels import persistent_mlp
    from rollout.models import decoder
    monkeypatch.setattr(decoder, "_skinny_config",
                        lambda w, x: None if x.shape[0] > 64 or w.shape[1] % 128 else
                        (64, 64, 4, 2, 1) if w.shape[0] == 2 * 768 else (64, 64, 4, 2, 2))
    calls = []
    inner = persistent_mlp.mlp_block
    monkeypatch.setattr(persistent_mlp, "mlp_block", lambda *a, **k: (calls.append(a[0].shape[0]), inner(*a, **k))[1])
    outs = {}
    for on in (False, True):
        eng = tiny_triton_engine()
        eng.model.persistent_mlp = on
        g = torch.Generator().manual_seed(7)        # norm weights that differ (init gives ones)
        for name, prm in sorted(eng.model.named_parameters()):
            if "norm" in name:
                prm.data.copy_(1 + torch.randn(prm.shape, generator=g) / 4)
        calls.clear()
        outs[on] = eng.generate(TINY_PROMPTS, tiny_params(), use_tqdm=False)
        assert bool(calls) == on and all(m <= 64 for m in calls)
    for a, b in zip(outs[False], outs[True]):
        assert a.completions[0].token_ids == b.completions[0].token_ids
        assert a.completions[0].logprobs == b.completions[0].logprobs
