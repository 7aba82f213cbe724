"""Native /generate, concurrency, pause / resume / abort, client disconnects, and the server's
guards (400 naming the field, 401, 413, 429 + Retry-After), each followed by a request that still works."""
from __future__ import annotations

import asyncio
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from serve_utils import ENGINE, MODEL, kv_pages_used, make_engine_process, make_worker, serving, wait_for

from rollout import RolloutEngine, SamplingParams
from rollout.client import RolloutClient, ServerError
from rollout.serve import ServeOptions, build_app


def _metric(url, name) -> float:
    return RolloutClient(url).metrics()[f"rollout_{name}"]


def _idle(server) -> bool:
    return kv_pages_used(server.url) == 0 and _metric(server.url, "requests_running") == 0


def _no_requests(server) -> bool:
    """Nothing running or waiting (and, where the engine is in this process, nothing held at all)."""
    idle = _metric(server.url, "requests_running") == 0 and _metric(server.url, "requests_waiting") == 0
    return idle and (server.engine is None or not server.engine.requests)


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _wait_decoding(url: str) -> None:
    """Until a request holds pages and has sampled a token (then it has ~240 steps left to run)."""
    gen0 = _metric(url, "generation_tokens_total")
    wait_for(lambda: kv_pages_used(url) > 0 and _metric(url, "generation_tokens_total") > gen0,
             what="the request to decode")


def test_native_generate_contract_and_shared_prefill(server, chat_dir, tiny_tokenizer):
    prompts = [tiny_tokenizer("the tired friend").input_ids, tiny_tokenizer("every blue cloud").input_ids]
    params = SamplingParams(n=3, max_new_tokens=7, temperature=1.0, top_k=20, seed=5, top_logprobs=3)
    client = RolloutClient(server.url)
    prefill0 = client.metrics()["rollout_prefill_tokens_total"]
    outs = client.generate(prompts, params)
    # one engine request with n=3 per prompt: each prompt is prefilled once, its KV shared by the samples
    assert client.metrics()["rollout_prefill_tokens_total"] - prefill0 == sum(len(p) for p in prompts)
    ref = RolloutEngine.from_pretrained(chat_dir, **ENGINE).generate(prompts, params, use_tqdm=False)
    for o, r in zip(outs, ref):
        assert o.prompt_token_ids == r.prompt_token_ids and len(o.completions) == 3
        for c, w in zip(o.completions, r.completions):
            assert (c.token_ids, c.logprobs, c.processed_logprobs, c.kept_mass, c.finish_reason, c.stop_reason) == \
                (w.token_ids, w.logprobs, w.processed_logprobs, w.kept_mass, w.finish_reason, w.stop_reason)
            assert c.policy_versions == [0] * len(c.token_ids) and c.top_logprobs == w.top_logprobs
            assert all(len(t) == 3 and all(isinstance(k, int) for k in t) for t in c.top_logprobs)
    # one SamplingParams dict per prompt
    per = client.generate(prompts, [SamplingParams(max_new_tokens=3), SamplingParams(max_new_tokens=5)])
    assert [len(o.completions[0].token_ids) for o in per] == [3, 5]


def test_concurrent_seeded_requests_equal_sequential(server, tiny_tokenizer):
    words = ["the sun", "a cold moon", "my game", "the clever star", "your old song", "this dark rain"]
    bodies = [{"model": MODEL, "prompt": tiny_tokenizer(f"{words[i % 6]} {i}").input_ids, "max_tokens": 6 + i % 5,
               "temperature": 1.0, "seed": 100 + i, "n": 1 + i % 2, "logprobs": 0, "return_token_ids": True}
              for i in range(36)]

    async def all_at_once():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))
    together = [r.json() for r in asyncio.run(all_at_once())]
    with httpx.Client(base_url=server.url, timeout=60) as c:
        alone = [c.post("/v1/completions", json=b).json() for b in bodies]
    for a, b in zip(together, alone):
        for ca, cb in zip(a["choices"], b["choices"]):
            assert ca["token_ids"] == cb["token_ids"]
            # a row's fp32 GEMM results may depend on its batch-mates (CPU kernels block by batch size):
            # the engine-vs-HF tolerance, 1e-5, bounds that
            assert max(abs(x - y) for x, y in zip(ca["logprobs"]["token_logprobs"],
                                                  cb["logprobs"]["token_logprobs"])) <= 1e-5
    assert _idle(server)


