"""Speculative decoding without a draft model: n-gram drafts and the policy that decides when to verify them.

A decoding sequence's next tokens are guessed from where its last tokens occurred before: in its own
prompt and output, in the other samples of its GRPO group, and in earlier completions of the same
prompt. The scheduler verifies a draft in the step's forward (one row per drafted position); the
sampler's noise is keyed by (seed, position), so each row samples the token plain decoding would, and
a draft is accepted exactly when it equals that token: the same tokens as without speculation.

A drafted step needs every token known, so the engine first finishes the batch in flight: drafted steps
run without the one-step lag. On CUDA they replay verify graphs (pipeline.py: one per token bucket, padded
with inert tokens and sequences, captured on first use); with penalties or top logprobs, eagerly. So speculation
is only on where that pays: few rows (rows x (k+1) within `spec_max_step_tokens`, the memory-bound
regime), a measured acceptance of at least `spec_min_acceptance` (probed again now and then), and
(`spec_speed_gate`) drafted steps measured faster than plain ones: tokens per row and second of
back-to-back drafted steps against back-to-back plain steps. A host-bound small model can accept half its
drafts and still lose, as a drafted step gives up the overlap of host and device.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from statistics import median

from .request import PLACEHOLDER, Request, Sequence

MIN_MATCH = 2          # tokens of suffix a draft needs to match (the index's key)
MAX_MATCH = 16         # longest suffix compared: the longest match wins, the latest among equals
CANDIDATES = 8         # latest occurrences of the key compared per source
PROBE_EVERY = 32       # steps between drafted probes while acceptance is low (and the longest back-off
                       # without a draft); drafted steps measured slower back off this, doubled each time in a row
MAX_SLOW_BACKOFF = 256  # up to this many steps
ACCEPTANCE_DECAY = 0.8  # weight of the past in the measured acceptance
RATE_SAMPLES = 5       # latest step rates kept per kind; their median is compared (robust to one slow step)
CONTROL_STEPS = 5      # plain steps run to measure plain decoding when no recent measurement exists
REFRESH_STEPS = 512    # drafted steps after which plain decoding is measured again


def _known(tokens: list[int]) -> int:
    """Leading tokens whose values are known (a token in flight is a PLACEHOLDER at the tail)."""
    n = len(tokens)
    while n and tokens[n - 1] == PLACEHOLDER:
        n -= 1
    return n


class NgramIndex:
    """Where each MIN_MATCH-gram of a growing token list ended, latest first (a chain per key); only
    n-grams with a token after them are entered, so a list's own current suffix never matches itself."""
    __slots__ = ("last", "prev")

    def __init__(self):
        self.last: dict[tuple, int] = {}    # key -> latest end (the position of the token after it)
        self.prev: list[int] = []           # prev[e]: the previous end of the key ending at e, -1 none

    def update(self, tokens: list[int], end: int) -> None:
        """Enter the n-grams ending before position `end - 1` not entered yet."""
        for e in range(len(self.prev), end):
            key = tuple(tokens[e - MIN_MATCH:e]) if e >= MIN_MATCH else None
            self.prev.append(self.last.get(key, -1) if key else -1)
            if key:
                self.last[key] = e

    def longest(self, tokens: list[int], ctx: list[int], aligned: bool = False) -> tuple[int, int]:
        """(length, end) of the longest match of ctx's suffix in `tokens` (0, -1: none). aligned (tokens
        of the same prompt): where both hold the same last MAX_MATCH tokens at ctx's end, that wins."""
        L = len(ctx)
        if aligned and L < len(self.prev) and tokens[max(L - MAX_MATCH, 0):L] == ctx[-MAX_MATCH:]:
            return MAX_MATCH + 1, L
        best, e = (0, -1), self.last.get(tuple(ctx[-MIN_MATCH:]), -1)
        for _ in range(CANDIDATES):
            if e < 0:
                break
            n = MIN_MATCH
            while n < MAX_MATCH and n < e and n < len(ctx) and tokens[e - n - 1] == ctx[-n - 1]:
                n += 1
            if n > best[0]:
                best = (n, e)
            if n == MAX_MATCH:
                break
            e = self.prev[e]
        return best


