"""Automatic prefix caching: page keys chained on the prefix (a forced hash collision is a miss),
reuse of the longest cached prefix with the last page recomputed, LRU eviction, cached pages
counted as free, weights-version roots (no KV of older weights reused after an update, even from
a stale_kv="keep" sequence), outputs equal to the cache off, under KV pressure too, no leaked pages."""
import pytest
from safetensors.torch import load_file

from hf_reference import random_prompts
from hf_reference import cpu_engine
from rollout import SamplingParams
from rollout.kv_cache import KVCacheManager
from rollout.request import Request
from rollout.worker import RolloutWorker

PAGE = 16


def _engine(path, **kw):
    return cpu_engine(path, **{"max_num_batched_tokens": 512, "page_size": PAGE, **kw})


def assert_no_leak(alloc):
    """No sequence holds a page; every page is empty or cached-evictable; the two maps agree."""
    assert alloc.num_used == 0 and all(r == 0 for r in alloc.refcount)
    assert alloc.num_evictable == alloc.num_cached and alloc.num_free == alloc.num_usable
    assert all(alloc.cached[key][0] == page for page, key in alloc.key_of.items())
    assert len(alloc.cached) == len(alloc.key_of)


def _computed(kv, tokens, n=1):
    """A sequence admitted from scratch with its KV computed (as the scheduler would)."""
    seq = Request(0, tokens, SamplingParams(n=n), seed=0).seqs[0]
    kv.reuse_prefix(seq)
    hit = seq.num_computed
    kv.append(seq, len(tokens) - seq.num_computed, [])
    seq.num_computed = len(tokens)
    return seq, hit


def test_longest_prefix_reused_last_page_recomputed_and_cached_pages_count_as_free():
    kv = KVCacheManager(12, 4, prefix_caching=True)
    a, hit = _computed(kv, list(range(10, 24)))            # 3 full pages + 2 tokens
    pa = list(a.block_table)
    assert hit == 0
    kv.free(a)
    assert kv.alloc.num_cached == 3 and kv.alloc.num_used == 0 and kv.alloc.num_free == 11
    b, hit = _computed(kv, list(range(10, 18)) + [99, 98, 97, 96, 95])   # shares 2 pages
    assert hit == 8 and b.block_table[:2] == pa[:2]
    assert kv.alloc.num_evictable == 1 and kv.alloc.num_used == 4     # 2 reused + 2 new; 1 cached page left
    # Whole prompt cached (12 tokens = 3 full pages): its last page is recomputed for the logits.
    c, hit = _computed(kv, list(range(10, 22)))
    assert hit == 8 and c.block_table[:2] == b.block_table[:2] and c.block_table[2] not in kv.alloc.key_of
    assert kv.alloc.refcount[c.block_table[0]] == 2
    for s in (b, c):
        kv.free(s)
    assert_no_leak(kv.alloc)


def test_forced_hash_collision_is_a_miss():
    """Token ids t and t + (2**61 - 1) hash alike in CPython, so the two pages' keys collide:
    the lookup compares the tokens and misses. The same tokens under another prefix miss too."""
    kv = KVCacheManager(12, 4, prefix_caching=True)
    m = 2 ** 61 - 1
    a, _ = _computed(kv, [1, 2, 3, 4, 5])
    pa = list(a.block_table)
    kv.free(a)
    (key, _), = kv.alloc.cached.items()
    twin = (key[0], (1, 2, 3, 4 + m))
    assert hash(twin) == hash(key) and twin != key
    b, hit = _computed(kv, [1, 2, 3, 4 + m, 5])
    assert hit == 0 and b.block_table[0] != pa[0]
    c, _ = _computed(kv, [9, 9, 9, 9, 1, 2, 3, 4, 5])
    kv.free(b), kv.free(c)
    d, hit = _computed(kv, [9, 9, 9, 9, 1, 2, 3, 4, 7])
    assert hit == 8
    e, hit = _computed(kv, [7, 7, 7, 7, 1, 2, 3, 4, 5])
    assert hit == 0                                       # [1, 2, 3, 4] is cached, but after [9, 9, 9, 9]
    kv.free(d), kv.free(e)
    assert_no_leak(kv.alloc)


