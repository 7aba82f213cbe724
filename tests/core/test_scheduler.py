"""Scheduler on its own, with fake sampled rows: finish reasons, EOS handling, token
budget and chunking, group fork, preemption order, abort."""
from rollout.kv_cache import KVCacheManager
from rollout.request import Request, SamplingParams, Status
from rollout.scheduler import Scheduler

EOS = 2


def _sched(num_pages=64, page=4, budget=16, max_seqs=8, max_len=64, reserve_fraction=None):
    kv = KVCacheManager(num_pages, page)
    return Scheduler(kv, max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_len,
                     eos_token_ids={EOS}, reserve_fraction=reserve_fraction)


def _req(i, n_prompt=5, **kw):
    return Request(i, list(range(3, 3 + n_prompt)), SamplingParams(**kw), seed=i)


def _run_step(s, token=7):
    out = s.schedule()
    n = out.num_rows
    return out, s.update_columns(out, [token] * n, [-1.0] * n, [-0.5] * n, [0.0] * n)


def test_eos_stops_unless_ignored_and_length_cut_appends_nothing():
    s = _sched()
    a, b = _req(0, max_new_tokens=10), _req(1, max_new_tokens=3, ignore_eos=True)
    s.add(a), s.add(b)
    _, fin = _run_step(s, token=EOS)
    assert fin == [a] and a.seqs[0].finish_reason == "stop" and a.seqs[0].generated_ids == [EOS]
    assert b.seqs[0].finish_reason is None
    _run_step(s, token=EOS)
    _, fin = _run_step(s, token=EOS)
    assert fin == [b] and b.seqs[0].finish_reason == "length" and b.seqs[0].generated_ids == [EOS] * 3
    assert s.kv.alloc.num_used == 0


def test_max_model_len_cut():
    s = _sched(max_len=8)
    r = _req(0, n_prompt=6, max_new_tokens=100)
    s.add(r)
    while s.has_work():
        _run_step(s)
    assert r.seqs[0].finish_reason == "length" and r.seqs[0].num_tokens == 8


def test_token_budget_chunks_long_prompt_and_decodes_first():
    s = _sched(budget=8)
    short, long = _req(0, n_prompt=3, max_new_tokens=5), _req(1, n_prompt=20, max_new_tokens=5)
    s.add(short), s.add(long)
    out, _ = _run_step(s)
    assert [(i.seq.request.request_id, i.num_new, i.num_samples) for i in out.items] == [(0, 3, 1), (1, 5, 0)]
    out, _ = _run_step(s)
    # The running decode comes first, then the next 7-token chunk of the long prompt.
    assert [(i.seq.request.request_id, i.num_new) for i in out.items] == [(0, 1), (1, 7)]
    assert out.num_tokens <= 8


def test_group_forks_after_prefill_with_shared_pages():
    s = _sched()
    r = _req(0, n_prompt=6, n=3, max_new_tokens=4)
    s.add(r)
    out, _ = _run_step(s)
    assert out.num_rows == 3 and len(r.seqs) == 3
    assert [q.sample_index for q in r.seqs] == [0, 1, 2]
    assert all(q.block_table == r.seqs[0].block_table for q in r.seqs)
    assert s.kv.alloc.total_allocations == 2      # 6 tokens on 4-token pages, once
    out, _ = _run_step(s)
    assert len(out.copies) == 2                    # two copy-on-writes of the partial page


def test_preempts_newest_and_requeues_first():
    s = _sched(num_pages=7, page=4, budget=64, max_len=20, reserve_fraction=0.0)   # 6 usable pages; one needs 5
    a, b = _req(0, n_prompt=8, max_new_tokens=12), _req(1, n_prompt=8, max_new_tokens=12)
    s.add(a), s.add(b)
    _run_step(s)           # both prefilled: 2 pages each
    for _ in range(6):     # each sequence needs a 3rd page (pos 8), then a 4th (pos 12): b must yield
        _run_step(s)
    assert s.num_preemptions >= 1 and b.seqs[0].num_preemptions >= 1 and a.seqs[0].num_preemptions == 0
    assert s.waiting[0] is b.seqs[0] and b.seqs[0].status == Status.WAITING
    while s.has_work():
        _run_step(s)
    assert a.seqs[0].num_generated == 12 and b.seqs[0].num_generated == 12
    assert s.kv.alloc.num_used == 0


def test_abort_frees_pages_and_materialises_group():
    s = _sched()
    r = _req(0, n_prompt=6, n=4, max_new_tokens=8)
    s.add(r)
    s.abort_request(r)     # still waiting, never forked
    assert len(r.seqs) == 4 and all(q.finish_reason == "abort" for q in r.seqs) and r.finished
    r2 = _req(1, n=2, max_new_tokens=8)
    s.add(r2)
    _run_step(s)
    s.abort_request(r2)
    assert all(q.finish_reason == "abort" for q in r2.seqs) and s.kv.alloc.num_used == 0
    assert not s.has_work()


def test_sequence_larger_than_cache_raises_instead_of_hanging():
    import pytest
    s = _sched(num_pages=3, page=4, budget=64, max_len=64)     # 2 usable pages = 8 tokens
    s.add(_req(0, n_prompt=6, max_new_tokens=10))
    with pytest.raises(RuntimeError, match="more KV pages than the whole cache"):
        for _ in range(10):
            _run_step(s)


def test_a_preempted_sequence_waits_until_it_can_finish():
    """KV for about half of the sequences at full length, admission by the next chunk: victims
    are preempted once, then wait until their whole remaining length fits, instead of being
    readmitted by their next chunk and preempted again before the recompute is done."""
    page, n, prompt, gen = 4, 8, 8, 40
    s = _sched(num_pages=1 + n * (prompt + gen) // page // 2, page=page, budget=16, max_seqs=n, max_len=64,
               reserve_fraction=0.0)
    reqs = [_req(i, n_prompt=prompt, max_new_tokens=gen, ignore_eos=True) for i in range(n)]
    for r in reqs:
        s.add(r)
    steps = 0
    while s.has_work():
        _run_step(s)
        steps += 1
    assert all(r.seqs[0].num_generated == gen for r in reqs) and s.kv.alloc.num_used == 0
    victims = [r.seqs[0] for r in reqs if r.seqs[0].num_preemptions]
    assert victims and max(v.num_preemptions for v in victims) == 1
    # Recompute work: each victim's prompt + what it had generated, once.
    assert s.num_recomputed_tokens <= len(victims) * (prompt + gen)
