"""Reliability on CPU: abort frees pages at once and returns partial output; a fault in a
step fails only its requests; a worker stopped mid-batch neither hangs nor leaks."""
import threading
import time

import pytest

from hf_reference import random_prompts
from rollout import RolloutEngine, SamplingParams
from rollout.request import PLACEHOLDER
from rollout.worker import RolloutWorker


def _engine(path, **kw):
    kw.setdefault("num_kv_pages", 128)
    return RolloutEngine.from_pretrained(path, device="cpu", dtype="float32", max_model_len=256, page_size=16,
                                         max_num_batched_tokens=256, seed=0, **kw)


def _run(eng):
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    return {o.request_id: o for o in outs}


def test_abort_frees_pages_at_once_and_returns_partial_output(model_dir, tiny_tokenizer):
    path = model_dir("llama")
    prompts = random_prompts(tiny_tokenizer, 3, 10, 40, seed=1)
    p = SamplingParams(n=2, max_new_tokens=30, temperature=0, ignore_eos=True)
    eng = _engine(path)
    ids = eng.add_requests(prompts, p)
    for _ in range(6):
        eng.step()
    held = len({p for s in eng.requests[ids[1]].seqs for p in s.block_table})   # group pages are shared
    used = eng.kv.alloc.num_used
    [aborted] = eng.abort([ids[1]])
    assert eng.kv.alloc.num_used == used - held         # freed now, not at the next step
    for c in aborted.completions:
        assert c.finish_reason == "abort" and 0 < len(c.token_ids) < 30
        assert PLACEHOLDER not in c.token_ids and len(c.logprobs) == len(c.token_ids)
    rest = _run(eng)
    assert set(rest) == {ids[0], ids[2]}                 # the aborted request never reappears
    clean = _engine(path).generate(prompts, p, use_tqdm=False)
    for i in (0, 2):
        assert [c.token_ids for c in rest[ids[i]].completions] == [c.token_ids for c in clean[i].completions]
    # The abort's partial tokens are a prefix of what it would have produced.
    for c, full in zip(aborted.completions, clean[1].completions):
        assert full.token_ids[:len(c.token_ids)] == c.token_ids
    assert eng.kv.alloc.num_used == 0


def test_fault_in_a_step_fails_only_its_requests(model_dir, tiny_tokenizer, monkeypatch):
    path = model_dir("qwen2")
    eng = _engine(path)
    prompts = random_prompts(tiny_tokenizer, 2, 8, 20, seed=2)
    p = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    ids = eng.add_requests(prompts, p)
    eng.step()
    eng.step()
    real_run, calls = eng.runner.run, {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated device fault")
        return real_run(*a, **k)
    monkeypatch.setattr(eng.runner, "run", flaky)
    outs = _run(eng)
    assert set(outs) == set(ids)
    for i in ids:
        o = outs[i]
        assert o.completions[0].finish_reason == "error" and "simulated device fault" in o.error
    assert eng.kv.alloc.num_used == 0 and eng.metrics["failed_steps"] == 1
    # The engine keeps serving, with the same results as a fresh engine.
    again = eng.generate(prompts, p, use_tqdm=False)
    fresh = _engine(path).generate(prompts, p, use_tqdm=False)
    assert [o.completions[0].token_ids for o in again] == [o.completions[0].token_ids for o in fresh]


def test_worker_stop_mid_batch_does_not_hang_or_leak(model_dir, tiny_tokenizer):
    path = model_dir("llama")
    worker = RolloutWorker(_engine(path))
    worker.start()
    fut = worker.submit(random_prompts(tiny_tokenizer, 4, 10, 30, seed=3),
                        SamplingParams(n=2, max_new_tokens=200, temperature=0, ignore_eos=True))
    deadline = time.time() + 30
    while worker.engine.metrics["steps"] < 5 and time.time() < deadline:
        time.sleep(0.01)
    t0 = time.time()
    worker.stop(timeout=10)
    assert time.time() - t0 < 10
    outs = fut.result(timeout=1)             # resolved with the partial, aborted outputs
    assert all(c.finish_reason in ("abort", "length") for o in outs for c in o.completions)
    assert any(c.finish_reason == "abort" for o in outs for c in o.completions)
    assert worker.engine.kv.alloc.num_used == 0 and not worker.engine.has_unfinished()
    assert not any(t.name == "rollout-worker" for t in threading.enumerate())
    # A stopped worker can start again and serve.
    with worker:
        again = worker.submit([[1, 5, 6]], SamplingParams(max_new_tokens=4, temperature=0)).result(timeout=30)
    assert len(again[0].completions[0].token_ids) == 4


def test_background_step_failure_fails_futures_and_worker_stays_up(model_dir, monkeypatch):
    worker = RolloutWorker(_engine(model_dir("llama")))
    real_step = worker.engine.step
    calls = {"n": 0}

    def broken_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("scheduler bug")
        return real_step()
    monkeypatch.setattr(worker.engine, "step", broken_step)
    with worker:
        fut = worker.submit([[1, 4, 5]], SamplingParams(max_new_tokens=30, temperature=0))
        with pytest.raises(RuntimeError, match="scheduler bug"):
            fut.result(timeout=30)
        ok = worker.submit([[1, 7, 8]], SamplingParams(max_new_tokens=3, temperature=0)).result(timeout=30)
    assert len(ok[0].completions[0].token_ids) == 3
