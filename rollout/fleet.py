"""RolloutFleet: N RolloutWorkers as Ray actors behind one driver.

    dispatch   one prompt = one request with its n samples (a GRPO group stays on one worker), to the
               live actor with the lowest `load_key`: the fuller of its KV pages and sequence slots
    collect    `generate` in input order, `stream` in completion order; request_id = prompt index;
               max_inflight bounds the prompts out at once
    weights    the driver is rank 0 of a torch.distributed group, actor i rank i+1; `update_weights`
               broadcasts in buckets (gloo on CPU, NCCL with GPUs) and waits for every commit
    faults     a dead actor's unfinished prompts go to the others (the first result per prompt is
               kept); restart_dead=True gives its slot a fresh actor, used once on the fleet's weight
               version. A prompt the driver drops (a stream closed early) is aborted on its worker

Importing this module imports ray; the single-worker path never does.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from .config import EngineConfig
from .request import RequestOutput, SamplingParams

log = logging.getLogger(__name__)

_ACTOR_DEATH = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


@dataclass
class EngineSpec:
    """How each actor builds its engine: RolloutEngine.from_pretrained(model, config), or
    factory() -> RolloutEngine when given (must be picklable)."""
    model: str | None = None
    config: EngineConfig = field(default_factory=EngineConfig)
    factory: Callable[[], Any] | None = None
    worker_kwargs: dict = field(default_factory=dict)      # RolloutWorker(engine, **worker_kwargs)

    def build(self):
        from .engine import RolloutEngine
        if self.factory is not None:
            return self.factory()
        if self.model is None:
            raise ValueError("EngineSpec needs a model path or a factory")
        return RolloutEngine.from_pretrained(self.model, self.config)


@dataclass
class KVReport:
    """A worker's KV state, taken under the worker lock and sent with every `run` result."""
    seq: int                 # per actor, increasing: the driver keeps the newest it has seen
    used: int                # KV pages in use now
    demand: int              # pages its requests hold at full length (running and waiting); > pages:
                             # new groups wait or preemption follows
    pages: int               # usable pages
    page_size: int
    max_num_seqs: int
    max_model_len: int
    running: int             # sequences running / waiting on the worker
    waiting: int


def group_tokens(prompt, params: SamplingParams | None, max_model_len: int | None = None) -> int:
    """KV tokens a prompt's group holds at full length, as the driver can tell without a tokenizer: the
    prompt once (shared by the n samples) plus n x max_new_tokens, capped by max_model_len; a text
    prompt counts 4 characters a token (until a worker's report replaces the estimate)."""
    p = params if params is not None else SamplingParams()
    plen = len(prompt) // 4 + 1 if isinstance(prompt, (str, bytes)) else len(prompt)
    gen = p.max_new_tokens
    if max_model_len is not None:
        plen = min(plen, max_model_len)
        gen = max(0, min(gen, max_model_len - plen))
    return plen + p.n * gen


def load_key(slot: _Slot, default: KVReport | None) -> tuple[float, float, int, int]:
    """How loaded a slot is, lowest first: (load, kv + seqs, outstanding sequences, index). kv = (reported page
    demand x page_size + tokens sent since) / KV capacity (before an actor's first report: `group_tokens` of its
    groups over `default`'s capacity), seqs = outstanding sequences / max_num_seqs, load = max(kv, seqs)."""
    r = slot.kv if slot.kv is not None else default
    if r is None:
        kv = 0.0
    else:
        tokens = (slot.kv.demand * r.page_size + slot.tokens_since_report if slot.kv is not None
                  else slot.outstanding_tokens)
        kv = tokens / max(r.pages * r.page_size, 1)
    seqs = slot.outstanding / max(r.max_num_seqs if r is not None else 1, 1)
    return (max(kv, seqs), kv + seqs, slot.outstanding, slot.index)


def pick_slot(slots: Sequence[_Slot], exclude=(), default: KVReport | None = None) -> _Slot:
    """The live, weight-synced slot with the lowest `load_key` (one in `exclude` only if no other)."""
    live = [s for s in slots if s.alive and s.synced and s.actor not in exclude]
    if not live:
        live = [s for s in slots if s.alive and s.synced]
    if not live:
        raise RuntimeError("no live rollout workers left in the fleet")
    return min(live, key=lambda s: load_key(s, default))


