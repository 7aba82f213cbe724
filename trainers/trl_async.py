"""AsyncGRPOTrainer (trl 1.16, `trl/experimental/async_grpo`) adapters over a RolloutWorker.

`AsyncGRPOTrainer(..., rollout_worker=EngineRolloutWorker(...), weight_transfer=EngineWeightTransfer(worker))`.
TRL's call order: init_weight_transfer -> pause -> send_weights -> resume -> update_model_version(1) -> start
-> (every weight_sync_steps: pause -> send_weights -> resume -> update_model_version(v)) -> stop -> destroy.

`EngineWeightTransfer` never drains: `send_weights` copies the (collective) iterator into the worker's names and
dtypes, `resume()` stages it, the worker commits at its next batch boundary. `EngineRolloutWorker` keeps
`max_inflight_groups` prompts generating (n = num_generations each), scores finished groups, normalises advantages
within each, and queues one `RolloutSample` per completion (`model_version`: the version live at its first token).
Our logprobs are AsyncGRPO's `old_log_probs`. The trainer itself needs CUDA and FSDP2; on CPU only the protocols run.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Callable, Iterable, Iterator, Optional, Sequence

import numpy as np
import torch

from rollout.request import SamplingParams

from .trl_generator import (_WeightMapper, _request_seed, check_trl_version, newest_worker_version,
                            sampling_params_from_trl_args, worker_lock)

log = logging.getLogger(__name__)


class EngineWeightTransfer:
    """WeightTransferProtocol over a RolloutWorker in this process. `defer_commit=False` stages from `send_weights`
    (the worker may then commit before `resume()`)."""

    def __init__(self, worker, *, name_map: Optional[Callable[[str], Optional[str]]] = None,
                 defer_commit: bool = True):
        self.worker = worker
        self.defer_commit = defer_commit
        self._mapper = _WeightMapper(worker, name_map)
        self._staged: Optional[list[tuple[str, torch.Tensor]]] = None
        self.calls: list[str] = []          # protocol calls, in order (introspection / tests)
        self.versions: list[int] = []       # worker versions handed to update_weights
        self.metrics = {"send_ms": 0.0, "bytes": 0}
        self._initialised = False

    def init_weight_transfer(self) -> None:
        self.calls.append("init_weight_transfer")
        check_trl_version()
        self._initialised = True

    def pause(self) -> None:
        # No drain: generation keeps running on the old weights until the update commits at a batch boundary.
        self.calls.append("pause")

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.calls.append("send_weights")
        if not self._initialised:
            raise RuntimeError("send_weights before init_weight_transfer")
        t0 = time.perf_counter()
        # copy=True: the trainer's tensors (full_tensor() gathers, live parameters) change or vanish after this call
        items = self._mapper.map(iterator, copy=True)
        self.metrics["send_ms"] = (time.perf_counter() - t0) * 1e3
        self.metrics["bytes"] = sum(t.numel() * t.element_size() for _, t in items)
        if self.defer_commit:
            self._staged = items
        else:
            self._push(items)

    def resume(self) -> None:
        self.calls.append("resume")
        if self._staged is not None:
            items, self._staged = self._staged, None
            self._push(items)

    def _push(self, items) -> None:
        with worker_lock(self.worker):       # read the versions and stage atomically w.r.t. a commit
            version = newest_worker_version(self.worker) + 1
            self.worker.update_weights(items, version=version)   # staged; committed at the next batch boundary
        self.versions.append(version)

    def destroy(self) -> None:
        self.calls.append("destroy")
        self._staged = None


class EngineRolloutWorker:
    """RolloutWorkerProtocol over a RolloutWorker (its loop started by `start()` unless running): streams scored
    groups as TRL `RolloutSample`s. `dataset` rows have a "prompt" (text or chat messages), other keys go to the
    reward functions `f(prompts=, completions=, completion_ids=, **row_keys) -> list[float | None]`. `args` (an
    AsyncGRPOConfig / GRPOConfig) gives the sampling fields, num_generations, chat_template_kwargs and queue_maxsize,
    or pass `sampling_params` and `num_generations`."""

    def __init__(self, worker, *, dataset: Iterable[dict], processing_class, reward_funcs: Sequence[Callable],
                 args=None, num_generations: Optional[int] = None, sampling_params: Optional[SamplingParams] = None,
                 eos_token_ids: Optional[Sequence[int]] = None, reward_weights: Optional[Sequence[float]] = None,
                 max_inflight_groups: int = 4, queue_maxsize: Optional[int] = None,
                 chat_template_kwargs: Optional[dict] = None, seed: Optional[int] = None,
                 metrics_interval_s: float = 1.0):
        check_trl_version()
        self.worker = worker
        self.dataset = dataset
        self.tokenizer = getattr(processing_class, "tokenizer", processing_class)
        self.reward_funcs = list(reward_funcs)
        self.reward_func_names = [getattr(f, "__name__", type(f).__name__) for f in self.reward_funcs]
        self.reward_weights = list(reward_weights) if reward_weights is not None else [1.0] * len(self.reward_funcs)
        if eos_token_ids is None:
            e = self.tokenizer.eos_token_id
            eos_token_ids = [] if e is None else [e]
        self.eos_token_ids = list(eos_token_ids)
        if sampling_params is None:
            if args is None:
                raise ValueError("pass args (an AsyncGRPOConfig) or sampling_params")
            sampling_params = sampling_params_from_trl_args(args, self.eos_token_ids)
        self.sampling_params = sampling_params
        self.num_generations = int(num_generations or getattr(args, "num_generations", 0) or 1)
        self.chat_template_kwargs = dict(chat_template_kwargs or getattr(args, "chat_template_kwargs", None) or {})
        qsize = queue_maxsize if queue_maxsize is not None else getattr(args, "queue_maxsize", 1024)
        self.rollout_buffer: queue.Queue = queue.Queue(maxsize=qsize)
        self.metrics_queue: queue.Queue = queue.Queue(maxsize=4096)
        self.max_inflight_groups = max(1, int(max_inflight_groups))
        self.seed = seed
        self.metrics_interval_s = metrics_interval_s
        self.model_version = 0                  # trainer numbering, from update_model_version
        self._version_offset = 0                # trainer version - worker version
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._error: Optional[BaseException] = None
        self._heartbeat = time.time()
        self._started_worker_loop = False
        self._group_ids = itertools.count()
        self._barrier_seen = float(worker.weights.metrics.get("barrier_ms", 0.0))
        self.calls: list[str] = []

    # ---- protocol ----------------------------------------------------------------------------------------------
    def update_model_version(self, model_version: int) -> None:
        self.calls.append(f"update_model_version({model_version})")
        # the update just sent is the newest worker version (read atomically w.r.t. a commit on the loop thread)
        self._version_offset = int(model_version) - newest_worker_version(self.worker)
        self.model_version = int(model_version)

    def start(self) -> None:
        self.calls.append("start")
        if self._thread is not None:
            return
        if getattr(self.worker, "_thread", None) is None:
            self.worker.start()
            self._started_worker_loop = True
        self._stop.clear()
        self._heartbeat = time.time()
        self._thread = threading.Thread(target=self._run, name="trl-async-rollout", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.calls.append("stop")
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        if self._started_worker_loop:
            self.worker.stop()          # aborts the requests still queued (their futures resolve as "abort")
            self._started_worker_loop = False

    def check_health(self, stale_after_s: float) -> None:
        if self._error is not None:
            raise RuntimeError("rollout worker failed; see the chained exception") from self._error
        if self._thread is not None and not self._thread.is_alive():
            raise RuntimeError("rollout worker thread exited")
        age = time.time() - self._heartbeat
        if age > stale_after_s:
            raise RuntimeError(f"rollout worker heartbeat stale: {age:.0f}s > {stale_after_s:.0f}s")

    # ---- production loop ---------------------------------------------------------------------------------------
    def _rows(self) -> Iterator[dict]:
        while True:
            n = 0
            for row in self.dataset:
                n += 1
                yield row
            if n == 0:
                raise ValueError("empty dataset")

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt).input_ids)
        out = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True, **self.chat_template_kwargs)
        return list(out["input_ids"])

    def _run(self) -> None:
        rows = self._rows()
        inflight: dict[Future, tuple[int, dict, list[int], float]] = {}
        tokens, t_window, last_push = 0, time.perf_counter(), time.perf_counter()
        try:
            while not self._stop.is_set():
                self._heartbeat = time.time()
                while len(inflight) < self.max_inflight_groups and not self._stop.is_set():
                    gid = next(self._group_ids)
                    row = next(rows)
                    ids = self._prompt_ids(row["prompt"])
                    seed = None if self.seed is None else _request_seed(self.seed, 0, gid)
                    params = dataclasses.replace(self.sampling_params, n=self.num_generations, seed=seed)
                    inflight[self.worker.submit([ids], params)] = (gid, row, ids, time.perf_counter())
                done, _ = wait(list(inflight), timeout=0.1, return_when=FIRST_COMPLETED)
                for fut in done:
                    gid, row, ids, t0 = inflight.pop(fut)
                    out = fut.result()[0]
                    if self._stop.is_set() or any(c.finish_reason in ("abort", "error") for c in out.completions):
                        continue
                    samples = self._score(gid, row, ids, out)
                    tokens += sum(len(c.token_ids) for c in out.completions)
                    for s in samples:
                        self._put(s)
                now = time.perf_counter()
                if now - last_push >= self.metrics_interval_s and tokens:
                    self._push({"gen/tokens_per_s": (float(tokens), now - t_window)})
                    tokens, t_window, last_push = 0, now, now
        except BaseException as exc:     # surfaced by check_health
            log.exception("rollout production failed")
            self._error = exc
        finally:
            now = time.perf_counter()
            if tokens:
                self._push({"gen/tokens_per_s": (float(tokens), now - t_window)})

    def _put(self, sample) -> None:
        while not self._stop.is_set():
            try:
                self.rollout_buffer.put(sample, timeout=0.1)
                return
            except queue.Full:
                self._heartbeat = time.time()   # back-pressure is not a hang

    def _push(self, metrics: dict) -> None:
        try:
            self.metrics_queue.put_nowait(metrics)
        except queue.Full:
            pass

    def _barrier_delta(self) -> float:
        total = float(self.worker.weights.metrics.get("barrier_ms", 0.0))
        delta, self._barrier_seen = total - self._barrier_seen, total
        return delta

    def _score(self, gid: int, row: dict, prompt_ids: list[int], out) -> list:
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample
        G = len(out.completions)
        prompt = row["prompt"]
        texts = self.tokenizer.batch_decode([c.token_ids for c in out.completions], skip_special_tokens=True)
        conversational = not isinstance(prompt, str)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        kwargs = {k: [v] * G for k, v in row.items() if k not in ("prompt", "completion", "completion_ids")}
        columns = []
        for f in self.reward_funcs:
            r = f(prompts=[prompt] * G, completions=completions,
                  completion_ids=[list(c.token_ids) for c in out.completions], **kwargs)
            columns.append([np.nan if x is None else float(x) for x in r])
        arr = np.array(columns, dtype=float).reshape(len(self.reward_funcs), G)
        weights = np.asarray(self.reward_weights, dtype=float)[:, None]
        all_nan = np.all(np.isnan(arr), axis=0)
        rewards = np.nansum(arr * weights, axis=0)
        rewards[all_nan] = np.nan
        adv = np.zeros(G)
        ok = ~np.isnan(rewards)
        mean = std = float("nan")
        if ok.any():       # group-normalised, as TRL's AsyncRolloutWorker does
            mean, std = float(rewards[ok].mean()), float(rewards[ok].std())
            adv[ok] = (rewards[ok] - mean) / (std + 1e-8)
        samples, versions = [], []
        P = len(prompt_ids)
        for i, c in enumerate(out.completions):
            first = (c.policy_versions[0] if c.policy_versions else self.worker.policy_version)
            version = first + self._version_offset
            versions.append(version)
            metrics = {"reward": float(rewards[i]), "reward_std": std,
                       **{f"rewards/{n}": float(arr[j, i]) for j, n in enumerate(self.reward_func_names)}}
            samples.append(RolloutSample(
                prompt=prompt, completion=completions[i],
                input_ids=np.asarray(prompt_ids + list(c.token_ids), dtype=np.int64),
                completion_mask=np.asarray([0] * P + [1] * len(c.token_ids), dtype=np.int64),
                old_log_probs=np.asarray([0.0] * P + list(c.logprobs), dtype=np.float32),
                advantage=float(adv[i]), model_version=int(version), group_id=int(gid), metrics=metrics,
                enqueued_at=time.time()))
        live = self.worker.policy_version + self._version_offset
        self._push({"gen/policy_version": float(min(versions)),
                    "gen/policy_version_lag": float(self.model_version - min(versions)),
                    "gen/weight_barrier_ms": self._barrier_delta(),
                    "gen/live_policy_version": float(live)})
        return samples
