"""Hostile input to the engine and the worker: requests that can never be served, settings that can
never serve, wrong types, non-finite values and weights, callers on other threads, parameters
changed after submission. Each gets a clear error (or is served) and the engine keeps serving:
the next good call equals a fresh engine's output and no KV page leaks."""
import math
import threading
import time

import numpy as np
import pytest
import torch

from hf_reference import random_prompts
from rollout import RolloutEngine, SamplingParams
from rollout.weights import WeightUpdateError
from rollout.worker import RolloutWorker

KW = dict(device="cpu", dtype="float32", max_model_len=128, num_kv_pages=64, page_size=16, max_num_seqs=8, seed=0)
GOOD = SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=7)
TIMEOUT_S = 60          # a thread not back by then is stuck (these runs take well under a second)


@pytest.fixture(scope="module")
def path(model_dir):
    return model_dir("llama")


@pytest.fixture(scope="module")
def engine(path):
    return RolloutEngine.from_pretrained(path, **KW)


@pytest.fixture(scope="module")
def good_prompts(tiny_tokenizer):
    return random_prompts(tiny_tokenizer, 3, 4, 12, seed=3)


@pytest.fixture(scope="module")
def reference(path, good_prompts):
    """What a fresh engine returns for the good call (seeded, so the same tokens in any batch)."""
    return _tokens(RolloutEngine.from_pretrained(path, **KW).generate(good_prompts, GOOD, use_tqdm=False))


def _tokens(outs):
    return [[c.token_ids for c in o.completions] for o in outs]


def _still_serving(eng, good_prompts, reference):
    assert not eng.requests and not eng.scheduler.waiting and not eng.scheduler.running
    assert eng.kv.alloc.num_used == 0
    assert _tokens(eng.generate(good_prompts, GOOD, use_tqdm=False)) == reference
    assert eng.kv.alloc.num_used == 0


# ---- 1. requests that can never be served ------------------------------------------------------
def test_a_group_larger_than_max_num_seqs_is_refused_and_does_not_wedge(engine, good_prompts, reference):
    with pytest.raises(ValueError, match="n=9 samples exceed max_num_seqs=8"):
        engine.generate([[1, 5, 6]], SamplingParams(n=9, max_new_tokens=4), use_tqdm=False)
    _still_serving(engine, good_prompts, reference)


def test_a_group_whose_full_length_overfills_the_kv_is_served(path, good_prompts, reference):
    """8 samples x 120 tokens need 8 x 8 pages; the cache has 12: the samples take turns
    (preempted and resumed), every one completes, nothing leaks."""
    eng = RolloutEngine.from_pretrained(path, **{**KW, "num_kv_pages": 12, "kv_reserve_fraction": 0.0})
    out = eng.generate([[1, 5, 6, 7]], SamplingParams(n=8, max_new_tokens=120, temperature=1.0, seed=1,
                                                      ignore_eos=True), use_tqdm=False)[0]
    assert [len(c.token_ids) for c in out.completions] == [120] * 8
    _still_serving(eng, good_prompts, reference)


def test_a_stuck_queue_fails_its_head_request_instead_of_wedging(path, good_prompts, reference, monkeypatch):
    """Defence in depth: if the scheduler ever admits nothing with nothing in flight, the request at
    the head of the queue fails (finish_reason "error") and later calls are served."""
    eng = RolloutEngine.from_pretrained(path, **KW)
    rid = eng.add_requests([[1, 5, 6]], SamplingParams(max_new_tokens=4))[0]
    monkeypatch.setattr(eng.scheduler, "_admissible", lambda seq, n: False)
    outs = eng.step()
    assert [o.request_id for o in outs] == [rid] and outs[0].completions[0].finish_reason == "error"
    assert "could not make progress" in outs[0].error
    monkeypatch.undo()
    _still_serving(eng, good_prompts, reference)


