"""The colocated GRPO benchmark on CPU (tiny shape, fp32, 2 steps per variant): every variant trains, the step
and generation times are real, our variants agree with TRL's recompute (fp32: IS ratio within 1e-4 of 1), and the
sleep variants were asleep at each optimizer step with one sleep per generate."""
import json

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

from rollout.bench import colocated  # noqa: E402


def test_colocated_bench_runs_every_variant_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "colocated.json"
    colocated.main(["--device", "cpu", "--shape", "tiny", "--steps", "2", "--batch", "4", "--num-generations", "2",
                    "--prompt-len", "8", "--completion-len", "8", "--out", str(out)])
    r = json.loads(out.read_text())
    assert list(r["variants"]) == ["trl", "ours", "sleep1", "sleep1-recapture", "sleep2"] and r["dtype"] == "float32"
    assert r["meta"]["command"].startswith("python -m rollout.bench.colocated")
    assert r["warmup"]["variant"] == "ours" and len(r["warmup"]["step_s_all"]) == 2   # run first, not reported
    for name, v in r["variants"].items():
        assert v["steps"] == 2 and len(v["generation_s_all"]) == 2, name      # one generation per step
        assert 0 < v["generation_s"] < v["step_s"] and 0 < v["generation_share"] < 1, name
    assert "sampling/importance_sampling_ratio/mean" not in r["variants"]["trl"]["logged"]   # TRL forms none there
    for name in ("ours", "sleep1", "sleep1-recapture", "sleep2"):
        logged = r["variants"][name]["logged"]
        for k in ("min", "mean", "max"):
            assert all(abs(x - 1) <= 1e-4 for x in logged[f"sampling/importance_sampling_ratio/{k}"]), name
        assert all(x <= 1e-5 for x in logged["sampling/sampling_logp_difference/max"]), name
    for name, level in (("sleep1", 1), ("sleep1-recapture", 1), ("sleep2", 2)):
        v = r["variants"][name]
        assert v["sleep_level_at_optimizer_step"] == [level, level] and v["sleeps"] == 2
        assert v["released_gb"] > 0 and v["sleep_s"] >= 0 and v["wake_s"] >= 0 and v["device_freed_gb"] is None
    assert r["variants"]["sleep2"]["released_gb"] > r["variants"]["sleep1"]["released_gb"]   # the weights too


def test_http_variant_trains_through_a_server_process_on_cpu(tmp_path, monkeypatch):
    """TRL's server mode as the two-GPU run does it, on CPU: the server in a child process, weights over a gloo
    group each step (versions 0, 1: the second step generated on the first update), IS ratio within 1e-4 of 1
    in fp32 (the server's logprobs against TRL's recompute on the same weights)."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "http.json"
    colocated.main(["--device", "cpu", "--shape", "tiny", "--steps", "2", "--batch", "4", "--num-generations", "2",
                    "--prompt-len", "8", "--completion-len", "8", "--variants", "http", "--warmup", "none",
                    "--out", str(out)])
    v = json.loads(out.read_text())["variants"]["http"]
    assert v["steps"] == 2 and 0 < v["generation_s"] < v["step_s"] and v["weight_sync_s"] > 0
    logged = v["logged"]
    for k in ("min", "mean", "max"):
        assert all(abs(x - 1) <= 1e-4 for x in logged[f"sampling/importance_sampling_ratio/{k}"])
    assert logged["gen/policy_version"] == [0, 1]
    assert "sleeps" not in v


def test_an_unknown_warmup_variant_is_refused_before_any_run():
    with pytest.raises(SystemExit, match="unknown variants"):
        colocated.main(["--device", "cpu", "--shape", "tiny", "--warmup", "bogus"])
