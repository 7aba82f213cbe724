"""Fused Triton sampler (rollout/kernels/fused_sampler.py) under the CPU interpreter, against
the torch reference `rollout.sampler.sample` for rows without truncation / penalty.

TRITON_INTERPRET=1 is set at the top, before triton and the kernel module are imported
(triton.jit picks the interpreter at decoration time, and triton's own jit'd helpers such as
the tl.max combine functions are decorated when triton is imported). It stays set for the rest
of the process (same convention as tests/test_kernels_interpret.py), so tests/gpu runs as its own
pytest invocation: `python -m pytest tests/gpu`.

Tolerances:
* logprobs, max |Δ| <= 1e-5: the kernel's (x_tok / T - max(x) / T) is bit-identical to the
  reference's (division is monotone, so max commutes with it), leaving only log(sum exp) to
  differ, by summation order and exp implementation: a few ulp of a value <= log V ~ 8.5,
  i.e. ~1e-6 (observed <= ~1e-6). 1e-5 is well below any indexing / scaling bug (>= 1e-3).
* tokens: greedy rows exactly equal (first index on ties). Sampled rows use the same u bits
  (checked bit for bit), but the kernel scores with x * (1/T) and its own logs, so the two can
  only disagree where the top-2 perturbed scores are within fp32 rounding (|scores| <~ 60 here,
  ulp <= 4e-6): at every mismatch the two candidates' reference scores must differ by < 1e-5,
  and mismatches must be < 1% of sampled rows (none are expected at these sizes).
"""
import os
import sys

