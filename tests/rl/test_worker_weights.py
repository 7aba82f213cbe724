"""RL worker on CPU: weight updates land between steps without draining, exact per-token
versions, stale-KV policies, atomic rejection of bad updates, verification, and a
two-process gloo broadcast."""
import os
import socket
import time

import pytest
import torch
from safetensors.torch import load_file

from hf_reference import random_prompts
from rollout import RolloutEngine, SamplingParams
from rollout.weights import WeightUpdateError
from rollout.worker import RolloutWorker


def _engine(path, **kw):
    return RolloutEngine.from_pretrained(path, device="cpu", dtype="float32", max_model_len=256,
                                         num_kv_pages=128, page_size=16, max_num_batched_tokens=256, seed=0, **kw)


def _weights(path):
    return load_file(str(path / "model.safetensors"))


def _run_with_update(worker, prompts, params, new_weights, after_steps):
    ids = worker.add_requests(prompts, params)
    outs, steps = {}, 0
    while len(outs) < len(ids):
        if steps == after_steps:
            worker.update_weights(new_weights.items(), version=1)
        for o in worker.step():
            outs[o.request_id] = o
        steps += 1
    return [outs[i] for i in ids]


def test_update_mid_generation_keeps_kv_and_tags_versions(model_dir, tiny_tokenizer):
    old, new = model_dir("llama"), model_dir("llama", seed=1)
    prompts = random_prompts(tiny_tokenizer, 3, 8, 30, seed=4)
    params = SamplingParams(n=2, max_new_tokens=24, temperature=0, ignore_eos=True)
    worker = RolloutWorker(_engine(old))
    outs = _run_with_update(worker, prompts, params, _weights(new), after_steps=8)
    baseline = _engine(old).generate(prompts, params, use_tqdm=False)
    assert worker.weights.metrics["committed_while_in_flight"] == 1   # no drain before the swap
    assert worker.weights.metrics["verified"] == 1 and worker.policy_version == 1
    for o, b in zip(outs, baseline):
        for c, cb in zip(o.completions, b.completions):
            v = c.policy_versions
            k = v.index(1)
            assert 0 < k < len(v) and v == [0] * k + [1] * (len(v) - k)   # one switch, in order
            # Tokens tagged v0 are exactly what the old weights produce; in-flight requests
            # continued (not restarted) and then followed the new weights.
            assert c.token_ids[:k] == cb.token_ids[:k] and c.logprobs[:k] == cb.logprobs[:k]
            assert c.token_ids[k:] != cb.token_ids[k:]


def test_recompute_policy_equals_fresh_run_under_new_weights(model_dir, tiny_tokenizer):
    old, new = model_dir("qwen2"), model_dir("qwen2", seed=1)
    prompts = random_prompts(tiny_tokenizer, 2, 8, 20, seed=6)
    params = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True, stale_kv="recompute")
    worker = RolloutWorker(_engine(old))
    outs = _run_with_update(worker, prompts, params, _weights(new), after_steps=6)
    assert worker.metrics["stale_recomputed"] == len(prompts)
    fresh_engine = _engine(new)
    for p, o in zip(prompts, outs):
        c = o.completions[0]
        k = c.policy_versions.index(1)
        fresh = fresh_engine.generate([p + c.token_ids[:k]], SamplingParams(max_new_tokens=20 - k, temperature=0,
                                                                            ignore_eos=True), use_tqdm=False)[0]
        assert c.token_ids[k:] == fresh.completions[0].token_ids
        # fp32, recomputed prefill of the same tokens under the same weights: ~1e-6.
        assert max(abs(a - b) for a, b in zip(c.logprobs[k:], fresh.completions[0].logprobs)) < 1e-5


@pytest.mark.parametrize("on_stale,reason", [("finish", "stale"), ("abort", "abort")])
def test_max_staleness_finishes_or_aborts(model_dir, tiny_tokenizer, on_stale, reason):
    old, new = model_dir("llama"), model_dir("llama", seed=1)
    prompts = random_prompts(tiny_tokenizer, 2, 8, 12, seed=8)
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True, max_staleness=0, on_stale=on_stale)
    worker = RolloutWorker(_engine(old))
    outs = _run_with_update(worker, prompts, params, _weights(new), after_steps=5)
    for o in outs:
        c = o.completions[0]
        assert c.finish_reason == reason and 0 < len(c.token_ids) < 40
        assert set(c.policy_versions) == {0} and len(c.logprobs) == len(c.token_ids)
    assert worker.engine.kv.alloc.num_used == 0


