"""Multi-step arithmetic as a multi-turn environment (rollout.multiturn) for the job's `+experiment=agent`.

Turn 1 is the data's problem ("12+3="). After each answer the environment rewards the turn
(rollout.tasks.arith.reward: 1.0 for the exact value) and poses the next step on the true running value
("15+7="), as the chat template renders a next user message: its text right after the model's <eos>.
Steps keep operands and results in [0, 99], the range the embedded model was trained on; a first answer
outside it ends the chain. The steps depend on the problem only, so a GRPO group's samples share them.
The embedded model never saw a problem after another: it answers the later steps with <eos> (reward 0).
"""
from __future__ import annotations

import random

from rollout.tasks.arith import reward, solve


class ArithChain:
    def __init__(self, prompt: str, tokenizer):
        self.problem, self.tokenizer = prompt.removeprefix(tokenizer.bos_token or ""), tokenizer
        self.value = int(solve(self.problem))
        self.rng = random.Random(self.problem)

    def step(self, trajectory) -> tuple[list[int] | None, float, bool]:
        start, end = trajectory.spans[-1]
        answer = self.tokenizer.decode(trajectory.token_ids[start:end], skip_special_tokens=True)
        turn_reward = reward(self.problem, answer)
        if not 0 <= self.value <= 99:
            return None, turn_reward, True
        op = self.rng.choice("+-")
        b = self.rng.randrange(100 - self.value if op == "+" else self.value + 1)
        self.problem = f"{self.value}{op}{b}="
        self.value = int(solve(self.problem))
        return self.tokenizer(self.problem, add_special_tokens=False).input_ids, turn_reward, False
