"""The skinny decode GEMM (kernels/skinny_gemm.py) on the GPU: against an fp32 reference on
fresh random inputs with poisoned outputs, every config of the swept table (layers/linear.py), and inside the
engine's CUDA graphs on a one-layer model of the Llama-3-8B shape (the table's shapes).
Skipped without CUDA."""
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _check(M, N, K, cfg, bias, seed):
    from rollout.kernels.skinny_gemm import skinny_gemm
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02)
    b = torch.randn(N, device="cuda", dtype=torch.bfloat16, generator=g) if bias else None
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    skinny_gemm(x, w, *cfg, out=out, bias=b)
    ref = x.float() @ w.float().T + (b.float() if bias else 0)
    cublas = F.linear(x, w, b).float()
    assert not out.isnan().any()
    # Both round an fp32 accumulation of the same products to bf16 once (8-bit mantissa): each
    # is within one bf16 rounding of the fp32 result, so within 2^-8 relative, plus a 1e-3
    # floor for outputs near zero where the different summation orders show.
    tol = ref.abs() * 2.0 ** -8 + 1e-3
    assert ((out.float() - ref).abs() <= tol).all(), (out.float() - ref).abs().max().item()
    assert ((cublas - ref).abs() <= tol).all()


@pytest.mark.parametrize("M", [1, 3, 16, 17, 32, 33, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_fp32_reference(M, bias):
    # N = 200: not a multiple of any BLOCK_N (masked tail); K = 512 spans several K tiles.
    # The last two split K (2 and 4 programs per tile, serial fix-up by the last to arrive).
    for i, cfg in enumerate([(16, 64, 4, 3), (32, 256, 4, 5), (64, 128, 4, 5), (128, 128, 8, 3),
                             (32, 64, 4, 3, 2), (64, 128, 4, 5, 4)]):
        _check(M, 200, 512, cfg, bias, seed=100 * M + i)


@pytest.mark.parametrize("split_k", [2, 4])
def test_split_k_same_bits_eager_and_every_graph_replay(split_k):
    """The split-K fix-up adds partials in split order whichever program arrives last, and
    resets its counters: eager and 50 replays of a graph of 8 chained calls give equal bits."""
    from rollout.kernels.skinny_gemm import skinny_gemm
    g = torch.Generator(device="cuda").manual_seed(split_k)
    x = torch.randn(32, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    w = 0.02 * torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    cfg = (64, 128, 4, 5, split_k)

    def chain():
        y = x
        for _ in range(8):
            y = skinny_gemm(y, w, *cfg) * 4.0    # keep magnitudes ~1 over the chain
        return y
    ref = chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for _ in range(50):
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out, ref)


def test_every_table_config_at_its_shape_and_row_range():
    from rollout.layers.linear import SKINNY_CONFIGS, pick_config
    for (N, K), ranges in SKINNY_CONFIGS.items():
        lo = 1
        for max_m, cfg in ranges:
            for M in sorted({lo, max_m}):
                assert pick_config(N, K, M) == cfg
                _check(M, N, K, cfg, False, seed=M)
            lo = max_m + 1
        assert pick_config(N, K, 65) is None                  # beyond the sweep: cuBLAS
    assert pick_config(4096, 14336, 33) is None               # cuBLAS won there


def test_engine_uses_it_in_graphs_and_matches_cublas():
    """One layer at the Llama-3-8B shape: decode graphs capture the skinny GEMM (eager and
    graph replay give equal bits), and the first token's logprob (prefill at M = 32 rows, so
    also the skinny path) is within bf16 rounding of the cuBLAS model's."""
    from transformers import AutoConfig

    import rollout.kernels.skinny_gemm as sk
    from rollout import RolloutEngine, SamplingParams
    from rollout.models.loader import build_model, init_random
    cfg = AutoConfig.for_model("llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                               num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8,
                               max_position_embeddings=1024, rope_theta=500000.0)
    calls = []
    inner = sk.skinny_gemm
    sk.skinny_gemm = lambda *a, **k: (calls.append(a[0].shape[0]), inner(*a, **k))[1]
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 128000, (8,), generator=g).tolist() for _ in range(4)]
        p = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
        outs = {}
        model = build_model(cfg, torch.bfloat16, torch.device("cuda"))
        init_random(model, 0)                     # the same weights in all three engines
        for skinny, graphs in ((True, False), (True, True), (False, True)):
            model.skinny_gemm = skinny            # before the engine captures its graphs
            calls.clear()
            eng = RolloutEngine(model, cfg, seed=0, max_model_len=256, num_kv_pages=64, max_num_seqs=4,
                                cuda_graphs=graphs)
            outs[skinny, graphs] = eng.generate(prompts, p, use_tqdm=False)
            assert bool(calls) == skinny          # with graphs: the calls made while capturing
            assert (eng.pipeline.counts["graph_steps"] > 0) == graphs
            del eng
    finally:
        sk.skinny_gemm = inner
    for a, b in zip(outs[True, False], outs[True, True]):
        assert a.completions[0].token_ids == b.completions[0].token_ids
        assert a.completions[0].logprobs == b.completions[0].logprobs
    # Logits of magnitude ~2-4 have a bf16 spacing of 2^-7 to 2^-6; four spacings bound the
    # logprob difference from rounding the GEMM outputs differently.
    for a, b in zip(outs[True, True], outs[False, True]):
        assert abs(a.completions[0].logprobs[0] - b.completions[0].logprobs[0]) < 4 * 2.0 ** -6