def _bad_updates(weights):
    name = "model.layers.0.mlp.down_proj.weight"
    good = (name, weights[name] + 1)
    return {
        "unknown name": [good, ("model.layers.0.mlp.fc9.weight", weights[name])],
        "wrong shape": [good, ("model.norm.weight", torch.ones(3))],
        "wrong dtype": [good, ("model.norm.weight", weights["model.norm.weight"].double())],
        "duplicate": [good, good],
    }


def test_bad_update_rejected_whole_and_old_weights_keep_serving(model_dir, tiny_tokenizer):
    path = model_dir("llama")
    worker = RolloutWorker(_engine(path))
    prompts = random_prompts(tiny_tokenizer, 2, 6, 12, seed=9)
    p = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    before = worker.generate(prompts, p)
    state = {k: v.clone() for k, v in worker.engine.model.state_dict().items()}
    for label, update in _bad_updates(_weights(path)).items():
        with pytest.raises(WeightUpdateError, match="rejected"):
            worker.update_weights(update, version=1)
        assert worker.weights.pending is None, label
    full = RolloutWorker(_engine(path), require_full_updates=True)
    with pytest.raises(WeightUpdateError, match="missing"):
        full.update_weights(_bad_updates(_weights(path))["duplicate"][:1], version=1)
    with pytest.raises(WeightUpdateError, match="not newer"):
        worker.update_weights([], version=0)
    after = worker.generate(prompts, p)
    assert all(torch.equal(state[k], v) for k, v in worker.engine.model.state_dict().items())
    assert [o.completions[0].token_ids for o in before] == [o.completions[0].token_ids for o in after]
    assert worker.policy_version == 0


def test_verification_catches_a_corrupted_landing_and_moved_storage(model_dir):
    path = model_dir("llama")
    worker = RolloutWorker(_engine(path))
    w = _weights(model_dir("llama", seed=1))
    worker.update_weights(w.items(), version=1)
    worker.weights.pending.tensors["model.norm.weight"][0] += 1.0   # bytes change after the checksum
    with pytest.raises(RuntimeError, match="did not land exactly"):
        worker.weights.commit()
    worker2 = RolloutWorker(_engine(path))
    worker2.engine.model.norm.weight = torch.nn.Parameter(worker2.engine.model.norm.weight.clone())
    worker2.weights.targets["model.norm.weight"] = worker2.engine.model.norm.weight.data
    worker2.update_weights(w.items(), version=1)
    with pytest.raises(RuntimeError, match="storage moved"):
        worker2.weights.commit()


def test_background_worker_submit_and_update(model_dir, tiny_tokenizer):
    old, new = model_dir("llama"), model_dir("llama", seed=1)
    prompts = random_prompts(tiny_tokenizer, 4, 6, 20, seed=10)
    p = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    with RolloutWorker(_engine(old)) as worker:
        first = worker.submit(prompts, p).result(timeout=60)
        worker.update_weights(_weights(new).items(), version=1)
        second = worker.submit(prompts, p).result(timeout=60)
        with pytest.raises(ValueError, match="empty"):
            worker.submit([[]], p)
    assert all(set(c.policy_versions) == {0} for o in first for c in o.completions)
    assert all(set(c.policy_versions) == {1} for o in second for c in o.completions)
    fresh = _engine(new).generate(prompts, p, use_tqdm=False)
    assert [o.completions[0].token_ids for o in second] == [o.completions[0].token_ids for o in fresh]
    assert worker.engine.kv.alloc.num_used == 0



def test_submit_is_let_in_between_steps_of_a_busy_loop(model_dir, tiny_tokenizer):
    """Python locks are not fair: the loop thread re-takes the worker lock microseconds after each
    step, so a submit from another thread could wait many steps (seen on the H200 fleet: prompts
    trickled in and halved throughput). The loop hands the lock to registered callers."""
    engine = _engine(model_dir("llama"), max_num_seqs=16)
    busy = SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True)
    p = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    prompts = random_prompts(tiny_tokenizer, 10, 6, 20, seed=11)
    waits = []
    with RolloutWorker(engine) as worker:
        long_run = worker.submit(prompts[:1], busy)
        while engine.scheduler._next_batch_id < 3:      # the loop is stepping back to back
            time.sleep(0.001)
        futs = []
        for prompt in prompts[1:]:
            before = engine.scheduler._next_batch_id
            futs.append(worker.submit([prompt], p))
            waits.append(engine.scheduler._next_batch_id - before)
        assert not long_run.done()          # every submit landed while the loop was busy
        for f in futs:
            f.result(timeout=60)
        long_run.result(timeout=60)
    # One step in flight may finish before the loop sees the waiter; 2 allows a step boundary race.
    assert max(waits) <= 2, waits