def test_lru_eviction_takes_empty_pages_first_then_the_least_recent_tail_first():
    kv = KVCacheManager(8, 4, prefix_caching=True)         # 7 usable pages
    a, _ = _computed(kv, list(range(10, 19)))               # pages a0 a1 full, a2 partial
    b, _ = _computed(kv, list(range(50, 59)))
    pa, pb = list(a.block_table), list(b.block_table)
    kv.free(a)
    kv.free(b)                                              # released after a: more recent
    assert kv.alloc.num_cached == 4 and kv.alloc.num_free == 7
    fresh = [kv.alloc.allocate() for _ in range(3)]         # the 3 empty pages first: nothing evicted
    assert kv.alloc.num_evictions == 0 and set(fresh) == {1, 2, 3, 4, 5, 6, 7} - set(pa[:2] + pb[:2])
    assert kv.alloc.allocate() == pa[1]                     # then a's tail, then a's head, then b's
    assert kv.alloc.allocate() == pa[0]
    kv.alloc.decref(fresh[0])                               # one empty page for b's partial one
    _, hit = _computed(kv, list(range(50, 59)))             # b's pages still there: a hit, no longer evictable
    assert hit == 8 and kv.alloc.num_evictable == 0 and kv.alloc.num_evictions == 2
    with pytest.raises(RuntimeError, match="out of KV pages"):
        kv.alloc.allocate()


def test_weights_version_roots_keep_older_kv_out_of_reach():
    kv = KVCacheManager(12, 4, prefix_caching=True)
    a, _ = _computed(kv, list(range(10, 19)))
    kv.free(a)
    kv.weights_version = 1
    b, hit = _computed(kv, list(range(10, 19)))
    assert hit == 0                                         # same tokens, KV of other weights
    kv.free(b)
    _, hit = _computed(kv, list(range(10, 19)))
    assert hit == 8 and kv.alloc.num_cached == 4            # v1's pages found; v0's still there, unreachable


def _prompts(tok, prefix_len=37):
    """A shared prefix (a system prompt, with a partial last page) before distinct suffixes."""
    head = random_prompts(tok, 1, prefix_len, prefix_len, seed=1)[0]
    tails = random_prompts(tok, 6, 5, 40, seed=2, add_bos=False)
    return [head + t for t in tails]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_outputs_with_the_cache_equal_outputs_without_it(model_dir, tiny_tokenizer, temperature):
    path = model_dir("llama")
    prompts = _prompts(tiny_tokenizer)
    aligned = random_prompts(tiny_tokenizer, 1, 48, 48, seed=3)[0]          # exactly 3 pages
    assert all(len(x) % PAGE != 1 for x in prompts)     # no 1-token prefill (counted as a decode step)
    p = SamplingParams(max_new_tokens=20, temperature=temperature, seed=5, ignore_eos=True)
    group = SamplingParams(n=3, max_new_tokens=20, temperature=temperature, seed=6, ignore_eos=True)
    waves = [(prompts[:3] + [aligned], p),
             (prompts[3:] + [prompts[0], aligned], p),         # shared prefix; whole prompts cached
             ([prompts[1]], group)]                            # a group whose prompt is cached
    on, off = _engine(path), _engine(path, enable_prefix_caching=False)
    for i, (ps, params) in enumerate(waves):
        if i == 2:      # the group's prefill forks from the cached pages
            cached_head = on.kv.alloc.cached[(-1, tuple(prompts[1][:PAGE]))][0]
            rid = on.add_requests(ps, params)[0]
            on.step()
            seqs = on.requests[rid].seqs
            assert len(seqs) == 3 and all(s.block_table[0] == cached_head for s in seqs)
            assert on.kv.alloc.refcount[cached_head] == 3
            got = []
            while on.has_unfinished():
                got += on.step()
        else:
            got = on.generate(ps, params, use_tqdm=False)
        want = off.generate(ps, params, use_tqdm=False)
        for a, b in zip(got, want):
            assert [c.token_ids for c in a.completions] == [c.token_ids for c in b.completions]
            for ca, cb in zip(a.completions, b.completions):
                # fp32: a cached prefix is a prefill chunk boundary, a different reduction order (~1e-6).
                assert max(abs(x - y) for x, y in zip(ca.logprobs, cb.logprobs)) <= 1e-5
        assert_no_leak(on.kv.alloc)
    s_on, s_off = on.stats(), off.stats()
    # Wave 2: 3 x 2 pages of the shared prefix, prompts[0] all but its last page, `aligned` 2 of 3 pages;
    # wave 3: prompts[1] all but its last page. Prefill computed shrinks by exactly the hits.
    def full(x):
        return (len(x) - 1) // PAGE * PAGE
    want_hits = 3 * 32 + full(prompts[0]) + 32 + full(prompts[1])
    assert s_on["prefix_cache_hit_tokens"] == want_hits
    assert s_on["prefix_cache_queries"] == sum(len(x) for ps, _ in waves for x in ps)
    assert s_off["prefix_cache_hit_tokens"] == 0 and s_off["prefix_cache_pages"] == 0
    assert s_off["prefill_tokens"] - s_on["prefill_tokens"] == want_hits
    assert s_on["prefix_cache_pages"] == s_on["prefix_cache_evictable_pages"] > 0


