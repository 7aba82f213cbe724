"""Speculative decoding on the GPU: drafted steps replay verify graphs (one per token bucket, captured on
first use, padded with inert tokens and sequences) and, in batch-invariant bf16, give the tokens and
logprobs of plain decoding bit for bit; in fp32 they match plain eager decoding. Skipped without CUDA."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from rollout import RolloutEngine, SamplingParams  # noqa: E402


def _config():
    from transformers import AutoConfig
    return AutoConfig.for_model("qwen2", vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)


def _engine(dtype_="bfloat16", **kw):
    return RolloutEngine.from_config(_config(), seed=0, device="cuda", dtype=dtype_, max_model_len=512,
                                     num_kv_pages=512, max_num_seqs=32, **kw)


def _prompts():
    g = torch.Generator().manual_seed(3)
    phrases = [torch.randint(10, 2000, (12,), generator=g).tolist() for _ in range(4)]
    return [p * 3 for p in phrases]           # repeated: n-gram drafts find matches


def _tokens(outs):
    return [[(c.token_ids, c.logprobs) for c in o.completions] for o in outs]


SPEC = dict(speculative="ngram", spec_max_draft=4, spec_history_prompts=8)


def test_verify_graphs_give_plain_decodings_bits_in_batch_invariant_mode():
    plain, spec = _engine(batch_invariant=True), _engine(batch_invariant=True, **SPEC)
    p = SamplingParams(n=2, max_new_tokens=64, temperature=1.0, seed=5, ignore_eos=True)
    prompts = _prompts()
    for _ in range(2):                         # round 2 drafts from round 1's completions (the same seed)
        assert _tokens(spec.generate(prompts, p, use_tqdm=False)) == _tokens(plain.generate(prompts, p, use_tqdm=False))
    st, c = spec.stats(), spec.pipeline.counts
    assert st["spec_accepted"] > 0 and c["verify_graph_steps"] > 0 and c["graph_capture_failures"] == 0, (st, c)
    assert c["verify_padded_steps"] >= c["verify_graph_steps"]
    keys = [k for k in spec.pipeline.graphs.graphs if isinstance(k[1], tuple)]
    assert keys and all(k[1][0] == k[1][1] for k in keys)      # one graph per token bucket


def test_verify_graphs_match_eager_fp32():
    """fp32 (no TF32), greedy: speculation with verify and decode graphs against plain eager decoding. Padded
    GEMMs may pick other kernels, so logprobs agree to ~1e-6 and tokens exactly; 1e-4 leaves room."""
    p = SamplingParams(n=2, max_new_tokens=48, temperature=0.0, ignore_eos=True)
    spec, eager = _engine(dtype_="float32", **SPEC), _engine(dtype_="float32", cuda_graphs=False)
    prompts = _prompts()
    for _ in range(2):
        for a, b in zip(spec.generate(prompts, p, use_tqdm=False), eager.generate(prompts, p, use_tqdm=False)):
            for ca, cb in zip(a.completions, b.completions):
                assert ca.token_ids == cb.token_ids
                assert max(abs(x - y) for x, y in zip(ca.logprobs, cb.logprobs)) < 1e-4
    assert spec.pipeline.counts["verify_graph_steps"] > 0 and spec.stats()["spec_accepted"] > 0
