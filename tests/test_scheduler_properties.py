"""Property-based tests of the allocator and scheduler under the one-step-lag loop.

A fake device samples token f(seed, sample, position) for every row, so the expected
completion of every request is known in closed form whatever the schedule. Hypothesis
draws arrivals, prompt and output lengths, group sizes, KV sizes, token budgets,
admission reservation, preemption by recompute or by swap (to host pages), aborts and
weight-version bumps; after every step the page refcounts (device and host pages)
must equal the block-table references exactly, and at the end every request must have
finished exactly once, with the unpressured output unless it was aborted.
"""
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout.kv_cache import KVCacheManager, PageAllocator
from rollout.request import PLACEHOLDER, Request, SamplingParams, Status
from rollout.scheduler import Scheduler

PAGE, MAX_LEN, EOS, VOCAB = 4, 48, 2, 50


def fake_token(seed: int, sample: int, pos: int) -> int:
    return (seed * 7919 + sample * 104729 + pos * 1299709) % 1000003 % VOCAB


def expected(req: Request, sample: int) -> list[int]:
    p, out = req.params, []
    for pos in range(len(req.prompt_ids), MAX_LEN):
        tok = fake_token(req.seed, sample, pos)
        out.append(tok)
        if (tok == EOS and not p.ignore_eos) or len(out) >= p.max_new_tokens:
            break
    return out


request_st = st.fixed_dictionaries({
    "prompt_len": st.integers(1, 40), "n": st.integers(1, 3), "max_new": st.integers(1, 30),
    "arrive": st.integers(0, 8), "ignore_eos": st.booleans(), "abort_at": st.none() | st.integers(0, 40),
})


def check_refcounts(alloc: PageAllocator, tables: list[list[int]]) -> None:
    refs = [0] * alloc.num_pages
    for table in tables:
        for p in table:
            refs[p] += 1
    assert refs == alloc.refcount, "refcounts differ from block-table references"
    assert alloc.num_free == sum(1 for p in range(1, alloc.num_pages) if refs[p] == 0)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.lists(request_st, min_size=1, max_size=6), num_pages=st.integers(13, 60),
       budget=st.integers(4, 64), reserve=st.sampled_from([0.0, 0.5, 1.0]), max_seqs=st.integers(1, 8),
       bumps=st.sets(st.integers(0, 60), max_size=4), num_host_pages=st.none() | st.integers(1, 40))
def test_random_schedules_keep_invariants_and_outputs(reqs, num_pages, budget, reserve, max_seqs, bumps,
                                                      num_host_pages):
    kv = KVCacheManager(num_pages, PAGE)
    host = PageAllocator(num_host_pages + 1, PAGE) if num_host_pages else None
    sched = Scheduler(kv, max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=MAX_LEN,
                      eos_token_ids={EOS}, reserve_fraction=reserve, preemption_mode="swap" if host else "recompute",
                      host_pages=host)
    requests = [Request(i, [3 + (i + j) % 40 for j in range(r["prompt_len"])],
                        SamplingParams(n=min(r["n"], max_seqs), max_new_tokens=r["max_new"],
                                       ignore_eos=r["ignore_eos"]), seed=i * 31 + 1)
                for i, r in enumerate(reqs)]
    ended: dict[int, int] = {}
    aborted = set()
    inflight, version, step = None, 0, 0
    while True:
        for r, spec in zip(requests, reqs):
            if spec["arrive"] == step:
                sched.add(r)
            if spec["abort_at"] == step and spec["arrive"] <= step and r.request_id not in ended:
                sched.abort_request(r)
                aborted.add(r.request_id)
                ended[r.request_id] = ended.get(r.request_id, 0) + 1
        if step in bumps:
            version += 1
        out = sched.schedule()
        out.policy_version = version
        launched = None
        if out.items:
            n = out.num_rows
            tokens = [fake_token(t.seq.request.seed, t.seq.sample_index, t.pos) for t in out.targets]
            launched = (out, tokens, [-1.0] * n, [-1.0] * n, [0.0] * n)
        elif inflight is None:
            assert not sched.has_work(), "no progress with work left"
        if inflight is not None:
            for r in sched.update_columns(*inflight):
                ended[r.request_id] = ended.get(r.request_id, 0) + 1
        inflight = launched
        live = [s for r in requests for s in r.seqs if s.status != Status.FINISHED]
        check_refcounts(kv.alloc, [s.block_table for s in live])
        if host is not None:
            check_refcounts(host, [s.host_table for s in live])
            assert all(not (s.host_table and s.block_table) for s in live)   # in one place at a time
        step += 1
        arrivals_left = any(spec["arrive"] >= step for spec in reqs)
        if not arrivals_left and inflight is None and not sched.has_work():
            break
        assert step < 5000, "schedule did not finish"
    assert all(ended.get(r.request_id) == 1 for r in requests), "every request ends exactly once"
    assert kv.alloc.num_used == 0 and all(c == 0 for c in kv.alloc.refcount)
    if host is not None:
        assert host.num_used == 0 and all(c == 0 for c in host.refcount)
    for r in requests:
        assert len(r.seqs) == r.params.n
        for s in r.seqs:
            gen = s.generated_ids
            assert PLACEHOLDER not in gen and len(s.logprobs) == len(gen) == len(s.policy_versions)
            assert s.policy_versions == sorted(s.policy_versions)
            want = expected(r, s.sample_index)
            if r.request_id in aborted:
                assert gen == want[:len(gen)] and s.finish_reason in ("abort", "stop", "length")
            else:
                assert gen == want, (r.request_id, s.sample_index)
                assert s.finish_reason == ("stop" if want[-1] == EOS and not r.params.ignore_eos else "length")
