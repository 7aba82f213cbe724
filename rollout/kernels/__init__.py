"""Triton kernels and their launch wrappers: paged decode / prefill attention, RoPE + KV write,
the decode GEMMs, fused small ops, the sampler. Which one runs at which shape is rollout/layers/'s.

Submodules import triton at import time; this package does not, so `triton_available()` works
without it, and the CPU interpreter tests can set TRITON_INTERPRET=1 before triton is first
imported (triton reads it when it is imported and when kernels are decorated).
"""
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


# The kernels use triton.knobs, the launch_pdl launch option and triton.language.extra.cuda's
# gdc_wait / gdc_launch_dependents (PDL), all new in triton 3.4 (torch 2.8); torch 2.6 / 2.7 ship
# triton 3.2 / 3.3, on which every kernel module fails to import.
TRITON_MIN = (3, 4)


@functools.cache
def triton_version() -> tuple | None:
    """(major, minor) of the installed triton from its package metadata (without importing it), None
    when no distribution says (a source build)."""
    for dist in ("triton", "pytorch-triton"):
        try:
            return tuple(int(p) for p in re.findall(r"\d+", importlib.metadata.version(dist))[:2])
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def triton_available() -> bool:
    """True when triton can be imported at a version the kernels run on (TRITON_MIN; a build whose
    version no metadata gives is taken as new enough). Checked without importing it."""
    if importlib.util.find_spec("triton") is None:
        return False
    version = triton_version()
    return version is None or version >= TRITON_MIN


def resolve_backend(requested: str, device_type: str) -> str:
    """The engine's attention_backend: "auto" is the Triton kernels (attention, fused sampler,
    decode GEMMs, CUDA graphs) on CUDA and the torch reference on CPU. Triton on CUDA with no
    usable triton raises, naming the way out, rather than running the slow reference unasked."""
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
    """a [..., M, K] @ b [..., K, N] summed over K in index order, so an output element's bits do
    not depend on the tile's M or N. numpy's matmul goes to BLAS, whose kernel (and so summation
    order) follows the matrix shape: OpenBLAS 0.3.31 gives a row other bits at M = 1 and M = 16,
    which broke the tests that compare two kernels' tilings bit for bit."""
    import numpy as np
    a, b = a.astype(out_dtype), b.astype(out_dtype)
    out = np.zeros(a.shape[:-1] + b.shape[-1:], out_dtype)
    for k in range(a.shape[-1]):
        out += a[..., :, k:k + 1] * b[..., k:k + 1, :]
    return out


def fix_interpreter() -> None:
    """Under TRITON_INTERPRET=1 only. (1) triton 3.6's interpreter holds scalars as 1-element numpy
    arrays and gives them `__index__ = int(array)`, which numpy >= 2.3 rejects, so `range()` over
    runtime bounds (our KV loops) fails. Re-patch `__index__` after triton's own patching (its
    scope restores attributes LIFO, so the original comes back after each launch). (2) tl.dot
    sums in K order whatever the tile shape (_dot_in_k_order), as an MMA does within a tile."""
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
