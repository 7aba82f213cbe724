"""Fixtures for the HTTP server tests (helpers in serve_utils.py): `chat_dir`, the tiny random Qwen2
of tests/conftest.py with a chat template; `server`, a module's in-thread server over it; `http`."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_utils import CHAT_TEMPLATE, make_worker, serving  # noqa: E402


@pytest.fixture(scope="session")
def chat_dir(model_dir, tmp_path_factory) -> Path:
    from transformers import AutoTokenizer
    out = tmp_path_factory.mktemp("serve") / "qwen2-chat"
    shutil.copytree(model_dir("qwen2"), out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def server(chat_dir):
    with serving(make_worker(chat_dir)) as s:
        yield s


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


