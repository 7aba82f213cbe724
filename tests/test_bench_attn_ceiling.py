"""bench.attn_ceiling's read kernel under the interpreter: the ceiling it times must read every
byte of K and V once (a program share that skipped or re-read a block would time fewer or more
bytes than attention reads)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from rollout.bench.attn_ceiling import read_bytes  # noqa: E402


@pytest.mark.parametrize("programs,block,pre", [(1, 64, 0), (3, 64, 0), (7, 32, 0), (3, 64, 2), (7, 32, 1)])
def test_read_kernel_sums_every_element_once(programs, block, pre):
    """Integer-valued fp16 data: the fp32 sums are exact, so the total must equal torch's exactly;
    sizes not a multiple of programs x block exercise the tail mask; `pre` blocks read before the
    PDL wait are not read again after it."""
    g = torch.Generator().manual_seed(programs)
    k = torch.randint(-4, 5, (5, 3, 2, 11), generator=g).half()
    v = torch.randint(-4, 5, (5, 3, 2, 11), generator=g).half()
    out = torch.zeros(programs, dtype=torch.float32)
    read_bytes(k, v, out, programs, stages=2, block=block, pre=pre)
    assert out.sum().item() == k.float().sum().item() + v.float().sum().item()


def test_read_kernel_refuses_more_blocks_before_the_wait_than_a_program_reads():
    k = torch.zeros(4, 64).half()
    with pytest.raises(ValueError, match="before the wait"):
        read_bytes(k, k, torch.zeros(2), 2, stages=2, block=64, pre=3)
