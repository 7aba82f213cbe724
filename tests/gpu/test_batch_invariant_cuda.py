"""Batch-invariant mode on the GPU (engine batch_invariant=True): a sequence's tokens and
logprobs are the same bits whatever else shares its steps, so bf16 greedy runs under KV
pressure can equal the unpressured run exactly (issue 7). Skipped without CUDA."""
import json

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 14336), (2304, 1536), (96, 256)])
def test_gemm_row_bits_do_not_depend_on_the_row_count(N, K):
    """Llama-3-8B QKV and down_proj, a Qwen-1.5B-like shape, a tiny masked one. Rows alone, in a
    decode-sized batch, in a 3000-row prefill (masked M tail) and in subsets: equal bits. Against
    fp32: one bf16 rounding of the output (2^-8 relative) on fp32 sums of K products; 2e-2
    covers it with margin on these O(1) outputs, and a wrong tile or mask is O(1)."""
    from rollout.kernels.skinny_gemm import batch_invariant_gemm
    g = torch.Generator(device="cuda").manual_seed(N + K)
    x = torch.randn(3000, K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
    full = batch_invariant_gemm(x, w)
    torch.testing.assert_close(full.float(), x.float() @ w.float().T, rtol=2e-2, atol=2e-2)
    for rows in ([0], [2999], list(range(32)), list(range(64)), [5, 700, 2998], list(range(100, 1100))):
        assert torch.equal(batch_invariant_gemm(x[rows], w), full[rows]), rows


def _engine(model, cfg, **kw):
    from rollout import RolloutEngine
    args = dict(max_model_len=640, max_num_seqs=48, num_kv_pages=2048, seed=0, batch_invariant=True)
    args.update(kw)
    return RolloutEngine(model, cfg, **args)


def test_engine_sequence_bits_do_not_depend_on_batch_mates():
    """8 prompts alone (big prefill budget) against the same 8 among 32 others of other lengths
    with a 96-token prefill budget (prompts chunked, decode rows in mixed steps, other graph
    buckets): every token and logprob equal, greedy and seeded sampling."""
    from rollout import SamplingParams
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
def test_bf16_pressure_gives_the_unpressured_bits(tmp_path, mode):
    """As test_pressure_cuda.py, in bf16: with batch-invariant kernels, preemption (recompute
    re-prefills with the same per-row arithmetic as decode) changes no token and no logprob."""
    from rollout.bench import pressure
    out = tmp_path / "pressure.json"
    pressure.main(["--shape", "tiny", "--batch", "16", "--prompt-len", "32", "--gen-len", "384",
                   "--kv-fraction", "0.4", "--dtype", "bfloat16", "--device", "cuda", "--out", str(out),
                   "--preemption-mode", mode, "--swap-space-gb", "1", "--batch-invariant"])
    r = json.loads(out.read_text())
    pr, o = r["pressured"], r["outputs"]
    assert r["batch_invariant"] and pr["all_completed"] and pr["preemptions"] > 0
    assert o["identical"], o["first_diffs"]
    assert o["max_abs_dlogprob_same_tokens"] == 0.0