def test_cache_off_caches_nothing_and_the_option_is_validated(model_dir, tiny_tokenizer):
    from rollout.config import EngineConfig
    eng = _engine(model_dir("llama"), enable_prefix_caching=False)
    prompts = _prompts(tiny_tokenizer)[:2]
    p = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    for _ in range(2):
        eng.generate(prompts, p, use_tqdm=False)
    st = eng.stats()
    assert st["prefix_cache_queries"] == st["prefix_cache_hit_tokens"] == st["prefix_cache_pages"] == 0
    assert st["prefill_tokens"] == 2 * sum(len(x) for x in prompts) and eng.kv.alloc.num_cached == 0
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="enable_prefix_caching must be True or False"):
            EngineConfig(enable_prefix_caching=bad).validate()


def test_reset_prefix_cache_forgets_every_prefix_and_the_next_run_prefills_in_full(model_dir, tiny_tokenizer):
    eng = _engine(model_dir("llama"))
    prompts = _prompts(tiny_tokenizer)[:2]
    p = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    first = eng.generate(prompts, p, use_tqdm=False)
    cached = eng.kv.alloc.num_cached
    assert cached > 0 and eng.reset_prefix_cache() == cached
    assert eng.kv.alloc.num_cached == 0
    assert_no_leak(eng.kv.alloc)
    hits, prefilled = eng.stats()["prefix_cache_hit_tokens"], eng.stats()["prefill_tokens"]
    again = eng.generate(prompts, p, use_tqdm=False)
    st = eng.stats()
    assert st["prefix_cache_hit_tokens"] == hits                                      # nothing reused
    assert st["prefill_tokens"] - prefilled == sum(len(x) for x in prompts)           # every prompt token again
    assert [o.completions[0].token_ids for o in again] == [o.completions[0].token_ids for o in first]


def test_reset_prefix_cache_from_another_thread_during_generation_changes_no_output(model_dir, tiny_tokenizer):
    """A second caller resets while generate runs on this thread: the calls take turns (the engine's
    lock), no held page is lost, and the outputs equal a run without resets."""
    import threading
    eng = _engine(model_dir("llama"))
    prompts = _prompts(tiny_tokenizer)
    p = SamplingParams(max_new_tokens=24, temperature=0.9, seed=4, ignore_eos=True)
    want = [o.completions[0].token_ids for o in eng.generate(prompts, p, use_tqdm=False)]
    stop, resets = threading.Event(), []

    def resetter():
        while not stop.is_set():
            resets.append(eng.reset_prefix_cache())
    t = threading.Thread(target=resetter)
    t.start()
    try:
        got = [o.completions[0].token_ids for o in eng.generate(prompts, p, use_tqdm=False)]
    finally:
        stop.set()
        t.join(timeout=30)
    assert not t.is_alive() and len(resets) > 0
    assert got == want
    eng.reset_prefix_cache()
    assert_no_leak(eng.kv.alloc)
    with pytest.raises(TypeError):
        eng.reset_prefix_cache(True)          # takes no arguments: nothing to misread


def test_eviction_under_kv_pressure_is_exact_and_leaks_nothing(model_dir, tiny_tokenizer):
    """20 pages for waves of shared-prefix prompts with preemption (reserve 0): cached pages are
    evicted to make room, victims re-find their own pages, outputs equal a roomy run without cache."""
    path = model_dir("llama")
    prompts = _prompts(tiny_tokenizer)
    params = SamplingParams(max_new_tokens=40, temperature=0.9, seed=3, ignore_eos=True)
    tight = _engine(path, num_kv_pages=20, max_num_batched_tokens=48, kv_reserve_fraction=0.0)
    roomy = _engine(path, enable_prefix_caching=False)
    for wave in (prompts[:4], prompts[2:], prompts[::2]):
        got = tight.generate(wave, params, use_tqdm=False)
        want = roomy.generate(wave, params, use_tqdm=False)
        assert [o.completions[0].token_ids for o in got] == [o.completions[0].token_ids for o in want]
        for a, b in zip(got, want):
            assert max(abs(x - y) for x, y in zip(a.completions[0].logprobs, b.completions[0].logprobs)) <= 1e-5
        assert_no_leak(tight.kv.alloc)
    st = tight.stats()
    assert st["prefix_cache_evictions"] > 0 and st["preemptions"] > 0 and st["prefix_cache_hit_tokens"] > 0


