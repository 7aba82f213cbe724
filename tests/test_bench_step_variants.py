"""The step_variants bench's comparison with its neighbouring baseline rows (CPU: the bench itself
needs CUDA, its bookkeeping does not)."""
import os
import types

os.environ.setdefault("TRITON_INTERPRET", "1")     # as the other bench tests: whichever module imports triton first

import pytest  # noqa: E402

from rollout.bench import step_variants  # noqa: E402
from rollout.bench.step_variants import vs_base  # noqa: E402
from rollout import kernels  # noqa: E402
from rollout.kernels import paged_decode, pdl, rope_kv, skinny_gemm  # noqa: E402
from rollout.models import decoder  # noqa: E402


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


def test_apply_parses_the_timing_bound_knobs_and_base_undoes_them(monkeypatch):
    """late_wait / no_trigger / skip_norms values are kinds, not the numbers of a GEMM config (a run of the
    GPU bench failed on exactly that; "qkv" names the QKV + RoPE kernel, not a skinny GEMM
    shape), and every variant starts from the defaults."""
    monkeypatch.setattr(step_variants, "recapture_graphs", lambda eng: None)
    monkeypatch.setattr(paged_decode, "pick_num_splits", paged_decode.pick_num_splits)
    monkeypatch.setattr(paged_decode, "DECODE_TILE", dict(paged_decode.DECODE_TILE))
    monkeypatch.setattr(paged_decode, "GLUON_TILE", paged_decode.GLUON_TILE)
    monkeypatch.setattr(paged_decode, "GLUON_WARPS", paged_decode.GLUON_WARPS)
    monkeypatch.setattr(paged_decode, "GLUON_EARLY", paged_decode.GLUON_EARLY)
    monkeypatch.setattr(paged_decode, "pick_decode", paged_decode.pick_decode)
    monkeypatch.setattr(skinny_gemm, "_LLAMA3_8B", dict(skinny_gemm._LLAMA3_8B))
    monkeypatch.setattr(skinny_gemm, "_LLAMA3_8B_PACKED", dict(skinny_gemm._LLAMA3_8B_PACKED))
    monkeypatch.setattr(rope_kv, "Q_HEADS_PER_PROGRAM", rope_kv.Q_HEADS_PER_PROGRAM)
    packs = []
    eng = types.SimpleNamespace(model=types.SimpleNamespace(
        splitk_into_norm=True, silu_in_gate_up=True, rope_in_qkv=True,
        pack_decode_weights=lambda rows, on: packs.append((rows, on))))
    defaults = dict(rope=rope_kv.Q_HEADS_PER_PROGRAM, table=dict(skinny_gemm._LLAMA3_8B),
                    packed_table=dict(skinny_gemm._LLAMA3_8B_PACKED),
                    tile=dict(paged_decode.DECODE_TILE), splits=paged_decode.pick_num_splits,
                    gluon_tile=paged_decode.GLUON_TILE, gluon_warps=paged_decode.GLUON_WARPS,
                    gluon_early=True, decode=paged_decode.pick_decode,
                    splitk_norm=True, silu_gate_up=True, rope_in_qkv=True, add_norm=decoder.add_norm_of_linear,
                    batch=32)
    try:
        step_variants.apply(eng, "late_wait=o,gate_up,down0+skip_norms=post+qkv=32,256,4,5", defaults)
        assert pdl._late == {"gemm:4096,4096", "gemm:28672,4096", "split0:4096,14336"}
        assert decoder.add_norm_of_linear.keywords == {"skip": "post"}
        assert skinny_gemm._LLAMA3_8B[(6144, 4096)] == ((64, (32, 256, 4, 5)),)
        step_variants.apply(eng, "late_wait+skip_norms", defaults)
        assert pdl._late == {"gemm", "qkv", "attn"} and pdl._no_trigger == frozenset()
        assert decoder.add_norm_of_linear.keywords == {"skip": ("pre", "post")}
        step_variants.apply(eng, "no_trigger", defaults)
        assert pdl._no_trigger == {"qkv"} and pdl._late == frozenset()
        step_variants.apply(eng, "no_trigger=attn,o", defaults)
        assert pdl._no_trigger == {"attn", "gemm:4096,4096"}
        assert packs == [(32, False)] * 4
        step_variants.apply(eng, "packed+down=64,128,4,5,2", defaults)
        assert packs[-1] == (32, True) and skinny_gemm._LLAMA3_8B[(4096, 14336)] == ((64, (64, 128, 4, 5, 2)),)
        assert skinny_gemm.pick_config(4096, 14336, 32, packed=True) == (64, 128, 4, 5, 2)
        assert skinny_gemm.pick_config(28672, 4096, 32, packed=True) == (128, 64, 8, 5)   # the packed table's
        step_variants.apply(eng, "gattn=64,3,2", defaults)
        assert paged_decode.GLUON_TILE == (64, 3, "heads") and paged_decode.pick_decode(32, 8) == (2, True)
        step_variants.apply(eng, "gattn=32,6,1,1", defaults)
        assert paged_decode.GLUON_TILE == (32, 6, "warp_scores") and paged_decode.pick_decode(32, 8) == (1, True)
        step_variants.apply(eng, "gattn=64,3,1,2", defaults)
        assert paged_decode.GLUON_TILE == (64, 3, "keys") and paged_decode.GLUON_WARPS == 4
        step_variants.apply(eng, "gattn=128,2,1,2,8", defaults)
        assert paged_decode.GLUON_TILE == (128, 2, "keys") and paged_decode.GLUON_WARPS == 8
        step_variants.apply(eng, "gattn=128,2,1,2", defaults)       # no W: 4 warps, not the last knob's
        assert paged_decode.GLUON_TILE == (128, 2, "keys") and paged_decode.GLUON_WARPS == 4
        step_variants.apply(eng, "packed+no_attn_early", defaults)
        assert paged_decode.GLUON_EARLY is False and packs[-1] == (32, True)
        step_variants.apply(eng, "attn=2,64,4,2", defaults)
        assert paged_decode.GLUON_EARLY is True
        assert paged_decode.GLUON_TILE is None and paged_decode.pick_num_splits(32, 8) == 2
        assert paged_decode.pick_decode(32, 8, gluon_ok=True) == (2, False)
        step_variants.apply(eng, "no_gattn", defaults)
        assert paged_decode.GLUON_TILE is None and paged_decode.pick_decode is defaults["decode"]
        sms = []
        monkeypatch.setattr(kernels, "sm_count", lambda device: 132)
        eng.device, eng.model.use_decode_megakernel = "cuda", lambda n: sms.append(n)
        step_variants.apply(eng, "mega", defaults)
        assert sms == [132]
        eng.model.decode_megakernel = True
        step_variants.apply(eng, "base", defaults)
        assert eng.model.decode_megakernel is False
        assert paged_decode.GLUON_TILE == defaults["gluon_tile"] and paged_decode.pick_decode(32, 8, gluon_ok=True)[1]
        assert paged_decode.GLUON_WARPS == defaults["gluon_warps"] == 8
        assert packs[-1] == (32, False)
        assert pdl._late == pdl._no_trigger == frozenset() and decoder.add_norm_of_linear is defaults["add_norm"]
        assert skinny_gemm._LLAMA3_8B == defaults["table"] and skinny_gemm._LLAMA3_8B_PACKED == defaults["packed_table"]
        with pytest.raises(SystemExit, match="unknown knob"):
            step_variants.apply(eng, "late_wiat", defaults)
    finally:
        pdl.set_late(())
        pdl.set_no_trigger(())
        decoder.add_norm_of_linear = defaults["add_norm"]


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
