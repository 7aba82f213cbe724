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

Order inside `enter`: a kernel lets its dependents launch first and then waits (mode 2, the
default), so the grid two kernels ahead can already be resident and loading weights while a
tiny kernel in between waits; with wait-then-launch (mode 1) only the next grid is early.
Either order is safe: launching dependents only schedules them; their own wait still waits
for this grid to complete, and this grid's CTAs were all scheduled before they can launch.

ROLLOUT_PDL=0 (or `set_enabled(False)` before an engine captures its graphs) turns it off;
ROLLOUT_PDL=1 waits before letting dependents launch.

`set_late(kinds)` is a timing experiment, not a mode to run: the big decode kernels of those
kinds ("gemm": the skinny GEMM, "gemm:N,K" one weight shape of it, "split0:N,K" its split-0
programs only; "qkv": the QKV GEMM with RoPE; "attn": decode attention; the kinds their
wrapper passes as `late`) then wait only before their first store (modes 3 and 4,
`before_store`), so their main loops read the previous kernel's output before it exists. Their
results are wrong; the step time says what any overlap of a kernel's main loop with the
previous kernel's tail could gain (bench.step_variants' `late_wait`).

`set_no_trigger(kinds)` is the opposite bound (right results, less overlap): kernels of those
kinds wait but never let their dependents launch early (mode 5), so the next kernel launches
only once they exit: what the early launch behind them is worth (`no_trigger`).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_enabled = os.environ.get("ROLLOUT_PDL", "2") != "0"
_launch_first = os.environ.get("ROLLOUT_PDL", "2") != "1"
_late: frozenset = frozenset()
_no_trigger: frozenset = frozenset()


def set_enabled(on: bool, launch_first: bool | None = None) -> None:
    """Launches from now on use PDL (where the GPU supports it) or not, and in which order
    `enter` lets dependents launch and waits. Graphs captured before keep what they captured."""
    global _enabled, _launch_first
    _enabled = bool(on)
    if launch_first is not None:
        _launch_first = bool(launch_first)


def set_late(kinds=()) -> None:
    """The timing experiment of the module docstring (wrong results): kernels of these kinds
    launched from now on wait only before their first store. () turns it off."""
    global _late
    _late = frozenset(kinds)


def set_no_trigger(kinds=()) -> None:
    """Kernels of these kinds (set_late's names) launched from now on do not let their
    dependents launch before they exit (module docstring). () turns it off."""
    global _no_trigger
    _no_trigger = frozenset(kinds)


def enabled() -> bool:
    return _enabled


@functools.lru_cache(maxsize=None)
def _sm90_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def sm90_or_later(t: torch.Tensor) -> bool:
    """t is on an sm_90+ GPU (cached per device: the decode path asks every step)."""
    return _sm90_or_later(t.device.index if t.device.index is not None else torch.cuda.current_device())


def pdl_for(t: torch.Tensor, late: tuple = ()) -> int:
    """The PDL mode of kernels on t's device: 0 off (always under the CPU interpreter), 1 wait
    then launch dependents, 2 launch dependents then wait. Under `set_late`, for a kernel that
    calls `before_store` and names a kind in `late` that is set: 3, launch dependents and wait
    before the first store, or 4 for a "split0:..." kind, the same for programs of split 0
    (program_id(1) == 0) only. Under `set_no_trigger`, for a kind in `late` that is set: 5,
    wait and never launch dependents early. Truthy = launch with PDL."""
    on = (_enabled and t.is_cuda and not triton.knobs.runtime.interpret
          and sm90_or_later(t))
    for kind in late if on else ():
        if kind in _late:
            return 4 if kind.startswith("split0:") else 3
        if kind in _no_trigger:
            return 5
    return (2 if _launch_first else 1) if on else 0


@triton.jit
def enter(PDL: tl.constexpr):
    """Wait for the previous grid (its writes visible) and let the next grid launch (PDL: the
    mode from pdl_for, in its order)."""
    if PDL == 5:
        gdc_wait()
    elif PDL >= 3:
        gdc_launch_dependents()
        if PDL == 4 and tl.program_id(1) != 0:
            gdc_wait()
    elif PDL == 2:
        gdc_launch_dependents()
        gdc_wait()
    elif PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def before_store(PDL: tl.constexpr):
    """Modes 3 and 4 (`set_late`) wait here, before the kernel's first store, where `enter` did not."""
    if PDL == 3:
        gdc_wait()
    elif PDL == 4 and tl.program_id(1) == 0:
        gdc_wait()
