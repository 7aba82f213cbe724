"""AsyncGRPOTrainer (trl 1.16, experimental) protocol adapters: trainers/trl_async.py on CPU.

AsyncGRPOTrainer cannot be built on CPU (its constructor queries the CUDA device name, and it trains through FSDP2 and
an FA3 kernel), so TRL's own pieces drive our adapters instead: `_TrainBeginCallback.on_train_begin` (cold sync, then
start), `AsyncGRPOTrainer._sync_weight` / `_sync_weight_merged` / `_streaming_iter` (bound to a stub with a CPU
accelerator), `RolloutQueueDataset` (the trainer's consumer, with its staleness filter) and `_reduce_metric` (how
the trainer reduces `metrics_queue` items). Call order checked: init_weight_transfer -> pause -> send_weights ->
resume -> update_model_version(1) -> start -> ... -> stop -> destroy.
"""
from __future__ import annotations

import os
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("trl")

from rollout import RolloutEngine, SamplingParams  # noqa: E402
from rollout.tasks import arith  # noqa: E402
from rollout.worker import RolloutWorker  # noqa: E402
from trainers.trl_async import EngineRolloutWorker, EngineWeightTransfer  # noqa: E402

LOGP_TOL = 1e-4   # arith-tiny (sharp logits), single-sequence fp32 recompute vs our engine; measured ~1e-5


@pytest.fixture(scope="module")
def arith_dir():
    return arith.ensure_default_model()


def _worker(path):
    return RolloutWorker(RolloutEngine.from_pretrained(path, device="cpu", dtype="float32", seed=0))


