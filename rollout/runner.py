"""Model runner: owns the device KV page pool, moves a Batch to the device, runs the
model forward, the lm_head on the rows that sample, and the sampler."""
from __future__ import annotations

from dataclasses import replace

import torch

from .attention import AttentionMetadata
from .batch import Batch
from .models.decoder import DecoderLM
from .sampler import SamplerOutput, SamplingTensors, sample


class ModelRunner:
    def __init__(self, model: DecoderLM, *, num_pages: int, page_size: int, kv_dtype: torch.dtype):
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

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)

    def _sampling_to_device(self, st: SamplingTensors) -> SamplingTensors:
        fields = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seeds", "counters")
        moved = {f: self._to_device(getattr(st, f)) for f in fields}
        if st.penalty_token_ids is not None:
            moved["penalty_token_ids"] = self._to_device(st.penalty_token_ids)
        return replace(st, **moved)

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        if src.numel() == 0:
            return
        src, dst = self._to_device(src), self._to_device(dst)
        for k, v in self.kv_caches:
            k[dst] = k[src]
            v[dst] = v[src]

    def forward_hidden(self, batch: Batch) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self._to_device(batch.slot_mapping),
            block_tables=self._to_device(batch.block_tables),
            seq_lens=self._to_device(batch.seq_lens),
            query_start_loc=self._to_device(batch.query_start_loc),
            seq_lens_host=batch.seq_lens_host, query_start_host=batch.query_start_host,
            page_size=self.page_size)
        return self.model(self._to_device(batch.input_ids), self._to_device(batch.positions),
                          self.kv_caches, meta)

    @torch.inference_mode()
    def execute(self, batch: Batch) -> SamplerOutput | None:
        self.copy_pages(batch.copy_src, batch.copy_dst)
        hidden = self.forward_hidden(batch)
        if batch.num_rows == 0:
            return None
        # lm_head only on the positions that sample.
        logits = self.model.compute_logits(hidden[self._to_device(batch.logits_indices)])
        return sample(logits, self._sampling_to_device(batch.sampling))

    @torch.inference_mode()
    def score(self, batch: Batch, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        """Logprobs of `targets` [R] at `batch.logits_indices` under log_softmax(logits / T), fp32."""
        hidden = self.forward_hidden(batch)
        logits = self.model.compute_logits(hidden[self._to_device(batch.logits_indices)]).float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        return logp.gather(1, self._to_device(targets)[:, None])[:, 0]
