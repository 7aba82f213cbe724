"""RolloutWorker: the engine as an RL rollout worker. A trainer keeps sending weights;
generation never stops for them.

Each worker step: commit a staged weight update at the batch boundary (if any), apply
the per-request stale-KV and staleness policies, then run one engine step. Every token
carries the version of the weights that sampled it (stamped on the launched batch).
Run it inline (`generate`, `step`) or on a background thread (`start`, `submit`).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future
from typing import Iterable, Optional

import torch

from .engine import RolloutEngine
from .request import RequestOutput, SamplingParams, Status
from .weights import WeightSync, WeightUpdateError

log = logging.getLogger(__name__)


class RolloutWorker:
    def __init__(self, engine: RolloutEngine, *, require_full_updates: bool = False, expects_updates: bool = True):
        self.engine = engine
        self.weights = WeightSync(engine, require_full=require_full_updates)
        self._lock = threading.RLock()          # serialises engine access and staging (take it via locked())
        self._wake = threading.Condition(self._lock)
        self._waiting = 0                       # callers blocked in locked(); the loop yields to them
        self._waiting_guard = threading.Lock()
        self._futures: dict[int, tuple[Future, list[int], dict]] = {}
        # generate() callers' requests: id -> its RequestOutput (or the exception that failed it) once
        # finished, whichever thread's step finished it; _arrived wakes the callers.
        self._waited: dict[int, object] = {}
        self._arrived = threading.Condition(self._lock)
        self._thread: Optional[threading.Thread] = None
        self._stop = False
        # outputs of requests added with add_requests that a generate() or background step finished: the
        # caller collects them here (step() returns them directly to its own caller)
        self.finished: list[RequestOutput] = []
        self.metrics = {"stale_finished": 0, "stale_recomputed": 0}
        if expects_updates:          # a standalone rollout job takes no updates: no warning
            self.weights.warn_if_no_room()

    @contextlib.contextmanager
    def locked(self):
        """The worker lock, handed over between steps. Python locks are not fair: the loop thread
        releases and re-takes it within microseconds, so a plain acquire from another thread (a
        submit, a weight update) could wait for many steps. The loop waits for registered callers."""
        with self._waiting_guard:
            self._waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._waiting_guard:
                self._waiting -= 1
        try:
            yield
        finally:
            self._lock.release()

    def _let_waiters_in(self, max_wait_s: float = 0.05) -> None:
        deadline = time.perf_counter() + max_wait_s
        while self._waiting and time.perf_counter() < deadline:
            time.sleep(0)          # drops the GIL; a waiter that got the lock decrements _waiting

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    # ---- weights -------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                       adopt: bool = False) -> None:
        """Stage an update (validated whole first); it goes live at the next batch boundary.
        Raises WeightUpdateError, leaving the live weights untouched, on a bad update (unknown
        name, wrong shape or dtype, a NaN or inf anywhere, an old version, no room). Returns once
        the staged copy is on the device and checked; decoding goes on meanwhile.
        adopt: the tensors become the staging buffers (see WeightSync.prepare).
        Asleep: at level 1 the update lands at once (the engine is idle); at level 2 it is refused until
        wake(tags=["weights"]); after sleep(discard_weights=True) it must be a full update."""
        staged = self.prepare_update(named_tensors, version, adopt)
        self.weights.check_finite(staged)      # waits for the copies: outside the lock, so steps go on
        self.install_update(staged)

    def prepare_update(self, named_tensors, version: int, adopt: bool = False):
        """update_weights' first part: validate and launch the staging copies (nothing waits)."""
        with self.locked():
            if "weights" in self.engine.asleep:
                raise WeightUpdateError("weight update rejected: the engine is asleep at level 2 (its weights are off "
                                        "the device); call wake(tags=['weights']) first")
            staged = self.weights.prepare(named_tensors, version, adopt=adopt)
            missing = self.engine.model.hf_missing(set(staged.tensors)) if self.engine.weights_discarded else []
            if missing:
                raise WeightUpdateError(f"weight update rejected: the weights were discarded by sleep, so an update "
                                        f"must be full; missing {len(missing)} tensors, e.g. {missing[:3]}")
        return staged

    def install_update(self, staged) -> None:
        """update_weights' last part, once weights.check_finite(staged) passed: live at the next boundary."""
        with self.locked():
            self.weights.install(staged)
            if self.engine.asleep or self.engine.weights_discarded:    # idle, nothing in flight: commit now
                self._commit_and_apply_policies()
                self.weights.verify(block=True)     # and free the staging copies while the trainer runs
            self._wake.notify_all()

    def _commit_and_apply_policies(self) -> list[RequestOutput]:
        version = self.weights.commit()
        if version is None:
            return []
        outs = []
        for req in list(self.engine.requests.values()):
            p = req.params
            firsts = [s.policy_versions[0] for s in req.seqs if s.policy_versions]
            if p.max_staleness is not None and firsts and version - min(firsts) > p.max_staleness:
                reason = "stale" if p.on_stale == "finish" else "abort"
                self.metrics["stale_finished"] += 1
                outs += self.engine.abort([req.request_id], reason=reason)
                continue
            if p.stale_kv == "recompute":
                for s in req.seqs:
                    if s.status == Status.RUNNING or s.host_table:   # KV on the device or swapped out
                        self.engine.scheduler.recompute(s)
                        self.metrics["stale_recomputed"] += 1
        return outs

    # ---- sleep / wake (colocated with a trainer) --------------------------------------------------
    def sleep(self, level: int = 1, discard_weights: bool = False) -> dict:
        """RolloutEngine.sleep between steps, a staged update committed first (see update_weights)."""
        with self.locked():
            if not self.engine.requests:
                self._commit_and_apply_policies()
                self.weights.verify(block=True)
            return self.engine.sleep(level, discard_weights)

    def wake(self, tags=None) -> dict:
        """RolloutEngine.wake; weight updates go on landing in place at the restored addresses."""
        with self.locked():
            out = self.engine.wake(tags)
            self.weights.track_pointers()
            self._wake.notify_all()
            return out

    # ---- stepping ----------------------------------------------------------------------------
    def _step(self) -> list[RequestOutput]:
        outs = self._commit_and_apply_policies()
        outs += self.engine.step()
        self.weights.verify()
        return outs

    def step(self) -> list[RequestOutput]:
        """One worker step. Returns the finished requests that no generate() / submit() caller waits for."""
        with self.locked():
            return self._route(self._step())

    def _route(self, outs: list[RequestOutput]) -> list[RequestOutput]:
        """Hand finished outputs to the generate() callers and submit() futures waiting for them;
        return the rest."""
        futures = {i for _, ids, _ in self._futures.values() for i in ids}
        rest = []
        for o in outs:
            if o.request_id in self._waited:
                self._waited[o.request_id] = o
            elif o.request_id not in futures:
                rest.append(o)
        if any(o.request_id in self._waited for o in outs):
            self._arrived.notify_all()
        self._resolve(outs)
        return rest

    def add_requests(self, prompts, sampling_params=None, continue_from=None) -> list[int]:
        with self.locked():
            return self.engine.add_requests(prompts, sampling_params, continue_from)

    def abort(self, request_ids) -> list[RequestOutput]:
        """Finish the given requests now (partial outputs, pages freed). Callers and futures waiting
        for them get the aborted outputs too. Abort through here, not engine.abort, when others wait."""
        with self.locked():
            outs = self.engine.abort(request_ids)
            self._route(outs)
            return outs

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Run prompts to completion through worker steps and return their outputs in input order.
        Safe from several threads at once: every caller gets its own outputs (the steps are shared;
        with the background loop running, callers wait for it instead of stepping). Weight updates
        staged meanwhile land between steps."""
        with self.locked():
            ids = self.engine.add_requests(prompts, sampling_params)
            for i in ids:
                self._waited[i] = None
            self._wake.notify_all()
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="rollout", unit="req")
        try:
            while True:
                self._let_waiters_in()     # an abort or update from another thread gets in between our steps
                with self.locked():
                    done = sum(self._waited[i] is not None for i in ids)
                    if bar is not None:
                        bar.update(done - bar.n)
                    if done == len(ids):
                        break
                    lost = [i for i in ids if self._waited[i] is None and not self.engine.pending(i)]
                    if lost:
                        raise RuntimeError(f"requests {lost} finished outside this worker (engine.abort?); "
                                           f"use RolloutWorker.abort so that waiting callers get the output")
                    if self._thread is not None and self._thread.is_alive():
                        self._arrived.wait(timeout=0.5)       # the loop steps and routes our outputs
                    else:
                        self.finished += self._route(self._step())
            outs = [self._waited[i] for i in ids]
        finally:
            with self.locked():
                for i in ids:
                    self._waited.pop(i, None)
            if bar is not None:
                bar.close()
        for o in outs:
            if isinstance(o, BaseException):
                raise o
        return outs

    # ---- background loop ---------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="rollout-worker", daemon=True)
        self._thread.start()

    def submit(self, prompts, sampling_params: Optional[SamplingParams] = None) -> Future:
        """Queue prompts; the future resolves to their RequestOutputs in input order.
        Bad input raises here, before anything is queued."""
        fut: Future = Future()
        with self.locked():
            ids = self.engine.add_requests(prompts, sampling_params)
            key = ids[0] if ids else -1
            self._futures[key] = (fut, ids, {})
            self._wake.notify_all()
        if not ids:
            fut.set_result([])
        return fut

    def _loop(self) -> None:
        while True:
            self._let_waiters_in()
            with self._wake:
                while not self._stop and not self.engine.has_unfinished() and self.weights.pending is None:
                    self._wake.wait(timeout=0.5)
                if self._stop:
                    return
                try:
                    self.finished += self._route(self._step())
                except Exception as exc:     # fail the waiting futures and callers, keep the worker up
                    log.exception("rollout step failed")
                    for fut, _, _ in self._futures.values():
                        if not fut.done():
                            fut.set_exception(exc)
                    self._futures.clear()
                    for i, o in self._waited.items():
                        if o is None:
                            self._waited[i] = exc
                    self._arrived.notify_all()

    def _resolve(self, outs: list[RequestOutput]) -> None:
        by_id = {o.request_id: o for o in outs}
        for key, (fut, ids, got) in list(self._futures.items()):
            for i in ids:
                if i in by_id:
                    got[i] = by_id[i]
            if len(got) == len(ids):
                fut.set_result([got[i] for i in ids])
                del self._futures[key]

    def stop(self, timeout: float = 10.0, abort_pending: bool = True) -> list[RequestOutput]:
        """Stop the loop after the current step and drain the batch in flight. Unfinished
        requests are aborted (pages freed, partial outputs returned and handed to their
        futures) unless abort_pending=False, which keeps them queued for a later start()."""
        if self._thread is not None:
            self._stop = True          # seen by the loop before its next step, lock or not
            with self._wake:           # (the loop re-takes the lock between steps; locks are not fair)
                self._wake.notify_all()
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError("rollout worker did not stop within the timeout")
            self._thread = None
        with self.locked():
            outs = self.engine.drain()
            if abort_pending:
                outs += self.engine.abort(list(self.engine.requests))
            self._route(outs)
            return outs

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def probe_mismatch(self, outputs: list[RequestOutput], max_sequences: int = 4) -> dict:
        """Opt-in mismatch probe: re-score a few finished completions with a full forward
        (engine.score) under the same weights and compare with the logprobs we returned.
        Only completions whose every token came from the live version are probed."""
        diffs = []
        with self.locked():
            for o in outputs:
                for c in o.completions:
                    if len(diffs) >= max_sequences:
                        break
                    if not c.token_ids or set(c.policy_versions) != {self.policy_version}:
                        continue
                    T = o.params.temperature if o.params and o.params.temperature > 0 else 1.0
                    ref = self.engine.score([o.prompt_token_ids + c.token_ids], temperature=T)[0]
                    ref = torch.tensor(ref[len(o.prompt_token_ids) - 1:])
                    diffs.append(ref - torch.tensor(c.logprobs))
        if not diffs:
            return {}
        d = torch.cat(diffs)                  # log(p_ref / p_sampler) per token
        ratio = d.exp()
        return {"probe/max_abs_dlogp": d.abs().max().item(), "probe/mean_abs_dlogp": d.abs().mean().item(),
                "probe/kl_k3": (ratio - 1 - d).mean().item(),
                "probe/frac_ratio_outside_0.5_2": ((ratio < 0.5) | (ratio > 2)).float().mean().item(),
                "probe/tokens": d.numel()}

    def stats(self) -> dict:
        m = self.engine.stats()
        m.update({f"weights/{k}": v for k, v in self.weights.metrics.items()})
        m.update(self.metrics)
        sch = self.engine.scheduler
        m["policy_version"] = self.policy_version
        m["kv_pages_used"] = self.engine.kv.alloc.num_used
        m["kv_pages_total"] = self.engine.kv.alloc.num_usable
        m["running_seqs"] = len(sch.running)
        m["max_num_seqs"] = sch.max_num_seqs
        m["recomputed_tokens"] = sch.num_recomputed_tokens
        m["discarded_tokens"] = sch.num_discarded_tokens
        m["time"] = time.time()
        return m