def test_adopted_update_is_not_copied_and_a_plain_one_is(model_dir, tiny_tokenizer):
    """adopt=True (the fleet's received buckets) keeps the caller's tensors as the standby copy;
    without it staging copies, so a trainer may reuse its tensors at once."""
    old, new = model_dir("llama"), model_dir("llama", seed=1)
    prompts = random_prompts(tiny_tokenizer, 2, 6, 20, seed=12)
    p = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    fresh = [o.completions[0].token_ids for o in _engine(new).generate(prompts, p, use_tqdm=False)]
    for adopt in (True, False):
        worker = RolloutWorker(_engine(old))
        update = _weights(new)
        worker.update_weights(update.items(), version=1, adopt=adopt)
        staged = worker.weights.pending.tensors
        same = [staged[n].data_ptr() == t.data_ptr() for n, t in update.items()]
        assert all(same) if adopt else not any(same)
        if not adopt:                     # the caller's tensors are free again: scribbling on them changes nothing
            for t in update.values():
                t.zero_()
        out = worker.generate(prompts, p)
        assert [o.completions[0].token_ids for o in out] == fresh
        assert worker.weights.metrics["verified"] == 1



def test_update_without_room_to_stage_is_refused_before_anything_changes(model_dir, tiny_tokenizer, monkeypatch):
    """Staging copies every tensor it does not adopt; with less device memory free than that,
    the update is refused up front (not a CUDA out-of-memory error halfway), nothing is staged,
    and generation goes on with the old weights. Adopted tensors need no room."""
    import rollout.weights as rw
    old, new = model_dir("llama"), model_dir("llama", seed=1)
    update = _weights(new)
    nbytes = sum(t.numel() * t.element_size() for t in update.values())
    monkeypatch.setattr(rw, "free_bytes", lambda device: nbytes - 1)      # one byte short
    worker = RolloutWorker(_engine(old))
    prompts = random_prompts(tiny_tokenizer, 2, 6, 20, seed=13)
    p = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    with pytest.raises(WeightUpdateError, match="staging needs"):
        worker.update_weights(update.items(), version=1)
    assert worker.weights.pending is None
    baseline = _engine(old).generate(prompts, p, use_tqdm=False)
    out = worker.generate(prompts, p)
    assert [o.completions[0].token_ids for o in out] == [o.completions[0].token_ids for o in baseline]
    worker.update_weights(update.items(), version=1, adopt=True)      # nothing to copy: accepted
    assert worker.weights.pending is not None


def test_worker_warns_at_start_when_a_full_update_could_not_be_staged(model_dir, monkeypatch, caplog):
    """A worker whose device has less free memory than a full update's staging copy says so when
    it is built, naming the engine option that fixes it, instead of an hour later at the first
    update. parameter_bytes (what reserve_memory="weights" reserves) is the checkpoint's size."""
    import logging

    import rollout.weights as rw
    from rollout.models.loader import parameter_bytes
    eng = _engine(model_dir("llama"))
    need = parameter_bytes(eng.model)
    assert need == sum(t.numel() * t.element_size() for t in _weights(model_dir("llama")).values())
    for free, warned in ((need - 1, True), (need, False), (None, False)):     # None: CPU, no budget
        monkeypatch.setattr(rw, "free_bytes", lambda device, free=free: free)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="rollout.weights"):
            RolloutWorker(eng)
        assert ("a full weight update would be refused" in caplog.text) == warned, free
        assert ('reserve_memory="weights"' in caplog.text) == warned
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="rollout.weights"):
            RolloutWorker(eng, expects_updates=False)          # a standalone job: never warned
        assert "would be refused" not in caplog.text


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_rank(rank, port, old, new, result_path):
    import torch.distributed as dist

    from rollout.weights import receive_weights, send_weights
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        if rank == 0:        # the trainer
            send_weights(load_file(os.path.join(new, "model.safetensors")).items(), src=0, bucket_bytes=64 << 10)
        else:                # the rollout worker
            worker = RolloutWorker(RolloutEngine.from_pretrained(old, device="cpu", dtype="float32",
                                                                 max_model_len=128, num_kv_pages=32))
            worker.update_weights(receive_weights(src=0, bucket_bytes=64 << 10), version=7)
            out = worker.generate([[1, 5, 9, 13]], SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True))
            torch.save({"tokens": out[0].completions[0].token_ids,
                        "versions": out[0].completions[0].policy_versions}, result_path)
    finally:
        dist.destroy_process_group()


