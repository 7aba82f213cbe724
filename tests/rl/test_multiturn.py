"""Multi-turn token-in / token-out rollouts (rollout.multiturn) and continuation of a partial
completion (add_requests(..., continue_from=...)): masks, spans, rewards, per-token versions,
re-scoring to the returned logprobs, only the new tokens prefilled, and weight updates between
turns or before a continuation never reusing KV of the old weights."""
import pytest
from safetensors.torch import load_file

from hf_reference import random_prompts
from rollout import RolloutEngine, SamplingParams
from rollout.multiturn import run_trajectories
from rollout.worker import RolloutWorker

PAGE = 16
OBS = 20


def _engine(path, **kw):
    return RolloutEngine.from_pretrained(path, device="cpu", dtype="float32", max_model_len=256, page_size=PAGE,
                                         num_kv_pages=256, max_num_batched_tokens=512, seed=0, **kw)


class ToyEnv:
    """Observation: OBS fixed token ids per turn; reward: the turn's length; done after `turns`."""

    def __init__(self, i, k, turns=4):
        self.i, self.k, self.turns, self.seen = i, k, turns, []

    def step(self, traj):
        start, end = traj.spans[-1]
        self.seen.append(traj.token_ids[start:end])
        obs = [3 + (self.i * 7 + self.k * 3 + len(traj.spans) + j) % 200 for j in range(OBS)]
        return obs, float(end - start), len(traj.spans) >= self.turns


def _check_layout(t, prompt, env):
    """Prompt, then per turn: the completion (mask on), then the environment's tokens (mask off)."""
    assert t.token_ids[:len(prompt)] == prompt
    mask = [False] * len(t.token_ids)
    for (s, e), seen in zip(t.spans, env.seen):
        assert t.token_ids[s:e] == seen and e > s
        mask[s:e] = [True] * (e - s)
    assert t.generated == mask
    assert all((lp == 0.0 and v == -1) or g for lp, v, g in zip(t.logprobs, t.policy_versions, t.generated))
    assert t.rewards == [float(e - s) for s, e in t.spans]
    for (_, e), (s2, _) in zip(t.spans, t.spans[1:]):
        assert s2 - e == OBS                      # exactly the observation between two turns


def test_four_turn_trajectories_rescore_and_prefill_only_new_tokens(model_dir, tiny_tokenizer):
    path = model_dir("llama")
    prompts = random_prompts(tiny_tokenizer, 2, 20, 40, seed=4)
    params = SamplingParams(n=3, max_new_tokens=12, temperature=1.0, seed=9, ignore_eos=True)
    runs = {}
    for caching in (True, False):
        eng = _engine(path, enable_prefix_caching=caching)
        envs = {}
        def factory(i, k):
            return envs.setdefault((i, k), ToyEnv(i, k, turns=2 if (i, k) == (1, 0) else 99))
        runs[caching] = (eng, run_trajectories(eng, prompts, factory, params, max_turns=4), envs)
    eng, trajs, envs = runs[True]
    assert [(t.prompt_index, t.sample_index) for t in trajs] == [(i, k) for i in range(2) for k in range(3)]
    for t in trajs:
        _check_layout(t, prompts[t.prompt_index], envs[t.prompt_index, t.sample_index])
        assert t.end == ("done" if (t.prompt_index, t.sample_index) == (1, 0) else "max_turns")
        assert len(t.spans) == (2 if t.end == "done" else 4) and t.finish_reasons == ["length"] * len(t.spans)
        assert {v for v, g in zip(t.policy_versions, t.generated) if g} == {0}
        # The stored tokens re-score to the returned logprobs: fp32, prefill vs decode order (~1e-6).
        ref = eng.score([t.token_ids], temperature=1.0)[0]
        got = [(lp, ref[j - 1]) for j, (lp, g) in enumerate(zip(t.logprobs, t.generated)) if g]
        assert max(abs(a - b) for a, b in got) <= 1e-5
    # Cache on and off: same tokens (seeded sampling), logprobs to fp32 noise.
    for a, b in zip(trajs, runs[False][1]):
        assert a.token_ids == b.token_ids and a.generated == b.generated and a.spans == b.spans
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5
    # Each later turn finds every full page its previous turn computed (all but that turn's last token).
    hits = sum((t.spans[j - 1][1] - 1) // PAGE * PAGE for t in trajs for j in range(1, len(t.spans)))
    queried = sum(len(p) for p in prompts) + sum(t.spans[j][0] for t in trajs for j in range(1, len(t.spans)))
    on, off = eng.stats(), runs[False][0].stats()
    assert on["prefix_cache_hit_tokens"] == hits and on["prefix_cache_queries"] == queried
    assert off["prefill_tokens"] - on["prefill_tokens"] == hits
    # After the first turn (a group's prompt prefilled once), only the new tokens were: the
    # observation and what of the previous turn did not fill a page.
    later_turns = 5 * 3 + 1
    assert on["prefill_tokens"] <= sum(len(p) for p in prompts) + later_turns * (OBS + PAGE)
    assert eng.kv.alloc.num_used == 0


def test_a_weight_update_between_turns_tags_versions_and_reuses_no_old_kv(model_dir, tiny_tokenizer):
    old, new = model_dir("llama"), model_dir("llama", seed=1)
    prompts = random_prompts(tiny_tokenizer, 2, 20, 40, seed=5)
    worker = RolloutWorker(_engine(old))
    weights = load_file(str(new / "model.safetensors"))
    hits_at_turn = []

    class UpdatingEnv(ToyEnv):
        def step(self, traj):
            hits_at_turn.append((len(traj.spans), worker.stats()["prefix_cache_hit_tokens"]))
            if worker.policy_version == 0 and worker.weights.pending is None:
                worker.update_weights(weights.items(), version=1)   # lands before the next turn
            return super().step(traj)

    trajs = run_trajectories(worker, prompts, lambda i, k: UpdatingEnv(i, k, turns=3),
                             SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True), max_turns=3)
    for t in trajs:
        (s0, e0), *later = t.spans
        assert set(t.policy_versions[s0:e0]) == {0} and all(set(t.policy_versions[s:e]) == {1} for s, e in later)
    # Turn 2 ran under new weights: nothing of turn 1's KV (v0) was reused; turn 3 reused turn 2's.
    assert max(h for turn, h in hits_at_turn if turn == 2) == 0
    assert max(h for turn, h in hits_at_turn if turn == 3) > 0
    fresh = _engine(new, enable_prefix_caching=False)
    for t in trajs:        # from turn 2 on, the new weights' greedy tokens
        s, e = t.spans[1]
        want = fresh.generate([t.token_ids[:s]], SamplingParams(max_new_tokens=e - s, temperature=0,
                                                                ignore_eos=True), use_tqdm=False)
        assert t.token_ids[s:e] == want[0].completions[0].token_ids


