"""Fused Triton sampler on CUDA at the real vocab size (151,936), against `rollout.sampler.sample`,
plus CUDA-graph capture and replay.

Run as its own pytest invocation, never with TRITON_INTERPRET set (the CPU interpreter tests set
it for their whole process): `python -m pytest tests/gpu/test_fused_sampler_cuda.py`.
Skipped without CUDA. Same contract and tolerances as tests/test_fused_sampler_interpret.py
(whose docstring justifies them); here the noise's inner log is libdevice logf (= CUDA logf, as
torch.log), so -log u is bit-equal to the reference and only fp32 score rounding
(x * (1/T), lg2.approx for the outer log) can flip near-ties.
"""
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
if not torch.cuda.is_available():
    # Skip before importing triton: a triton imported here without the interpreter would make the
    # CPU interpreter tests, collected later in the same process, skip themselves.
    pytest.skip("needs CUDA", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    pytest.skip("TRITON_INTERPRET is set in this process (by the CPU interpreter tests): run "
                "`python -m pytest tests/gpu` as its own invocation", allow_module_level=True)
pytest.importorskip("triton")

from rollout.sampler import SamplingTensors, counter_uniform, sample  # noqa: E402

V = 151_936
LP_TOL = 1e-5
NEAR_TIE = 1e-5
TEMPS = [0.0, 0.7, 1.0, 1.6, 0.3, 1.0]


@pytest.fixture(scope="module")
def fs():
    from rollout.kernels import fused_sampler
    if fused_sampler._INTERPRET:
        pytest.skip("kernel module was imported under the interpreter in this process")
    return fused_sampler


def reference(logits, temp, seeds, counters):
    R = logits.shape[0]
    dev = logits.device
    st = SamplingTensors(
        temperature=temp, top_k=torch.zeros(R, dtype=torch.int64, device=dev),
        top_p=torch.ones(R, device=dev), min_p=torch.zeros(R, device=dev),
        repetition_penalty=torch.ones(R, device=dev), seeds=seeds, counters=counters,
        penalty_token_ids=None, all_greedy=bool((temp <= 0).all()), any_truncation=False,
        any_penalty=False)
    return sample(logits, st)


def make_inputs(R, dtype, seed, scale=3.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(R, V, generator=g, device="cuda") * scale).to(dtype)
    temp = torch.tensor([TEMPS[(r + seed) % len(TEMPS)] for r in range(R)], device="cuda")
    seeds = torch.randint(0, 2**31, (R,), generator=g, device="cuda")
    counters = torch.randint(0, 2**40, (R,), generator=g, device="cuda")
    return logits, temp, seeds, counters


def check(logits, temp, seeds, counters, tok, lp):
    Vv = logits.shape[1]
    ref = reference(logits, temp, seeds, counters)
    assert bool(((tok >= 0) & (tok < Vv)).all())
    greedy = temp <= 0
    xt = logits.float() / torch.where(greedy, 1.0, temp)[:, None]
    lp_at_ours = torch.log_softmax(xt, dim=-1).gather(1, tok[:, None])[:, 0]
    err = (lp - lp_at_ours).abs().max().item()
    assert err <= LP_TOL, err
    same = tok == ref.token_ids
    if same.any():
        assert (lp[same] - ref.logprobs[same]).abs().max().item() <= LP_TOL
    assert torch.equal(tok[greedy], ref.token_ids[greedy])
    mism = ~same
    if mism.any():
        gumbel = -torch.log(-torch.log(counter_uniform(seeds, counters, Vv)))
        score = xt + torch.where(greedy[:, None], 0.0, gumbel)
        gap = (score.gather(1, ref.token_ids[:, None]) - score.gather(1, tok[:, None]))[:, 0][mism]
        assert gap.abs().max().item() < NEAR_TIE, gap
    assert mism.sum().item() <= 0.01 * max(1, int((~greedy).sum()))
    return err


def test_uniform_bit_identical(fs):
    seeds = torch.tensor([0, 1, 2**31 - 1, 12345], dtype=torch.int64, device="cuda")
    counters = torch.tensor([0, 2**32 - 1, 2**32, 2**40 + 17], dtype=torch.int64, device="cuda")
    assert torch.equal(fs.counter_uniform_triton(seeds, counters, V), counter_uniform(seeds, counters, V))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("R", [1, 64, 256])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_matches_reference(fs, R, dtype, num_splits):
    logits, temp, seeds, counters = make_inputs(R, dtype, seed=R + 1)
    for r in range(R):  # greedy ties far apart (other blocks / splits): first index wins
        if temp[r] <= 0:
            logits[r, [V - 3, 70_001, 5_000]] = (logits[r].float().max() + 1).to(dtype)
    tok = torch.full((R,), -7, dtype=torch.int64, device="cuda")
    lp = torch.full((R,), float("nan"), device="cuda")
    fs.fused_sample(logits, temp, seeds, counters, num_splits=num_splits, out=(tok, lp))
    err = check(logits, temp, seeds, counters, tok, lp)
    assert bool((tok[temp <= 0] == 5_000).all())
    print(f"R={R} {dtype} S={num_splits}: max |dlogp| {err:.2e}")


def test_many_draws_mismatch_rate(fs):
    # 8 steps x 256 sampled rows at T = 1: near-tie flips must stay < 1%.
    logits, _, seeds, counters = make_inputs(256, torch.bfloat16, seed=3)
    temp = torch.ones(256, device="cuda")
    for step in range(8):
        tok, lp = fs.fused_sample(logits, temp, seeds, counters + step)
        check(logits, temp, seeds, counters + step, tok, lp)


def test_greedy_only(fs):
    logits, _, seeds, counters = make_inputs(64, torch.bfloat16, seed=5)
    temp = torch.zeros(64, device="cuda")
    tok, lp = fs.fused_sample(logits, temp, seeds, counters, greedy_only=True)
    check(logits, temp, seeds, counters, tok, lp)
    tok2, _ = fs.fused_sample(logits, temp, seeds, counters)
    assert torch.equal(tok, tok2)


@pytest.mark.parametrize("R", [64, 256])
def test_cuda_graph_replay_matches_eager(fs, R):
    logits, temp, seeds, counters = make_inputs(R, torch.bfloat16, seed=7)
    tok = torch.empty(R, dtype=torch.int64, device="cuda")
    lp = torch.empty(R, device="cuda")
    fs.fused_sample(logits, temp, seeds, counters, out=(tok, lp))  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fs.fused_sample(logits, temp, seeds, counters, out=(tok, lp))
    g = torch.Generator(device="cuda").manual_seed(99)
    for step in range(4):
        counters.add_(1)  # in place: the graph reads the same buffers
        logits.copy_(torch.randn(logits.shape, generator=g, device="cuda") * 3)
        temp.copy_((0.5 + torch.rand(R, generator=g, device="cuda")) * (step % 2))  # even steps: all greedy
        tok.fill_(-7)
        lp.fill_(float("nan"))
        graph.replay()
        e_tok, e_lp = fs.fused_sample(logits, temp, seeds, counters)
        assert torch.equal(tok, e_tok) and torch.equal(lp, e_lp)
        check(logits, temp, seeds, counters, tok, lp)
