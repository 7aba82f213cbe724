"""The step_variants bench's bookkeeping on CPU (the bench itself needs CUDA): its comparison with the
neighbouring baseline rows, the KernelSwitches each variant builds, that applying variants to one
engine's model changes its kernel forms and not its tokens, and the KV page relayout."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")     # as the other bench tests: whichever module imports triton first

import pytest  # noqa: E402

from rollout.bench import step_variants  # noqa: E402
from rollout.bench.step_variants import parse_variant, vs_base  # noqa: E402
from rollout.env import KernelSwitches  # noqa: E402

L8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
       "lm_head": (128256, 4096)}


def test_vs_base_compares_each_variant_with_the_mean_of_its_neighbouring_baselines():
    rows = [dict(variant="base", fraction=0.80), dict(variant="a", fraction=0.815),
            dict(variant="base", fraction=0.81), dict(variant="b", error="out of shared memory"),
            dict(variant="c", fraction=0.79), dict(variant="base", fraction=0.82),
            dict(variant="d", fraction=0.83)]
    vs_base(rows)
    assert rows[1]["vs_base"] == pytest.approx(0.815 - 0.805)     # between two baselines
    assert "vs_base" not in rows[3]                                # failed: nothing to compare
    assert rows[4]["vs_base"] == pytest.approx(0.79 - 0.815)       # skips the failed row
    assert rows[6]["vs_base"] == pytest.approx(0.83 - 0.82)        # last row: one side only
    assert all("vs_base" not in r for r in rows if r["variant"] == "base")


def test_vs_base_takes_the_first_variant_as_the_baseline_and_interpolates_to_the_context():
    """A sweep of packed variants: `packed` is the baseline; a window between two baselines is read
    against the line through them at its own mean context (the fraction grows with it)."""
    rows = [dict(variant="packed", fraction=0.819, mean_context=4610),
            dict(variant="packed+o", fraction=0.827, mean_context=5115),
            dict(variant="packed", fraction=0.833, mean_context=6125),
            dict(variant="packed+down", fraction=0.80, mean_context=6630)]
    vs_base(rows)
    assert rows[1]["vs_base"] == pytest.approx(0.827 - (0.819 + 0.014 * 505 / 1515))
    assert rows[3]["vs_base"] == pytest.approx(0.80 - 0.833)       # after the last baseline: that one
    assert "vs_base" not in rows[0] and "vs_base" not in rows[2]
    empty = [dict(variant="a", error="out of shared memory")]
    vs_base(empty)
    assert "vs_base" not in empty[0]


def test_variants_build_their_switches_on_top_of_the_engines():
    base = KernelSwitches(skinny_configs="4096x14336=32,256,4,5")          # e.g. from ROLLOUT_SKINNY_CONFIGS
    assert parse_variant("base", L8B, base) == (base, True, False)
    sw, pdl_on, packed = parse_variant("packed+no_pdl+no_gluon+no_rope_in_qkv+qkv=64,128,4,3,2+o=cublas", L8B, base)
    assert (pdl_on, packed) == (False, True)
    assert sw == KernelSwitches(gluon_decode=False, rope_in_qkv=False,
                                skinny_configs="4096x14336=32,256,4,5 6144x4096=64,128,4,3,2 4096x4096=cublas")
    assert sw.gemm_overrides() == {(4096, 14336): (32, 256, 4, 5), (6144, 4096): (64, 128, 4, 3, 2),
                                   (4096, 4096): None}
    sw, _, _ = parse_variant("no_attn_early+no_splitk_norm+no_silu_gate_up+down=64,128,4,5,4", L8B, base)
    assert not (sw.gluon_early or sw.splitk_into_norm or sw.silu_in_gate_up) and sw.gluon_decode and sw.rope_in_qkv
    assert sw.gemm_overrides()[(4096, 14336)] == (64, 128, 4, 5, 4)         # the knob's config wins
    assert base == KernelSwitches(skinny_configs="4096x14336=32,256,4,5")   # untouched
    for gone in ("late_wait", "no_trigger", "skip_norms=post", "mega", "wait_first", "rope_token",
                 "attn=2,64,4,2", "gattn=64,3,2", "qkv"):
        with pytest.raises(SystemExit, match="unknown knob"):
            parse_variant(gone, L8B, base)
    with pytest.raises(ValueError, match="ROLLOUT_SKINNY_CONFIGS"):
        parse_variant("qkv=64,128", L8B, base)


def _rows(w):
    """A skinny_gemm weight's N, plain [N, K] or packed [tiles, k_tiles, BLOCK_N, BLOCK_K]."""
    return w.shape[0] * (w.shape[2] if w.dim() == 4 else 1)


