"""Which GEMM runs each linear layer: F.linear (cuBLAS), the batch-invariant GEMM, or for decode-sized
bf16 x the skinny Triton GEMM where the swept table says it wins, with fused epilogues (`Gemms`)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..env import KernelSwitches, parse_skinny_configs

MAX_M = 64      # decode rows: the skinny GEMM's one row tile (kernels/skinny_gemm.py's MAX_M)

# (N, K) -> ((largest M, (BLOCK_N, BLOCK_K, num_warps, num_stages[, split_k]) or None for cuBLAS), ...):
# the fastest per M range in the H200 sweeps (rollout.bench.gemm, step_variants); others use cuBLAS.
SKINNY_CONFIGS = {
    (6144, 4096): ((32, (64, 128, 4, 5)),),                                        # fused QKV
    (4096, 4096): ((16, (32, 256, 4, 5)), (32, (32, 256, 4, 5))),                  # o_proj
    (28672, 4096): ((16, (128, 128, 8, 3)), (32, (128, 128, 8, 4)), (64, (64, 64, 4, 3))),  # gate_up
    (4096, 14336): ((16, (32, 256, 4, 5)), (32, (64, 128, 4, 5, 2))),              # down_proj
    (128256, 4096): ((64, (64, 128, 4, 3)),),                                      # lm_head
}

SKINNY_CONFIGS_PACKED = {     # first where the weight is packed (pack_decode_weights)
    (4096, 4096): ((16, (32, 256, 4, 5)), (32, (64, 128, 4, 5, 2))),               # o_proj
    (28672, 4096): ((32, (128, 64, 8, 5)),),                                       # gate_up
    (4096, 14336): ((16, (32, 256, 4, 5)), (32, (64, 128, 4, 5, 2))),              # down_proj
}


def pick_config(N: int, K: int, M: int, packed: bool = False, overrides: Optional[dict] = None):
    """The skinny-GEMM config of an [N, K] weight at M rows, or None (cuBLAS); `overrides` win at M <= 64."""
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


_overrides = functools.lru_cache(maxsize=None)(parse_skinny_configs)    # KernelSwitches.skinny_configs -> dict


def skinny_config(lin: nn.Module, x: torch.Tensor, overrides: Optional[dict] = None):
    """pick_config for lin(x) where x is a decode-sized bf16 activation on the GPU, else None."""
    if x.is_cuda and x.dtype == torch.bfloat16 and x.shape[0] <= MAX_M and x.stride(-1) == 1 and _triton_ok():
        return pick_config(*lin.weight.shape, x.shape[0], getattr(lin, "weight_tiles", None) is not None, overrides)
    return None


def weight_for(lin: nn.Module, cfg, order: str = "rows") -> tuple[torch.Tensor, bool]:
    """(weight, packed): lin's packed tiles if packed for this tile shape and row order, else lin.weight."""
    packed = getattr(lin, "weight_tiles", None)
    if packed is not None and lin.weight_tiles_order == order and tuple(packed.shape[2:]) == tuple(cfg[:2]):
        return packed, True
    return lin.weight, False


def plain_linear(lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, lin.weight, getattr(lin, "bias", None))


@dataclass(frozen=True)
class Gemms:
    """The GEMM forms of one forward: mode "plain" (F.linear), "skinny" (where configured) or "invariant"."""
    mode: str
    switches: KernelSwitches

    def config(self, lin: nn.Module, x: torch.Tensor):
        return skinny_config(lin, x, _overrides(self.switches.skinny_configs)) if self.mode == "skinny" else None

    def __call__(self, lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "invariant":
            return batch_invariant_gemm(x, lin.weight, getattr(lin, "bias", None))
        cfg = self.config(lin, x)
        return plain_linear(lin, x) if cfg is None else self._skinny(lin, x, cfg, bias=getattr(lin, "bias", None))

    @staticmethod
    def _skinny(lin: nn.Module, x: torch.Tensor, cfg, order: str = "rows", **kw) -> torch.Tensor:
        from ..kernels.skinny_gemm import skinny_gemm
        w, tiled = weight_for(lin, cfg, order)
        return skinny_gemm(x, w, *cfg, tiled=tiled, **kw)

    def _fusable(self, lin: nn.Module, x: torch.Tensor, split_k: Optional[bool]):
        """lin(x)'s skinny config if lin has no bias and it splits K as `split_k` says (None: either)."""
        cfg = self.config(lin, x) if getattr(lin, "bias", None) is None else None
        if cfg is None or (split_k is not None and (len(cfg) > 4 and cfg[4] > 1) != split_k):
            return None
        return cfg

    def add_norm(self, lin: nn.Module, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module):
        """add_rmsnorm(residual, delta=lin(x)); with splitk_into_norm it sums split-K partials itself."""
        from ..kernels.fused_ops import add_rmsnorm
        cfg = self._fusable(lin, x, split_k=True) if self.switches.splitk_into_norm else None
        delta = self(lin, x) if cfg is None else self._skinny(lin, x, cfg, partials=True)
        return add_rmsnorm(residual, norm.weight, norm.eps, delta=delta)

    def silu_gate_up(self, lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of gate_up; with silu_in_gate_up in the (unsplit) skinny GEMM's epilogue."""
        from ..kernels.fused_ops import silu_mul
        cfg = self._fusable(lin, x, split_k=False) if self.switches.silu_in_gate_up else None
        return silu_mul(self(lin, x)) if cfg is None else self._skinny(lin, x, cfg, "silu", silu_mul=True)

    def qkv_rope(self, lin: nn.Module, x: torch.Tensor, num_heads: int, positions, inv_freq, k_cache, v_cache,
                 slot_mapping) -> Optional[torch.Tensor]:
        """With rope_in_qkv where the skinny GEMM's tiles fit: RoPE'd q, k and v cached by its epilogue."""
        cfg = self._fusable(lin, x, split_k=None) if self.switches.rope_in_qkv else None
        if cfg is None or (k_cache.shape[3] // 2) % (cfg[0] // 2):
            return None
        from ..kernels.rope_kv import qkv_rope_and_write_kv
        w, tiled = weight_for(lin, cfg, "rope")
        return qkv_rope_and_write_kv(x, w, num_heads, positions, inv_freq, k_cache, v_cache, slot_mapping, *cfg,
                                     tiled=tiled)


# Batch-invariant mode: one tile shape per weight at any row count (no split-K), so a row's bits do
# not depend on the batch; only the pipeline depth and the row tile (the MMA's N side) follow M.
INVARIANT_BLOCK_M = 64
INVARIANT_SMALL_M_TILES = True      # False: 64-row tiles at every M (the GPU test runs both)


def _invariant_table(table: dict) -> dict:
    """(N, K) -> the decode table's unsplit config for the largest M <= 32, else its first unsplit one."""
    out = {}
    for nk, entries in table.items():
        unsplit = [(max_m, cfg[:4]) for max_m, cfg in entries if cfg is not None and cfg[4:] in ((), (1,))]
        small = [cfg for max_m, cfg in unsplit if max_m <= 32]
        if unsplit:
            out[nk] = small[-1] if small else unsplit[0][1]
    return out


INVARIANT_CONFIGS = _invariant_table(SKINNY_CONFIGS)


def invariant_block_n(N: int) -> int:
    """Shapes off the table: 64-row weight tiles for wide outputs, 32 below 16K (>= 128 programs)."""
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
