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
                           "--digits-cap", "6", "--log-every", "100", "--repeats", "2",
                           "--spec-min-acceptance", "0", "--out", str(out)])   # this little model accepts 6-28%
    assert r["trained"]["steps"] == 200 and r["trained"]["final_loss"] < 1.5      # it learned the format
    for name, run in r["runs"].items():
        assert run["tokens"] > 0 and run["makespan_s"] > 0 and run["finished_by_eos"] > 0.5, name
        assert run["length_p50"] < run["length_max"] <= r["max_new_tokens"], name          # lengths vary
        assert len(run["makespans_s"]) == 2 and run["makespan_s"] in run["makespans_s"], name
        bins = run["tokens_by_batch_size"].values()     # the step calls' walls lie inside the generate call's
        assert sum(b["steps"] for b in bins) == run["steps"], name
        assert 0 < sum(b["seconds"] for b in bins) <= run["makespan_s"], name
    # CPU's eager verify is slower than a plain step, so the speed gate may keep the gated runs from
    # drafting at all (a back-off of up to 256 steps outlasts a run); the same engine with its gate off
    # drafts at every step (spec_min_acceptance 0: no acceptance back-off either) and accepts
    assert r["runs"]["on_ungated"]["spec_drafted"] > 0 and r["runs"]["on_ungated"]["spec_accepted"] > 0
    assert set(r["runs"]) == {"off", "on", "on_ungated", "off2", "on2", "on2_ungated"}
    assert r["on_ungated_vs_off"]["identical_sequences"] == 1.0 and "on2_ungated_vs_off2" in r
    assert r["runs"]["off"].get("spec_drafted") is None                                 # no speculator there
    counts = r["runs"]["on_ungated"]["pipeline"]   # CUDA counts how steps ran (CPU runs each in place)
    assert {"graph_steps", "verify_graph_steps", "graph_captures"} <= set(counts) and counts["graph_capture_failures"] == 0
    # fp32: speculation changes no token (same seeds, exact acceptance)
    assert r["on_vs_off"]["identical_sequences"] == 1.0 and r["on2_vs_off2"]["identical_sequences"] == 1.0
    assert r["runs"]["on"]["tokens"] == r["runs"]["off"]["tokens"] == r["runs"]["on_ungated"]["tokens"]
    saved = json.loads(out.read_text())
    assert saved["meta"]["command"].startswith("python -m rollout.bench.spec_trained") and "completions" not in \
        saved["runs"]["on"]


def test_widened_model_computes_the_trained_models_function(tmp_path):
    """--widen: the padded, deeper model gives the small model's logits (HF forward, fp32) and our engine's
    greedy tokens and logprobs on it equal the small model's. Tolerance 1e-5: the sums gain only exact zero
    terms and RMSNorm's eps is rescaled exactly; what differs is fp32 summation order over wider rows."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rollout.engine import RolloutEngine
    from rollout.models.loader import build_model, copy_hf_tensors
    from rollout.request import SamplingParams

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=18, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, eos_token_id=2)
    small = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in small.parameters():          # norms away from 1, so a wrong gain rescale shows
            p.add_(0.05 * torch.randn_like(p))
    small.save_pretrained(tmp_path)
    big_cfg, tensors = spec_trained.widened(str(tmp_path), 192, 160, 5, torch.device("cpu"), torch.float32)
    assert (big_cfg.num_attention_heads, big_cfg.num_key_value_heads, big_cfg.head_dim) == (12, 6, 16)
    big = LlamaForCausalLM(big_cfg).eval()
    big.load_state_dict(tensors)
    ids = torch.randint(0, 18, (3, 20))
    with torch.no_grad():
        torch.testing.assert_close(big(ids).logits, small(ids).logits, rtol=0, atol=1e-5)

    model = build_model(big_cfg, torch.float32, torch.device("cpu"))
    copy_hf_tensors(model, tensors.items())
    engines = [RolloutEngine.from_pretrained(tmp_path, tokenizer=False, device="cpu", dtype="float32"),
               RolloutEngine(model, big_cfg, device="cpu", dtype="float32")]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    outs = [e.generate([[1, 5, 7, 3], [4, 4]], params, use_tqdm=False) for e in engines]
    for a, b in zip(*outs):
        assert a.completions[0].token_ids == b.completions[0].token_ids
        torch.testing.assert_close(torch.tensor(a.completions[0].logprobs), torch.tensor(b.completions[0].logprobs),
                                   rtol=0, atol=1e-5)


def test_widen_smaller_than_the_trained_model_is_refused(tmp_path):
    import pytest
    from transformers import LlamaConfig, LlamaForCausalLM
    LlamaForCausalLM(LlamaConfig(vocab_size=18, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path)
    import torch
    for size in ((32, 96, 2), (64, 64, 2), (64, 96, 1), (80, 96, 2)):      # the last: not a multiple of 32
        with pytest.raises(ValueError, match="--widen"):
            spec_trained.widened(str(tmp_path), *size, torch.device("cpu"), torch.float32)
