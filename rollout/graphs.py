"""CUDA graphs for decode steps, one per (slot, batch-size bucket, sampling mode): each replays a
slot's whole step (carry-over, forward, lm_head, sampler, copy to static outputs). Graphs never run
concurrently and allocate only step temporaries, so they share one pool (one step's activations).
Every key is captured at start-up; after a sleep dropped them, each is captured on its first use
(a wake costs no capture, and keys a workload never uses are never captured again).
Modes: "greedy", "sample", "truncate"; penalties and top logprobs run eagerly.
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
    """1, 2, 4, then steps of 8 to 64, 16 to 128, 32 beyond (a padded row costs little)."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, 129, 16)) + list(range(160, 4097, 32))
    return [b for b in sizes if b < max_rows] + [max_rows]


def mode_of(all_greedy: bool, any_truncation: bool) -> str:
    return "truncate" if any_truncation else "greedy" if all_greedy else "sample"


class DecodeGraphs:
    """Captures `step(slot, bucket, mode)` (one eager decode step from static buffers) per key."""

    def __init__(self, step: Callable[[int, int, str], None], compute_stream, buckets: list[int],
                 modes: tuple[str, ...] = MODES):
        self.step = step
        self.stream = compute_stream
        self.buckets = sorted(buckets)
        self.modes = modes
        self.graphs: dict[tuple[int, int, str], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.capture_s = 0.0              # capture() of every key (at start-up)
        self.captured_on_use = 0          # keys captured by capture_one since, and the seconds it took
        self.dropped: set = set()         # keys that had a graph before a reset (their kernels are warm)
        self.capture_on_use_s = 0.0

    def bucket_for(self, rows: int) -> Optional[int]:
        return next((b for b in self.buckets if b >= rows), None)

    def capture(self, progress: bool = True, slots: tuple[int, ...] = (0, 1)) -> None:
        """Largest bucket first, so smaller graphs reuse the pool. `slots`: (0,) only to measure."""
        from tqdm.auto import tqdm
        t0 = time.perf_counter()
        keys = [(s, b, m) for b in reversed(self.buckets) for m in self.modes for s in slots]
        self.pool = torch.cuda.graph_pool_handle()
        # No gc during capture: freeing an older engine's graphs' memory would fail the capture.
        gc.collect()
        gc.disable()
        try:
            for slot, bucket, mode in tqdm(keys, desc="capturing CUDA graphs", unit="graph", disable=not progress):
                if slot == slots[0]:   # warm-up (Triton compiles, cuBLAS workspaces) outside any capture
                    with torch.cuda.stream(self.stream):
                        self.step(slot, bucket, mode)
                    self.stream.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool, stream=self.stream):
                    self.step(slot, bucket, mode)
                self.graphs[(slot, bucket, mode)] = g
        finally:
            gc.enable()
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - t0
        log.info("captured %d CUDA graphs (buckets %s, modes %s) in %.1f s",
                 len(keys), self.buckets, self.modes, self.capture_s)

    def capture_one(self, slot: int, bucket: int, mode: str) -> None:
        """Capture one key on first use, on the compute stream: a key dropped by a sleep (its kernels are
        warm) before its first replay; a new one (a verify shape) after the caller ran its step eagerly (the
        warm-up). thread_local: another thread's CUDA calls meanwhile (a weight staging check, a trainer)
        neither fail nor spoil the capture."""
        t0 = time.perf_counter()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        gc.disable()
        try:
            with torch.cuda.graph(g, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                self.step(slot, bucket, mode)
        finally:
            gc.enable()
        self.graphs[(slot, bucket, mode)] = g
        self.captured_on_use += 1
        self.capture_on_use_s += time.perf_counter() - t0

    def reset(self) -> None:
        """Forget every graph and give their pool back (before the memory they read is freed); each
        key is captured again on its first use (capture_one)."""
        for g in self.graphs.values():
            g.reset()
        self.dropped |= set(self.graphs)
        self.graphs.clear()
        self.pool = None

    def replay(self, slot: int, bucket: int, mode: str) -> None:     # on the caller's current stream
        self.graphs[(slot, bucket, mode)].replay()
