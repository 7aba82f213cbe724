"""The KV-pressure benchmark on CPU: the tiny shape in fp32, where a preempted sequence's
recomputed KV must give exactly the tokens of the unpressured run."""
import json

import pytest
import torch

from rollout.bench import pressure
from rollout.bench.shapes import make_config

B, P, G = 4, 16, 64


def test_pressured_run_preempts_and_matches_the_unpressured_run(tmp_path):
    out = tmp_path / "pressure.json"
    pressure.main(["--shape", "tiny", "--batch", str(B), "--prompt-len", str(P), "--gen-len", str(G),
                   "--kv-fraction", "0.5", "--dtype", "float32", "--device", "cpu", "--out", str(out)])
    r = json.loads(out.read_text())
    un, pr = r["unpressured"], r["pressured"]
    for run in (un, pr):
        assert run["all_completed"] and run["completed"] == B and not run["errors"]
        assert run["tokens"] == B * G
        assert run["wall_s"] > 0 and run["tok_s"] == pytest.approx(B * G / run["wall_s"])
        assert 1 <= run["peak_running_seqs"] <= B
    # The unpressured KV holds everyone at once; the pressured one does not, and preempts.
    assert un["kv_tokens"] >= B * (P + G) > pr["kv_tokens"]
    assert un["preemptions"] == 0 and un["recomputed_tokens"] == 0
    assert pr["preemptions"] > 0 and pr["recomputed_tokens"] > 0
    assert pr["prefill_tokens"] > un["prefill_tokens"]          # the recompute is prefill work
    o = r["outputs"]
    assert o["sequences"] == B and o["identical"] and o["sequences_differ"] == 0
    assert o["first_diff_position"] is None
    assert o["max_abs_dlogprob_same_tokens"] < 1e-4              # fp32: prefill vs decode order only
    assert r["tok_s_ratio"] > 0 and r["tok_s_ratio"] == pytest.approx(pr["tok_s"] / un["tok_s"])
    assert r["all_completed"]
    assert r["meta"]["command"].startswith("python -m rollout.bench.pressure --shape tiny")


def test_compare_outputs_counts_differences_and_first_position():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    got = [[1, 2, 3, 4], [5, 6, 0, 8], [9, 1, 9, 9]]
    lp = [[-0.1] * 4 for _ in ref]
    c = pressure.compare_outputs(ref, got, lp, [[-0.1, -0.2, -0.1, -0.1]] + lp[1:])
    assert c["sequences_differ"] == 2 and not c["identical"]
    assert c["first_diffs"] == [{"seq": 1, "position": 2}, {"seq": 2, "position": 1}]
    assert c["first_diff_position"] == 1
    assert c["max_abs_dlogprob_same_tokens"] == pytest.approx(0.1)
    short = pressure.compare_outputs([[1, 2, 3]], [[1, 2]])                 # a truncated sequence differs
    assert short["sequences_differ"] == 1 and short["first_diff_position"] == 2


def test_fit_check_gives_the_largest_gen_len_that_fits():
    cfg = make_config("llama3-8b")
    # The 8B shape at B = 64, P = 256, G = 16384 needs more KV than one H200 has.
    assert pressure.unpressured_kv_bytes(cfg, torch.bfloat16, 64, 256, 16384) > 141e9
    free = 120 * 10**9
    fit = pressure.max_gen_len_fitting(cfg, torch.bfloat16, 64, 256, free)
    need = lambda g: pressure.unpressured_kv_bytes(cfg, torch.bfloat16, 64, 256, g) + pressure.HEADROOM_BYTES
    assert need(fit) <= free < need(fit + 1)


