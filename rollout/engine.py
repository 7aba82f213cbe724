"""RolloutEngine: the public entry point. Validates input, then wires the stages:
requests -> scheduler -> batch builder -> model runner (model + sampler) -> outputs."""
from __future__ import annotations

import functools
import logging
import math
import random
import threading
import time
from pathlib import Path
from typing import Optional, Sequence as Seq, Union

import torch

from .config import EngineConfig
from .kernels import resolve_backend
from .kv_cache import KVCacheManager, PageAllocator
from .layers.moe import compile_tiles
from .models.loader import build_model, init_random, load_model, parameter_bytes, resolve_dtype
from .request import MIN_TEMPERATURE, Completion, Request, RequestOutput, SamplingParams, _is_array, _is_int
from .pipeline import DevicePipeline, InFlight
from .runner import ModelRunner
from .sampler import SamplerOutput
from .scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from .spec import Speculator

Prompt = Union[str, list[int]]
log = logging.getLogger(__name__)


def _serialized(method):
    """Engine calls from several threads run one at a time (a generate call holds the engine for
    its whole run), so no two interleave their steps."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return call


def _default_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class RolloutEngine:
    """The engine over a loaded model. Options: an EngineConfig, and / or keyword overrides of its
    fields (`RolloutEngine.from_pretrained(path, max_num_seqs=64)`). Its public calls may come
    from several threads: they run one at a time (a `generate` holds the engine until it returns).
    For concurrent callers that should share batches use RolloutWorker or the HTTP server."""

    def __init__(self, model, hf_config, config: Optional[EngineConfig] = None, *, tokenizer=None,
                 generation_config=None, **overrides):
        cfg = (config or EngineConfig()).replace(**overrides).validate()
        self.config = cfg
        self._lock = threading.RLock()
        self.model = model
        self.hf_config = hf_config
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = hf_config.vocab_size
        self.max_model_len = cfg.model_len(hf_config)
        self.page_size = page_size = cfg.page_size
        kv_dtype = self.dtype
        if self.device.type == "cpu":
            small = sum(p.numel() for p in model.parameters()) < 100_000_000
            threads = cfg.cpu_threads or (1 if small else None)
            if threads:       # process-wide: a tiny model on 2 cores ran ~30x faster on 1 thread than 2
                torch.set_num_threads(threads)
        # "auto": the Triton kernels (attention, fused sampler) on CUDA, the torch reference on CPU.
        attention_backend = resolve_backend(cfg.attention_backend, self.device.type)
        if attention_backend == "triton" and page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two for the Triton kernels, got {page_size}")
        model.use_kernel_switches(cfg.kernels)
        if cfg.batch_invariant:
            self._check_batch_invariant(attention_backend)
        if cfg.pack_decode_weights:      # before the KV cache takes the free memory
            self._pack_decode_weights(attention_backend, cfg.batch_invariant, cfg.max_num_seqs)
        reserve = parameter_bytes(model) if cfg.reserve_memory == "weights" else cfg.reserve_memory
        kv_memory = cfg.kv_cache_memory
        if kv_memory is None and cfg.num_kv_pages is None and cfg.gpu_memory_utilization is not None:
            kv_memory = self._kv_memory_of_share(cfg.gpu_memory_utilization, page_size, kv_dtype, reserve)
        num_pages = self._size_kv(cfg.num_kv_pages, kv_memory, page_size, kv_dtype, cfg.max_num_seqs, reserve)
        self.kv = KVCacheManager(num_pages, page_size, prefix_caching=cfg.enable_prefix_caching)
        if self.kv.alloc.num_usable < self.kv.pages_for(self.max_model_len):
            raise ValueError(f"KV cache of {self.kv.alloc.num_usable} pages x {page_size} tokens cannot "
                             f"hold one sequence of max_model_len={self.max_model_len}")
        self.eos_token_ids = self._eos_ids(hf_config, generation_config, tokenizer)
        page_bytes = ModelRunner.kv_bytes_per_page(hf_config, page_size, kv_dtype)
        num_host_pages = int(cfg.swap_space_gb * 1e9) // page_bytes
        swap_page_s, recompute_token_s = self._preemption_costs(page_bytes)
        self.scheduler = Scheduler(
            self.kv, max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=self.max_model_len, eos_token_ids=self.eos_token_ids, tokenizer=tokenizer,
            admission_reserve_pages=max(1, num_pages // 100), reserve_fraction=cfg.kv_reserve_fraction,
            preemption_mode=cfg.preemption_mode,
            host_pages=PageAllocator(num_host_pages + 1, page_size) if num_host_pages else None,
            swap_page_s=swap_page_s, recompute_token_s=recompute_token_s)
        self.runner = ModelRunner(model, num_pages=num_pages, page_size=page_size, kv_dtype=kv_dtype,
                                  attention_backend=attention_backend, batch_invariant=cfg.batch_invariant,
                                  num_host_pages=num_host_pages if self.scheduler.host_pages is not None else 0)
        # Both modes run the same one-step-lag schedule; async overlaps the CPU with the GPU
        # (default on CUDA). CPU always runs synchronously. Decode steps replay CUDA graphs
        # when the Triton backend runs on CUDA (captured here, before serving).
        cuda = self.device.type == "cuda"
        self.pipeline = DevicePipeline(
            self.runner, self.kv, max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
            max_pages_per_seq=self.kv.pages_for(self.max_model_len),
            async_mode=cuda if cfg.async_pipeline is None else cfg.async_pipeline,
            cuda_graphs=cuda and cfg.cuda_graphs and attention_backend == "triton",
            graph_max_batch=cfg.cuda_graph_max_batch, graph_modes=tuple(cfg.cuda_graph_modes),
            verify_max_tokens=cfg.spec_max_step_tokens if cfg.speculative != "off" else 0)
        self.pipeline.capture_graphs()
        if cuda and attention_backend == "triton" and self.model.sparse_layers:
            # the graphs compiled the MoE's decode tiles; prefill and recompute chunks take the others
            moe = self.model.layers[self.model.sparse_layers[0]].mlp
            compile_tiles(moe.gate_up, moe.down, moe.top_k, cfg.max_num_batched_tokens)
            torch.cuda.synchronize(self.device)
        self._inflight: Optional[InFlight] = None
        self.speculator = Speculator(cfg) if cfg.speculative != "off" else None
        self.policy_version = 0      # stamped on every launched batch; the RL worker bumps it
        self.cpu_spans: Optional[list] = None   # (name, start_s, end_s) while tracing
        self._ready: list[RequestOutput] = []     # finished while draining, handed out by step()
        self._rng = random.Random(cfg.seed)
        self._next_id = 0
        self.requests: dict[int, Request] = {}
        self.metrics = {"steps": 0, "generated_tokens": 0, "prefill_tokens": 0, "failed_steps": 0}
        self.asleep: set[str] = set()     # sleep(): parts off the device, "kv_cache" and (level 2) "weights"
        self._discarded_at: Optional[int] = None   # policy_version whose weights sleep(discard_weights=True) dropped

    def stats(self) -> dict:
        """Counters plus the pipeline's: graph / eager steps and compute-stream busy time."""
        p = self.pipeline
        graph_s = p.graphs.capture_s if p.graphs is not None else 0.0
        on_use_s = p.graphs.capture_on_use_s if p.graphs is not None else 0.0
        sch, kv = self.scheduler, self.kv.alloc
        return {**self.metrics, **p.counts, "gpu_busy_ms": p.busy_ms, "graph_capture_s": graph_s,
                "graph_capture_on_use_s": on_use_s,
                "preemptions": sch.num_preemptions, "swap_outs": sch.num_swap_outs,
                "swapped_pages": sch.num_swapped_pages, "recomputed_tokens": sch.num_recomputed_tokens,
                # prefix cache, over sequences admitted from scratch (new, or recomputing): hit rate = hits / queries
                "prefix_cache_queries": sch.prefix_cache_queries, "prefix_cache_hit_tokens": sch.prefix_cache_hits,
                "prefix_cache_pages": kv.num_cached, "prefix_cache_evictable_pages": kv.num_evictable,
                "prefix_cache_evictions": kv.num_evictions, "sleep_level": self.sleep_level,
                **(self.speculator.stats() if self.speculator is not None else {})}

    def _pack_decode_weights(self, attention_backend: str, batch_invariant: bool, max_num_seqs: int) -> None:
        """pack_decode_weights=True: the decode GEMMs read copies of their weights packed one
        contiguous run per program (DecoderLM.pack_decode_weights) for the configs at
        min(max_num_seqs, 64) rows, at the cost of those weights' memory once more."""
        from .kernels.skinny_gemm import MAX_M
        if self.device.type != "cuda" or attention_backend != "triton" or batch_invariant:
            raise ValueError("pack_decode_weights=True needs the Triton decode kernels on a CUDA device "
                             "(and not batch_invariant, whose GEMMs read the plain weights)")
        rows = min(max_num_seqs, MAX_M)
        nbytes = self.model.pack_decode_weights(rows)
        if not nbytes:
            raise ValueError(f"pack_decode_weights=True: no decode GEMM of this model takes the skinny Triton "
                             f"GEMM at {rows} rows (its table holds the Llama-3-8B shapes); nothing to pack")
        log.info("packed decode weights for %d rows: %.2f GB more weight memory", rows, nbytes / 1e9)

    def _check_batch_invariant(self, attention_backend: str) -> None:
        """batch_invariant=True: a sequence's tokens and logprobs do not depend on which other
        sequences share its steps (so a preempted and resumed run, or one in a bigger batch, gives
        the same bits). It runs on our Triton kernels only; say so before anything is allocated."""
        if self.model.sparse_layers:     # the grouped GEMM's tiles follow the batch's pairs per expert
            raise ValueError(f"batch_invariant=True does not cover mixture-of-experts models "
                             f"({self.hf_config.model_type}): the fused MoE picks its tiles by batch size")
        if self.device.type != "cuda" or attention_backend != "triton":
            raise ValueError("batch_invariant=True needs the Triton kernels on a CUDA device "
                             f"(device {self.device.type}, attention_backend {attention_backend!r})")
        if self.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"batch_invariant=True needs bf16 or fp16 weights, got {self.dtype}")
        if not getattr(self.model, "fused_small_ops", True):
            raise ValueError("batch_invariant=True runs on the fused forward (model.fused_small_ops)")

    def _preemption_costs(self, page_bytes: int) -> tuple[float, float]:
        """Estimated seconds to move one KV page to the host and back, and to prefill one token
        (2 FLOPs per parameter), for preemption_mode="auto". Rough rates: a PCIe host link at
        ~20 GB/s and ~300 TFLOP/s of bf16 prefill on a GPU; a memcpy and ~100 GFLOP/s on a CPU.
        For the Llama-3-8B shape: 2 MB pages -> 0.2 ms per 16 tokens to swap, against ~0.9 ms to
        recompute them; for a 0.5B model the two are close."""
        bytes_s, flops_s = (20e9, 300e12) if self.device.type == "cuda" else (10e9, 1e11)
        params = sum(p.numel() for p in self.model.parameters())
        return 2 * page_bytes / bytes_s, 2 * params / flops_s

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: Union[str, Path], config: Optional[EngineConfig] = None, *, tokenizer=None,
                        **overrides) -> "RolloutEngine":
        """Load a local Hugging Face folder. `tokenizer`: None = load from the folder if it has
        tokenizer files, False = none, or a tokenizer object."""
        cfg = (config or EngineConfig()).replace(**overrides).validate()
        path = Path(path)
        model, hf_config = load_model(path, cfg.dtype, _default_device(cfg.device))
        if tokenizer is None:
            tokenizer = _load_tokenizer(path)
        gen_cfg = None
        if (path / "generation_config.json").exists():
            from transformers import GenerationConfig
            gen_cfg = GenerationConfig.from_pretrained(str(path), local_files_only=True)
        return cls(model, hf_config, cfg, tokenizer=tokenizer or None, generation_config=gen_cfg)

    @classmethod
    def from_config(cls, hf_config, config: Optional[EngineConfig] = None, *, tokenizer=None,
                    **overrides) -> "RolloutEngine":
        """Seeded random weights (EngineConfig.seed) from a transformers config (benchmarks, tests)."""
        cfg = (config or EngineConfig()).replace(**overrides).validate()
        device = _default_device(cfg.device)
        model = build_model(hf_config, resolve_dtype(cfg.dtype, hf_config, device), device)
        init_random(model, cfg.seed)
        return cls(model, hf_config, cfg, tokenizer=tokenizer)

    def _size_kv(self, num_pages, mem, page_size, kv_dtype, max_num_seqs, reserve: int = 0) -> int:
        """Pages: num_kv_pages, else kv_cache_memory bytes, else (CUDA) 85% of free memory less 2 GiB
        of headroom for activations and logits and less `reserve` (reserve_memory: bytes, or
        "weights" for one copy of the parameters, a full staged update; explicit sizes ignore it)."""
        if num_pages is not None:
            return int(num_pages) + 1      # + the trash page
        per_page = ModelRunner.kv_bytes_per_page(self.hf_config, page_size, kv_dtype)
        if mem is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                mem = int(free * 0.85) - (2 << 30) - int(reserve)
                if mem < per_page:
                    raise ValueError(f"no device memory left for the KV cache: {free / 1e9:.2f} GB free, "
                                     f"reserve_memory={reserve / 1e9:.2f} GB plus 2 GiB of headroom")
            else:
                mem = min(max_num_seqs * self.max_model_len * per_page // page_size, 1 << 30)
        return max(int(mem) // per_page, 2)

    def _kv_memory_of_share(self, util: float, page_size: int, kv_dtype, reserve: int) -> Optional[int]:
        """gpu_memory_utilization: KV bytes that keep the engine (weights, KV, 2 GiB headroom, `reserve`)
        within that share of the device's total, as vLLM's option does; None on CPU (no fixed budget)."""
        if self.device.type != "cuda":
            return None
        free, total = torch.cuda.mem_get_info(self.device)
        mem = int(total * util) - parameter_bytes(self.model) - (2 << 30) - int(reserve)
        if not ModelRunner.kv_bytes_per_page(self.hf_config, page_size, kv_dtype) <= mem <= free:
            raise ValueError(f"gpu_memory_utilization={util} leaves {mem / 1e9:.2f} GB for the KV cache "
                             f"({total / 1e9:.1f} GB device less weights, 2 GiB headroom and reserve_memory); it "
                             f"must hold a page and fit in the {free / 1e9:.2f} GB free")
        return mem

    @staticmethod
    def _eos_ids(hf_config, gen_cfg, tokenizer) -> set[int]:
        ids: set[int] = set()
        for src in (gen_cfg, hf_config, tokenizer):
            e = getattr(src, "eos_token_id", None) if src is not None else None
            if e is None:
                continue
            ids.update(e if isinstance(e, (list, tuple, set)) else [e])
        return ids

    # ---- input validation (before any state changes) -----------------------------------
    def _prepare(self, prompts, sampling_params) -> list[tuple[list[int], SamplingParams, Optional[str]]]:
        """(token ids, a validated copy of the params, text) per prompt; ValueError naming the first
        bad prompt or field, before anything is queued."""
        if _is_array(prompts) and getattr(prompts, "ndim", 0) == 2:
            prompts = prompts.tolist()        # a 2-D integer array: one prompt per row
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a list of prompts (strings or token-id lists), got "
                             f"{type(prompts).__name__}; wrap a single prompt in a list")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        else:
            params = [sampling_params] * len(prompts)
        out = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params for prompt {i} must be a rollout.SamplingParams, "
                                 f"got {type(p).__name__}")
            p = p.checked(self.vocab_size)
            if p.return_routed_experts and not self.model.sparse_layers:
                raise ValueError(f"sampling_params for prompt {i}: return_routed_experts=True needs a mixture-of-"
                                 f"experts model; {self.hf_config.model_type} has no MoE layer")
            if p.n > self.scheduler.max_num_seqs:
                raise ValueError(f"prompt {i}: n={p.n} samples exceed max_num_seqs={self.scheduler.max_num_seqs} "
                                 f"(a group's samples run together); raise max_num_seqs or split the group")
            out.append((self._token_ids(i, prompt), p, prompt if isinstance(prompt, str) else None))
        return out

    def _token_ids(self, i: int, prompt) -> list[int]:
        """Prompt i as checked token ids: its length first, then (for given ids) the vocabulary."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt {i} is text but the engine has no tokenizer; pass token ids")
            ids = self.tokenizer(prompt).input_ids
        elif prompt is None or isinstance(prompt, (bytes, bytearray)) or \
                not (isinstance(prompt, (list, tuple)) or (_is_array(prompt) and prompt.ndim == 1)):
            raise ValueError(f"prompt {i} must be a string or a list of token ids, got {type(prompt).__name__}")
        else:
            ids = prompt.tolist() if _is_array(prompt) else list(prompt)
        if len(ids) == 0:
            raise ValueError(f"prompt {i} is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt {i} has {len(ids)} tokens; max_model_len={self.max_model_len} "
                             f"leaves no room to generate")
        if isinstance(prompt, str):
            return ids
        bad = [t for t in ids if not _is_int(t) or not (0 <= t < self.vocab_size)]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {self.vocab_size}) "
                             f"(or not integers): {bad[:5]}")
        return [int(t) for t in ids]

    # ---- request lifecycle ----------------------------------------------------------------
    def _continuations(self, continue_from, prepared) -> list[Optional[Completion]]:
        """One validated Completion (or None) per prompt; ValueError naming the first bad one."""
        if continue_from is None:
            return [None] * len(prepared)
        if not isinstance(continue_from, (list, tuple)) or len(continue_from) != len(prepared):
            raise ValueError(f"continue_from must be a list of one Completion (or None) per prompt, "
                             f"{len(prepared)} here")
        for i, (c, (ids, p, _)) in enumerate(zip(continue_from, prepared)):
            if c is None:
                continue
            if not isinstance(c, Completion):
                raise ValueError(f"continue_from[{i}] must be a rollout Completion or None, got {type(c).__name__}")
            T = len(c.token_ids)
            if any(not _is_int(t) or not 0 <= t < self.vocab_size for t in c.token_ids):
                raise ValueError(f"continue_from[{i}].token_ids must be token ids in [0, {self.vocab_size})")
            for name in ("logprobs", "processed_logprobs", "kept_mass", "policy_versions") + \
                    (("top_logprobs",) if p.top_logprobs else ()):
                if len(getattr(c, name) or ()) != T:
                    raise ValueError(f"continue_from[{i}].{name} must have one entry per token ({T})")
            if p.n != 1:
                raise ValueError(f"continue_from[{i}]: a continuation is one sample; SamplingParams.n must be 1, "
                                 f"got {p.n}")
            if not _is_int(c.sample_index) or c.sample_index < 0:
                raise ValueError(f"continue_from[{i}].sample_index must be an integer >= 0")
            if T >= p.max_new_tokens:
                raise ValueError(f"continue_from[{i}] already has {T} tokens; max_new_tokens={p.max_new_tokens} "
                                 f"counts the whole completion")
            if len(ids) + T >= self.max_model_len:
                raise ValueError(f"continue_from[{i}]: prompt + completion ({len(ids) + T} tokens) leave no room "
                                 f"under max_model_len={self.max_model_len}")
        return list(continue_from)

    @_serialized
    def add_requests(self, prompts, sampling_params=None, continue_from=None) -> list[int]:
        """Queue prompts; returns their request ids. continue_from: one Completion (or None) per prompt,
        a partial completion of it (aborted, or stopped at a turn) to go on with: its tokens, logprobs
        and policy versions stay at the head of the output, their KV comes from the prefix cache where
        it still is (same weights version), new tokens carry the live version, and max_new_tokens
        counts the whole completion. Its sample_index, with the same seed, keeps the sampler's stream:
        a seeded continuation samples what the uninterrupted run would have."""
        self._check_awake()
        prepared = self._prepare(prompts, sampling_params)
        conts = self._continuations(continue_from, prepared)
        ids = []
        for (prompt_ids, p, text), cont in zip(prepared, conts):
            seed = p.seed if p.seed is not None else self._rng.randrange(2 ** 31)
            req = Request(self._next_id, prompt_ids, p, seed, prompt=text, continue_from=cont)
            req.routed_shape = (len(self.model.sparse_layers), self.model.top_k)
            self._next_id += 1
            self.requests[req.request_id] = req
            self.scheduler.add(req)
            ids.append(req.request_id)
        return ids

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None or bool(self._ready)

    @_serialized
    def step(self) -> list[RequestOutput]:
        """Schedule and launch batch k, then wait for batch k-1 and process its outputs
        (stops, freed pages). Returns the requests that finished."""
        t0 = time.perf_counter()
        self.kv.weights_version = self.policy_version   # sequences started now chain from this version's root
        sched = self.scheduler.schedule(self._drafts(t0) if self.speculator is not None else None)
        sched.policy_version = self.policy_version
        launched = None
        if sched.items:
            try:
                launched = self.pipeline.launch(sched)
                self.metrics["steps"] += 1
                self.metrics["prefill_tokens"] += sum(i.num_new for i in sched.items
                                                      if i.num_new - i.num_draft > 1 or i.num_samples == 0)
            except Exception as exc:          # a fault in this step fails only its requests
                self._fail(sched, exc)
        elif self._inflight is None and self.scheduler.has_work():
            self._fail_stuck()      # not reachable for validated requests; never let one wedge the engine
        prev, self._inflight = self._inflight, launched
        if sched.num_drafted and launched is not None:   # verified now: the next drafts need its tokens
            prev, self._inflight = launched, None
        t1 = time.perf_counter()
        finished = self._complete(prev) if prev is not None else []
        if self.cpu_spans is not None:       # timeline: host work vs waiting on the device
            self.cpu_spans.append(("schedule+build+launch", t0, t1))
            self.cpu_spans.append(("wait+update", t1, time.perf_counter()))
        ready, self._ready = self._ready + finished, []
        return ready

    def _complete(self, flight: InFlight) -> list[RequestOutput]:
        try:
            out = self.pipeline.wait(flight)
        except Exception as exc:
            self._fail(flight.sched, exc)
            return []
        cols = self._columns(out, flight.top_n)
        routed = flight.routed.numpy() if flight.routed is not None else None
        sched = flight.sched
        finished = self.scheduler.update_columns(sched, *cols, routed=routed)
        self.metrics["generated_tokens"] += len(cols[0]) - sched.num_unused_rows
        if sched.num_drafted:
            self.speculator.observe(sched.num_drafted, sched.num_accepted, sum(i.num_draft > 0 for i in sched.items))
        return [self._finish(r) for r in finished]

    def _drafts(self, now: float) -> Optional[dict]:
        """This step's drafts, or None: the speculator's k for the running rows; drafting needs every
        token known, so the batch in flight is finished first (the drafted step runs without the lag)."""
        graphs = self.pipeline.graphs       # the speed gate's clock stops while a graph is captured on first use
        now -= graphs.capture_on_use_s if graphs is not None else 0.0
        k = self.speculator.draft_len(self.scheduler.running, now)
        if not k:
            return None
        if self._inflight is not None:
            flight, self._inflight = self._inflight, None
            self.speculator.counts["spec_drains"] += 1
            self._ready += self._complete(flight)
        return self.speculator.propose(self.scheduler.running, k)

    def _fail(self, sched: SchedulerOutput, exc: Exception) -> None:
        """Finish every request with a sequence in the failed batch: finish_reason "error",
        the exception in RequestOutput.error, pages freed. Other requests go on."""
        log.error("step failed; failing its requests: %r", exc)
        self.metrics["failed_steps"] += 1
        for rid in {i.seq.request.request_id for i in sched.items}:
            req = self.requests.get(rid)
            if req is not None:
                req.error = f"{type(exc).__name__}: {exc}"
                self.scheduler.abort_request(req, "error")
                self._ready.append(self._finish(req))
        self.kv.alloc.clear_cache()     # the failed step's KV writes are unknown: cache nothing from before it

    def _fail_stuck(self) -> None:
        """Nothing could be scheduled and nothing is in flight: fail the request at the head of the
        queue (or the running ones) with finish_reason "error" instead of stopping every later call."""
        sch = self.scheduler
        stuck = [sch.waiting[0]] if sch.waiting else list(sch.running)
        exc = RuntimeError("the scheduler could not make progress with this request (KV cache, max_num_seqs "
                           "or max_num_batched_tokens too small for it)")
        self._fail(SchedulerOutput(items=[ScheduledSeq(seq, 0, 0) for seq in stuck]), exc)

    @_serialized
    def drain(self) -> list[RequestOutput]:
        """Finish the batch in flight; return every finished request not yet handed out."""
        if self._inflight is not None:
            flight, self._inflight = self._inflight, None
            self._ready += self._complete(flight)
        ready, self._ready = self._ready, []
        return ready

    def _finish(self, req: Request) -> RequestOutput:
        del self.requests[req.request_id]
        if self.speculator is not None:
            self.speculator.drafter.remember(req)
        return req.output(self.tokenizer)

    @staticmethod
    def _columns(out: Optional[SamplerOutput], top_n: int) -> tuple[list, list, list, list, Optional[list]]:
        """Sampled tokens, logprobs, processed logprobs, kept mass (and top logprobs) as lists."""
        if out is None:
            return [], [], [], [], None
        tops = None
        if top_n and out.top_ids is not None:
            tops = [dict(zip(i, v)) for i, v in zip(out.top_ids.tolist(), out.top_logprobs.tolist())]
        return (out.token_ids.tolist(), out.logprobs.tolist(), out.processed_logprobs.tolist(),
                out.kept_mass.tolist(), tops)

    @_serialized
    def pending(self, request_id: int) -> bool:
        """Not yet handed out: queued, running, or finished and held for the next step() to return."""
        _check_request_id(request_id)
        return request_id in self.requests or any(o.request_id == request_id for o in self._ready)

    @_serialized
    def progress(self, request_id: int, since: Optional[dict] = None) -> Optional[RequestOutput]:
        """The request's output so far (tokens whose values are known, none still in flight; one
        completion until its group forks after the prefill), or None once it finished and was
        handed out. since: {sample index: tokens already seen}; each completion then holds only the
        newer ones, so a streaming caller copies each token once. Call between steps."""
        _check_request_id(request_id)
        if since is not None and not (isinstance(since, dict) and all(
                _is_int(k) and _is_int(v) and v >= 0 for k, v in since.items())):
            raise ValueError(f"since must be a dict of sample index -> tokens seen (integers >= 0), got {since!r}")
        req = self.requests.get(request_id)
        if req is None:
            return None
        since = since or {}
        comps = []
        for s in sorted(req.seqs, key=lambda s: s.sample_index):
            a, k, p = since.get(s.sample_index, 0), len(s.logprobs), s.num_prompt   # logprobs: tokens landed
            comps.append(Completion(
                token_ids=s.token_ids[p + a:p + k], logprobs=s.logprobs[a:k],
                processed_logprobs=s.processed_logprobs[a:k], kept_mass=s.kept_mass[a:k],
                finish_reason=s.finish_reason, policy_versions=s.policy_versions[a:k],
                top_logprobs=s.top_logprobs[a:k] if req.params.top_logprobs else None))
        return RequestOutput(req.request_id, req.prompt_ids, comps, req.prompt, req.params)

    @_serialized
    def abort(self, request_ids: Seq[int], reason: str = "abort") -> list[RequestOutput]:
        """Finish the given requests now (finish_reason `reason`); their pages are freed and
        the partial outputs returned. Tokens still in flight for them are discarded when
        their batch completes."""
        if isinstance(request_ids, (str, bytes)) or not isinstance(request_ids, (list, tuple, set)) \
                or not all(_is_int(r) for r in request_ids):
            raise ValueError(f"request_ids must be a list of integer request ids, got {request_ids!r}")
        outs = []
        for rid in request_ids:
            req = self.requests.get(int(rid))
            if req is None:
                continue
            self.scheduler.abort_request(req, reason)
            outs.append(self._finish(req))
        return outs

    @_serialized
    def generate(self, prompts: Seq[Prompt], sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order."""
        ids = self.add_requests(prompts, sampling_params)
        wanted = set(ids)
        done: dict[int, RequestOutput] = {}
        bar = _progress(len(ids), use_tqdm)
        start, gen0 = time.perf_counter(), self.metrics["generated_tokens"]
        shown = start
        while wanted - done.keys():
            finished = [out for out in self.step()]
            for out in finished:
                done[out.request_id] = out
            now = time.perf_counter()
            # Long generations finish together at the end: refresh the rate every few seconds.
            if bar is not None and (finished or now - shown > 5.0):
                bar.update(sum(out.request_id in wanted for out in finished))
                gen = self.metrics["generated_tokens"] - gen0
                bar.set_postfix(tokens=gen, tok_s=f"{gen / max(now - start, 1e-9):.0f}")
                shown = now
        if bar is not None:
            bar.close()
        return [done[i] for i in ids]

    # ---- sleep / wake: the device memory handed to a colocated trainer between generations ----------
    @property
    def sleep_level(self) -> int:
        return 2 if "weights" in self.asleep else 1 if self.asleep else 0

    @property
    def weights_discarded(self) -> bool:
        """sleep(2, discard_weights=True) dropped the weights and no update has landed since."""
        return self._discarded_at is not None and self.policy_version == self._discarded_at

    def _check_awake(self) -> None:
        if self.asleep:
            raise RuntimeError(f"engine is asleep (level {self.sleep_level}); call wake() first")
        if self.weights_discarded:
            raise RuntimeError("the weights were discarded by sleep(level=2, discard_weights=True): send a full "
                               "weight update (RolloutWorker.update_weights) before generating")

    @_serialized
    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (vLLM's `reset_prefix_cache`): later requests prefill in full, as a
        prefill benchmark needs. Pages that queued or running sequences hold stay theirs. Returns the pages
        forgotten."""
        forgotten = self.kv.alloc.num_cached
        self.kv.alloc.clear_cache()
        return forgotten

    @_serialized
    def sleep(self, level: int = 1, discard_weights: bool = False) -> dict:
        """Give device memory back between generations; needs no request queued or running. Level 1: the KV
        cache (prefix cache emptied), the decode graphs and their pool, torch's cached blocks. Level 2: the
        weights too, copied to pinned host memory, or dropped (discard_weights: the next full update refills
        them; generating before one raises). Parts already asleep stay so. Returns released_bytes (what we
        freed by our count), device_freed_bytes (CUDA: the drop in torch's reserved memory) and seconds."""
        if isinstance(level, bool) or not isinstance(level, int) or level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (KV cache) or 2 (KV cache and weights), got {level!r}")
        if discard_weights and level != 2:
            raise ValueError("discard_weights=True applies to level 2 (level 1 keeps the weights on the device)")
        if self.requests:
            raise RuntimeError(f"sleep needs an idle engine: requests {sorted(self.requests)[:8]} are queued or "
                               f"running; let them finish or abort them first")
        self._ready += self.drain()       # nothing of ours on the device past this point
        if self.device.type == "cuda":    # (a weight commit on the compute stream included)
            torch.cuda.synchronize(self.device)
        t0, before, released = time.perf_counter(), _reserved(self.device), 0
        if "kv_cache" not in self.asleep:
            if self.pipeline.graphs is not None:      # they hold the pool's and the weights' addresses
                self.pipeline.graphs.reset()
            self.kv.alloc.clear_cache()
            released += self.runner.release_kv()
            self.asleep.add("kv_cache")
        if level == 2 and "weights" not in self.asleep:
            released += self.runner.release_weights(keep=not discard_weights)
            self.asleep.add("weights")
            self._discarded_at = self.policy_version if discard_weights else None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        freed = before - _reserved(self.device) if self.device.type == "cuda" else None
        return {"level": self.sleep_level, "released_bytes": released, "device_freed_bytes": freed,
                "seconds": time.perf_counter() - t0}

    @_serialized
    def wake(self, tags: Optional[Seq[str]] = None) -> dict:
        """Bring back what sleep freed: tags None (everything), or some of "weights", "kv_cache" (vLLM's
        names: wake the weights alone to take an update before the KV cache returns). The KV cache comes
        back empty; the decode graphs sleep dropped are captured again on first use, one key (slot, batch
        bucket, sampling mode) at a time (stats: graph_captures, graph_capture_on_use_s)."""
        parts = {"weights", "kv_cache"} if tags is None else set([tags] if isinstance(tags, str) else tags)
        if not parts or not parts <= {"weights", "kv_cache"}:
            raise ValueError(f"wake tags must be drawn from ['weights', 'kv_cache'] (or None: both), got {tags!r}")
        t0 = time.perf_counter()
        if "weights" in parts & self.asleep:
            self.runner.restore_weights()
            self.asleep.discard("weights")
        if "kv_cache" in parts & self.asleep:
            try:
                self.runner.restore_kv()
            except torch.OutOfMemoryError as exc:     # stays asleep; a later wake may find the room
                self.runner.release_kv()
                raise RuntimeError(f"wake: no device room for the KV cache ({self.kv.alloc.num_pages} pages); "
                                   f"size it for the memory a colocated trainer leaves (gpu_memory_utilization, "
                                   f"kv_cache_memory)") from exc
            self.asleep.discard("kv_cache")
        if self.device.type == "cuda":    # restored on this stream; the pipeline's streams read them next
            torch.cuda.synchronize(self.device)
        return {"level": self.sleep_level, "seconds": time.perf_counter() - t0}

    # ---- scoring --------------------------------------------------------------------------
    @_serialized
    def score(self, sequences: Seq[list[int]], temperature: float = 1.0) -> list[list[float]]:
        """Per-token logprobs of given sequences: out[i][j] = log p(seq[j+1] | seq[:j+1]) under
        log_softmax(logits / temperature), fp32 (length len(seq) - 1). Runs between steps on
        its own pages, so it never disturbs scheduled requests."""
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
                or not math.isfinite(temperature) or temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be a finite number >= {MIN_TEMPERATURE} for scoring, got {temperature!r}")
        self._check_awake()
        prepared = self._prepare(sequences, SamplingParams())
        if any(len(ids) < 2 for ids, _, _ in prepared):
            raise ValueError("score needs sequences of at least 2 tokens")
        self._ready += self.drain()      # handed out by the next step()
        return [self._score_one(ids, float(temperature)) for ids, _, _ in prepared]

    def _score_one(self, ids: list[int], temperature: float) -> list[float]:
        req = Request(-1, ids, SamplingParams(), 0)
        seq = req.seqs[0]
        builder = self.pipeline.slots[0].builder
        chunk = builder.dims[0]      # max tokens per step
        if self.kv.pages_for(len(ids)) > self.kv.alloc.num_free:
            raise RuntimeError("not enough free KV pages to score now; retry when the engine is idle")
        out: list[float] = []
        try:
            while seq.num_computed < len(ids) - 1:
                n = min(chunk, len(ids) - 1 - seq.num_computed)
                start = seq.num_computed
                sched = SchedulerOutput(items=[ScheduledSeq(seq, n, 0, start)])
                self.kv.append(seq, n, sched.copies)
                batch = builder.build(sched)
                idx = torch.arange(n)
                batch.logits_indices = idx
                targets = torch.tensor(ids[start + 1:start + n + 1])
                out += self.runner.score(batch, targets, temperature).tolist()
                seq.num_computed += n
        finally:
            self.kv.free(seq)
        return out


def _reserved(device: torch.device) -> int:
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0


def _check_request_id(request_id) -> None:
    if not _is_int(request_id):
        raise ValueError(f"request_id must be an integer request id, got {request_id!r}")


def _load_tokenizer(path: Path):
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="generate", unit="req")
