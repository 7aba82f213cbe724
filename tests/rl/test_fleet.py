"""Ray fleet on CPU (a local Ray cluster): group-aware dispatch equals one worker, weight
broadcast over gloo reaches every actor, a killed actor loses no prompt, and dispatch by load
(KV demand and queue depth) sends new prompts away from a worker whose KV is full."""
import time

import pytest

ray = pytest.importorskip("ray")

from hf_reference import random_prompts
from safetensors.torch import load_file

from rollout import RolloutEngine, SamplingParams

ENGINE_KW = {"device": "cpu", "dtype": "float32", "max_model_len": 128, "num_kv_pages": 64, "page_size": 16,
             "max_num_batched_tokens": 256, "seed": 0}


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    yield
    ray.shutdown()


def _fleet(path, n=2, engine=None, **kw):
    from rollout.fleet import RolloutFleet
    return RolloutFleet(n, {"model": str(path), **ENGINE_KW, **(engine or {})}, num_cpus_per_worker=1, **kw)


def _tokens(outs):
    return [[c.token_ids for c in o.completions] for o in outs]


def test_fleet_greedy_equals_single_worker_and_weight_update_reaches_all(ray_cluster, model_dir, tiny_tokenizer):
    old, new = model_dir("llama"), model_dir("llama", seed=1)
    prompts = random_prompts(tiny_tokenizer, 6, 6, 24, seed=21)
    p = SamplingParams(n=2, max_new_tokens=12, temperature=0, ignore_eos=True)
    single = RolloutEngine.from_pretrained(old, **ENGINE_KW)
    expected = [single.generate([q], p, use_tqdm=False)[0] for q in prompts]
    fleet = _fleet(old)
    try:
        outs = fleet.generate(prompts, p)
        assert [o.request_id for o in outs] == list(range(len(prompts)))
        assert _tokens(outs) == _tokens(expected)
        st = fleet.stats()
        assert st["num_live"] == 2 and st["tok_s"] > 0
        # both workers got work (queue-depth balancing), each group whole on one worker
        assert all(w["returned_tokens"] > 0 and w["tok_s"] > 0 for w in st["workers"].values())
        assert sum(w["returned_tokens"] for w in st["workers"].values()) == 6 * 2 * 12
        # a bounded window (the job's waves): at most 2 prompts out at once, the rest follow; same outputs
        windowed = {}
        for o in fleet.stream(prompts, p, max_inflight=2):
            assert sum(fleet.queue_depths().values()) <= 2 * p.n
            windowed[o.request_id] = o
        assert _tokens([windowed[i] for i in range(len(prompts))]) == _tokens(expected)
        with pytest.raises(ValueError, match="max_inflight"):
            next(fleet.stream(prompts, p, max_inflight=0))

        # weight update: the driver is rank 0 of a gloo group, each actor a rank
        sent = fleet.update_weights(load_file(str(new / "model.safetensors")).items(), version=3)
        assert sent > 0
        assert fleet.versions() == {0: 3, 1: 3} and fleet.version_skew() == 0
        after = fleet.generate(prompts, p)
        fresh = RolloutEngine.from_pretrained(new, **ENGINE_KW)
        want = [fresh.generate([q], p, use_tqdm=False)[0] for q in prompts]
        assert _tokens(after) == _tokens(want)
        assert all(c.policy_versions == [3] * 12 for o in after for c in o.completions)
        assert _tokens(after) != _tokens(outs)
        assert all(w["weights/verified"] == 1 for w in fleet.stats()["workers"].values())
        # a consumer that stops early leaves no phantom queue depth behind
        it = fleet.stream(prompts, p)
        next(it)
        it.close()
        assert set(fleet.queue_depths().values()) == {0}
        # the cancelled prompts are aborted on the workers, whose loops keep going (a cancelled
        # worker future used to kill the loop thread: the actor then never answered again)
        short = SamplingParams(max_new_tokens=2, temperature=0)
        ray.get([s.actor.run.remote(prompts[0], short) for s in fleet.slots], timeout=60)
    finally:
        fleet.shutdown()