def _two_ranks(rank_fn, model_dir, tmp_path):
    """Run rank_fn as trainer (0) and worker (1) over gloo; -> (worker's result file, the tokens
    a fresh engine on the new weights gives for the prompt the ranks generate from)."""
    import torch.multiprocessing as mp
    old, new = model_dir("llama"), model_dir("llama", seed=1)
    result = tmp_path / "result.pt"
    mp.start_processes(rank_fn, args=(_free_port(), str(old), str(new), str(result)), nprocs=2,
                       join=True, start_method="spawn")
    fresh = RolloutEngine.from_pretrained(new, device="cpu", dtype="float32", max_model_len=128, num_kv_pages=32
                                          ).generate([[1, 5, 9, 13]], SamplingParams(max_new_tokens=10, temperature=0,
                                                                                    ignore_eos=True), use_tqdm=False)
    return result, fresh[0].completions[0].token_ids


def test_two_process_gloo_broadcast_update(model_dir, tmp_path):
    result, expected = _two_ranks(_gloo_rank, model_dir, tmp_path)
    got = torch.load(result)
    assert got["tokens"] == expected
    assert got["versions"] == [7] * 10



def _gloo_rank_no_room(rank, port, old, new, result_path):
    """Rank 1 (the worker) first reports no device room: both ranks get WeightUpdateError before
    any bucket is sent (no rank left blocked in a collective), the worker keeps its weights, and
    the next update over the same group lands."""
    import torch.distributed as dist

    import rollout.weights as rw
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    errors = []
    try:
        update = load_file(os.path.join(new, "model.safetensors"))
        worker = None
        if rank == 1:
            worker = RolloutWorker(RolloutEngine.from_pretrained(old, device="cpu", dtype="float32",
                                                                 max_model_len=128, num_kv_pages=32))
            rw.free_bytes = lambda device: 1024          # far less than the update
        try:
            if rank == 0:
                rw.send_weights(update.items(), src=0, bucket_bytes=64 << 10)
            else:
                worker.update_weights(rw.receive_weights(src=0, bucket_bytes=64 << 10), version=1)
        except rw.WeightUpdateError as exc:
            errors.append(str(exc))
        if rank == 1:
            rw.free_bytes = lambda device: None
            assert worker.weights.pending is None and worker.policy_version == 0
        if rank == 0:
            rw.send_weights(update.items(), src=0, bucket_bytes=64 << 10)
        else:
            worker.update_weights(rw.receive_weights(src=0, bucket_bytes=64 << 10), version=1)
            out = worker.generate([[1, 5, 9, 13]], SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True))
            torch.save({"tokens": out[0].completions[0].token_ids, "errors": errors}, result_path)
        if rank == 0:
            torch.save({"errors": errors}, result_path + ".sender")
    finally:
        dist.destroy_process_group()


def test_gloo_update_refused_on_every_rank_when_a_worker_has_no_room(model_dir, tmp_path):
    result, expected = _two_ranks(_gloo_rank_no_room, model_dir, tmp_path)
    got, sender = torch.load(result), torch.load(str(result) + ".sender")
    assert len(got["errors"]) == 1 and "this worker has 0.00 GB free" in got["errors"][0]
    assert len(sender["errors"]) == 1 and "nothing was sent" in sender["errors"][0]
    assert got["tokens"] == expected     # the second update landed


def test_mismatch_probe_is_zero_on_same_weights_and_flags_a_silent_swap(model_dir, tiny_tokenizer):
    worker = RolloutWorker(_engine(model_dir("llama")))
    prompts = random_prompts(tiny_tokenizer, 3, 6, 20, seed=12)
    outs = worker.generate(prompts, SamplingParams(n=2, max_new_tokens=12, temperature=0.8, seed=1, ignore_eos=True))
    same = worker.probe_mismatch(outs, max_sequences=4)
    # Same weights, fp32: a full forward and the incremental one differ by ~1e-6.
    assert same["probe/tokens"] == 48 and same["probe/max_abs_dlogp"] < 1e-5
    # Weights changed behind the engine's back (no version bump): the probe sees it.
    targets = worker.weights.targets
    for name, t in _weights(model_dir("llama", seed=1)).items():
        if name in targets:
            targets[name].copy_(t)
    moved = worker.probe_mismatch(outs, max_sequences=4)
    assert moved["probe/max_abs_dlogp"] > 0.1 and moved["probe/kl_k3"] > 1e-3
