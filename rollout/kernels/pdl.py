"""Programmatic dependent launch (PDL, sm_90+): the next kernel's programs launch while the previous
one finishes and do what does not depend on it. Rule: a PDL kernel calls `enter` before it reads
anything an earlier kernel wrote and before its first store (the graph pool reuses freed blocks).
ROLLOUT_PDL=0 or `set_enabled(False)` before graph capture turns it off.
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
    """Launches from now on use PDL (where supported) or not; captured graphs keep theirs."""
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
