"""rollout/layers/ decides which kernel runs at which shape, per engine (its EngineConfig.kernels),
and rollout/kernels/ holds kernels only: no environment reads, no import cycle among them."""
import ast
import os
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")     # as the other interpreter tests: whichever imports triton first

import torch  # noqa: E402

KERNELS = Path(__file__).resolve().parents[2] / "rollout" / "kernels"


def _imports(path: Path) -> set[str]:
    """Absolute names of the modules a rollout.kernels source file imports."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(["rollout", "kernels"][:2 - node.level + 1]) if node.level else ""
            mod = ".".join(p for p in (base, node.module) if p)
            out.add(mod)
            if node.module is None:                  # from . import x: x may be a submodule
                out |= {f"{mod}.{a.name}" for a in node.names}
    return out


def test_kernels_read_no_environment_and_import_no_cycle():
    """No kernels module touches os.environ (rollout/env.py reads the environment; only pdl.py
    takes its PDL default from there), none imports rollout.layers or the models, and the
    kernels' imports among themselves form no cycle (gluon_decode once imported paged_decode
    back)."""
    graph = {}
    for f in KERNELS.glob("*.py"):
        src = f.read_text()
        assert "environ" not in src and "getenv" not in src, f.name
        name = "rollout.kernels" + ("" if f.stem == "__init__" else f".{f.stem}")
        deps = _imports(f)
        assert "os" not in deps, f.name
        outside = {d for d in deps if d.startswith("rollout") and not d.startswith("rollout.kernels")}
        assert outside <= ({"rollout", "rollout.env"} if f.stem == "pdl" else {"rollout.sampler"}), (f.name, outside)
        graph[name] = {d for d in deps if d.startswith("rollout.kernels.") and d != name}
    assert {"rollout.kernels.gluon_decode", "rollout.kernels.paged_decode"} <= set(graph)

    def visit(node, path):
        assert node not in path, " -> ".join(path + [node])
        for dep in graph.get(node, ()):
            visit(dep, path + [node])
    for node in graph:
        visit(node, [])


TINY_GEMMS = "384x256=32,64,4,2 256x256=64,64,4,2,2 1536x256=64,64,4,2 256x768=64,64,4,2,2"   # qkv o gate_up down


def test_two_engines_in_one_process_take_their_own_kernel_forms(monkeypatch):
    """Two engines alive together, built with different EngineConfig.kernels, each run their own
    forms however their steps interleave: one the defaults (the QKV GEMM's RoPE epilogue, SiLU in
    gate_up's epilogue, split-K partials into the norm, Gluon decode attention with its early
    tiles) with the lm_head on the skinny GEMM, the other the separate kernels, Triton's decode
    attention and the lm_head on cuBLAS. Their tokens agree and their logprobs differ by fp32
    summation order only (the lm_head's: ~1e-6). On CPU the skinny GEMM's GPU-only gate is opened
    for decode-sized x (the tiny shapes' configs come from skinny_configs, through pick_config),
    and the decode-attention choice is recorded for a decode-shaped batch at P1's shape."""
    from engine_ab import TINY_PROMPTS, tiny_params
    from paged_cases import make_paged, meta_for
    from rollout import RolloutEngine
    from rollout.bench.shapes import make_config
    from rollout.env import KernelSwitches
    from rollout.kernels import paged_decode, rope_kv
    from rollout.kernels import skinny_gemm as sg
    from rollout.layers import attention, linear

    monkeypatch.setattr(linear, "skinny_config", lambda lin, x, overrides=None: linear.pick_config(
        *lin.weight.shape, x.shape[0], False, overrides) if x.shape[0] <= linear.MAX_M else None)
    calls = []
    for mod, fn in ((sg, "skinny_gemm"), (rope_kv, "qkv_rope_and_write_kv"), (rope_kv, "rope_and_write_kv")):
        inner = getattr(mod, fn)
        monkeypatch.setattr(mod, fn, lambda *a, fn=fn, inner=inner, **k: calls.append(
            (fn, a[1].shape[0] if fn == "skinny_gemm" else 0, bool(k.get("partials") or k.get("silu_mul"))))
            or inner(*a, **k))
    fused = KernelSwitches(skinny_configs=TINY_GEMMS + " 4096x256=64,64,4,2")
    plain = KernelSwitches(rope_in_qkv=False, silu_in_gate_up=False, splitk_into_norm=False, gluon_decode=False,
                           skinny_configs=TINY_GEMMS + " 4096x256=cublas")
    engines = {name: RolloutEngine.from_config(make_config("tiny"), seed=0, device="cpu", dtype="float32",
                                               max_model_len=64, num_kv_pages=16, attention_backend="triton",
                                               kernels=switches)
               for name, switches in (("fused", fused), ("plain", plain))}
    outs, seen = {}, {}
    for name in ("fused", "plain", "fused"):
        calls.clear()
        out = [(o.completions[0].token_ids, o.completions[0].logprobs)
               for o in engines[name].generate(TINY_PROMPTS, tiny_params(), use_tqdm=False)]
        assert outs.setdefault(name, out) == out and seen.setdefault(name, set(calls)) == set(calls)
    assert seen["fused"] == {("qkv_rope_and_write_kv", 0, False), ("skinny_gemm", 256, True),
                             ("skinny_gemm", 1536, True), ("skinny_gemm", 4096, False)}
    assert seen["plain"] == {("skinny_gemm", 384, False), ("rope_and_write_kv", 0, False),
                             ("skinny_gemm", 256, False), ("skinny_gemm", 1536, False)}
    for (tok_a, lp_a), (tok_b, lp_b) in zip(outs["fused"], outs["plain"]):
        assert tok_a == tok_b and max(abs(x - y) for x, y in zip(lp_a, lp_b)) < 1e-5

    decode = []
    monkeypatch.setattr(paged_decode, "gluon_supported", lambda *a: True)
    monkeypatch.setattr(paged_decode, "paged_decode_attention", lambda q, *a, **k: decode.append((a[6], k)) or q)
    lens = [100 + i for i in range(32)]
    _, caches, bt = make_paged(lens, 8, 128, 16, torch.bfloat16, seed=0)
    meta = replace(meta_for(lens, [1] * 32, bt, 16), backend="triton")
    q = torch.zeros(32, 32, 128, dtype=torch.bfloat16)
    for name in ("fused", "plain"):
        attention.paged_attention(q, *caches, meta, 0.1, None, engines[name].model.kernels)
    assert decode == [(1, dict(gluon=True, early=True, **attention.GLUON_TILE)),
                      (2, dict(gluon=False, **attention.DECODE_TILE))]
