"""CPU batch builder: a SchedulerOutput as flat step inputs in fixed host buffers (pinned on CUDA, stable
for graphs), each field written with one numpy slice assignment (not per-item torch ops, ~10 us each)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from .kv_cache import TRASH_PAGE, KVCacheManager
from .request import PLACEHOLDER, SamplingParams
from .sampler import SamplingTensors
from .scheduler import SampleTarget, SchedulerOutput


class RowField(NamedTuple):
    """A per-row sampling input (a SamplingTensors field) and where a row's value comes from."""
    dtype: torch.dtype
    inert: object               # padding rows' value: a greedy, untruncated sample nobody reads
    value: Callable[[SamplingParams, SampleTarget], object]   # (request's params, row's target) -> value
    per_step: bool = False      # else fixed per sequence: the decode path rewrites it only on a new one


SAMPLING_FIELDS = {
    "temperature": RowField(torch.float32, 0.0, lambda p, t: p.temperature),
    "top_k": RowField(torch.int64, 0, lambda p, t: p.top_k),
    "top_p": RowField(torch.float32, 1.0, lambda p, t: p.top_p),
    "min_p": RowField(torch.float32, 0.0, lambda p, t: p.min_p),
    "repetition_penalty": RowField(torch.float32, 1.0, lambda p, t: p.repetition_penalty),
    "seeds": RowField(torch.int64, 0, lambda p, t: t.seq.request.sample_seed(t.seq.sample_index)),
    "counters": RowField(torch.int64, 0, lambda p, t: t.pos, per_step=True),   # position of the sampled token
}

# Host buffers of the builder, also mirrored on the device per slot: name -> (dim key, dtype).
# Dim keys: T tokens, S sequences (+1 for query_start_loc), R rows, C copy-on-write pairs.
STEP_FIELDS = {
    "input_ids": ("T", torch.int64), "carry": ("T", torch.int64), "positions": ("T", torch.int64),
    "slot_mapping": ("T", torch.int64), "query_start_loc": ("S1", torch.int32), "seq_lens": ("S", torch.int32),
    "block_tables": ("SP", torch.int32), "logits_indices": ("R", torch.int64),
    **{name: ("R", f.dtype) for name, f in SAMPLING_FIELDS.items()},
    "copy_src": ("S", torch.int64), "copy_dst": ("S", torch.int64),
}


def field_shape(key: str, T: int, S: int, P: int) -> tuple[int, ...]:
    return {"T": (T,), "S": (S,), "S1": (S + 1,), "SP": (S, P), "R": (S,)}[key]


def field_lengths(T: int, S: int, R: int) -> dict[str, int]:
    """Leading length of each dim key for one step of T tokens, S sequences, R rows."""
    return {"T": T, "S": S, "S1": S + 1, "SP": S, "R": R}


@dataclass
class Batch:
    """Host tensors for one step (views into the builder's buffers)."""
    input_ids: torch.Tensor         # [T] int64 (0 where a carried-over token goes)
    carry: torch.Tensor             # [T] int64: row of the previous batch's outputs, -1 = none
    positions: torch.Tensor         # [T] int64
    slot_mapping: torch.Tensor      # [T] int64
    query_start_loc: torch.Tensor   # [S + 1] int32
    seq_lens: torch.Tensor          # [S] int32, context length after the step
    block_tables: torch.Tensor      # [S, max_pages] int32
    logits_indices: torch.Tensor    # [R] int64, token index whose logits each row samples
    sampling: SamplingTensors       # [R] rows
    copy_src: torch.Tensor          # [C] int64 copy-on-write pages
    copy_dst: torch.Tensor          # [C] int64
    seq_lens_host: list[int]
    query_start_host: list[int]
    num_top_logprobs: int = 0
    has_carry: bool = False         # any token (or penalty entry) comes from the previous batch
    decode_only: bool = False       # every sequence computes one token and samples one row
    every_token_samples: bool = False   # token i is sampled by row i (decode, and a drafted step's verify rows)
    padded_to: int = 0              # > 0: buffers hold inert padding rows up to this size
    padded_seqs: int = 0            # > 0 (pad_verify): ... and inert sequences up to this count

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_rows(self) -> int:
        return self.logits_indices.numel()

    @property
    def graph_safe(self) -> bool:
        """Decode steps of fixed sampling shape: no penalty, no top logprobs."""
        return self.decode_only and not self.sampling.any_penalty and self.num_top_logprobs == 0

    @property
    def verify_graph_safe(self) -> bool:
        """A drafted step a verify graph can run: every token sampled, no page copy, no penalty or top logprobs."""
        return (self.every_token_samples and not self.decode_only and self.copy_src.numel() == 0
                and not self.sampling.any_penalty and self.num_top_logprobs == 0)


