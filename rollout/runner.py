"""Model runner: owns the device KV page pool; uploads a Batch, applies the carry-over
from the previous batch's sampled tokens, runs the model forward, the lm_head on the
rows that sample, and the sampler."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from .attention import AttentionMetadata
from .batch import Batch
from .models.decoder import DecoderLM
from .sampler import SamplerOutput, SamplingTensors, sample


@dataclass
class DeviceBatch:
    """A Batch's tensors on the device (kept alive until the step's outputs are read)."""
    input_ids: torch.Tensor
    carry: Optional[torch.Tensor]
    positions: torch.Tensor
    logits_indices: torch.Tensor
    meta: AttentionMetadata
    sampling: SamplingTensors
    copy_src: torch.Tensor
    copy_dst: torch.Tensor
    num_rows: int


def apply_carry_over(input_ids: torch.Tensor, carry: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
    """Fill the tokens the previous batch sampled into this batch's input ids.
    `prev_tokens` is the other slot's output buffer [max_rows + 1] whose last entry is
    never written (stays 0), so carry == -1 gathers a harmless 0 that the select drops.
    A select rather than an add: replaying it twice is harmless."""
    return torch.where(carry >= 0, prev_tokens[carry], input_ids)


def carry_penalty_ids(penalty: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
    """Penalty entries <= -2 name a previous-batch row as -(2 + row)."""
    rows = (-penalty - 2).clamp(min=0)
    return torch.where(penalty <= -2, prev_tokens[rows], penalty)


class ModelRunner:
    def __init__(self, model: DecoderLM, *, num_pages: int, page_size: int, kv_dtype: torch.dtype,
                 attention_backend: str = "torch"):
        if attention_backend not in ("torch", "triton"):
            raise ValueError(f"attention_backend must be 'torch' or 'triton', got {attention_backend!r}")
        self.attention_backend = attention_backend
        self.model = model
        self.device = next(model.parameters()).device
        self.page_size = page_size
        shape = (num_pages, page_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=kv_dtype, device=self.device),
                           torch.zeros(shape, dtype=kv_dtype, device=self.device))
                          for _ in model.layers]

    @staticmethod
    def kv_bytes_per_page(hf_config, page_size: int, dtype: torch.dtype) -> int:
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        kv_heads = hf_config.num_key_value_heads or hf_config.num_attention_heads
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * hf_config.num_hidden_layers * page_size * kv_heads * head_dim * elem

    def _dev(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)

    def upload(self, batch: Batch) -> DeviceBatch:
        """Host -> device copies of one step's inputs (on the caller's current stream)."""
        st = batch.sampling
        fields = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seeds", "counters")
        moved = {f: self._dev(getattr(st, f)) for f in fields}
        if st.penalty_token_ids is not None:
            moved["penalty_token_ids"] = self._dev(st.penalty_token_ids)
        meta = AttentionMetadata(
            slot_mapping=self._dev(batch.slot_mapping), block_tables=self._dev(batch.block_tables),
            seq_lens=self._dev(batch.seq_lens), query_start_loc=self._dev(batch.query_start_loc),
            seq_lens_host=batch.seq_lens_host, query_start_host=batch.query_start_host,
            page_size=self.page_size, backend=self.attention_backend)
        return DeviceBatch(
            input_ids=self._dev(batch.input_ids), carry=self._dev(batch.carry) if batch.has_carry else None,
            positions=self._dev(batch.positions), logits_indices=self._dev(batch.logits_indices), meta=meta,
            sampling=replace(st, **moved), copy_src=self._dev(batch.copy_src), copy_dst=self._dev(batch.copy_dst),
            num_rows=batch.num_rows)

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        if src.numel() == 0:
            return
        for k, v in self.kv_caches:
            k[dst] = k[src]
            v[dst] = v[src]

    @torch.inference_mode()
    def run(self, dev: DeviceBatch, prev_tokens: Optional[torch.Tensor]) -> Optional[SamplerOutput]:
        """Carry-over, copy-on-write copies, forward, lm_head on sampling rows, sampler."""
        ids, st = dev.input_ids, dev.sampling
        if dev.carry is not None:
            ids = apply_carry_over(ids, dev.carry, prev_tokens)
        if st.penalty_token_ids is not None and prev_tokens is not None:
            st = replace(st, penalty_token_ids=carry_penalty_ids(st.penalty_token_ids, prev_tokens))
        self.copy_pages(dev.copy_src, dev.copy_dst)
        hidden = self.model(ids, dev.positions, self.kv_caches, dev.meta)
        if dev.num_rows == 0:
            return None
        logits = self.model.compute_logits(hidden[dev.logits_indices])   # lm_head only where needed
        return sample(logits, st)

    @torch.inference_mode()
    def score(self, batch: Batch, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        """Logprobs of `targets` [R] at `batch.logits_indices` under log_softmax(logits / T), fp32."""
        dev = self.upload(batch)
        hidden = self.model(dev.input_ids, dev.positions, self.kv_caches, dev.meta)
        logits = self.model.compute_logits(hidden[dev.logits_indices]).float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        return logp.gather(1, self._dev(targets)[:, None])[:, 0]
