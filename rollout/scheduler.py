"""Continuous-batching scheduler (CPU): admission by free KV pages under a per-step
token budget, chunked prefill, preemption by recompute, and output processing
(appending sampled tokens, stop checks, freeing pages).

One step = a list of (sequence, tokens to compute, rows to sample). Decodes are
just sequences with one token left to compute, so prefill chunks and decodes mix.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from .kv_cache import KVCacheManager
from .request import Request, Sequence, Status


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new: int        # tokens computed this step, from seq.num_computed
    num_samples: int    # logits rows sampled: 0 (mid-prefill), 1, or n (a group's prefill ends)


@dataclass
class SchedulerOutput:
    items: list[ScheduledSeq]
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) pages

    @property
    def num_tokens(self) -> int:
        return sum(i.num_new for i in self.items)

    @property
    def num_rows(self) -> int:
        return sum(i.num_samples for i in self.items)


@dataclass
class SampledRow:
    token_id: int
    logprob: float
    processed_logprob: float
    kept_mass: float
    top: Optional[dict[int, float]] = None


class Scheduler:
    def __init__(self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: set[int], tokenizer=None,
                 admission_reserve_pages: int = 0):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.tokenizer = tokenizer
        self.admission_reserve_pages = admission_reserve_pages
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0

    # ---- queue -------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request.seqs[0])

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _slots_used(self) -> int:
        return sum(s.fork_count for s in self.running)

    def _preempt(self, seq: Sequence) -> None:
        """Free the sequence's pages; it re-prefills prompt + generated tokens later."""
        self.running.remove(seq)
        self.kv.free(seq)
        self.num_recomputed_tokens += seq.num_computed
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ---- one step ----------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(items=[])
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        # Running sequences first, oldest first; the newest are the preemption victims.
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed, budget)
            while not self.kv.can_append(seq, num_new):
                if len(self.running) == 1:   # alone and still no room: it can never fit
                    raise RuntimeError(f"{seq} needs more KV pages than the whole cache has")
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status != Status.RUNNING:
                break
            self._add_item(out, seq, num_new)
            budget -= num_new
            i += 1
        # Then new (or preempted) sequences, FIFO, while pages, slots and budget allow.
        while self.waiting and budget > 0 and not preempted:
            seq = self.waiting[0]
            if self._slots_used() + seq.fork_count > self.max_num_seqs:
                break
            num_new = min(seq.num_tokens - seq.num_computed, budget)
            reserve = self.admission_reserve_pages if self.running else 0
            if not self.kv.can_append(seq, num_new, reserve):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            self._add_item(out, seq, num_new)
            budget -= num_new
        return out

    def _add_item(self, out: SchedulerOutput, seq: Sequence, num_new: int) -> None:
        self.kv.append(seq, num_new, out.copies)
        ends = seq.num_computed + num_new == seq.num_tokens
        out.items.append(ScheduledSeq(seq, num_new, seq.fork_count if ends else 0))

    # ---- outputs -------------------------------------------------------------------
    def update(self, sched: SchedulerOutput, rows: list[SampledRow]) -> list[Request]:
        """Append the step's sampled tokens; return requests that finished this step."""
        finished: list[Request] = []
        r = 0
        for item in sched.items:
            seq = item.seq
            if seq.status != Status.RUNNING:   # aborted while in flight
                r += item.num_samples
                continue
            seq.num_computed += item.num_new
            if item.num_samples == 0:
                continue
            targets = [seq] + (self._fork(seq) if seq.fork_count > 1 else [])
            for s in targets:
                self._append(s, rows[r])
                r += 1
                if s.finished and s.request.finished:
                    finished.append(s.request)
        assert r == len(rows), (r, len(rows))
        return finished

    def _fork(self, parent: Sequence) -> list[Sequence]:
        req = parent.request
        children = []
        for k in range(1, parent.fork_count):
            child = Sequence(req, k, list(parent.token_ids), parent.num_prompt)
            child.num_computed = parent.num_computed
            child.status = Status.RUNNING
            self.kv.fork(parent, child)
            children.append(child)
        parent.fork_count = 1
        req.seqs.extend(children)
        pos = self.running.index(parent) + 1
        self.running[pos:pos] = children
        return children

    def _append(self, seq: Sequence, row: SampledRow) -> None:
        seq.token_ids.append(row.token_id)
        seq.logprobs.append(row.logprob)
        seq.processed_logprobs.append(row.processed_logprob)
        seq.kept_mass.append(row.kept_mass)
        if row.top is not None:
            seq.top_logprobs.append(row.top)
        reason = self._stop_reason(seq, row.token_id)
        if reason is not None:
            self.finish(seq, *reason)

    def _stop_reason(self, seq: Sequence, tok: int):
        p = seq.request.params
        if tok in p.stop_token_ids:
            return "stop", tok
        if not p.ignore_eos and tok in self.eos_token_ids:
            return "stop", tok
        if p.stop and self.tokenizer is not None:
            # Decode only a tail window: enough tokens to cover the longest stop string.
            window = max(len(s) for s in p.stop) + 8
            tail = self.tokenizer.decode(seq.generated_ids[-window:], skip_special_tokens=True)
            for s in p.stop:
                if s in tail:
                    text = self.tokenizer.decode(seq.generated_ids, skip_special_tokens=True)
                    cut = text.find(s)
                    seq.final_text = text[:cut] if cut >= 0 else text
                    return "stop", s
        if seq.num_generated >= p.max_new_tokens or seq.num_tokens >= self.max_model_len:
            return "length", None
        return None

    def finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        seq.status = Status.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        self.kv.free(seq)

    def abort_request(self, req: Request) -> None:
        """Finish every unfinished sequence of the request with reason "abort"."""
        for seq in req.seqs:
            if seq.finished:
                continue
            if seq in self.waiting:
                self.waiting.remove(seq)
            if seq.fork_count > 1:   # never forked: materialise the missing samples
                seq.fork_count = 1
                for k in range(1, req.params.n):
                    c = Sequence(req, k, list(seq.token_ids), seq.num_prompt)
                    c.finish_reason, c.status = "abort", Status.FINISHED
                    req.seqs.append(c)
            self.finish(seq, "abort")
