"""Fixtures for the HTTP server tests (helpers in serve_utils.py): `chat_dir`, the tiny random Qwen2
of tests/conftest.py with a chat template; `server`, a module's server over it (engine loop on a thread,
then in its own process); `http`."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_utils import CHAT_TEMPLATE, make_engine_process, make_worker, serving  # noqa: E402


@pytest.fixture(scope="session")
def chat_dir(model_dir, tmp_path_factory) -> Path:
    from transformers import AutoTokenizer
    out = tmp_path_factory.mktemp("serve") / "qwen2-chat"
    shutil.copytree(model_dir("qwen2"), out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=["engine-thread", "engine-process"])
def server(request, chat_dir):
    """Each module's server tests run against both: the engine loop on a thread of the server's process,
    and in a process of its own (`python -m rollout.serve`'s default); only HTTP reaches the latter."""
    engine = make_worker(chat_dir) if request.param == "engine-thread" else make_engine_process(chat_dir)
    with serving(engine) as s:
        yield s


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


