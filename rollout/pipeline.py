"""Device pipeline: two slots and (on CUDA) three non-default streams chained by events.

    launch(k):  h2d stream:     upload slot s inputs             -> h2d_done[s]
                compute stream: wait h2d_done[s]; carry-over from slot 1-s's outputs,
                                forward, sample, write slot s outputs -> compute_done[s]
                d2h stream:     wait compute_done[s]; copy outputs to pinned host -> d2h_done[s]
    wait(k):    the host's only blocking call: d2h_done[s].synchronize()

The engine calls launch(k) before wait(k-1), so the CPU builds batch k+1 while the GPU
runs batch k. In sync mode launch() waits for its own batch before returning: the same
batches, the GPU idle while the CPU works (the comparison baseline). On CPU there are
no streams and launch() runs the step in place. Slot s is rewritten only by batch k+2,
after the host waited on batch k, so no buffer is overwritten while in use.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .batch import BatchBuilder
from .kv_cache import KVCacheManager
from .runner import ModelRunner
from .sampler import SamplerOutput
from .scheduler import SchedulerOutput

_OUT_FIELDS = ("token_ids", "logprobs", "processed_logprobs", "kept_mass")


@dataclass
class Slot:
    builder: BatchBuilder                 # pinned host input buffers
    out_tokens: torch.Tensor              # device [max_rows + 1]; the last entry stays 0
    host_out: dict[str, torch.Tensor]     # pinned host copies of the outputs
    events: dict[str, object] = field(default_factory=dict)


@dataclass
class InFlight:
    sched: SchedulerOutput
    slot: int
    num_rows: int
    top_n: int
    keep_alive: tuple = ()                # device tensors in use until the outputs are read
    outputs: Optional[SamplerOutput] = None   # CPU path: the outputs themselves
    top: Optional[tuple] = None               # CUDA path: pinned host top-logprob ids and values


class DevicePipeline:
    def __init__(self, runner: ModelRunner, kv: KVCacheManager, *, max_num_batched_tokens: int,
                 max_num_seqs: int, max_pages_per_seq: int, async_mode: bool):
        self.runner = runner
        self.device = runner.device
        self.cuda = self.device.type == "cuda"
        self.async_mode = bool(async_mode) and self.cuda
        self.slots = [self._make_slot(kv, max_num_batched_tokens, max_num_seqs, max_pages_per_seq)
                      for _ in range(2)]
        self.current = 0
        self.busy_ms = 0.0                # compute-stream time, from CUDA events
        self.gpu_spans: Optional[list] = None   # (start_s, end_s) per batch while tracing
        self._trace_ref = None
        if self.cuda:
            self.h2d, self.compute, self.d2h = (torch.cuda.Stream(self.device) for _ in range(3))

    def _make_slot(self, kv, T, S, P) -> Slot:
        builder = BatchBuilder(kv, max_num_batched_tokens=T, max_num_seqs=S, max_pages_per_seq=P,
                               pin_memory=self.cuda)
        out_tokens = torch.zeros(S + 1, dtype=torch.int64, device=self.device)
        host_out = {}
        if self.cuda:
            host_out = {f: torch.zeros(S, dtype=torch.int64 if f == "token_ids" else torch.float32,
                                       pin_memory=True) for f in _OUT_FIELDS}
        events = {}
        if self.cuda:
            events = {name: torch.cuda.Event(enable_timing=name in ("start", "end"))
                      for name in ("h2d_done", "start", "end", "d2h_done")}
        return Slot(builder, out_tokens, host_out, events)

    def launch(self, sched: SchedulerOutput) -> InFlight:
        s = self.current
        slot, prev = self.slots[s], self.slots[1 - s].out_tokens
        self.current ^= 1
        batch = slot.builder.build(sched)
        R = batch.num_rows
        flight = InFlight(sched, s, R, batch.num_top_logprobs)
        if not self.cuda:
            dev = self.runner.upload(batch)
            out = self.runner.run(dev, prev)
            if out is not None:
                slot.out_tokens[:R].copy_(out.token_ids)
            flight.outputs = out
            return flight
        ev = slot.events
        with torch.cuda.stream(self.h2d):
            dev = self.runner.upload(batch)
            ev["h2d_done"].record()
        self.compute.wait_event(ev["h2d_done"])
        with torch.cuda.stream(self.compute):
            ev["start"].record()
            out = self.runner.run(dev, prev)
            if out is not None:
                slot.out_tokens[:R].copy_(out.token_ids)
            ev["end"].record()
        self.d2h.wait_event(ev["end"])
        with torch.cuda.stream(self.d2h):
            if out is not None:
                for f in _OUT_FIELDS:
                    slot.host_out[f][:R].copy_(getattr(out, f), non_blocking=True)
                if out.top_ids is not None:   # rare: pinned buffers per launch
                    flight.top = tuple(torch.empty(x.shape, dtype=x.dtype, pin_memory=True).copy_(x, non_blocking=True)
                                       for x in (out.top_ids, out.top_logprobs))
            ev["d2h_done"].record()
        flight.keep_alive = (dev, out)
        if not self.async_mode:
            ev["d2h_done"].synchronize()
        return flight

    def start_trace(self) -> None:
        """Record compute-stream spans on the host clock (perf_counter seconds) from now on."""
        self.gpu_spans = []
        if self.cuda:
            import time
            ref = torch.cuda.Event(enable_timing=True)
            ref.record(self.compute)
            ref.synchronize()
            self._trace_ref = (ref, time.perf_counter())

    def wait(self, flight: InFlight) -> Optional[SamplerOutput]:
        """Block until the batch's outputs are on the host; return them (host tensors)."""
        if not self.cuda:
            return flight.outputs
        ev = self.slots[flight.slot].events
        ev["d2h_done"].synchronize()
        self.busy_ms += ev["start"].elapsed_time(ev["end"])
        if self.gpu_spans is not None:
            ref, t0 = self._trace_ref
            self.gpu_spans.append((t0 + ref.elapsed_time(ev["start"]) / 1e3, t0 + ref.elapsed_time(ev["end"]) / 1e3))
        out = flight.keep_alive[1]
        flight.keep_alive = ()
        if out is None:
            return None
        host = self.slots[flight.slot].host_out
        R = flight.num_rows
        top_ids, top_lps = flight.top or (None, None)
        return SamplerOutput(*(host[f][:R] for f in _OUT_FIELDS), top_ids=top_ids, top_logprobs=top_lps)
