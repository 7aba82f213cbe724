"""Requests, sequences and their outputs; SamplingParams and its validation.

A request holds one prompt and `n` sequences (the GRPO group). While the prompt is
prefilled the group is one unit; after the prefill it forks into `n` sequences that
share the prompt's KV pages.
"""
from __future__ import annotations

import enum
import itertools
import math
import numbers
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

# Below this a temperature overflows log_softmax(logits / T) for large logits: use 0 for greedy.
MIN_TEMPERATURE = 1e-5


def _is_array(x) -> bool:
    """A numpy array or torch tensor (any dtype and rank)."""
    return hasattr(x, "tolist") and hasattr(x, "ndim") and hasattr(x, "dtype")


def _is_int(v) -> bool:
    """Python, numpy and 0-d torch integers; not booleans (their dtype names hold no "int")."""
    return not isinstance(v, bool) and (isinstance(v, numbers.Integral)
                                        or (_is_array(v) and v.ndim == 0 and "int" in str(v.dtype)))


def _is_number(v) -> bool:
    return not isinstance(v, bool) and (isinstance(v, numbers.Real) or (
        _is_array(v) and v.ndim == 0 and ("int" in str(v.dtype) or "float" in str(v.dtype))))


def _is_sequence(v) -> bool:
    return isinstance(v, (list, tuple)) or (_is_array(v) and v.ndim == 1)


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
    return_routed_experts: bool = False   # MoE: Completion.routed_experts (the prefix cache is not used)
    speculative: bool = True          # False: never drafted when the engine speculates (plain decode steps' bits)
    # RL worker policies (applied by rollout.worker at each weight update):
    stale_kv: str = "keep"            # "keep" the KV computed by older weights, or "recompute" it
    max_staleness: Optional[int] = None   # versions behind the live weights before `on_stale`
    on_stale: str = "finish"          # "finish" (finish_reason="stale") or "abort"

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the first bad field; called before anything is scheduled."""
        self.checked(vocab_size)

    def checked(self, vocab_size: int) -> "SamplingParams":
        """A validated copy with plain Python values (numpy / torch integers and floats accepted),
        so later changes to this object touch nothing already queued. Raises ValueError naming
        the first bad field."""
        def bad(name, want):
            raise ValueError(f"invalid SamplingParams: {name} must be {want}, got {getattr(self, name)!r}")

        def integer(name, lo, hi=None, optional=False):
            v = getattr(self, name)
            if v is None and optional:
                return None
            if not _is_int(v) or v < lo or (hi is not None and v > hi):
                bad(name, f"an integer >= {lo}" + (f" and <= {hi}" if hi is not None else "")
                    + (" or None" if optional else ""))
            return int(v)

        def number(name, ok, want):
            v = getattr(self, name)
            if not _is_number(v) or not math.isfinite(v) or not ok(float(v)):
                bad(name, want)
            return float(v)

        def choice(name, options):
            if getattr(self, name) not in options:
                bad(name, " or ".join(repr(o) for o in options))
            return getattr(self, name)

        temperature = number("temperature", lambda t: t == 0 or t >= MIN_TEMPERATURE,
                             f"0 (greedy) or a finite number >= {MIN_TEMPERATURE}")
        stop_ids = self.stop_token_ids
        if isinstance(stop_ids, (str, bytes)) or not _is_sequence(stop_ids) \
                or not all(_is_int(t) and 0 <= t < vocab_size for t in stop_ids):
            bad("stop_token_ids", f"a list of token ids in [0, {vocab_size})")
        stop = self.stop
        if isinstance(stop, str) or not _is_sequence(stop) or any(not isinstance(x, str) or not x for x in stop):
            bad("stop", "a list of non-empty strings")
        for name in ("ignore_eos", "detokenize", "return_routed_experts", "speculative"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "True or False")
        return SamplingParams(
            n=integer("n", 1), max_new_tokens=integer("max_new_tokens", 1), temperature=temperature,
            top_p=number("top_p", lambda x: 0 < x <= 1, "a number in (0, 1]"),
            top_k=min(integer("top_k", 0), vocab_size), min_p=number("min_p", lambda x: 0 <= x <= 1, "a number in [0, 1]"),
            repetition_penalty=number("repetition_penalty", lambda x: x > 0, "a finite number > 0"),
            seed=integer("seed", 0, optional=True), stop_token_ids=[int(t) for t in stop_ids], stop=list(stop),
            ignore_eos=self.ignore_eos, top_logprobs=integer("top_logprobs", 0, vocab_size),
            detokenize=self.detokenize, return_routed_experts=self.return_routed_experts, speculative=self.speculative,
            stale_kv=choice("stale_kv", ("keep", "recompute")),
            max_staleness=integer("max_staleness", 0, optional=True), on_stale=choice("on_stale", ("finish", "abort")))

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
    sample_index: int = 0             # within its request's group; a continuation keeps its sampler stream
    # return_routed_experts: int16 [P + T - 1, MoE layers, top_k], the expert ids each position's forward
    # was routed to (every prompt token and every generated token but the last), most probable first
    routed_experts: Optional[np.ndarray] = None


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
NO_CACHE = 1 << 40  # Sequence.prefix_pages of a sequence that enters no page into the prefix cache


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
        # Prefix cache (kv_cache.py): its leading pages whose cache entry is known, and that entry's id
        self.prefix_pages = NO_CACHE
        self.prefix_key = 0
        self.routed: Optional[np.ndarray] = None   # return_routed_experts: [position, layer, k], rows routed_len
        self.routed_len = 0
        self.draft_index = None           # spec.py: n-gram index of its tokens, built when it is first drafted from
        self.draft_follow = None          # spec.py: where it drafted from last (source tokens, offset, match, length)

    def drop_placeholders(self) -> None:
        """Drop the tail not yet sampled: tokens in flight (PLACEHOLDER) and drafts under verification
        (every sampled token has its logprob, so the known tokens are the prompt and len(logprobs) more)."""
        known = self.num_prompt + len(self.logprobs)
        for pos in range(known, len(self.token_ids)):
            self.inflight.pop(pos, None)
        del self.token_ids[known:]

    def record_routing(self, start: int, ids: np.ndarray) -> None:
        """Expert ids [layers, n, k] of positions start.. (a recompute overwrites its rows). A forked
        sample starts from its group's prompt rows, landed by then: its first rows land after the
        prefill's last."""
        if self.routed is None:
            self.routed = np.zeros((self.num_prompt + self.request.params.max_new_tokens,) + self.request.routed_shape,
                                   np.int16)
            group = self.request.seqs[0]
            if group is not self and group.routed is not None:
                self.routed_len = min(group.routed_len, self.num_prompt)
                self.routed[:self.routed_len] = group.routed[:self.routed_len]
        end = start + ids.shape[1]
        self.routed[start:end] = ids.transpose(1, 0, 2)
        self.routed_len = max(self.routed_len, end)

    def routed_experts(self) -> np.ndarray:
        """The rows of every position whose forward ran and landed (a never-run sample: its group's prompt)."""
        src = self if self.routed is not None else self.request.seqs[0]
        if src.routed is None:
            return np.zeros((0,) + self.request.routed_shape, np.int16)
        n = min(src.routed_len, self.num_tokens - 1, self.num_prompt if src is not self else src.routed_len)
        return src.routed[:n].copy()

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
                 seed: int, prompt: Optional[str] = None, continue_from: Optional[Completion] = None):
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.prompt = prompt
        self.params = params
        self.seed = seed                  # resolved: user seed or drawn by the engine
        self.error: Optional[str] = None
        self.routed_shape = (0, 0)        # (MoE layers, top_k): set by the engine for return_routed_experts
        self.draft_history = None         # spec.py: earlier completions of this prompt, looked up once
        first = Sequence(self, 0, list(prompt_ids), len(prompt_ids))
        first.fork_count = params.n
        if continue_from is not None:     # a partial completion (n = 1) goes on after its last token
            c = continue_from
            first.sample_index = c.sample_index
            first.token_ids += c.token_ids
            first.logprobs, first.processed_logprobs = list(c.logprobs), list(c.processed_logprobs)
            first.kept_mass, first.policy_versions = list(c.kept_mass), list(c.policy_versions)
            first.top_logprobs = list(c.top_logprobs or [])
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
                stop_reason=s.stop_reason, policy_versions=list(s.policy_versions), sample_index=s.sample_index,
                routed_experts=s.routed_experts() if self.params.return_routed_experts else None))
        return RequestOutput(self.request_id, list(self.prompt_ids), comps, self.prompt, self.params, self.error)
