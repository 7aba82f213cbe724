"""The decode megakernel's CPU-testable parts (kernels/decode_layers.py): the Triton prologue under
the interpreter against torch, the stacked KV view, and DecoderLM.use_decode_megakernel's stacked
weights (views that weight updates land in). The kernel itself is sm_90-only: its compile is
checked in test_bench_ws.py, its numbers in tests/gpu/test_decode_layers_cuda.py."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")     # before triton is imported (as the other kernel tests)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")


def _llama(**kw):
    from transformers import AutoConfig

    from rollout.models.decoder import DecoderLM
    args = dict(vocab_size=64, hidden_size=512, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=128, max_position_embeddings=256)
    args.update(kw)
    torch.manual_seed(0)
    return DecoderLM(AutoConfig.for_model("llama", **args)).to(torch.bfloat16)


def test_prologue_matches_torch():
    """res = emb, xn = emb * n rounded once to bf16, the partial sums of squares by 32-column tile
    (fp32, within fp32 summation order: 1e-5 relative), cos / sin as DecoderLM.rope rounds them.
    The interpreter casts fp32 to bf16 by truncation where the GPU rounds to nearest, so the bf16
    results may differ by one bf16 ulp (2^-8 relative at most) here."""
    from rollout.kernels.decode_layers import BLOCK_M, BLOCK_N, prologue
    model = _llama()
    M, H = 5, 512
    emb = torch.randn(M, H).to(torch.bfloat16)
    n = (1 + 0.2 * torch.randn(H)).to(torch.bfloat16)
    pos = torch.tensor([0, 1, 7, 100, 255])
    res, xn = torch.full_like(emb, float("nan")), torch.full_like(emb, float("nan"))
    ss = torch.full((H // BLOCK_N, BLOCK_M), float("nan"))
    cs = torch.full((M, 128), float("nan"), dtype=torch.bfloat16)
    prologue(emb, n, pos, model.inv_freq.float(), res, xn, ss, cs)
    assert torch.equal(res, emb)
    torch.testing.assert_close(xn.float(), (emb.float() * n.float()).to(torch.bfloat16).float(), rtol=2 ** -7, atol=0)
    want = emb.float().view(M, H // BLOCK_N, BLOCK_N).pow(2).sum(-1).T
    torch.testing.assert_close(ss[:, :M], want, rtol=1e-5, atol=1e-5)
    cos, sin = model.rope(pos)
    torch.testing.assert_close(cs.float(), torch.cat([cos[:, :64], sin[:, :64]], 1).float(), rtol=2 ** -7, atol=1e-6)


def test_stacked_kv_needs_one_allocation():
    from rollout.kernels.decode_layers import stacked_kv
    pool = torch.randn(3, 2, 4, 16, 2, 128)
    view = stacked_kv([(p[0], p[1]) for p in pool])
    assert view.data_ptr() == pool.data_ptr() and torch.equal(view, pool)
    with pytest.raises(ValueError, match="one"):
        stacked_kv([(torch.randn(4, 16, 2, 128), torch.randn(4, 16, 2, 128)) for _ in range(2)])


def test_runner_kv_caches_are_views_of_one_pool():
    from rollout.kernels.decode_layers import stacked_kv
    from rollout.runner import ModelRunner
    model = _llama()
    runner = ModelRunner(model, num_pages=8, page_size=16, kv_dtype=torch.bfloat16)
    assert stacked_kv(runner.kv_caches).data_ptr() == runner.kv_pool.data_ptr()
    assert runner.kv_pool.shape == (2, 2, 8, 16, 2, 128)


def test_use_decode_megakernel_stacks_weights_as_views():
    """The layers' weights become views of [L, ...] stacks holding the same values; an in-place
    write through hf_targets (what weight updates do) lands in the stack the kernel reads."""
    model = _llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.use_decode_megakernel(num_sms=132)
    w = model.decode_weights
    assert model.decode_megakernel and set(w) == {"wqkv", "wo", "wgu", "wd", "n_in", "n_post"}
    assert w["wqkv"].shape == (2, (4 + 2 * 2) * 128, 512) and w["n_in"].shape == (3, 512)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    layer = model.layers[1]
    assert layer.mlp.down_proj.weight.data_ptr() == w["wd"][1].data_ptr()
    assert model.norm.weight.data_ptr() == w["n_in"][2].data_ptr()
    targets = model.hf_targets()
    targets["model.layers.1.self_attn.k_proj.weight"].fill_(0.5)
    assert (w["wqkv"][1, 512:768] == 0.5).all() and (w["wqkv"][0] != 0.5).any()
    model.use_decode_megakernel(num_sms=132)              # again: the same stacks, not new copies
    assert model.decode_weights is w


@pytest.mark.parametrize("kw, why", [(dict(head_dim=64, num_attention_heads=8), "head_dim"),
                                     (dict(hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
                                           intermediate_size=512), "programs resident"),
                                     (dict(attention_bias=True), "bias")])
def test_use_decode_megakernel_refuses_other_models(kw, why):
    model = _llama(**kw)
    with pytest.raises(ValueError, match=why):
        model.use_decode_megakernel(num_sms=132)
    assert not model.decode_megakernel and model.decode_weights is None


def test_engine_refuses_the_megakernel_on_cpu(model_dir):
    """decode_megakernel=True on CPU: a clear error before anything is allocated, the model's
    weights not stacked."""
    from rollout import RolloutEngine
    eng = RolloutEngine.from_pretrained(model_dir("llama"), max_model_len=64, num_kv_pages=16)
    with pytest.raises(ValueError, match="decode_megakernel=True needs the Triton kernels on a CUDA"):
        RolloutEngine(eng.model, eng.hf_config, max_model_len=64, num_kv_pages=16, decode_megakernel=True)
    assert eng.model.decode_weights is None and not eng.model.decode_megakernel


def test_forward_takes_the_megakernel_for_decode_steps_of_at_most_32_rows(monkeypatch):
    """DecoderLM's fused path calls decode_layers (here a stand-in returning a known residual) for
    decode-only steps of <= 32 rows and returns the final norm of what it returns; steps with more
    rows or a prefill chunk take the launches."""
    from rollout.attention import AttentionMetadata
    from rollout.kernels import decode_layers as dl
    from rollout.kernels.fused_ops import add_rmsnorm
    model = _llama()
    model.use_decode_megakernel(num_sms=132)
    calls = []

    def stand_in(emb, *a, **k):
        calls.append(emb.shape[0])
        return torch.full_like(emb, 0.5) + torch.arange(emb.shape[1], dtype=emb.dtype) / emb.shape[1]
    monkeypatch.setattr(dl, "decode_layers", stand_in)
    pool = torch.zeros(2, 2, 8, 16, 2, 128, dtype=torch.bfloat16)
    kv = [(p[0], p[1]) for p in pool]

    def meta(rows, decode_only):
        return AttentionMetadata(slot_mapping=torch.arange(rows) + 16,
                                 block_tables=torch.ones(rows, 1, dtype=torch.int32),
                                 seq_lens=torch.ones(rows, dtype=torch.int32),
                                 query_start_loc=torch.arange(rows + 1, dtype=torch.int32), seq_lens_host=[1] * rows,
                                 query_start_host=list(range(rows + 1)), page_size=16, backend="triton",
                                 decode_only=decode_only)
    with torch.no_grad():
        out = model(torch.zeros(32, dtype=torch.long), torch.zeros(32, dtype=torch.long), kv, meta(32, True))
        want = add_rmsnorm(stand_in(torch.zeros(32, 512, dtype=torch.bfloat16)), model.norm.weight, model.norm.eps)[0]
        assert calls == [32, 32] and torch.equal(out, want)
        calls.clear()
        model(torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long), kv, meta(3, False))
        model(torch.zeros(33, dtype=torch.long), torch.zeros(33, dtype=torch.long), kv, meta(33, True))
        assert calls == []
