"""EngineLoop: the one thread that owns a RolloutWorker.

HTTP handlers never touch the engine: they enqueue a command (a callable run between two steps)
and await an asyncio future, or read the items the loop puts on their request's asyncio queue:
    ("added", engine_ids) | ("error", exc) | ("delta", prompt_index, sample_index, Delta)
    | ("done", prompt_index, RequestOutput)
The loop runs `worker.step()` (weight commit at the batch boundary, stale policies, one engine
step) while there is work and is not paused, and after each step hands finished outputs and
stream deltas to the asyncio loop in one `call_soon_threadsafe` per step.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import defaultdict
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
    tag: str
    index: int                    # prompt index within the HTTP request
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    stream_interval: int          # 0: no deltas; else push every this many tokens (the first at once)
    sent: dict = field(default_factory=dict)   # sample index -> tokens already pushed


def _settle(fut: asyncio.Future, result, exc) -> None:
    if not fut.done():
        fut.set_exception(exc) if exc is not None else fut.set_result(result)


def _deliver(items) -> None:
    for q, item in items:
        q.put_nowait(item)


class EngineLoop:
    def __init__(self, worker):
        self.worker, self.engine = worker, worker.engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: dict[int, _Job] = {}
        self._streams: dict[int, _Job] = {}
        self._tags: dict[str, set[int]] = {}       # HTTP request id -> its unfinished engine ids
        self._aborted: set[str] = set()            # tags aborted while held
        self._held: list[tuple] = []               # adds that arrived during a pause(wait) drain
        self._outbox: list[tuple] = []
        self._pause_waiters: list[tuple] = []
        self.paused = False
        self._holding = False                      # pause(wait) in progress: admit nothing new
        self._stop = False
        self.accepted = 0                          # prompts accepted (written by the asyncio thread only)
        self.finished = 0                          # prompts answered (written by this thread only)
        self.running_requests = 0                  # published after each step
        self.prompt_tokens = 0
        self.thread = threading.Thread(target=self._run, name="rollout-engine-loop", daemon=True)

    # ---- called from the asyncio thread ------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def call(self, fn: Callable):
        """Run fn() on the engine thread between steps; an awaitable of its result."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._commands.put((fn, loop, fut))
        return fut

    def post(self, fn: Callable) -> None:
        """Fire and forget (safe from a cancelled task or any thread)."""
        self._commands.put((fn, None, None))

    def waiting_requests(self) -> int:
        return self.accepted - self.finished - self.running_requests

    def add(self, tag: str, prompts: list[list[int]], params: list, q: asyncio.Queue, stream_interval: int = 0):
        self.accepted += len(prompts)
        loop = asyncio.get_running_loop()
        self.post(lambda: self._add(tag, prompts, params, loop, q, stream_interval))

    def abort(self, tag: str) -> None:
        self.post(lambda: self._abort_tag(tag))

    def stop(self, timeout: float = 30.0) -> None:
        self._stop = True
        self.post(lambda: None)           # wake the thread
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise RuntimeError("the engine loop did not stop within the timeout")

    # ---- engine thread ----------------------------------------------------------------------
    def _emit(self, job: _Job, item) -> None:
        self._outbox.append((job.loop, job.queue, item))

    def _flush(self) -> None:
        by_loop = defaultdict(list)
        for loop, q, item in self._outbox:
            by_loop[loop].append((q, item))
        self._outbox = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:          # that event loop is closed: nobody is listening
                pass

    def _add(self, tag, prompts, params, loop, q, stream_interval) -> None:
        if self._holding:
            self._held.append((tag, prompts, params, loop, q, stream_interval))
            return
        try:
            if tag in self._tags:
                raise ValueError(f"request_id {tag!r} is already in use by a running request")
            ids = self.worker.add_requests(prompts, params)
        except (ValueError, TypeError) as exc:      # bad input: nothing was queued
            self.finished += len(prompts)
            self._outbox.append((loop, q, ("error", exc)))
            return
        self.prompt_tokens += sum(len(p) for p in prompts)
        self._tags[tag] = set(ids)
        for i, rid in enumerate(ids):
            self._jobs[rid] = job = _Job(tag, i, loop, q, stream_interval)
            if stream_interval:
                self._streams[rid] = job
        self._outbox.append((loop, q, ("added", ids)))
        if tag in self._aborted:
            self._abort_tag(tag)

    def _abort_tag(self, tag: str) -> list[int]:
        ids = sorted(self._tags.get(tag, ()))
        if not ids and any(h[0] == tag for h in self._held):
            self._aborted.add(tag)        # answered as aborted once it is added
        self._finish(self.engine.abort(ids))
        return ids

    def abort_all(self, reason: str = "abort") -> None:
        self._finish(self.engine.drain())
        self._finish(self.engine.abort(list(self.engine.requests), reason=reason))

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
            self._emit(job, ("done", job.index, out))

    def _push_deltas(self) -> None:
        for rid, job in self._streams.items():
            req = self.engine.requests.get(rid)
            if req is None:
                continue
            tops = req.params.top_logprobs
            for s in req.seqs:    # read as it lands: engine.progress() would copy every token each step
                known, sent = len(s.logprobs), job.sent.get(s.sample_index, 0)
                if known > sent and (known - sent >= job.stream_interval or sent == 0):
                    a = s.num_prompt
                    self._emit(job, ("delta", job.index, s.sample_index, Delta(
                        s.token_ids[a + sent:a + known], s.logprobs[sent:known], s.processed_logprobs[sent:known],
                        s.top_logprobs[sent:known] if tops else None, s.policy_versions[sent:known])))
                    job.sent[s.sample_index] = known

    def pause(self, mode: str):
        """keep: stop stepping (the batch in flight lands first); abort: also finish every request
        now with its partial output; wait: admit nothing new, pause once the running ones finish.
        An awaitable that resolves once paused (True), or False if a resume came first."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.post(lambda: self._pause(mode, loop, fut))
        return fut

    def _pause(self, mode: str, loop, fut) -> None:
        if mode == "wait" and not self.paused:
            self._holding = True
            self._pause_waiters.append((loop, fut))
            self._check_drained()
            return
        self._finish(self.engine.drain())
        if mode == "abort":
            self.abort_all()
        self._push_deltas()
        self._flush()
        self.paused = True
        loop.call_soon_threadsafe(_settle, fut, True, None)

    def _release(self, paused: bool) -> None:
        self._holding = False
        self._flush()                     # the last outputs go out before the pause is answered
        for loop, fut in self._pause_waiters:
            loop.call_soon_threadsafe(_settle, fut, paused, None)
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

    def _run_command(self, fn, loop, fut) -> None:
        try:
            result, exc = fn(), None
        except Exception as e:            # handed to the awaiting handler (ValueError -> 400)
            result, exc = None, e
            if fut is None:
                log.exception("engine-loop command failed")
        if fut is not None:
            loop.call_soon_threadsafe(_settle, fut, result, exc)

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
            for _, _, _, loop, q, _ in self._held:
                self._outbox.append((loop, q, ("error", RuntimeError("the server is shutting down"))))
            self._held, self._holding = [], False
            self._flush()

    def _shutdown(self) -> None:
        self._holding = False
        while True:                       # commands already queued run (adds are answered below)
            try:
                self._run_command(*self._commands.get_nowait())
            except queue.Empty:
                break
        self.fail_pending()