# ---- 2. settings that can never serve ----------------------------------------------------------
@pytest.mark.parametrize("option,value", [
    ("max_num_seqs", 0), ("max_num_seqs", -1), ("max_num_seqs", True), ("max_num_seqs", 2.0),
    ("max_num_batched_tokens", 0), ("page_size", 0), ("page_size", -16), ("max_model_len", 0),
    ("max_model_len", 1), ("num_kv_pages", 0), ("kv_cache_memory", 0), ("kv_reserve_fraction", 1.5),
    ("kv_reserve_fraction", float("nan")), ("swap_space_gb", -1.0), ("swap_space_gb", float("inf")),
    ("preemption_mode", "never"), ("attention_backend", "cuda"), ("cuda_graph_modes", "greedy"),
    ("dtype", "int8"), ("seed", -1), ("cuda_graphs", "yes"), ("cpu_threads", 0)])
def test_engine_settings_that_can_never_serve_are_refused_at_construction(path, option, value):
    with pytest.raises(ValueError, match=option):
        RolloutEngine.from_pretrained(path, **{**KW, option: value})


def test_unknown_engine_option_lists_the_known_ones(path):
    with pytest.raises(ValueError, match="unknown engine option.*max_num_sequences.*max_num_seqs"):
        RolloutEngine.from_pretrained(path, **{**KW, "max_num_sequences": 8})


def test_swap_preemption_without_swap_space_is_refused(path):
    with pytest.raises(ValueError, match="swap_space_gb"):
        RolloutEngine.from_pretrained(path, **{**KW, "preemption_mode": "swap"})


# ---- 3. types, checked by name ---------------------------------------------------------------------
BAD_FIELDS = [("n", "2"), ("n", True), ("max_new_tokens", 2.5), ("max_new_tokens", b"3"), ("temperature", "1"),
              ("temperature", None), ("temperature", float("inf")), ("temperature", 1e-9), ("top_p", None),
              ("top_p", float("nan")), ("top_k", True), ("top_k", 1.5), ("min_p", "0"), ("min_p", float("nan")),
              ("repetition_penalty", [1.0]), ("repetition_penalty", float("inf")), ("repetition_penalty", float("nan")),
              ("seed", 1.5), ("seed", True), ("stop_token_ids", 5), ("stop_token_ids", [True]), ("stop", [1]),
              ("stop", [""]), ("ignore_eos", 1), ("top_logprobs", True), ("detokenize", "yes"), ("stale_kv", 1),
              ("on_stale", None), ("max_staleness", -1)]


@pytest.mark.parametrize("field,value", BAD_FIELDS, ids=[f"{f}={v!r}" for f, v in BAD_FIELDS])
def test_a_bad_sampling_field_is_named(engine, good_prompts, reference, field, value):
    with pytest.raises(ValueError, match=f"invalid SamplingParams: {field} must be"):
        engine.generate([[1, 5, 6]], SamplingParams(**{field: value}), use_tqdm=False)
    _still_serving(engine, good_prompts, reference)


@pytest.mark.parametrize("params,msg", [({"n": 2}, "must be a rollout.SamplingParams, got dict"),
                                        ("greedy", "must be a rollout.SamplingParams, got str")])
def test_sampling_params_of_another_type_are_refused(engine, params, msg):
    with pytest.raises(ValueError, match=msg):
        engine.generate([[1, 5, 6]], params, use_tqdm=False)
    assert not engine.requests and engine.kv.alloc.num_used == 0


@pytest.mark.parametrize("prompts,msg", [
    ([None], "prompt 0 must be a string or a list of token ids, got NoneType"),
    ([[1, 5], b"abc"], "prompt 1 must be a string or a list of token ids, got bytes"),
    ([[1, True, 5]], "outside the vocabulary.*True"), ([[1, 5.0]], "outside the vocabulary"),
    ([1, 5, 6], "prompt 0 must be a string or a list of token ids, got int"),
    (np.array([1, 5, 6]), "prompts must be a list of prompts"), (None, "prompts must be a list"),
    ([np.array([1.0, 5.0])], "outside the vocabulary")])
def test_bad_prompts_are_named(engine, good_prompts, reference, prompts, msg):
    with pytest.raises(ValueError, match=msg):
        engine.generate(prompts, GOOD, use_tqdm=False)
    _still_serving(engine, good_prompts, reference)


