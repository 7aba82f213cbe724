"""Programmatic dependent launch (PDL, sm_90+) for the decode-step kernels.

A decode step of the 8B shape is ~320 kernels inside one CUDA graph. Between two of them the
GPU drains the first grid, then launches and ramps up the second: a few microseconds each in
which HBM idles. With PDL the next kernel's programs are launched while the previous kernel
finishes; they do what does not depend on it (the GEMM loads its first weight tile), then
`griddepcontrol.wait` until the previous grid has completed and its writes are visible.

The rule that keeps this race-free: a kernel launched with PDL calls `enter` before it reads
anything an earlier kernel wrote and before its first store (a buffer it writes may still be
read by the kernel before it: the graph's memory pool reuses freed blocks). Waiting on the
previous grid is transitive: that grid itself waited on its own predecessor before finishing.
Kernels without PDL (cuBLAS, torch ops) are ordered as usual.

`enter` lets dependents launch first and then waits, so the grid two kernels ahead can already
be resident and loading weights while a tiny kernel in between waits. Launching dependents only
schedules them; their own wait still waits for this grid to complete.

ROLLOUT_PDL=0 (rollout.env) or `set_enabled(False)` before an engine captures its graphs turns it off.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .. import env

_enabled = env.PDL


def set_enabled(on: bool) -> None:
    """Launches from now on use PDL (where the GPU supports it) or not. Graphs captured before
    keep what they captured."""
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    return _enabled


@functools.lru_cache(maxsize=None)
def _sm90_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def sm90_or_later(t: torch.Tensor) -> bool:
    """t is on an sm_90+ GPU (cached per device: the decode path asks every step)."""
    return _sm90_or_later(t.device.index if t.device.index is not None else torch.cuda.current_device())


def pdl_for(t: torch.Tensor) -> int:
    """1 where kernels on t's device launch with PDL, else 0 (always under the CPU interpreter)."""
    return int(_enabled and t.is_cuda and not triton.knobs.runtime.interpret and sm90_or_later(t))


@triton.jit
def enter(PDL: tl.constexpr):
    """Let the next grid launch, then wait for the previous grid (its writes visible)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
