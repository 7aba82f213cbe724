"""The job's multi-turn path (`+experiment=agent`: rollout.tasks.arith_chain on the embedded model, CPU):
rows with consistent masks, spans and per-turn rewards, the stored tokens re-scoring to the stored
logprobs, the prefix cache serving the later turns (summary and the offline W&B run), resume, and the
settings checked before anything is written."""
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
from test_job import LIMIT, N, WAVE, rows_of
from test_job import make_cfg as job_cfg

from rollout import RolloutEngine
from rollout.job import run
from rollout.metrics import read_offline_run
from rollout.tasks import arith
from rollout.tasks.arith_chain import ArithChain

PAGE = 4                                 # conf/experiment/agent.yaml's engine.page_size


def make_cfg(tmp, *overrides):
    return job_cfg(tmp, *overrides, experiment="agent")


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agent")
    return tmp, run(make_cfg(tmp)), rows_of(tmp / "out")


def test_rows_have_consistent_masks_spans_and_turn_rewards(agent_run):
    tmp, summary, rows = agent_run
    eng = RolloutEngine.from_pretrained(arith.default_model_path(), device="cpu", dtype="float32")
    tok = eng.tokenizer
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(i, k) for i in range(LIMIT) for k in range(N)]
    for r in rows:
        ids, spans = r["token_ids"], r["spans"]
        prompt = tok(r["prompt"]).input_ids
        assert ids[:len(prompt)] == prompt and spans[0][0] == len(prompt)
        assert len(r["generated"]) == len(r["logprobs"]) == len(r["policy_versions"]) == len(ids)
        assert r["generated"] == [any(s <= j < e for s, e in spans) for j in range(len(ids))]
        assert all((v == 0 and lp <= 0) if g else (v == -1 and lp == 0.0)
                   for g, v, lp in zip(r["generated"], r["policy_versions"], r["logprobs"]))
        assert len(r["turn_rewards"]) == len(spans) == len(r["turn_finish_reasons"]) <= 4
        assert r["reward"] == sum(r["turn_rewards"]) and r["end"] in ("done", "max_turns", "max_model_len")
        # Replaying the environment on the stored answers gives the stored observations and rewards.
        env = ArithChain(r["prompt"], tok)
        for j, (s, e) in enumerate(spans):
            obs, reward, done = env.step(SimpleNamespace(token_ids=ids, spans=spans[:j + 1]))
            assert reward == r["turn_rewards"][j]
            if j + 1 < len(spans):
                assert not done and ids[e:spans[j + 1][0]] == obs
    four = [r for r in rows if len(r["spans"]) == 4]
    assert len(four) > len(rows) // 3 and all(r["end"] == "max_turns" for r in four)
    first = sum(r["turn_rewards"][0] for r in rows) / len(rows)
    assert first > 0.5                       # turn 1 is the trained problem: ~0.8 at temperature 1
    assert len(summary["turn_mean_rewards"]) == 4 and summary["turn_mean_rewards"][0] == pytest.approx(first, abs=1e-4)
    assert summary["mean_reward"] == pytest.approx(sum(r["reward"] for r in rows) / len(rows))
    assert summary["completions"] == len(rows) and summary["tokens"] == sum(sum(r["generated"]) for r in rows)
    # The stored tokens re-score to the stored logprobs at the generated positions. fp32, but the
    # reduction order differs (one prefill of the whole row against decode steps and cached prefix pages
    # computed in other batch shapes, CPU GEMMs split by thread count): measured up to 1.3e-5 on 2 cores
    # (logprobs near -2.5), so 3e-5.
    scores = eng.score([r["token_ids"] for r in rows], temperature=1.0)
    worst = max(abs(lp - sc[j - 1]) for r, sc in zip(rows, scores)
                for j, (lp, g) in enumerate(zip(r["logprobs"], r["generated"])) if g)
    assert worst <= 3e-5


def test_the_prefix_cache_served_the_later_turns(agent_run):
    tmp, summary, rows = agent_run
    # Each later turn finds at least the full pages its previous turn computed (all but its last token).
    floor = sum((r["spans"][j - 1][1] - 1) // PAGE * PAGE for r in rows for j in range(1, len(r["spans"])))
    assert summary["prefix_cache_hit_tokens"] >= floor > 0
    (run_dir,) = (tmp / "wb/wandb").glob("offline-run-*")
    history, final = read_offline_run(run_dir)
    parts = [h for h in history if "prefix_cache/hit_rate" in h]
    assert len(parts) == LIMIT // WAVE and all(0 < h["prefix_cache/hit_rate"] <= 1 for h in parts)
    assert parts[-1]["prefix_cache/hit_tokens"] == summary["prefix_cache_hit_tokens"]
    assert parts[-1]["prefix_cache/queried_tokens"] == summary["prefix_cache_queried_tokens"]
    assert parts[-1]["tokens/version_age_0"] == summary["tokens"]     # generated tokens only
    assert final["prefix_cache_hit_tokens"] == summary["prefix_cache_hit_tokens"]


def test_resume_gives_the_uninterrupted_trajectories(agent_run, tmp_path):
    ref = agent_run[2]
    assert run(make_cfg(tmp_path, f"data.limit={WAVE}"))["parts"] == 1
    part0 = (tmp_path / "out/rollouts/part-00000.parquet").read_bytes()
    again = run(make_cfg(tmp_path, "batch_prompts=3"))       # other waves: seeds are per prompt and turn
    assert again["skipped_prompts"] == WAVE and again["prompts"] == LIMIT - WAVE
    assert (tmp_path / "out/rollouts/part-00000.parquet").read_bytes() == part0
    rows = rows_of(tmp_path / "out")
    assert [r["token_ids"] for r in rows] == [r["token_ids"] for r in ref]
    assert [r["turn_rewards"] for r in rows] == [r["turn_rewards"] for r in ref]
    with pytest.raises(ValueError, match=r"another config .*env\.max_turns: 4 -> 2"):
        run(make_cfg(tmp_path, "env.max_turns=2"))
    assert set(pq.read_schema(tmp_path / "out/rollouts/part-00000.parquet").names) >= {"generated", "spans", "end"}


@pytest.mark.parametrize("overrides, message", [
    (["env.name=no_such_module_xyz:Env"], r"env\.name='no_such_module_xyz:Env': cannot load 'Env'"),
    (["env.name=rollout.tasks.arith:solve"], r"rollout\.tasks\.arith:solve must take \(prompt, tokenizer\)"),
    (["env.max_turns=0"], r"env\.max_turns must be >= 1, got 0"),
    (["reward=arith"], r"reward='arith' with env\.name='arith_chain': the environment rewards each turn"),
    (["fleet.num_workers=2"], r"multi-turn rollouts run on one worker; set fleet\.num_workers=1"),
])
def test_bad_agent_settings_fail_before_anything_is_written(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        run(make_cfg(tmp_path, *overrides))
    assert not (tmp_path / "out").exists() and not (tmp_path / "wb").exists()