def test_numpy_and_torch_integer_ids_equal_python_ints(engine, good_prompts, reference):
    forms = [[np.array(p) for p in good_prompts], [torch.tensor(p) for p in good_prompts],
             [[np.int64(t) for t in p] for p in good_prompts], [torch.tensor(p, dtype=torch.int32) for p in good_prompts]]
    for prompts in forms:
        assert _tokens(engine.generate(prompts, GOOD, use_tqdm=False)) == reference
    rect = [p[:4] for p in good_prompts]
    assert _tokens(engine.generate(np.array(rect), GOOD, use_tqdm=False)) == \
        _tokens(engine.generate(rect, GOOD, use_tqdm=False))            # a 2-D array: one prompt a row
    numpy_params = SamplingParams(n=np.int64(2), max_new_tokens=np.int32(6), temperature=np.float32(1.0),
                                  seed=torch.tensor(7))
    assert _tokens(engine.generate(good_prompts, numpy_params, use_tqdm=False)) == reference


@pytest.mark.parametrize("extra", [{}, {"top_k": 5, "top_p": 0.9, "min_p": 0.05}, {"repetition_penalty": 1.3},
                                   {"top_logprobs": 3}])
def test_the_smallest_temperature_gives_finite_logprobs(engine, good_prompts, extra):
    """MIN_TEMPERATURE (1e-5): logits / T stays far inside fp32, so no accepted input returns a NaN
    logprob; below it the request is refused (see BAD_FIELDS)."""
    from rollout.request import MIN_TEMPERATURE
    outs = engine.generate(good_prompts, SamplingParams(n=2, max_new_tokens=6, temperature=MIN_TEMPERATURE, seed=3,
                                                        **extra), use_tqdm=False)
    for o in outs:
        for c in o.completions:
            vals = c.logprobs + c.processed_logprobs + c.kept_mass
            vals += [v for d in c.top_logprobs or [] for v in d.values()]
            assert vals and all(math.isfinite(v) for v in vals)


def test_scoring_refuses_bad_input_before_touching_the_batch(engine):
    for bad, msg in (([[1]], "at least 2 tokens"), ([[1, 2], None], "prompt 1"), ([[1, 2]], None)):
        if msg is None:
            for t in (float("nan"), float("inf"), 0.0, True, "1"):
                with pytest.raises(ValueError, match="temperature"):
                    engine.score(bad, temperature=t)
        else:
            with pytest.raises(ValueError, match=msg):
                engine.score(bad)
    assert engine.kv.alloc.num_used == 0


def test_progress_and_pending_refuse_bad_ids_and_serve_a_second_thread(path, good_prompts, reference):
    eng = RolloutEngine.from_pretrained(path, **KW)
    for bad in ("3", None, [1], 1.5, True):
        with pytest.raises(ValueError, match="request_id must be an integer"):
            eng.progress(bad)
        with pytest.raises(ValueError, match="request_id must be an integer"):
            eng.pending(bad)
    for since in ([0], {0: -1}, {"a": 1}, {0: 1.5}):
        with pytest.raises(ValueError, match="since must be a dict"):
            eng.progress(0, since=since)
    assert eng.progress(12345) is None and not eng.pending(12345)     # unknown: nothing, no error
    ids = eng.add_requests(good_prompts, GOOD)
    seen, stop = {i: [] for i in ids}, threading.Event()

    def watch():     # a second thread streaming while this one steps (the calls serialise on the engine lock)
        while not stop.is_set():
            for i in ids:
                out = eng.progress(i)
                if out is not None:
                    seen[i].append([len(c.token_ids) for c in out.completions])
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    outs = {}
    while eng.has_unfinished():
        outs.update((o.request_id, o) for o in eng.step())
    stop.set()
    watcher.join(TIMEOUT_S)
    assert not watcher.is_alive() and _tokens([outs[i] for i in ids]) == reference
    for i in ids:     # what the watcher saw only grew, and never past the final completion
        final = [len(c.token_ids) for c in outs[i].completions]
        grown = [s for s in seen[i] if len(s) == len(final)]
        assert all(a <= b for s, t in zip(grown, grown[1:]) for a, b in zip(s, t))
        assert all(a <= b for s in grown for a, b in zip(s, final))


