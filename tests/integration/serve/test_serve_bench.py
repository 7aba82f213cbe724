"""rollout.bench.serve on CPU with the tiny shape (the H200 runs the P3 shape): both runs complete,
the server child process starts and stops, and the JSON carries what the GPU run reports."""
import json

from rollout.bench import serve as bench


def test_throughput_smoke_tiny(tmp_path):
    out = tmp_path / "serve.json"
    r = bench.main(["throughput", "--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--prompts", "4",
                    "--n", "2", "--prompt-len", "16", "--gen-len", "16", "--kv-bytes", "4000000", "--out", str(out)])
    # both servers: the engine loop in its own process ("http") and on a thread of the HTTP process
    assert r["all_completed"] and r["in_process"]["tokens"] == r["http"]["tokens"] == 4 * 2 * 16
    assert r["http_engine_thread"]["tokens"] == 4 * 2 * 16
    assert r["http_over_in_process"] == r["http"]["tok_s"] / r["in_process"]["tok_s"]
    assert r["http_engine_thread_over_in_process"] == r["http_engine_thread"]["tok_s"] / r["in_process"]["tok_s"]
    assert 0 < r["http"]["ttft_p50_ms"] <= r["http"]["ttft_p99_ms"] and r["in_process"]["tok_s"] > 0
    saved = json.loads(out.read_text())
    assert saved["meta"]["command"].startswith("python -m rollout.bench.serve throughput")
    assert {"git_commit", "date", "device"} <= set(saved["meta"]) and saved["stream_interval"] == 16


def test_group_smoke_tiny_gloo(tmp_path):
    """The two-GPU weight-broadcast run's code path on CPU: this process broadcasts new weights over gloo while
    the server decodes; every token after the switch is on v1, none before it, and the server's greedy outputs
    after it equal a fresh engine built on the new weights (fp32 CPU: the same kernels, exactly equal)."""
    r = bench.main(["group", "--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--prompts", "4",
                    "--prompt-len", "16", "--gen-len", "512", "--update-after-s", "0.3", "--kv-bytes", "8000000",
                    "--check-prompts", "3", "--check-len", "12", "--out", str(tmp_path / "group.json")])
    assert r["all_completed"] and r["versions_exact"]
    assert 0 < r["tokens_after_update"] < 4 * 512          # the switch landed mid-decode
    assert r["after_update_equal_fresh"] and r["after_update_max_abs_dlogp"] == 0.0
    assert r["after_update_versions"] == [1]
    assert r["weight_bytes"] > 0 and r["transfer_gb_s"] > 0 and r["barrier_ms"] >= 0
