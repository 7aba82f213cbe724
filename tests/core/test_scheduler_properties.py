"""Property-based tests of the allocator and scheduler under the one-step-lag loop.

A fake device samples token f(seed, sample, position) for every row, so the expected
completion of every request is known in closed form whatever the schedule. Hypothesis
draws arrivals, prompt and output lengths, group sizes, KV sizes, token budgets, admission
reservation (fixed or adaptive), preemption by recompute or by swap (to host pages), aborts,
weight-version bumps and the prefix cache on or off (prompts of a few families share
prefixes); after every step the page refcounts (device and host pages) must equal the
block-table references exactly and the cache's maps agree, and at the end every request
must have finished exactly once, with the unpressured output unless it was aborted.
A simulated device KV (each slot: its prefix's tokens and the weights version that wrote
it, moved by swaps and copy-on-write) checks that every step reads the KV of exactly its
own prefix, and that a sequence started from scratch reuses only KV of the live version.
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
    "family": st.integers(0, 2),
})


def check_refcounts(alloc: PageAllocator, tables: list[list[int]]) -> None:
    refs = [0] * alloc.num_pages
    for table in tables:
        for p in table:
            refs[p] += 1
    assert refs == alloc.refcount, "refcounts differ from block-table references"
    assert alloc.num_free == sum(1 for p in range(1, alloc.num_pages) if refs[p] == 0)
    assert all(alloc.cached[key][0] == page for page, key in alloc.key_of.items())
    assert len(alloc.cached) == len(alloc.key_of) >= alloc.num_evictable
    assert all(refs[p] == 0 and p in alloc.key_of for p in alloc._evictable)


class DeviceKV:
    """Slot (page, offset) -> (signature of the prefix whose last token's KV it holds, version)."""

    def __init__(self):
        self.device, self.host = {}, {}

    def step(self, out, fresh) -> None:
        for moves, src_mem, dst_mem in ((out.swap_out, self.device, self.host), (out.swap_in, self.host, self.device),
                                        (out.copies, self.device, self.device)):
            for src, dst in moves:
                for o in range(PAGE):
                    dst_mem[dst, o] = src_mem.get((src, o))
        for item in out.items:
            seq, sigs, h = item.seq, [], None
            for i, t in enumerate(seq.token_ids[:item.start + item.num_new]):
                h = hash((h, t if t != PLACEHOLDER else fake_token(seq.request.seed, seq.sample_index, i)))
                sigs.append(h)
            table = seq.block_table
            assert item.num_new > 0, "a step computes at least one token of each item (its logits)"
            for p in range(item.start):
                held = self.device.get((table[p // PAGE], p % PAGE))
                assert held is not None and held[0] == sigs[p], "a step reads KV of another prefix"
                assert seq not in fresh or held[1] == out.policy_version, "KV of older weights reused"
            for p in range(item.start, item.start + item.num_new):
                self.device[table[p // PAGE], p % PAGE] = (sigs[p], out.policy_version)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.lists(request_st, min_size=1, max_size=6), num_pages=st.integers(13, 60),
       budget=st.integers(4, 64), reserve=st.sampled_from([0.0, 0.5, 1.0, None]), max_seqs=st.integers(1, 8),
       bumps=st.sets(st.integers(0, 60), max_size=4), num_host_pages=st.none() | st.integers(1, 40),
       caching=st.booleans())
def test_random_schedules_keep_invariants_and_outputs(reqs, num_pages, budget, reserve, max_seqs, bumps,
                                                      num_host_pages, caching):
    kv = KVCacheManager(num_pages, PAGE, prefix_caching=caching)
    host = PageAllocator(num_host_pages + 1, PAGE) if num_host_pages else None
    sched = Scheduler(kv, max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=MAX_LEN,
                      eos_token_ids={EOS}, reserve_fraction=reserve, preemption_mode="swap" if host else "recompute",
                      host_pages=host)
    sched.ADAPTIVE_RAISE, sched.ADAPTIVE_DECAY = 0.3, 0.05   # adaptive (None): let it move within a short run
    requests = [Request(i, [3 + (r["family"] + j) % 40 for j in range(r["prompt_len"])],
                        SamplingParams(n=min(r["n"], max_seqs), max_new_tokens=r["max_new"],
                                       ignore_eos=r["ignore_eos"]), seed=i * 31 + 1)
                for i, r in enumerate(reqs)]
    ended: dict[int, int] = {}
    aborted = set()
    inflight, version, step = None, 0, 0
    device = DeviceKV()
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
        kv.weights_version = version
        fresh = {s for s in sched.waiting if s.num_computed == 0 and not s.host_table}
        out = sched.schedule()
        out.policy_version = version
        device.step(out, fresh)
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
    assert kv.alloc.num_cached == kv.alloc.num_evictable and (caching or kv.alloc.num_cached == 0)
    if host is not None:
        assert host.num_used == 0 and all(c == 0 for c in host.refcount)
    for r in requests:
        assert len(r.seqs) == r.params.n
        for s in r.seqs:
            assert s.num_preemptions <= 1, "readmitted only when it can finish: never preempted twice"
            gen = s.generated_ids
            assert PLACEHOLDER not in gen and len(s.logprobs) == len(gen) == len(s.policy_versions)
            assert s.policy_versions == sorted(s.policy_versions)
            want = expected(r, s.sample_index)
            if r.request_id in aborted:
                assert gen == want[:len(gen)] and s.finish_reason in ("abort", "stop", "length")
            else:
                assert gen == want, (r.request_id, s.sample_index)
                assert s.finish_reason == ("stop" if want[-1] == EOS and not r.params.ignore_eos else "length")
