"""The RL-step benchmark on CPU (tiny shape, fp32): drawn lengths honored exactly through the
bench-only stop, the schedule's floor on a hand-computed case, the JSON and the PNG."""
import json

import pytest
import torch

from rollout import RolloutEngine, SamplingParams
from rollout.bench import rl_step
from rollout.bench.pressure import random_model
from rollout.bench.roofline import BW_BYTES_S, schedule_floor_s
from rollout.bench.shapes import make_config


def test_r1_lengths_are_the_documented_draw():
    lengths = rl_step.draw_lengths(256, 2048, 0.9, 16384, 0)
    assert sum(lengths) == 777_028 and max(lengths) == 16384 and min(lengths) >= 1   # docs long-tail.md


def test_floor_of_a_hand_computed_schedule():
    # One sequence, prompt 8, stopped at 3 tokens: the prefill attends over 8 positions, the decodes
    # over 9 and 10, and the step launched before the 3rd token landed (one-step lag) over 11.
    cfg = make_config("tiny")
    engine = RolloutEngine(random_model(cfg, torch.float32, torch.device("cpu"), 0), cfg, device="cpu",
                           max_model_len=64)
    rid = engine.add_requests([list(range(10, 18))], SamplingParams(max_new_tokens=50, ignore_eos=True))[0]
    rec = rl_step.StepRecorder(engine, {(rid, 0): 3})
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert len(outs[0].completions[0].token_ids) == 3 and outs[0].completions[0].finish_reason == "stop"
    assert rec.steps == [(8, 8), (1, 9), (1, 10), (1, 11)] and rec.landed == 3    # (tokens, context)
    assert engine.kv.alloc.num_used == 0
    dense = {"weight_bytes": 2e9, "kv_bytes_per_token": 1e6, "moe_layers": 0, "expert_bytes": 0}
    f = schedule_floor_s(rec.steps, dense)
    assert f["floor_weights_s"] == pytest.approx(4 * 2e9 / BW_BYTES_S)
    assert f["floor_kv_s"] == pytest.approx(38 * 1e6 / BW_BYTES_S)
    assert f["floor_s"] == pytest.approx((8e9 + 38e6) / 4.8e12)
    # An MoE layer reads the experts a step's tokens touch: all 4 of 4 (top-2) take 1 - (1/2)^8 of them at
    # the 8-token prefill, and 2 at a one-token decode step.
    moe = {**dense, "moe_layers": 3, "experts": 4, "top_k": 2, "expert_bytes": 1e8}
    f = schedule_floor_s(rec.steps, moe)
    touched = 4 * (1 - 0.5 ** 8) + 3 * 2
    assert f["floor_weights_s"] == pytest.approx((4 * 2e9 + 3 * touched * 1e8) / BW_BYTES_S)


def test_smoke_run_honors_lengths_and_writes_json_and_png(tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    argv = ["--shape", "tiny", "--prompts", "3", "--n", "2", "--prompt-len", "8", "--median", "6", "--cap", "20",
            "--max-new-tokens", "64", "--dtype", "float32", "--device", "cpu", "--runs", "adaptive,0,1",
            "--num-kv-pages", "8", "--bins", "5", "--out", str(out), "--png", str(png)]
    rl_step.main(argv)
    r = json.loads(out.read_text())
    lengths = rl_step.draw_lengths(6, 6, 0.9, 20, 0)
    assert r["drawn_tokens"] == sum(lengths) and r["meta"]["command"].startswith("python -m rollout.bench.rl_step")
    assert list(r["runs"]) == ["kv_reserve_fraction=adaptive", "kv_reserve_fraction=0", "kv_reserve_fraction=1"]
    assert [run["kv_reserve_fraction"] for run in r["runs"].values()] == [None, 0.0, 1.0]
    for run in r["runs"].values():
        assert run["lengths_honored"] and run["finish_reasons"] == ["stop"] and run["tokens"] == sum(lengths)
        assert run["steps"] > max(lengths) and run["kv_pages"] == 8
        assert run["floor_s"] == pytest.approx(run["floor_weights_s"] + run["floor_kv_s"])
        assert run["fraction_of_floor"] == pytest.approx(run["floor_s"] / run["makespan_s"])
        assert 0 <= run["time_after_90pct_tokens_s"] < run["makespan_s"]
        assert len(run["tok_s_over_time"]) == 5 and sum(run["tok_s_over_time"]) * run["bin_s"] == pytest.approx(
            run["tokens"])
        assert 1 <= run["mean_running_seqs"] <= run["peak_running_seqs"] <= 6
    # A group at its full length (8 + 64 tokens, 2 samples) needs 10 pages of 16, more than the 8: reserving
    # it whole (1.0) runs one group at a time; admitting by the next chunk (0) runs all three at once.
    assert r["runs"]["kv_reserve_fraction=1"]["peak_running_seqs"] == 2
    assert r["runs"]["kv_reserve_fraction=0"]["peak_running_seqs"] == 6
    assert png.stat().st_size > 10_000


def test_a_speculative_run_beside_the_plain_one(tmp_path):
    """'+spec' runs the same workload with speculative='ngram': the speculator's counters come back, and
    the drawn lengths end the sequences as in the plain run."""
    argv = ["--shape", "tiny", "--prompts", "3", "--n", "2", "--prompt-len", "8", "--median", "6", "--cap", "20",
            "--max-new-tokens", "64", "--dtype", "float32", "--device", "cpu", "--runs", "adaptive,adaptive+spec",
            "--bins", "5", "--out", str(tmp_path / "r.json")]
    r = rl_step.main(argv)
    plain, spec = r["runs"]["kv_reserve_fraction=adaptive"], r["runs"]["kv_reserve_fraction=adaptive speculative=ngram"]
    assert plain["speculative"] == "off" and "spec_steps" not in plain
    assert spec["speculative"] == "ngram" and spec["spec_steps"] + spec["spec_empty"] > 0     # it tried to draft
    for run in (plain, spec):
        assert run["finish_reasons"] == ["stop"] and run["tokens"] >= r["drawn_tokens"]
    assert plain["lengths_honored"]


def test_append_adds_runs_of_the_same_workload_and_refuses_another(tmp_path):
    """R1's settings are run in separate device calls into one file: --append keeps the earlier runs and
    their meta; a different workload in the file is refused before any run."""
    out = tmp_path / "r.json"
    base = ["--shape", "tiny", "--prompts", "2", "--n", "2", "--prompt-len", "8", "--median", "6", "--cap", "20",
            "--max-new-tokens", "32", "--dtype", "float32", "--device", "cpu", "--bins", "5", "--out", str(out)]
    rl_step.main(base + ["--runs", "adaptive"])
    r = rl_step.main(base + ["--runs", "0", "--append"])
    saved = json.loads(out.read_text())
    assert list(saved["runs"]) == ["kv_reserve_fraction=adaptive", "kv_reserve_fraction=0"] == list(r["runs"])
    assert len(saved["earlier_meta"]) == 1 and "--append" not in saved["earlier_meta"][0]["command"]
    assert all(run["finish_reasons"] == ["stop"] for run in saved["runs"].values())
    with pytest.raises(SystemExit, match="median"):
        rl_step.main([a if a != "6" else "7" for a in base] + ["--runs", "1", "--append"])
    assert list(json.loads(out.read_text())["runs"]) == list(saved["runs"])      # untouched
    rl_step.main(base + ["--runs", "1"])                       # without --append: a fresh file
    assert list(json.loads(out.read_text())["runs"]) == ["kv_reserve_fraction=1"]
