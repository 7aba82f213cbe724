"""Engine-level KV behaviour on CPU: prompt sharing across a GRPO group, preemption by
recompute under a tiny KV budget, chunked prefill, and no leaked pages."""
import pytest
import torch

from hf_reference import hf_token_logprobs, random_prompts
from hf_reference import cpu_engine
from rollout import RolloutEngine, SamplingParams

PAGE = 16


def _engine(path, **kw):
    return cpu_engine(path, **{"max_num_batched_tokens": 512, "page_size": PAGE, **kw})


def _pages(tokens):
    return -(-tokens // PAGE)


@pytest.mark.parametrize("prompt_len", [37, 48])   # partial last page, and an exact page fit
def test_group_prefix_sharing_equals_separate_requests(model_dir, tiny_tokenizer, prompt_len):
    path = model_dir("llama")
    prompt = random_prompts(tiny_tokenizer, 1, prompt_len, prompt_len, seed=7)[0]
    assert len(prompt) == prompt_len
    M = 20
    greedy = SamplingParams(max_new_tokens=M, temperature=0, ignore_eos=True)

    grouped = _engine(path)
    g = grouped.add_requests([prompt], SamplingParams(n=8, max_new_tokens=M, temperature=0, ignore_eos=True))
    grouped.step()          # the prompt's only prefill step, then the group forks
    req = grouped.requests[g[0]]
    assert len(req.seqs) == 8
    first_page = req.seqs[0].block_table[0]
    assert grouped.kv.alloc.refcount[first_page] == 8          # shared, not copied
    assert grouped.kv.alloc.total_allocations == _pages(prompt_len)   # prompt pages allocated once
    outs = []
    while grouped.has_unfinished():
        outs += grouped.step()
    group_tokens = [c.token_ids for c in outs[0].completions]

    separate = _engine(path)
    sep_outs = separate.generate([prompt] * 8, greedy, use_tqdm=False)
    assert group_tokens == [o.completions[0].token_ids for o in sep_outs]

    # Exact page accounting: prompt pages once, one copy-on-write per child when the last
    # prompt page is partial, then each sample's own decode pages (M-1 tokens are written).
    cow = 7 if prompt_len % PAGE else 0
    own = _pages(prompt_len + M - 1) - _pages(prompt_len)
    assert grouped.kv.alloc.total_allocations == _pages(prompt_len) + cow + 8 * own
    assert separate.kv.alloc.total_allocations == 8 * _pages(prompt_len + M - 1)
    assert grouped.kv.alloc.num_used == 0 and separate.kv.alloc.num_used == 0


@pytest.mark.parametrize("family,temperature", [("llama", 0.0), ("qwen3", 0.0), ("llama", 0.9)])
def test_preemption_gives_identical_output_and_no_leak(model_dir, tiny_tokenizer, family, temperature):
    """Greedy, and seeded sampling: a preempted sequence (maybe with a token in flight)
    recomputes its KV and resamples the same tokens (the RNG is keyed by position)."""
    path = model_dir(family)
    prompts = random_prompts(tiny_tokenizer, 6, 10, 60, seed=3)
    params = [SamplingParams(n=2 if i % 3 == 0 else 1, max_new_tokens=60, temperature=temperature, seed=11,
                             ignore_eos=True) for i in range(len(prompts))]
    roomy = _engine(path).generate(prompts, params, use_tqdm=False)
    # 20 pages x 16 = 320 token positions for 8 sequences of up to ~120 tokens: must preempt.
    tight = _engine(path, num_kv_pages=20, max_num_batched_tokens=32, kv_reserve_fraction=0.0)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.scheduler.num_preemptions > 0
    for a, b in zip(roomy, outs):
        assert [c.token_ids for c in a.completions] == [c.token_ids for c in b.completions]
        for ca, cb in zip(a.completions, b.completions):
            # Recomputed KV (prefill) vs incremental KV (decode) differ only by fp32
            # reduction order: ~1e-6 on these logits.
            assert max(abs(x - y) for x, y in zip(ca.logprobs, cb.logprobs)) < 1e-4
    assert tight.kv.alloc.num_used == 0
    assert all(r == 0 for r in tight.kv.alloc.refcount)


def test_chunked_prefill_matches_single_pass(model_dir, tiny_tokenizer):
    path = model_dir("qwen2")
    prompts = random_prompts(tiny_tokenizer, 3, 90, 120, seed=11)
    p = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    whole = _engine(path, max_num_batched_tokens=512).generate(prompts, p, use_tqdm=False)
    chunked_engine = _engine(path, max_num_batched_tokens=16)    # 16-token prefill chunks
    chunked = chunked_engine.generate(prompts, p, use_tqdm=False)
    assert [o.completions[0].token_ids for o in whole] == [o.completions[0].token_ids for o in chunked]
    assert chunked_engine.metrics["steps"] > 3 * 120 // 16


def test_score_matches_hf_forward(model_dir, tiny_tokenizer):
    path = model_dir("mistral")              # sliding window 24 < sequence length
    seqs = random_prompts(tiny_tokenizer, 2, 40, 80, seed=5)
    eng = _engine(path, max_num_batched_tokens=32)     # scoring in chunks too
    for T in (1.0, 0.7):
        got = eng.score(seqs, temperature=T)
        for s, lp in zip(seqs, got):
            ref = hf_token_logprobs(path, s[:1], s[1:], temperature=T)
            assert len(lp) == len(s) - 1
            # fp32 forward of the same weights, different kernels: ~1e-6.
            assert max(abs(a - b) for a, b in zip(lp, ref.tolist())) < 1e-5
    assert eng.kv.alloc.num_used == 0


def test_full_reservation_admission_avoids_preemption(model_dir, tiny_tokenizer):
    path = model_dir("llama")
    prompts = random_prompts(tiny_tokenizer, 6, 10, 60, seed=3)
    params = SamplingParams(n=2, max_new_tokens=60, temperature=0, ignore_eos=True)
    roomy = _engine(path).generate(prompts, params, use_tqdm=False)
    reserved = _engine(path, num_kv_pages=40, max_num_batched_tokens=64, kv_reserve_fraction=1.0)
    outs = reserved.generate(prompts, params, use_tqdm=False)
    # Admission waited for room instead of overcommitting: same outputs, no preemption.
    assert reserved.scheduler.num_preemptions == 0
    assert [[c.token_ids for c in o.completions] for o in roomy] == [[c.token_ids for c in o.completions] for o in outs]
    greedy_overcommit = _engine(path, num_kv_pages=40, max_num_batched_tokens=64, kv_reserve_fraction=0.0)
    greedy_overcommit.generate(prompts, params, use_tqdm=False)
    assert greedy_overcommit.scheduler.num_preemptions > 0        # the same load does preempt without it


@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_preemption_by_swap_gives_identical_output_and_no_leak(model_dir, tiny_tokenizer, mode):
    """The same tight KV as the recompute test, with host swap space: victims keep their KV in
    host pages and recompute only their last token; outputs equal the roomy run, no device page
    or host page is left in use."""
    path = model_dir("llama")
    prompts = random_prompts(tiny_tokenizer, 6, 10, 60, seed=3)
    params = [SamplingParams(n=2 if i % 3 == 0 else 1, max_new_tokens=60, temperature=t, seed=11,
                             ignore_eos=True) for i, t in enumerate([0.0, 0.9] * 3)]
    roomy = _engine(path).generate(prompts, params, use_tqdm=False)
    kw = dict(num_kv_pages=20, max_num_batched_tokens=32, kv_reserve_fraction=0.0)
    tight = _engine(path, preemption_mode=mode, swap_space_gb=0.01, **kw)
    if mode == "auto":       # make swapping the cheaper choice for every victim
        tight.scheduler.swap_page_s, tight.scheduler.recompute_token_s = 1e-6, 1.0
    outs = tight.generate(prompts, params, use_tqdm=False)
    recompute = _engine(path, **kw)
    recompute.generate(prompts, params, use_tqdm=False)
    st = tight.stats()
    assert st["swap_outs"] > 0 and st["swapped_pages"] >= st["swap_outs"]
    # Each swapped victim recomputes at most its last token; recompute victims all of theirs.
    assert st["recomputed_tokens"] < recompute.stats()["recomputed_tokens"]
    for a, b in zip(roomy, outs):
        assert [c.token_ids for c in a.completions] == [c.token_ids for c in b.completions]
        for ca, cb in zip(a.completions, b.completions):
            assert max(abs(x - y) for x, y in zip(ca.logprobs, cb.logprobs)) < 1e-4   # fp32 reduction order
    host = tight.scheduler.host_pages
    assert tight.kv.alloc.num_used == 0 and host.num_used == 0
    assert all(r == 0 for r in tight.kv.alloc.refcount) and all(r == 0 for r in host.refcount)


def test_auto_swaps_only_where_cheaper_and_recomputes_without_host_room(model_dir):
    from rollout.request import Request
    eng = _engine(model_dir("llama"), preemption_mode="auto", swap_space_gb=0.01)
    sch = eng.scheduler
    seq = Request(0, list(range(3, 100)), SamplingParams(), 0).seqs[0]
    seq.block_table, seq.num_computed = [1, 2, 3, 4, 5, 6, 7], 97
    sch.swap_page_s, sch.recompute_token_s = 1.0, 0.01     # 7 s to swap, 0.97 s to recompute
    assert not sch._swaps(seq)
    sch.swap_page_s = 0.001                                # 7 ms to swap
    assert sch._swaps(seq)
    host = sch.host_pages
    taken = [host.allocate() for _ in range(host.num_free - 6)]   # 6 host pages left, 7 needed
    assert not sch._swaps(seq)
    for h in taken:
        host.decref(h)
    seq.fork_count = 2                                     # an unforked group: always recompute
    assert not sch._swaps(seq)


def test_swap_configuration_errors(model_dir):
    path = model_dir("llama")
    with pytest.raises(ValueError, match="preemption_mode must be"):
        _engine(path, preemption_mode="spill")
    with pytest.raises(ValueError, match="needs host swap space"):
        _engine(path, preemption_mode="swap")


def test_batch_invariant_needs_cuda_triton_and_half_precision(model_dir):
    """batch_invariant=True runs on our Triton kernels only: on CPU (torch reference ops) it is a
    clear error at construction, not a silent no-op. The GPU side is tests/gpu/test_batch_invariant_cuda.py."""
    with pytest.raises(ValueError, match="batch_invariant=True needs the Triton kernels on a CUDA device"):
        _engine(model_dir("llama"), batch_invariant=True)


def test_pack_decode_weights_needs_cuda_triton_and_leaves_the_model_alone(model_dir):
    """pack_decode_weights=True packs weights for the Triton decode GEMMs: on CPU it is a clear
    error before anything is packed or allocated. The GPU side (same bits as the plain weights,
    kept in step by weight updates) is tests/gpu/test_skinny_gemm_cuda.py."""
    from rollout.engine import RolloutEngine
    eng = _engine(model_dir("llama"))
    with pytest.raises(ValueError, match="pack_decode_weights=True needs the Triton decode kernels on a CUDA"):
        RolloutEngine(eng.model, eng.hf_config, max_model_len=64, num_kv_pages=16, pack_decode_weights=True)
    assert all(getattr(m, "weight_tiles", None) is None for m in eng.model.modules())


def test_swapped_out_sequence_recomputed_on_request_and_abort_frees_host_pages(model_dir, tiny_tokenizer):
    """What the RL worker's stale_kv="recompute" policy does at a weight update: a sequence
    waiting with its KV in host pages drops it and re-prefills (same tokens: same weights
    here). And aborting a request whose sequence is swapped out frees its host pages."""
    from rollout.request import Status
    path = model_dir("llama")
    prompts = random_prompts(tiny_tokenizer, 6, 10, 60, seed=3)
    p = SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True)
    roomy = _engine(path).generate(prompts, p, use_tqdm=False)
    for abort in (False, True):
        eng = _engine(path, num_kv_pages=20, max_num_batched_tokens=32, kv_reserve_fraction=0.0,
                      preemption_mode="swap", swap_space_gb=0.01)
        ids = eng.add_requests(prompts, p)
        outs = []
        while not any(s.host_table for r in eng.requests.values() for s in r.seqs):
            outs += eng.step()
        swapped = [s for r in eng.requests.values() for s in r.seqs if s.host_table]
        assert all(s.status == Status.WAITING and not s.block_table for s in swapped)
        if abort:
            outs += eng.abort([s.request.request_id for s in swapped])
            assert eng.scheduler.host_pages.num_used == 0
        else:
            before = eng.scheduler.num_recomputed_tokens
            for s in swapped:
                eng.scheduler.recompute(s)
            assert eng.scheduler.host_pages.num_used == 0 and all(s.num_computed == 0 for s in swapped)
            assert eng.scheduler.num_recomputed_tokens > before
        while eng.has_unfinished():
            outs += eng.step()
        by_id = {o.request_id: o for o in outs}
        for rid, ref in zip(ids, roomy):
            got = by_id[rid].completions[0]
            if got.finish_reason == "abort":
                assert got.token_ids == ref.completions[0].token_ids[:len(got.token_ids)]
            else:
                assert got.token_ids == ref.completions[0].token_ids
        assert eng.kv.alloc.num_used == 0 and eng.scheduler.host_pages.num_used == 0


