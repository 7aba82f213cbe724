"""EngineConfig: every engine option, declared once.

`RolloutEngine`, the Hydra job (`engine.*`), the Ray fleet's engine spec and the HTTP server
(`python -m rollout.serve --help`) all take this one dataclass; keyword overrides anywhere are
its field names. Kernel A/B switches come from the environment (rollout.env) into `kernels`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from .env import SWITCHES, KernelSwitches

GRAPH_MODES = ("greedy", "sample", "truncate")   # the sampler's static shapes a decode graph holds
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class EngineConfig:
    # where and how the model runs
    device: Optional[str] = None                 # None: cuda if available, else cpu
    dtype: str = "auto"                          # auto: the checkpoint's dtype (bf16 on CUDA, fp32 on CPU if none)
    seed: int = 0                                # random weights (from_config) and requests without a seed
    cpu_threads: Optional[int] = None            # CPU: torch threads the engine sets; None: 1 under 100M parameters
                                                 # (overhead-bound: more threads only spin), torch's default above
    # lengths and batch
    max_model_len: Optional[int] = None          # prompt + completion; None: the model's max_position_embeddings
    max_num_seqs: int = 256                      # sequences in flight (a group of n counts n)
    max_num_batched_tokens: int = 2048           # tokens per step (prefill chunks + one per decoding sequence)
    # KV cache
    page_size: int = 16                          # tokens per KV page
    num_kv_pages: Optional[int] = None           # explicit size; else kv_cache_memory
    kv_cache_memory: Optional[int] = None        # bytes; None: 85% of free GPU memory less 2 GiB (CPU: enough for max_num_seqs)
    gpu_memory_utilization: Optional[float] = None   # CUDA, kv_cache_memory None: the engine's share of the device
                                                 # (weights + KV + 2 GiB); the rest is a colocated trainer's
    reserve_memory: Any = 0                      # bytes the automatic KV sizing leaves free, or "weights" (room to stage an update)
    kv_reserve_fraction: Optional[float] = None  # admission: share of full-length pages (new + running) kept
                                                 # free; fixed (1 = never preempt, 0 = next chunk) or None: adaptive
    preemption_mode: str = "recompute"           # recompute | swap | auto (swap where moving pages beats re-prefilling)
    swap_space_gb: float = 0.0                   # host memory for swapped-out KV pages (swap and auto need > 0)
    enable_prefix_caching: bool = True           # full KV pages reused by later requests of that prefix (same weights)
    # execution
    async_pipeline: Optional[bool] = None        # None: on for CUDA; False: the same schedule run synchronously
    attention_backend: str = "auto"              # auto: Triton kernels on CUDA, torch reference on CPU | torch | triton
    cuda_graphs: bool = True                     # decode steps replay CUDA graphs (CUDA + Triton), captured at start-up
    cuda_graph_max_batch: Optional[int] = None   # largest graph bucket; None: max_num_seqs
    cuda_graph_modes: list = field(default_factory=lambda: list(GRAPH_MODES))   # sampler shapes captured
    batch_invariant: bool = False                # a sequence's bits independent of its batch-mates (CUDA + Triton, bf16/fp16)
    pack_decode_weights: bool = False            # decode GEMMs read packed weight copies (CUDA, Llama-3-8B shapes; 2x those weights)
    # speculative decoding (rollout/spec.py): drafted steps run without the one-step lag and eagerly
    speculative: str = "off"                     # off | ngram: drafts from the sequence, its group, earlier completions
    spec_max_draft: int = 5                      # draft tokens per sequence and step (k), at most
    spec_max_step_tokens: int = 256              # rows x (k + 1) per drafted step (memory-bound); more rows: no drafts
    spec_min_acceptance: float = 0.2             # below this measured acceptance, drafting only as a probe
    spec_history_prompts: int = 0                # prompts whose latest completions stay as draft sources
    spec_speed_gate: bool = True                 # draft only while drafted steps are measured faster than plain ones
    kernels: KernelSwitches = field(default_factory=lambda: dataclasses.replace(SWITCHES))   # rollout.env; same results

    def validate(self) -> "EngineConfig":
        """Raise ValueError naming the first option that can never serve; return self."""
        def bad(name, want):
            raise ValueError(f"invalid EngineConfig: {name} must be {want}, got {getattr(self, name)!r}")

        def integer(name, lo, optional=False):
            v = getattr(self, name)
            if v is None and optional:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                bad(name, f"an integer >= {lo}" + (" or None" if optional else ""))

        if self.device is not None and not isinstance(self.device, str):
            bad("device", "a device name such as 'cuda' or 'cpu', or None")
        if self.dtype not in DTYPES and not _is_torch_dtype(self.dtype):
            bad("dtype", f"one of {DTYPES}")
        integer("seed", 0)
        integer("cpu_threads", 1, optional=True)
        integer("max_model_len", 2, optional=True)
        integer("max_num_seqs", 1)
        integer("max_num_batched_tokens", 1)
        integer("page_size", 1)
        integer("num_kv_pages", 1, optional=True)
        integer("kv_cache_memory", 1, optional=True)
        integer("cuda_graph_max_batch", 1, optional=True)
        integer("spec_max_draft", 1)
        integer("spec_max_step_tokens", 2)
        integer("spec_history_prompts", 0)
        if self.speculative not in ("off", "ngram"):
            bad("speculative", "'off' or 'ngram'")
        a = self.spec_min_acceptance
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0:
            bad("spec_min_acceptance", "a number in [0, 1]")
        r = self.reserve_memory
        if r != "weights" and (isinstance(r, bool) or not isinstance(r, int) or r < 0):
            bad("reserve_memory", "bytes >= 0 or 'weights'")
        u = self.gpu_memory_utilization
        if u is not None and (isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 < u <= 1.0):
            bad("gpu_memory_utilization", "a number in (0, 1] or None")
        f = self.kv_reserve_fraction
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0):
            bad("kv_reserve_fraction", "a number in [0, 1] or None (adaptive)")
        if self.preemption_mode not in ("recompute", "swap", "auto"):
            bad("preemption_mode", "'recompute', 'swap' or 'auto'")
        s = self.swap_space_gb
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s < 0:
            bad("swap_space_gb", "a finite number >= 0")
        if self.preemption_mode != "recompute" and s <= 0:
            raise ValueError(f"invalid EngineConfig: preemption_mode={self.preemption_mode!r} needs host swap "
                             f"space (swap_space_gb > 0)")
        if self.attention_backend not in ("auto", "torch", "triton"):
            bad("attention_backend", "'auto', 'torch' or 'triton'")
        for name in ("enable_prefix_caching", "cuda_graphs", "batch_invariant", "pack_decode_weights",
                     "spec_speed_gate"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "True or False")
        if self.async_pipeline is not None and not isinstance(self.async_pipeline, bool):
            bad("async_pipeline", "True, False or None")
        modes = self.cuda_graph_modes
        if isinstance(modes, str) or not all(m in GRAPH_MODES for m in modes):
            bad("cuda_graph_modes", f"a list drawn from {GRAPH_MODES}")
        if not isinstance(self.kernels, KernelSwitches):
            bad("kernels", "a rollout.env.KernelSwitches")
        return self

    def model_len(self, hf_config) -> int:
        """max_model_len, or the model's max_position_embeddings (4096 where the config has none)."""
        return int(self.max_model_len or getattr(hf_config, "max_position_embeddings", None) or 4096)

    def replace(self, **overrides) -> "EngineConfig":
        """A copy with `overrides` (field names; an unknown name raises ValueError listing the known ones)."""
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; EngineConfig has: "
                             f"{', '.join(f.name for f in dataclasses.fields(self))}")
        return dataclasses.replace(self, **overrides)


def _is_torch_dtype(x) -> bool:
    import torch
    return isinstance(x, torch.dtype) and x.is_floating_point