def test_split_k_partials_into_the_norm_same_bits_at_8b_shapes_and_in_the_engine():
    """o_proj and down_proj at M = 32 (the table's split-K configs): the norm kernel summing the
    GEMM's partials gives the fix-up path's bits; and one 8B-shape layer through the engine's
    decode graphs gives the same greedy tokens and logprobs with it on and off."""
    from engine_ab import assert_same_tokens_and_logprobs, generate_per_setting, llama8b_model
    from rollout.env import KernelSwitches
    from rollout.kernels.fused_ops import add_rmsnorm
    from rollout.kernels.skinny_gemm import skinny_gemm
    from rollout.layers.linear import pick_config
    g = torch.Generator(device="cuda").manual_seed(0)
    for N, K in ((4096, 4096), (4096, 14336)):
        cfg = pick_config(N, K, 32)
        if len(cfg) < 5 or cfg[4] == 1:
            continue                                  # this shape does not split K at M = 32
        x = torch.randn(32, K, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        res = torch.randn(32, N, device="cuda", dtype=torch.bfloat16, generator=g)
        nw = torch.ones(N, device="cuda", dtype=torch.bfloat16)
        want = add_rmsnorm(res, nw, 1e-5, delta=skinny_gemm(x, w, *cfg))
        got = add_rmsnorm(res, nw, 1e-5, delta=skinny_gemm(x, w, *cfg, partials=True))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (N, K)
    model, cfg = llama8b_model(1)
    outs = generate_per_setting(model, cfg, {on: lambda on=on: dict(kernels=KernelSwitches(splitk_into_norm=on))
                                             for on in (False, True)}, prompt_lens=(3, 40), seed=2)
    assert_same_tokens_and_logprobs(outs[False], outs[True])


def test_gate_up_silu_epilogue_same_bits_at_8b_shape_and_in_the_engine():
    """The 8B gate_up GEMM with SiLU * up in its epilogue, at the table's configs for M = 1, 16,
    32 and 64: the bits of the plain GEMM followed by fused_ops.silu_mul. Then one 8B-shape layer
    through the engine's decode graphs: the same greedy tokens and logprobs with it on and off."""
    from engine_ab import assert_same_tokens_and_logprobs, generate_per_setting, llama8b_model
    from rollout.env import KernelSwitches
    from rollout.kernels.fused_ops import silu_mul
    from rollout.kernels.skinny_gemm import skinny_gemm
    from rollout.layers.linear import pick_config
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(28672, 4096, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    for M in (1, 16, 32, 64):
        cfg = pick_config(28672, 4096, M)
        assert cfg is not None and (len(cfg) < 5 or cfg[4] == 1), cfg   # the epilogue path takes no split-K
        x = torch.randn(M, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
        want = silu_mul(skinny_gemm(x, w, *cfg))
        got = skinny_gemm(x, w, *cfg, silu_mul=True)
        assert torch.equal(got, want), M
    model, cfg = llama8b_model(1)
    outs = generate_per_setting(model, cfg, {on: lambda on=on: dict(kernels=KernelSwitches(silu_in_gate_up=on))
                                             for on in (False, True)}, prompt_lens=(3, 40), seed=5)
    assert_same_tokens_and_logprobs(outs[False], outs[True])


def test_qkv_rope_epilogue_same_bits_at_8b_shape_and_in_the_engine():
    """The 8B QKV GEMM with RoPE and the K/V write in its epilogue, at the table's configs for
    M = 1, 16 and 32 and at three split-K configs: the q, cache and untouched-slot bits of the
    plain GEMM (same config) followed by rope_and_write_kv (both compiled without FMA
    contraction, libdevice cos/sin), positions up to 16K. Then one 8B-shape layer through the
    engine's decode graphs: the same greedy tokens and logprobs with it on and off."""
    from engine_ab import assert_same_tokens_and_logprobs, generate_per_setting, llama8b_model
    from rollout.env import KernelSwitches
    from rollout.kernels.rope_kv import qkv_rope_and_write_kv, rope_and_write_kv
    from rollout.kernels.skinny_gemm import skinny_gemm
    from rollout.layers.linear import pick_config
    D, ps = 128, 16
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    inv_freq = (1.0 / (500000.0 ** (torch.arange(0, D, 2).float() / D))).cuda()
    # The table's configs, then split-K ones (wide tiles re-read less of x; the tile's last split
    # program does the epilogue after the fix-up), twice each (the counters reset themselves).
    cases = [(M, pick_config(6144, 4096, M)) for M in (1, 16, 32)]
    cases += [(32, (128, 128, 8, 4, 2)), (32, (64, 128, 4, 5, 2)), (16, (128, 128, 4, 4, 4))] * 2
    for M, cfg in cases:
        assert cfg is not None, M
        x = torch.randn(M, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
        positions = torch.randint(0, 16384, (M,), device="cuda", generator=g)
        slots = torch.randperm(64 * ps, device="cuda", generator=g)[:M]
        slots[0] = -1                                               # a padding row: not written
        caches = [[torch.full((64, ps, 8, D), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(2)]
                  for _ in range(2)]
        q, k, v = (t.view(M, -1, D) for t in skinny_gemm(x, w, *cfg).split([4096, 1024, 1024], dim=-1))
        want = rope_and_write_kv(q, k, v, positions, inv_freq, *caches[0], slots)
        got = qkv_rope_and_write_kv(x, w, 32, positions, inv_freq, *caches[1], slots, *cfg)
        assert torch.equal(got, want), M
        for a, b in zip(*caches):
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), M
    model, cfg = llama8b_model(1)
    outs = generate_per_setting(model, cfg, {on: lambda on=on: dict(kernels=KernelSwitches(rope_in_qkv=on))
                                             for on in (False, True)}, prompt_lens=(3, 40), seed=6)
    assert_same_tokens_and_logprobs(outs[False], outs[True])


def test_packed_weight_tiles_same_bits_at_every_table_config():
    """Every config of the swept tables (plain and packed) at its row range: the skinny GEMM (and
    gate_up's SiLU epilogue, QKV's RoPE epilogue) reading the weight packed by pack_weight_tiles
    gives the plain layout's bits, with the output poisoned first."""
    from rollout.kernels.rope_kv import qkv_rope_and_write_kv
    from rollout.kernels.skinny_gemm import pack_weight_tiles, skinny_gemm
    from rollout.layers.linear import SKINNY_CONFIGS, SKINNY_CONFIGS_PACKED
    g = torch.Generator(device="cuda").manual_seed(7)
    inv_freq = (1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128))).cuda()
    for (N, K), entries in list(SKINNY_CONFIGS.items()) + list(SKINNY_CONFIGS_PACKED.items()):
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        for M, cfg in entries:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
            silu = N == 28672 and (len(cfg) < 5 or cfg[4] == 1)
            packed = pack_weight_tiles(w, cfg[0], cfg[1], "silu" if silu else "rows")
            outs = [torch.full((M, N // 2 if silu else N), float("nan"), device="cuda", dtype=torch.bfloat16)
                    for _ in range(2)]
            skinny_gemm(x, w, *cfg, out=outs[0], silu_mul=silu)
            skinny_gemm(x, packed, *cfg, out=outs[1], silu_mul=silu, tiled=True)
            assert not outs[1].isnan().any() and torch.equal(outs[0], outs[1]), (N, K, M, cfg)
            if N == 6144:        # QKV: the RoPE + K/V write epilogue over its own packing order
                pos = torch.randint(0, 8192, (M,), device="cuda", generator=g)
                slots = torch.randperm(64 * 16, device="cuda", generator=g)[:M]
                res = []
                for weight, tiled in ((w, False), (pack_weight_tiles(w, cfg[0], cfg[1], "rope", 128), True)):
                    kc, vc = (torch.full((64, 16, 8, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
                              for _ in range(2))
                    q = qkv_rope_and_write_kv(x, weight, 32, pos, inv_freq, kc, vc, slots, *cfg, tiled=tiled)
                    res.append(torch.cat([q.reshape(-1), kc.nan_to_num(7.0).reshape(-1),
                                          vc.nan_to_num(7.0).reshape(-1)]))
                assert torch.equal(res[0], res[1]), (M, cfg)


def test_packed_decode_weights_in_the_engine_same_bits_and_kept_in_step_by_weight_updates(monkeypatch):
    """pack_decode_weights=True on one 8B-shape layer: the decode graphs read the packed copies
    (every decode GEMM weight has one). down_proj's packed config does not split K (another
    summation order than the plain table's), so here the packed table is emptied: both engines
    run the same configs and must give the same greedy tokens and logprobs bit for bit
    (test_packed_weight_tiles_same_bits_at_every_table_config covers the packed table's configs).
    A weight update through WeightSync refreshes the copies in place: afterwards the packed
    engine again matches a plain engine on the new weights, and its tokens changed."""
    from engine_ab import assert_same_tokens_and_logprobs, llama8b_model
    from rollout import RolloutEngine, SamplingParams
    from rollout.layers import linear
    from rollout.weights import WeightSync
    monkeypatch.setattr(linear, "SKINNY_CONFIGS_PACKED", {})
    model, cfg = llama8b_model(1)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128000, (int(n),), generator=g).tolist()
               for n in torch.randint(3, 40, (32,), generator=g)]
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)

    def run(pack):
        if not pack:
            model.pack_decode_weights(32, on=False)
        eng = RolloutEngine(model, cfg, seed=0, max_model_len=512, num_kv_pages=1024, max_num_seqs=32,
                            pack_decode_weights=pack)
        out = eng.generate(prompts, params, use_tqdm=False)
        assert eng.pipeline.counts["graph_steps"] > 0
        return eng, out

    _, plain0 = run(False)
    eng, packed0 = run(True)
    lins = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(lins) == 5 and all(getattr(m, "weight_tiles", None) is not None for m in lins)
    ptrs = [m.weight_tiles.data_ptr() for m in lins]
    assert_same_tokens_and_logprobs(plain0, packed0)
    gen = torch.Generator(device="cuda").manual_seed(11)
    update = [(n, torch.randn(t.shape, device="cuda", dtype=t.dtype, generator=gen) * 0.02)
              for n, t in model.hf_targets().items() if n.endswith("proj.weight") or n == "lm_head.weight"]
    sync = WeightSync(eng)
    sync.stage(update, version=1)
    assert sync.commit() == 1
    packed1 = eng.generate(prompts, params, use_tqdm=False)
    assert [m.weight_tiles.data_ptr() for m in lins] == ptrs          # in place: the graphs' addresses
    del eng
    _, plain1 = run(False)
    assert_same_tokens_and_logprobs(plain1, packed1)
    assert [o.completions[0].token_ids for o in packed1] != [o.completions[0].token_ids for o in packed0]


def test_pack_decode_weights_with_nothing_to_pack_is_a_clear_error():
    """A model none of whose decode GEMMs takes the skinny GEMM (the table holds the 8B shapes):
    pack_decode_weights=True is refused before anything is packed or allocated."""
    from rollout import RolloutEngine
    from rollout.bench.shapes import make_config
    from rollout.models.loader import build_model, init_random
    cfg = make_config("tiny")
    model = build_model(cfg, torch.bfloat16, torch.device("cuda"))
    init_random(model, 0)
    with pytest.raises(ValueError, match="nothing to pack"):
        RolloutEngine(model, cfg, max_model_len=64, num_kv_pages=16, pack_decode_weights=True)
    assert all(getattr(m, "weight_tiles", None) is None for m in model.modules())