def test_abort_with_bad_ids_is_refused(engine):
    for bad in ("3", None, [1.5], [None]):
        with pytest.raises(ValueError, match="request_ids"):
            engine.abort(bad)


# ---- 4. non-finite weights -------------------------------------------------------------------------
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
def test_a_weight_update_holding_nan_or_inf_is_refused_whole(path, good_prompts, reference, poison):
    worker = RolloutWorker(RolloutEngine.from_pretrained(path, **KW))
    targets = worker.engine.model.hf_targets()
    update = [(n, (t + 0.01).clone()) for n, t in targets.items()]
    bad_name = "model.layers.1.mlp.down_proj.weight"
    dict(update)[bad_name][3, 4] = poison
    with pytest.raises(WeightUpdateError, match=f"NaN or inf.*{bad_name}"):
        worker.update_weights(update, version=1)
    assert worker.weights.pending is None and worker.policy_version == 0
    assert _tokens(worker.generate(good_prompts, GOOD)) == reference          # the old weights still serve
    assert worker.engine.kv.alloc.num_used == 0
    worker.update_weights([(n, t) for n, t in update if n != bad_name], version=1)   # the rest is fine alone
    worker.generate(good_prompts, GOOD)
    assert worker.policy_version == 1


def test_finite_weights_whose_checksum_overflows_are_accepted(path, good_prompts):
    """The checksums accumulate in fp32: huge finite weights can sum to inf, which must not read as non-finite
    (their elements are checked). The engine's dtype here is fp32, whose largest value is ~3.4e38."""
    worker = RolloutWorker(RolloutEngine.from_pretrained(path, **KW))
    name = "model.norm.weight"
    big = torch.full_like(worker.engine.model.hf_targets()[name], 3e38)
    assert not big.sum(dtype=torch.float32).isfinite()
    worker.update_weights([(name, big)], version=1)
    worker.generate(good_prompts[:1], GOOD)            # commits at its first batch boundary
    worker.weights.verify(block=True)
    assert worker.policy_version == 1 and torch.equal(worker.engine.model.hf_targets()[name], big)


def test_a_weight_update_that_is_not_name_tensor_pairs_is_refused(path):
    worker = RolloutWorker(RolloutEngine.from_pretrained(path, **KW))
    for bad in ([("model.norm.weight", [1.0, 2.0])], [(3, torch.ones(2))], [torch.ones(2)], 5):
        with pytest.raises(WeightUpdateError, match="pairs"):
            worker.update_weights(bad, version=1)
    with pytest.raises(WeightUpdateError, match="version must be an integer"):
        worker.update_weights([("model.norm.weight", torch.ones(64))], version=1.5)
    assert worker.weights.pending is None


