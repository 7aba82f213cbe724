"""bench.gemm_ladder (CUDA only): its rung kernel's arithmetic under the interpreter, and its
configs against the engine's."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from rollout.bench import gemm_ladder  # noqa: E402
from rollout.bench.gemm import linear_shapes  # noqa: E402
from rollout.bench.shapes import make_config  # noqa: E402
from rollout.kernels.skinny_gemm import pack_weight_tiles, pick_config  # noqa: E402


def test_configs_are_the_engines_packed_configs_at_32_rows():
    shapes = linear_shapes(make_config("llama3-8b"))
    for name, cfg in gemm_ladder.CONFIGS.items():
        N, K, _ = shapes[name]
        engine = pick_config(N, K, 32, packed=True)
        splits_k = len(engine) > 4 and engine[4] > 1     # the rungs read all of K: the ladder keeps its tile
        assert len(cfg) == 4 and (splits_k or tuple(cfg) == engine), name


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the interpreter")
@pytest.mark.parametrize("M", [1, 5, 16])
def test_each_rung_computes_what_it_names(M):
    """Each rung stores the per-row sums of what it computes, over a packed weight: the product
    (x as the left or the right operand), the product with x's first K tile for every tile, or
    the weight alone. fp32 (the interpreter's fp32 dot is numpy's): summation order only, ~1e-5
    on these O(10) sums; 1e-4 bounds it. The plain layout read as if packed is caught."""
    N, K, cfg = 64, 256, (32, 64, 4, 2)
    g = torch.Generator().manual_seed(M)
    w, x = torch.randn(N, K, generator=g), torch.randn(M, K, generator=g)
    wp = pack_weight_tiles(w.clone(), cfg[0], cfg[1], "rows")
    y = torch.full((N,), float("nan"))
    want = {(): (x @ w.T).sum(0), ("x_left",): (x @ w.T).sum(0), ("no_mma",): w.sum(1),
            ("x_once",): (x[:, :64].repeat(1, K // 64) @ w.T).sum(0)}
    for flags, ref in want.items():
        y.fill_(float("nan"))
        gemm_ladder.rung(x, wp, y, cfg, **{f: True for f in flags})
        torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4, msg=str(flags))
    gemm_ladder.rung(x, w.reshape(N // 32, K // 64, 32, 64), y, cfg)
    assert not torch.allclose(y, want[()], atol=1e-2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
def test_main_says_cuda_only_without_a_gpu(capsys):
    assert gemm_ladder.main([]) == 1
    assert "CUDA only" in capsys.readouterr().err
