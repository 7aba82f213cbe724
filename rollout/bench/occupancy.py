"""Triton and Gluon kernels compiled for sm_90a on any machine (no GPU; triton's bundled ptxas gives the
registers), and the programs an H100 / H200 SM holds: the compile tests' occupancy checks. Run without
TRITON_INTERPRET (the interpreter replaces the kernels these compile).
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

SMEM_PER_SM = 233472      # bytes of shared memory on one SM (H100 / H200); each CTA also takes 1 KB
REGS_PER_SM = 65536
PTR_ARGS = {"q_ptr", "k_ptr", "v_ptr", "out_ptr", "x_ptr", "w_ptr", "b_ptr", "y_ptr", "qo_ptr", "kc_ptr",
            "vc_ptr"}
PTR_TYPES = {"bt_ptr": "*i32", "lens_ptr": "*i32", "pos_ptr": "*i64", "inv_freq_ptr": "*fp32",
             "slot_ptr": "*i64", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "po_ptr": "*fp32", "plse_ptr": "*fp32"}


def compile_sm90(fn, const: dict, num_warps: int, num_stages: int = 2, gluon: bool = False,
                 types: dict | None = None) -> tuple:
    """(compiled kernel, registers a thread from ptxas -v) of Triton or Gluon kernel `fn` for sm_90a
    at these constexprs. Argument types: `types` (int32 for any it does not name) where given, else
    pointers bf16 unless PTR_TYPES says otherwise, scalars int32 (fp32 for softmax scales); pointers,
    N and strides 16-divisible, as the JIT specialises them."""
    import triton
    from triton.backends.compiler import GPUTarget
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif types is not None:
            sig[name] = types.get(name, "i32")
        else:
            sig[name] = PTR_TYPES.get(name, "*bf16" if name in PTR_ARGS else "fp32" if "scale" in name else "i32")
        if name.endswith("_ptr") or name == "N" or name.startswith("s_"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as Source
        options = dict(num_warps=num_warps)
    else:
        from triton.compiler import ASTSource as Source
        options = dict(num_warps=num_warps, num_stages=num_stages, launch_pdl=True)
    k = triton.compile(Source(fn=fn, signature=sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=options)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:      # registers: ptxas -v (n_regs needs a GPU to load the kernel)
        with open(os.path.join(d, "k.ptx"), "w") as f:
            f.write(k.asm["ptx"])
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.path.join(d, "k.o")],
                              capture_output=True, text=True, check=True).stderr
    return k, max(int(r) for r in re.findall(r"Used (\d+) registers", info))


def per_sm(shared: int, regs: int, num_warps: int) -> int:
    """Programs of this size one SM holds at once: what its shared memory, registers and 2,048 threads allow."""
    return min(SMEM_PER_SM // (shared + 1024), REGS_PER_SM // (regs * 32 * num_warps), 2048 // (32 * num_warps))
