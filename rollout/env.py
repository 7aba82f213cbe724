"""Environment variables, read here and nowhere else (once, at import).

| variable | default | effect |
|---|---|---|
| `ROLLOUT_PDL` | `1` | `0`: kernels launch without programmatic dependent launch (sm_90+) |
| `ROLLOUT_GLUON_DECODE` | `1` | `0`: Triton's decode attention at every batch size, never the Gluon kernel |
| `ROLLOUT_GLUON_EARLY` | `1` | `0`: the Gluon decode kernel issues its first K / V tiles after its PDL wait |
| `ROLLOUT_SPLITK_NORM` | `1` | `0`: split-K GEMMs sum their own partials instead of the next add + RMSNorm |
| `ROLLOUT_SILU_GATE_UP` | `1` | `0`: SiLU * up in a kernel of its own, not in the gate_up GEMM's epilogue |
| `ROLLOUT_ROPE_QKV` | `1` | `0`: RoPE + the K/V write in a kernel of its own, not in the QKV GEMM's epilogue |
| `ROLLOUT_SKINNY_CONFIGS` | empty | `NxK=BN,BK,W,S[,SK]` or `NxK=cublas`, space-separated: the decode GEMM of that weight shape takes this config at every row count |
| `ROLLOUT_GIT_COMMIT` | unset | the commit stamped into benchmark JSON where the tree has no `.git` |

All but the last are kernel switches (same results either way; the defaults measured fastest),
landing in `KernelSwitches` (`EngineConfig.kernels`, so benchmarks can vary them per engine).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

GemmConfig = Optional[tuple]   # (BLOCK_N, BLOCK_K, num_warps, num_stages[, split_k]), or None for cuBLAS


def parse_skinny_configs(value: str) -> dict[tuple[int, int], GemmConfig]:
    """ROLLOUT_SKINNY_CONFIGS, e.g. "6144x4096=64,128,4,3,2 4096x4096=cublas" -> {(N, K): config}."""
    out = {}
    for item in value.replace(";", " ").split():
        try:
            shape, cfg = item.split("=")
            n, k = (int(d) for d in shape.lower().split("x"))
            nums = None if cfg == "cublas" else tuple(int(c) for c in cfg.split(","))
        except ValueError:
            raise ValueError(f"ROLLOUT_SKINNY_CONFIGS: {item!r} is not NxK=BN,BK,W,S[,SK] or NxK=cublas") from None
        if nums is not None and len(nums) not in (4, 5):
            raise ValueError(f"ROLLOUT_SKINNY_CONFIGS: {item!r} needs 4 or 5 numbers")
        out[(n, k)] = nums
    return out


@dataclass
class KernelSwitches:
    """Which fused forms the Triton path takes (same results; see the table above)."""
    gluon_decode: bool = True
    gluon_early: bool = True
    splitk_into_norm: bool = True
    silu_in_gate_up: bool = True
    rope_in_qkv: bool = True
    skinny_configs: str = ""            # ROLLOUT_SKINNY_CONFIGS' form: overrides of the decode-GEMM table

    def __post_init__(self):
        parse_skinny_configs(self.skinny_configs)      # a bad spec fails here, not at the first decode step

    def gemm_overrides(self) -> dict[tuple[int, int], GemmConfig]:
        return parse_skinny_configs(self.skinny_configs)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> "KernelSwitches":
        def on(name: str) -> bool:
            return environ.get(name, "1") != "0"
        return cls(gluon_decode=on("ROLLOUT_GLUON_DECODE"), gluon_early=on("ROLLOUT_GLUON_EARLY"),
                   splitk_into_norm=on("ROLLOUT_SPLITK_NORM"), silu_in_gate_up=on("ROLLOUT_SILU_GATE_UP"),
                   rope_in_qkv=on("ROLLOUT_ROPE_QKV"), skinny_configs=environ.get("ROLLOUT_SKINNY_CONFIGS", ""))


PDL: bool = os.environ.get("ROLLOUT_PDL", "1") != "0"
SWITCHES = KernelSwitches.from_environ()
GIT_COMMIT: Optional[str] = os.environ.get("ROLLOUT_GIT_COMMIT") or None


def rollout_variables() -> dict[str, str]:
    """The ROLLOUT_* variables a process runs under (stamped into benchmark JSON)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("ROLLOUT_") and k != "ROLLOUT_GIT_COMMIT"}
