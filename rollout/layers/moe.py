"""Which mixture-of-experts path runs: the router (softmax over experts in fp32, top-k, optional
renormalisation; as transformers) and the experts, by a torch loop over the experts hit (the reference:
CPU, fp32 tests, the torch backend) or the fused Triton MoE (kernels/fused_moe.py) with decode or
prefill tiles."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). Decode: a few pairs per expert, so 16-row blocks
# (the MMA's least) waste the least padding; prefill: taller blocks reuse each weight tile across rows.
# Swept at the Qwen3-30B-A3B shape on an H100 (`python -m rollout.bench.gemm --moe`, bench/results
# 2026-12-06_moe_tiles_*): these decode tiles are within 2% of the best at 8-256 tokens (95% of the copy
# rate at 32), the 64-row ones best at 512 tokens, the 128-row ones 1.31x faster at 4096.
DECODE_TILES = (16, 64, 128, 4, 4)
PREFILL_TILES = (64, 64, 64, 4, 3)
LONG_PREFILL_TILES = (128, 128, 64, 8, 4)
DECODE_PAIRS_PER_EXPERT = 16      # T * k / E at or below this: the decode tiles
LONG_PREFILL_PAIRS_PER_EXPERT = 128   # at or above this: the long-prefill tiles


def route(logits: torch.Tensor, top_k: int, renormalize: bool, ids_out: Optional[torch.Tensor] = None,
          fused: bool = False):
    """Router logits [T, E] -> (weights [T, k] fp32, rounded to the logits' dtype as transformers rounds
    them; expert ids [T, k] int64, most probable first). ids_out: where topk writes the ids (the step's
    routed-expert buffer, so capturing them costs no extra kernel). fused: one Triton launch for the
    softmax, top-k and renormalisation (seven torch kernels; the probabilities differ by reduction order)."""
    if fused:
        from ..kernels.fused_moe import route as fused_route
        return fused_route(logits, top_k, renormalize, ids_out)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if ids_out is None:
        weights, ids = torch.topk(probs, top_k, dim=-1)
    else:
        weights, ids = torch.topk(probs, top_k, dim=-1, out=(probs.new_empty(ids_out.shape), ids_out))
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype).float(), ids


def experts_reference(x, weights, ids, w_gate_up, w_down) -> torch.Tensor:
    """transformers' loop: each expert hit runs its tokens; contributions summed in fp32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        tok, j = (ids == e).nonzero(as_tuple=True)
        gate, up = F.linear(x[tok], w_gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w_down[e])
        out.index_add_(0, tok, y.float() * weights[tok, j, None])
    return out.to(x.dtype)


def moe_tiles(num_tokens: int, top_k: int, num_experts: int) -> tuple[int, int, int, int, int]:
    pairs = num_tokens * top_k
    if pairs <= DECODE_PAIRS_PER_EXPERT * num_experts:
        return DECODE_TILES
    return LONG_PREFILL_TILES if pairs >= LONG_PREFILL_PAIRS_PER_EXPERT * num_experts else PREFILL_TILES


def experts(x, weights, ids, w_gate_up, w_down, fused: bool, combine: bool = True) -> torch.Tensor:
    """sum_j weights[t, j] * expert ids[t, j](x[t]): the fused Triton kernels or the reference loop.
    combine=False (fused only): the k terms uncombined, [k, T, H], for the next residual add to sum."""
    if not fused:
        return experts_reference(x, weights, ids, w_gate_up, w_down)
    from ..kernels.fused_moe import fused_moe
    return fused_moe(x, weights, ids, w_gate_up, w_down, moe_tiles(x.shape[0], ids.shape[1], w_gate_up.shape[0]),
                     combine)


def tile_variant_token_counts(top_k: int, num_experts: int) -> list[int]:
    """One token count for each (tiles, moe_align path) pair the fused MoE can take at this routing shape:
    every such range of counts starts where a tile class or the three-launch moe_align starts, or at the
    later of two such starts. The kernels do not specialise on counts, so these are all the variants."""
    from ..kernels.fused_moe import ONE_PROGRAM_PAIRS
    firsts = (1, DECODE_PAIRS_PER_EXPERT * num_experts // top_k + 1,
              -(-LONG_PREFILL_PAIRS_PER_EXPERT * num_experts // top_k), ONE_PROGRAM_PAIRS // top_k + 1)
    counts, seen = [], set()
    for T in sorted({max(a, b) for a in firsts for b in firsts}):
        key = (moe_tiles(T, top_k, num_experts), T * top_k <= ONE_PROGRAM_PAIRS)
        if key not in seen:
            seen.add(key)
            counts.append(T)
    return counts


def compile_tiles(w_gate_up: torch.Tensor, w_down: torch.Tensor, top_k: int, max_tokens: int) -> list[int]:
    """Run the fused MoE once at each of tile_variant_token_counts up to max_tokens (the most a step
    holds), so that Triton compiles every variant a step can take at start-up, not inside a serving step
    (a compile holds the GPU ~0.4 s; prefill and recompute chunks reach every tile class). Returns the
    token counts run."""
    E, H = w_gate_up.shape[0], w_gate_up.shape[2]
    gen = torch.Generator(device=w_gate_up.device).manual_seed(0)
    counts = [T for T in tile_variant_token_counts(top_k, E) if T <= max_tokens]
    for T in counts:
        x = torch.randn(T, H, generator=gen, device=w_gate_up.device).to(w_gate_up.dtype)
        ids = torch.rand(T, E, generator=gen, device=w_gate_up.device).argsort(dim=1)[:, :top_k]
        weights = torch.full((T, top_k), 1.0 / top_k, device=w_gate_up.device)
        experts(x, weights, ids, w_gate_up, w_down, fused=True)
    return counts