import pytest

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set (tests/gpu in the same "
                "process?); run `pytest tests/test_fused_sampler_interpret.py` on its own",
                allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

import torch  # noqa: E402

from rollout.kernels import fused_sampler as fs  # noqa: E402
from rollout.sampler import SamplingTensors, counter_uniform, sample  # noqa: E402

LP_TOL = 1e-5
NEAR_TIE = 1e-5
TEMPS = [0.0, 0.7, 1.0, 1.6, 0.3, 0.05]  # 0.05: |x / T| ~ 200, where 1 ulp = 1.5e-5


def test_module_is_interpreted():
    assert fs._INTERPRET


def reference(logits, temp, seeds, counters):
    R = logits.shape[0]
    st = SamplingTensors(
        temperature=temp, top_k=torch.zeros(R, dtype=torch.int64), top_p=torch.ones(R),
        min_p=torch.zeros(R), repetition_penalty=torch.ones(R), seeds=seeds, counters=counters,
        penalty_token_ids=None, all_greedy=bool((temp <= 0).all()), any_truncation=False,
        any_penalty=False)
    return sample(logits, st)


def make_inputs(R, V, dtype, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(R, V, generator=g) * scale).to(dtype)
    temp = torch.tensor([TEMPS[(r + seed) % len(TEMPS)] for r in range(R)], dtype=torch.float32)
    seeds = torch.randint(0, 2**31, (R,), generator=g)
    seeds[0] = 2**31 - 1
    counters = torch.randint(0, 2**40, (R,), generator=g)  # > 2**32: exercises the high word
    return logits, temp, seeds, counters


def run_poisoned(logits, temp, seeds, counters, **kw):
    R = logits.shape[0]
    tok = torch.full((R,), -7, dtype=torch.int64)
    lp = torch.full((R,), float("nan"))
    out = fs.fused_sample(logits, temp, seeds, counters, out=(tok, lp), **kw)
    assert out[0] is tok and out[1] is lp
    return tok, lp


def check(logits, temp, seeds, counters, tok, lp):
    """Asserts the contract; returns the number of (near-tie) token mismatches."""
    V = logits.shape[1]
    ref = reference(logits, temp, seeds, counters)
    # The caller fills processed_logprobs = logprobs and kept_mass = 0 for these rows.
    assert torch.equal(ref.processed_logprobs, ref.logprobs) and bool((ref.kept_mass == 0).all())
    assert bool(((tok >= 0) & (tok < V)).all()), tok
    greedy = temp <= 0
    xt = logits.float() / torch.where(greedy, 1.0, temp)[:, None]
    lp_at_ours = torch.log_softmax(xt, dim=-1).gather(1, tok[:, None])[:, 0]
    assert (lp - lp_at_ours).abs().max().item() <= LP_TOL
    same = tok == ref.token_ids
    assert (lp[same] - ref.logprobs[same]).abs().max().item() <= LP_TOL
    assert torch.equal(tok[greedy], ref.token_ids[greedy])
    gumbel = -torch.log(-torch.log(counter_uniform(seeds, counters, V)))
    score = xt + torch.where(greedy[:, None], 0.0, gumbel)
    mism = ~same
    if mism.any():
        gap = (score.gather(1, ref.token_ids[:, None]) - score.gather(1, tok[:, None]))[:, 0][mism]
        assert gap.abs().max().item() < NEAR_TIE, gap
    assert mism.sum().item() <= 0.01 * max(1, int((~greedy).sum()))
    return int(mism.sum())


def test_uniform_bit_identical():
    seeds = torch.tensor([0, 1, 2**31 - 1, 12345, 7], dtype=torch.int64)
    counters = torch.tensor([0, 2**32 - 1, 2**32, 2**40 + 17, 2**62 + 3], dtype=torch.int64)
    u = fs.counter_uniform_triton(seeds, counters, 3001)
    assert torch.equal(u, counter_uniform(seeds, counters, 3001))


@pytest.mark.parametrize("R, V, dtype, num_splits, block_v", [
    (1, 4999, torch.float32, None, 2048),  # default split heuristic (several splits + merge)
    (7, 3001, torch.bfloat16, 3, 512),
    (33, 1000, torch.float16, 1, 256),
    (33, 2500, torch.bfloat16, 2, 1024),
])
def test_matches_reference(R, V, dtype, num_splits, block_v):
    logits, temp, seeds, counters = make_inputs(R, V, dtype, seed=R + V + 1)
    # Greedy ties across lanes, blocks and splits: the first index must win.
    for r in range(R):
        if temp[r] <= 0:
            top = logits[r].float().max() + 1
            logits[r, [V - 3, block_v + 5, V // 2, 2 * block_v + 5]] = top.to(dtype)
    tok, lp = run_poisoned(logits, temp, seeds, counters, num_splits=num_splits, block_v=block_v)
    check(logits, temp, seeds, counters, tok, lp)
    g = temp <= 0
    assert bool((tok[g] == min(V - 3, block_v + 5, V // 2)).all())


def test_pruned_blocks_peaked_logits():
    # A dominant token early in the row makes later blocks unable to win (max x/T + 17 < best):
    # their noise is skipped, which must not change anything.
    R, V = 7, 3000
    logits, temp, seeds, counters = make_inputs(R, V, torch.bfloat16, seed=3, scale=2.0)
    temp = torch.tensor([1.0, 0.7, 1.0, 0.0, 1.3, 1.0, 0.5])
    logits[:, 40] += 28.0
    logits[1::2, 2900] += 26.0  # a late competitor, in a block that is not pruned
    tok, lp = run_poisoned(logits, temp, seeds, counters, num_splits=1, block_v=256)
    check(logits, temp, seeds, counters, tok, lp)


def test_greedy_only():
    R, V = 7, 2000
    logits, _, seeds, counters = make_inputs(R, V, torch.bfloat16, seed=5)
    temp = torch.zeros(R)
    ref_tok = None
    for greedy_only in (True, False):
        tok, lp = run_poisoned(logits, temp, seeds, counters, greedy_only=greedy_only, block_v=512)
        check(logits, temp, seeds, counters, tok, lp)
        assert ref_tok is None or torch.equal(tok, ref_tok)
        ref_tok = tok


def test_tokens_independent_of_splits_and_batch():
    # A row's token depends only on its own (seed, counter, logits, T): not on the split count,
    # the block width, or which rows share the batch.
    R, V = 5, 2100
    logits, temp, seeds, counters = make_inputs(R, V, torch.bfloat16, seed=11)
    base, base_lp = fs.fused_sample(logits, temp, seeds, counters, num_splits=1, block_v=512)
    for S, bv in [(3, 256), (5, 512)]:
        tok, lp = fs.fused_sample(logits, temp, seeds, counters, num_splits=S, block_v=bv)
        assert torch.equal(tok, base)
        assert (lp - base_lp).abs().max().item() <= 2e-6  # summation order only
    for r in (0, 3):
        tok, lp = fs.fused_sample(logits[r:r + 1], temp[r:r + 1], seeds[r:r + 1], counters[r:r + 1],
                                  num_splits=1, block_v=512)
        assert tok.item() == base[r].item() and lp.item() == base_lp[r].item()


def test_strided_rows_never_read_past_v():
    # Rows of a wider buffer (stride > V) whose padding is NaN: any read past V poisons lse.
    R, V = 4, 1500
    logits, temp, seeds, counters = make_inputs(R, V, torch.float32, seed=13)
    wide = torch.full((R, V + 37), float("nan"))
    wide[:, :V] = logits
    tok, lp = run_poisoned(wide[:, :V], temp, seeds, counters, num_splits=2, block_v=512)
    check(logits, temp, seeds, counters, tok, lp)
