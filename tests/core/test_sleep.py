"""Sleep / wake on CPU (the same storage release and restore as on CUDA, without graphs): outputs equal
across a round trip at each level, calls refused while asleep before any state changes, the KV cache
fresh after wake (prefix cache emptied, every page free), and weight updates across a sleep: applied at
once at level 1, refused at level 2 until the weights wake, required full after discard_weights."""
import pytest
from safetensors.torch import load_file

from hf_reference import cpu_engine, random_prompts
from rollout import SamplingParams
from rollout.weights import WeightUpdateError
from rollout.worker import RolloutWorker

PARAMS = SamplingParams(n=2, max_new_tokens=12, temperature=0.9, seed=5, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    return random_prompts(tiny_tokenizer, 3, 20, 40, seed=2)


def _tokens(outs):
    return [[(c.token_ids, c.logprobs) for c in o.completions] for o in outs]


def _param_storage_bytes(engine):
    return [p.untyped_storage().nbytes() for p in engine.model.parameters()]


def _distinct_storage_bytes(tensors) -> int:      # tied weights share one storage
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize("level,tags", [(1, None), (2, None), (2, ["weights", "kv_cache"])])
def test_round_trip_gives_equal_outputs_and_a_fresh_kv_cache(model_dir, prompts, level, tags):
    engine = cpu_engine(model_dir("llama"))
    before = engine.generate(prompts, PARAMS, use_tqdm=False)
    assert engine.kv.alloc.num_cached > 0                    # the prompts' full pages are cached
    weight_bytes = _distinct_storage_bytes(engine.model.parameters())
    pool_bytes = engine.runner.kv_pool.numel() * engine.runner.kv_pool.element_size()

    report = engine.sleep(level)
    assert report["level"] == level and engine.sleep_level == level and report["seconds"] >= 0
    assert report["device_freed_bytes"] is None                # CPU: only our count
    assert engine.runner.kv_pool.untyped_storage().nbytes() == 0  # really given back, not just marked
    if level == 1:
        assert report["released_bytes"] == pool_bytes
        assert all(n > 0 for n in _param_storage_bytes(engine))
    else:   # KV pool, every parameter, and the RoPE buffer
        assert report["released_bytes"] >= pool_bytes + weight_bytes
        assert all(n == 0 for n in _param_storage_bytes(engine))
    assert engine.kv.alloc.num_cached == 0                   # prefix cache emptied with the pool

    engine.wake(tags)
    assert engine.sleep_level == 0 and not engine.asleep
    a = engine.kv.alloc
    assert a.num_free == a.num_usable and a.num_used == 0 and sum(a.refcount) == 0
    hits = engine.stats()["prefix_cache_hit_tokens"]
    after = engine.generate(prompts, PARAMS, use_tqdm=False)
    assert _tokens(after) == _tokens(before)                 # bit-equal: same weights, same seeds
    assert engine.stats()["prefix_cache_hit_tokens"] == hits    # nothing cached survived the sleep
    again = engine.generate(prompts, PARAMS, use_tqdm=False)
    assert engine.stats()["prefix_cache_hit_tokens"] > hits     # the cache works again after wake
    assert _tokens(again) == _tokens(before)
    assert a.num_used == 0


def test_calls_while_asleep_fail_before_any_state_changes(model_dir, prompts):
    engine = cpu_engine(model_dir("llama"))
    engine.sleep(1)
    next_id = engine._next_id
    for call in (lambda: engine.add_requests(prompts, PARAMS), lambda: engine.generate(prompts, PARAMS),
                 lambda: engine.score([prompts[0]])):
        with pytest.raises(RuntimeError, match=r"engine is asleep \(level 1\); call wake\(\) first"):
            call()
    assert engine._next_id == next_id and not engine.requests and not engine.scheduler.has_work()
    assert engine.step() == []                               # an idle step does nothing asleep
    engine.sleep(2)                                          # deepen: the weights go too
    assert engine.sleep_level == 2
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(prompts, PARAMS)
    engine.wake("kv_cache")                                  # the KV cache alone: still asleep (weights)
    assert engine.asleep == {"weights"}
    with pytest.raises(RuntimeError, match=r"level 2"):
        engine.add_requests(prompts, PARAMS)
    engine.wake()
    assert len(engine.generate(prompts, PARAMS, use_tqdm=False)) == len(prompts)


def test_sleep_refuses_running_requests_and_bad_arguments(model_dir, prompts):
    engine = cpu_engine(model_dir("llama"))
    ids = engine.add_requests(prompts, PARAMS)
    engine.step()
    with pytest.raises(RuntimeError, match=rf"requests \[{ids[0]}, {ids[1]}, {ids[2]}\] are queued or running"):
        engine.sleep(1)
    assert not engine.asleep and engine.runner.kv_pool.untyped_storage().nbytes() > 0
    for bad in (0, 3, True, "1", 1.0):
        with pytest.raises(ValueError, match="sleep level must be 1"):
            engine.sleep(bad)
    with pytest.raises(ValueError, match="discard_weights=True applies to level 2"):
        engine.sleep(1, discard_weights=True)
    for bad in (["kv"], [], "weight"):
        with pytest.raises(ValueError, match="wake tags must be drawn from"):
            engine.wake(bad)
    outs = []
    while engine.has_unfinished():                           # the engine kept serving
        outs += engine.step()
    assert sorted(o.request_id for o in outs) == ids and all(o.error is None for o in outs)
    engine.sleep(1)                                          # idle now
    assert engine.sleep_level == 1


def _new_weights(model_dir):
    return load_file(str(model_dir("llama", seed=1) / "model.safetensors"))


def test_weight_update_while_asleep_at_level_1_lands_at_once(model_dir, prompts):
    worker = RolloutWorker(cpu_engine(model_dir("llama")))
    worker.sleep(1)
    worker.update_weights(_new_weights(model_dir).items(), version=1)
    assert worker.policy_version == 1 and worker.weights.pending is None     # committed while asleep
    assert worker.weights.metrics["verified"] == 1
    worker.wake()
    got = worker.generate(prompts, PARAMS)
    want = cpu_engine(model_dir("llama", seed=1)).generate(prompts, PARAMS, use_tqdm=False)
    assert _tokens(got) == _tokens(want)
    assert all(v == 1 for o in got for c in o.completions for v in c.policy_versions)
    # and an update after the wake takes the usual path (staged, committed at the next step)
    worker.update_weights(load_file(str(model_dir("llama") / "model.safetensors")).items(), version=2)
    assert worker.weights.pending is not None
    back = worker.generate(prompts, PARAMS)
    assert _tokens(back) == _tokens(cpu_engine(model_dir("llama")).generate(prompts, PARAMS, use_tqdm=False))


def test_weight_update_at_level_2_waits_for_the_weights_to_wake(model_dir, prompts):
    worker = RolloutWorker(cpu_engine(model_dir("llama")))
    worker.sleep(2)
    new = _new_weights(model_dir)
    with pytest.raises(WeightUpdateError, match=r"asleep at level 2 .* wake\(tags=\['weights'\]\) first"):
        worker.update_weights(new.items(), version=1)
    assert worker.policy_version == 0 and worker.weights.pending is None
    worker.wake(["weights"])                                  # the weights back, the KV cache still asleep
    assert worker.engine.asleep == {"kv_cache"}
    worker.update_weights(new.items(), version=1)
    assert worker.policy_version == 1
    worker.wake()
    want = cpu_engine(model_dir("llama", seed=1)).generate(prompts, PARAMS, use_tqdm=False)
    assert _tokens(worker.generate(prompts, PARAMS)) == _tokens(want)


def test_discarded_weights_need_a_full_update_before_generating(model_dir, prompts):
    worker = RolloutWorker(cpu_engine(model_dir("llama")))
    worker.sleep(1)                                           # a pending update is committed before sleep(2)
    rep = worker.sleep(2, discard_weights=True)
    assert rep["level"] == 2
    worker.wake()
    assert worker.engine.weights_discarded
    assert all(bool((p == 0).all()) for p in worker.engine.model.parameters())   # zeros, not stale values
    with pytest.raises(RuntimeError, match="discarded by sleep"):
        worker.generate(prompts, PARAMS)
    new = _new_weights(model_dir)
    partial = [(n, t) for n, t in new.items() if "layers.0." in n]
    with pytest.raises(WeightUpdateError, match="must be full; missing"):
        worker.update_weights(partial, version=1)
    assert worker.engine.weights_discarded and worker.policy_version == 0
    worker.update_weights(new.items(), version=1)             # full: lands at once (the engine is idle)
    assert not worker.engine.weights_discarded and worker.policy_version == 1
    want = cpu_engine(model_dir("llama", seed=1)).generate(prompts, PARAMS, use_tqdm=False)
    assert _tokens(worker.generate(prompts, PARAMS)) == _tokens(want)


def test_background_loop_refuses_submits_while_asleep(model_dir, prompts):
    worker = RolloutWorker(cpu_engine(model_dir("llama")))
    want = worker.generate(prompts, PARAMS)
    with worker:
        worker.sleep(1)
        with pytest.raises(RuntimeError, match="asleep"):
            worker.submit(prompts, PARAMS)
        worker.wake()
        got = worker.submit(prompts, PARAMS).result(timeout=60)
    assert _tokens(got) == _tokens(want)
    assert worker.engine.kv.alloc.num_used == 0


def test_tied_embeddings_are_released_once_and_restored(model_dir, prompts):
    engine = cpu_engine(model_dir("qwen2"))            # the tiny qwen2 reads its logits off the embedding
    before = engine.generate(prompts, PARAMS, use_tqdm=False)
    assert engine.model.tie_word_embeddings
    params = _distinct_storage_bytes(engine.model.parameters())
    buffers = _distinct_storage_bytes(engine.model.buffers())
    pool = engine.runner.kv_pool.numel() * engine.runner.kv_pool.element_size()
    rep = engine.sleep(2)
    assert rep["released_bytes"] == pool + params + buffers
    engine.wake()
    assert _tokens(engine.generate(prompts, PARAMS, use_tqdm=False)) == _tokens(before)


def test_gpu_memory_utilization_caps_the_engine_share(monkeypatch):
    """The engine's share of the device's total memory: weights + KV + 2 GiB headroom (+ reserve). Free
    memory is faked (no GPU here); a share that leaves no KV page, or more than is free, is a clear error."""
    import torch
    from rollout import RolloutEngine
    from rollout.bench.shapes import make_config
    from rollout.config import EngineConfig
    eng = RolloutEngine.__new__(RolloutEngine)
    eng.device, eng.hf_config = torch.device("cuda"), make_config("tiny")
    eng.model = torch.nn.Linear(1024, 1024, bias=False)          # 4 MiB of fp32 "weights"
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 << 30, 80 << 30))
    share = eng._kv_memory_of_share(0.3, 16, torch.bfloat16, 0)
    assert share == int((80 << 30) * 0.3) - (4 << 20) - (2 << 30)
    assert eng._kv_memory_of_share(0.3, 16, torch.bfloat16, 1 << 30) == share - (1 << 30)
    for util in (0.9, 0.02):                                     # over the 40 GB free; under the headroom
        with pytest.raises(ValueError, match=f"gpu_memory_utilization={util} leaves"):
            eng._kv_memory_of_share(util, 16, torch.bfloat16, 0)
    eng.device = torch.device("cpu")
    assert eng._kv_memory_of_share(0.3, 16, torch.bfloat16, 0) is None   # no fixed budget on CPU
    for bad in (0, 1.5, True, "0.3"):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be a number in"):
            EngineConfig(gpu_memory_utilization=bad).validate()
    assert EngineConfig(gpu_memory_utilization=1).validate().gpu_memory_utilization == 1
