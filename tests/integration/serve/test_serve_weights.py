"""Weight updates through the server while it generates: from a safetensors folder (the engine loop on a
thread, then in its own process) and through a gloo group the test process joins as the trainer's rank 0 (a `python -m rollout.serve`
subprocess: one process joins one default group). Tokens after the commit carry the new version;
requests after it equal a fresh engine built from the new weights, bit for bit (fp32, one request
alone in its batch on both sides). CUDA IPC refuses clearly on CPU (its GPU test: tests/gpu/test_serve_cuda.py)."""
from __future__ import annotations

import json

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from serve_utils import ENGINE, MODEL, kv_pages_used, make_engine_process, make_worker, server_process, serving

from rollout import RolloutEngine, SamplingParams
from rollout.client import RolloutClient, ServerError


def _stream_versions(url: str, body: dict, at_chunk: int = -1, between=None) -> tuple[list[int], list[int]]:
    """(token ids, per-token policy versions) of a streamed completion; between() runs after chunk at_chunk."""
    ids, versions, chunks = [], [], 0
    with httpx.Client(base_url=url, timeout=120) as http, \
            http.stream("POST", "/v1/completions", json={**body, "stream": True, "return_token_ids": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ch = json.loads(line[6:])["choices"][0]
                ids += ch["token_ids"]
                versions += ch["policy_versions"]
                chunks += 1
                if chunks == at_chunk:
                    between()
    return ids, versions


def _greedy(prompt) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True}


def _fresh(path, prompt, max_new=40):
    engine = RolloutEngine.from_pretrained(path, **ENGINE)
    return engine.generate([prompt], SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True),
                           use_tqdm=False)[0].completions[0]


def _check_switch_and_fresh(url, client, prompt, update, new_dir, version):
    """Pause after 3 tokens, stage `update()`, resume: the tokens after carry `version`, and a new
    request equals a fresh engine of `new_dir`."""
    def pause_update_resume():
        client.pause("keep")
        assert update() == {"staged_version": version, "live_version": version - 1}
        client.resume()
    _, versions = _stream_versions(url, _greedy(prompt), 3, pause_update_resume)
    k = versions.index(version)
    assert k >= 3 and versions == [version - 1] * k + [version] * (40 - k)
    r = httpx.post(url + "/v1/completions", json={**_greedy(prompt), "logprobs": 0, "return_token_ids": True},
                   timeout=60).json()["choices"][0]
    want = _fresh(new_dir, prompt)
    assert r["token_ids"] == want.token_ids and r["logprobs"]["token_logprobs"] == want.logprobs
    assert r["policy_versions"] == [version] * 40


def _update_without_pause(url, update, prompt, version):
    """An update that lands mid-generation with nothing paused: versions never go back."""
    _, versions = _stream_versions(url, {**_greedy(prompt), "max_tokens": 120}, 2, update)
    assert versions == sorted(versions) and set(versions) <= {version - 1, version} and versions[-1] == version


@pytest.mark.parametrize("make", [make_worker, make_engine_process], ids=["engine-thread", "engine-process"])
def test_update_from_disk_while_generating(make, chat_dir, model_dir, tiny_tokenizer, tmp_path):
    prompt = tiny_tokenizer("the strange star").input_ids
    new_dir = model_dir("qwen2", seed=1)
    with serving(make(chat_dir)) as s:
        client = RolloutClient(s.url)
        _check_switch_and_fresh(s.url, client, prompt, lambda: client.update_weights_from_disk(new_dir, 1), new_dir, 1)
        _update_without_pause(s.url, lambda: client.update_weights_from_disk(chat_dir, 2), prompt, 2)
        assert _fresh(chat_dir, prompt).token_ids == client.generate(prompt, SamplingParams(
            max_new_tokens=40, temperature=0, ignore_eos=True))[0].completions[0].token_ids
        # refused whole, the live weights untouched, the server serving
        save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, str(tmp_path / "model.safetensors"))
        for path, version, what in ((new_dir, 2, "not newer"), (tmp_path, 3, "shape"), (tmp_path / "no", 3, "folder")):
            with pytest.raises(ServerError, match=what):
                client.update_weights_from_disk(path, version)
        m = client.metrics()
        assert (m["rollout_policy_version"], m["rollout_weight_updates_total"]) == (2, 2)
        assert m["rollout_weight_staging_ms_total"] > 0 and kv_pages_used(s.url) == 0
        # CUDA IPC is GPU-only: a clear refusal on a CPU engine, from the server and from the client
        with pytest.raises(ServerError, match="CUDA"):
            client._call("POST", "/update_weights_from_ipc", admin=True, json={"handles": "", "version": 3})
        with pytest.raises(ValueError, match="CUDA"):
            client.update_weights_from_ipc([("model.norm.weight", torch.ones(64))], 3)