def _weights(path):
    return load_file(str(path / "model.safetensors"))


def test_no_kv_of_older_weights_is_reused_after_an_update(model_dir, tiny_tokenizer):
    old, new = model_dir("llama"), model_dir("llama", seed=1)
    prompts = _prompts(tiny_tokenizer)[:3]
    greedy = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    worker = RolloutWorker(_engine(old))
    worker.generate(prompts, greedy)
    worker.generate(prompts, greedy)
    hits_v0 = worker.stats()["prefix_cache_hit_tokens"]
    assert hits_v0 > 0
    worker.update_weights(_weights(new).items(), version=1)
    outs = worker.generate(prompts, greedy)               # the first step commits v1
    assert worker.policy_version == 1 and worker.stats()["prefix_cache_hit_tokens"] == hits_v0
    fresh = _engine(new, enable_prefix_caching=False).generate(prompts, greedy, use_tqdm=False)
    assert [o.completions[0].token_ids for o in outs] == [o.completions[0].token_ids for o in fresh]
    assert all(set(o.completions[0].policy_versions) == {1} for o in outs)
    worker.generate(prompts, greedy)
    assert worker.stats()["prefix_cache_hit_tokens"] > hits_v0          # v1's own pages are reused
    assert_no_leak(worker.engine.kv.alloc)


def test_keep_stale_sequence_fills_no_page_reusable_under_new_weights(model_dir, tiny_tokenizer):
    """Across an update, a stale_kv="keep" sequence attends to KV of the old weights, so every page
    it fills, after the update too, stays out of reach; a "recompute" one restarts under the new
    root and its pages are reused. The next turn (prompt + completion) of each shows it."""
    old, new = model_dir("llama"), model_dir("llama", seed=1)
    prompt = random_prompts(tiny_tokenizer, 1, 20, 20, seed=9)[0]
    greedy = SamplingParams(max_new_tokens=4, temperature=0)
    for policy in ("keep", "recompute"):
        worker = RolloutWorker(_engine(old))
        rid = worker.add_requests([prompt], SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True,
                                                           stale_kv=policy))[0]
        for _ in range(10):
            worker.step()
        worker.update_weights(_weights(new).items(), version=1)
        outs = {}
        while rid not in outs:
            outs.update({o.request_id: o for o in worker.step()})
        c = outs[rid].completions[0]
        assert 0 in c.policy_versions and 1 in c.policy_versions
        turn2 = prompt + c.token_ids + [5, 6, 7]
        nxt = worker.generate([turn2], greedy)
        hits = worker.stats()["prefix_cache_hit_tokens"]
        if policy == "keep":
            assert hits == 0
        else:       # re-prefilled from scratch under the new weights: all its full pages are reused
            assert hits == (len(prompt) + len(c.token_ids) - 1) // PAGE * PAGE
        fresh = _engine(new, enable_prefix_caching=False).generate([turn2], greedy, use_tqdm=False)
        assert nxt[0].completions[0].token_ids == fresh[0].completions[0].token_ids
        assert_no_leak(worker.engine.kv.alloc)


def test_a_failed_step_clears_the_cache_and_the_engine_goes_on(model_dir, tiny_tokenizer, monkeypatch):
    path = model_dir("llama")
    eng = _engine(path)
    prompts = _prompts(tiny_tokenizer)[:2]
    p = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    eng.generate(prompts, p, use_tqdm=False)
    assert eng.kv.alloc.num_cached > 0
    real_run, calls = eng.runner.run, {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated device fault")
        return real_run(*a, **k)
    monkeypatch.setattr(eng.runner, "run", flaky)
    outs = eng.generate(prompts, p, use_tqdm=False)
    assert all(o.completions[0].finish_reason == "error" for o in outs)
    assert eng.kv.alloc.num_cached == 0 and eng.metrics["failed_steps"] == 1
    assert_no_leak(eng.kv.alloc)
    again = eng.generate(prompts, p, use_tqdm=False)
    fresh = _engine(path, enable_prefix_caching=False).generate(prompts, p, use_tqdm=False)
    assert [o.completions[0].token_ids for o in again] == [o.completions[0].token_ids for o in fresh]