def _stream_tokens(http, body, on_chunk=None):
    """Token ids per choice of a streamed completion; on_chunk(count) runs after each chunk."""
    ids, count = {}, 0
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[6:])["choices"]:
                ids.setdefault(ch["index"], []).extend(ch["token_ids"])
            count += 1
            if on_chunk is not None:
                on_chunk(count)
    return [ids[k] for k in sorted(ids)]


def test_pause_keep_resume_gives_the_unpaused_output(server, http, tiny_tokenizer):
    body = {"model": MODEL, "prompt": tiny_tokenizer("the happy bird").input_ids, "max_tokens": 40, "n": 2,
            "temperature": 1.0, "seed": 21, "ignore_eos": True, "return_token_ids": True}
    client = RolloutClient(server.url)
    state = {}

    def pause_once(count):
        if count == 3:
            assert client.pause("keep") == {"paused": True, "mode": "keep"}
            state["tokens"] = client.metrics()["rollout_generation_tokens_total"]
            time.sleep(0.3)
            state["still"] = client.metrics()["rollout_generation_tokens_total"] == state["tokens"]
            assert kv_pages_used(server.url) > 0      # kept: its pages stay for the resume
            client.resume()
    paused = _stream_tokens(http, body, pause_once)
    assert state["still"], "tokens were generated while paused"
    assert paused == _stream_tokens(http, body) and [len(x) for x in paused] == [40, 40]
    assert _idle(server)


def _post_in_thread(url, body, path="/v1/completions"):
    pool = ThreadPoolExecutor(1)
    return pool.submit(lambda: httpx.post(url + path, json=body, timeout=120))


def test_pause_abort_and_wait(server, tiny_tokenizer):
    client = RolloutClient(server.url)
    long = {"model": MODEL, "prompt": tiny_tokenizer("a slow game").input_ids, "max_tokens": 240, "n": 4,
            "ignore_eos": True, "return_token_ids": True}
    fut = _post_in_thread(server.url, long)
    _wait_decoding(server.url)
    client.pause("abort")                      # finished now, with what it has
    ch = fut.result().json()["choices"][0]
    assert ch["finish_reason"] == "abort" and 0 < len(ch["token_ids"]) < 240
    assert kv_pages_used(server.url) == 0
    queued = _post_in_thread(server.url, {**long, "max_tokens": 5})
    time.sleep(0.3)
    assert not queued.done()                   # accepted while paused, not stepped
    client.resume()
    assert queued.result().json()["choices"][0]["finish_reason"] == "length"
    # wait: the running request finishes whole before the pause takes
    fut = _post_in_thread(server.url, {**long, "max_tokens": 60, "n": 1})
    _wait_decoding(server.url)
    assert client.pause("wait")["paused"] is True
    ch = fut.result(timeout=10).json()["choices"][0]
    assert ch["finish_reason"] == "length" and len(ch["token_ids"]) == 60
    client.resume()


def test_abort_by_request_id(server, tiny_tokenizer):
    body = {"model": MODEL, "prompt": tiny_tokenizer("my quiet song").input_ids, "max_tokens": 240,
            "ignore_eos": True, "request_id": "mine-1", "n": 4}
    fut = _post_in_thread(server.url, body)
    _wait_decoding(server.url)
    client = RolloutClient(server.url)
    assert client.abort(["mine-1", "unknown"]) == ["mine-1"]
    r = fut.result().json()
    assert r["id"] == "mine-1" and [c["finish_reason"] for c in r["choices"]] == ["abort"] * 4
    assert _idle(server)


