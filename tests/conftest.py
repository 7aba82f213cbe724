"""Shared pytest fixtures: tiny tokenizer and tiny random HF model folders.

Fixtures (all session-scoped, built offline under ``tmp_path_factory``):

* ``tiny_tokenizer`` -> ``PreTrainedTokenizerFast`` (byte-level BPE, 250 tokens,
  ``<pad>``=0 ``<bos>``=1 ``<eos>``=2, bos prepended by ``tokenizer(text)``).
* ``model_dir`` -> factory ``model_dir(family: str, seed: int = 0) -> Path``; folders
  are built once per (family, seed) and reused.
* ``family_model_dir`` -> ``(family, Path)``, parametrized over
  ``["llama", "qwen2", "qwen3", "mistral"]``.
* ``sharded_model_dir`` -> ``Path`` of the llama model (seed 0, same weights as
  ``model_dir("llama")``) saved as 5 safetensors shards + ``model.safetensors.index.json``.

Reference helpers live in ``tests/support/hf_reference.py`` (``import hf_reference``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# support/ holds shared helpers; core/ and rl/ test modules are imported by tests elsewhere
# (test_moe, test_trl_generator), which must also work when a file runs alone
for _i, _sub in enumerate(("support", "core", "rl")):
    _dir = str(Path(__file__).resolve().parent / _sub)
    if _dir not in sys.path:
        sys.path.insert(_i, _dir)

import pytest
import torch

# The tiny models are overhead-bound; with 2 cores shared by other processes, torch's
# default of 2 intra-op threads was ~40x slower (OpenMP spinning) than 1 thread.
torch.set_num_threads(int(os.environ.get("ROLLOUT_TEST_TORCH_THREADS", "1")))

from hf_reference import FAMILIES, build_tiny_model_dir, build_tiny_tokenizer
from transformers.utils import logging as _hf_logging

# keep test output free of "Writing model shards" / "Loading weights" progress bars
_hf_logging.disable_progress_bar()

SHARDED_MAX_SHARD_SIZE = "100KB"


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_models_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def model_dir(tiny_models_root):
    """Factory: ``model_dir(family, seed=0) -> Path`` (built once, then cached)."""
    cache: dict[tuple[str, int], Path] = {}

    def _get(family: str, seed: int = 0) -> Path:
        if family not in FAMILIES:
            raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
        key = (family, seed)
        if key not in cache:
            cache[key] = build_tiny_model_dir(family, tiny_models_root / f"{family}-seed{seed}", seed=seed)
        return cache[key]

    return _get


@pytest.fixture(scope="session", params=list(FAMILIES))
def family_model_dir(request, model_dir) -> tuple[str, Path]:
    return request.param, model_dir(request.param)


@pytest.fixture(scope="session")
def sharded_model_dir(tiny_models_root) -> Path:
    return build_tiny_model_dir(
        "llama", tiny_models_root / "llama-seed0-sharded", seed=0, max_shard_size=SHARDED_MAX_SHARD_SIZE
    )
