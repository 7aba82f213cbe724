"""CUDA graphs for decode steps: one graph per (slot, batch-size bucket, sampling mode), all
captured into one shared memory pool.

A graph replays the whole decode step of one slot: carry-over from the other slot's sampled
tokens, the forward, the lm_head, the sampler, and the copy of the results into the slot's
static output buffers. Its inputs are the slot's static device buffers, so replaying it after
an upload runs the new batch. Every tensor a graph allocates is a temporary of that step
(results are copied out to buffers allocated outside the pool), so graphs can share one pool:
they never run concurrently (one compute stream) and none reads another's pool memory. Peak
memory is then one step's activations, not one per graph or per slot.

Modes (the sampler's static shape): "greedy" and "sample" use the fused one-pass Triton
sampler, "truncate" its top-k / top-p / min-p kernel (the torch sampler on the torch backend).
Penalties and top logprobs run eagerly.
"""
from __future__ import annotations

import gc
import logging
import time
from typing import Callable, Optional

import torch

log = logging.getLogger(__name__)

MODES = ("greedy", "sample", "truncate")


def default_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, then steps of 8 to 64, 16 to 128, 32 beyond: a padded row costs little in a
    weight-bound decode (GEMM rows are nearly free, attention skips empty contexts)."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, 129, 16)) + list(range(160, 4097, 32))
    out = [b for b in sizes if b < max_rows]
    return out + [max_rows]


def mode_of(all_greedy: bool, any_truncation: bool) -> str:
    if any_truncation:
        return "truncate"
    return "greedy" if all_greedy else "sample"


class DecodeGraphs:
    """`step(slot, bucket, mode)` runs one decode step eagerly from the slot's static buffers;
    this class captures it per key and replays it."""

    def __init__(self, step: Callable[[int, int, str], None], compute_stream, buckets: list[int],
                 modes: tuple[str, ...] = MODES):
        self.step = step
        self.stream = compute_stream
        self.buckets = sorted(buckets)
        self.modes = modes
        self.graphs: dict[tuple[int, int, str], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.capture_s = 0.0

    def bucket_for(self, rows: int) -> Optional[int]:
        for b in self.buckets:
            if b >= rows:
                return b
        return None

    def capture(self, progress: bool = True, slots: tuple[int, ...] = (0, 1)) -> None:
        """Largest bucket first, so the pool is sized once and smaller graphs reuse it.
        `slots`: both in service; one only to measure what the second slot costs."""
        t0 = time.perf_counter()
        keys = [(s, b, m) for b in reversed(self.buckets) for m in self.modes for s in slots]
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(keys), desc="capturing CUDA graphs", unit="graph")
        self.pool = torch.cuda.graph_pool_handle()
        # No garbage collection during capture: collecting an older engine's graphs frees
        # device memory, which is not permitted while a stream captures (the capture fails and
        # leaves the CUDA RNG in capture state).
        gc.collect()
        gc.disable()
        try:
            self._capture(keys, slots, bar)
        finally:
            gc.enable()
        torch.cuda.synchronize()
        if bar is not None:
            bar.close()
        self.capture_s = time.perf_counter() - t0
        log.info("captured %d CUDA graphs (buckets %s, modes %s) in %.1f s",
                 len(keys), self.buckets, self.modes, self.capture_s)

    def _capture(self, keys, slots, bar) -> None:
        for slot, bucket, mode in keys:
            if slot == slots[0]:   # warm-up (Triton compiles, cuBLAS workspaces) outside any capture
                with torch.cuda.stream(self.stream):
                    self.step(slot, bucket, mode)
                self.stream.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool, stream=self.stream):
                self.step(slot, bucket, mode)
            self.graphs[(slot, bucket, mode)] = g
            if bar is not None:
                bar.update(1)

    def replay(self, slot: int, bucket: int, mode: str) -> None:
        """On the caller's current stream."""
        self.graphs[(slot, bucket, mode)].replay()