def test_disconnects_free_pages(server, http, tiny_tokenizer):
    gen0 = _metric(server.url, "generation_tokens_total")
    body = {"model": MODEL, "prompt": tiny_tokenizer("the red friend").input_ids, "max_tokens": 240, "n": 8,
            "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:     # mid-stream: leave after two chunks
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 2:
                break
    wait_for(lambda: _idle(server), what="the aborted stream's pages")
    assert _metric(server.url, "generation_tokens_total") - gen0 < 8 * 240 and _no_requests(server)
    # non-streaming: a raw connection closed while its request holds pages (paused: it cannot finish first)
    payload = json.dumps({**body, "stream": False}).encode()
    sock = socket.create_connection(_host_port(server.url))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
    wait_for(lambda: kv_pages_used(server.url) > 0, what="the request to run")
    client = RolloutClient(server.url)
    client.pause("keep")
    sock.close()
    wait_for(lambda: kv_pages_used(server.url) == 0, what="the disconnected request's pages")
    client.resume()
    assert _idle(server) and _no_requests(server)
    assert not server.app.state.server.loop._queues     # no request's queue left behind


BAD = [  # (body, path, what the message must name)
    ({"prompt": "x", "temperature": -1}, "/v1/completions", "temperature"),
    ({"prompt": "x", "bogus": 1}, "/v1/completions", "bogus"),
    ({"prompt": [[1, 99999]]}, "/v1/completions", "vocabulary"),
    ({"prompt": []}, "/v1/completions", "empty"),
    ({"prompt": "x", "max_tokens": "many"}, "/v1/completions", "max_tokens"),
    ({"prompt": "x", "n": 0}, "/v1/completions", "n must"),
    ({"prompt": "x", "logprobs": -1}, "/v1/completions", "logprobs"),
    ({"prompt": "x", "stop_token_ids": [999999]}, "/v1/completions", "stop_token_ids"),
    ({"prompt": list(range(3, 300))}, "/v1/completions", "max_model_len"),
    ({"prompt": "x", "presence_penalty": 0.5}, "/v1/completions", "presence_penalty"),
    ({"prompt": "x", "echo": True}, "/v1/completions", "echo"),
    ({"prompt": "x"}, "/v1/chat/completions", "messages"),
    ({"input_ids": [1, 2], "sampling_params": {"max_tokens": 5}}, "/generate", "max_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"top_k": -3}}, "/generate", "top_k"),
]


def test_bad_input_is_400_naming_the_field_then_still_serving(server, http):
    for body, path, what in BAD:
        r = http.post(path, json=body)
        assert r.status_code == 400 and what in r.json()["error"]["message"], (body, r.text)
    for raw in (b"{not json", b'{"prompt": "x", "top_p": NaN}'):
        r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and ("JSON" in r.text or "top_p" in r.text), r.text
    assert http.post("/v1/completions", json={"prompt": "x", "model": "other"}).status_code == 404
    assert http.post("/v1/completions", json={"prompt": "the", "max_tokens": 3}).status_code == 200
    assert _idle(server) and _no_requests(server)


def test_api_and_admin_keys(chat_dir):
    with serving(make_worker(chat_dir), api_key="user-key", admin_key="admin-key") as s:
        user, admin = {"Authorization": "Bearer user-key"}, {"Authorization": "Bearer admin-key"}
        assert httpx.get(s.url + "/health").status_code == 200       # open: load balancers probe it
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "user-key"}):
            assert httpx.get(s.url + "/v1/models", headers=headers).status_code == 401
            assert httpx.post(s.url + "/v1/completions", json={"prompt": "x"}, headers=headers).status_code == 401
        assert httpx.get(s.url + "/metrics", headers=user).status_code == 200
        assert httpx.post(s.url + "/pause", headers=user).status_code == 401          # control needs the admin key
        assert httpx.post(s.url + "/pause", headers=admin).json()["paused"] is True
        assert httpx.post(s.url + "/resume", headers=admin).status_code == 200
        assert RolloutClient(s.url, api_key="user-key").completions("the", max_tokens=2)["choices"]
        import openai
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong").completions.create(model=MODEL, prompt="x")


