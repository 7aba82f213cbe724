"""bench.profile's kernel categories (the profile itself needs CUDA)."""
from rollout.bench.profile import categorize


def test_kernel_names_fall_into_the_step_breakdown_categories():
    assert categorize("_decode_split_kernel") == categorize("_decode_merge_kernel") == "attention"
    assert categorize("_skinny_gemm_kernel") == categorize("nvjet_tst_128x64_64x8") == "gemm"
    assert categorize("_qkv_rope_kernel") == "gemm"          # the QKV GEMM with its RoPE epilogue
    assert categorize("_mlp_kernel") == "gemm"               # the persistent MLP block
    assert categorize("_add_rmsnorm_kernel") == categorize("_rope_kv_kernel") == "fused small ops"
    assert categorize("_sample_kernel") == "sampling"
    assert categorize("void at::native::vectorized_elementwise_kernel<4>") == "other small ops"
