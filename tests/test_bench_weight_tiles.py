"""bench.weight_tiles (CUDA only): what can be checked without a GPU."""
import pytest
import torch

from rollout.bench import weight_tiles
from rollout.bench.gemm import linear_shapes
from rollout.bench.shapes import make_config
from rollout.kernels.skinny_gemm import pick_config


def test_first_config_of_each_linear_is_the_engines_at_32_rows():
    """The layer row times the engine's configs: each linear's first config is the plain table's
    at M = 32 (the table changed: update CONFIGS)."""
    shapes = linear_shapes(make_config("llama3-8b"))
    for name, configs in weight_tiles.CONFIGS.items():
        N, K, _ = shapes[name]
        assert tuple(configs[0]) == pick_config(N, K, 32), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
def test_main_says_cuda_only_without_a_gpu(capsys):
    assert weight_tiles.main([]) == 1
    assert "CUDA only" in capsys.readouterr().err
