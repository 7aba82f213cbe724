"""Triton kernels and their launch wrappers (which runs at which shape: rollout/layers/). Submodules
import triton; this package does not, so tests can set TRITON_INTERPRET=1 before triton loads."""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import re

@functools.cache
def sm_count(device) -> int:
    """SMs of a torch device (it sizes grids: decode splits, sampler chunks); 4 off CUDA."""
    import torch
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


TRITON_MIN = (3, 4)     # triton.knobs, launch_pdl, gdc_wait / gdc_launch_dependents (torch 2.8)


@functools.cache
def triton_version() -> tuple | None:
    """(major, minor) of the installed triton from package metadata, None for a source build."""
    for dist in ("triton", "pytorch-triton"):
        try:
            return tuple(int(p) for p in re.findall(r"\d+", importlib.metadata.version(dist))[:2])
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def triton_available() -> bool:
    """triton is installed at TRITON_MIN or newer (a source build counts as new enough)."""
    return importlib.util.find_spec("triton") is not None and (triton_version() or TRITON_MIN) >= TRITON_MIN


def resolve_backend(requested: str, device_type: str) -> str:
    """"auto" is Triton on CUDA, torch on CPU; Triton on CUDA without a usable triton raises."""
    if requested not in ("auto", "torch", "triton"):
        raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got {requested!r}")
    backend = requested if requested != "auto" else "triton" if device_type == "cuda" else "torch"
    if backend == "triton" and device_type == "cuda" and not triton_available():
        found = triton_version() if importlib.util.find_spec("triton") else None
        raise RuntimeError(
            f"rollout's Triton kernels need triton >= {'.'.join(map(str, TRITON_MIN))} (torch >= 2.8); found "
            f"{'.'.join(map(str, found)) if found else 'none'}. Upgrade torch / triton, or pass "
            "attention_backend='torch' for the torch reference path (no fused kernels, no CUDA graphs: slower)")
    return backend


def _dot_in_k_order(a, b, out_dtype):
    """a @ b summed over K in index order: bits independent of the tile shape (unlike BLAS)."""
    import numpy as np
    a, b = a.astype(out_dtype), b.astype(out_dtype)
    out = np.zeros(a.shape[:-1] + b.shape[-1:], out_dtype)
    for k in range(a.shape[-1]):
        out += a[..., :, k:k + 1] * b[..., k:k + 1, :]
    return out


def fix_interpreter() -> None:
    """Under TRITON_INTERPRET=1: scalars' `__index__` that numpy >= 2.3 accepts (triton 3.6's breaks
    `range()` over runtime bounds), and tl.dot summing in K order (_dot_in_k_order)."""
    import triton
    if not triton.knobs.runtime.interpret:
        return
    from triton.runtime import interpreter as itp
    orig = itp._patch_lang_tensor
    if getattr(orig, "_rollout_fixed", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._rollout_fixed = True
    itp._patch_lang_tensor = patched
    orig_dot = itp.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:    # 8-bit types: triton's path
            return orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        return itp.TensorHandle(_dot_in_k_order(a.data, b.data, d.data.dtype) + d.data, d.dtype.scalar)

    itp.InterpreterBuilder.create_dot = create_dot