class NgramDrafter:
    """Drafts from the sequence itself, its group's other samples and (history_prompts > 0) the latest
    group of completions of each of that many recent prompts (previous RL steps' rollouts)."""

    def __init__(self, history_prompts: int = 0):
        self.history_prompts = history_prompts
        self.history: OrderedDict[tuple, list[tuple[list[int], NgramIndex]]] = OrderedDict()

    def remember(self, req: Request) -> None:
        """Keep a finished request's completions (prompt + output) as drafts for later requests of its prompt."""
        done = [(s.token_ids, s.draft_index or NgramIndex()) for s in req.seqs if s.num_generated > 0]
        if not self.history_prompts or not done:
            return
        key = tuple(req.prompt_ids)
        self.history[key] = done
        self.history.move_to_end(key)
        while len(self.history) > self.history_prompts:
            self.history.popitem(last=False)

    def _sources(self, seq: Sequence):
        req = seq.request
        if req.draft_history is None:
            req.draft_history = self.history.get(tuple(req.prompt_ids), []) if self.history_prompts else []
        for s in [seq] + [s for s in req.seqs if s is not seq]:
            if s.draft_index is None:
                s.draft_index = NgramIndex()
            yield s.token_ids, s.draft_index
        yield from req.draft_history

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to k tokens that followed the longest earlier match of the sequence's suffix (sources in
        order: itself, its siblings, earlier completions; the first wins a tie; a sibling or earlier
        completion that holds the same tokens up to here wins, as SPEC-RL / DAS draft from the previous
        rollout). Its own earlier occurrence may reach its end: the draft then repeats that period.
        The place found is followed on later steps while every token since matched there (no other
        source can then hold a longer match): no search while drafts are accepted, which is most of a
        drafted step's host time otherwise."""
        ctx = seq.token_ids
        L = len(ctx)
        found = self._followed(seq, ctx, L)
        if found is None:
            best = 0
            for tokens, index in self._sources(seq):
                end = _known(tokens)
                index.update(tokens, end)
                n, e = index.longest(tokens, ctx, aligned=tokens is not ctx)
                if n > best:
                    best, found = n, (tokens, e, end)
                    if n > MAX_MATCH:      # aligned: no later source can beat it
                        break
            if found is None:
                seq.draft_follow = None
                return []
            seq.draft_follow = (found[0], found[1] - L, best, L)
        tokens, e, end = found
        draft: list[int] = []
        for j in range(e, e + k):
            if j < end:
                draft.append(tokens[j])
            elif tokens is ctx:
                draft.append(draft[j - end])
            else:
                break
        return draft

    @staticmethod
    def _followed(seq: Sequence, ctx: list[int], L: int):
        """(tokens, next position, known end) of the place the sequence drafted from last, if its suffix
        still matches there: the match found then, grown by every token since (up to MAX_MATCH)."""
        if seq.draft_follow is None:
            return None
        tokens, offset, matched, at = seq.draft_follow
        pos, m = L + offset, min(MAX_MATCH, matched + L - at, L)
        end = _known(tokens)
        if m <= pos < end and tokens[pos - m:pos] == ctx[L - m:]:
            return tokens, pos, end
        return None


