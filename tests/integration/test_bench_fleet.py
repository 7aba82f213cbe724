"""The fleet benchmark (issue 9) on CPU with a local Ray cluster: the tiny shape, two workers.
The numbers mean nothing here; what is checked is that every run completes and that the
reported quantities are the ones the H200 run will need."""
import pytest

ray = pytest.importorskip("ray")

from rollout.bench import fleet as bench  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _ray_down_after():
    yield
    ray.shutdown()          # the bench starts Ray itself; later modules start their own

COMMON = ["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--prompt-len", "8", "--kv-bytes", "4000000"]


def test_scaling_runs_each_worker_count_and_reports_efficiency():
    r = bench.main(["scaling", *COMMON, "--workers", "1", "2", "--prompts-per-worker", "2", "--n", "2",
                    "--gen-len", "16"])
    one, two = r["runs"]
    assert (one["workers"], two["workers"]) == (1, 2) and r["all_completed"]
    assert one["tokens"] == 2 * 2 * 16 and two["tokens"] == 4 * 2 * 16
    assert one["scaling_efficiency"] == pytest.approx(1.0)
    assert two["scaling_efficiency"] == pytest.approx(two["tok_s"] / (2 * one["tok_s"]))
    assert sum(two["prompts_per_worker"]) == 4 and min(two["prompts_per_worker"]) >= 1   # both worked
    assert r["meta"]["command"].startswith("python -m rollout.bench.fleet scaling")


def test_broadcast_lands_while_every_worker_decodes():
    r = bench.main(["broadcast", *COMMON, "--num-workers", "2", "--batch", "2", "--gen-len", "800",
                    "--update-after-s", "0.3"])
    assert r["backend"] == "gloo" and r["workers"] == 2
    assert r["sent_bytes"] == r["update_bytes"] > 0 and r["broadcast_s"] > 0
    assert r["committed_versions"] == [1, 1] and r["decodes_completed"]
    assert all(w["updates"] == 1 and w["policy_version"] == 1 and w["barrier_ms"] > 0
               for w in r["per_worker"].values())
    # 800 tokens take seconds on CPU, the update goes out after 0.3 s: it lands mid-decode.
    assert r["sequences_spanning_the_update"] >= 1
