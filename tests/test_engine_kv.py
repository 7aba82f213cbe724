"""Engine-level KV behaviour on CPU: prompt sharing across a GRPO group, preemption by
recompute under a tiny KV budget, chunked prefill, and no leaked pages."""
import pytest

from hf_reference import hf_token_logprobs, random_prompts
from rollout import RolloutEngine, SamplingParams

PAGE = 16


def _engine(path, **kw):
    kw.setdefault("num_kv_pages", 256)
    kw.setdefault("max_num_batched_tokens", 512)
    return RolloutEngine.from_pretrained(path, device="cpu", dtype="float32", max_model_len=256,
                                         page_size=PAGE, seed=0, **kw)


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
    # 20 pages x 16 = 320 token slots for 8 sequences of up to ~120 tokens: must preempt.
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
