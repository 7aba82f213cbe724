"""The engine's attention_backend choice (kernels.resolve_backend) and the triton version gate: the
kernels need triton >= 3.4 (torch 2.6 / 2.7 ship 3.2 / 3.3, on which every kernel module fails to
import), so "auto" on CUDA with an older triton raises, naming attention_backend='torch', and the
decode GEMMs (layers.linear._triton_ok) stay off. Package metadata is faked; nothing imports triton."""
import importlib.metadata

import pytest

from rollout import kernels
from rollout.layers import linear


@pytest.fixture
def triton_dist(monkeypatch):
    """Make the installed triton report `version` (None: no distribution metadata at all)."""
    def fake(version):
        def lookup(dist):
            if version is None or dist != "triton":
                raise importlib.metadata.PackageNotFoundError(dist)
            return version
        monkeypatch.setattr(importlib.metadata, "version", lookup)
        monkeypatch.setattr(kernels.importlib.util, "find_spec", lambda name: object() if name == "triton" else None)
        kernels.triton_version.cache_clear()
        linear._triton_ok.cache_clear()
    yield fake
    kernels.triton_version.cache_clear()
    linear._triton_ok.cache_clear()


def test_triton_older_than_3_4_is_not_used_and_auto_on_cuda_says_what_to_do(triton_dist):
    triton_dist("3.2.0")
    assert kernels.triton_version() == (3, 2) and not kernels.triton_available()
    assert not linear._triton_ok()          # the decode GEMMs and their fused paths stay on torch
    with pytest.raises(RuntimeError, match=r"triton >= 3\.4.*found 3\.2.*attention_backend='torch'"):
        kernels.resolve_backend("auto", "cuda")
    with pytest.raises(RuntimeError, match="found 3.2"):
        kernels.resolve_backend("triton", "cuda")
    assert kernels.resolve_backend("torch", "cuda") == "torch"
    assert kernels.resolve_backend("auto", "cpu") == "torch"


@pytest.mark.parametrize("version,expected", [("3.4.0", (3, 4)), ("3.6.0+git1a2b", (3, 6)), (None, None)])
def test_triton_3_4_and_later_or_unversioned_builds_take_the_kernels(triton_dist, version, expected):
    triton_dist(version)
    assert kernels.triton_version() == expected and kernels.triton_available()
    assert kernels.resolve_backend("auto", "cuda") == "triton"
    assert kernels.resolve_backend("auto", "cpu") == "torch"


def test_no_triton_at_all(monkeypatch):
    monkeypatch.setattr(kernels.importlib.util, "find_spec", lambda name: None)
    assert not kernels.triton_available()
    with pytest.raises(RuntimeError, match="found none"):
        kernels.resolve_backend("auto", "cuda")


def test_unknown_backend_name_is_refused():
    with pytest.raises(ValueError, match="'auto', 'torch' or 'triton'"):
        kernels.resolve_backend("flash", "cpu")
