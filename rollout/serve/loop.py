"""The engine loop and its HTTP-side handle.

EngineLoop, on the engine side, is the one thread that owns a RolloutWorker: it runs `worker.step()`
while there is work and it is not paused, and between steps the commands it is sent, by name:
    (name, args, token)       token: None for fire-and-forget, else a reply is due
It answers with batches of messages, once per step (`send(batch)`), in order:
    ("event", tag, item)      item: ("added", engine_ids) | ("error", exc) | ("delta", prompt_index,
                              sample_index, Delta) | ("done", prompt_index, RequestOutput) | ("end",)
                              after a request's last "done"
    ("reply", token, result, exc)
    ("state", finished, running_requests, policy_version, paused)     last in every batch
LoopClient, on the HTTP side, turns those into asyncio futures and per-request queues. The two meet
either in one process (`LocalLoop`: the loop is a thread beside the event loop) or across a pipe
(`rollout.serve.remote`: the loop has a process, and a GIL, of its own).
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

from . import transfer

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
    stream_interval: int          # 0: no deltas; else one every this many tokens (the first at once)
    samples: int = 1              # n: each sample's first token goes out at once
    sent: dict = field(default_factory=dict)   # sample index -> tokens already pushed
    due: int = 0                  # loop step from which a sample may hold stream_interval unpushed tokens


# commands that wait on I/O, a collective or a device copy: they run on a helper thread of the engine
# side and touch the worker only through _on_engine, so decode goes on meanwhile
_BLOCKING = ("stage_disk", "stage_ipc", "join_group", "stage_group")
_COMMANDS = ("add", "abort_tag", "pause", "resume", "fail_pending", "info", "metric_rows", "weights_info",
             "sleep", "wake", "sleep_level") + _BLOCKING


class EngineLoop:
    def __init__(self, worker, send: Callable[[list], None]):
        self.worker, self.engine = worker, worker.engine
        self.send = send                           # delivers one batch of messages to the HTTP side
        self.commands: queue.SimpleQueue = queue.SimpleQueue()   # (name, args, token), from any thread
        self._jobs: dict[int, _Job] = {}
        self._streams: dict[int, _Job] = {}
        self._tags: dict[str, set[int]] = {}       # HTTP request id -> its unfinished engine ids
        self._aborted: set[str] = set()            # tags aborted while held
        self._held: list[tuple] = []               # adds that arrived while a pause(wait) drains
        self._outbox: list[tuple] = []             # messages, sent once per step
        self._pause_waiters: list = []             # reply tokens
        self._group_lock = threading.Lock()        # one weight-group join or receive at a time
        self.paused = self._holding = self._stop = False
        self.finished = 0                          # prompts answered
        self.running_requests = 0
        self.prompt_tokens = 0
        self.steps = 0                             # engine steps run by this loop

    # ---- the commands ------------------------------------------------------------------------------
    def add(self, tag, prompts, params, stream_interval) -> None:
        if self._holding:
            self._held.append((tag, prompts, params, stream_interval))
            return
        try:
            if tag in self._tags:
                raise ValueError(f"request_id {tag!r} is already in use by a running request")
            ids = self.worker.add_requests(prompts, params)
        except Exception as exc:          # validation (a 400) or worse (a 503): nothing was queued
            self.finished += len(prompts)
            self._outbox.append(("event", tag, ("error", exc)))
            return
        self.prompt_tokens += sum(len(p) for p in prompts)
        self._tags[tag] = set(ids)
        for i, rid in enumerate(ids):
            self._jobs[rid] = job = _Job(tag, i, stream_interval, params[i].n)
            if stream_interval:
                self._streams[rid] = job
        self._outbox.append(("event", tag, ("added", ids)))
        if tag in self._aborted:
            self.abort_tag(tag)

    def abort_tag(self, tag: str) -> list[int]:     # returns the engine ids aborted
        ids = sorted(self._tags.get(tag, ()))
        if not ids and any(h[0] == tag for h in self._held):
            self._aborted.add(tag)        # answered as aborted once it is added
        self._finish(self.engine.abort(ids))
        return ids

    def pause(self, mode: str, token) -> None:
        """keep: stop stepping (the batch in flight lands first); abort: also finish every request now
        with its partial output; wait: admit nothing new, pause once the running ones finish. Answers
        True once paused, False if a resume came first."""
        if mode == "wait" and not self.paused:
            self._holding = True
            self._pause_waiters.append(token)
            self._check_drained()
            return
        self._finish(self.engine.drain())
        if mode == "abort":
            self._abort_all()
        self._push_deltas()
        self.paused = True
        self._reply(token, True)

    def resume(self) -> None:
        self.paused = False
        if self._holding:                 # resumed before a pause(wait) finished draining
            self._release(False)

    def fail_pending(self) -> None:
        """Answer everything now: running requests with their partial outputs, held ones with an error."""
        try:
            self._abort_all()
        finally:
            for h in self._held:
                self._outbox.append(("event", h[0], ("error", RuntimeError("the server is shutting down"))))
            self._held, self._holding = [], False
            self._flush()

    def info(self) -> dict:               # what the HTTP side needs once, at start-up
        e = self.engine
        return {"max_model_len": e.max_model_len, "vocab_size": e.vocab_size, "device_type": e.device.type,
                "tokenizer": e.tokenizer, "tensor_specs": {n: {"shape": list(t.shape),
                                                               "dtype": str(t.dtype).removeprefix("torch.")}
                                                           for n, t in self.worker.weights.targets.items()}}

    def metric_rows(self) -> list:        # one consistent view between steps
        s = self.worker.stats()
        return [("generation_tokens_total", s["generated_tokens"]), ("prompt_tokens_total", self.prompt_tokens),
                ("prefill_tokens_total", s["prefill_tokens"]), ("requests_running", self.running_requests),
                ("kv_cache_usage", s["kv_pages_used"] / max(1, s["kv_pages_total"])),
                ("kv_pages_used", s["kv_pages_used"]), ("kv_pages_total", s["kv_pages_total"]),
                ("policy_version", s["policy_version"]), ("weight_updates_total", s["weights/updates"]),
                ("weight_barrier_ms_total", s["weights/barrier_ms"]), ("paused", int(self.paused)),
                ("weight_staging_ms_total", s["weights/staging_ms"]), ("preemptions_total", s["preemptions"]),
                ("weight_barrier_launch_ms", s.get("weights/barrier_launch_ms", 0)),
                # tokens of sequences admitted from scratch, and of them those served from cached KV (rate() both)
                ("prefix_cache_queried_tokens_total", s["prefix_cache_queries"]),
                ("prefix_cache_hit_tokens_total", s["prefix_cache_hit_tokens"]),
                ("prefix_cache_pages", s["prefix_cache_pages"])]

    def weights_info(self) -> dict:
        pending = self.worker.weights.pending
        return {"live_version": self.worker.policy_version,
                "staged_version": pending.version if pending is not None else None}

    def sleep(self, level: int, discard_weights: bool) -> dict:
        return self.worker.sleep(level, discard_weights)

    def wake(self, tags) -> dict:
        return self.worker.wake(tags)

    def sleep_level(self) -> int:
        return self.engine.sleep_level

    # blocking commands (on a helper thread) ------------------------------------------------------
    def _stage(self, items: list, version: int, adopt: bool) -> dict:
        """Copies launched between steps, waited for and checked off the engine thread (decode goes on:
        the wait is the whole staging copy), then installed to go live at the next batch boundary. The
        sources are dropped before the install, a few at a time (their release must not hold the GIL
        while the engine thread launches the commit)."""
        staged = self._on_engine(lambda: self.worker.prepare_update(items, version, adopt))
        self.worker.weights.check_finite(staged)          # the staging copies are done
        transfer.release_gradually(items)
        self._on_engine(lambda: self.worker.install_update(staged))
        return {"staged_version": version, "live_version": self.worker.policy_version}

    def stage_disk(self, path: str, version: int) -> dict:
        items = transfer.read_safetensors(path, self.worker.weights.targets)
        return self._stage(items, version, adopt=self.engine.device.type == "cpu")

    def stage_ipc(self, handles_b64: str, version: int) -> dict:
        return self._stage(transfer.load_ipc_handles(handles_b64, self.engine.device), version, adopt=False)

    def join_group(self, master_address, master_port, world_size, rank_offset, backend, timeout_s) -> dict:
        backend = backend or ("nccl" if self.engine.device.type == "cuda" else "gloo")
        with self._group_lock:
            transfer.join_group(master_address, master_port, world_size, rank_offset, backend, timeout_s)
        return {"backend": backend, "rank": rank_offset, "world_size": world_size}

    def stage_group(self, version: int, bucket_bytes: int) -> dict:
        with self._group_lock:
            items = transfer.receive_group(self.engine.device, bucket_bytes)
        return self._stage(items, version, adopt=True)

    def _on_engine(self, fn: Callable):
        """From a helper thread: run fn() on the engine thread between steps and return its result."""
        fut: Future = Future()
        self.commands.put(("_local", (fn, fut), None))
        return fut.result()

    def _helper(self, name: str, args, token) -> None:
        try:
            result, exc = getattr(self, name)(*args), None
        except Exception as e:            # answered to the caller (ValueError -> 400)
            result, exc = None, e
        self.commands.put(("_reply", (token, result, exc), None))

    # ---- the engine thread ---------------------------------------------------------------------------
    def _flush(self) -> None:
        items, self._outbox = self._outbox, []
        items.append(("state", self.finished, self.running_requests, self.worker.policy_version, self.paused))
        self.send(items)

    def _reply(self, token, result, exc=None) -> None:
        self._outbox.append(("reply", token, result, exc))    # after the outputs it may be waiting on
        self._flush()

    def _abort_all(self) -> None:
        self._finish(self.engine.drain())
        self._finish(self.engine.abort(list(self.engine.requests)))

    def _finish(self, outs) -> None:
        for out in outs:
            job = self._jobs.pop(out.request_id, None)
            self._streams.pop(out.request_id, None)
            if job is None:
                continue
            self.finished += 1
            self._outbox.append(("event", job.tag, ("done", job.index, out)))
            left = self._tags.get(job.tag)
            if left is not None:
                left.discard(out.request_id)
                if not left:
                    del self._tags[job.tag]
                    self._aborted.discard(job.tag)
                    self._outbox.append(("event", job.tag, ("end",)))

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
                    self._outbox.append(("event", job.tag, ("delta", job.index, i, Delta(
                        c.token_ids, c.logprobs, c.processed_logprobs, c.top_logprobs, c.policy_versions))))
                    job.sent[i], new = sent + new, 0
                most = max(most, new)
            if len(job.sent) == job.samples:              # until each sample's first token: every step
                job.due = self.steps + job.stream_interval - most

    def _release(self, paused: bool) -> None:
        self._holding = False
        for token in self._pause_waiters:
            self._reply(token, paused)
        self._pause_waiters = []
        held, self._held = self._held, []
        for h in held:                    # validated and queued now; stepped once not paused
            self.add(*h)

    def _check_drained(self) -> None:
        if self._holding and not self.engine.requests:
            self.paused = True
            self._release(True)

    def _busy(self) -> bool:
        return not self.paused and (self.engine.has_unfinished() or self.worker.weights.pending is not None)

    def _run_command(self, name: str, args, token) -> None:
        if name == "_local":              # a helper thread's critical section
            fn, fut = args
            try:
                fut.set_result(fn())
            except BaseException as e:
                fut.set_exception(e)
            return
        if name == "_reply":
            self._reply(*args)
            return
        if name == "stop":
            self._stop = True
            return
        if name not in _COMMANDS:
            result, exc = None, ValueError(f"unknown engine command {name!r}")
        elif name in _BLOCKING:
            threading.Thread(target=self._helper, args=(name, args, token), name=f"rollout-{name}", daemon=True).start()
            return
        elif name == "pause":
            return self.pause(*args, token)
        else:
            try:
                result, exc = getattr(self, name)(*args), None
            except Exception as e:        # handed to the awaiting handler (ValueError -> 400)
                result, exc = None, e
                if token is None:
                    log.exception("engine-loop command %s failed", name)
        if token is not None:
            self._reply(token, result, exc)

    def run(self) -> None:
        """The loop: until a "stop" command, then every request is answered."""
        while not self._stop:
            block = not self._busy()
            while True:
                try:
                    self._run_command(*self.commands.get(block=block, timeout=1.0 if block else None))
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
            if self._outbox or self.steps % 64 == 0:      # the state stamp goes out at least this often
                self._flush()
        self._holding = False
        while not self.commands.empty():      # commands already queued run (adds are answered below)
            self._run_command(*self.commands.get_nowait())
        self.fail_pending()


class LoopClient:
    """The HTTP side of an EngineLoop: commands out through `submit((name, args, token))`, message
    batches in through `receive` (on the event loop). Every method but post() runs on the event loop."""

    def __init__(self, submit: Callable[[tuple], None], alive: Callable[[], bool]):
        self.submit, self.alive = submit, alive
        self.aloop: Optional[asyncio.AbstractEventLoop] = None
        self._tokens = itertools.count()
        self._futures: dict[int, asyncio.Future] = {}
        self._queues: dict[str, asyncio.Queue] = {}
        self.accepted = 0                 # prompts accepted
        self.finished = self.running_requests = self.policy_version = 0    # the engine's, as of its last batch
        self.paused = False

    def bind(self, aloop: asyncio.AbstractEventLoop) -> None:
        self.aloop = aloop

    def call(self, name: str, *args) -> asyncio.Future:
        """Run the engine loop's command `name(*args)` between two steps; a future of its result."""
        token = next(self._tokens)
        fut = self.aloop.create_future()
        if not self.alive():
            fut.set_exception(RuntimeError("the engine loop is not running"))
            return fut
        self._futures[token] = fut
        self.submit((name, args, token))
        return fut

    def post(self, name: str, *args) -> None:
        """Fire and forget (safe from a cancelled task or any thread)."""
        self.submit((name, args, None))

    def waiting_requests(self) -> int:
        return self.accepted - self.finished - self.running_requests

    def open(self, tag: str) -> asyncio.Queue:
        """The queue of a new HTTP request's events (ValueError if its id is in use); close() it after."""
        if tag in self._queues:
            raise ValueError(f"request_id {tag!r} is already in use by a running request")
        self._queues[tag] = q = asyncio.Queue()
        return q

    def close(self, tag: str) -> None:
        self._queues.pop(tag, None)

    def add(self, tag: str, prompts: list[list[int]], params: list, stream_interval: int = 0) -> None:
        if not self.alive():
            self._queues[tag].put_nowait(("error", RuntimeError("the engine loop is not running")))
            return
        self.accepted += len(prompts)
        self.post("add", tag, prompts, params, stream_interval)

    def abort(self, tag: str) -> None:
        self.post("abort_tag", tag)

    def receive(self, batch: list) -> None:
        for msg in batch:
            if msg[0] == "event":
                if msg[2][0] == "end":    # the request's last output went out: its id is free again, even
                    self._queues.pop(msg[1], None)    # if its handler never ran its cleanup (a stream never begun)
                    continue
                q = self._queues.get(msg[1])
                if q is not None:
                    q.put_nowait(msg[2])
            elif msg[0] == "reply":
                fut = self._futures.pop(msg[1], None)
                if fut is not None and not fut.done():
                    fut.set_exception(msg[3]) if msg[3] is not None else fut.set_result(msg[2])
            else:
                _, self.finished, self.running_requests, self.policy_version, self.paused = msg

    def fail_all(self, exc: BaseException) -> None:
        """The engine side is gone: every waiting handler gets `exc` (nothing waits forever)."""
        for fut in self._futures.values():
            if not fut.done():
                fut.set_exception(exc)
        self._futures.clear()
        for q in self._queues.values():
            q.put_nowait(("error", exc))


class LocalLoop:
    """An EngineLoop on a thread of this process, beside the event loop (the engine stays inspectable)."""

    def __init__(self, worker):
        self.loop = EngineLoop(worker, self._send)
        self.thread = threading.Thread(target=self.loop.run, name="rollout-engine-loop", daemon=True)
        self.client = LoopClient(self.loop.commands.put, self.thread.is_alive)

    def _send(self, batch: list) -> None:
        with contextlib.suppress(RuntimeError):      # the event loop is closed: nobody is listening
            self.client.aloop.call_soon_threadsafe(self.client.receive, batch)

    def start(self, aloop: asyncio.AbstractEventLoop) -> None:
        self.client.bind(aloop)
        self.thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self.client.post("stop")
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise RuntimeError("the engine loop did not stop within the timeout")
