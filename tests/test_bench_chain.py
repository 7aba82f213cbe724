"""bench.chain's persistent GEMM chain under the interpreter: one program (the interpreter runs
programs one after another, so a grid barrier between several would never open; the GPU run of
the bench compares the full grid with the launches bit for bit)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from rollout.bench.chain import chain_launches, chain_persistent, chain_queue  # noqa: E402


@pytest.mark.parametrize("block_n,block_k,M", [(16, 32, 5), (32, 64, 16)])
def test_persistent_chain_gives_the_launches_bits(block_n, block_k, M):
    """Three dependent layers in one launch: the same bits as one skinny_gemm launch per layer
    (same tiles and K order), close to torch's chain (fp16: one rounding per layer of an fp32 sum
    of 64 products ~1e-3 relative; 1e-2 over three layers), the counter back at zero and no
    barrier timeout; a second launch gives the same bits. A wrong layer order is caught."""
    L, N = 3, 64
    g = torch.Generator().manual_seed(block_n + M)
    w = (torch.randn(L, N, N, generator=g) * N ** -0.5).half()
    x0 = torch.randn(M, N, generator=g).half()
    xs = [torch.zeros(L + 1, M, N, dtype=torch.float16) for _ in range(2)]
    for x in xs:
        x[0] = x0
    bar, err = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    chain_launches(xs[0], w, block_n, block_k, 4, 2)
    chain_persistent(xs[1], w, bar, err, block_n, block_k, 4, 2, grid=1)
    assert torch.equal(xs[0], xs[1])
    assert int(bar.item()) == 0 and int(err.item()) == 0
    ref = x0.float()
    for i in range(L):
        ref = (ref @ w[i].float().T).half().float()
    torch.testing.assert_close(xs[1][L].float(), ref, atol=1e-2, rtol=1e-2)
    again = xs[1].clone()
    again[1:] = 0
    chain_persistent(again, w, bar, err, block_n, block_k, 4, 2, grid=1)
    assert torch.equal(again, xs[1])
    flipped = xs[1].clone()
    chain_persistent(flipped, w.flip(0).contiguous(), bar, err, block_n, block_k, 4, 2, grid=1)
    assert not torch.equal(flipped[L], xs[1][L])


@pytest.mark.parametrize("grid", [1, 3])
def test_queue_chain_gives_the_launches_bits_with_any_grid(grid):
    """The work-queue chain: items taken in layer order and per-layer done counts. Under the
    interpreter the first program takes every item (each wait is on items it already did) and
    the others find the queue empty; the last one out zeroes the counters. The same bits as the
    launches, twice in a row; a wrong layer order is caught."""
    L, N, M, block_n, block_k = 3, 64, 5, 16, 32
    g = torch.Generator().manual_seed(grid)
    w = (torch.randn(L, N, N, generator=g) * N ** -0.5).half()
    xs = [torch.zeros(L + 1, M, N, dtype=torch.float16) for _ in range(2)]
    for x in xs:
        x[0] = torch.randn(M, N, generator=g).half()
    xs[1][0] = xs[0][0]
    cnt, err = torch.zeros(L + 2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    chain_launches(xs[0], w, block_n, block_k, 4, 2)
    for _ in range(2):
        xs[1][1:] = 0
        chain_queue(xs[1], w, cnt, err, block_n, block_k, 4, 2, grid)
        assert torch.equal(xs[1], xs[0])
        assert int(cnt.abs().sum()) == 0 and int(err.item()) == 0
    xs[1][1:] = 0
    chain_queue(xs[1], w.flip(0).contiguous(), cnt, err, block_n, block_k, 4, 2, grid)
    assert not torch.equal(xs[1][L], xs[0][L])
