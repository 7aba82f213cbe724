"""bench.occupancy: kernels compiled for sm_90a here (no GPU) and the programs an SM holds. The facts
the decode GEMM table's configs were chosen by are asserted at the table's own configs (layers/linear.py):
QKV's 96 programs at one an SM (36 SMs idle), packed gate_up's one an SM, and a QKV config of 192
programs in one wave. The compiles run in a subprocess without TRITON_INTERPRET."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_programs_an_sm_from_shared_memory_registers_and_threads():
    from rollout.bench.occupancy import per_sm
    assert per_sm(147456, 78, 4) == 1 and per_sm(98304, 80, 4) == 2 and per_sm(65536, 96, 4) == 3
    assert per_sm(1024, 255, 8) == 1              # registers bind: 255 x 256 threads of 65,536
    assert per_sm(0, 16, 1) == 64                 # threads bind: 2,048 an SM


COMPILE = textwrap.dedent("""
    import json
    from rollout.bench.occupancy import compile_sm90, per_sm
    from rollout.kernels import rope_kv, skinny_gemm
    from rollout.layers.linear import pick_config
    out = {}
    for name, (N, K), packed, cfg in (("qkv", (6144, 4096), True, None), ("qkv_split", (6144, 4096), True,
                                      (64, 128, 4, 3, 2)), ("gate_up", (28672, 4096), True, None)):
        bn, bk, warps, stages, *split = cfg or pick_config(N, K, 32, packed)
        common = dict(BLOCK_M=32, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split[0] if split else 1, PDL=1, TILED=packed)
        if name.startswith("qkv"):     # with its RoPE epilogue, as the engine runs it
            fn, const = rope_kv._qkv_rope_kernel, dict(common, HQ=32, HKV=8, HALF=64, PRECISE=False)
        else:                          # with its SiLU epilogue
            fn, const = skinny_gemm._skinny_gemm_kernel, dict(common, EVEN_N=True, HAS_BIAS=False, PARTIALS=False,
                                                             SILU_MUL=True)
        k, regs = compile_sm90(fn, const, warps, stages)
        out[name] = dict(programs=N // bn * const["SPLIT_K"], per_sm=per_sm(k.metadata.shared, regs, warps))
    print(json.dumps(out))
""")


def test_decode_gemm_table_configs_at_32_rows_fill_the_sms_they_were_chosen_for():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", COMPILE], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["qkv"] == dict(programs=96, per_sm=1)                # the table's QKV: 36 of 132 SMs idle
    assert got["qkv_split"] == dict(programs=192, per_sm=2)         # 192 programs in one wave
    assert got["gate_up"] == dict(programs=224, per_sm=1)           # packed gate_up: 1.7 waves
