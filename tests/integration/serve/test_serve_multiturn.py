"""An agent loop over the real `openai` client: each turn sends the whole conversation as token ids
(the previous prompt_token_ids + the completion's token_ids from return_token_ids + the next
observation's ids) to /v1/completions. /metrics shows each later turn served from the prefix cache,
and the tokens and logprobs equal rollout.multiturn.run_trajectories in process with the same seeds
(fp32). A chat turn with return_token_ids finds the previous turn's pages too."""
from __future__ import annotations

import httpx
import openai
import pytest
from serve_utils import ENGINE, MODEL

from rollout import RolloutEngine, SamplingParams
from rollout.multiturn import run_trajectories, turn_seed

PAGE, TURNS, GEN, SEED = ENGINE["page_size"], 4, 12, 21


def _counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}


def _cached(url: str) -> tuple[float, float]:
    m = _counters(url)
    return m["rollout_prefix_cache_hit_tokens_total"], m["rollout_prefix_cache_queried_tokens_total"]


def _observation(turn: int) -> list[int]:
    return [3 + (11 * turn + 5 * j) % 240 for j in range(9)]      # ids of the tiny vocabulary's ordinary tokens


class _Observations:
    """The in-process twin of the client loop's environment: the same observation after each turn."""

    def step(self, traj):
        turn = len(traj.spans)
        return _observation(turn - 1), 0.0, turn >= TURNS


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def test_token_id_agent_loop_is_served_from_cache_and_equals_run_trajectories(oai, server, chat_dir, tiny_tokenizer):
    prompt = tiny_tokenizer("the small cat sat on the old mat and looked at the quiet moon").input_ids
    ids, spans, logprobs = list(prompt), [], []
    for turn in range(TURNS):
        hits0, queried0 = _cached(server.url)
        r = oai.completions.create(model=MODEL, prompt=ids, max_tokens=GEN, temperature=1.0, logprobs=0,
                                   seed=SEED if turn == 0 else turn_seed(SEED, 0, turn),
                                   extra_body={"return_token_ids": True, "ignore_eos": True})
        c = r.choices[0]
        assert c.prompt_token_ids == ids and len(c.token_ids) == GEN
        hits, queried = (a - b for a, b in zip(_cached(server.url), (hits0, queried0)))
        assert queried == len(ids)
        if turn:
            # the previous turn's KV, every full page of it (its last token was sampled, never fed):
            # all of this prompt but the observation and less than a page
            assert hits == (spans[-1][1] - 1) // PAGE * PAGE and hits > len(ids) - len(_observation(0)) - PAGE
        else:
            assert hits == 0
        spans.append((len(ids), len(ids) + GEN))
        logprobs += c.logprobs.token_logprobs
        ids = ids + c.token_ids + (_observation(turn) if turn < TURNS - 1 else [])
    assert _counters(server.url)["rollout_prefix_cache_pages"] > 0

    ref = RolloutEngine.from_pretrained(chat_dir, **ENGINE)
    (t,) = run_trajectories(ref, [prompt], lambda i, k: _Observations(),
                            SamplingParams(max_new_tokens=GEN, temperature=1.0, seed=SEED, ignore_eos=True), TURNS)
    assert t.token_ids == ids and t.spans == spans and t.end == "done"
    # fp32; each turn alone in its batch in both, but prefill chunks may split differently: ~1e-6
    assert max(abs(a - b) for a, b in zip([lp for lp, g in zip(t.logprobs, t.generated) if g], logprobs)) <= 1e-5


def test_a_chat_turn_with_return_token_ids_finds_the_previous_turn(oai, server):
    first = [{"role": "user", "content": "tell me about the small cat and the old dog in the quiet red house"}]
    r1 = oai.chat.completions.create(model=MODEL, messages=first, max_tokens=8, temperature=0,
                                     extra_body={"return_token_ids": True})
    p1, g1 = r1.prompt_token_ids, r1.choices[0].token_ids
    hits0, _ = _cached(server.url)
    second = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                      {"role": "user", "content": "and then"}]
    r2 = oai.chat.completions.create(model=MODEL, messages=second, max_tokens=8, temperature=0,
                                     extra_body={"return_token_ids": True})
    p2, computed = r2.prompt_token_ids, p1 + g1[:-1]       # the first turn's KV: all but its last token
    common = next((j for j, (a, b) in enumerate(zip(p2, computed)) if a != b), min(len(p2), len(computed)))
    assert common >= len(p1) - 1 >= 2 * PAGE        # the re-rendered conversation starts with the first prompt
    assert _cached(server.url)[0] - hits0 == common // PAGE * PAGE > 0