def test_body_limit_413(chat_dir):
    with serving(make_worker(chat_dir), max_body_bytes=10_000) as s:
        assert httpx.post(s.url + "/v1/completions", json={"prompt": "a" * 20_000}).status_code == 413

        def chunked():                         # no Content-Length: counted as it arrives
            for _ in range(30):
                yield b" " * 1000
        r = httpx.post(s.url + "/v1/completions", content=chunked(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert httpx.post(s.url + "/v1/completions", json={"prompt": "the", "max_tokens": 2}).status_code == 200


def _get_health(sock: socket.socket) -> bytes:
    """One keep-alive GET /health on an open socket; the response's head and body (b"" if closed)."""
    sock.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data or not data.endswith(b"}"):
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def test_idle_connections_outlive_the_clients_keep_alive(chat_dir):
    # httpx and openai drop an idle connection after 5 s; a server that closes it at the same moment
    # resets a POST sent on it (a request lost under load), so the server's idle timeout is longer
    with serving(make_worker(chat_dir)) as s, socket.create_connection(_host_port(s.url)) as sock:
        sock.settimeout(10)
        assert _get_health(sock).startswith(b"HTTP/1.1 200")
        time.sleep(5.5)                        # past the clients' 5 s
        assert _get_health(sock).startswith(b"HTTP/1.1 200"), "the server closed an idle connection within 5.5 s"
    with serving(make_worker(chat_dir), keep_alive_s=0.3) as s, socket.create_connection(_host_port(s.url)) as sock:
        sock.settimeout(10)
        assert _get_health(sock).startswith(b"HTTP/1.1 200")
        time.sleep(1.0)                        # the option reaches uvicorn: closed after 0.3 s idle
        assert sock.recv(4096) == b""
    for bad in (0, -1.0, float("nan"), "75", True):        # refused before any engine is touched
        with pytest.raises(ValueError, match="keep_alive_s"):
            build_app(None, ServeOptions(keep_alive_s=bad))


def test_connection_cap_503_then_serves_again(chat_dir):
    with serving(make_worker(chat_dir), max_connections=2) as s:
        held = [socket.create_connection(_host_port(s.url), timeout=10) for _ in range(2)]
        for sock in held:                      # two open connections: both served, and kept open
            assert _get_health(sock).startswith(b"HTTP/1.1 200")
        with socket.create_connection(_host_port(s.url), timeout=10) as third:
            assert _get_health(third).startswith(b"HTTP/1.1 503")
        held.pop().close()
        # the server sees the close asynchronously: a new connection is served once it has
        wait_for(lambda: _health_on_new_connection(s.url).startswith(b"HTTP/1.1 200"), what="a freed connection slot")
        assert _get_health(held[0]).startswith(b"HTTP/1.1 200")   # the held one is still served
        held[0].close()
    for bad in (0, -2, 1.5, "8", True):        # refused before any engine is touched
        with pytest.raises(ValueError, match="max_connections"):
            build_app(None, ServeOptions(max_connections=bad))


def test_size_and_queue_options_refuse_non_positive_ints():
    """max_body_bytes, max_queued_requests and stream_interval at 0 would refuse every request or stream
    nothing: each bad value is refused by name before any engine is touched, and None is no setting here."""
    for name in ("max_body_bytes", "max_queued_requests", "stream_interval"):
        for bad in (0, -1, 2.0, "64", True, None):
            with pytest.raises(ValueError, match=f"{name} must be an int >= 1, got"):
                build_app(None, ServeOptions(**{name: bad}))


def test_cli_optional_numbers_take_none():
    """`--max-connections none` lifts the cap from the command line, as None does from Python; `none` is not
    taken for an int option that has no None meaning, nor turned into None for a str option like the API key."""
    from rollout.serve.__main__ import parser, split_args
    opts, cfg = split_args(parser().parse_args(["--max-connections", "none", "--kv-cache-memory", "None",
                                                "--api-key", "none", "--device", "cpu"]))
    assert (opts.max_connections, cfg.kv_cache_memory, opts.api_key) == (None, None, "none")
    assert split_args(parser().parse_args(["--max-connections", "16"]))[0].max_connections == 16
    with pytest.raises(SystemExit):            # argparse: "invalid int value: 'none'"
        parser().parse_args(["--max-queued-requests", "none"])


def _health_on_new_connection(url: str) -> bytes:
    with socket.create_connection(_host_port(url), timeout=10) as sock:
        return _get_health(sock)


def test_queue_bound_429_with_retry_after(chat_dir):
    with serving(make_worker(chat_dir), max_queued_requests=3) as s:
        client = RolloutClient(s.url)
        client.pause("keep")                   # nothing runs: every accepted prompt waits
        body = {"model": MODEL, "prompt": "the cat", "max_tokens": 4}
        held = [_post_in_thread(s.url, body) for _ in range(3)]
        wait_for(lambda: _metric(s.url, "requests_waiting") == 3, what="three waiting requests")
        r = httpx.post(s.url + "/v1/completions", json=body)
        assert r.status_code == 429 and r.headers["Retry-After"] == "1" and "max_queued_requests" in r.text
        with pytest.raises(ServerError, match="429"):
            client.generate([1, 2, 3], SamplingParams(max_new_tokens=2))
        assert _metric(s.url, "requests_rejected_total") == 2
        r = httpx.post(s.url + "/v1/completions", json={**body, "prompt": [[5, 6]] * 4})   # can never fit
        assert r.status_code == 400 and "max_queued_requests" in r.text
        client.resume()
        assert all(f.result().status_code == 200 for f in held)
        assert httpx.post(s.url + "/v1/completions", json=body).status_code == 200


@pytest.mark.parametrize("make", [make_worker, make_engine_process], ids=["engine-thread", "engine-process"])
def test_shutdown_answers_requests_in_flight(make, chat_dir):
    with serving(make(chat_dir)) as s:
        fut = _post_in_thread(s.url, {"model": MODEL, "prompt": "the", "max_tokens": 240, "n": 4, "ignore_eos": True})
        _wait_decoding(s.url)
        t0 = time.time()
    assert time.time() - t0 < 10               # no wait for the generation to end
    assert fut.result().json()["choices"][0]["finish_reason"] == "abort"
    side = s.app.state.server.side
    assert not s.app.state.server.loop.alive() and (s.engine is None or not s.engine.requests)
    assert s.engine is not None or side.proc.exitcode == 0      # the engine process exited cleanly


def test_a_dead_engine_process_fails_its_requests_and_the_health_check(chat_dir, tiny_tokenizer):
    """Killed mid-generation: the waiting and streaming callers get an error at once, /health says 503,
    new requests are refused; nothing waits forever."""
    with serving(make_engine_process(chat_dir)) as s, httpx.Client(base_url=s.url, timeout=30) as http:
        body = {"model": MODEL, "prompt": tiny_tokenizer("the old moon").input_ids, "max_tokens": 240,
                "ignore_eos": True}
        whole = _post_in_thread(s.url, body)
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")          # streaming has begun
            s.app.state.server.side.proc.kill()
            rest = list(lines)                                # the stream ends instead of hanging
        errors = [json.loads(ln[6:])["error"] for ln in rest if ln.startswith('data: {"error"')]
        assert len(errors) == 1 and errors[0]["code"] == 503 and "engine process exited" in errors[0]["message"]
        assert whole.result(timeout=30).status_code == 503
        assert http.get("/health").status_code == 503
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "the", "max_tokens": 2})
        assert r.status_code == 503, r.text


