"""bench.gemm's config space (the sweep itself needs CUDA)."""
from rollout.bench.gemm import sweep_configs


def test_split_k_configs_divide_k_and_include_wide_tiles():
    """Every split-K config splits K's tiles evenly and only where the tiles alone would leave SMs
    idle (< 264 programs); wide tiles (128, 256 rows: less of x re-read per weight byte) get
    split-K too, which the decode A/B needs for o_proj and down_proj."""
    for N, K in ((4096, 4096), (4096, 14336), (6144, 4096), (128256, 4096)):
        cfgs = sweep_configs(N, K, (1, 2, 4, 8))
        assert len(set(cfgs)) == len(cfgs)
        for bn, bk, nw, st, sk in cfgs:
            assert K % bk == 0
            if sk > 1:
                assert (K // bk) % sk == 0 and -(-N // bn) < 264, (N, K, bn, bk, sk)
        split_wide = {(bn, sk) for bn, _, _, _, sk in cfgs if sk > 1 and bn >= 128}
        if N == 4096:
            assert {(128, 4), (256, 8)} <= split_wide
        if N == 128256:     # lm_head: 501+ tiles at any width already fill the SMs, no split
            assert {sk for *_, sk in cfgs} == {1}


def test_quick_space_is_narrow_tiles_with_four_warps():
    cfgs = sweep_configs(4096, 4096, (1, 2), quick=True)
    assert cfgs and {bn for bn, *_ in cfgs} == {32, 64} and {nw for _, _, nw, *_ in cfgs} == {4}
