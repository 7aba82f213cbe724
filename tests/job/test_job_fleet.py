"""The Hydra job through a Ray fleet (rollout/job.py with fleet.num_workers=2; CPU, local Ray
cluster): the same parquet output as one worker, every prompt exactly once, resume across
the two paths, per-worker metrics; and one worker never imports Ray."""
import subprocess
import sys

import pytest
from hydra.errors import ConfigCompositionException
from test_job import ROOT, child_env, make_cfg, rows_of

from rollout.job import run
from rollout.metrics import read_offline_run

# few prompts, short answers: Ray start-up dominates
SMALL = ("data.limit=12", "sampling.n=2", "sampling.max_new_tokens=6")
GREEDY = (*SMALL, "batch_prompts=2", "sampling.temperature=0")
FLEET = "fleet.num_workers=2"


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()


def _same_rows(got, want):
    def key(r):
        return r["prompt_index"], r["sample_index"]
    assert [key(r) for r in got] == [key(r) for r in want]
    for a, b in zip(got, want):
        assert a["completion_ids"] == b["completion_ids"] and a["text"] == b["text"]
        assert a["finish_reason"] == b["finish_reason"] and a["prompt_ids"] == b["prompt_ids"]
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-5)


def test_cli_with_two_workers_starts_and_stops_its_own_ray(tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "cli"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/rollout.py"), "+experiment=grpo", FLEET, *SMALL,
                           "batch_prompts=4", f"output_dir={out}", "logging=none"], cwd=tmp_path, env=child_env(),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rollout: 12 prompts" in proc.stdout and "fleet: 2 workers" in proc.stdout
    rows = rows_of(out)
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(i, g) for i in range(12) for g in range(2)]
    assert len(list((out / "rollouts").glob("part-*.parquet"))) == 3


def test_fleet_job_equals_one_worker_greedy(ray_cluster, tmp_path):
    one = run(make_cfg(tmp_path / "one", *GREEDY))
    two = run(make_cfg(tmp_path / "two", *GREEDY, FLEET))
    want, got = rows_of(tmp_path / "one/out"), rows_of(tmp_path / "two/out")
    # every prompt exactly once, each group whole, in the same 6 parts of 2 prompts
    assert [(r["prompt_index"], r["sample_index"]) for r in got] == [(i, g) for i in range(12) for g in range(2)]
    _same_rows(got, want)
    assert len(list((tmp_path / "two/out/rollouts").glob("part-*.parquet"))) == two["parts"] == 6
    assert two["tokens"] == one["tokens"] and two["completions"] == 24
    assert two["workers"] == 2 and two["dead_actors"] == 0 and two["fleet_tok_s"] > 0
    assert set(two["worker_tok_s"]) == {"0", "1"} and all(r > 0 for r in two["worker_tok_s"].values())
    assert "workers" not in one                                     # one worker: no fleet keys
    # the W&B run has the fleet's rates, per worker and summed
    (run_dir,) = (tmp_path / "two/wb/wandb").glob("offline-run-*")
    history, final = read_offline_run(run_dir)
    history = [h for h in history if "rollouts/completions" in h]   # not close()'s table-only row
    last = history[-1]
    assert last["rollouts/completions"] == 24 and last["fleet/num_live"] == 2 and last["fleet/dead_actors"] == 0
    assert last["tokens/version_age_0"] == two["tokens"] <= last["tokens/generated"]   # engines count discarded too
    for w in (0, 1):
        assert max(h[f"fleet/worker_{w}/gen_tok_s"] for h in history) > 0
        assert last[f"fleet/worker_{w}/outstanding"] == 0
        # dispatch load and KV demand as fractions of the worker's capacity (KV-aware balancing)
        assert all(0 <= h[f"fleet/worker_{w}/{k}"] <= 4 for h in history for k in ("load", "kv_demand"))
    assert max(h["throughput/gen_tok_s"] for h in history) > 0
    assert final["fleet_tok_s"] == two["fleet_tok_s"]


def test_resume_across_one_worker_and_fleet(ray_cluster, tmp_path):
    seeded = (*SMALL, "batch_prompts=4")                            # grpo: temperature 1, per-prompt seeds
    ref = run(make_cfg(tmp_path / "ref", *seeded))
    assert run(make_cfg(tmp_path, *seeded, "data.limit=4"))["parts"] == 1     # one worker: first wave only
    parts = tmp_path / "out/rollouts"
    (parts / ".part-00001.parquet.tmp").write_bytes(b"a wave killed mid-write")
    again = run(make_cfg(tmp_path, *seeded, FLEET))                 # the fleet does the other two waves
    assert again["skipped_prompts"] == 4 and again["prompts"] == 8 and again["parts"] == 3
    assert not list(parts.glob(".*.tmp"))
    rows = rows_of(tmp_path / "out")
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(i, g) for i in range(12) for g in range(2)]
    _same_rows(rows, rows_of(tmp_path / "ref/out"))                 # = the uninterrupted one-worker run
    assert again["tokens"] + ref["tokens"] > ref["tokens"]
    assert run(make_cfg(tmp_path, *seeded))["prompts"] == 0         # nothing left, whichever path


def test_fleet_config_errors(ray_cluster, tmp_path):
    with pytest.raises(ConfigCompositionException, match="fleet.num_workers=two"):
        make_cfg(tmp_path, "fleet.num_workers=two")
    with pytest.raises(ValueError, match="fleet.num_workers must be >= 1, got 0"):
        run(make_cfg(tmp_path, "fleet.num_workers=0"))
    with pytest.raises(ValueError, match="needs 200 CPUs and 0 GPUs but the Ray cluster has 4"):
        run(make_cfg(tmp_path, FLEET, "fleet.num_cpus_per_worker=100"))
    with pytest.raises(ValueError, match="CUDA workers need GPUs"):
        run(make_cfg(tmp_path, FLEET, "engine.device=cuda", "fleet.num_gpus_per_worker=0"))
    assert not (tmp_path / "out").exists() and not (tmp_path / "wb").exists()   # nothing written
    assert ray_cluster.is_initialized() and not ray_cluster.util.list_named_actors()


def test_one_worker_never_imports_ray(tmp_path):
    code = f"""
import sys
from hydra import compose, initialize_config_dir
from rollout.job import register_configs, run
register_configs()
with initialize_config_dir(config_dir={str(ROOT / 'conf')!r}, version_base="1.3"):
    cfg = compose("config", overrides=["+experiment=grpo", "data.limit=4", "output_dir={tmp_path / 'out'}",
                                       "logging=none", "fleet.num_workers=1"])
assert run(cfg)["completions"] == 32
print("ray modules:", sorted(m for m in sys.modules if m == "ray" or m.startswith("ray.")))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=child_env(), capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ray modules: []" in proc.stdout
