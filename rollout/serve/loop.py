"""EngineLoop: the one thread that owns a RolloutWorker.

HTTP handlers never touch the engine: they enqueue a command (a callable run between two steps) and
await its future, or read what the loop puts on their request's asyncio queue:
    ("added", engine_ids) | ("error", exc) | ("delta", prompt_index, sample_index, Delta) | ("done", prompt_index, out)
The loop runs `worker.step()` while there is work and it is not paused, then hands the step's outputs
and stream deltas to the event loop in one `call_soon_threadsafe`.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

log = logging.getLogger(__name__)


class Delta(NamedTuple):          # tokens of one sample since the last delta
    token_ids: list
    logprobs: list
    processed_logprobs: list
    top_logprobs: Optional[list]
    policy_versions: list


@dataclass
class _Job:                       # one engine request (a prompt with its n samples)
    tag: str                      # the HTTP request's id
    index: int                    # prompt index within the HTTP request
    queue: asyncio.Queue
    stream_interval: int          # 0: no deltas; else one every this many tokens (the first at once)
    samples: int = 1              # n: each sample's first token goes out at once
    sent: dict = field(default_factory=dict)   # sample index -> tokens already pushed
    due: int = 0                  # loop step from which a sample may hold stream_interval unpushed tokens


def _settle(fut: asyncio.Future, result, exc) -> None:
    if not fut.done():
        fut.set_exception(exc) if exc is not None else fut.set_result(result)


def _deliver(items) -> None:
    for q, item in items:
        q.put_nowait(item)


class EngineLoop:
    def __init__(self, worker):
        self.worker, self.engine = worker, worker.engine
        self.aloop: Optional[asyncio.AbstractEventLoop] = None   # the server's event loop
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: dict[int, _Job] = {}
        self._streams: dict[int, _Job] = {}
        self._tags: dict[str, set[int]] = {}       # HTTP request id -> its unfinished engine ids
        self._aborted: set[str] = set()            # tags aborted while held
        self._held: list[tuple] = []               # adds that arrived while a pause(wait) drains
        self._outbox: list[tuple] = []             # (queue, item), delivered once per step
        self._pause_waiters: list[asyncio.Future] = []
        self.paused = self._holding = self._stop = False
        self.accepted = 0                          # prompts accepted (written by the event loop only)
        self.finished = 0                          # prompts answered (written by this thread only)
        self.running_requests = 0                  # published by this thread
        self.prompt_tokens = 0
        self.steps = 0                             # engine steps run by this loop
        self.thread = threading.Thread(target=self._run, name="rollout-engine-loop", daemon=True)

    # ---- called from the event loop --------------------------------------------------------------
    def start(self) -> None:
        self.aloop = asyncio.get_running_loop()
        self.thread.start()

    def call(self, fn: Callable) -> asyncio.Future:
        """Run fn() on the engine thread between steps; a future of its result."""
        fut = self.aloop.create_future()
        self._commands.put((fn, fut))
        return fut

    def post(self, fn: Callable) -> None:
        """Fire and forget (safe from a cancelled task or any thread)."""
        self._commands.put((fn, None))

    def waiting_requests(self) -> int:
        return self.accepted - self.finished - self.running_requests

    def add(self, tag: str, prompts: list[list[int]], params: list, q: asyncio.Queue, stream_interval: int = 0):
        self.accepted += len(prompts)
        self.post(lambda: self._add(tag, prompts, params, q, stream_interval))

    def abort(self, tag: str) -> None:
        self.post(lambda: self.abort_tag(tag))

    def pause(self, mode: str) -> asyncio.Future:
        """keep: stop stepping (the batch in flight lands first); abort: also finish every request
        now with its partial output; wait: admit nothing new, pause once the running ones finish.
        Resolves to True once paused, False if a resume came first."""
        fut = self.aloop.create_future()
        self.post(lambda: self._pause(mode, fut))
        return fut

    def stop(self, timeout: float = 30.0) -> None:
        self._stop = True
        self.post(lambda: None)           # wake the thread
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise RuntimeError("the engine loop did not stop within the timeout")

    # ---- engine thread ---------------------------------------------------------------------------
    def _flush(self) -> None:
        items, self._outbox = self._outbox, []
        if items:
            with contextlib.suppress(RuntimeError):      # the event loop is closed: nobody is listening
                self.aloop.call_soon_threadsafe(_deliver, items)

    def _answer(self, fut, result, exc=None) -> None:
        self._flush()                     # outputs first, then what was waiting on them
        self.aloop.call_soon_threadsafe(_settle, fut, result, exc)

    def _add(self, tag, prompts, params, q, stream_interval) -> None:
        if self._holding:
            self._held.append((tag, prompts, params, q, stream_interval))
            return
        try:
            if tag in self._tags:
                raise ValueError(f"request_id {tag!r} is already in use by a running request")
            ids = self.worker.add_requests(prompts, params)
        except Exception as exc:          # validation (a 400) or worse (a 503): nothing was queued
            self.finished += len(prompts)
            self._outbox.append((q, ("error", exc)))
            return
        self.prompt_tokens += sum(len(p) for p in prompts)
        self._tags[tag] = set(ids)
        for i, rid in enumerate(ids):
            self._jobs[rid] = job = _Job(tag, i, q, stream_interval, params[i].n)
            if stream_interval:
                self._streams[rid] = job
        self._outbox.append((q, ("added", ids)))
        if tag in self._aborted:
            self.abort_tag(tag)

    def abort_tag(self, tag: str) -> list[int]:     # on the engine thread; returns the engine ids aborted
        ids = sorted(self._tags.get(tag, ()))
        if not ids and any(h[0] == tag for h in self._held):
            self._aborted.add(tag)        # answered as aborted once it is added
        self._finish(self.engine.abort(ids))
        return ids

    def abort_all(self) -> None:
        self._finish(self.engine.drain())
        self._finish(self.engine.abort(list(self.engine.requests)))

    def _finish(self, outs) -> None:
        for out in outs:
            job = self._jobs.pop(out.request_id, None)
            self._streams.pop(out.request_id, None)
            if job is None:
                continue
            self.finished += 1
            left = self._tags.get(job.tag)
            if left is not None:
                left.discard(out.request_id)
                if not left:
                    del self._tags[job.tag]
                    self._aborted.discard(job.tag)
            self._outbox.append((job.queue, ("done", job.index, out)))

    def _push_deltas(self) -> None:
        """Each sample's new tokens once it has stream_interval of them (its first token at once).
        A step adds at most one token per sample, so a job is looked at again only once it can be
        due: per-step progress() calls over every stream would cost the engine thread ~1 ms a step."""
        for rid, job in self._streams.items():
            if self.steps < job.due:
                continue
            out = self.engine.progress(rid, since=job.sent)
            if out is None:
                continue
            most = 0                                      # unpushed tokens left in any sample
            for i, c in enumerate(out.completions):       # in sample order
                new, sent = len(c.token_ids), job.sent.get(i, 0)
                if new and (new >= job.stream_interval or sent == 0):
                    self._outbox.append((job.queue, ("delta", job.index, i, Delta(
                        c.token_ids, c.logprobs, c.processed_logprobs, c.top_logprobs, c.policy_versions))))
                    job.sent[i], new = sent + new, 0
                most = max(most, new)
            if len(job.sent) == job.samples:              # until each sample's first token: every step
                job.due = self.steps + job.stream_interval - most

    def _pause(self, mode: str, fut) -> None:
        if mode == "wait" and not self.paused:
            self._holding = True
            self._pause_waiters.append(fut)
            self._check_drained()
            return
        self._finish(self.engine.drain())
        if mode == "abort":
            self.abort_all()
        self._push_deltas()
        self.paused = True
        self._answer(fut, True)

    def _release(self, paused: bool) -> None:
        self._holding = False
        for fut in self._pause_waiters:
            self._answer(fut, paused)
        self._pause_waiters = []
        held, self._held = self._held, []
        for h in held:                    # validated and queued now; stepped once not paused
            self._add(*h)

    def _check_drained(self) -> None:
        if self._holding and not self.engine.requests:
            self.paused = True
            self._release(True)

    def resume(self) -> None:             # a command: run on the engine thread
        self.paused = False
        if self._holding:                 # resumed before a pause(wait) finished draining
            self._release(False)

    def _busy(self) -> bool:
        return not self.paused and (self.engine.has_unfinished() or self.worker.weights.pending is not None)

    def _run_command(self, fn, fut) -> None:
        try:
            result, exc = fn(), None
        except Exception as e:            # handed to the awaiting handler (ValueError -> 400)
            result, exc = None, e
            if fut is None:
                log.exception("engine-loop command failed")
        if fut is not None:
            self._answer(fut, result, exc)

    def _run(self) -> None:
        while not self._stop:
            block = not self._busy()
            while True:                   # no reference kept past its run (IPC tensors are the trainer's)
                try:
                    self._run_command(*self._commands.get(block=block, timeout=1.0 if block else None))
                except queue.Empty:
                    break
                block = False
            if self._stop:
                break
            if self._busy():
                try:
                    self.steps += 1
                    self._finish(self.worker.step())
                except Exception:         # answer everything in flight; keep serving
                    log.exception("engine step failed; finishing its requests with finish_reason 'error'")
                    self._finish(self.engine.abort(list(self.engine.requests), reason="error"))
                self._push_deltas()
                self._check_drained()
            self.running_requests = len({s.request.request_id for s in self.engine.scheduler.running})
            self._flush()
        self._shutdown()

    def fail_pending(self) -> None:
        """Answer everything now: running requests with their partial outputs, held ones with an error."""
        try:
            self.abort_all()
        finally:
            for h in self._held:
                self._outbox.append((h[3], ("error", RuntimeError("the server is shutting down"))))
            self._held, self._holding = [], False
            self._flush()

    def _shutdown(self) -> None:
        self._holding = False
        while not self._commands.empty():     # commands already queued run (adds are answered below)
            self._run_command(*self._commands.get_nowait())
        self.fail_pending()