def test_reference_in_chunks_saved_then_compared_in_a_second_call(tmp_path):
    """The H200 flow for B=64 x G=16384: the unpressured reference in two engines of B/2 (all of
    it does not fit at once), each chunk saved by its own call; the pressured run in another
    call compares against both files."""
    refs = [tmp_path / "ref0.npz", tmp_path / "ref1.npz"]
    out = tmp_path / "pressured.json"
    common = ["--shape", "tiny", "--batch", str(B), "--prompt-len", str(P), "--gen-len", str(G),
              "--dtype", "float32", "--device", "cpu", "--reference-chunks", "2"]
    parts = []
    for c in (1, 0):                     # any order: each file knows its prompt range
        r = pressure.main(common + ["--runs", "unpressured", "--chunk", str(c), "--reference-file", str(refs[c])])
        assert "pressured" not in r and refs[c].exists()
        un = r["unpressured"]
        assert (un["prompts_from"], un["prompts_to"], un["batch"]) == (c * B // 2, (c + 1) * B // 2, B // 2)
        assert un["tokens"] == B // 2 * G and un["all_completed"] and un["preemptions"] == 0
        assert 0 < un["fraction_of_roofline"] == pytest.approx(un["tok_s"] / un["roofline_tok_s"])
        parts.append(un)
    second = pressure.main(common + ["--runs", "pressured", "--kv-fraction", "0.5", "--out", str(out),
                                     "--reference-file", *map(str, refs)])
    merged = second["unpressured"]
    assert [c["prompts_from"] for c in merged["chunks"]] == [0, B // 2]
    assert merged["tokens"] == B * G and merged["all_completed"]
    assert merged["wall_s"] == pytest.approx(sum(p["wall_s"] for p in parts))
    pr, o = second["pressured"], second["outputs"]
    assert pr["preemptions"] > 0 and pr["all_completed"]
    # fp32 on CPU: recompute gives the same tokens, so nothing differs, before or after a preemption.
    assert o["identical"] and o["differ_at_or_after_first_preemption"] == 0
    assert 1 <= o["sequences_preempted"] <= B
    with pytest.raises(SystemExit, match="cover no output"):     # one chunk's file only
        pressure.main(common + ["--runs", "pressured", "--reference-file", str(refs[0])])
    with pytest.raises(SystemExit, match="other prompts"):       # another seed: other weights and prompts
        pressure.main(common + ["--runs", "pressured", "--seed", "1", "--reference-file", *map(str, refs)])



def test_pressured_run_beside_its_reference_chunks_waits_for_their_files(tmp_path):
    """The one-call flow on a machine of several GPUs: the pressured run starts at the same time as
    the two reference chunks and reads their files (written whole, then renamed) after its own run.
    Without the files it stops with a clear error after its wait."""
    import threading
    refs = [tmp_path / "ref0.npz", tmp_path / "ref1.npz"]
    common = ["--shape", "tiny", "--batch", str(B), "--prompt-len", str(P), "--gen-len", str(G),
              "--dtype", "float32", "--device", "cpu", "--reference-chunks", "2"]
    box = {}
    pressured = threading.Thread(target=lambda: box.update(r=pressure.main(
        common + ["--runs", "pressured", "--kv-fraction", "0.5", "--wait-reference-s", "120",
                  "--reference-file", *map(str, refs)])))
    pressured.start()
    for c in (0, 1):
        pressure.main(common + ["--runs", "unpressured", "--chunk", str(c), "--reference-file", str(refs[c])])
    pressured.join(timeout=300)
    r = box["r"]
    assert r["outputs"]["identical"] and r["pressured"]["preemptions"] > 0
    assert r["unpressured"]["tokens"] == B * G
    assert not list(tmp_path.glob("*.part.npz"))
    with pytest.raises(SystemExit, match="not found"):
        pressure.main(common + ["--runs", "pressured", "--wait-reference-s", "0.1",
                                "--reference-file", str(tmp_path / "none0.npz"), str(tmp_path / "none1.npz")])


def test_differences_are_attributed_to_preemption_only_at_or_after_it():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    got = [[1, 2, 0, 4], [5, 0, 7, 8], [9, 9, 9, 0]]
    c = pressure.compare_outputs(ref, got, first_preempt=[2, 3, None])
    assert c["sequences_preempted"] == 2
    assert c["differ_at_or_after_first_preemption"] == 1      # seq 0: differs at 2, preempted at 2
    assert c["differ_before_any_preemption"] == 2             # seq 1 before its preemption; seq 2 never preempted