def test_a_requests_id_is_freed_when_its_last_output_goes_out(chat_dir):
    """The engine loop ends every request with an "end" event that drops its queue on the HTTP side, so a
    handler that never ran its cleanup (a stream whose body never began) leaks nothing and its
    request_id can be used again."""
    from rollout.serve.loop import LocalLoop

    async def run():
        side = LocalLoop(make_worker(chat_dir))
        side.start(asyncio.get_running_loop())
        try:
            client = side.client
            q = client.open("mine")
            client.add("mine", [[5, 6, 7], [8, 9]], [SamplingParams(max_new_tokens=4)] * 2)
            got = [await asyncio.wait_for(q.get(), 30) for _ in range(3)]      # added, done, done
            assert [g[0] for g in got] == ["added", "done", "done"]
            await asyncio.sleep(0.05)
            assert "mine" not in client._queues                # dropped with no close() call
            client.open("mine")                                # and the id is free
        finally:
            await asyncio.to_thread(side.stop)
    asyncio.run(run())


ORPHAN = """
import sys
from functools import partial
from rollout.config import EngineConfig
from rollout.serve.remote import EngineProcess, pretrained_worker
if __name__ == "__main__":
    p = EngineProcess(partial(pretrained_worker, sys.argv[1], EngineConfig(device="cpu", dtype="float32")))
    p.launch()
    p.proc.terminate()                   # SIGTERM: an orderly stop, not ignored
    p.proc.join(20)
    assert p.proc.exitcode == 0, p.proc.exitcode
    q = EngineProcess(p.make_worker)
    q.launch()
    print(q.proc.pid, flush=True)        # then this process exits without stop(): it must not hang
"""


def test_the_engine_process_stops_on_sigterm_and_with_its_parent(chat_dir, tmp_path):
    import os
    import subprocess
    import sys
    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    out = subprocess.run([sys.executable, str(script), str(chat_dir)], capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    pid = int(out.stdout.split()[-1])
    wait_for(lambda: not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
             .lower(), what="the engine process to exit with its parent")


def test_an_exception_that_does_not_pickle_crosses_the_pipe_as_runtime_error():
    from rollout.serve.remote import _picklable

    class Odd(Exception):             # a required constructor argument: unpickling it fails
        def __init__(self, code, msg):
            super().__init__(msg)
            self.code = code
    batch = [("reply", 3, None, Odd(7, "boom")), ("event", "t", ("error", ValueError("bad n"))),
             ("event", "t", ("done", 0, "out"))]
    out = _picklable(batch)
    assert isinstance(out[0][3], RuntimeError) and "Odd: boom" in str(out[0][3])
    assert isinstance(out[1][2][1], ValueError) and out[2] == batch[2]     # picklable ones cross unchanged


def test_an_engine_process_that_cannot_build_its_worker_fails_launch_clearly(tmp_path):
    """A bad model path: launch() raises naming the cause (nothing waits for an engine that never comes)."""
    from functools import partial

    from rollout.config import EngineConfig
    from rollout.serve.remote import EngineProcess, pretrained_worker
    side = EngineProcess(partial(pretrained_worker, str(tmp_path / "missing"), EngineConfig(device="cpu")))
    with pytest.raises(RuntimeError, match="failed to start.*config.json"):
        side.launch()
    side.proc.join(30)
    assert not side.proc.is_alive()
