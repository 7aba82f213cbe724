"""Paged attention: the torch reference (CPU tests, CI) and the dispatch to the Triton
kernels (CUDA default). Writes the step's K/V into the page pool through the slot
mapping, then attends each sequence's queries over its pages via the block table.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [T] int64, flat slot (page * page_size + offset) per token
    block_tables: torch.Tensor      # [S, max_pages] int32
    seq_lens: torch.Tensor          # [S] int32, context length after this step
    query_start_loc: torch.Tensor   # [S + 1] int32
    # Host copies for the torch reference (no device sync needed to read them); None inside
    # a CUDA graph's static step, which only the Triton backend runs.
    seq_lens_host: Optional[list[int]]
    query_start_host: Optional[list[int]]
    page_size: int
    backend: str = "torch"          # "torch" (reference) or "triton" (rollout.kernels)
    decode_only: bool = False       # one query per sequence: the split-KV decode kernel applies
    # Batch-invariant mode: every row through the varlen kernel, whose per-row reduction order
    # does not depend on the step's other sequences (the decode kernel's split count does).
    batch_invariant: bool = False


def attend(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, sliding_window=None) -> torch.Tensor:
    """Paged attention over the pool (K/V of this step already written), by backend."""
    if meta.backend == "triton":
        from .kernels import paged_attention
        return paged_attention(q, k_cache, v_cache, meta, scale, sliding_window)
    return paged_attention_ref(q, k_cache, v_cache, meta, scale, sliding_window)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; caches: [pages, page_size, Hkv, D]."""
    n = slot_mapping.numel()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k[:n])
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v[:n])


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float,
                        sliding_window: Optional[int] = None) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D]. Causal within each sequence. Scores, softmax and the
    value sum are computed in fp32 (as flash-style kernels accumulate): rounding the
    scores to bf16 before the softmax doubled our error against an fp32 forward.
    Decode rows (one query) run as one batched gather; prefill chunks per sequence."""
    out = torch.zeros_like(q)    # rows of no sequence (graph padding) stay 0, as in the kernels
    qsl, lens = meta.query_start_host, meta.seq_lens_host
    decode = [i for i in range(len(lens)) if qsl[i + 1] - qsl[i] == 1]
    if decode:
        _decode_batched(q, k_cache, v_cache, meta, scale, sliding_window, decode, out)
    for i, L in enumerate(lens):
        qs, qe = qsl[i], qsl[i + 1]
        if qe - qs > 1:
            out[qs:qe] = _attend_one(q[qs:qe], k_cache, v_cache, meta.block_tables[i], L, meta.page_size,
                                     scale, sliding_window)
    return out


def _attend_one(q, k_cache, v_cache, block_table, L, ps, scale, window):
    qlen, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    pages = block_table[: -(-L // ps)].long()
    k = k_cache[pages].reshape(-1, Hkv, D)[:L].float().repeat_interleave(Hq // Hkv, dim=1).transpose(0, 1)
    v = v_cache[pages].reshape(-1, Hkv, D)[:L].float().repeat_interleave(Hq // Hkv, dim=1).transpose(0, 1)
    scores = torch.matmul(q.float().transpose(0, 1), k.transpose(1, 2)) * scale     # [Hq, qlen, L]
    q_pos = torch.arange(L - qlen, L, device=q.device)[:, None]
    k_pos = torch.arange(L, device=q.device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= (q_pos - k_pos) < window
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v).transpose(0, 1).to(q.dtype)


def _decode_batched(q, k_cache, v_cache, meta, scale, window, rows, out):
    ps, Hkv, D = meta.page_size, k_cache.shape[2], k_cache.shape[3]
    Hq = q.shape[1]
    n_pages = -(-max(meta.seq_lens_host[i] for i in rows) // ps)
    sel = torch.tensor(rows, device=q.device)
    tok = torch.tensor([meta.query_start_host[i] for i in rows], device=q.device)
    bt = meta.block_tables[sel, :n_pages].long()                      # [S, P]
    k = k_cache[bt].reshape(len(rows), n_pages * ps, Hkv, D).float()   # [S, K, Hkv, D]
    v = v_cache[bt].reshape(len(rows), n_pages * ps, Hkv, D).float()
    qd = q[tok].view(len(rows), Hkv, Hq // Hkv, D).float()              # [S, Hkv, G, D]
    scores = torch.einsum("shgd,skhd->shgk", qd, k) * scale
    L = meta.seq_lens[sel].long()[:, None]
    k_pos = torch.arange(n_pages * ps, device=q.device)[None, :]
    allowed = k_pos < L
    if window is not None:
        allowed &= (L - 1 - k_pos) < window
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # Columns past a row's length read other pages (the trash page, where padding tokens write
    # anything): zero them, or a 0 weight times a NaN there would poison the row.
    v = v.masked_fill(~allowed[:, :, None, None], 0.0)
    out[tok] = torch.einsum("shgk,skhd->shgd", probs, v).reshape(len(rows), Hq, D).to(q.dtype)
