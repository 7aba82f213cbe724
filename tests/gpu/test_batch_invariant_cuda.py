"""Batch-invariant mode on the GPU (engine batch_invariant=True): a sequence's tokens and
logprobs are the same bits whatever else shares its steps, so bf16 greedy runs under KV
pressure can equal the unpressured run exactly (issue 7). Skipped without CUDA."""
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("small_m_tiles", [True, False])
@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096),
                                 (2304, 1536), (96, 256)])
def test_gemm_row_bits_do_not_depend_on_the_row_count(monkeypatch, N, K, small_m_tiles):
    """Every Llama-3-8B linear (QKV, o_proj, gate_up, down_proj, lm_head), a Qwen-1.5B-like
    shape, a tiny masked one. Rows alone (16-row x tile), in decode batches of 3, 32 (32-row
    tile) and 64, in a 1500-row prefill (64-row tiles, masked M tail) and its subsets: equal
    bits. small_m_tiles=False is the fallback with 64-row tiles at every M. Against fp32: one
    bf16 rounding of the output (2^-8 relative) on fp32 sums of K products; 2e-2 covers it with
    margin on these O(1) outputs, and a wrong tile or mask is O(1)."""
    from rollout.layers import linear
    monkeypatch.setattr(linear, "INVARIANT_SMALL_M_TILES", small_m_tiles)
    g = torch.Generator(device="cuda").manual_seed(N + K)
    x = torch.randn(1500, K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
    full = linear.batch_invariant_gemm(x, w)
    torch.testing.assert_close(full.float(), x.float() @ w.float().T, rtol=2e-2, atol=2e-2)
    for rows in ([0], [1499], [5, 700, 1498], list(range(32)), list(range(64)), list(range(100, 1100))):
        assert torch.equal(linear.batch_invariant_gemm(x[rows], w), full[rows]), rows


@pytest.mark.parametrize("window", [None, 1500])
def test_attention_row_bits_across_decode_mixed_and_reprefill_steps(window):
    """Llama-3-8B attention shape, bf16, contexts from 37 to 5000 keys (1 to 5 splits of 1024,
    one exactly 1024): the decode path (a program per split + merge kernel) gives each row the
    same bits as the folding path, alone, beside a prefill chunk, and as the last query of a
    re-prefill of its own sequence. Against fp32: bf16 output rounding (2^-8) on O(1) values
    that are averages of unit-normal V rows; 2e-2 with margin."""
    from dataclasses import replace

    from paged_cases import make_paged, meta_for, reference
    from rollout.kernels.paged_prefill import paged_prefill_attention
    from rollout.layers.attention import INVARIANT_SPLIT_LEN, INVARIANT_TILE, paged_attention
    lens, ps, Hq, Hkv, D = [5000, 37, 2100, 1024, 1025], 16, 32, 8, 128
    caches, poisoned, bt = make_paged(lens, Hkv, D, ps, torch.bfloat16, seed=5, device="cuda")
    q = torch.randn(len(lens), Hq, D, device="cuda").bfloat16()
    inv = dict(batch_invariant=True)
    dmeta = replace(meta_for(lens, [1] * len(lens), bt, ps), **inv)
    out = paged_attention(q, *poisoned, dmeta, D ** -0.5, window)
    torch.testing.assert_close(out.float(), reference(q, caches, dmeta, D ** -0.5, window), rtol=2e-2, atol=2e-2)
    nan = lambda: torch.full_like(q, float("nan"))       # poisoned outputs: every row must be written
    fold = paged_prefill_attention(q, *poisoned, bt, dmeta.query_start_loc, dmeta.seq_lens, D ** -0.5, window,
                                   split_len=INVARIANT_SPLIT_LEN, out=nan(), **INVARIANT_TILE)
    split = paged_prefill_attention(q, *poisoned, bt, dmeta.query_start_loc, dmeta.seq_lens, D ** -0.5, window,
                                    split_len=INVARIANT_SPLIT_LEN, decode_rows=True, out=nan(), **INVARIANT_TILE)
    assert torch.equal(out, fold) and torch.equal(out, split)
    for i in range(len(lens)):
        alone = replace(meta_for(lens[i:i + 1], [1], bt[i:i + 1], ps), **inv)
        assert torch.equal(paged_attention(q[i:i + 1], *poisoned, alone, D ** -0.5, window), out[i:i + 1]), i
    mixed = replace(meta_for([lens[0], lens[2]], [300, 1], bt[[0, 2]], ps), **inv)
    qm = torch.cat([torch.randn(300, Hq, D, device="cuda").bfloat16(), q[2:3]])
    assert torch.equal(paged_attention(qm, *poisoned, mixed, D ** -0.5, window)[300:], out[2:3])
    for i, n in ((0, 2000), (2, 7), (4, 1025)):     # re-prefill chunks ending at the decode position
        chunk = replace(meta_for(lens[i:i + 1], [n], bt[i:i + 1], ps), **inv)
        qc = torch.cat([torch.randn(n - 1, Hq, D, device="cuda").bfloat16(), q[i:i + 1]])
        assert torch.equal(paged_attention(qc, *poisoned, chunk, D ** -0.5, window)[n - 1:], out[i:i + 1]), i


def _engine(model, cfg, **kw):
    from rollout import RolloutEngine
    args = dict(max_model_len=640, max_num_seqs=48, num_kv_pages=2048, seed=0, batch_invariant=True)
    args.update(kw)
    return RolloutEngine(model, cfg, **args)


def test_engine_sequence_bits_do_not_depend_on_batch_mates(monkeypatch):
    """8 prompts alone (big prefill budget) against the same 8 among 32 others of other lengths
    with a 96-token prefill budget (prompts chunked, decode rows in mixed steps, other graph
    buckets): every token and logprob equal, greedy and seeded sampling. KV splits of 128 keys
    (contexts reach 556): decode rows fold several splits."""
    from rollout import SamplingParams
    from rollout.layers import attention
    monkeypatch.setattr(attention, "INVARIANT_SPLIT_LEN", 128)
    from rollout.bench.pressure import random_model
    from rollout.bench.shapes import make_config
    cfg = make_config("tiny")
    model = random_model(cfg, torch.bfloat16, torch.device("cuda"), seed=0)
    g = torch.Generator().manual_seed(1)
    mine = [torch.randint(10, 4000, (int(n),), generator=g).tolist() for n in torch.randint(20, 200, (8,), generator=g)]
    others = [torch.randint(10, 4000, (int(n),), generator=g).tolist() for n in torch.randint(5, 300, (32,), generator=g)]
    for params in (SamplingParams(max_new_tokens=256, temperature=0.0, ignore_eos=True),
                   SamplingParams(max_new_tokens=256, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)):
        alone = _engine(model, cfg, max_num_batched_tokens=4096).generate(mine, params, use_tqdm=False)
        crowd = _engine(model, cfg, max_num_batched_tokens=96).generate(others[:20] + mine + others[20:], params,
                                                                        use_tqdm=False)[20:28]
        for a, c in zip(alone, crowd):
            assert a.completions[0].token_ids == c.completions[0].token_ids
            assert a.completions[0].logprobs == c.completions[0].logprobs      # bit-equal floats


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_bf16_pressure_gives_the_unpressured_bits(tmp_path, monkeypatch, mode):
    """As test_pressure_cuda.py, in bf16: with batch-invariant kernels, preemption (recompute
    re-prefills with the same per-row arithmetic as decode) changes no token and no logprob.
    KV splits of 128 keys, so contexts of up to 416 fold several."""
    from rollout.bench import pressure
    from rollout.layers import attention
    monkeypatch.setattr(attention, "INVARIANT_SPLIT_LEN", 128)
    out = tmp_path / "pressure.json"
    pressure.main(["--shape", "tiny", "--batch", "16", "--prompt-len", "32", "--gen-len", "384",
                   "--kv-fraction", "0.4", "--dtype", "bfloat16", "--device", "cuda", "--out", str(out),
                   "--preemption-mode", mode, "--swap-space-gb", "1", "--batch-invariant"])
    r = json.loads(out.read_text())
    pr, o = r["pressured"], r["outputs"]
    assert r["batch_invariant"] and pr["all_completed"] and pr["preemptions"] > 0
    assert o["identical"], o["first_diffs"]
    assert o["max_abs_dlogprob_same_tokens"] == 0.0
