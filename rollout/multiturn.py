"""Multi-turn rollouts, token in / token out.

An environment (tool calls, a game, a checker) reads each turn's completion and answers with
the next observation's token ids. A trajectory goes on from exactly the token ids sampled so
far plus the observation's, never from re-tokenized text, so what the trainer scores is what
was sampled. Every active trajectory's next turn is queued as soon as its environment answers,
so turns of all trajectories batch together; each turn is a new request whose prompt is the
whole trajectory, and the prefix cache serves its KV, so only the new tokens are prefilled.
A first prompt with SamplingParams.n = G starts a GRPO group of G trajectories sharing its pages.

    class Env:
        def step(self, traj):            # after each turn
            return obs_ids_or_None, reward, done
    trajs = run_trajectories(engine, prompts, lambda i, k: Env(), SamplingParams(n=8, ...), max_turns=4)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol

from .request import Completion, SamplingParams, _is_int


@dataclass
class Trajectory:
    prompt_index: int
    sample_index: int                   # within its first prompt's group
    token_ids: list[int] = field(default_factory=list)       # first prompt, then per turn: generated, observation
    generated: list[bool] = field(default_factory=list)      # per token: sampled by the policy (trained on)
    logprobs: list[float] = field(default_factory=list)      # per token; 0.0 where not generated
    policy_versions: list[int] = field(default_factory=list)  # per token; -1 where not generated
    spans: list[tuple[int, int]] = field(default_factory=list)   # [start, end) of each turn's generated tokens
    rewards: list[float] = field(default_factory=list)       # per turn, from the environment
    finish_reasons: list[str] = field(default_factory=list)  # per turn, the engine's ("stop", "length", ...)
    end: Optional[str] = None   # "done" (by the environment), "max_turns", "max_model_len", or the engine's
                                # "abort" / "error" / "stale" of the last turn

    def _append(self, ids: list[int], c: Optional[Completion] = None) -> None:
        self.token_ids += ids
        self.generated += [c is not None] * len(ids)
        self.logprobs += c.logprobs if c is not None else [0.0] * len(ids)
        self.policy_versions += c.policy_versions if c is not None else [-1] * len(ids)


class Environment(Protocol):
    def step(self, trajectory: Trajectory) -> tuple[Optional[list[int]], float, bool]:
        """After a turn (its tokens are the trajectory's last span): the next observation's token
        ids (None to stop), this turn's reward, and whether the trajectory is done."""


def turn_seed(seed: int, sample_index: int, turn: int) -> int:
    """The seed of a seeded trajectory's later turn (turn >= 1; turn 0 is its prompt's request): from its
    prompt's seed, its sample index and the turn, so it does not depend on what else runs in the call."""
    return hash((seed, sample_index, turn)) % 2 ** 31


def run_trajectories(runner, prompts, env_factory: Callable[[int, int], Environment],
                     sampling_params, max_turns: int) -> list[Trajectory]:
    """Roll out sum(n) trajectories of at most max_turns turns on a RolloutEngine, or a RolloutWorker
    stepped inline (weight updates land between steps), which runs nothing else meanwhile (like generate).
    sampling_params: one SamplingParams, or one per prompt. env_factory(prompt index, sample index) makes
    each trajectory's environment. Later turns sample one completion each (n = 1) under their prompt's
    params, seeded by turn_seed where it has a seed (prompts sharing one seed share their samples' streams,
    as a group's first turn does). Returns the trajectories ordered by (prompt index, sample index)."""
    engine = getattr(runner, "engine", runner)
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
        raise ValueError(f"max_turns must be an integer >= 1, got {max_turns!r}")
    if engine.requests or getattr(runner, "_thread", None) is not None:
        raise ValueError("run_trajectories needs the engine to itself (no other requests, no background loop)")
    params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
    if not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError(f"sampling_params must be a rollout.SamplingParams or one per prompt, "
                         f"got {sampling_params!r:.80}")
    first = runner.add_requests(prompts, params)
    trajs = [Trajectory(i, k) for i, p in enumerate(params) for k in range(p.n)]
    envs = [env_factory(t.prompt_index, t.sample_index) for t in trajs]
    pending, j = {}, 0                                  # request -> its trajectories
    for rid, p in zip(first, params):
        pending[rid], j = list(range(j, j + p.n)), j + p.n
    try:
        while pending:
            nxt = []
            for out in runner.step():
                for j, c in zip(pending.pop(out.request_id), out.completions):
                    t = trajs[j]
                    if not t.token_ids:
                        t._append(out.prompt_token_ids)
                    if _turn_done(t, c, envs[j], max_turns, engine):
                        nxt.append(j)
            if nxt:
                ps = [params[trajs[j].prompt_index] for j in nxt]
                ps = [dataclasses.replace(p, n=1, seed=None if p.seed is None else
                                          turn_seed(p.seed, trajs[j].sample_index, len(trajs[j].spans)))
                      for p, j in zip(ps, nxt)]
                for rid, j in zip(runner.add_requests([trajs[j].token_ids for j in nxt], ps), nxt):
                    pending[rid] = [j]
    except BaseException:
        runner.abort(list(pending))     # leave nothing of ours queued
        raise
    return trajs


def _turn_done(t: Trajectory, c: Completion, env: Environment, max_turns: int, engine) -> bool:
    """Record a finished turn and ask the environment; True when the trajectory goes on."""
    start = len(t.token_ids)
    t._append(c.token_ids, c)
    t.spans.append((start, len(t.token_ids)))
    t.finish_reasons.append(c.finish_reason)
    if c.finish_reason not in ("stop", "length"):
        t.rewards.append(0.0)
        t.end = c.finish_reason
        return False
    obs, reward, done = env.step(t)
    t.rewards.append(float(reward))
    if done or obs is None:
        t.end = "done"
    elif len(t.spans) >= max_turns:
        t.end = "max_turns"
    else:
        if isinstance(obs, (str, bytes)) or not all(_is_int(x) and 0 <= x < engine.vocab_size for x in obs):
            raise ValueError(f"environment of trajectory ({t.prompt_index}, {t.sample_index}) returned an "
                             f"observation that is not token ids in [0, {engine.vocab_size}): {obs!r:.80}")
        t._append([int(x) for x in obs])
        if len(t.token_ids) >= engine.max_model_len:
            t.end = "max_model_len"
    return t.end is None