def test_bad_observation_or_max_turns_raise_and_leave_nothing_queued(model_dir, tiny_tokenizer):
    eng = _engine(model_dir("llama"))
    prompts = random_prompts(tiny_tokenizer, 2, 10, 20, seed=6)
    p = SamplingParams(max_new_tokens=4, temperature=0)

    class BadEnv:
        def step(self, traj):
            return ["not", "ids"], 0.0, False

    with pytest.raises(ValueError, match="not token ids"):
        run_trajectories(eng, prompts, lambda i, k: BadEnv(), p, max_turns=3)
    assert not eng.requests                   # the other trajectory's turn was aborted
    while eng.has_unfinished():
        assert not eng.step()
    assert eng.kv.alloc.num_used == 0
    with pytest.raises(ValueError, match="max_turns must be"):
        run_trajectories(eng, prompts, lambda i, k: ToyEnv(i, k), p, max_turns=0)


def _abort_midway(eng, prompts, params, steps):
    ids = eng.add_requests(prompts, params)
    for _ in range(steps):
        assert not eng.step()
    return eng.abort(ids)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_continuation_after_abort_equals_the_uninterrupted_run(model_dir, tiny_tokenizer, temperature):
    path = model_dir("llama")
    prompts = random_prompts(tiny_tokenizer, 2, 20, 40, seed=7)
    group = SamplingParams(n=2, max_new_tokens=30, temperature=temperature, seed=3, ignore_eos=True)
    whole = _engine(path).generate(prompts, group, use_tqdm=False)
    eng = _engine(path)
    partial = _abort_midway(eng, prompts, group, steps=12)
    conts = [(p, c) for p, o in zip(prompts, partial) for c in o.completions]
    assert all(c.finish_reason == "abort" and 5 < len(c.token_ids) < 30 for _, c in conts)
    hits0 = eng.stats()["prefix_cache_hit_tokens"]
    one = SamplingParams(n=1, max_new_tokens=30, temperature=temperature, seed=3, ignore_eos=True)
    ids = eng.add_requests([p for p, _ in conts], one, continue_from=[c for _, c in conts])
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step()})
    wants = [c for o in whole for c in o.completions]
    for rid, (p, old), want in zip(ids, conts, wants):
        got = done[rid].completions[0]
        assert got.token_ids == want.token_ids and len(got.token_ids) == 30 and got.finish_reason == "length"
        assert got.sample_index == old.sample_index and got.policy_versions == [0] * 30
        assert got.logprobs[:len(old.logprobs)] == old.logprobs              # kept as they were
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) <= 1e-5   # fp32 reduction order
    # The prompt and the kept tokens came from the cache: every full page but the last token's.
    assert eng.stats()["prefix_cache_hit_tokens"] - hits0 == sum((len(p) + len(c.token_ids) - 1) // PAGE * PAGE
                                                                 for p, c in conts)
    assert eng.kv.alloc.num_used == 0


