"""Ray fleet on CPU (a local Ray cluster): group-aware dispatch equals one worker, weight
broadcast over gloo reaches every actor, and a killed actor loses no prompt."""
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


def _fleet(path, n=2, **kw):
    from rollout.fleet import RolloutFleet
    return RolloutFleet(n, {"model": str(path), **ENGINE_KW}, num_cpus_per_worker=1, **kw)


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
    finally:
        fleet.shutdown()


def test_killed_actor_mid_job_loses_and_duplicates_nothing(ray_cluster, model_dir, tiny_tokenizer):
    path = model_dir("llama")
    prompts = random_prompts(tiny_tokenizer, 10, 6, 24, seed=22)
    p = SamplingParams(n=2, max_new_tokens=40, temperature=0, ignore_eos=True)
    fleet = _fleet(path, restart_dead=True)
    try:
        got, killed = [], None
        for o in fleet.stream(prompts, p):
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
        want = [single.generate([q], p, use_tqdm=False)[0] for q in prompts]
        assert _tokens([by_id[i] for i in range(len(prompts))]) == _tokens(want)
        assert all(c.finish_reason == "length" for o in got for c in o.completions)
        # the restarted actor takes work again
        again = fleet.generate(prompts[:4], SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
        assert len(again) == 4 and fleet.stats()["num_live"] == 2
        # a weight update after the restart re-forms the gloo group and syncs the new actor too
        fleet.update_weights(load_file(str(model_dir("llama", seed=1) / "model.safetensors")).items(), version=1)
        assert fleet.versions() == {0: 1, 1: 1} and fleet.version_skew() == 0
    finally:
        fleet.shutdown()