class _WorkerActor:
    """Ray actor (async; generation runs on the RolloutWorker's background thread)."""

    def __init__(self, spec: EngineSpec, torch_threads: int | None = None):
        if torch_threads:
            torch.set_num_threads(torch_threads)
        from .worker import RolloutWorker
        self.worker = RolloutWorker(spec.build(), **spec.worker_kwargs)
        self.worker.start()
        self._report: KVReport | None = None      # guarded by the worker lock
        self._report_batch = -1

    def _kv_report(self, cached: bool = False) -> KVReport:
        """The worker's KV state (under the worker lock). cached: reuse the one taken after the same step."""
        with self.worker.locked():
            eng = self.worker.engine
            sch, alloc = eng.scheduler, eng.kv.alloc
            batch = sch._next_batch_id
            if cached and self._report is not None and self._report_batch == batch:
                return self._report
            used = alloc.num_used
            demand = used + sch._outstanding_pages() + sum(sch._final_pages(s) for s in sch.waiting)
            seq = self._report.seq + 1 if self._report is not None else 1
            self._report = KVReport(seq, used, demand, alloc.num_usable, eng.kv.page_size, sch.max_num_seqs,
                                    sch.max_model_len, len(sch.running), len(sch.waiting))
            self._report_batch = batch
            return self._report

    async def run(self, prompt, params: SamplingParams | None) -> tuple[RequestOutput, KVReport]:
        """One prompt's RequestOutput and the worker's KV state right after it finished."""
        # on a thread: submit waits for the step in flight, which must not block this actor's event loop
        fut = await asyncio.get_running_loop().run_in_executor(None, self.worker.submit, [prompt], params)
        box: list[KVReport] = []
        # runs on the worker's loop thread as it resolves the future, before wrap_future's callback wakes us
        fut.add_done_callback(lambda f: None if f.cancelled() else box.append(self._kv_report(cached=True)))
        try:
            # shielded: a ray.cancel must not cancel the worker's future (resolving it would kill its loop)
            out = (await asyncio.shield(asyncio.wrap_future(fut)))[0]
        except asyncio.CancelledError:
            await asyncio.get_running_loop().run_in_executor(None, self._abort, fut)
            raise
        return out, (box[0] if box else self._kv_report())

    def _abort(self, fut) -> None:
        """Abort the request behind `fut` (its KV pages are freed; the future gets the partial output)."""
        w = self.worker
        with w.locked():
            ids = [i for f, rids, _ in w._futures.values() if f is fut for i in rids]
            if ids:
                w._resolve(w.engine.abort(ids))

    async def kv_report(self) -> KVReport:
        return await asyncio.get_running_loop().run_in_executor(None, self._kv_report)

    async def policy_version(self) -> int:
        return self.worker.policy_version

    async def stats(self) -> dict:
        st = self.worker.stats()
        st["kv_report"] = await self.kv_report()
        return st

    async def init_weight_group(self, backend: str, addr: str, port: int, rank: int, world_size: int,
                                timeout_s: float = 600.0) -> None:
        from .weights import join_group
        await asyncio.get_running_loop().run_in_executor(None, join_group, backend, addr, port, rank, world_size,
                                                         timeout_s)

    async def receive_weights(self, version: int, bucket_bytes: int) -> None:
        from .weights import receive_weights
        device = self.worker.engine.device
        rx_device = device if device.type == "cuda" else None

        def _recv():
            items = list(receive_weights(src=0, bucket_bytes=bucket_bytes, device=rx_device))
            self.worker.update_weights(items, version, adopt=True)    # the buckets are the staging copy
        await asyncio.get_running_loop().run_in_executor(None, _recv)

    async def wait_version(self, version: int, timeout: float) -> int:
        t0 = time.time()
        while self.worker.policy_version < version and time.time() - t0 < timeout:
            await asyncio.sleep(0.01)
        return self.worker.policy_version

    async def shutdown(self) -> None:
        self.worker.stop()
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class _Slot:
    index: int
    actor: Any
    alive: bool = True
    synced: bool = True          # on the fleet's weight version (a restarted actor may not be)
    outstanding: int = 0         # sequences submitted and not yet returned
    outstanding_tokens: int = 0  # their groups' KV tokens at full length (driver estimate, group_tokens)
    tokens_since_report: int = 0  # of those, sent after the newest KV report arrived
    kv: KVReport | None = None   # the newest KV report from the current actor
    generations: int = 0         # how many actors this slot has had
    tokens: int = 0              # generated tokens returned (cumulative)
    job_tokens: int = 0          # in the last generate/stream call


