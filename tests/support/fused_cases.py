"""Shared cases for the fused small-op kernels, run under the interpreter on CPU
(tests/kernels/test_kernels_interpret.py) and on CUDA (tests/gpu/test_kernels_cuda.py)."""
import torch
import torch.nn.functional as F

from rollout.kernels.fused_ops import add_rmsnorm, silu_mul
from rollout.models.decoder import RMSNorm


def fused_ops_cases(device, dtype):
    """(name, kernel output, torch eager output) for add_rmsnorm (with and without the add) and
    silu_mul on fresh random inputs, kernel outputs poisoned with NaN first. N = 96 is not a
    power of two (masked tail); rows are strided views like the model's."""
    T, N, inter = 5, 96, 80
    g = torch.Generator().manual_seed(7)
    x = torch.randn(T, N + 8, generator=g).to(device, dtype)[:, :N]
    d = torch.randn(T, N, generator=g).to(device, dtype)
    norm = RMSNorm(N, 1e-6).to(device, dtype)
    norm.weight.data = (1 + 0.1 * torch.randn(N, generator=g)).to(device, dtype)
    poison = lambda *shape: torch.full(shape, float("nan"), dtype=dtype, device=device)  # noqa: E731
    cases = []
    h, r = add_rmsnorm(x, norm.weight, norm.eps, delta=d, out=(poison(T, N), poison(T, N)))
    cases += [("add_rmsnorm.residual", r, x + d), ("add_rmsnorm.normed", h, norm(x + d))]
    h, r = add_rmsnorm(x, norm.weight, norm.eps, out=(poison(T, N), x))
    cases += [("rmsnorm", h, norm(x))]
    gu = torch.randn(T, 2 * inter, generator=g).to(device, dtype)
    cases += [("silu_mul", silu_mul(gu, out=poison(T, inter)), F.silu(gu[:, :inter]) * gu[:, inter:])]
    return cases
