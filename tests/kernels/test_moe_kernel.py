"""The fused MoE Triton kernels (rollout/kernels/fused_moe.py) under the CPU interpreter, against the
torch reference (rollout/layers/moe.py), at small odd shapes; and an MoE engine on the Triton backend
(fused MoE + Triton attention) against the torch backend. TRITON_INTERPRET=1 is set before triton is
imported, as in tests/kernels/test_kernels_interpret.py (run this file in its own pytest process too); the
sm_90 compile check is in test_kernels_interpret.py::test_compiles_for_sm90."""
import os
import sys

import pytest

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set; run this file on its own",
                allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

import torch

from rollout.kernels.fused_moe import ONE_PROGRAM_PAIRS, fused_moe, moe_align
from rollout.kernels.fused_moe import route as fused_route
from rollout.layers.moe import (
    DECODE_TILES,
    LONG_PREFILL_PAIRS_PER_EXPERT,
    LONG_PREFILL_TILES,
    PREFILL_TILES,
    compile_tiles,
    experts_reference,
    moe_tiles,
    route,
    tile_variant_token_counts,
)


def _case(T, H, inter, E, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w1 = (torch.randn(E, 2 * inter, H, generator=g) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, inter, generator=g) / inter ** 0.5).to(dtype)
    weights, ids = route((torch.randn(T, E, generator=g) * 3).to(dtype), k, renormalize=seed % 2 == 0)
    return x, weights, ids, w1, w2


# up to ONE_PROGRAM_PAIRS (512) pairs one program sorts them, above three launches: both, at several chunk counts
@pytest.mark.parametrize("T,E,k,block_m", [(1, 5, 2, 16), (7, 5, 2, 16), (37, 9, 3, 16), (37, 3, 3, 32),
                                           (200, 7, 2, 64), (256, 9, 2, 16), (257, 9, 2, 16), (300, 5, 2, 32),
                                           (700, 9, 3, 16)])   # 700: 17 chunks of 128 pairs
def test_align_sorts_every_pair_once_into_padded_expert_blocks(T, E, k, block_m):
    _, _, ids, _, _ = _case(T, 8, 8, E, k, torch.float32, T + E)
    sorted_ids, expert_ids, npost = moe_align(ids, E, block_m)
    n, total = T * k, int(npost)
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=E)
    assert total == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert sorted_ids.numel() >= n + E * (block_m - 1) and total <= sorted_ids.numel()   # the static bound holds
    live = sorted_ids[:total]
    assert sorted(live[live < n].tolist()) == list(range(n)) and (live[live >= n] == n).all()
    for b in range(total // block_m):
        block = live[b * block_m:(b + 1) * block_m]
        real = block[block < n].long()
        assert len(real) and (flat[real] == expert_ids[b]).all()        # one expert per block
        assert torch.equal(real, real.sort().values)                    # stable: pair order within an expert
    assert (expert_ids[:total // block_m].diff() >= 0).all() and (expert_ids[total // block_m:] == E).all()


def test_align_paths_meet_at_the_one_program_bound():
    assert ONE_PROGRAM_PAIRS == 512      # the parametrised sizes above straddle it (256 x 2 and 257 x 2 pairs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,E,k,renorm", [(1, 5, 1, False), (7, 5, 2, True), (37, 9, 3, False), (33, 60, 8, True),
                                          (5, 128, 8, True), (4, 3, 3, True)])
def test_fused_route_matches_torch_route(T, E, k, renorm, dtype):
    g = torch.Generator().manual_seed(T * E + k)
    logits = (torch.randn(T, E, generator=g) * 3).to(dtype)
    if dtype == torch.bfloat16:   # rounded to 8 bits, dozens of logits tie exactly, and torch.topk leaves the
        # order of ties open (ours: lowest expert first, tested below): distinct values 1/16 apart instead
        logits = (torch.stack([torch.randperm(E, generator=g) for _ in range(T)]) / 16 - 4).to(dtype)
    want_w, want_i = route(logits, k, renorm)
    got_w, got_i = fused_route(logits, k, renorm)
    assert got_i.dtype == torch.int64 and got_w.dtype == torch.float32 and got_w.shape == (T, k)
    assert torch.equal(got_i, want_i)
    # Both round the weights to the logits' dtype. fp32: the softmax's and renorm's sums in another order,
    # a few fp32 ulps. bf16: the same fp32 values rounded alike but where an ulp of fp32 crosses a rounding
    # boundary: one bf16 ulp at most (up to 2^-7 relative).
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=0, rtol=2 ** -7)
    torch.testing.assert_close(got_w, want_w, **tol)
    out = torch.full((T, k), -1, dtype=torch.int64)          # ids into the caller's buffer (routed capture)
    assert fused_route(logits, k, renorm, out)[1] is out and torch.equal(out, want_i)


