"""bench.profile's kernel categories (the profile itself needs CUDA)."""
from rollout.bench.profile import categorize


def test_kernel_names_fall_into_the_step_breakdown_categories():
    assert categorize("_decode_split_kernel") == categorize("_decode_merge_kernel") == "attention"
    assert categorize("_gluon_decode_split_kernel") == "attention"      # kernels/gluon_decode.py
    assert categorize("_gluon_decode_keys_kernel") == "attention"       # its keys form, the default
    assert categorize("_skinny_gemm_kernel") == categorize("nvjet_tst_128x64_64x8") == "gemm"
    assert categorize("_qkv_rope_kernel") == "gemm"          # the QKV GEMM with its RoPE epilogue
    assert categorize("_add_rmsnorm_kernel") == categorize("_rope_kv_kernel") == "fused small ops"
    assert categorize("_sample_kernel") == "sampling"
    assert categorize("_moe_gate_up_kernel") == categorize("_moe_align_one_kernel") == "moe experts"   # fused MoE
    assert categorize("_route_kernel") == "moe router"
    assert categorize("void at::native::vectorized_elementwise_kernel<4>") == "other small ops"


def test_the_profiled_window_times_the_whole_batch_decoding():
    """Chunked prefill lets the first prompts decode while later ones prefill; decoding_engine's
    headroom keeps them running until the last prompt is in, so the timed window holds all B rows
    (without it, 512 x 2304 on the H200 profiled ~200 rows). Tiny model on the CPU, 8 prefill steps."""
    from rollout.bench.profile import decoding_engine, step_until_decoding
    from rollout.bench.shapes import make_config
    cfg = make_config("qwen2.5-1.5b")
    cfg.update(dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, vocab_size=1000))
    B, C = 64, 512
    eng = decoding_engine(cfg, B, C, new_tokens=1, device="cpu")
    step_until_decoding(eng, B, extra_steps=1)
    running = eng.scheduler.running
    assert len(running) == B and all(s.num_computed >= s.num_prompt for s in running)
    assert not eng.scheduler.waiting


def test_grouped_profile_decodes_every_sample_up_to_the_context():
    """GRPO groups (n = 8): B / n prompts prefilled once, their n samples sharing the prompt's
    pages, all B rows decoding and holding `context` tokens before the timed window."""
    from rollout.bench.profile import decoding_engine, step_until_decoding
    from rollout.bench.shapes import make_config
    cfg = make_config("qwen2.5-1.5b")
    cfg.update(dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, vocab_size=1000))
    B, n, P, C = 32, 8, 48, 80
    eng = decoding_engine(cfg, B, C, new_tokens=1, device="cpu", n=n, prompt_len=P)
    step_until_decoding(eng, B, extra_steps=1, context=C)
    running = eng.scheduler.running
    assert len(running) == B and all(s.num_tokens >= C and s.num_prompt == P for s in running)
    # the samples of a group share its prompt pages: B / n distinct first pages
    assert len({s.block_table[0] for s in running}) == B // n


def test_run_meta_records_the_rollout_switches_a_run_was_under(monkeypatch):
    """A/B runs differ only in a ROLLOUT_* variable (e.g. ROLLOUT_GLUON_DECODE=0), which the command
    line does not show; the commit passed in for the device has its own field."""
    from rollout.bench.__main__ import run_meta
    monkeypatch.setenv("ROLLOUT_GLUON_DECODE", "0")
    monkeypatch.setenv("ROLLOUT_GIT_COMMIT", "abc1234")
    env = run_meta("rollout.bench", ["--shape", "tiny"])["environment"]
    assert env["ROLLOUT_GLUON_DECODE"] == "0" and "ROLLOUT_GIT_COMMIT" not in env
