"""TRL plug-in generator: our RolloutWorker as the completion backend of TRL's GRPOTrainer / RLOOTrainer.

Route A (primary): `attach_generator(trainer, worker)` puts a `TRLGenerationAdapter` into the trainer's vLLM
generation slot (`trainer.vllm_generation`, a private seam of trl 1.16; TRL never imports vLLM) and keeps TRL's
importance-sampling (IS) correction. Route B: `make_rollout_func(worker)` for TRL's public `rollout_func=` hook
(no IS correction there), also for multi-turn trajectories (rollout.multiturn) under TRL's env_mask.
Route C (AsyncGRPOTrainer): `trainers.trl_async`.

Logprob contract: per sampled token, fp32 `log_softmax(logits / T)` over the full vocabulary, T = `args.temperature`:
what TRL recomputes (no top-p/top-k/min-p renormalisation, no repetition penalty).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import torch

from rollout.request import SamplingParams

# The tested trl range: the generation slot, `_metrics`, `_last_loaded_step` and AsyncGRPO are private seams.
TRL_MIN_VERSION = "1.16"
TRL_MAX_VERSION = "1.17"   # exclusive
TRL_REQUIREMENT = f"trl>={TRL_MIN_VERSION},<{TRL_MAX_VERSION}"

# Wrapper names never in the checkpoint: DDP / accelerate, torch.compile, activation checkpointing, FSDP1.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")
_WRAPPER_INFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


# ---- version guard ------------------------------------------------------------------------------------------
def check_trl_version(version: Optional[str] = None) -> str:
    """Raise a clear error unless trl (or `version`) is in the tested range; return the version."""
    from packaging.version import Version
    if version is None:
        try:
            import trl
        except ImportError as exc:   # pragma: no cover - trl is a test dependency
            raise ImportError(f"the TRL adapters need {TRL_REQUIREMENT} (pip install '{TRL_REQUIREMENT}')") from exc
        version = trl.__version__
    v = Version(version)
    if not (Version(TRL_MIN_VERSION) <= Version(v.base_version) < Version(TRL_MAX_VERSION)):
        raise RuntimeError(
            f"rollout's TRL adapters are tested with {TRL_REQUIREMENT} but trl {version} is installed. They plug into "
            f"private trl seams (trainer.vllm_generation, _last_loaded_step, _metrics) that change between releases; "
            f"install '{TRL_REQUIREMENT}' or use the public rollout_func route (make_rollout_func) after checking it.")
    return version


# ---- GRPOConfig / RLOOConfig -> SamplingParams -----------------------------------------------------------------
# generation_kwargs keys (vLLM SamplingParams names, plus the transformers spelling max_new_tokens) -> ours.
_KWARG_ALIASES = {"max_tokens": "max_new_tokens", "max_new_tokens": "max_new_tokens", "temperature": "temperature",
                  "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                  "seed": "seed", "stop": "stop", "ignore_eos": "ignore_eos", "stop_token_ids": "stop_token_ids"}
# Keys that change nothing we return (output formatting, or what the adapter always does).
_KWARG_HARMLESS = {"n", "logprobs", "skip_special_tokens", "spaces_between_special_tokens", "detokenize",
                   "include_stop_str_in_output", "output_kind", "prompt_logprobs", "do_sample", "eos_token_id",
                   "pad_token_id", "bos_token_id", "use_cache", "cache_implementation", "return_dict_in_generate"}


def sampling_params_from_trl_args(args, eos_ids: Iterable[int]) -> SamplingParams:
    """A GRPOConfig / RLOOConfig / AsyncGRPOConfig as our SamplingParams (n=1; the adapter sets n per request).

    generation_kwargs (`_KWARG_ALIASES`) override the config's fields, formatting keys are ignored, anything else
    raises. The engine stops on exactly eos_ids (TRL's EOS; dropped by ignore_eos=True) plus stop_token_ids.
    """
    kw = getattr(args, "generation_kwargs", None) or {}
    if isinstance(kw, str):   # a JSON string (CLI); TRL's configs usually parse it already
        import json
        kw = json.loads(kw)
    kw = dict(kw)
    min_p = getattr(args, "min_p", None)
    fields: dict[str, Any] = dict(
        max_new_tokens=args.max_completion_length, temperature=float(args.temperature),
        top_p=float(getattr(args, "top_p", 1.0)), top_k=getattr(args, "top_k", 0),
        min_p=None if min_p is None else float(min_p),
        repetition_penalty=float(getattr(args, "repetition_penalty", 1.0)),
        seed=None, stop=[], ignore_eos=False, stop_token_ids=[])
    unknown = sorted(k for k in kw if k not in _KWARG_ALIASES and k not in _KWARG_HARMLESS)
    if unknown:
        raise ValueError(f"generation_kwargs {unknown} are not supported by the rollout engine (supported: "
                         f"{sorted(_KWARG_ALIASES)}; ignored as formatting-only: {sorted(_KWARG_HARMLESS)})")
    if kw.get("do_sample") is False:
        raise ValueError("generation_kwargs do_sample=False (greedy) would make the sampling logprobs disagree with "
                         "the trainer's recompute at args.temperature; set temperature instead")
    for key, value in kw.items():
        if key in _KWARG_ALIASES:
            fields[_KWARG_ALIASES[key]] = value
    if fields["top_k"] is None or fields["top_k"] < 0:
        fields["top_k"] = 0
    if fields["min_p"] is None:
        fields["min_p"] = 0.0
    stop = fields["stop"]
    fields["stop"] = [stop] if isinstance(stop, str) else list(stop or [])
    stop_ids = [int(t) for t in (fields["stop_token_ids"] or [])]
    if not fields["ignore_eos"]:
        stop_ids = [int(t) for t in eos_ids if t is not None] + stop_ids
    fields["stop_token_ids"] = list(dict.fromkeys(stop_ids))   # dedup, keep order
    fields["ignore_eos"] = True       # the engine's own EOS set is replaced by the trainer's
    fields["max_new_tokens"] = int(fields["max_new_tokens"])
    fields["top_k"] = int(fields["top_k"])
    if "temperature" in kw and float(kw["temperature"]) != float(args.temperature):
        warnings.warn(f"generation_kwargs temperature={kw['temperature']} differs from args.temperature="
                      f"{args.temperature}: TRL recomputes logprobs at args.temperature, so the IS ratio is biased",
                      stacklevel=2)
    return SamplingParams(n=1, detokenize=False, **fields)


# ---- weights: trainer model -> our HF names ----------------------------------------------------------------------
def _strip_wrappers(name: str) -> str:
    while name.startswith(_WRAPPER_PREFIXES):
        name = name.split(".", 1)[1]          # each prefix is one dotted component
    for p in _WRAPPER_INFIXES:
        name = name.replace(p, "")
    return name


class _TRLParamWalker:
    """trl's VLLMGeneration parameter walk (FSDP1/2, ZeRO-3 gathers, PEFT merge, renames) without building it."""

    def __init__(self, model, accelerator, dist):
        from trl.generation.vllm_generation import VLLMGeneration as V
        self.model, self.accelerator, self._dist = model, accelerator, dist
        for name in ("_iter_named_params", "_iter_fsdp_params", "_iter_fsdp1_params", "_iter_fsdp2_params",
                     "_fix_param_name_to_vllm"):
            setattr(self, name, getattr(V, name).__get__(self))


def iter_trainer_weights(trainer) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) per parameter of the trainer's model, checkpoint names, PEFT merged. Every rank must iterate
    (the gathers are collectives); a tensor is valid only until the generator advances."""
    model = trainer.model
    acc = getattr(trainer, "accelerator", None)
    if acc is not None:
        with contextlib.suppress(Exception):   # unusual wrappers
            model = acc.unwrap_model(model)
    dist = getattr(trainer, "_dist", None)
    if dist is not None and acc is not None:
        walker = _TRLParamWalker(model, acc, dist)
        for name, t in walker._iter_named_params():
            yield _strip_wrappers(name), t
        return
    for name, p in model.named_parameters():   # plain walk (no TRL distributed backend)
        yield _strip_wrappers(name), p.data


class _WeightMapper:
    """Maps trainer parameter names onto the worker's HF tensor names and casts to the worker's dtype/device."""

    def __init__(self, worker, name_map: Optional[Callable[[str], Optional[str]]] = None):
        self.name_map = name_map
        self.targets = worker.weights.targets        # hf name -> the engine's view (dtype, device, shape)

    def map(self, named: Iterable[tuple[str, torch.Tensor]], *, copy: bool) -> list[tuple[str, torch.Tensor]]:
        out, seen, embed = [], set(), None
        for name, t in named:
            name = _strip_wrappers(name)
            if self.name_map is not None:
                name = self.name_map(name)
                if name is None:
                    continue
            if name not in self.targets and name == "lm_head.weight":
                continue               # tied in the engine: the embedding carries it
            if name in self.targets:
                dst = self.targets[name]
                t = t.detach().to(device=dst.device, dtype=dst.dtype, copy=copy)
            if name == "model.embed_tokens.weight":
                embed = t
            out.append((name, t))      # unknown names are rejected whole by the worker (WeightUpdateError)
            seen.add(name)
        if "lm_head.weight" in self.targets and "lm_head.weight" not in seen and embed is not None:
            out.append(("lm_head.weight", embed))   # trainer ties, engine holds a separate head
        return out


# ---- route A: the vLLM-generation slot -------------------------------------------------------------------------------
def _consecutive_runs(prompts: Sequence[Sequence[int]], max_len: int) -> list[tuple[int, int]]:
    """(start, length) of runs of identical consecutive rows, each run at most max_len long."""
    runs, i = [], 0
    while i < len(prompts):
        j = i + 1
        while j < len(prompts) and j - i < max_len and list(prompts[j]) == list(prompts[i]):
            j += 1
        runs.append((i, j - i))
        i = j
    return runs


def _request_seed(base: int, call: int, index: int) -> int:
    # Distinct per request (two requests of the same prompt must not replay the same samples), reproducible per run.
    return (base * 1_000_003 + call * 10_007 + index * 97 + 1) % (2 ** 31)


class TRLGenerationAdapter:
    """Duck-types `trl.generation.VLLMGeneration` (trl 1.16) over a rank-local `RolloutWorker`.

    `sync_weights()` stages the trainer's weights as version `trainer.state.global_step` (committed at the worker's
    next batch boundary). `generate` returns one row per input row; consecutive identical rows (TRL's G copies) are
    one request with n = run length. Per batch it appends `gen/*` metrics to `trainer._metrics[mode]`.

    Colocated (`sleep_level`): the worker sleeps after each generate, so the trainer's loss, backward and optimizer
    step have its memory, and wakes before the next (TRL's seam for vLLM's sleep mode). "auto": level 1 when the
    engine is in this process on the trainer's CUDA device, else off; 1, 2 or None force it. At level 2 the weights
    wake first in sync_weights, for the update to land in place; discard_weights (default) drops them at sleep
    instead of copying them to host memory, since the trainer sends them before every generation anyway.
    """

    mode = "server"     # what TRL's tool loop checks (it then reads max_model_len from the model config)

    def __init__(self, worker, trainer, *, metrics_prefix: str = "gen/",
                 name_map: Optional[Callable[[str], Optional[str]]] = None,
                 sampling_params: Optional[SamplingParams] = None, log_metrics: bool = True,
                 sleep_level: Union[int, str, None] = "auto", discard_weights: bool = True):
        self.worker = worker
        self.trainer = trainer
        self.metrics_prefix = metrics_prefix
        self.log_metrics = log_metrics
        self.model = trainer.model
        self.accelerator = getattr(trainer, "accelerator", None)
        self.processing_class = getattr(trainer, "processing_class", None)
        self.eos_token_ids = _trainer_eos_ids(trainer)
        self.sampling_params = sampling_params or sampling_params_from_trl_args(trainer.args, self.eos_token_ids)
        sp = self.sampling_params
        # mirrors of VLLMGeneration's public attributes
        self.temperature, self.top_p, self.top_k, self.min_p = sp.temperature, sp.top_p, sp.top_k, sp.min_p
        self.repetition_penalty, self.max_completion_length = sp.repetition_penalty, sp.max_new_tokens
        self.generation_kwargs = dict(getattr(trainer.args, "generation_kwargs", None) or {})
        self._mapper = _WeightMapper(worker, name_map)
        self._offset = 0              # worker version = trainer global_step + offset (0 unless forced, see below)
        self._synced = False
        self._calls = 0
        self._last_sync_ms = 0.0
        self.sync_history: list[int] = []       # trainer versions pushed (or adopted)
        self.batch_versions: list[list[int]] = []  # per generate call: sorted distinct token versions (trainer terms)
        self.sleep_level = _resolve_sleep_level(sleep_level, worker, trainer)
        self.discard_weights = bool(discard_weights) and self.sleep_level == 2
        self.sleep_reports: list[dict] = []      # RolloutWorker.sleep's report after each generate
        self.wake_reports: list[dict] = []       # and wake's, before each (weights, then the rest at level 2)

    def to_trainer_version(self, worker_version: int) -> int:
        return worker_version - self._offset

    # -- weights ------------------------------------------------------------------------------------------------------
    def sync_weights(self) -> None:
        t0 = time.perf_counter()
        if self.sleep_level == 2:       # the weights' storage back first: the update lands in place
            self.wake_reports.append(self.worker.wake(["weights"]))
        step = int(self.trainer.state.global_step)
        dist = getattr(self.trainer, "_dist", None)
        sharded = bool(getattr(self.trainer, "is_deepspeed_enabled", False) or getattr(dist, "is_fsdp", False))
        # copy while gathered / merged (ZeRO-3 / FSDP free the gathered tensor as the walk moves on, PEFT unmerges
        # in place at its end); otherwise the worker's staging copy is the only one
        items = self._mapper.map(iter_trainer_weights(self.trainer), copy=sharded or _is_peft(self.trainer.model))
        with worker_lock(self.worker):        # no commit can run between reading the versions and staging
            newest = newest_worker_version(self.worker)
            if step + self._offset > newest:
                self.worker.update_weights(items, version=step + self._offset)
            elif not self._synced and self._same_as_live(items):
                # first sync and the worker already serves these exact weights: adopt them as this version
                self._offset = self.worker.policy_version - step
            else:
                # the worker went past this version (it served another trainer): monotone, reported via the offset
                self._offset = newest + 1 - step
                self.worker.update_weights(items, version=step + self._offset)
        self._synced = True
        self.sync_history.append(step)
        self._last_sync_ms = (time.perf_counter() - t0) * 1e3

    def _same_as_live(self, items) -> bool:
        eng = self.worker.engine
        if getattr(self.worker, "remote", False) or getattr(self.worker.weights, "pending", None) is not None \
                or getattr(eng, "asleep", None) or getattr(eng, "weights_discarded", False):
            return False          # a remote worker's tensors are not here to compare (or not there at all): push
        targets, model = self._mapper.targets, self.worker.engine.model
        names = {n for n, _ in items}
        if not names <= set(targets) or model.hf_missing(names):    # a full set (stacked experts count whole)
            return False
        return all(torch.equal(t, targets[n]) for n, t in items)

    # -- generation ----------------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], images=None, num_generations: int = 1, profiler=None):
        if images is not None and any(im is not None for im in images):
            raise NotImplementedError("the rollout engine serves text-only models; got images")
        prompts = [list(p) for p in prompts]
        if not prompts:
            return [], [], [], []
        runs = _consecutive_runs(prompts, max(1, int(num_generations or 1)))
        params = self._params(runs)
        barrier0 = self.worker.weights.metrics.get("barrier_ms", 0.0)
        t0 = time.perf_counter()
        with (profiler if profiler is not None else contextlib.nullcontext()):
            if self.sleep_level:
                if self.worker.engine.weights_discarded:   # no step since the last sync (eval): send them again
                    self.sync_weights()
                self.wake_reports.append(self.worker.wake())
            outs = self._run([prompts[s] for s, _ in runs], params)
            if self.sleep_level:
                self.sleep_reports.append(self.worker.sleep(self.sleep_level, self.discard_weights))
        wall = time.perf_counter() - t0
        prompt_ids, completion_ids, logprobs, token_ids = [], [], [], []
        versions: list[int] = []
        ntok = 0
        for (start, n), out in zip(runs, outs):
            if getattr(out, "error", None):
                raise RuntimeError(f"rollout worker failed request {out.request_id}: {out.error}")
            if len(out.completions) != n:
                raise RuntimeError(f"worker returned {len(out.completions)} completions for n={n}")
            for c in out.completions:
                prompt_ids.append(list(prompts[start]))
                completion_ids.append(list(c.token_ids))          # EOS only if sampled; never appended
                logprobs.append([[float(lp)] for lp in c.logprobs])
                token_ids.append([[int(t)] for t in c.token_ids])
                versions += c.policy_versions
                ntok += len(c.token_ids)
        if self.log_metrics:
            self._log_batch(versions, ntok, wall, self.worker.weights.metrics.get("barrier_ms", 0.0) - barrier0)
        return prompt_ids, completion_ids, logprobs, token_ids

    def _params(self, runs) -> list[SamplingParams]:
        """One request per run of identical rows (n = its length), seeded per call and run."""
        base, call = self.sampling_params, self._calls
        self._calls += 1
        return [dataclasses.replace(base, n=n, seed=None if base.seed is None else _request_seed(base.seed, call, k))
                for k, (_, n) in enumerate(runs)]

    def _run(self, prompts, params):
        if getattr(self.worker, "_thread", None) is not None:     # the worker's background loop is running
            return self.worker.submit(prompts, params).result()
        return self.worker.generate(prompts, params)

    def _log_batch(self, versions, ntok, wall, barrier_ms) -> None:
        step = int(self.trainer.state.global_step)
        live = self.to_trainer_version(self.worker.policy_version)
        tv = sorted({self.to_trainer_version(v) for v in versions}) or [live]
        self.batch_versions.append(tv)
        metrics = getattr(self.trainer, "_metrics", None)
        if metrics is None:
            return
        mode = "train" if getattr(self.trainer.model, "training", True) else "eval"
        m, p = metrics[mode], self.metrics_prefix
        m[p + "policy_version"].append(float(tv[0]))           # oldest weights that sampled a token of this batch
        m[p + "policy_version_lag"].append(float(step - tv[0]))
        m[p + "tokens_per_s"].append(ntok / wall if wall > 0 else 0.0)
        m[p + "weight_barrier_ms"].append(float(barrier_ms))
        m[p + "weight_sync_ms"].append(float(self._last_sync_ms))
        self._last_sync_ms = 0.0
        if self.sleep_level and self.sleep_reports:
            rep = self.sleep_reports[-1]
            m[p + "sleep_s"].append(rep["seconds"])
            m[p + "wake_s"].append(self.wake_reports[-1]["seconds"])
            freed = rep["device_freed_bytes"]
            m[p + "sleep_freed_gb"].append((rep["released_bytes"] if freed is None else freed) / 1e9)


def _shares_device(worker, trainer) -> bool:
    """The worker's engine runs in this process on the trainer's CUDA device."""
    dev = getattr(getattr(worker, "engine", None), "device", None)
    acc_dev = getattr(getattr(trainer, "accelerator", None), "device", None)
    if getattr(worker, "remote", False) or dev is None or acc_dev is None:
        return False
    a, b = torch.device(dev), torch.device(acc_dev)
    if a.type != "cuda" or b.type != "cuda":
        return False
    return (a.index if a.index is not None else torch.cuda.current_device()) == \
        (b.index if b.index is not None else torch.cuda.current_device())


def _resolve_sleep_level(level, worker, trainer) -> int:
    if level == "auto":
        return 1 if _shares_device(worker, trainer) else 0
    if level is None or level == 0:
        return 0
    if isinstance(level, bool) or level not in (1, 2):
        raise ValueError(f"sleep_level must be 'auto', None, 1 or 2, got {level!r}")
    if getattr(worker, "remote", False) or not callable(getattr(worker, "sleep", None)):
        raise ValueError(f"sleep_level={level} needs an in-process RolloutWorker (sleep / wake), got "
                         f"{type(worker).__name__}")
    return level


def _is_peft(model) -> bool:
    try:
        from accelerate.utils import is_peft_model
    except ImportError:   # pragma: no cover
        return False
    inner = getattr(model, "module", model)
    return bool(is_peft_model(model) or is_peft_model(inner))


def worker_lock(worker):
    """The worker's step lock: (policy_version, pending update) read together, never a commit half done."""
    locked = getattr(worker, "locked", None)
    return locked() if locked is not None else contextlib.nullcontext()


def newest_worker_version(worker) -> int:
    """The version of the newest weights the worker has: staged (pending) or live."""
    with worker_lock(worker):
        pending = getattr(worker.weights, "pending", None)
        return max(worker.policy_version, pending.version if pending is not None else -1)


def _trainer_eos_ids(trainer) -> list[int]:
    ids = getattr(trainer, "eos_token_ids", None)
    if ids:
        return [int(i) for i in ids if i is not None]
    tok = getattr(trainer, "processing_class", None)
    tok = getattr(tok, "tokenizer", tok)
    e = getattr(tok, "eos_token_id", None)
    return [] if e is None else ([int(x) for x in e] if isinstance(e, (list, tuple)) else [int(e)])


def attach_generator(trainer, worker, **kw) -> TRLGenerationAdapter:
    """Make `worker` the completion generator of a TRL `GRPOTrainer` or `RLOOTrainer` built with use_vllm=False.

    Sets `trainer.vllm_generation`, `use_vllm = True`, `vllm_mode = "server"`, `_last_loaded_step = -1`: TRL syncs
    weights every step, generates through us and keeps its IS correction. Keyword arguments go to the adapter.
    """
    check_trl_version()
    from trl import GRPOTrainer, RLOOTrainer
    if not isinstance(trainer, (GRPOTrainer, RLOOTrainer)):
        raise TypeError(f"attach_generator supports GRPOTrainer and RLOOTrainer, got {type(trainer).__name__}; "
                        f"for AsyncGRPOTrainer use trainers.trl_async (EngineRolloutWorker, EngineWeightTransfer)")
    if getattr(trainer.args, "use_vllm", False):
        raise ValueError("attach_generator replaces vLLM: build the trainer with use_vllm=False (the default), "
                         "otherwise TRL starts its own vLLM engine/client first")
    vocab = getattr(getattr(trainer.model, "config", None), "vocab_size", None)
    if vocab is not None and vocab != worker.engine.vocab_size:
        raise ValueError(f"the trainer model has vocab_size={vocab} but the worker's engine has "
                         f"{worker.engine.vocab_size}: they must serve the same model")
    max_len = getattr(trainer.args, "vllm_max_model_length", None)
    if max_len and max_len > worker.engine.max_model_len:
        warnings.warn(f"vllm_max_model_length={max_len} but the worker's engine has max_model_len="
                      f"{worker.engine.max_model_len}: build the engine with max_model_len={max_len}", stacklevel=2)
    if trainer.args.max_completion_length >= worker.engine.max_model_len:
        warnings.warn(f"max_completion_length={trainer.args.max_completion_length} >= the engine's max_model_len="
                      f"{worker.engine.max_model_len}: completions will be cut by the context", stacklevel=2)
    adapter = TRLGenerationAdapter(worker, trainer, **kw)
    cfg = getattr(worker.engine, "config", None)
    if adapter.sleep_level and cfg is not None and worker.engine.device.type == "cuda" and \
            cfg.gpu_memory_utilization is None and cfg.kv_cache_memory is None and cfg.num_kv_pages is None:
        warnings.warn("the engine shares the trainer's GPU but sized its KV cache from the memory free when it was "
                      "built; the trainer's optimizer state may leave no room to wake it: build the engine with "
                      "gpu_memory_utilization (e.g. args.vllm_gpu_memory_utilization) or kv_cache_memory", stacklevel=2)
    trainer.vllm_generation = adapter
    trainer.use_vllm = True
    trainer.vllm_mode = "server"
    trainer._last_loaded_step = -1
    return adapter


# ---- route B: rollout_func -----------------------------------------------------------------------------------------
def make_rollout_func(worker, env_factory: Optional[Callable] = None, max_turns: int = 1,
                      **kw) -> Callable[[list, Any], dict]:
    """A TRL `rollout_func(prompts, trainer) -> dict` over `worker` (TRL's public, experimental hook).

    Tokenises as TRL does (chat template for conversational prompts), syncs the weights whenever
    `trainer.state.global_step` changes, and returns `prompt_ids`, `completion_ids` and per-token `logprobs`.
    On this route TRL forms NO importance-sampling ratio (only with `use_vllm`); use `attach_generator` to keep it.
    With env_factory(prompt as TRL gives it, sample index) -> a rollout.multiturn.Environment, each row is a
    trajectory of at most max_turns turns (the worker stepped inline): completion_ids are all its tokens after
    the prompt, `env_mask` (1: sampled) is TRL's loss mask over them, `turn_rewards` reaches the reward functions.
    Other keyword arguments go to the internal `TRLGenerationAdapter`.
    """
    state: dict[str, Any] = {"trainer": None, "adapter": None, "step": None}

    def rollout_func(prompts: list, trainer) -> dict:
        if state["trainer"] is not trainer:
            check_trl_version()
            state.update(trainer=trainer, adapter=TRLGenerationAdapter(worker, trainer, **kw), step=None)
        adapter: TRLGenerationAdapter = state["adapter"]
        step = trainer.state.global_step
        routed_a = getattr(trainer, "use_vllm", False) and getattr(trainer, "vllm_generation", None) is not None
        if not routed_a and step != state["step"]:
            adapter.sync_weights()
            state["step"] = step
        prompt_ids = tokenize_prompts(trainer, prompts)
        mode = "train" if trainer.model.training else "eval"
        G = trainer.num_generations if mode == "train" else trainer.num_generations_eval
        if env_factory is not None:
            return _trajectory_batch(adapter, prompts, prompt_ids, G, env_factory, max_turns)
        p_ids, c_ids, lps, _ = adapter.generate(prompt_ids, None, G)
        return {"prompt_ids": p_ids, "completion_ids": c_ids, "logprobs": [[x[0] for x in row] for row in lps]}

    rollout_func.state = state      # for tests / introspection
    return rollout_func


def _trajectory_batch(adapter: TRLGenerationAdapter, prompts, prompt_ids, G: int, env_factory, max_turns: int) -> dict:
    from rollout.multiturn import run_trajectories
    runs = _consecutive_runs(prompt_ids, G)
    barrier0, t0 = adapter.worker.weights.metrics.get("barrier_ms", 0.0), time.perf_counter()
    trajs = run_trajectories(adapter.worker, [prompt_ids[s] for s, _ in runs],
                             lambda i, k: env_factory(prompts[runs[i][0]], k), adapter._params(runs), max_turns)
    versions = [v for t in trajs for v in t.policy_versions if v >= 0]
    if adapter.log_metrics:
        adapter._log_batch(versions, len(versions), time.perf_counter() - t0,
                           adapter.worker.weights.metrics.get("barrier_ms", 0.0) - barrier0)
    cut = [t.spans[0][0] for t in trajs]           # the prompt's length
    return {"prompt_ids": [t.token_ids[:c] for t, c in zip(trajs, cut)],
            "completion_ids": [t.token_ids[c:] for t, c in zip(trajs, cut)],
            "logprobs": [t.logprobs[c:] for t, c in zip(trajs, cut)],
            "env_mask": [[int(g) for g in t.generated[c:]] for t, c in zip(trajs, cut)],
            "turn_rewards": [t.rewards for t in trajs]}


def tokenize_prompts(trainer, prompts: list) -> list[list[int]]:
    """Prompt ids as TRL's `_tokenize_prompts` makes them (text-only)."""
    from trl.data_utils import is_conversational
    proc = trainer.processing_class
    if is_conversational({"prompt": prompts[0]}):
        out = proc.apply_chat_template(
            conversation=prompts, tools=getattr(trainer, "tools", None) or None,
            chat_template=getattr(trainer, "chat_template", None), add_generation_prompt=True, tokenize=True,
            return_dict=True, **(getattr(trainer, "chat_template_kwargs", None) or {}))
        return [list(x) for x in out["input_ids"]]
    return [list(x) for x in proc(text=prompts)["input_ids"]]
