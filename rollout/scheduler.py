"""Continuous-batching scheduler (CPU): admission by free KV pages under a per-step
token budget, chunked prefill, preemption (by recompute, or by swapping pages to host
memory), and output processing (filling sampled tokens, stop checks, freeing pages).
A sequence admitted from scratch first takes its longest cached prefix (kv_cache.py).

One step = a list of (sequence, tokens to compute, rows to sample). Decodes are
just sequences with one token left to compute, so prefill chunks and decodes mix.

One-step lag, in sync and async mode alike: batch k is scheduled before batch k-1's
tokens are known. A row sampled in k-1 leaves a PLACEHOLDER in its sequence; batch k
uses it as input and the device fills it in from k-1's outputs (carry-over). The
scheduler fills it on the host when k-1's outputs arrive. Because both modes run this
same schedule, they build identical batches and so produce identical tokens.

Speculative steps (spec.py drafts, the engine runs them with no batch in flight): a decoding
sequence also computes its draft tokens and samples one row per position. The rows are sampled
as plain decoding would sample them (the noise is keyed by position), so a draft is accepted
while it equals the row sampled before it; the first mismatch is replaced by that row's token,
and the KV of the rest is dropped (its pages freed). Stops apply token by token.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from .kv_cache import KVCacheManager, PageAllocator
from .request import PLACEHOLDER, Request, Sequence, Status


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new: int        # tokens computed this step, from `start`
    num_samples: int    # logits rows sampled: 0 (mid-prefill), 1, n (a group's prefill ends) or 1 + drafts
    start: int = 0      # seq.num_computed before this step
    num_draft: int = 0  # draft tokens among its last inputs: its rows sample its last 1 + num_draft positions


@dataclass(slots=True)
class SampleTarget:
    """Where one sampled row lands: a placeholder position of a sequence, valid while the
    sequence's epoch (bumped by preemption) is unchanged."""
    seq: Sequence
    pos: int
    epoch: int


@dataclass
class SchedulerOutput:
    items: list[ScheduledSeq]
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) pages
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device page, host page)
    swap_in: list[tuple[int, int]] = field(default_factory=list)   # (host page, device page)
    targets: list[SampleTarget] = field(default_factory=list)    # one per sampled row, in row order
    batch_id: int = 0
    policy_version: int = 0   # weights live on the compute stream when the batch was launched
    num_drafted: int = 0      # draft tokens verified by this step
    num_accepted: int = 0     # of those, accepted (set by update_columns)
    num_unused_rows: int = 0  # rows after a rejected draft or a stop inside a drafted run (set by update_columns)

    @property
    def num_tokens(self) -> int:
        return sum(i.num_new for i in self.items)

    @property
    def num_rows(self) -> int:
        return len(self.targets)


