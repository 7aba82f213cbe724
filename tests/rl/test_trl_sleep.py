"""The TRL adapter's colocated mode on CPU: GRPOTrainer with our generator sleeping after every generate and
waking before the next. The worker is asleep at every optimizer step, the sleep / wake calls are counted, and
TRL's own check holds as without sleep: importance ratio within 1e-4 of 1, |dlogp| <= 1e-5 (fp32), at level 1
and at level 2 with the weights dropped and re-sent by each sync."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
sys.path.insert(0, str(Path(__file__).resolve().parent))

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from test_trl_generator import LOGP_TOL, RATIO_TOL, _grpo, _step_logs, _worker  # noqa: E402
from trainers import TRLGenerationAdapter, attach_generator  # noqa: E402


@pytest.fixture(autouse=True)
def _trl_env(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()


def _sleep_levels_at_optimizer_steps(trainer, worker) -> list:
    from transformers import TrainerCallback
    seen = []

    class AtOptimizerStep(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kw):
            seen.append(worker.engine.sleep_level)
    trainer.add_callback(AtOptimizerStep())
    return seen


@pytest.mark.parametrize("level", [1, 2])
def test_grpo_with_sleep_keeps_trainer_exact_logprobs(model_dir, tmp_path, level):
    path = model_dir("qwen2")
    trainer, _ = _grpo(path, tmp_path)
    worker = _worker(path)
    adapter = attach_generator(trainer, worker, sleep_level=level)
    assert adapter.sleep_level == level and adapter.discard_weights == (level == 2)
    at_step = _sleep_levels_at_optimizer_steps(trainer, worker)
    trainer.train()

    logs = _step_logs(trainer)
    assert [h["step"] for h in logs] == [1, 2, 3]
    for h in logs:
        assert h["sampling/sampling_logp_difference/max"] <= LOGP_TOL, h
        for k in ("min", "mean", "max"):
            assert abs(h[f"sampling/importance_sampling_ratio/{k}"] - 1.0) <= RATIO_TOL, h
        assert h["gen/sleep_s"] >= 0 and h["gen/wake_s"] >= 0 and h["gen/sleep_freed_gb"] > 0
    assert at_step == [level] * 3                     # asleep whenever the optimizer stepped
    assert len(adapter.sleep_reports) == 3 and all(r["level"] == level for r in adapter.sleep_reports)
    # level 1: one wake per generate; level 2: the weights in each of the 3 syncs, then the rest in each generate
    assert len(adapter.wake_reports) == (3 if level == 1 else 6)
    assert worker.engine.sleep_level == level         # training ended after a generate: still asleep
    assert adapter.sync_history == [0, 1, 2] and adapter.batch_versions == [[0], [1], [2]]
    assert worker.weights.metrics["updates"] == 2 and worker.weights.metrics["verified"] == 2
    assert worker.engine.kv.alloc.num_used == 0
    if level == 2:                                    # dropped, not copied: the host copies are only the buffers
        host = sum(h.nbytes() for h in worker.engine.runner._host_weights)
        assert host < sum(p.numel() * p.element_size() for p in worker.engine.model.parameters()) // 10


def test_sleep_level_choice_and_refusals(model_dir, tmp_path):
    path = model_dir("qwen2")
    trainer, _ = _grpo(path, tmp_path)
    worker = _worker(path)
    assert TRLGenerationAdapter(worker, trainer).sleep_level == 0          # auto: CPU is not a shared GPU
    assert TRLGenerationAdapter(worker, trainer, sleep_level=None).sleep_level == 0
    for bad in (3, True, "always"):
        with pytest.raises(ValueError, match="sleep_level must be 'auto', None, 1 or 2"):
            TRLGenerationAdapter(worker, trainer, sleep_level=bad)
    remote = SimpleNamespace(remote=True, engine=worker.engine, weights=worker.weights)
    with pytest.raises(ValueError, match="needs an in-process RolloutWorker"):
        TRLGenerationAdapter(remote, trainer, sleep_level=1)