# ---- 5. threads ----------------------------------------------------------------------------------------
def _in_threads(fns):
    """Run each fn in its own thread; return their results (or exceptions), failing if one is stuck."""
    results = [None] * len(fns)

    def run(i, fn):
        try:
            results[i] = fn()
        except Exception as exc:  # noqa: BLE001  handed back to the test
            results[i] = exc
    threads = [threading.Thread(target=run, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a caller never returned"
    return results


@pytest.mark.parametrize("background", [False, True])
def test_worker_generate_from_several_threads_gives_each_caller_its_own_outputs(path, tiny_tokenizer, background):
    prompts = [random_prompts(tiny_tokenizer, 2, 4, 12, seed=s) for s in range(6)]
    params = [SamplingParams(n=2, max_new_tokens=5 + s, temperature=1.0, seed=s) for s in range(6)]
    sequential = RolloutWorker(RolloutEngine.from_pretrained(path, **KW))
    want = [_tokens(sequential.generate(p, q)) for p, q in zip(prompts, params)]
    worker = RolloutWorker(RolloutEngine.from_pretrained(path, **KW))
    if background:
        worker.start()
    try:
        got = _in_threads([lambda p=p, q=q: worker.generate(p, q) for p, q in zip(prompts, params)])
    finally:
        worker.stop()
    assert [_tokens(g) for g in got] == want
    assert worker.engine.kv.alloc.num_used == 0 and not worker.finished


def test_a_caller_whose_request_another_thread_aborts_gets_the_aborted_output(path, good_prompts, reference):
    worker = RolloutWorker(RolloutEngine.from_pretrained(path, **KW))
    started = threading.Event()
    real_step = worker.engine.step

    def step():     # the long request is running: hold the step until the other thread waits for the lock
        out = real_step()
        if not started.is_set():
            started.set()
            deadline = time.monotonic() + TIMEOUT_S
            while not worker._waiting and time.monotonic() < deadline:
                time.sleep(0.001)
        return out
    worker.engine.step = step
    long = SamplingParams(max_new_tokens=100, temperature=1.0, seed=1, ignore_eos=True)

    def abort():
        started.wait(TIMEOUT_S)
        return worker.abort(list(worker.engine.requests))
    got, aborted = _in_threads([lambda: worker.generate([[1, 5, 6]], long), abort])
    assert got[0].completions[0].finish_reason == "abort" and len(got[0].completions[0].token_ids) < 100
    assert [o.request_id for o in aborted] == [got[0].request_id]
    worker.engine.step = real_step
    assert worker.engine.kv.alloc.num_used == 0
    assert _tokens(worker.generate(good_prompts, GOOD)) == reference


def test_a_request_aborted_behind_the_workers_back_raises_instead_of_spinning(path):
    worker = RolloutWorker(RolloutEngine.from_pretrained(path, **KW))
    real_step = worker.engine.step

    def step():    # someone aborts through the engine, not the worker
        worker.engine.abort(list(worker.engine.requests))
        return real_step()
    worker.engine.step = step
    (res,) = _in_threads([lambda: worker.generate([[1, 5, 6]], SamplingParams(max_new_tokens=50))])
    assert isinstance(res, RuntimeError) and "RolloutWorker.abort" in str(res)


def test_submit_futures_resolve_on_abort_and_on_stop(path):
    worker = RolloutWorker(RolloutEngine.from_pretrained(path, **KW))
    long = SamplingParams(max_new_tokens=120, temperature=1.0, seed=1, ignore_eos=True)
    worker.start()
    try:
        short = worker.submit([[1, 5, 6]], SamplingParams(max_new_tokens=3, ignore_eos=True))
        assert len(short.result(timeout=TIMEOUT_S)[0].completions[0].token_ids) == 3    # finished by the loop
        fut = worker.submit([[1, 5, 6]], long)
        rid = max(worker.engine.requests)
        worker.abort([rid])
        assert fut.result(timeout=TIMEOUT_S)[0].completions[0].finish_reason == "abort"
        pending = worker.submit([[1, 5, 6], [1, 7]], long)
    finally:
        worker.stop()
    outs = pending.result(timeout=TIMEOUT_S)
    assert [c.finish_reason for o in outs for c in o.completions] == ["abort", "abort"]
    assert worker.engine.kv.alloc.num_used == 0
    assert not worker.finished        # outputs handed to futures are not also kept for collection


def test_bare_engine_generate_from_two_threads_serialises(path, tiny_tokenizer):
    eng = RolloutEngine.from_pretrained(path, **KW)
    a, b = (random_prompts(tiny_tokenizer, 3, 4, 12, seed=s) for s in (5, 6))
    want = [_tokens(eng.generate(p, GOOD, use_tqdm=False)) for p in (a, b)]
    got = _in_threads([lambda: eng.generate(a, GOOD, use_tqdm=False), lambda: eng.generate(b, GOOD, use_tqdm=False)])
    assert [_tokens(g) for g in got] == want
    assert eng.kv.alloc.num_used == 0


# ---- 6. parameters are copied at submission --------------------------------------------------------------
def test_changing_sampling_params_after_submission_changes_nothing_queued(engine, good_prompts, reference):
    p = SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=7)
    ids = engine.add_requests(good_prompts, p)
    p.n, p.max_new_tokens, p.temperature, p.stop = 50, 0, -1.0, "x"      # would hang or fail if shared
    outs = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step())
    assert _tokens([outs[i] for i in ids]) == reference
    assert all(outs[i].params.n == 2 and outs[i].params.max_new_tokens == 6 for i in ids)