def test_fused_route_breaks_ties_to_the_lowest_expert():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0]])
    w, ids = fused_route(logits, 3, False)
    assert ids.tolist() == [[1, 3, 2]] and w[0, 0] == w[0, 1] > w[0, 2]


def test_pairs_summed_in_the_residual_add_equal_the_combine():
    """fused_moe(combine=False) handed to add_rmsnorm: the same bits as the combine, then the add."""
    from rollout.kernels.fused_ops import add_rmsnorm
    x, weights, ids, w1, w2 = _case(9, 40, 24, 5, 3, torch.float16, 3)
    pairs = fused_moe(x, weights, ids, w1, w2, DECODE_TILES, combine=False)
    assert pairs.shape == (3, 9, 40)
    residual = torch.randn(9, 40).to(torch.float16)
    norm_w = torch.rand(40).to(torch.float16)
    got = add_rmsnorm(residual, norm_w, 1e-6, delta=pairs)
    want = add_rmsnorm(residual, norm_w, 1e-6, delta=fused_moe(x, weights, ids, w1, w2, DECODE_TILES))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# fp32: the interpreter's dot sums in K order (kernels.fix_interpreter) and the reference in BLAS order;
# the combine adds k terms in fp32: ~1e-6 on these O(1) outputs. fp16: SiLU * up and each pair's output
# rounded to fp16 as the reference rounds them, summed in fp32: a few fp16 ulps (2^-10 relative).
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=4e-3, rtol=4e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,H,inter,E,k,tiles", [
    (1, 40, 24, 5, 2, DECODE_TILES), (7, 40, 24, 5, 2, (16, 16, 16, 4, 2)), (13, 72, 40, 9, 3, (16, 32, 32, 4, 2)),
    (45, 48, 56, 6, 2, PREFILL_TILES), (150, 48, 56, 6, 2, LONG_PREFILL_TILES),
    (3, 200, 136, 4, 4, (32, 64, 64, 4, 2))])
def test_fused_moe_matches_the_reference(T, H, inter, E, k, tiles, dtype):
    x, weights, ids, w1, w2 = _case(T, H, inter, E, k, dtype, T * H)
    got = fused_moe(x, weights, ids, w1, w2, tiles)
    want = experts_reference(x.float(), weights, ids, w1.float(), w2.float()) if dtype == torch.float32 else \
        experts_reference(x, weights, ids, w1, w2)
    assert got.dtype == dtype and got.shape == (T, H)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    assert torch.equal(fused_moe(x, weights, ids, w1, w2, tiles), got)      # deterministic (no atomics)
    swapped = ids.roll(1, dims=1)                                           # a wrong expert is caught
    assert not torch.allclose(fused_moe(x, weights, swapped, w1, w2, tiles), got, atol=1e-3)


