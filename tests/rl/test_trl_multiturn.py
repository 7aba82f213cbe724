"""TRL 1.16's GRPOTrainer over multi-turn trajectories: make_rollout_func(worker, env_factory=...) runs
rollout.tasks.arith_chain on the embedded model through rollout.multiturn for 2 steps, TRL takes the
`env_mask` as its loss mask (its completion lengths count only sampled tokens) and the per-turn rewards
reach the reward function."""
from __future__ import annotations

import pytest

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from rollout import RolloutEngine  # noqa: E402
from rollout.tasks import arith  # noqa: E402
from rollout.tasks.arith_chain import ArithChain  # noqa: E402
from rollout.worker import RolloutWorker  # noqa: E402
from trainers import make_rollout_func  # noqa: E402


def test_grpo_two_steps_on_arith_chain_trajectories(tmp_path, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    path = arith.ensure_default_model()
    tok = AutoTokenizer.from_pretrained(path)
    worker = RolloutWorker(RolloutEngine.from_pretrained(path, device="cpu", dtype="float32", page_size=4))
    func = make_rollout_func(worker, env_factory=lambda prompt, k: ArithChain(prompt, tok), max_turns=3)
    batches = []

    def spy(prompts, trainer):
        batches.append(func(prompts, trainer))
        return batches[-1]

    def total(prompts, completions, turn_rewards, **kw):
        return [sum(r) for r in turn_rewards]

    rows = [{"prompt": p} for p in ("12+3=", "40+7=", "8+9=", "31+25=")] * 4
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=8, learning_rate=1e-3, max_steps=2, logging_steps=1, bf16=False,
                      use_cpu=True, beta=0.0, report_to="none", save_strategy="no", seed=0, disable_tqdm=True,
                      dataloader_num_workers=0, lr_scheduler_type="constant")
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), reward_funcs=total,
                          args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=tok,
                          rollout_func=spy)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert len(batches) == len(logs) == 2 and func.state["adapter"].sync_history == [0, 1]
    for out, log in zip(batches, logs):
        assert len(out["completion_ids"]) == 8
        for c, m, lp, tr in zip(out["completion_ids"], out["env_mask"], out["logprobs"], out["turn_rewards"]):
            assert len(c) == len(m) == len(lp) and m[0] == 1 and len(tr) == 3     # these chains stay in [0, 99]
            assert all(x == 0.0 for x, g in zip(lp, m) if not g) and 0 in m     # observations between turns
        assert log["reward"] == pytest.approx(sum(map(sum, out["turn_rewards"])) / 8)
        # TRL counts a completion's length over its env_mask: our sampled tokens only
        assert log["completions/mean_length"] == pytest.approx(sum(map(sum, out["env_mask"])) / 8)
        assert log["completions/mean_length"] < sum(map(len, out["completion_ids"])) / 8
