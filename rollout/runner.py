"""Model runner: owns the device KV page pool; uploads a Batch, applies the carry-over from the
previous batch's sampled tokens, runs the forward, the lm_head on sampling rows, and the sampler."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from .batch import SAMPLING_FIELDS, STEP_FIELDS, Batch, BatchBuilder, field_lengths
from .layers.attention import AttentionMetadata
from .models.decoder import DecoderLM
from .layers.sampling import sample_step
from .sampler import SamplerOutput, SamplingTensors


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
    """The previous batch's sampled tokens into input ids (carry -1 gathers prev_tokens' unwritten 0)."""
    return torch.where(carry >= 0, prev_tokens[carry], input_ids)


def carry_penalty_ids(penalty: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
    """Penalty entries <= -2 name a previous-batch row as -(2 + row)."""
    rows = (-penalty - 2).clamp(min=0)
    return torch.where(penalty <= -2, prev_tokens[rows], penalty)


def _storages(tensors) -> list:
    """The distinct non-empty storages under `tensors` (tied weights share one)."""
    out: dict = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes():
            out.setdefault(st.data_ptr(), st)
    return list(out.values())


def _release(storage) -> int:
    nbytes = storage.nbytes()
    storage.resize_(0)
    return nbytes


class ModelRunner:
    def __init__(self, model: DecoderLM, *, num_pages: int, page_size: int, kv_dtype: torch.dtype,
                 attention_backend: str = "torch", num_host_pages: int = 0, batch_invariant: bool = False):
        self.attention_backend = attention_backend
        self.fused_sampler = attention_backend == "triton"
        self.batch_invariant = batch_invariant     # configs fixed per shape, not per batch
        model.batch_invariant = batch_invariant
        self.model = model
        self.device = next(model.parameters()).device
        self.page_size = page_size
        shape = (num_pages, page_size, model.num_kv_heads, model.head_dim)
        # One allocation; each layer's K and V caches are views of it.
        self.kv_pool = torch.zeros((len(model.layers), 2) + shape, dtype=kv_dtype, device=self.device)
        self.kv_caches = [(pool[0], pool[1]) for pool in self.kv_pool]
        # Swap space: host pages (pinned on CUDA) with the device pages' layout, host page 0 unused.
        pin = self.device.type == "cuda"
        self.host_kv = [tuple(torch.empty((2, num_host_pages + 1) + shape[1:], dtype=kv_dtype, pin_memory=pin))
                        for _ in model.layers] if num_host_pages else []
        self._released: list = []         # sleep: (storage, bytes, host copy or None) per released weight storage
        self._host_weights: list = []     # pinned host copies, reused from one sleep to the next

    # ---- sleep: memory given back and restored under the same tensors (new addresses: graphs re-captured) ----
    def release_kv(self) -> int:
        """Free the KV pool's memory; its views (kv_caches) stay, holding nothing until restore_kv."""
        return _release(self.kv_pool.untyped_storage())

    def restore_kv(self) -> None:
        """A fresh zeroed pool under the same views (padding rows read the zero trash page)."""
        self.kv_pool.untyped_storage().resize_(self.kv_pool.numel() * self.kv_pool.element_size())
        self.kv_pool.zero_()

    def release_weights(self, keep: bool) -> int:
        """Free the model's memory: parameters, packed decode copies and buffers. keep: all copied to host
        memory first (pinned on CUDA, reused by later sleeps); else the parameters and packed copies are
        dropped (restored as zeros for a full update to refill) and only the buffers (RoPE) are copied."""
        model = self.model
        tiles = [t for m in model.modules() if (t := getattr(m, "weight_tiles", None)) is not None]
        params = _storages(list(model.parameters()) + tiles)
        taken = {st.data_ptr() for st in params}
        kept = (params if keep else []) + [st for st in _storages(model.buffers()) if st.data_ptr() not in taken]
        pin = self.device.type == "cuda"
        if [h.nbytes() for h in self._host_weights] != [st.nbytes() for st in kept]:
            self._host_weights = [torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=pin).untyped_storage()
                                  for st in kept]
        for h, st in zip(self._host_weights, kept):
            h.copy_(st, non_blocking=pin)
        if pin:
            torch.cuda.synchronize(self.device)
        dropped = [] if keep else params
        self._released = [(st, st.nbytes(), h) for st, h in zip(kept, self._host_weights)] + \
                         [(st, st.nbytes(), None) for st in dropped]
        return sum(_release(st) for st, _, _ in self._released)

    def restore_weights(self) -> None:
        for st, nbytes, host in self._released:
            st.resize_(nbytes)
            if host is None:
                st.fill_(0)
            else:
                st.copy_(host, non_blocking=True)
        self._released = []

    @staticmethod
    def kv_bytes_per_page(hf_config, page_size: int, dtype: torch.dtype) -> int:
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        kv_heads = hf_config.num_key_value_heads or hf_config.num_attention_heads
        return 2 * hf_config.num_hidden_layers * page_size * kv_heads * head_dim * dtype.itemsize

    def device_buffers(self, builder: BatchBuilder) -> dict[str, torch.Tensor]:
        """One slot's device mirror of the builder's host buffers (stable addresses for graphs)."""
        return {name: torch.zeros(t.shape, dtype=t.dtype, device=self.device) for name, t in builder.host.items()}

    def upload(self, batch: Batch, host: Optional[dict[str, torch.Tensor]] = None,
               bufs: Optional[dict[str, torch.Tensor]] = None) -> DeviceBatch:
        """One step's inputs to the device (current stream): `host` buffers into `bufs`, or fresh tensors."""
        T, S, R = batch.num_tokens, len(batch.seq_lens_host), batch.num_rows
        if batch.padded_to:
            T = S = R = batch.padded_to
            S = batch.padded_seqs or S
        size = field_lengths(T, S, R)
        dev = {}
        for name, (key, _) in STEP_FIELDS.items():
            if name.startswith("copy_"):
                h = getattr(batch, name)
            elif host is not None:
                h = host[name][:size[key]]
            else:
                h = getattr(batch.sampling if name in SAMPLING_FIELDS else batch, name)
            if bufs is None:
                dev[name] = h.to(self.device, non_blocking=True)
            else:
                dev[name] = bufs[name][:h.shape[0]]
                dev[name].copy_(h, non_blocking=True)
        return self.device_batch(dev, batch)

    def device_batch(self, dev: dict[str, torch.Tensor], batch_or_flags, *, decode_only: bool = False,
                     has_carry: bool = True) -> DeviceBatch:
        """Device tensors (one per STEP_FIELDS name) for `run`, with the host Batch or flags only."""
        if isinstance(batch_or_flags, Batch):
            b = batch_or_flags
            st, lens, qsl = b.sampling, b.seq_lens_host, b.query_start_host
            decode_only, has_carry = b.decode_only, b.has_carry
        else:
            st, lens, qsl = batch_or_flags, None, None
        penalty = None if st.penalty_token_ids is None else st.penalty_token_ids.to(self.device, non_blocking=True)
        meta = AttentionMetadata(
            slot_mapping=dev["slot_mapping"], block_tables=dev["block_tables"], seq_lens=dev["seq_lens"],
            query_start_loc=dev["query_start_loc"], seq_lens_host=lens, query_start_host=qsl,
            page_size=self.page_size, backend=self.attention_backend, decode_only=decode_only,
            batch_invariant=self.batch_invariant)
        sampling = replace(st, penalty_token_ids=penalty, **{f: dev[f] for f in SAMPLING_FIELDS})
        return DeviceBatch(
            input_ids=dev["input_ids"], carry=dev["carry"] if has_carry else None,
            positions=dev["positions"], logits_indices=dev["logits_indices"], meta=meta, sampling=sampling,
            copy_src=dev["copy_src"], copy_dst=dev["copy_dst"], num_rows=dev["logits_indices"].numel())

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        if src.numel() == 0:
            return
        for layer in self.kv_pool:      # [2, pages, ...]: K and V together
            layer[:, dst] = layer[:, src]

    def swap_pages(self, out_moves: list[tuple[int, int]], in_moves: list[tuple[int, int]]) -> None:
        """Preemption by swap before a step's forward; rare, so it blocks the host (no buffer tracking)."""
        caches = [(c, hc) for dev, host in zip(self.kv_caches, self.host_kv) for c, hc in zip(dev, host)]
        if out_moves:
            d = torch.tensor([m[0] for m in out_moves], device=self.device)
            h = torch.tensor([m[1] for m in out_moves])
            for c, hc in caches:
                hc[h] = c[d].cpu()
        if in_moves:
            h = torch.tensor([m[0] for m in in_moves])
            d = torch.tensor([m[1] for m in in_moves], device=self.device)
            for c, hc in caches:
                c[d] = hc[h].to(self.device)

    @torch.inference_mode()
    def run(self, dev: DeviceBatch, prev_tokens: Optional[torch.Tensor],
            routed: Optional[torch.Tensor] = None) -> Optional[SamplerOutput]:
        """Carry-over, copy-on-write copies, forward (MoE layers' expert ids into `routed`), lm_head on
        sampling rows, sampler."""
        ids, st = dev.input_ids, dev.sampling
        if dev.carry is not None:
            ids = apply_carry_over(ids, dev.carry, prev_tokens)
        if st.penalty_token_ids is not None and prev_tokens is not None:
            st = replace(st, penalty_token_ids=carry_penalty_ids(st.penalty_token_ids, prev_tokens))
        self.copy_pages(dev.copy_src, dev.copy_dst)
        hidden = self.model(ids, dev.positions, self.kv_caches, dev.meta, routed)
        if dev.num_rows == 0:
            return None
        logits = self.model.compute_logits(hidden[dev.logits_indices])   # lm_head only where needed
        return sample_step(logits, st, self.fused_sampler, self.batch_invariant)

    @torch.inference_mode()
    def score(self, batch: Batch, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        """Logprobs of `targets` [R] at `batch.logits_indices` under log_softmax(logits / T), fp32."""
        dev = self.upload(batch)
        hidden = self.model(dev.input_ids, dev.positions, self.kv_caches, dev.meta)
        logits = self.model.compute_logits(hidden[dev.logits_indices]).float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        return logp.gather(1, targets.to(self.device)[:, None])[:, 0]