class Scheduler:
    # Adaptive admission (reserve_fraction=None), after SGLang's "new token ratio": the fraction
    # starts at MIN, rises by RAISE (to 1) on every step that preempts and falls back by DECAY (to
    # MIN) on every other step, except while a preempted sequence waits (the pressure is not over).
    # Chosen with a CPU simulation of long-tailed GRPO batches (its R1 case is tests/core/test_admission.py):
    # MIN does most of the work; after a preemption the readmission rule (`_admissible`) already brakes.
    ADAPTIVE_MIN, ADAPTIVE_RAISE, ADAPTIVE_DECAY = 0.1, 0.02, 1e-3

    def __init__(self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: set[int], tokenizer=None,
                 admission_reserve_pages: int = 0, reserve_fraction: Optional[float] = None,
                 preemption_mode: str = "recompute", host_pages: Optional[PageAllocator] = None,
                 swap_page_s: float = 0.0, recompute_token_s: float = 0.0):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.tokenizer = tokenizer
        self.admission_reserve_pages = admission_reserve_pages
        if reserve_fraction is not None and not 0.0 <= reserve_fraction <= 1.0:
            raise ValueError(f"reserve_fraction must be in [0, 1] or None, got {reserve_fraction}")
        # KV-pressure-aware admission: a new request is admitted only if a fraction of the
        # pages it will need at full length (prompt + max_new_tokens, every sample), plus the
        # same fraction of what running sequences still need, fits in the free pages.
        # A float fixes it: 1.0 = never preempt while the KV fits; 0.0 = admit by the next chunk.
        # None adapts it (`admission_fraction`, the ADAPTIVE_* rule above).
        self.reserve_fraction = reserve_fraction
        self.admission_fraction = self.ADAPTIVE_MIN if reserve_fraction is None else reserve_fraction
        # Preemption frees a victim's pages. "recompute": it prefills prompt + tokens again
        # later. "swap": its pages are copied to host pages (`host_pages`) and back before it runs
        # again. "auto": swap where moving its pages out and back (swap_page_s each) costs less
        # than prefilling its tokens (recompute_token_s each). Too few free host pages: recompute.
        if preemption_mode not in ("recompute", "swap", "auto"):
            raise ValueError(f"preemption_mode must be 'recompute', 'swap' or 'auto', got {preemption_mode!r}")
        if preemption_mode != "recompute" and (host_pages is None or host_pages.num_usable < 1):
            raise ValueError(f"preemption_mode={preemption_mode!r} needs host swap space (swap_space_gb > 0)")
        self.preemption_mode = preemption_mode
        self.host_pages = host_pages if preemption_mode != "recompute" else None
        self.swap_page_s, self.recompute_token_s = swap_page_s, recompute_token_s
        self.num_swap_outs = 0
        self.num_swapped_pages = 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        self.num_discarded_tokens = 0   # sampled for a sequence that had already finished
        self.prefix_cache_queries = 0   # tokens of sequences admitted from scratch with the prefix cache on
        self.prefix_cache_hits = 0      # of those, tokens whose KV came from cached pages
        self._next_batch_id = 0
        self._forked_now: set[Sequence] = set()

    # ---- queue -------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request.seqs[0])

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _final_pages(self, seq: Sequence) -> int:
        """Pages this sequence (a not-yet-forked group: all its samples) holds at full length."""
        p = seq.request.params
        total = self.kv.pages_for(min(seq.num_prompt + p.max_new_tokens, self.max_model_len))
        shared = seq.num_prompt // self.kv.page_size          # full prompt pages are shared
        return total + (seq.fork_count - 1) * (total - shared)

    def _outstanding_pages(self) -> int:
        return sum(max(0, self._final_pages(s) - len(s.block_table)) for s in self.running)

    def _admissible(self, seq: Sequence, num_new: int) -> bool:
        reserve = self.admission_reserve_pages if self.running else 0
        if not self.kv.can_append(seq, num_new, reserve):
            return False
        # A preempted sequence comes back only when all it will hold (its recompute and the
        # rest of its generation) fits beside what the running sequences still need. Taken
        # back by its next chunk alone, it is the newest, so the first victim again, often
        # before its recompute is done: a re-preemption loop that can stall long generations.
        f = 1.0 if seq.num_preemptions else self.admission_fraction
        if f == 0.0 or not self.running:
            return True
        need = f * (self._final_pages(seq) - len(seq.block_table) + self._outstanding_pages())
        return need <= self.kv.alloc.num_free

    def _num_seqs_running(self) -> int:
        return sum(s.fork_count for s in self.running)

    def recompute(self, seq: Sequence) -> None:
        """Drop the sequence's KV (on the device, or swapped out to the host); it re-prefills
        prompt + tokens so far (e.g. under new weights)."""
        if seq.status == Status.RUNNING:
            self._preempt(seq)
        elif seq.host_table:
            self.kv.drop_swapped(seq, self.host_pages)
            self._recompute_from_scratch(seq)

    def _recompute_from_scratch(self, seq: Sequence) -> None:
        self.num_recomputed_tokens += seq.num_computed
        seq.num_computed = 0

    def _swaps(self, seq: Sequence) -> bool:
        """Whether preempting `seq` now swaps its pages out instead of dropping them."""
        if self.host_pages is None or seq.fork_count > 1 or not seq.block_table \
                or len(seq.block_table) > self.host_pages.num_free:
            return False          # an unforked group re-prefills one shared prompt: cheap
        return self.preemption_mode == "swap" or \
            len(seq.block_table) * self.swap_page_s < seq.num_computed * self.recompute_token_s

    def _preempt(self, seq: Sequence, out: Optional[SchedulerOutput] = None) -> None:
        """Take the sequence off the device. A token still in flight is dropped (its row is
        ignored) and sampled again later; the counter-keyed RNG makes it the same token.
        Recompute: its pages are freed (its full ones stay cached while nothing needs them,
        so the recompute may find them) and it re-prefills prompt + generated tokens. Swap
        (only while scheduling `out`, whose step copies the pages out first): its KV waits in
        host pages, and it recomputes just its last token to sample the dropped one again."""
        self.running.remove(seq)
        swap = out is not None and self._swaps(seq)
        seq.drop_placeholders()
        if swap:
            self.num_swapped_pages += len(seq.block_table)
            self.num_swap_outs += 1
            self.kv.swap_out(seq, self.host_pages, out.swap_out)
            seq.num_computed = min(seq.num_computed, seq.num_tokens - 1)
        else:
            self.kv.free(seq)
            self._recompute_from_scratch(seq)
        seq.epoch += 1
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ---- one step ----------------------------------------------------------------
    def _length_done(self, seq: Sequence) -> bool:
        """Its last (maybe in-flight) token already reaches a length limit: nothing to schedule."""
        return seq.num_generated >= seq.request.params.max_new_tokens or seq.num_tokens >= self.max_model_len

    def schedule(self, drafts: Optional[dict[Sequence, list[int]]] = None) -> SchedulerOutput:
        """drafts: proposed next tokens of decoding sequences (no token of theirs in flight)."""
        out = SchedulerOutput(items=[], batch_id=self._next_batch_id)
        self._next_batch_id += 1
        budget = self.max_num_batched_tokens
        preempted = False
        self._forked_now = set()     # children forked by this step: they sample with their parent
        i = 0
        # Running sequences first, oldest first; the newest are the preemption victims.
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self._length_done(seq) or seq in self._forked_now:
                i += 1            # nothing to compute, or forked in this very step
                continue
            num_new = min(seq.num_tokens - seq.num_computed, budget)
            draft = self._fit_draft(seq, drafts[seq], budget, out) if drafts and seq in drafts else []
            num_new += len(draft)
            if self.kv.fits_in_place(seq, num_new):     # a decode step inside its last page
                self._add_item(out, seq, num_new, in_place=True, draft=draft)
                budget -= num_new
                i += 1
                continue
            while not self.kv.can_append(seq, num_new):
                if len(self.running) == 1:   # alone and still no room: it can never fit
                    raise RuntimeError(f"{seq} needs more KV pages than the whole cache has")
                victim = self.running[-1]
                self._preempt(victim, out)
                preempted = True
                if victim is seq:
                    break
            if seq.status != Status.RUNNING:
                break
            self._add_item(out, seq, num_new, draft=draft)
            budget -= num_new
            i += 1
        if self.reserve_fraction is None:
            f = self.admission_fraction
            if preempted:
                self.admission_fraction = min(1.0, f + self.ADAPTIVE_RAISE)
            elif not (self.waiting and self.waiting[0].num_preemptions):   # preempted ones wait at the head
                self.admission_fraction = max(self.ADAPTIVE_MIN, f - self.ADAPTIVE_DECAY)
        # Then new (or preempted) sequences, FIFO, while pages, max_num_seqs and budget allow.
        while self.waiting and budget > 0 and not preempted:
            seq = self.waiting[0]
            if self._num_seqs_running() + seq.fork_count + out.num_drafted > self.max_num_seqs:   # rows
                break
            fresh = seq.num_computed == 0 and not seq.host_table
            if fresh:
                self.kv.reuse_prefix(seq)
            num_new = min(seq.num_tokens - seq.num_computed, budget)
            if not self._admissible(seq, num_new):
                if seq.block_table:     # cached pages taken for the check: back (evictable) until admitted
                    self.kv.free(seq)
                    seq.num_computed = 0
                break
            if fresh and self.kv.prefix_caching:
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += seq.num_computed
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            if seq.host_table:       # swapped out: its pages come back before this step's forward
                self.kv.swap_in(seq, self.host_pages, out.swap_in)
            self._add_item(out, seq, num_new)
            budget -= num_new
        return out

    def _fit_draft(self, seq: Sequence, draft: list[int], budget: int, out: SchedulerOutput) -> list[int]:
        """The part of a draft this step can verify: within the token budget, the rows the step's
        buffers hold, the length limits (no row samples past them), and pages that leave one free
        per running sequence (a draft never causes a preemption)."""
        if seq.num_tokens - seq.num_computed != 1:
            return []
        p = seq.request.params
        room = min(budget - 1, self.max_num_seqs - self._num_seqs_running() - out.num_drafted,
                   p.max_new_tokens - seq.num_generated - 1, self.max_model_len - seq.num_tokens - 1)
        draft = draft[:max(room, 0)]
        need = self.kv.pages_needed(seq, 1 + len(draft))
        return draft if need + len(self.running) <= self.kv.alloc.num_free else []

    def _add_item(self, out: SchedulerOutput, seq: Sequence, num_new: int, in_place: bool = False,
                  draft: list[int] = ()) -> None:
        """Commit the step at schedule time: KV pages (none to add when `in_place`),
        num_computed (computed or in flight), and a placeholder for every token the step
        samples (a group forks here). Draft tokens join the sequence's tokens; each drafted
        position is a sampled row too (before the placeholder after them)."""
        if draft:
            seq.token_ids += draft
        if not in_place:
            self.kv.append(seq, num_new, out.copies)
        item = ScheduledSeq(seq, num_new, 0, seq.num_computed, len(draft))
        seq.num_computed += num_new
        if seq.num_computed == seq.num_tokens:
            if draft:
                out.targets += [SampleTarget(seq, pos, seq.epoch) for pos in range(seq.num_tokens - len(draft),
                                                                                  seq.num_tokens)]
                out.num_drafted += len(draft)
            samplers = [seq] + (self._fork(seq) if seq.fork_count > 1 else [])
            for s in samplers:
                s.inflight[s.num_tokens] = (out.batch_id, len(out.targets))
                out.targets.append(SampleTarget(s, s.num_tokens, s.epoch))
                s.token_ids.append(PLACEHOLDER)
            item.num_samples = len(samplers) + len(draft)
        out.items.append(item)

    # ---- outputs -------------------------------------------------------------------
    def update_columns(self, sched: SchedulerOutput, tokens: list[int], logprobs: list[float],
                       processed: list[float], kept: list[float],
                       tops: Optional[list[Optional[dict]]] = None, routed=None) -> list[Request]:
        """Fill the batch's sampled tokens in (one list per field, in row order); return the
        requests that finished with it. routed: the step's expert ids [MoE layers, tokens, k] (numpy),
        recorded first for the sequences that asked, so a request finishing here has its last rows."""
        assert len(tokens) == len(sched.targets), (len(tokens), len(sched.targets))
        if routed is not None:
            offset = 0
            for item in sched.items:
                if item.seq.request.params.return_routed_experts:
                    item.seq.record_routing(item.start, routed[:, offset:offset + item.num_new])
                offset += item.num_new
        finished: list[Request] = []
        running, version = Status.RUNNING, sched.policy_version
        cut: set[Sequence] = set()      # its drafted run ended in this batch: its later rows go unused
        for i, t in enumerate(sched.targets):
            s, pos = t.seq, t.pos
            if s in cut:
                sched.num_unused_rows += 1
                continue
            if s.status is not running or s.epoch != t.epoch:
                # Finished (or aborted, or preempted) after this batch was scheduled: the
                # extra token is discarded and never reaches the output.
                self.num_discarded_tokens += 1
                continue
            draft = s.token_ids[pos]      # PLACEHOLDER, or the draft token this row verifies
            if draft == PLACEHOLDER:
                del s.inflight[pos]
            else:
                assert sched.num_drafted, "a known token where a sampled one lands"
            s.policy_versions.append(version)
            s.token_ids[pos] = tokens[i]
            s.logprobs.append(logprobs[i])
            s.processed_logprobs.append(processed[i])
            s.kept_mass.append(kept[i])
            if tops is not None and tops[i] is not None:
                s.top_logprobs.append(tops[i])
            reason = self._stop_reason(s, pos)
            if draft != PLACEHOLDER:
                sched.num_accepted += draft == tokens[i]
                if draft != tokens[i] or reason is not None:
                    self._roll_back(s, pos)
                    cut.add(s)
            if reason is not None:
                del s.token_ids[pos + 1:]          # a later token may already be in flight
                self.finish(s, *reason)
                if s.request.finished:
                    finished.append(s.request)
        return finished

    def _roll_back(self, seq: Sequence, pos: int) -> None:
        """Its sampled token at `pos` ends the step's run: the later drafts, the placeholder after
        them and their KV go (pages past the next write freed)."""
        del seq.token_ids[pos + 1:]
        seq.inflight.clear()      # a drafted run's step has no other token in flight
        seq.num_computed = pos
        keep = self.kv.pages_for(pos + 1)
        if len(seq.block_table) > keep:     # pages only rejected drafts wrote (never cached: not yet full)
            for page in seq.block_table[keep:]:
                self.kv.alloc.decref(page)
            del seq.block_table[keep:]
            seq.table_version += 1

    def _fork(self, parent: Sequence) -> list[Sequence]:
        req = parent.request
        children = []
        for k in range(1, parent.fork_count):
            child = Sequence(req, k, list(parent.token_ids), parent.num_prompt)
            child.epoch = parent.epoch
            child.num_computed = parent.num_computed
            child.status = Status.RUNNING
            self.kv.fork(parent, child)
            children.append(child)
        parent.fork_count = 1
        req.seqs.extend(children)
        self._forked_now.update(children)
        pos = self.running.index(parent) + 1
        self.running[pos:pos] = children
        return children

    def _stop_reason(self, seq: Sequence, pos: int):
        p = seq.request.params
        tok = seq.token_ids[pos]
        if tok in p.stop_token_ids:
            return "stop", tok
        if not p.ignore_eos and tok in self.eos_token_ids:
            return "stop", tok
        num_generated = pos + 1 - seq.num_prompt
        if p.stop and self.tokenizer is not None:
            generated = seq.token_ids[seq.num_prompt:pos + 1]   # copied only when stop strings are set
            # Decode only a tail window: enough tokens to cover the longest stop string.
            window = max(len(s) for s in p.stop) + 8
            tail = self.tokenizer.decode(generated[-window:], skip_special_tokens=True)
            for s in p.stop:
                if s in tail:
                    text = self.tokenizer.decode(generated, skip_special_tokens=True)
                    cut = text.find(s)
                    seq.final_text = text[:cut] if cut >= 0 else text
                    return "stop", s
        if num_generated >= p.max_new_tokens or pos + 1 >= self.max_model_len:
            return "length", None
        return None

    def finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        seq.drop_placeholders()
        seq.inflight.clear()
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        seq.status = Status.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        self.kv.free(seq)

    def abort_request(self, req: Request, reason: str = "abort") -> None:
        """Finish every unfinished sequence of the request now (reason "abort" or "stale")."""
        for seq in req.seqs:
            if seq.finished:
                continue
            if seq in self.waiting:
                self.waiting.remove(seq)
            if seq.host_table:
                self.kv.drop_swapped(seq, self.host_pages)
            if seq.fork_count > 1:   # never forked: materialise the missing samples
                seq.fork_count = 1
                for k in range(1, req.params.n):
                    c = Sequence(req, k, list(seq.token_ids), seq.num_prompt)
                    c.finish_reason, c.status = reason, Status.FINISHED
                    req.seqs.append(c)
            self.finish(seq, reason)
