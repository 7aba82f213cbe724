"""Helpers for the HTTP server tests: a real uvicorn server on 127.0.0.1 (a free port), in a
background thread of the test process (`serving`: the engine stays inspectable) or as a
`python -m rollout.serve` subprocess (`server_process`: where the test process must be the
trainer's rank of a torch.distributed weight group, which one process can join only once).

The model is the tiny random Qwen2 of tests/conftest.py with its byte-level tokenizer, given a
small chat template that renders `tools` and a `chat_template_kwargs` switch (`shout`). `serving` takes
a RolloutWorker (the engine loop on a thread) or an EngineProcess (the loop in a process of its own)."""
from __future__ import annotations

import contextlib
from functools import partial
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

from rollout import RolloutEngine
from rollout.config import EngineConfig
from rollout.serve import ServeOptions, start_in_thread
from rollout.serve.remote import EngineProcess, pretrained_worker
from rollout.worker import RolloutWorker

ROOT = Path(__file__).resolve().parents[3]
# within the tiny tokenizer's alphabet (lower case, digits, a little punctuation)
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if tools %}tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}\n{% endif %}"
                 "{% if shout %}loud\n{% endif %}{% if add_generation_prompt %}assistant:{% endif %}")
ENGINE = dict(device="cpu", dtype="float32", max_model_len=256, num_kv_pages=160, page_size=16,
              max_num_batched_tokens=512, max_num_seqs=64)
MODEL = "tiny-qwen2"


def make_worker(path, **overrides) -> RolloutWorker:
    return RolloutWorker(RolloutEngine.from_pretrained(path, **{**ENGINE, **overrides}))


def make_engine_process(path, **overrides) -> EngineProcess:
    """The same engine built in a process of its own (what `python -m rollout.serve` runs)."""
    return EngineProcess(partial(pretrained_worker, str(path), EngineConfig().replace(**{**ENGINE, **overrides})))


@contextlib.contextmanager
def serving(engine, **opts):
    """A server over `engine`: a RolloutWorker (inspectable: .worker, .engine) or an EngineProcess."""
    server, thread, url = start_in_thread(engine, ServeOptions(served_model_name=MODEL, **opts))
    worker = engine if isinstance(engine, RolloutWorker) else None
    try:
        yield SimpleNamespace(url=url, worker=worker, engine=worker and worker.engine, app=server.config.app)
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive(), "the server did not shut down"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server_process(*args: str, timeout: float = 120.0):
    """`python -m rollout.serve ARGS` on a free port; yields its base URL; SIGTERM and a clean exit after."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ROLLOUT_TEST_TORCH_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "rollout.serve", "--port", str(port), "--log-level", "warning",
                             *args], cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            assert proc.poll() is None, f"the server exited with {proc.returncode}"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            assert time.time() < deadline, "the server did not come up"
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError("the server did not exit within 30 s of SIGTERM")
        # uvicorn shuts down gracefully, then re-raises the signal it caught: killed by SIGTERM, on purpose
        assert code in (0, -signal.SIGTERM), f"the server exited with {code}"


def kv_pages_used(url: str, **headers) -> float:
    text = httpx.get(url + "/metrics", headers=headers).text
    return float(next(ln.split()[1] for ln in text.splitlines() if ln.startswith("rollout_kv_pages_used ")))


def wait_for(predicate, timeout: float = 20.0, what: str = "condition"):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