def test_continuation_after_a_weight_update_carries_the_new_version(model_dir, tiny_tokenizer):
    old, new = model_dir("llama"), model_dir("llama", seed=1)
    prompts = random_prompts(tiny_tokenizer, 2, 20, 40, seed=8)
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    worker = RolloutWorker(_engine(old))
    partial = _abort_midway(worker, prompts, params, steps=10)
    worker.update_weights(load_file(str(new / "model.safetensors")).items(), version=1)
    hits0 = worker.stats()["prefix_cache_hit_tokens"]
    ids = worker.add_requests(prompts, params, continue_from=[o.completions[0] for o in partial])
    done = {}
    while len(done) < len(ids):
        done.update({o.request_id: o for o in worker.step()})
    fresh = _engine(new, enable_prefix_caching=False)
    for rid, p, o in zip(ids, prompts, partial):
        old_c, got = o.completions[0], done[rid].completions[0]
        k = len(old_c.token_ids)
        assert got.token_ids[:k] == old_c.token_ids and got.policy_versions == [0] * k + [1] * (24 - k)
        want = fresh.generate([p + old_c.token_ids], SamplingParams(max_new_tokens=24 - k, temperature=0,
                                                                    ignore_eos=True), use_tqdm=False)
        assert got.token_ids[k:] == want[0].completions[0].token_ids
    assert worker.stats()["prefix_cache_hit_tokens"] == hits0      # KV of v0 is not reused under v1


def test_continuation_input_is_checked_before_anything_is_queued(model_dir, tiny_tokenizer):
    import dataclasses
    eng = _engine(model_dir("llama"))
    prompt = random_prompts(tiny_tokenizer, 1, 20, 20, seed=9)[0]
    p = SamplingParams(max_new_tokens=20, temperature=0)
    c = _abort_midway(eng, [prompt], p, steps=5)[0].completions[0]
    bad = [({"continue_from": [c, c]}, "one Completion"), ({"continue_from": ["x"]}, "must be a rollout Completion"),
           ({"continue_from": [dataclasses.replace(c, logprobs=c.logprobs[:-1])]}, "logprobs must have one entry"),
           ({"continue_from": [dataclasses.replace(c, token_ids=c.token_ids[:-1] + [10 ** 6])]}, "token ids in"),
           ({"continue_from": [c], "sampling_params": SamplingParams(n=2)}, "n must be 1"),
           ({"continue_from": [c], "sampling_params": SamplingParams(max_new_tokens=len(c.token_ids))},
            "counts the whole completion")]
    for kw, match in bad:
        kw = {"sampling_params": p, **kw}
        with pytest.raises(ValueError, match=match):
            eng.add_requests([prompt], **kw)
    assert not eng.requests and not eng.scheduler.has_work()


def test_multiturn_bench_cpu_smoke(tmp_path):
    """rollout.bench.multiturn at a tiny shape (the H200 run uses the llama3-8b defaults): the cache
    computes fewer prefill tokens by exactly its hits, and (fp32 on the CPU) changes no token."""
    import json
    from rollout.bench import multiturn
    out = tmp_path / "mt.json"
    multiturn.main(["--shape", "tiny", "--trajectories", "4", "--n", "2", "--turns", "3", "--prompt-len", "16",
                    "--obs-len", "8", "--gen-len", "8", "--p1-prompts", "2", "--p1-prompt-len", "16",
                    "--p1-gen-len", "16", "--dtype", "float32", "--device", "cpu", "--out", str(out)])
    r = json.loads(out.read_text())
    on, off = r["multiturn"]["cache_on"], r["multiturn"]["cache_off"]
    assert on["trajectories"] == 4 and on["generated_tokens"] == off["generated_tokens"] == 4 * 3 * 8
    assert off["prefill_tokens"] - on["prefill_tokens"] == on["prefix_cache_hit_tokens"] > 0
    assert r["multiturn"]["identical_trajectories"] == 4 and r["p1"]["identical_outputs"] == 2
    assert r["p1"]["cache_on"]["prefix_cache_pages"] > 0 == r["p1"]["cache_off"]["prefix_cache_pages"]
