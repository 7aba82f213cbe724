"""Device pipeline: two slots and (on CUDA) three streams chained by events.

    launch(k):  h2d stream:     upload slot s inputs -> h2d_done[s]
                compute stream: carry-over from slot 1-s's outputs, forward, sample -> end[s]
                d2h stream:     copy outputs to pinned host -> d2h_done[s]
    wait(k):    the host's only blocking call: d2h_done[s].synchronize()

launch(k) runs before wait(k-1), so the CPU builds batch k+1 while the GPU runs batch k (slot s is
rewritten only by batch k+2). Sync mode waits in launch(); on CPU launch() runs the step in place.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from .batch import SAMPLING_FIELDS, STEP_FIELDS, BatchBuilder, field_lengths
from .graphs import MODES, DecodeGraphs, default_buckets, mode_of
from .kv_cache import KVCacheManager
from .runner import DeviceBatch, ModelRunner
from .sampler import SamplerOutput, SamplingTensors
from .scheduler import SchedulerOutput

_OUT_FIELDS = ("token_ids", "logprobs", "processed_logprobs", "kept_mass")
log = logging.getLogger(__name__)


@dataclass
class Slot:
    builder: BatchBuilder                 # pinned host input buffers
    bufs: Optional[dict]                  # their device mirror (CUDA only; CPU uses the host buffers)
    out: dict[str, torch.Tensor]          # device outputs; token_ids' extra last entry stays 0
    host_out: dict[str, torch.Tensor]     # pinned host copies of the outputs
    events: dict[str, object] = field(default_factory=dict)
    routed: Optional[torch.Tensor] = None       # MoE: [layers, T, k] int64 expert ids, written by every forward
    routed_host: Optional[torch.Tensor] = None  # pinned int16, filled only for a step a sequence asks it of


@dataclass
class InFlight:
    sched: SchedulerOutput
    slot: int
    num_rows: int
    top_n: int
    keep_alive: tuple = ()                # device tensors in use until the outputs are read
    outputs: Optional[SamplerOutput] = None   # CPU path: the outputs themselves
    top: Optional[tuple] = None               # CUDA path: pinned host top-logprob ids and values
    routed: Optional[torch.Tensor] = None     # host [MoE layers, tokens, k] int16 when a sequence asked


class DevicePipeline:
    def __init__(self, runner: ModelRunner, kv: KVCacheManager, *, max_num_batched_tokens: int,
                 max_num_seqs: int, max_pages_per_seq: int, async_mode: bool,
                 cuda_graphs: bool = False, graph_max_batch: Optional[int] = None,
                 graph_modes: tuple[str, ...] = MODES, verify_max_tokens: int = 0):
        self.runner = runner
        self.device = runner.device
        self.cuda = self.device.type == "cuda"
        self.async_mode = bool(async_mode) and self.cuda
        self.slots = [self._make_slot(kv, max_num_batched_tokens, max_num_seqs, max_pages_per_seq)
                      for _ in range(2)]
        self.current = 0
        self.busy_ms = 0.0                # compute-stream time, from CUDA events
        self.counts = {"graph_steps": 0, "graph_captures": 0, "eager_steps": 0, "eager_decode_steps": 0,
                       "graph_capture_failures": 0, "verify_padded_steps": 0, "verify_graph_steps": 0}
        self.gpu_spans: Optional[list] = None   # (start_s, end_s) per batch while tracing
        self._trace_ref = None
        self.graphs: Optional[DecodeGraphs] = None
        if self.cuda:
            self.h2d, self.compute, self.d2h = (torch.cuda.Stream(self.device) for _ in range(3))
            if cuda_graphs:   # the engine checks the backend (Triton) and the modes
                top = min(graph_max_batch or max_num_seqs, max_num_seqs, max_num_batched_tokens)
                self.graphs = DecodeGraphs(self._static_step, self.compute, default_buckets(top), graph_modes)
        # Drafted steps (speculation) as verify graphs, one per token bucket, captured on first use; their
        # rows fit the outputs (max_num_seqs). pad_verify: the padded layout without graphs too (CPU: its tests).
        top = min(verify_max_tokens, max_num_batched_tokens, max_num_seqs)
        self.verify_tokens = default_buckets(top) if top > 0 else []
        self.pad_verify = self.graphs is not None and bool(self.verify_tokens)
        self.uncapturable: set = set()    # graph keys captured on use whose capture failed: eager (logged once)

    def _make_slot(self, kv, T, S, P) -> Slot:
        builder = BatchBuilder(kv, max_num_batched_tokens=T, max_num_seqs=S, max_pages_per_seq=P, pin_memory=self.cuda)
        out = {f: torch.zeros(S + 1 if f == "token_ids" else S, device=self.device,
                              dtype=torch.int64 if f == "token_ids" else torch.float32) for f in _OUT_FIELDS}
        host_out, events, bufs = {}, {}, None
        if self.cuda:
            bufs = self.runner.device_buffers(builder)
            host_out = {f: torch.zeros(S, dtype=t.dtype, pin_memory=True) for f, t in out.items()}
            events = {name: torch.cuda.Event(enable_timing=name in ("start", "end"))
                      for name in ("h2d_done", "start", "end", "d2h_done")}
        slot = Slot(builder, bufs, out, host_out, events)
        model = self.runner.model
        if model.sparse_layers:
            slot.routed = torch.zeros(len(model.sparse_layers), T, model.top_k, dtype=torch.int64, device=self.device)
            if self.cuda:
                slot.routed_host = torch.zeros(slot.routed.numel(), dtype=torch.int16, pin_memory=True)
        return slot

    def capture_graphs(self, progress: bool = True) -> None:
        if self.graphs is not None and not self.graphs.graphs:
            self.graphs.capture(progress)

    def _compute(self, s: int, dev: DeviceBatch) -> Optional[SamplerOutput]:
        """Carry-over from the other slot, forward, sample; results into slot s's outputs."""
        out = self.runner.run(dev, self.slots[1 - s].out["token_ids"], self.slots[s].routed)
        if out is not None:
            R = out.token_ids.shape[0]
            for f in _OUT_FIELDS:
                self.slots[s].out[f][:R].copy_(getattr(out, f))
        return out

    def _static_step(self, s: int, bucket, mode: str) -> None:
        """What a graph holds, read from slot s's device buffers: a decode step of `bucket` rows, or (bucket
        a (tokens, sequences) pair) a drafted step's verify forward of that padded shape."""
        bufs = self.slots[s].bufs
        tokens, seqs = bucket if isinstance(bucket, tuple) else (bucket, bucket)
        sizes = field_lengths(tokens, seqs, tokens)
        dev = {name: bufs[name][:0 if name.startswith("copy_") else sizes[key]]
               for name, (key, _) in STEP_FIELDS.items()}
        flags = SamplingTensors(**dict.fromkeys(SAMPLING_FIELDS), penalty_token_ids=None, num_top_logprobs=0,
                                all_greedy=mode == "greedy", any_truncation=mode == "truncate", any_penalty=False)
        self._compute(s, self.runner.device_batch(dev, flags, decode_only=not isinstance(bucket, tuple),
                                                  has_carry=True))

    def _verify_bucket(self, batch) -> Optional[tuple]:
        """(tokens, sequences) of a drafted step's padded layout, or None (no verify graph). As many sequence
        slots as tokens (a drafted step has fewer sequences than tokens): one graph per token bucket; the
        attention kernel's programs for empty sequences return at once."""
        if not batch.verify_graph_safe:
            return None
        tokens = next((b for b in self.verify_tokens if b >= batch.num_tokens), None)
        return None if tokens is None else (tokens, tokens)

    def _capture(self, s: int, bucket, mode: str) -> bool:
        """Capture a key on first use; one that fails is logged and counted, and runs eagerly from then on."""
        try:
            self.graphs.capture_one(s, bucket, mode)
            self.counts["graph_captures"] += 1
            return True
        except Exception:
            log.warning("CUDA graph %s did not capture; that shape runs eagerly from now on", (s, bucket, mode),
                        exc_info=True)
            self.uncapturable.add((s, bucket, mode))
            self.counts["graph_capture_failures"] += 1
            return False

    def launch(self, sched: SchedulerOutput) -> InFlight:
        s = self.current
        slot = self.slots[s]
        self.current ^= 1
        batch = slot.builder.build(sched)
        R, T = batch.num_rows, batch.num_tokens
        flight = InFlight(sched, s, R, batch.num_top_logprobs)
        routed = slot.routed is not None and any(i.seq.request.params.return_routed_experts for i in sched.items)
        mode = mode_of(batch.sampling.all_greedy, batch.sampling.any_truncation)
        verify = None
        if sched.num_drafted and self.pad_verify and (self.graphs is None or mode in self.graphs.modes):
            verify = self._verify_bucket(batch)
        if verify is not None:
            slot.builder.pad_verify(batch, *verify)
            self.counts["verify_padded_steps"] += 1
        if not self.cuda:
            self.runner.swap_pages(sched.swap_out, sched.swap_in)
            out = self._compute(s, self.runner.upload(batch, slot.builder.host))
            if out is not None and batch.padded_to:   # drop the padding rows' samples
                out = SamplerOutput(*(getattr(out, f)[:R] for f in _OUT_FIELDS), top_ids=None, top_logprobs=None)
            flight.outputs = out
            flight.routed = slot.routed[:, :T].to(torch.int16) if routed else None
            return flight
        bucket = verify if verify is not None and (s, verify, mode) not in self.uncapturable else None
        if self.graphs is not None and batch.graph_safe and mode in self.graphs.modes:
            size = self.graphs.bucket_for(R)
            if size is not None and (s, size, mode) not in self.uncapturable:
                bucket = size
                slot.builder.pad(batch, bucket)
        ev = slot.events
        with torch.cuda.stream(self.h2d):
            dev = self.runner.upload(batch, slot.builder.host, slot.bufs)
            ev["h2d_done"].record()
        self.compute.wait_event(ev["h2d_done"])
        out = None
        with torch.cuda.stream(self.compute):
            self.runner.swap_pages(sched.swap_out, sched.swap_in)    # nothing when no swap
            ev["start"].record()
            key = (s, bucket, mode)
            if bucket is not None and key not in self.graphs.graphs and key in self.graphs.dropped \
                    and not self._capture(*key):
                self._static_step(s, bucket, mode)     # dropped by a sleep, and it failed to capture again
                self.counts["eager_steps"] += 1
            elif bucket is not None and key in self.graphs.graphs:    # (a dropped key was captured just now:
                self.graphs.replay(s, bucket, mode)     # the graph's kernels give the bits of before the sleep)
                self.counts["verify_graph_steps" if verify is not None else "graph_steps"] += 1
            elif bucket is not None:      # first use of a verify shape: eagerly (its warm-up), then its graph
                self._static_step(s, bucket, mode)
                self._capture(s, bucket, mode)
            elif verify is not None:      # its capture failed once: the padded layout, eagerly
                self._static_step(s, verify, mode)
                self.counts["eager_steps"] += 1
            else:
                out = self._compute(s, dev)
                self.counts["eager_steps"] += 1
                self.counts["eager_decode_steps"] += batch.decode_only
            ev["end"].record()
        self.d2h.wait_event(ev["end"])
        with torch.cuda.stream(self.d2h):
            if R:
                for f in _OUT_FIELDS:
                    slot.host_out[f][:R].copy_(slot.out[f][:R], non_blocking=True)
                if out is not None and out.top_ids is not None:   # rare: pinned buffers per launch
                    flight.top = tuple(torch.empty(x.shape, dtype=x.dtype, pin_memory=True).copy_(x, non_blocking=True)
                                       for x in (out.top_ids, out.top_logprobs))
            if routed:
                ids = slot.routed[:, :T].to(torch.int16)      # on this stream, alive until d2h_done
                flight.routed = slot.routed_host[:ids.numel()].view(ids.shape).copy_(ids, non_blocking=True)
            ev["d2h_done"].record()
        flight.keep_alive = (dev, out, ids if routed else None)
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
        flight.keep_alive = ()
        if not flight.num_rows:
            return None
        host = self.slots[flight.slot].host_out
        R = flight.num_rows
        top_ids, top_lps = flight.top or (None, None)
        return SamplerOutput(*(host[f][:R] for f in _OUT_FIELDS), top_ids=top_ids, top_logprobs=top_lps)
