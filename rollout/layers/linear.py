"""Which GEMM runs each linear layer: F.linear (cuBLAS), the batch-invariant GEMM, or, for a
decode-sized bf16 x on the GPU, the skinny Triton GEMM (kernels/skinny_gemm.py) where the swept
table says it beats cuBLAS, with its fused epilogues (split-K partials summed by the next add +
RMSNorm, SiLU * up, RoPE + the K/V write) and packed weight copies. Per model: `Gemms(mode,
switches)` carries the engine's KernelSwitches, so engines in one process may run different forms.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..env import KernelSwitches, parse_skinny_configs

MAX_M = 64      # decode rows: the skinny GEMM's one row tile (kernels/skinny_gemm.py's MAX_M)

# (N, K) -> ((largest M, (BLOCK_N, BLOCK_K, num_warps, num_stages[, split_k]) or None for cuBLAS), ...),
# the fastest per M range in the H200 sweeps `python -m rollout.bench.gemm --shape llama3-8b`
# (bench/results/2026-11-29_kernels_gemm_l8b.json: 1.01-1.14x cuBLAS where chosen; at M = 32
# the whole step's GEMMs 4.68 -> 4.39 ms; M = 32 of o_proj and down_proj re-swept with split-K
# and PDL in ..._kernels_gemm_l8b_splitk_pdl.json: 13.0 us against cuBLAS's 14.9, and 35.1 us
# against 36.0). gate_up at M <= 32 re-swept inside the decode graphs at P1's context
# (`python -m rollout.bench.step_variants`, ..._step_variants_l8b_B32_C4352_*.json): 128x128 tiles,
# 8 warps, 4 stages, +0.8% of the step over 64x64. Shapes not swept here stay on cuBLAS.
SKINNY_CONFIGS = {
    (6144, 4096): ((32, (64, 128, 4, 5)),),                                        # fused QKV
    (4096, 4096): ((16, (32, 256, 4, 5)), (32, (32, 256, 4, 5))),                  # o_proj
    (28672, 4096): ((16, (128, 128, 8, 3)), (32, (128, 128, 8, 4)), (64, (64, 64, 4, 3))),  # gate_up
    (4096, 14336): ((16, (32, 256, 4, 5)), (32, (64, 128, 4, 5, 2))),              # down_proj
    (128256, 4096): ((64, (64, 128, 4, 3)),),                                      # lm_head
}

# Where the weight is packed (pack_weight_tiles; the engine's pack_decode_weights) these come first:
# in the decode graphs at P1's context the table's configs gain 0.6 points packed, these 1.0-1.1
# (unpacked they lose 0.2). o_proj and down_proj: 64-row tiles split over K in two, so each program
# re-reads half as much x from L2 for the same weight bytes: +0.3 / +0.4 points over 500-step
# windows at 32 rows.
SKINNY_CONFIGS_PACKED = {
    (4096, 4096): ((16, (32, 256, 4, 5)), (32, (64, 128, 4, 5, 2))),               # o_proj
    (28672, 4096): ((32, (128, 64, 8, 5)),),                                       # gate_up
    (4096, 14336): ((16, (32, 256, 4, 5)), (32, (64, 128, 4, 5, 2))),              # down_proj
}


def pick_config(N: int, K: int, M: int, packed: bool = False, overrides: Optional[dict] = None):
    """The skinny-GEMM config of an [N, K] weight at M rows (a packed weight's if `packed`), or None:
    use cuBLAS. `overrides` ({(N, K): config or None}, KernelSwitches.gemm_overrides()) replace both
    tables' entries for their shapes at every M <= MAX_M."""
    if overrides and (N, K) in overrides:
        return overrides[(N, K)] if M <= MAX_M else None
    for max_m, cfg in (SKINNY_CONFIGS_PACKED.get((N, K), ()) if packed else ()) + SKINNY_CONFIGS.get((N, K), ()):
        if M <= max_m:
            return cfg
    return None


@functools.lru_cache(maxsize=None)
def _triton_ok() -> bool:
    from ..kernels import triton_available
    return triton_available()


@functools.lru_cache(maxsize=None)
def _overrides(spec: str) -> dict:
    return parse_skinny_configs(spec)


def skinny_config(lin: nn.Module, x: torch.Tensor, overrides: Optional[dict] = None):
    """pick_config for lin(x) where x is a decode-sized bf16 activation on the GPU (the config for
    lin's packed copy where it has one), else None. `lin` may be the tied embedding."""
    if x.is_cuda and x.dtype == torch.bfloat16 and x.shape[0] <= MAX_M and x.stride(-1) == 1 and _triton_ok():
        w = lin.weight
        return pick_config(w.shape[0], w.shape[1], x.shape[0], getattr(lin, "weight_tiles", None) is not None,
                           overrides)
    return None


def weight_for(lin: nn.Module, cfg, order: str = "rows") -> tuple[torch.Tensor, bool]:
    """(weight, packed): lin's packed weight tiles (DecoderLM.pack_decode_weights) where they
    were packed for this config's tile shape and this kernel's row order ("rows": skinny_gemm,
    "silu": its silu_mul form, "rope": the QKV + RoPE kernel), else lin.weight."""
    packed = getattr(lin, "weight_tiles", None)
    if packed is not None and lin.weight_tiles_order == order and tuple(packed.shape[2:]) == tuple(cfg[:2]):
        return packed, True
    return lin.weight, False


def plain_linear(lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, lin.weight, getattr(lin, "bias", None))


@dataclass(frozen=True)
class Gemms:
    """The GEMM forms of one forward. mode "plain": F.linear; "skinny": the skinny GEMM where
    skinny_config gives a config, F.linear elsewhere, with the epilogue fusions `switches` turns on;
    "invariant": batch_invariant_gemm at every row count."""
    mode: str
    switches: KernelSwitches

    def config(self, lin: nn.Module, x: torch.Tensor):
        return skinny_config(lin, x, _overrides(self.switches.skinny_configs)) if self.mode == "skinny" else None

    def __call__(self, lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x @ lin.weight.T (+ bias)."""
        if self.mode == "invariant":
            return batch_invariant_gemm(x, lin.weight, getattr(lin, "bias", None))
        cfg = self.config(lin, x)
        if cfg is None:
            return plain_linear(lin, x)
        from ..kernels.skinny_gemm import skinny_gemm
        w, tiled = weight_for(lin, cfg)
        return skinny_gemm(x, w, *cfg, bias=getattr(lin, "bias", None), tiled=tiled)

    def _fusable(self, lin: nn.Module, x: torch.Tensor, split_k: Optional[bool]):
        """lin(x)'s skinny config where a fused epilogue may take it: no bias, and a config that
        splits K (split_k True) or does not (False; None: either). Else None."""
        if getattr(lin, "bias", None) is not None:
            return None
        cfg = self.config(lin, x)
        if cfg is None or (split_k is not None and (len(cfg) > 4 and cfg[4] > 1) != split_k):
            return None
        return cfg

    def add_norm(self, lin: nn.Module, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module):
        """add_rmsnorm(residual, delta=lin(x)) -> (normed, new residual). With splitk_into_norm,
        where the skinny GEMM splits K, the norm kernel sums the GEMM's fp32 partials itself (the
        same bits; the GEMM skips its fix-up tail)."""
        from ..kernels.fused_ops import add_rmsnorm
        cfg = self._fusable(lin, x, split_k=True) if self.switches.splitk_into_norm else None
        if cfg is not None:
            from ..kernels.skinny_gemm import skinny_gemm
            w, tiled = weight_for(lin, cfg)
            delta = skinny_gemm(x, w, *cfg, partials=True, tiled=tiled)
        else:
            delta = self(lin, x)
        return add_rmsnorm(residual, norm.weight, norm.eps, delta=delta)

    def silu_gate_up(self, lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of the fused gate_up projection. With silu_in_gate_up, where the skinny
        GEMM takes this shape without split-K, its epilogue does it (the same bits; no SiLU
        kernel, and gate_up's output never goes to memory)."""
        from ..kernels.fused_ops import silu_mul
        cfg = self._fusable(lin, x, split_k=False) if self.switches.silu_in_gate_up else None
        if cfg is None:
            return silu_mul(self(lin, x))
        from ..kernels.skinny_gemm import skinny_gemm
        w, tiled = weight_for(lin, cfg, "silu")
        return skinny_gemm(x, w, *cfg, silu_mul=True, tiled=tiled)

    def qkv_rope(self, lin: nn.Module, x: torch.Tensor, num_heads: int, positions, inv_freq, k_cache, v_cache,
                 slot_mapping) -> Optional[torch.Tensor]:
        """With rope_in_qkv, where the skinny GEMM takes the QKV projection in tiles of whole
        frequency-pair blocks: RoPE'd q [T, Hq, D], k and v rotated and written to the cache in
        the GEMM's epilogue (after its split-K fix-up if the config splits). Else None."""
        cfg = self._fusable(lin, x, split_k=None) if self.switches.rope_in_qkv else None
        if cfg is None or (k_cache.shape[3] // 2) % (cfg[0] // 2):
            return None
        from ..kernels.rope_kv import qkv_rope_and_write_kv
        w, tiled = weight_for(lin, cfg, "rope")
        return qkv_rope_and_write_kv(x, w, num_heads, positions, inv_freq, k_cache, v_cache, slot_mapping, *cfg,
                                     tiled=tiled)


# Batch-invariant mode: one tile shape per weight whatever the row count, so a row's result is the
# same bits in a decode batch of 1 or 64 and in a prefill of thousands: fixed BLOCK_N, BLOCK_K,
# warps and K order, no split-K (a split count would be a second config). What may follow M is
# what leaves each output element's MMA chain alone: pipeline depth, and the row tile (the MMA's
# N side in this swapped form: each element is still one k16 MMA after another in K order), 16
# or 32 rows for decode, 64 for prefill. tests/gpu/test_batch_invariant_cuda.py checks the bits.
INVARIANT_BLOCK_M = 64
INVARIANT_SMALL_M_TILES = True      # False: 64-row tiles at every M (the GPU test runs both)


def _invariant_table(table: dict) -> dict:
    """(N, K) -> (BLOCK_N, BLOCK_K, num_warps, num_stages at <= 32 rows): the decode table's config
    for the largest M <= 32 among those without split-K (down_proj: its M <= 16 one), or, where no
    entry is that small, its first config without split-K (lm_head)."""
    out = {}
    for nk, entries in table.items():
        unsplit = [(max_m, cfg[:4]) for max_m, cfg in entries if cfg is not None and cfg[4:] in ((), (1,))]
        small = [cfg for max_m, cfg in unsplit if max_m <= 32]
        if unsplit:
            out[nk] = small[-1] if small else unsplit[0][1]
    return out


INVARIANT_CONFIGS = _invariant_table(SKINNY_CONFIGS)


def invariant_block_n(N: int) -> int:
    """Shapes off the table: 64-row weight tiles for wide outputs; 32 below 16K so that decode's
    weight streaming still has >= 128 programs (N = 4096). A function of N only."""
    return 64 if N >= 16384 else 32


def invariant_block_k(K: int) -> int:
    for bk in (128, 64, 32, 16):
        if K % bk == 0:
            return bk
    raise ValueError(f"batch-invariant GEMM: K={K} is not a multiple of 16")


def invariant_config(N: int, K: int, M: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); all but BLOCK_M and stages fixed per (N, K)."""
    from ..kernels.skinny_gemm import pick_block_m
    fallback = (invariant_block_n(N), invariant_block_k(K), 4, 3)
    block_n, block_k, warps, stages = INVARIANT_CONFIGS.get((N, K), fallback)
    if INVARIANT_SMALL_M_TILES and M <= 32:
        return pick_block_m(M), block_n, block_k, warps, stages
    return INVARIANT_BLOCK_M, block_n, block_k, warps, 3      # 64-row x tiles: 3 stages fit shared memory


def batch_invariant_gemm(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] @ w[N, K].T (+ bias) for any M; row i of the result depends only on x[i] and w."""
    from ..kernels.skinny_gemm import skinny_gemm
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"batch-invariant GEMM needs bf16 or fp16 activations, got {x.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    block_m, block_n, block_k, warps, stages = invariant_config(w.shape[0], x.shape[1], x.shape[0])
    return skinny_gemm(x, w, block_n, block_k, num_warps=warps, num_stages=stages, bias=bias, block_m=block_m)
