"""vLLM's sleep-mode routes over a real socket: POST /sleep?level= (admin key), POST /wake_up (tags),
GET /is_sleeping; generation answers 503 while asleep, outputs equal after wake, a weight update at
level 2 waits for /wake_up?tags=weights, sleep refuses running requests (409) and bad levels (400)."""
from __future__ import annotations

import threading

import httpx
import pytest
from serve_utils import ENGINE, MODEL, kv_pages_used, make_worker, serving, wait_for

from rollout import RolloutEngine, SamplingParams
from rollout.client import RolloutClient, ServerError

PARAMS = SamplingParams(n=2, max_new_tokens=8, temperature=1.0, seed=9)


@pytest.fixture(scope="module")
def sleepy(chat_dir):
    with serving(make_worker(chat_dir), admin_key="adm") as s:
        yield s


def _same(a, b):
    return [[(c.token_ids, c.logprobs) for c in o.completions] for o in a] == \
        [[(c.token_ids, c.logprobs) for c in o.completions] for o in b]


def test_sleep_wake_round_trip_and_503_while_asleep(sleepy, tiny_tokenizer):
    prompts = [tiny_tokenizer("the quiet river").input_ids, tiny_tokenizer("a green hill").input_ids]
    client, admin = RolloutClient(sleepy.url), RolloutClient(sleepy.url, admin_key="adm")
    before = client.generate(prompts, PARAMS)
    with pytest.raises(ServerError) as e:
        client.sleep(1)                                      # no admin key
    assert e.value.status == 401
    rep = admin.sleep(1)
    assert rep["level"] == 1 and rep["released_bytes"] > 0 and rep["device_freed_bytes"] is None
    assert client.is_sleeping() is True and sleepy.engine.runner.kv_pool.untyped_storage().nbytes() == 0
    with pytest.raises(ServerError) as e:
        client.generate(prompts, PARAMS)
    assert e.value.status == 503 and "engine is asleep (level 1); call wake() first" in e.value.message
    r = httpx.post(sleepy.url + "/v1/completions", json={"model": MODEL, "prompt": prompts[0], "max_tokens": 2})
    assert r.status_code == 503 and "asleep" in r.json()["error"]["message"]
    assert admin.wake_up()["level"] == 0 and client.is_sleeping() is False
    assert _same(client.generate(prompts, PARAMS), before)
    assert kv_pages_used(sleepy.url) == 0


def test_level_2_update_waits_for_the_weights_then_lands(sleepy, model_dir, tiny_tokenizer):
    prompts = [tiny_tokenizer("my small song").input_ids]
    admin = RolloutClient(sleepy.url, admin_key="adm")
    version = sleepy.worker.policy_version + 1
    new = model_dir("qwen2", seed=1)
    assert admin.sleep(2)["level"] == 2
    with pytest.raises(ServerError) as e:
        admin.update_weights_from_disk(new, version)
    assert e.value.status == 400 and "wake(tags=['weights']) first" in e.value.message
    assert admin.wake_up(["weights"])["level"] == 1 and admin.is_sleeping()
    staged = admin.update_weights_from_disk(new, version)
    assert staged["live_version"] == version                 # landed at once: the engine is idle asleep
    admin.wake_up()
    want = RolloutEngine.from_pretrained(new, tokenizer=False, **ENGINE).generate(prompts, PARAMS, use_tqdm=False)
    assert _same(admin.generate(prompts, PARAMS), want)


def test_sleep_refuses_running_requests_and_bad_levels(sleepy, tiny_tokenizer):
    admin = RolloutClient(sleepy.url, admin_key="adm")
    for bad in (0, 3):
        with pytest.raises(ServerError) as e:
            admin.sleep(bad)
        assert e.value.status == 400 and "sleep level must be 1" in e.value.message
    with pytest.raises(ServerError) as e:
        admin.wake_up(["kv"])
    assert e.value.status == 400 and "wake tags" in e.value.message
    long = SamplingParams(max_new_tokens=200, temperature=1.0, ignore_eos=True, seed=1)
    done = []
    t = threading.Thread(target=lambda: done.append(admin.generate([tiny_tokenizer("a long one").input_ids], long)))
    t.start()
    wait_for(lambda: kv_pages_used(sleepy.url) > 0, what="the request to run")
    with pytest.raises(ServerError) as e:
        admin.sleep(1)
    assert e.value.status == 409 and "are queued or running" in e.value.message
    t.join(120)
    assert len(done[0][0].completions[0].token_ids) == 200 and not admin.is_sleeping()