def test_update_from_sharded_folder(model_dir, sharded_model_dir, tiny_tokenizer):
    """A checkpoint in shards (an index and 5 files) into a server of another seed's weights."""
    prompt = tiny_tokenizer("the dark cloud").input_ids
    with serving(make_worker(model_dir("llama", seed=1))) as s:
        client = RolloutClient(s.url)
        assert client.update_weights_from_disk(sharded_model_dir, 1)["staged_version"] == 1
        got = client.generate(prompt, SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True))[0]
    want = _fresh(sharded_model_dir, prompt)
    assert got.completions[0].token_ids == want.token_ids and got.completions[0].logprobs == want.logprobs
    assert got.completions[0].policy_versions == [1] * 40


@pytest.fixture(scope="module")
def process_server(chat_dir):
    args = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    with server_process("--model", str(chat_dir), "--served-model-name", MODEL, *args) as url:
        yield url


def test_update_through_gloo_group_while_generating(process_server, chat_dir, model_dir, tiny_tokenizer):
    url, prompt = process_server, tiny_tokenizer("my clever game").input_ids
    new_dir = model_dir("qwen2", seed=1)
    new, old = load_file(str(new_dir / "model.safetensors")), load_file(str(chat_dir / "model.safetensors"))
    client = RolloutClient(url)
    try:
        assert client.init_weight_group()["backend"] == "gloo"
        base = client.weights_info()["live_version"]
        _check_switch_and_fresh(url, client, prompt, lambda: client.update_weights_from_group(new.items(), base + 1),
                                new_dir, base + 1)
        _update_without_pause(url, lambda: client.update_weights_from_group(old.items(), base + 2), prompt, base + 2)
        with pytest.raises(ServerError, match="unknown tensor"):     # validated whole after the broadcast
            client.update_weights_from_group([("model.bogus", torch.zeros(2))], base + 3)
        assert client.weights_info()["live_version"] == base + 2
    finally:
        client.close()


def test_trl_grpo_through_http_adapter(process_server, chat_dir, tmp_path, monkeypatch):
    """GRPOTrainer in this process (modelled on tests/rl/test_trl_generator.py, whose helpers it reuses), the
    engine in the server process; weights through the gloo group."""
    pytest.importorskip("trl")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from test_trl_generator import LOGP_TOL, RATIO_TOL, _grpo, _step_logs

    from trainers import attach_http_generator
    trainer, _ = _grpo(chat_dir, tmp_path)
    adapter = attach_http_generator(trainer, process_server)
    try:
        trainer.train()
    finally:
        adapter.worker.close()
    logs = _step_logs(trainer)
    assert [h["step"] for h in logs] == [1, 2, 3]
    for h in logs:        # TRL's recompute vs the logprobs our server sampled with (IS correction on)
        assert h["sampling/sampling_logp_difference/max"] <= LOGP_TOL, h
        for k in ("min", "mean", "max"):
            assert abs(h[f"sampling/importance_sampling_ratio/{k}"] - 1.0) <= RATIO_TOL, h
    assert adapter.sync_history == [0, 1, 2] and adapter.batch_versions == [[0], [1], [2]]
    assert [h["gen/policy_version_lag"] for h in logs] == [0, 0, 0]


def test_staged_sources_are_released_a_few_at_a_time_letting_other_threads_run():
    """release_gradually frees the sources a few at a time and hands the GIL over between (a thread waiting
    to launch the commit runs in between); a plain list drop would free them all in one GIL hold."""
    import threading
    import time
    import weakref
    from rollout.serve.transfer import release_gradually

    class Source:       # stands for a received tensor whose release is slow and holds the GIL
        def __del__(self):
            t = time.perf_counter()
            while time.perf_counter() - t < 2e-3:
                pass

    sources = [Source() for _ in range(20)]
    refs = [weakref.ref(s) for s in sources]
    items = [(f"w{i}", s) for i, s in enumerate(sources)]
    del sources
    ticks, stop = [], threading.Event()

    def other():        # records when it got to run, and how many sources were alive then
        while not stop.is_set():
            ticks.append(sum(r() is not None for r in refs))
            time.sleep(1e-4)

    import sys
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.1)     # longer than all 20 releases: only a voluntary hand-over lets `other` in
    th = threading.Thread(target=other)
    try:
        th.start()
        time.sleep(0.01)
        # a 2 ms pause (the default is 0.1 ms): on a loaded 2-core CI runner the OS may not wake the other
        # thread inside a 0.1 ms window, and a missed window is scheduling, not a release held in one GIL hold
        release_gradually(items, every=2, pause_s=2e-3)
    finally:
        stop.set()
        th.join()
        sys.setswitchinterval(interval)
    assert items == [] and all(r() is None for r in refs)
    # the other thread ran while only part of the sources were freed, at many distinct points
    between = {n for n in ticks if 0 < n < 20}
    assert len(between) >= 5, sorted(set(ticks))   # items.clear(): none (measured)
