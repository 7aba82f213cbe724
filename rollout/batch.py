"""CPU batch builder: turns a SchedulerOutput into flat step inputs written into
fixed-size host buffers (allocated once, pinned on CUDA), so a device pipeline can
copy them in one go and a captured graph can read them at stable addresses.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_cache import KVCacheManager
from .request import PLACEHOLDER
from .sampler import SamplingTensors
from .scheduler import SchedulerOutput


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

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_rows(self) -> int:
        return self.logits_indices.numel()


class BatchBuilder:
    def __init__(self, kv: KVCacheManager, *, max_num_batched_tokens: int, max_num_seqs: int,
                 max_pages_per_seq: int, pin_memory: bool = False):
        self.kv = kv
        T, S, R, P = max_num_batched_tokens, max_num_seqs, max_num_seqs, max_pages_per_seq

        def buf(*shape, dtype=torch.int64):
            return torch.zeros(*shape, dtype=dtype, pin_memory=pin_memory)

        self.input_ids, self.positions, self.slot_mapping = buf(T), buf(T), buf(T)
        self.carry = buf(T)
        self.query_start_loc, self.seq_lens = buf(S + 1, dtype=torch.int32), buf(S, dtype=torch.int32)
        self.block_tables = buf(S, P, dtype=torch.int32)
        self.logits_indices = buf(R)
        self.temperature, self.top_p = buf(R, dtype=torch.float32), buf(R, dtype=torch.float32)
        self.min_p, self.rep_penalty = buf(R, dtype=torch.float32), buf(R, dtype=torch.float32)
        self.top_k, self.seeds, self.counters = buf(R), buf(R), buf(R)
        self.max_pages_per_seq = P

    def build(self, sched: SchedulerOutput) -> Batch:
        """Flatten one scheduled step. Tokens sampled by the previous batch (still in
        flight) are PLACEHOLDERs on the host: their slot gets id 0 and a carry-over entry
        naming the previous batch's output row, which the device gathers before the forward."""
        kv = self.kv
        t = s = r = 0
        qsl = [0]
        seq_lens: list[int] = []
        penalty_rows: list[list[int]] = []
        any_trunc = any_pen = has_carry = False
        all_greedy = True
        top_n = 0
        targets = iter(sched.targets)

        def carried(seq, pos) -> int:
            bid, row = seq.inflight[pos]
            assert bid == sched.batch_id - 1, "placeholder not from the previous batch"
            return row

        for item in sched.items:
            seq, n, start = item.seq, item.num_new, item.start
            ids = seq.token_ids[start:start + n]
            carry = [-1] * n
            for j, tok in enumerate(ids):
                if tok == PLACEHOLDER:
                    carry[j] = carried(seq, start + j)
                    has_carry = True
            self.input_ids[t:t + n] = torch.tensor([max(x, 0) for x in ids], dtype=torch.int64)
            self.carry[t:t + n] = torch.tensor(carry, dtype=torch.int64)
            self.positions[t:t + n] = torch.arange(start, start + n)
            self.slot_mapping[t:t + n] = torch.tensor([kv.slot(seq, p) for p in range(start, start + n)])
            pages = seq.block_table
            self.block_tables[s, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
            self.block_tables[s, len(pages):] = 0
            t += n
            qsl.append(t)
            seq_lens.append(start + n)
            s += 1
            p = seq.request.params
            for _ in range(item.num_samples):
                # A group's prefill samples all n first tokens from its last position.
                target = next(targets)
                ts = target.seq
                self.logits_indices[r] = t - 1
                self.temperature[r] = p.temperature
                self.top_p[r], self.top_k[r], self.min_p[r] = p.top_p, p.top_k, p.min_p
                self.rep_penalty[r] = p.repetition_penalty
                self.seeds[r] = ts.request.sample_seed(ts.sample_index)
                self.counters[r] = target.pos      # position of the token being sampled
                if p.repetition_penalty != 1.0:
                    # In-flight tokens are encoded as -(2 + previous row) and carried over too.
                    row = [x if x != PLACEHOLDER else -2 - carried(ts, i) for i, x in enumerate(ts.token_ids[:target.pos])]
                    has_carry |= any(x <= -2 for x in row)
                    penalty_rows.append(row)
                else:
                    penalty_rows.append([])
                any_trunc |= p.truncates
                any_pen |= p.repetition_penalty != 1.0
                all_greedy &= p.greedy
                top_n = max(top_n, p.top_logprobs)
                r += 1
        self.query_start_loc[:s + 1] = torch.tensor(qsl, dtype=torch.int32)
        self.seq_lens[:s] = torch.tensor(seq_lens, dtype=torch.int32)
        penalty = None
        if any_pen:
            width = max(len(x) for x in penalty_rows)
            penalty = torch.full((r, width), -1, dtype=torch.int64)
            for i, row in enumerate(penalty_rows):
                penalty[i, :len(row)] = torch.tensor(row, dtype=torch.int64)
        sampling = SamplingTensors(
            temperature=self.temperature[:r], top_k=self.top_k[:r], top_p=self.top_p[:r],
            min_p=self.min_p[:r], repetition_penalty=self.rep_penalty[:r], seeds=self.seeds[:r],
            counters=self.counters[:r], penalty_token_ids=penalty, num_top_logprobs=top_n,
            all_greedy=all_greedy and r > 0, any_truncation=any_trunc, any_penalty=any_pen)
        src = torch.tensor([c[0] for c in sched.copies], dtype=torch.int64)
        dst = torch.tensor([c[1] for c in sched.copies], dtype=torch.int64)
        return Batch(
            input_ids=self.input_ids[:t], carry=self.carry[:t], positions=self.positions[:t],
            slot_mapping=self.slot_mapping[:t],
            query_start_loc=self.query_start_loc[:s + 1], seq_lens=self.seq_lens[:s],
            block_tables=self.block_tables[:s], logits_indices=self.logits_indices[:r],
            sampling=sampling, copy_src=src, copy_dst=dst,
            seq_lens_host=seq_lens, query_start_host=qsl, num_top_logprobs=top_n, has_carry=has_carry)