def _hf(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _tok(path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def arith_reward(prompts, completions, **kw):
    return [arith.reward(p, c) for p, c in zip(prompts, completions)]


class _Acc:
    is_main_process = True
    device = torch.device("cpu")
    num_processes = 1

    def wait_for_everyone(self):
        pass

    def unwrap_model(self, model):
        return model


def _stub_trainer(model, rollout_worker, weight_transfer):
    from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer

    class Stub:   # TRL's own methods, on a CPU stand-in for the trainer
        _sync_weight = AsyncGRPOTrainer._sync_weight
        _sync_weight_merged = AsyncGRPOTrainer._sync_weight_merged
        _streaming_iter = AsyncGRPOTrainer._streaming_iter

    s = Stub()
    s.accelerator, s.model, s.rollout_worker, s.weight_transfer = _Acc(), model, rollout_worker, weight_transfer
    s.model_version, s._lora_sync = 0, False
    s._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    return s


def _config(**kw):
    from trl.experimental.async_grpo import AsyncGRPOConfig
    base = dict(output_dir="/tmp/unused-async-grpo", num_generations=4, max_completion_length=8, temperature=1.0,
                bf16=False, use_cpu=True, report_to="none", max_staleness=1)
    base.update(kw)
    return AsyncGRPOConfig(**base)


def _dataset(n=64, seed=0):
    import random
    rng = random.Random(seed)
    return [{"prompt": arith.make_problem(rng, digits=2)[0]} for _ in range(n)]


@torch.no_grad()
def _recompute(model, input_ids: np.ndarray, n_prompt: int, temperature: float) -> np.ndarray:
    x = torch.as_tensor(input_ids)[None]
    logits = model(x).logits[0, :-1].float() / temperature
    lp = torch.log_softmax(logits, -1).gather(1, x[0, 1:, None])[:, 0]
    return lp[n_prompt - 1:].numpy()


def _take(dataset_iter, n, timeout=60.0):
    out, t0 = [], time.time()
    while len(out) < n:
        assert time.time() - t0 < timeout, "no rollout samples"
        out.append(next(dataset_iter))
    return out


def test_async_protocols_in_trl_call_order(arith_dir):
    from trl.experimental.async_grpo.async_grpo_trainer import (RolloutQueueDataset, _reduce_metric,
                                                                _TrainBeginCallback)
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    args = _config()
    worker = _worker(arith_dir)
    tok = _tok(arith_dir)
    model = _hf(arith_dir)
    wt = EngineWeightTransfer(worker)
    rw = EngineRolloutWorker(worker, dataset=_dataset(), processing_class=tok, reward_funcs=[arith_reward], args=args,
                             max_inflight_groups=3, seed=0)
    order = []
    wt.calls = rw.calls = order        # one shared log of protocol calls
    trainer = _stub_trainer(model, rw, wt)

    # train begin: init -> cold sync (pause, send, resume, update_model_version(1)) -> start
    _TrainBeginCallback(trainer).on_train_begin(None, None, None)
    assert order == ["init_weight_transfer", "pause", "send_weights", "resume", "update_model_version(1)", "start"]
    assert trainer.model_version == 1 and wt.versions == [1]
    try:
        ds = RolloutQueueDataset(rollout_queue=rw.rollout_buffer, model_version_fn=lambda: trainer.model_version,
                                 check_health_fn=rw.check_health, stale_after_s=120, metrics=trainer._metrics["train"],
                                 max_staleness=args.max_staleness, poll_interval_s=0.5)
        it = iter(ds)
        snap1 = {k: v.clone() for k, v in model.state_dict().items()}
        first = _take(it, 8)
        # each item is what the trainer's collator gets; the RolloutSamples themselves are checked via a peek below
        for item in first:
            ids, mask, old = item["input_ids"], item["completion_mask"], item["old_log_probs"]
            assert ids.dtype == np.int64 and mask.dtype == np.int64 and old.dtype == np.float32
            assert len(ids) == len(mask) == len(old)
            P = int(np.argmax(mask))
            assert P > 0 and mask[:P].sum() == 0 and mask[P:].all()
            assert (old[:P] == 0).all() and (old[P:] <= 0).all()
            # old logprobs = the weights of version 1 (the cold sync): all of these were sampled before any update
            ref = _recompute(model, ids, P, args.temperature)
            assert np.abs(ref - old[P:]).max() <= LOGP_TOL
        groups = defaultdict(list)
        for item in first:
            groups[item["group_id"]].append(item)
        assert all(len(g) <= 4 for g in groups.values())
        full = [g for g in groups.values() if len(g) == 4]
        assert full, "expected at least one complete group in order"
        for g in full:
            adv = np.array([x["advantage"] for x in g])
            rewards = np.array([x["metrics"]["reward"] for x in g])
            if rewards.std() > 0:
                np.testing.assert_allclose(adv, (rewards - rewards.mean()) / (rewards.std() + 1e-8), rtol=1e-6)
            else:
                assert (adv == 0).all()
            assert all(set(x["metrics"]) >= {"reward", "reward_std", "rewards/arith_reward"} for x in g)

        # a training step, then TRL's periodic sync: pause (no-op) -> send (staged) -> resume (commit at boundary)
        with torch.no_grad():
            g = torch.Generator().manual_seed(0)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.01)
        trainer._sync_weight()
        assert order[-4:] == ["pause", "send_weights", "resume", "update_model_version(2)"]
        assert trainer.model_version == 2 and wt.versions == [1, 2]
        assert trainer._metrics["train"]["perf/weight_sync_s"]          # TRL's own timing keys were logged
        # the rollout keeps streaming (no drain); soon samples from version 2 arrive and match the new weights
        v2, t0 = [], time.time()
        while len(v2) < 4:
            assert time.time() - t0 < 60, "no samples from the new weights"
            peek = rw.rollout_buffer.get(timeout=30)
            assert isinstance(peek, RolloutSample)
            assert peek.model_version in (1, 2)
            if peek.model_version == 2:
                v2.append(peek)
        for s in v2:                   # first token sampled by v2 and no later update: every token is v2
            P = int(np.argmax(s.completion_mask))
            assert np.abs(_recompute(model, s.input_ids, P, args.temperature) - s.old_log_probs[P:]).max() <= LOGP_TOL
            ref1 = _hf(arith_dir)
            ref1.load_state_dict(snap1)
            assert np.abs(_recompute(ref1, s.input_ids, P, args.temperature) - s.old_log_probs[P:]).max() > LOGP_TOL
        assert worker.policy_version == 2
        rw.check_health(stale_after_s=120)
    finally:
        # _inner_training_loop's finally: stop the worker, then destroy the transfer
        trainer.rollout_worker.stop()
        trainer.weight_transfer.destroy()
    assert order[-2:] == ["stop", "destroy"]
    assert worker._thread is None                # the worker's loop we started is stopped again

    # metrics: what AsyncGRPOTrainer.log() drains and reduces
    window = defaultdict(list)
    while not rw.metrics_queue.empty():
        for k, v in rw.metrics_queue.get_nowait().items():
            window[k].append(v)
    reduced = {k: _reduce_metric(k, v) for k, v in window.items()}
    assert reduced["gen/tokens_per_s"] > 0
    assert reduced["gen/policy_version"] >= 1 and "gen/policy_version_lag" in reduced
    assert {"sample/staleness_mean", "sample/staleness_max"} <= set(trainer._metrics["train"])


def test_weight_transfer_defers_commit_to_resume(arith_dir):
    worker = _worker(arith_dir)        # background loop not running: nothing commits by itself
    wt = EngineWeightTransfer(worker)
    wt.init_weight_transfer()
    wt.pause()
    model = _hf(arith_dir)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
    wt.send_weights((n, p) for n, p in model.named_parameters())
    assert worker.weights.pending is None and worker.policy_version == 0     # staged in the adapter only
    with torch.no_grad():
        model.model.norm.weight.mul_(2.0)          # the trainer moves on: what was sent must not change
    wt.resume()
    assert worker.weights.pending is not None and worker.weights.pending.version == 1
    worker.generate([[1, 5, 6, 13, 7, 8, 16]], SamplingParams(max_new_tokens=2, temperature=0))   # batch boundary
    assert worker.policy_version == 1
    live = worker.weights.targets["model.norm.weight"]
    torch.testing.assert_close(live, model.model.norm.weight.detach() / 2.0, rtol=0, atol=0)
    wt.destroy()
    assert wt.calls == ["init_weight_transfer", "pause", "send_weights", "resume", "destroy"]
    with pytest.raises(RuntimeError, match="before init_weight_transfer"):
        EngineWeightTransfer(worker).send_weights(iter([]))


def test_check_health_reports_a_failing_reward(arith_dir):
    def broken(prompts, completions, **kw):
        raise ZeroDivisionError("reward blew up")

    worker = _worker(arith_dir)
    rw = EngineRolloutWorker(worker, dataset=_dataset(8), processing_class=_tok(arith_dir), reward_funcs=[broken],
                             args=_config())
    rw.update_model_version(0)
    rw.start()
    try:
        t0 = time.time()
        with pytest.raises(RuntimeError, match="failed") as e:
            while time.time() - t0 < 30:
                rw.check_health(stale_after_s=60)
                time.sleep(0.05)
        assert isinstance(e.value.__cause__, ZeroDivisionError)
    finally:
        rw.stop()
