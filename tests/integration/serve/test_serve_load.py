"""Load, bounded in count and time, on 127.0.0.1: 10x the queue bound of concurrent clients for a few
seconds against a server with a small batch (its engine loop on a thread, then in its own process).
Every response is a 200 with complete choices or a 429 with Retry-After; nothing hangs or is lost (the
server accepted exactly the answered requests, and is idle after); resident memory stays roughly flat."""
from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest
from serve_utils import MODEL, make_engine_process, make_worker, serving

from rollout.client import RolloutClient

QUEUE_BOUND = 8
CLIENTS = 10 * QUEUE_BOUND
SECONDS = 3.0


def _rss_mb(pid="self") -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS")) / 1024


def _server_rss_mb(s) -> float:
    """This process's resident memory, plus the engine process's where it has one."""
    side = s.app.state.server.side
    return _rss_mb() + (_rss_mb(side.proc.pid) if s.engine is None else 0.0)


async def _client(c: httpx.AsyncClient, k: int, until: float, tally: dict) -> None:
    rng = random.Random(k)
    while time.monotonic() < until:
        max_tokens = rng.randint(2, 10)
        body = {"model": MODEL, "prompt": f"the cat {k}", "max_tokens": max_tokens, "n": rng.randint(1, 2),
                "seed": rng.randrange(1000), "return_token_ids": True, "stream": rng.random() < 0.3}
        if body["stream"]:
            async with c.stream("POST", "/v1/completions", json=body) as r:
                lines = [ln async for ln in r.aiter_lines() if ln.startswith("data: ")]
                status, done = r.status_code, r.status_code == 200 and lines[-1] == "data: [DONE]"
        else:
            r = await c.post("/v1/completions", json=body)
            status = r.status_code
            done = status == 200 and all(ch["finish_reason"] in ("stop", "length") and
                                         len(ch["token_ids"]) <= max_tokens for ch in r.json()["choices"])
        if status == 200:
            assert done, "an accepted request came back incomplete"
            tally["ok"] += 1
        else:
            assert status == 429 and r.headers["Retry-After"] == "1", status
            tally["refused"] += 1
            await asyncio.sleep(0.02)


@pytest.mark.parametrize("make", [make_worker, make_engine_process], ids=["engine-thread", "engine-process"])
def test_load_bounded_queue(make, chat_dir):
    with serving(make(chat_dir, max_num_seqs=4), max_queued_requests=QUEUE_BOUND) as s:
        client = RolloutClient(s.url)

        async def run(seconds):
            tally = {"ok": 0, "refused": 0}
            limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
            async with httpx.AsyncClient(base_url=s.url, timeout=60, limits=limits) as c:
                until = time.monotonic() + seconds
                await asyncio.wait_for(asyncio.gather(*(_client(c, k, until, tally) for k in range(CLIENTS))),
                                       seconds + 60)
            return tally
        asyncio.run(run(1.0))                  # warm-up: allocator pools, connection set-up
        rss0, accepted0, rejected0 = _server_rss_mb(s), s.app.state.server.loop.accepted, client.metrics()[
            "rollout_requests_rejected_total"]
        tally = asyncio.run(run(SECONDS))
        grown = _server_rss_mb(s) - rss0
        m = client.metrics()
    assert tally["ok"] > 5 and tally["refused"] > 5, tally      # both paths exercised (a loaded machine serves fewer)
    assert m["rollout_requests_rejected_total"] - rejected0 == tally["refused"]
    loop = s.app.state.server.loop
    # every accepted prompt was answered: requests x prompts accepted == answered, nothing left behind
    assert loop.accepted - accepted0 == tally["ok"] and loop.accepted == loop.finished
    assert m["rollout_requests_running"] == 0 and m["rollout_requests_waiting"] == 0
    assert s.engine is None or not s.engine.requests
    assert m["rollout_kv_pages_used"] == 0
    assert grown < 40, f"RSS grew {grown:.1f} MB over {tally['ok'] + tally['refused']} requests"
