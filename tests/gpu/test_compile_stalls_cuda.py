"""No Triton kernel is compiled inside a serving step once the engine has captured its graphs
and served one short request. A compile in a step holds the GPU for ~0.4 s: P3's first timed run
lost ~3 s to seven of them (the sampler compiled per split-count class of the step's row count,
the prefill kernel per class of its sequence count; an MoE's grouped GEMMs per tile class and per class of
its pair and block counts). Skipped without CUDA."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from rollout import RolloutEngine, SamplingParams  # noqa: E402


def _prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, 200, (n,), generator=g)
    return [torch.randint(3, 150_000, (int(L),), generator=g).tolist() for L in lengths]


# Qwen's vocab: the sampler's split counts depend on V and the row count. The MoE: 8 experts, top-2, so
# 512-token chunks reach its long-prefill tiles (128 pairs per expert) and decode rows its decode tiles.
CONFIGS = {"qwen2": dict(intermediate_size=512),
           "qwen3_moe": dict(intermediate_size=512, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                             norm_topk_prob=True, head_dim=32)}


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_no_triton_compiles_in_steps_after_the_first_request(model_type, monkeypatch):
    import triton
    from transformers import AutoConfig

    from rollout.kernels import fused_moe as fm
    from rollout.layers.moe import moe_tiles
    cfg = AutoConfig.for_model(model_type, vocab_size=151_936, hidden_size=256, num_hidden_layers=2,
                               num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                               **CONFIGS[model_type])
    tiles_run, fused = set(), fm.fused_moe

    def recording(x, weights, ids, *rest):
        tiles_run.add(moe_tiles(x.shape[0], ids.shape[1], cfg.num_experts))
        return fused(x, weights, ids, *rest)
    monkeypatch.setattr(fm, "fused_moe", recording)
    eng = RolloutEngine.from_config(cfg, seed=0, device="cuda", dtype="bfloat16", max_model_len=512, num_kv_pages=4096,
                                    max_num_batched_tokens=512, max_num_seqs=256,
                                    cuda_graph_modes=("greedy", "truncate"))
    eng.generate(_prompts(2, 0), SamplingParams(max_new_tokens=8, temperature=0.0), use_tqdm=False)  # first request
    compiled = []
    tiles_run.clear()
    triton.knobs.runtime.jit_cache_hook = lambda *, repr, **_: compiled.append(repr[:100])
    try:
        # GRPO groups through chunked prefill: eager steps mix prefill chunks with decode rows, so
        # their row and sequence counts take many values; then top-p sampling the same way.
        outs = eng.generate(_prompts(24, 1), SamplingParams(n=8, max_new_tokens=24, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
        outs += eng.generate(_prompts(13, 2), SamplingParams(n=4, max_new_tokens=16, temperature=1.0, top_p=0.9, seed=1,
                                                             ignore_eos=True), use_tqdm=False)
    finally:
        triton.knobs.runtime.jit_cache_hook = None
    assert sum(len(c.token_ids) for o in outs for c in o.completions) == 24 * 8 * 24 + 13 * 4 * 16
    assert eng.stats()["eager_steps"] > 10        # the mixed steps this test is about did run eagerly
    assert compiled == [], f"{len(compiled)} kernels compiled inside steps: {compiled}"
    if model_type == "qwen3_moe":     # the eager steps took every tile class (the start-up compiled them)
        assert len(tiles_run) == 3, tiles_run