class RolloutFleet:
    def __init__(self, num_workers: int, engine: EngineSpec | dict | Callable | str, *,
                 num_gpus_per_worker: float = 0, num_cpus_per_worker: float = 1,
                 restart_dead: bool = False, torch_threads: int | None = 1,
                 max_concurrency: int = 1000, bucket_bytes: int = 256 << 20,
                 weight_timeout_s: float = 600.0):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.spec = self._spec(engine)
        if num_gpus_per_worker and self.spec.config.device is None and self.spec.factory is None:
            self.spec.config = self.spec.config.replace(device="cuda")   # Ray sets CUDA_VISIBLE_DEVICES per actor
        if not ray.is_initialized():
            ray.init(include_dashboard=False)
        self._actor_options = dict(num_cpus=num_cpus_per_worker, num_gpus=num_gpus_per_worker,
                                   max_concurrency=max_concurrency, max_restarts=0)
        self.restart_dead, self.torch_threads = restart_dead, torch_threads
        self.bucket_bytes, self.weight_timeout_s = bucket_bytes, weight_timeout_s   # the weight group's
        self.backend = "nccl" if num_gpus_per_worker else "gloo"
        self._cls = ray.remote(_WorkerActor)
        self.slots = [_Slot(i, self._new_actor()) for i in range(num_workers)]
        self.version = 0
        self._group_members: tuple | None = None     # actor ids in the current weight group
        self.metrics = {"dead_actors": 0, "restarted_actors": 0, "resubmitted_prompts": 0,
                        "duplicate_results": 0, "weight_updates": 0, "job_s": 0.0, "job_tokens": 0}
        self.placement: dict[int, int] = {}          # last stream: prompt index -> slot of its result
        # waits for every engine; `kv_default` stands in for a restarted actor's report until it sends one
        reports = ray.get([s.actor.kv_report.remote() for s in self.slots])
        for s, r in zip(self.slots, reports):
            s.kv = r
        self.kv_default: KVReport = reports[0]

    @staticmethod
    def _spec(engine) -> EngineSpec:
        if isinstance(engine, EngineSpec):
            return engine
        if isinstance(engine, (str, os.PathLike)):
            return EngineSpec(model=str(engine))
        if isinstance(engine, dict):     # {"model": path, EngineConfig fields..., "worker_kwargs": {...}}
            kw = dict(engine)
            model = kw.pop("model", None) or kw.pop("path", None)
            worker_kwargs = kw.pop("worker_kwargs", {})
            return EngineSpec(model=str(model) if model is not None else None,
                              config=EngineConfig().replace(**kw).validate(), worker_kwargs=worker_kwargs)
        if callable(engine):
            return EngineSpec(factory=engine)
        raise TypeError(f"engine must be an EngineSpec, a dict, a model path or a factory, got {type(engine)}")

    def _new_actor(self):
        return self._cls.options(**self._actor_options).remote(self.spec, self.torch_threads)

    # ---- workers -----------------------------------------------------------------------------
    @property
    def num_live(self) -> int:
        return sum(s.alive for s in self.slots)

    def queue_depths(self) -> dict[int, int]:
        return {s.index: s.outstanding for s in self.slots if s.alive}

    def loads(self) -> dict[int, float]:
        """Each live slot's dispatch load (`load_key`'s first term: the fuller of KV and slots)."""
        return {s.index: load_key(s, self.kv_default)[0] for s in self.slots if s.alive}

    def _observe(self, slot: _Slot, actor, report: KVReport | None) -> None:
        """Keep a KV report if it is the newest from the slot's current actor."""
        if report is None or slot.actor is not actor or not slot.alive:
            return
        if slot.kv is None or report.seq > slot.kv.seq:
            slot.kv, slot.tokens_since_report = report, 0

    def _mark_dead(self, slot: _Slot) -> None:
        if not slot.alive:
            return
        log.warning("rollout actor %d died", slot.index)
        slot.alive, slot.outstanding = False, 0
        slot.outstanding_tokens = slot.tokens_since_report = 0
        slot.kv = None
        self.metrics["dead_actors"] += 1
        if self.restart_dead:
            slot.actor = self._new_actor()
            slot.alive, slot.generations = True, slot.generations + 1
            slot.synced = self.version == 0
            self.metrics["restarted_actors"] += 1

    # ---- generation ----------------------------------------------------------------------------
    def stream(self, prompts, sampling_params=None, *, max_inflight: int | None = None) -> Iterator[RequestOutput]:
        """One RequestOutput per prompt in completion order (request_id = prompt index); at most max_inflight
        prompts out at once, the rest sent in input order as results come back (None = all at once)."""
        if max_inflight is not None and max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1 or None, got {max_inflight}")
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
            raise ValueError("prompts must be a list of strings or a list of token-id lists")  # noqa: TRY004
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        for s in self.slots:
            s.job_tokens = 0
        self.placement = {}
        cost = [0] * len(prompts)                             # group_tokens of each prompt, set on submit
        pending: dict[Any, tuple[int, _Slot, Any]] = {}      # ref -> (prompt index, slot, actor)
        done: set[int] = set()
        t0 = time.perf_counter()

        def submit(i: int, exclude=()):
            slot = pick_slot(self.slots, exclude, self.kv_default)
            p = params[i]
            ref = slot.actor.run.remote(prompts[i], p)
            slot.outstanding += p.n if p is not None else 1
            cost[i] = group_tokens(prompts[i], p, (slot.kv or self.kv_default).max_model_len)
            slot.outstanding_tokens += cost[i]
            slot.tokens_since_report += cost[i]
            pending[ref] = (i, slot, slot.actor)

        todo = iter(range(len(prompts)))

        def fill() -> None:
            for i in itertools.islice(todo, None if max_inflight is None else max(max_inflight - len(pending), 0)):
                submit(i)

        def release(i: int, slot: _Slot, actor) -> None:
            if slot.actor is actor and slot.alive:
                p = params[i]
                slot.outstanding -= p.n if p is not None else 1
                slot.outstanding_tokens -= cost[i]
                slot.tokens_since_report = min(slot.tokens_since_report, slot.outstanding_tokens)

        try:
            while True:
                fill()
                if not pending:
                    break
                ready, _ = ray.wait(list(pending), num_returns=1)
                ref = ready[0]
                i, slot, actor = pending.pop(ref)
                try:
                    out, report = ray.get(ref)
                except _ACTOR_DEATH:
                    if slot.actor is actor:
                        self._mark_dead(slot)
                    # every prompt still on that actor goes elsewhere (its refs are dropped)
                    lost = [r for r, (_, _, a) in pending.items() if a is actor]
                    redo = [i] + [pending.pop(r)[0] for r in lost]
                    for j in redo:
                        if j not in done:
                            self.metrics["resubmitted_prompts"] += 1
                            submit(j, exclude=(actor,))
                    continue
                except BaseException:
                    release(i, slot, actor)
                    raise
                self._observe(slot, actor, report)
                release(i, slot, actor)
                if i in done:
                    self.metrics["duplicate_results"] += 1
                    continue
                done.add(i)
                self.placement[i] = slot.index
                ntok = sum(len(c.token_ids) for c in out.completions)
                slot.tokens += ntok
                slot.job_tokens += ntok
                out.request_id = i
                yield out
        finally:        # an error, or the consumer stopped early: drop what is still queued
            for r, (i, slot, actor) in pending.items():
                release(i, slot, actor)
                try:
                    ray.cancel(r)
                except Exception as exc:  # noqa: BLE001
                    log.debug("cancel: %r", exc)
            self.metrics["job_s"] = time.perf_counter() - t0
            self.metrics["job_tokens"] = sum(s.job_tokens for s in self.slots)

    def generate(self, prompts, sampling_params=None, *, max_inflight: int | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order (request_id = prompt index)."""
        outs: list[RequestOutput | None] = [None] * len(prompts)
        for o in self.stream(prompts, sampling_params, max_inflight=max_inflight):
            outs[o.request_id] = o
        return outs

    # ---- weights -------------------------------------------------------------------------------
    def _ensure_group(self) -> list[_Slot]:
        import torch.distributed as dist
        from .weights import free_port, join_group
        live = [s for s in self.slots if s.alive]
        members = tuple((s.index, s.generations) for s in live)
        if members == self._group_members:
            return live
        if dist.is_initialized() and self._group_members is None:
            raise RuntimeError("the driver already has a default torch.distributed group; RolloutFleet makes "
                               "the driver rank 0 of its own group (run the fleet from a process without one)")
        addr = ray.util.get_node_ip_address() if len(ray.nodes()) > 1 else "127.0.0.1"
        port, world = free_port(), len(live) + 1
        refs = [s.actor.init_weight_group.remote(self.backend, addr, port, k + 1, world, self.weight_timeout_s)
                for k, s in enumerate(live)]
        join_group(self.backend, addr, port, 0, world, self.weight_timeout_s)   # a changed membership: a new group
        ray.get(refs)
        self._group_members = members
        return live

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                       *, wait_commit: bool = True, timeout: float = 300.0) -> int:
        """Broadcast (name, tensor) pairs from this process (rank 0) to every live worker as `version` (with
        wait_commit, until all committed it); returns bytes sent. Restarted workers need full updates."""
        from .weights import WeightUpdateError, send_weights
        if version <= self.version:
            raise ValueError(f"version {version} is not newer than the fleet's version {self.version}")
        live = self._ensure_group()
        refs = [s.actor.receive_weights.remote(version, self.bucket_bytes) for s in live]
        device = "cuda" if self.backend == "nccl" else None
        try:
            sent = send_weights(named_tensors, src=0, bucket_bytes=self.bucket_bytes, device=device)
        except WeightUpdateError:     # refused before any bucket (a worker without room): the
            ray.wait(refs, num_returns=len(refs))    # workers raised too and keep serving
            raise
        ray.get(refs)
        self.version = version
        self.metrics["weight_updates"] += 1
        if wait_commit:
            got = ray.get([s.actor.wait_version.remote(version, timeout) for s in live])
            if min(got) < version:
                raise RuntimeError(f"workers did not commit version {version} within {timeout}s: {got}")
        for s in live:
            s.synced = True
        return sent

    def versions(self) -> dict[int, int]:
        live = [s for s in self.slots if s.alive]
        return dict(zip([s.index for s in live], ray.get([s.actor.policy_version.remote() for s in live])))

    def version_skew(self) -> int:
        """max - min committed weight version over the live workers."""
        v = list(self.versions().values())
        return max(v) - min(v) if v else 0

    # ---- stats / shutdown ---------------------------------------------------------------------
    def stats(self) -> dict:
        """Per-worker and fleet counters; an actor found dead is handled as in `stream` and left out."""
        dt = max(self.metrics["job_s"], 1e-9)
        workers = {}
        for s, ref in [(s, s.actor.stats.remote()) for s in self.slots if s.alive]:
            try:
                st = dict(ray.get(ref))
            except _ACTOR_DEATH:
                self._mark_dead(s)
                continue
            self._observe(s, s.actor, st.pop("kv_report", None))
            st.update(outstanding=s.outstanding, synced=s.synced, restarts=s.generations,
                      returned_tokens=s.tokens, tok_s=s.job_tokens / dt if self.metrics["job_s"] else 0.0,
                      outstanding_tokens=s.outstanding_tokens, load=load_key(s, self.kv_default)[0],
                      kv_demand=s.kv.demand / max(s.kv.pages, 1) if s.kv is not None else 0.0,
                      kv_used_frac=s.kv.used / max(s.kv.pages, 1) if s.kv is not None else 0.0)
            workers[s.index] = st
        vers = [w["policy_version"] for w in workers.values()]
        return {"workers": workers, "num_live": len(workers), "num_workers": len(self.slots),
                "fleet_version": self.version, "version_skew": (max(vers) - min(vers)) if vers else 0,
                "tok_s": self.metrics["job_tokens"] / dt if self.metrics["job_s"] else 0.0,
                **self.metrics}

    def shutdown(self) -> None:
        import torch.distributed as dist
        for s in self.slots:
            if s.alive:
                try:
                    ray.get(s.actor.shutdown.remote(), timeout=30)
                except Exception as exc:  # noqa: BLE001  already dead / unreachable
                    log.debug("actor %d shutdown: %r", s.index, exc)
                ray.kill(s.actor)
                s.alive = False
        if self._group_members is not None and dist.is_initialized():
            dist.destroy_process_group()
        self._group_members = None