def test_tiles_follow_pairs_per_expert():
    assert moe_tiles(32, 8, 128) == DECODE_TILES and moe_tiles(256, 8, 128) == DECODE_TILES
    assert moe_tiles(257, 8, 128) == PREFILL_TILES and moe_tiles(2047, 8, 128) == PREFILL_TILES
    assert moe_tiles(2048, 8, 128) == LONG_PREFILL_TILES


def _variants(T, k, E):
    return moe_tiles(T, k, E), T * k <= ONE_PROGRAM_PAIRS


# Qwen3-30B-A3B, Mixtral, Qwen2-MoE (60 experts) and odd ones where the tile classes and align paths cross
@pytest.mark.parametrize("E,k", [(128, 8), (8, 2), (60, 4), (4, 2), (3, 3), (16, 1), (256, 8), (9, 3)])
def test_tile_variant_token_counts_reach_every_variant_once(E, k):
    counts = tile_variant_token_counts(k, E)
    reachable = {_variants(T, k, E) for T in range(1, 4 * LONG_PREFILL_PAIRS_PER_EXPERT * E // k + 2)}
    assert sorted(map(_variants, counts, [k] * len(counts), [E] * len(counts))) == sorted(reachable)


def test_compile_tiles_runs_the_fused_moe_at_every_variant(monkeypatch):
    """What the engine runs at start-up on CUDA: the kernels themselves (here under the interpreter), once
    per variant, at the weights' shape."""
    from rollout.kernels import fused_moe as fm
    seen = []

    def recording(x, weights, ids, w1, w2, tiles, *rest):
        seen.append((ids.shape, tiles))
        return fused_moe(x, weights, ids, w1, w2, tiles, *rest)
    monkeypatch.setattr(fm, "fused_moe", recording)
    E, k = 5, 2
    _, _, _, w1, w2 = _case(1, 24, 16, E, k, torch.float32, 0)
    assert compile_tiles(w1, w2, k, max_tokens=1000) == [1, 41, 257, 320]   # every variant, as below
    assert {(tiles, shape[0] * k <= ONE_PROGRAM_PAIRS) for shape, tiles in seen} == \
        {_variants(T, k, E) for T in range(1, 700)}
    assert len(seen) == 4 and all(shape[1] == k for shape, _ in seen)
    seen.clear()     # steps of at most 300 tokens never take the long-prefill tiles: not compiled
    assert compile_tiles(w1, w2, k, max_tokens=300) == [1, 41, 257]
    assert {tiles for _, tiles in seen} == {DECODE_TILES, PREFILL_TILES}


def test_moe_engine_on_triton_kernels_matches_torch_backend(tmp_path, monkeypatch):
    """End to end under the interpreter: fused MoE and Triton attention give the torch path's tokens,
    logprobs to fp32 summation order, and the same routed experts."""
    from test_moe import build_moe_dir

    from rollout import RolloutEngine, SamplingParams
    from rollout.kernels import fused_moe as fm
    calls = []
    monkeypatch.setattr(fm, "fused_moe", lambda *a: (calls.append(a[0].shape[0]), fused_moe(*a))[1])
    path = build_moe_dir(tmp_path / "moe")
    prompts = [[1, 40, 41, 42, 7], [1] + list(range(60, 79))]
    p = SamplingParams(n=2, max_new_tokens=4, temperature=0.8, seed=2, ignore_eos=True, return_routed_experts=True)
    outs = {b: RolloutEngine.from_pretrained(path, device="cpu", dtype="float32", max_model_len=64, num_kv_pages=16,
                                             max_num_batched_tokens=16, attention_backend=b).generate(prompts, p,
                                                                                                     use_tqdm=False)
            for b in ("torch", "triton")}
    for a, b in zip(outs["torch"], outs["triton"]):
        for x, y in zip(a.completions, b.completions):
            assert x.token_ids == y.token_ids and (x.routed_experts == y.routed_experts).all()
            assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) < 1e-5
    assert min(calls) <= 4 and max(calls) == 16        # decode steps and 16-token prefill chunks took the kernels