class Speculator:
    """When to draft, how much, and what it gained (engine.stats())."""

    def __init__(self, cfg):
        self.drafter = NgramDrafter(cfg.spec_history_prompts)
        self.max_draft, self.max_step_tokens = cfg.spec_max_draft, cfg.spec_max_step_tokens
        self.min_acceptance = cfg.spec_min_acceptance
        self.speed_gate = cfg.spec_speed_gate
        self.acceptance = 1.0            # measured: accepted / drafted per drafted step, decayed
        self.wait = 0                    # steps to go before drafting again
        self.misses = 0                  # drafting attempts in a row that found no draft
        # Step rates in tokens per decoding row and second, of steps that follow one of their own kind: a
        # plain step after a drafted one refills the pipeline and a drafted step after a plain one first
        # drains it, so neither is typical of its kind.
        self.rates = {"plain": deque(maxlen=RATE_SAMPLES), "drafted": deque(maxlen=RATE_SAMPLES)}
        self.kinds = [None, None]        # the two latest steps: "plain", "drafted" or None (neither, or no decode)
        self.started = None              # when the latest step started
        self.rows = 0                    # its decoding rows
        self.gain = 1.0                  # its tokens per row (a drafted step: 1 + accepted / rows)
        self.since_plain = 0             # drafted steps since plain decoding was last measured
        self.slow_in_a_row = 0           # drafted runs measured slower, with no faster one since
        self.measured_speedup = None     # the latest drafted-over-plain rate (stats)
        self.counts = {"spec_steps": 0, "spec_drafted": 0, "spec_accepted": 0, "spec_drafted_seqs": 0,
                       "spec_drains": 0, "spec_empty": 0, "spec_control_steps": 0, "spec_slower": 0}

    @staticmethod
    def _eligible(seq: Sequence) -> bool:
        """Decoding (its last token, maybe in flight, is all it computes) and not opted out."""
        p = seq.request.params
        return seq.num_tokens - seq.num_computed == 1 and seq.fork_count == 1 and p.speculative \
            and not p.return_routed_experts

    def draft_len(self, running: list[Sequence], now: float) -> int:
        """k for this step, which started at `now`: 0 (no speculation) in compute-bound steps (rows x
        (k + 1) over the limit), with nothing decoding, while backing off (low acceptance, no draft found
        lately, drafted steps measured slower than plain ones) and while plain decoding is measured."""
        self._clock(now)
        self.rows, self.gain = sum(s.fork_count for s in running), 1.0
        k = min(self.max_draft, self.max_step_tokens // max(self.rows, 1) - 1)
        self.kinds = [self.kinds[1], None]              # "drafted" once observe() sees its drafts verified
        if k < 1 or not any(self._eligible(s) for s in running):
            return 0
        if self.speed_gate and not self.wait and (not self.rates["plain"] or self.since_plain >= REFRESH_STEPS):
            self.wait, self.since_plain = CONTROL_STEPS, 0
            self.counts["spec_control_steps"] += CONTROL_STEPS
        if self.wait:
            self.wait -= 1
            self.kinds[1] = "plain"
            return 0
        return k

    def _clock(self, now: float) -> None:
        """Close the latest step: a typical one (after one of its kind) updates its kind's rate; a drafted
        one measured slower than plain decoding (the medians: over 3 drafted samples at least, or over
        one at under half the plain rate, where exploring costs most) backs off, longer each time in a row."""
        kind, began = self.kinds[1], self.started
        self.started = now
        if kind is None or kind != self.kinds[0] or began is None or now <= began:
            return
        self.rates[kind].append(self.gain / (now - began))
        if kind == "plain":
            self.since_plain = 0
            return
        self.since_plain += 1
        speedup, samples = self.speedup(), len(self.rates["drafted"])
        self.measured_speedup = speedup
        if not self.speed_gate or speedup is None:
            return
        if speedup >= 1 and samples >= 3:
            self.slow_in_a_row = 0
        elif (speedup < 0.5 or speedup < 1 and samples >= 3) and not self.wait:
            # A verdict holds for the conditions it was measured in (rows, acceptance), which change as the
            # batch drains: the next probe is judged on its own samples. Slow again and again (a host-bound
            # model): probe less often.
            self.counts["spec_slower"] += 1
            self.rates["drafted"].clear()
            self.wait = min(PROBE_EVERY << self.slow_in_a_row, MAX_SLOW_BACKOFF)
            self.slow_in_a_row += 1

    def speedup(self):
        """Drafted steps' measured tokens per row and second over plain steps' (None: not measured yet)."""
        p, d = self.rates["plain"], self.rates["drafted"]
        return median(d) / median(p) if p and d else None

    def propose(self, running: list[Sequence], k: int) -> dict[Sequence, list[int]]:
        """Drafts of the eligible sequences (every token known by now); none found: back off 2, 4, .. steps."""
        drafts = {s: d for s in running if self._eligible(s) for d in [self.drafter.propose(s, k)] if d}
        if drafts:
            self.misses = 0
        else:
            self.counts["spec_empty"] += 1
            self.misses += 1
            self.wait = min(2 ** self.misses, PROBE_EVERY)
        return drafts

    def observe(self, num_drafted: int, num_accepted: int, num_seqs: int) -> None:
        """A drafted step's result: below the acceptance threshold, the next drafted step is a probe."""
        c = self.counts
        c["spec_steps"] += 1
        c["spec_drafted"] += num_drafted
        c["spec_accepted"] += num_accepted
        c["spec_drafted_seqs"] += num_seqs
        self.kinds[1], self.gain = "drafted", 1.0 + num_accepted / max(self.rows, 1)
        self.acceptance = ACCEPTANCE_DECAY * self.acceptance + (1 - ACCEPTANCE_DECAY) * num_accepted / num_drafted
        if self.acceptance < self.min_acceptance:
            self.wait = PROBE_EVERY

    def stats(self) -> dict:
        c = self.counts
        # tokens a drafted sequence gained per drafted step: its accepted drafts and the row after them
        gained = (c["spec_accepted"] + c["spec_drafted_seqs"]) / max(c["spec_drafted_seqs"], 1)
        return {**c, "spec_acceptance": self.acceptance, "spec_tokens_per_seq_step": gained,
                "spec_measured_speedup": self.measured_speedup}