def test_killed_actor_mid_job_loses_and_duplicates_nothing(ray_cluster, model_dir, tiny_tokenizer):
    path = model_dir("llama")
    prompts = random_prompts(tiny_tokenizer, 10, 6, 24, seed=22)
    # The first two prompts are short, so the first result comes while every actor still holds
    # long ones (with equal lengths, the other actor's prompts could all be done by then, their
    # results already on the way, and the kill would lose nothing).
    params = [SamplingParams(n=2, max_new_tokens=4 if i < 2 else 72, temperature=0, ignore_eos=True)
              for i in range(len(prompts))]
    fleet = _fleet(path, restart_dead=True)
    try:
        got, killed = [], None
        for o in fleet.stream(prompts, params):
            got.append(o)
            if killed is None:      # kill the busiest actor while it still has unfinished prompts
                depths = fleet.queue_depths()
                killed = max(depths, key=depths.get)
                assert depths[killed] > 0
                ray.kill(fleet.slots[killed].actor)
        ids = [o.request_id for o in got]
        assert sorted(ids) == list(range(len(prompts)))          # every prompt exactly once
        st = fleet.stats()
        assert st["dead_actors"] == 1 and st["resubmitted_prompts"] > 0 and st["restarted_actors"] == 1
        single = RolloutEngine.from_pretrained(path, **ENGINE_KW)
        by_id = {o.request_id: o for o in got}
        want = [single.generate([q], qp, use_tqdm=False)[0] for q, qp in zip(prompts, params)]
        assert _tokens([by_id[i] for i in range(len(prompts))]) == _tokens(want)
        assert all(c.finish_reason == "length" for o in got for c in o.completions)
        # the restarted actor takes work again
        again = fleet.generate(prompts[:4], SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
        assert len(again) == 4 and fleet.stats()["num_live"] == 2
        # a weight update after the restart re-forms the gloo group and syncs the new actor too
        fleet.update_weights(load_file(str(model_dir("llama", seed=1) / "model.safetensors")).items(), version=1)
        assert fleet.versions() == {0: 1, 1: 1} and fleet.version_skew() == 0
        # an actor that dies while idle is found by stats() (a job logs it between waves): marked
        # dead, restarted (not on the fleet's version until the next update), left out of that
        # report; the next job runs on the live, synced worker
        ray.kill(fleet.slots[0].actor)
        time.sleep(0.5)
        st = fleet.stats()
        assert st["dead_actors"] == 2 and st["restarted_actors"] == 2 and sorted(st["workers"]) == [1]
        assert len(fleet.generate(prompts[:2], SamplingParams(max_new_tokens=4, temperature=0))) == 2
    finally:
        fleet.shutdown()


# ---- dispatch policy: load = max(KV demand, sequence slots) ---------------------------------------
def _report(demand=0, pages=100, page_size=16, max_num_seqs=64, seq=1):
    from rollout.fleet import KVReport
    return KVReport(seq=seq, used=min(demand, pages), demand=demand, pages=pages, page_size=page_size,
                    max_num_seqs=max_num_seqs, max_model_len=1024, running=0, waiting=0)


def _slot(i, outstanding=0, demand=0, since=0, report=True):
    from rollout.fleet import _Slot
    return _Slot(i, actor=f"actor{i}", outstanding=outstanding, outstanding_tokens=since,
                 tokens_since_report=since, kv=_report(demand) if report else None)


def _old_pick(slots):        # the queue-depth-only policy this replaces
    return min((s for s in slots if s.alive), key=lambda s: (s.outstanding, s.index))


def test_pick_policy_on_fake_slots():
    """No Ray actors: the load function and pick on hand-made slots (100 pages x 16 tokens,
    64 sequence slots per worker)."""
    from rollout.fleet import group_tokens, load_key, pick_slot
    default = _report()
    # KV idle: the slots bind, so this is queue depth (fewest outstanding sequences)
    a, b = _slot(0, outstanding=8, demand=2), _slot(1, outstanding=2, demand=3)
    assert pick_slot([a, b], default=default) is b
    # worker 0 has fewer sequences but its KV is nearly full (long generations): new groups go to 1,
    # where the queue-depth policy would have picked 0
    a, b = _slot(0, outstanding=4, demand=95), _slot(1, outstanding=16, demand=10)
    assert load_key(a, default)[0] == pytest.approx(0.95) and load_key(b, default)[0] == pytest.approx(0.25)
    assert pick_slot([a, b], default=default) is b and _old_pick([a, b]) is a
    # KV demand past capacity (the worker will hold groups back or preempt) still orders correctly
    a, b = _slot(0, outstanding=2, demand=180), _slot(1, outstanding=2, demand=120)
    assert pick_slot([a, b], default=default) is b
    # groups sent after the newest report count by the driver's estimate until the next report
    a, b = _slot(0, outstanding=2, demand=0, since=1200), _slot(1, outstanding=4, demand=40)
    assert load_key(a, default)[0] == pytest.approx(0.75)
    assert pick_slot([a, b], default=default) is b
    # a restarted actor that has not reported yet: its outstanding groups over the default capacity
    a, b = _slot(0, outstanding=1, since=1400, report=False), _slot(1, outstanding=3, demand=50)
    assert load_key(a, default)[0] == pytest.approx(1400 / 1600)
    assert pick_slot([a, b], default=default) is b
    # equal loads: fewer outstanding sequences, then the lower index
    a, b = _slot(0, outstanding=3, demand=10), _slot(1, outstanding=3, demand=10)
    assert pick_slot([b, a], default=default) is a
    # an excluded actor (one that just died) only when nothing else is left; dead / unsynced never
    a, b = _slot(0, demand=90), _slot(1)
    assert pick_slot([a, b], exclude=("actor1",), default=default) is a
    assert pick_slot([b], exclude=("actor1",), default=default) is b
    b.synced = False
    assert pick_slot([a, b], default=default) is a
    a.alive = False
    with pytest.raises(RuntimeError, match="no live"):
        pick_slot([a, b], default=default)
    # the driver's estimate of a group: prompt once (shared) + n x max_new_tokens, capped by max_model_len
    assert group_tokens([1] * 30, SamplingParams(n=8, max_new_tokens=100)) == 30 + 800
    assert group_tokens([1] * 30, SamplingParams(n=8, max_new_tokens=100), max_model_len=80) == 30 + 8 * 50
    assert group_tokens("x" * 40, SamplingParams(n=2, max_new_tokens=5)) == 11 + 10
    assert group_tokens([1] * 3, None) == 3 + SamplingParams().max_new_tokens


def test_new_prompts_avoid_the_worker_with_full_kv(ray_cluster, model_dir, tiny_tokenizer):
    """Two workers with 1280 KV pages each (max_model_len 1024). A group of 16 long generations
    (63 pages each at full length, 993 with the shared prompt page) fills worker 0's KV; new
    prompts go to worker 1, once from worker 0's piggybacked KV report and once from the
    driver's own estimate. The group runs ~3 s on CPU (976 steps), so it is still running
    while the short prompts are dispatched (with 220 steps, ~0.6 s, a loaded CI machine lost
    that race once)."""
    path = model_dir("llama")
    engine = {"num_kv_pages": 1280, "max_model_len": 1024}
    (long_prompt,) = random_prompts(tiny_tokenizer, 1, 24, 24, seed=23)
    shorts = random_prompts(tiny_tokenizer, 6, 6, 12, seed=24)
    heavy_p = SamplingParams(n=16, max_new_tokens=976, temperature=0, ignore_eos=True)
    short_p = SamplingParams(n=2, max_new_tokens=2, temperature=0, ignore_eos=True)
    fleet = _fleet(path, engine=engine)
    try:
        assert fleet.kv_default.pages == 1280 and fleet.loads() == {0: 0.0, 1: 0.0}
        # 1) KV use the driver's queue depth cannot see: the heavy group sent straight to actor 0
        # (it runs for ~976 steps; each short prompt needs 3). One prompt at a time: queue depth is
        # 0 on both at every pick (so the old policy sent every prompt to worker 0). The first goes
        # to 0 (a tie) and brings back 0's KV report; the rest go to 1.
        heavy = fleet.slots[0].actor.run.remote(long_prompt, heavy_p)
        t0 = time.time()
        while ray.get(fleet.slots[0].actor.kv_report.remote()).used == 0:
            assert time.time() - t0 < 60
            time.sleep(0.005)
        outs = fleet.generate(shorts, short_p, max_inflight=1)
        assert [o.request_id for o in outs] == list(range(len(shorts)))
        assert fleet.placement == {0: 0, **{i: 1 for i in range(1, len(shorts))}}
        assert fleet.slots[0].kv.demand >= 960 and fleet.slots[1].kv.demand <= 2
        assert fleet.loads()[0] > 0.7 and fleet.loads()[1] < 0.1
        ray.cancel(heavy)                       # aborted on the worker, its pages freed
        with pytest.raises(ray.exceptions.TaskCancelledError):
            ray.get(heavy, timeout=60)
        while ray.get(fleet.slots[0].actor.kv_report.remote()).used:
            assert time.time() - t0 < 60
            time.sleep(0.01)
        st = fleet.stats()                      # refreshes the reports: worker 0 is empty again
        assert st["workers"][0]["kv_demand"] == 0 and fleet.loads() == {0: 0.0, 1: 0.0}

        # 2) all through the fleet, all at once (no report yet): the driver's estimate of a heavy
        # group (24 + 4 x 200 tokens: 53 pages, 4% of worker 0's KV, above the 2.3% that three
        # short groups' 6 sequences of 256 slots make on worker 1) sends every short group to worker 1;
        # by queue depth alone the third short group would have gone to worker 0
        heavy_p = SamplingParams(n=4, max_new_tokens=200, temperature=0, ignore_eos=True)
        prompts, params = [long_prompt, *shorts[:4]], [heavy_p] + [short_p] * 4
        outs = fleet.generate(prompts, params)
        assert fleet.placement == {0: 0, 1: 1, 2: 1, 3: 1, 4: 1}
        assert [len(o.completions) for o in outs] == [4, 2, 2, 2, 2]
        assert all(s.outstanding == s.outstanding_tokens == s.tokens_since_report == 0 for s in fleet.slots)
        # group-aware dispatch and outputs as before: same tokens as one engine
        single = RolloutEngine.from_pretrained(path, **{**ENGINE_KW, **engine})
        want = [single.generate([q], pp, use_tqdm=False)[0] for q, pp in zip(prompts, params)]
        assert _tokens(outs) == _tokens(want)
    finally:
        fleet.shutdown()