def test_applying_variants_to_one_engine_changes_its_forms_not_its_tokens(monkeypatch):
    """The bench's loop on the tiny model (Triton backend, interpreter): each variant applied to the
    same engine's model (as before timing it) runs its forms (the separate RoPE / SiLU kernels, the
    fix-up split-K, the QKV GEMM on cuBLAS, packed weight copies) and gives the base variant's
    tokens, with logprobs equal up to fp32 summation order (the QKV on cuBLAS: ~1e-6). The skinny
    GEMM's GPU-only gate is opened for decode-sized x; the tiny shapes' configs come as GEMM knobs."""
    from engine_ab import TINY_PROMPTS, tiny_params, tiny_triton_engine
    from rollout.kernels import pdl, rope_kv
    from rollout.kernels import skinny_gemm as sg
    from rollout.layers import linear
    monkeypatch.setattr(linear, "skinny_config", lambda lin, x, overrides=None: linear.pick_config(
        *lin.weight.shape, x.shape[0], getattr(lin, "weight_tiles", None) is not None, overrides)
        if x.shape[0] <= linear.MAX_M else None)
    calls = []
    for mod, fn in ((sg, "skinny_gemm"), (rope_kv, "qkv_rope_and_write_kv"), (rope_kv, "rope_and_write_kv")):
        inner = getattr(mod, fn)
        monkeypatch.setattr(mod, fn, lambda *a, fn=fn, inner=inner, **k: calls.append(
            (fn, _rows(a[1]) if fn == "skinny_gemm" else 0, bool(k.get("tiled")))) or inner(*a, **k))
    eng = tiny_triton_engine()
    tiny = "qkv=32,64,4,2+o=64,64,4,2,2+gate_up=64,64,4,2+down=64,64,4,2,2"
    base, runs, was = eng.model.kernels, {}, pdl.enabled()
    try:
        for variant in ("base+" + tiny, f"{tiny}+no_splitk_norm+no_silu_gate_up+no_rope_in_qkv+no_pdl",
                        f"{tiny}+packed", f"{tiny}+qkv=cublas"):
            step_variants.apply(eng, variant, base, was, rows=8)
            calls.clear()
            outs = eng.generate(TINY_PROMPTS, tiny_params(), use_tqdm=False)
            runs[variant] = [o.completions[0] for o in outs], set(calls)
    finally:
        pdl.set_enabled(was)
    (ref, fused), (_, plain), (_, packed), (_, cublas) = runs.values()
    assert ("qkv_rope_and_write_kv", 0, False) in fused and ("rope_and_write_kv", 0, False) not in fused
    assert ("rope_and_write_kv", 0, False) in plain and ("skinny_gemm", 384, False) in plain
    assert {c for c in packed if c[0] != "rope_and_write_kv"} == {
        ("qkv_rope_and_write_kv", 0, True), ("skinny_gemm", 256, True), ("skinny_gemm", 1536, True)}
    assert ("rope_and_write_kv", 0, False) in cublas and not any(n == 384 for _, n, _ in cublas)
    assert eng.model.layers[0].mlp.gate_up_proj.weight_tiles is None          # the packed copies dropped again
    for completions, _ in runs.values():
        for a, b in zip(ref, completions):
            assert a.token_ids == b.token_ids and max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


@pytest.mark.parametrize("order", ["interleaved", "shuffled"])
def test_relayout_pages_moves_the_kv_and_keeps_the_tokens(model_dir, tiny_tokenizer, order):
    """The bench times P1's page order by moving each sequence's pages: the KV must move with
    them (the greedy tokens after the move equal a run without it), the pages in use become
    1..n in the asked order, and nothing leaks."""
    from hf_reference import random_prompts
    from rollout import RolloutEngine, SamplingParams

    prompts = random_prompts(tiny_tokenizer, 4, 40, 40, seed=3)
    greedy = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)

    def run(relayout):
        eng = RolloutEngine.from_pretrained(model_dir("llama"), device="cpu", dtype="float32", max_model_len=128,
                                            page_size=16, num_kv_pages=64, seed=0)
        eng.add_requests(prompts, greedy)
        for _ in range(4):                       # prefill, then a few decode steps
            eng.step()
        tables = None
        if relayout:
            before = [list(s.block_table) for s in eng.scheduler.running]
            step_variants.relayout_pages(eng, order)
            tables = [list(s.block_table) for s in eng.scheduler.running]
            in_use = sorted(p for t in tables for p in t)
            assert tables != before and in_use == list(range(1, 1 + len(in_use)))
            if order == "interleaved":           # sequence i's page j is page 1 + j * B + i
                assert all(t[j] == 1 + j * len(tables) + i for i, t in enumerate(tables) for j in range(len(t)))
        outs = []
        while eng.has_unfinished():
            outs += eng.step()
        assert eng.kv.alloc.num_used == 0
        return sorted((o.request_id, o.completions[0].token_ids) for o in outs), tables

    moved, tables = run(True)
    assert moved == run(False)[0]
