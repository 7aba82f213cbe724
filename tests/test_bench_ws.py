"""bench.ws_chain and bench.ws_mlp (warp-specialized Gluon kernels, sm_90 only; no interpreter):
their kernels compile for sm_90a here (with triton's bundled ptxas), with the parts the design
depends on, and their mains refuse to run without a GPU."""
import pytest
import torch

pytest.importorskip("triton")

from rollout.bench import ws_chain, ws_mlp  # noqa: E402

SMEM_SM90 = 232448      # bytes of shared memory a CTA may use on an H100 / H200


def _compile(fn, ptrs, **const):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        sig[name] = "constexpr" if name in const else ptrs.get(name, "i32")
        if name.endswith("_ptr") or name == "N":     # as the JIT specialises 16-divisible arguments
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=const["num_warps"]))


def _check(k, slots):
    ptx = k.asm["ptx"]
    assert k.metadata.shared <= SMEM_SM90
    assert "mma.sync" in ptx and "ldmatrix" in ptx                    # skinny_gemm's tile, its bits
    assert "cp.async.mbarrier.arrive.noinc" in ptx                    # the producers' slot-full signal
    assert ptx.count("mbarrier.init") >= 4 * slots                    # full and empty, both rings
    assert "setmaxnreg" in ptx                                        # warp-specialized partitions


@pytest.mark.parametrize("w_slots,x_slots,w_warps,flags", [(6, 4, 2, False), (8, 4, 4, True)])
def test_ws_chain_kernel_compiles_for_sm90(w_slots, x_slots, w_warps, flags):
    k = _compile(ws_chain._ws_chain_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "cnt_ptr": "*i32", "err_ptr": "*i32"},
                 BLOCK_N=32, BLOCK_M=32, BLOCK_K=256, W_SLOTS=w_slots, X_SLOTS=x_slots, SPIN=ws_chain.SPIN_LIMIT,
                 W_WARPS=w_warps, X_WARPS=1, FLAGS=flags, MMA=True, num_warps=4)
    _check(k, min(w_slots, x_slots))


@pytest.mark.parametrize("norms", [False, True])
def test_ws_mlp_kernel_compiles_for_sm90(norms):
    names = ("x_ptr", "h_ptr", "a_ptr", "o_ptr", "d_ptr", "res_ptr", "n1_ptr", "n2_ptr", "wo_ptr", "wgu_ptr", "wd_ptr")
    ptrs = {n: "*bf16" for n in names} | {"cnt_ptr": "*i32", "err_ptr": "*i32", "eps": "fp32"}
    k = _compile(ws_mlp._ws_mlp_kernel, ptrs, H=4096, I=14336, BLOCK_N=32, BLOCK_M=32, BLOCK_K=256, W_SLOTS=6,
                 X_SLOTS=4, SPIN=ws_mlp.SPIN_LIMIT, W_WARPS=4, X_WARPS=1, NORMS=norms, num_warps=4)
    _check(k, 4)
    ptx = k.asm["ptx"]
    assert "ex2" in ptx                                               # the SiLU epilogue
    assert ("sqrt.rn" in ptx) == norms                                # the norm phases, only with norms


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
@pytest.mark.parametrize("mod", [ws_chain, ws_mlp])
def test_main_says_cuda_only_without_a_gpu(mod, capsys):
    assert mod.main([]) == 1
    assert "CUDA only" in capsys.readouterr().err
