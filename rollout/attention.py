"""Paged attention, torch reference (CPU tests, CI, and the eager CUDA path until the
Triton kernels land). Writes the step's K/V into the page pool through the slot
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
    # Host copies for the reference loop (no device sync needed to read them).
    seq_lens_host: list[int]
    query_start_host: list[int]
    page_size: int


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; caches: [pages, page_size, Hkv, D]."""
    n = slot_mapping.numel()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k[:n])
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v[:n])


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float,
                        sliding_window: Optional[int] = None) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D]. Causal within the sequence; softmax in fp32 like
    the eager reference it is checked against."""
    T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    group = Hq // Hkv
    ps = meta.page_size
    out = torch.empty_like(q)
    for i, L in enumerate(meta.seq_lens_host):
        qs, qe = meta.query_start_host[i], meta.query_start_host[i + 1]
        qlen = qe - qs
        if qlen == 0:
            continue
        pages = meta.block_tables[i, : -(-L // ps)].long()
        k = k_cache[pages].reshape(-1, Hkv, D)[:L]
        v = v_cache[pages].reshape(-1, Hkv, D)[:L]
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        qi = q[qs:qe].transpose(0, 1)                           # [Hq, qlen, D]
        scores = torch.matmul(qi, k.transpose(1, 2)) * scale    # [Hq, qlen, L]
        q_pos = torch.arange(L - qlen, L, device=q.device)[:, None]
        k_pos = torch.arange(L, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= (q_pos - k_pos) < sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[qs:qe] = torch.matmul(probs, v).transpose(0, 1)
    return out