class BatchBuilder:
    def __init__(self, kv: KVCacheManager, *, max_num_batched_tokens: int, max_num_seqs: int,
                 max_pages_per_seq: int, pin_memory: bool = False):
        self.kv = kv
        self.dims = (max_num_batched_tokens, max_num_seqs, max_pages_per_seq)
        self.host = {name: torch.zeros(field_shape(key, *self.dims), dtype=dtype, pin_memory=pin_memory)
                     for name, (key, dtype) in STEP_FIELDS.items()}
        self.np = {name: t.numpy() for name, t in self.host.items()}
        self._rows: list = [None] * max_num_seqs          # (seq_id, table_version) of each block-table row
        self._param_rows: list = [None] * max_num_seqs    # the sequence whose sampling params a row holds
        self.fast_decode = True       # off: the general path only (its comparison test, bench.host)

    def build(self, sched: SchedulerOutput) -> Batch:
        """Flatten one scheduled step; PLACEHOLDERs (in flight) get id 0 and a carry-over row."""
        if self.fast_decode and not sched.copies:
            batch = self._build_decode(sched)
            if batch is not None:
                return batch
        self._param_rows = [None] * len(self._param_rows)
        ps, npb = self.kv.page_size, self.np
        ids, carry, positions, kv_pos, logits_idx, qsl, seq_lens = [], [], [], [], [], [0], []
        row_src, penalty_rows = [], []       # (params, target) and penalty token ids of each sampled row
        any_trunc = any_pen = has_carry = False
        all_greedy, decode_only, top_n = True, True, 0
        targets = iter(sched.targets)

        def carried(seq, pos) -> int:
            bid, row = seq.inflight[pos]
            assert bid == sched.batch_id - 1, "placeholder not from the previous batch"
            return row

        for s, item in enumerate(sched.items):
            seq, n, start = item.seq, item.num_new, item.start
            decode_only &= n == 1 and item.num_samples == 1
            for j, tok in enumerate(seq.token_ids[start:start + n]):
                row = -1
                if tok == PLACEHOLDER:
                    tok, row, has_carry = 0, carried(seq, start + j), True
                ids.append(tok)
                carry.append(row)
            positions.extend(range(start, start + n))
            table = seq.block_table
            kv_pos.extend(table[p // ps] * ps + p % ps for p in range(start, start + n))
            key = (seq.seq_id, seq.table_version)
            if self._rows[s] != key:
                npb["block_tables"][s, :len(table)] = table
                self._rows[s] = key
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            p = seq.request.params
            for r in range(item.num_samples):
                # A group's prefill samples all n first tokens from its last position; a drafted run
                # samples each of its last 1 + num_draft positions.
                target = next(targets)
                logits_idx.append(qsl[-1] - 1 - item.num_draft + min(r, item.num_draft))
                row_src.append((p, target))
                if p.repetition_penalty != 1.0:
                    # In-flight tokens are encoded as -(2 + previous row) and carried over too.
                    ts = target.seq
                    row = [x if x != PLACEHOLDER else -2 - carried(ts, i)
                           for i, x in enumerate(ts.token_ids[:target.pos])]
                    has_carry |= any(x <= -2 for x in row)
                    penalty_rows.append(row)
                else:
                    penalty_rows.append([])
                any_trunc |= p.truncates
                any_pen |= p.repetition_penalty != 1.0
                all_greedy &= p.greedy
                top_n = max(top_n, p.top_logprobs)
        t, s, r, c = len(ids), len(seq_lens), len(logits_idx), len(sched.copies)
        for name, values in (("input_ids", ids), ("carry", carry), ("positions", positions),
                             ("slot_mapping", kv_pos), ("query_start_loc", qsl), ("seq_lens", seq_lens),
                             ("logits_indices", logits_idx),
                             *((name, [f.value(*src) for src in row_src]) for name, f in SAMPLING_FIELDS.items()),
                             ("copy_src", [x[0] for x in sched.copies]), ("copy_dst", [x[1] for x in sched.copies])):
            npb[name][:len(values)] = values
        penalty = pad_sequence([torch.tensor(x, dtype=torch.int64) for x in penalty_rows], batch_first=True,
                               padding_value=-1) if any_pen else None
        batch = self._batch(t, s, r, c, seq_lens, qsl, penalty, top_n, all_greedy, any_trunc, any_pen, has_carry,
                            decode_only and s > 0 and c == 0)
        batch.every_token_samples = s > 0 and r == t and logits_idx == list(range(t))
        return batch

    def _batch(self, t, s, r, c, seq_lens_host, qsl_host, penalty, top_n, all_greedy, any_trunc, any_pen,
               has_carry, decode_only) -> Batch:
        """The step's views of the host buffers: t tokens, s sequences, r rows, c page copies."""
        h = self.host
        sampling = SamplingTensors(
            **{f: h[f][:r] for f in SAMPLING_FIELDS}, penalty_token_ids=penalty, num_top_logprobs=top_n,
            all_greedy=all_greedy and r > 0, any_truncation=any_trunc, any_penalty=any_pen)
        return Batch(
            input_ids=h["input_ids"][:t], carry=h["carry"][:t], positions=h["positions"][:t],
            slot_mapping=h["slot_mapping"][:t], query_start_loc=h["query_start_loc"][:s + 1],
            seq_lens=h["seq_lens"][:s], block_tables=h["block_tables"][:s], logits_indices=h["logits_indices"][:r],
            sampling=sampling, copy_src=h["copy_src"][:c], copy_dst=h["copy_dst"][:c],
            seq_lens_host=seq_lens_host, query_start_host=qsl_host, num_top_logprobs=top_n, has_carry=has_carry,
            decode_only=decode_only)

    def _build_decode(self, sched: SchedulerOutput) -> Batch | None:
        """`build` for steady decode (one token and row a sequence, no penalty), else None (nothing written)."""
        npb, ps, prm = self.np, self.kv.page_size, self._param_rows
        items, targets = sched.items, sched.targets
        S = len(items)
        ids, carry, starts, params, fresh = [], [], [], [], []
        prev = sched.batch_id - 1
        has_carry = any_trunc = False
        all_greedy, top_n = True, 0
        for s, item in enumerate(items):
            seq, start = item.seq, item.start
            p = seq.request.params
            if item.num_new != 1 or item.num_samples != 1 or p.repetition_penalty != 1.0:
                return None
            tok, row = seq.token_ids[start], -1
            if tok == PLACEHOLDER:
                bid, row = seq.inflight[start]
                assert bid == prev, "placeholder not from the previous batch"
                tok, has_carry = 0, True
            ids.append(tok)
            carry.append(row)
            starts.append(start)
            params.append(p)
            key = (seq.seq_id, seq.table_version)
            if self._rows[s] != key:
                npb["block_tables"][s, :len(seq.block_table)] = seq.block_table
                self._rows[s] = key
            if prm[s] is not seq:
                fresh.append(s)
                prm[s] = seq
            any_trunc |= p.truncates
            all_greedy &= p.greedy
            top_n = max(top_n, p.top_logprobs)
        npb["input_ids"][:S] = ids
        npb["carry"][:S] = carry
        pos = npb["positions"][:S]
        pos[:] = starts
        npb["slot_mapping"][:S] = npb["block_tables"][np.arange(S), pos // ps].astype(np.int64) * ps + pos % ps
        npb["query_start_loc"][:S + 1] = np.arange(S + 1)
        npb["seq_lens"][:S] = pos + 1
        npb["logits_indices"][:S] = np.arange(S)
        for name, f in SAMPLING_FIELDS.items():
            if f.per_step:
                npb[name][:S] = [f.value(p, t) for p, t in zip(params, targets)]
            elif fresh:
                npb[name][fresh] = [f.value(params[s], targets[s]) for s in fresh]
        batch = self._batch(S, S, S, 0, [x + 1 for x in starts], list(range(S + 1)), None, top_n, all_greedy,
                            any_trunc, False, has_carry, S > 0)
        batch.every_token_samples = S > 0
        return batch

    def pad(self, batch: Batch, size: int) -> None:
        """Fill rows [B, size) of a decode batch with inert entries (trash page, length 0) for a graph."""
        B = batch.num_rows
        assert batch.decode_only and B <= size <= self.dims[1]
        npb = self.np
        for name, value in (("input_ids", 0), ("carry", -1), ("positions", 0),
                            ("slot_mapping", TRASH_PAGE * self.kv.page_size), ("seq_lens", 0),
                            *((name, f.inert) for name, f in SAMPLING_FIELDS.items())):
            npb[name][B:size] = value
        npb["query_start_loc"][B + 1:size + 1] = np.arange(B + 1, size + 1)
        npb["logits_indices"][B:size] = np.arange(B, size)
        self._param_rows[B:size] = [None] * (size - B)     # inert parameters written there
        batch.padded_to = size

    def pad_verify(self, batch: Batch, tokens: int, seqs: int) -> None:
        """Pad a drafted step (every token a sampled row) to `tokens` tokens and rows and `seqs` sequences
        for a verify graph: one inert sequence holds the padding tokens (writing the trash page; its rows
        sample inert parameters), inert empty sequences fill the rest."""
        T, S = batch.num_tokens, len(batch.seq_lens_host)
        assert batch.verify_graph_safe and T <= tokens <= self.dims[0] and S < seqs <= self.dims[1] \
            and tokens <= self.dims[1]
        npb = self.np
        for name, value in (("input_ids", 0), ("carry", -1), ("slot_mapping", TRASH_PAGE * self.kv.page_size),
                            *((name, f.inert) for name, f in SAMPLING_FIELDS.items())):
            npb[name][T:tokens] = value
        npb["positions"][T:tokens] = np.arange(tokens - T)
        npb["logits_indices"][T:tokens] = np.arange(T, tokens)
        npb["query_start_loc"][S + 1:seqs + 1] = tokens
        npb["seq_lens"][S] = tokens - T
        npb["seq_lens"][S + 1:seqs] = 0
        self._param_rows[T:tokens] = [None] * (tokens - T)
        batch.padded_to, batch.padded_seqs = tokens, seqs