def test_automatic_kv_sizing_leaves_reserve_memory_free(monkeypatch):
    """reserve_memory (bytes) comes off the automatic (CUDA) KV size, page for page; a reserve larger
    than what is free, or a negative one, is a clear error. Free memory is faked: no GPU here."""
    from rollout.bench.shapes import make_config
    from rollout.runner import ModelRunner
    eng = RolloutEngine.__new__(RolloutEngine)
    eng.device, eng.hf_config, eng.max_model_len = torch.device("cuda"), make_config("tiny"), 256
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 << 30, 80 << 30))
    per_page = ModelRunner.kv_bytes_per_page(eng.hf_config, 16, torch.bfloat16)
    base = eng._size_kv(None, None, 16, torch.bfloat16, 8)
    less = eng._size_kv(None, None, 16, torch.bfloat16, 8, reserve=8 << 30)
    assert base == (int((40 << 30) * 0.85) - (2 << 30)) // per_page
    assert base - less in ((8 << 30) // per_page, (8 << 30) // per_page + 1)
    assert eng._size_kv(100, None, 16, torch.bfloat16, 8, reserve=8 << 30) == 101     # explicit sizes: as given
    with pytest.raises(ValueError, match="no device memory left for the KV cache"):
        eng._size_kv(None, None, 16, torch.bfloat16, 8, reserve=32 << 30)
    from rollout.config import EngineConfig
    for bad in (-1, "all", 1.5, True):
        with pytest.raises(ValueError, match="reserve_memory must be bytes >= 0 or 'weights'"):
            EngineConfig(reserve_memory=bad).validate()


def test_reserve_memory_weights_is_one_copy_of_the_parameters(model_dir, monkeypatch):
    """reserve_memory="weights" reserves parameter_bytes(model), resolved by the engine itself
    (from_pretrained users have no model to measure before the engine builds it)."""
    from rollout.models.loader import parameter_bytes
    seen = []
    monkeypatch.setattr(RolloutEngine, "_size_kv", lambda self, *a: seen.append(a[-1]) or 64)
    eng = RolloutEngine.from_pretrained(model_dir("llama"), device="cpu", dtype="float32", max_model_len=64,
                                        reserve_memory="weights")
    assert seen == [parameter_bytes(eng.model)] and seen[0] > 0


def test_model_pack_decode_weights_packs_refills_in_place_and_drops(monkeypatch):
    """DecoderLM.pack_decode_weights on the tiny model with table entries for its shapes: every
    decode weight gets a copy in its kernel's order (the QKV one for the RoPE epilogue, gate_up
    for the SiLU one) equal to pack_weight_tiles of the weight; packing again refills the same
    storage (captured graphs read it); repack_decode_weights follows a weight change in place;
    on=False drops them all."""
    from rollout.bench.shapes import make_config
    from rollout.kernels import skinny_gemm as sg
    from rollout.layers import linear
    from rollout.models.loader import build_model, init_random
    cfg = make_config("tiny")
    model = build_model(cfg, torch.float32, torch.device("cpu"))
    init_random(model, 0)
    H, F, D = cfg.hidden_size, cfg.intermediate_size, model.head_dim
    qkv_n = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * D
    monkeypatch.setattr(linear, "SKINNY_CONFIGS", {
        (qkv_n, H): ((32, (32, 64, 4, 2)),), (H, H): ((32, (32, 64, 4, 2, 2)),), (2 * F, H): ((32, (64, 64, 4, 2)),),
        (H, F): ((32, (32, 64, 4, 2)),), (cfg.vocab_size, H): ((32, (64, 64, 4, 2)),)})
    monkeypatch.setattr(linear, "SKINNY_CONFIGS_PACKED", {(H, F): ((32, (16, 128, 4, 2)),)})   # down: the packed entry
    nbytes = model.pack_decode_weights(32)
    lins = list(model._decode_linears())
    assert nbytes == sum(lin.weight.numel() * 4 for lin, _ in lins)
    assert [o for _, o in lins[:4]] == ["rope", "rows", "silu", "rows"]
    for lin, order in lins:
        t = lin.weight_tiles
        assert torch.equal(t, sg.pack_weight_tiles(lin.weight, t.shape[2], t.shape[3], order, D))
    assert lins[3][0].weight_tiles.shape[2:] == (16, 128)
    ptrs = [lin.weight_tiles.data_ptr() for lin, _ in lins]
    assert model.pack_decode_weights(32) == nbytes and [lin.weight_tiles.data_ptr() for lin, _ in lins] == ptrs
    with torch.no_grad():
        lins[2][0].weight.mul_(2)
    model.repack_decode_weights()
    assert torch.equal(lins[2][0].weight_tiles, sg.pack_weight_tiles(lins[2][0].weight, 64, 64, "silu"))
    assert lins[2][0].weight_tiles.data_ptr() == ptrs[2]
    assert model.pack_decode_weights(32, on=False) == 0
    assert all(lin.weight_tiles is None for lin, _ in lins)
