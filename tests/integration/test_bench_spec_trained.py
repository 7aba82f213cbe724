"""rollout.bench.spec_trained on CPU (a 2-layer model trained for 200 steps; the H200 run trains for 90 s):
the model learns to stop by EOS with lengths that vary, speculation drafts and accepts on it, and in fp32
speculation leaves every sequence's tokens identical (the counter-keyed sampler), in both pairs of runs."""
import json

from rollout.bench import spec_trained


def test_worked_sum_is_column_addition():
    assert spec_trained.worked_sum(4071, 865) == "1+5+0=6 7+6+0=13 0+8+1=9 4+0+0=4 4936"
    assert spec_trained.correct("4071+865=", "1+5+0=6 7+6+0=13 0+8+1=9 4+0+0=4 4936")
    assert not spec_trained.correct("4071+865=", "1+5+0=6 4935")


def test_spec_trained_smoke_cpu(tmp_path):
    out = tmp_path / "spec.json"
    r = spec_trained.main(["--device", "cpu", "--dtype", "float32", "--train-steps", "200", "--hidden", "64",
                           "--layers", "2", "--batch", "64", "--prompts", "4", "--n", "4", "--digits-median", "3",
                           "--digits-cap", "6", "--log-every", "100", "--out", str(out)])
    assert r["trained"]["steps"] == 200 and r["trained"]["final_loss"] < 1.5      # it learned the format
    for name in ("off", "on", "off2", "on2"):
        run = r["runs"][name]
        assert run["tokens"] > 0 and run["makespan_s"] > 0 and run["finished_by_eos"] > 0.5, name
        assert run["length_p50"] < run["length_max"] <= r["max_new_tokens"], name          # lengths vary
    assert r["runs"]["on"]["spec_drafted"] > 0 and r["runs"]["on"]["spec_accepted"] > 0
    assert r["runs"]["off"].get("spec_drafted") is None                                 # no speculator there
    counts = r["runs"]["on"]["pipeline"]        # CUDA counts how steps ran (CPU runs each in place)
    assert {"graph_steps", "verify_graph_steps", "graph_captures"} <= set(counts) and counts["graph_capture_failures"] == 0
    # fp32: speculation changes no token (same seeds, exact acceptance)
    assert r["on_vs_off"]["identical_sequences"] == 1.0 and r["on2_vs_off2"]["identical_sequences"] == 1.0
    assert r["runs"]["on"]["tokens"] == r["runs"]["off"]["tokens"]
    saved = json.loads(out.read_text())
    assert saved["meta"]["command"].startswith("python -m rollout.bench.spec_trained") and "completions" not in \
        saved["runs"]["on"]
