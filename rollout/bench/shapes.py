"""Model shapes for benchmarks (random bf16 weights; nothing is downloaded)."""
from __future__ import annotations

SHAPES = {
    "llama3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      max_position_embeddings=32768, rope_theta=500000.0, tie_word_embeddings=False),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
                          tie_word_embeddings=False),
    "tiny-moe": dict(model_type="qwen3_moe", hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                     num_experts_per_tok=2, norm_topk_prob=True, vocab_size=1024, max_position_embeddings=1024,
                     tie_word_embeddings=False),
    "tiny": dict(model_type="llama", hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=2, vocab_size=4096,
                 max_position_embeddings=4096, tie_word_embeddings=False),
}


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Seeded random token ids, clear of the vocabulary's first and last 10 (special tokens)."""
    import torch
    return torch.randint(10, vocab - 10, (count, length), generator=torch.Generator().manual_seed(seed)).tolist()


def make_config(shape: str, **overrides):
    from transformers import AutoConfig

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    kw = {**SHAPES[shape], **overrides}
    return AutoConfig.for_model(kw.pop("model_type"), **kw)
