"""Paged attention: the torch reference, the K/V write, and which Triton kernel runs at which
shape (a function of the shapes and KernelSwitches only, so CUDA graphs capture it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..env import KernelSwitches

_DEFAULT_SWITCHES = KernelSwitches()


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [T] int64, flat slot (page * page_size + offset) per token
    block_tables: torch.Tensor      # [S, max_pages] int32
    seq_lens: torch.Tensor          # [S] int32, context length after this step
    query_start_loc: torch.Tensor   # [S + 1] int32
    seq_lens_host: Optional[list[int]]      # host copies for the torch reference (None in graphs)
    query_start_host: Optional[list[int]]
    page_size: int
    backend: str = "torch"          # "torch" (reference) or "triton" (rollout.kernels)
    decode_only: bool = False       # one query per sequence: the split-KV decode kernel applies
    batch_invariant: bool = False   # every row through the varlen kernel (per-row reduction order)


DECODE_TILE = dict(block_n=None, num_warps=4, num_stages=2)    # the H200 sweeps' (64 keys, 16 in fp32)
GLUON_TILE = dict(block_n=128, num_stages=2, num_warps=8, form="keys")     # the fastest in the H200's graphs
GLUON_PROGRAMS_PER_SM = 2
PROGRAMS_PER_SM = 4     # of the Triton decode tile on one SM (103 registers, 38 KB shared, ptxas)
INVARIANT_SPLIT_LEN = 1024     # batch-invariant KV split length, a multiple of BLOCK_N
INVARIANT_TILE = dict(block_m=64, block_n=64, num_warps=4, num_stages=3)   # batch-invariant mode's, every row


def pick_num_splits(batch: int, num_kv_heads: int, num_sms: int = 132, max_splits: int = 16) -> int:
    """The most KV splits whose grid fits on the GPU at once, PROGRAMS_PER_SM an SM (smaller piles
    onto the SMs PDL frees first, larger runs a second wave); the batch size's alone (graph-safe)."""
    return max(1, min(max_splits, PROGRAMS_PER_SM * num_sms // max(1, batch * num_kv_heads)))


def pick_decode(batch: int, num_kv_heads: int, num_sms: int = 132, gluon_ok: bool = False) -> tuple:
    """(splits, gluon): one-split Gluon where `gluon_ok` at 1 to GLUON_PROGRAMS_PER_SM programs an SM."""
    if gluon_ok and num_sms < batch * num_kv_heads <= GLUON_PROGRAMS_PER_SM * num_sms:
        return 1, True
    return pick_num_splits(batch, num_kv_heads, num_sms), False


def attend(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, sliding_window=None,
           switches: Optional[KernelSwitches] = None) -> torch.Tensor:
    """Paged attention over the pool (K/V of this step already written), by backend."""
    if meta.backend == "triton":
        return paged_attention(q, k_cache, v_cache, meta, scale, sliding_window, switches)
    return paged_attention_ref(q, k_cache, v_cache, meta, scale, sliding_window)


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, sliding_window=None,
                    switches: Optional[KernelSwitches] = None) -> torch.Tensor:
    """The Triton kernels: the decode kernel for decode-only batches (pick_decode), else the varlen
    kernel, which batch-invariant mode takes for every batch (fixed KV splits). switches: None = defaults."""
    from ..kernels import paged_decode, paged_prefill, sm_count
    switches = switches or _DEFAULT_SWITCHES
    if meta.batch_invariant:
        return paged_prefill.paged_prefill_attention(
            q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale, sliding_window,
            split_len=INVARIANT_SPLIT_LEN, decode_rows=meta.decode_only, **INVARIANT_TILE)
    if meta.decode_only:
        sms = {"num_sms": sm_count(q.device)} if q.is_cuda else {}    # CPU runs: the default (the H200's)
        gluon_ok = switches.gluon_decode and paged_decode.gluon_supported(q, k_cache, sliding_window)
        splits, gluon = pick_decode(q.shape[0], k_cache.shape[2], **sms, gluon_ok=gluon_ok)
        tile = dict(GLUON_TILE, early=switches.gluon_early) if gluon else DECODE_TILE
        return paged_decode.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                                   sliding_window, splits, gluon=gluon, **tile)
    return paged_prefill.paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                                 meta.seq_lens, scale, sliding_window)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; caches: [pages, page_size, Hkv, D]."""
    n = slot_mapping.numel()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k[:n])
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v[:n])


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float, sliding_window: Optional[int] = None) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D], causal per sequence, in fp32 (as the kernels accumulate)."""
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
    k, v = (c[bt].reshape(len(rows), n_pages * ps, Hkv, D).float() for c in (k_cache, v_cache))  # [S, K, Hkv, D]
    qd = q[tok].view(len(rows), Hkv, Hq // Hkv, D).float()              # [S, Hkv, G, D]
    scores = torch.einsum("shgd,skhd->shgk", qd, k) * scale
    L = meta.seq_lens[sel].long()[:, None]
    k_pos = torch.arange(n_pages * ps, device=q.device)[None, :]
    allowed = k_pos < L
    if window is not None:
        allowed &= (L - 1 - k_pos) < window
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # Columns past a row's length read other pages: zero them, or 0 x NaN there poisons the row.
    v = v.masked_fill(~allowed[:, :, None, None], 0.0)
    out[tok] = torch.einsum("shgk,skhd->shgd", probs, v).reshape(len(rows), Hq, D).to(q.dtype)
