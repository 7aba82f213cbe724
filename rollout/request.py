"""Requests, sequences and their outputs; SamplingParams and its validation.

A request holds one prompt and `n` sequences (the GRPO group). While the prompt is
prefilled the group is one unit; after the prefill it forks into `n` sequences that
share the prompt's KV pages.
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class SamplingParams:
    n: int = 1
    max_new_tokens: int = 16
    temperature: float = 1.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None        # per request; sample i of the group uses (seed, i)
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    top_logprobs: int = 0             # 0 = off
    detokenize: bool = True
    # RL worker policies (applied by rollout.worker at each weight update):
    stale_kv: str = "keep"            # "keep" the KV computed by older weights, or "recompute" it
    max_staleness: Optional[int] = None   # versions behind the live weights before `on_stale`
    on_stale: str = "finish"          # "finish" (finish_reason="stale") or "abort"

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the first bad field; called before anything is scheduled."""
        def bad(msg):
            raise ValueError(f"invalid SamplingParams: {msg}")
        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            bad(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not (self.temperature >= 0):  # also rejects NaN
            bad(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (0 <= self.min_p <= 1):
            bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not (self.repetition_penalty > 0):
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            bad(f"seed must be a non-negative integer or None, got {self.seed!r}")
        if not isinstance(self.top_logprobs, int) or not (0 <= self.top_logprobs <= vocab_size):
            bad(f"top_logprobs must be an integer in [0, vocab size], got {self.top_logprobs!r}")
        if isinstance(self.stop, str) or any(not isinstance(s, str) or not s for s in self.stop):
            bad(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if self.stale_kv not in ("keep", "recompute"):
            bad(f"stale_kv must be 'keep' or 'recompute', got {self.stale_kv!r}")
        if self.on_stale not in ("finish", "abort"):
            bad(f"on_stale must be 'finish' or 'abort', got {self.on_stale!r}")
        if self.max_staleness is not None and (not isinstance(self.max_staleness, int) or self.max_staleness < 0):
            bad(f"max_staleness must be a non-negative integer or None, got {self.max_staleness!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or not (0 <= t < vocab_size):
                bad(f"stop_token_ids must be ids in [0, {vocab_size}), got {t!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


class Status(enum.Enum):
    WAITING = "waiting"      # queued (new, or preempted and waiting to recompute)
    RUNNING = "running"      # holds KV pages; prefilling or decoding
    FINISHED = "finished"


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]             # log_softmax(logits / T) over the full vocab, fp32
    processed_logprobs: list[float]   # under the distribution actually sampled from
    kept_mass: list[float]            # log of the mass kept by truncation
    finish_reason: Optional[str]      # "stop" | "length" | "abort" | "stale" | "error"
    text: Optional[str] = None
    policy_versions: list[int] = field(default_factory=list)   # per token: weights that sampled it
    top_logprobs: Optional[list[dict[int, float]]] = None
    stop_reason: Optional[object] = None  # the stop string or token id that ended it


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    completions: list[Completion]
    prompt: Optional[str] = None
    params: Optional[SamplingParams] = None
    error: Optional[str] = None       # set when a fault in a step failed this request

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


_seq_ids = itertools.count()

PLACEHOLDER = -1   # a token sampled by a batch still in flight; carry-over fills it in


class Sequence:
    """One stream of tokens with its KV pages. Before a group forks, the single prefill
    sequence stands for all `n` samples (`fork_count = n`)."""

    def __init__(self, request: "Request", sample_index: int, token_ids: list[int], num_prompt: int):
        self.seq_id = next(_seq_ids)
        self.request = request
        self.sample_index = sample_index
        self.token_ids = token_ids        # prompt + generated
        self.num_prompt = num_prompt
        self.num_computed = 0             # tokens whose KV is in the cache
        self.block_table: list[int] = []  # physical page ids
        self.host_table: list[int] = []   # host pages holding its KV while swapped out
        self.table_version = 0            # bumped on every block-table change (kv_cache.py)
        self.status = Status.WAITING
        self.fork_count = 1               # >1 only for a group's shared prefill
        self.logprobs: list[float] = []
        self.processed_logprobs: list[float] = []
        self.kept_mass: list[float] = []
        self.top_logprobs: list[dict[int, float]] = []
        self.policy_versions: list[int] = []   # weights version that sampled each token
        self.finish_reason: Optional[str] = None
        self.stop_reason = None
        self.num_preemptions = 0
        self.epoch = 0                    # bumped on preemption: in-flight rows become stale
        self.inflight: dict[int, tuple[int, int]] = {}   # placeholder pos -> (batch_id, row)

    def drop_placeholders(self) -> None:
        while self.token_ids and self.token_ids[-1] == PLACEHOLDER:
            self.inflight.pop(len(self.token_ids) - 1, None)
            self.token_ids.pop()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def generated_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED

    def __repr__(self):
        return (f"Sequence(id={self.seq_id}, req={self.request.request_id}, i={self.sample_index}, "
                f"tokens={self.num_tokens}, computed={self.num_computed}, {self.status.value})")


class Request:
    def __init__(self, request_id: int, prompt_ids: list[int], params: SamplingParams,
                 seed: int, prompt: Optional[str] = None):
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.prompt = prompt
        self.params = params
        self.seed = seed                  # resolved: user seed or drawn by the engine
        self.error: Optional[str] = None
        first = Sequence(self, 0, list(prompt_ids), len(prompt_ids))
        first.fork_count = params.n
        self.seqs: list[Sequence] = [first]

    def sample_seed(self, sample_index: int) -> int:
        # Distinct, reproducible stream per sample of the group.
        return (self.seed * 1_000_003 + sample_index * 7_919) % (2 ** 31)

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.finished for s in self.seqs)

    def output(self, tokenizer=None) -> RequestOutput:
        comps = []
        for s in sorted(self.seqs, key=lambda s: s.sample_index):
            text = None
            if tokenizer is not None and self.params.detokenize:
                text = getattr(s, "final_text", None)
                if text is None:
                    text = tokenizer.decode(s.generated_ids, skip_special_tokens=True)
            comps.append(Completion(
                token_ids=list(s.generated_ids), logprobs=list(s.logprobs),
                processed_logprobs=list(s.processed_logprobs), kept_mass=list(s.kept_mass),
                finish_reason=s.finish_reason, text=text,
                top_logprobs=list(s.top_logprobs) if self.params.top_logprobs else None,
                stop_reason=s.stop_reason, policy_versions=list(s.policy_versions)))
        return RequestOutput(self.request_id, list(self.prompt_ids), comps, self.prompt, self.params, self.error)
