"""The Gluon kernels (sm_90 only; no interpreter): bench.ws_chain, ws_mlp and ws_layer (warp-specialized)
and kernels.gluon_decode compile for sm_90a here (with triton's bundled ptxas), with the parts the
design depends on, and the benches' mains refuse to run without a GPU. The compiles run in a subprocess without
TRITON_INTERPRET: under the interpreter (which other test modules switch on for this process)
Gluon's reductions do not compile."""
import json
import os
import subprocess
import sys
import textwrap

os.environ.setdefault("TRITON_INTERPRET", "1")     # as the other bench tests: whichever module imports triton first

import pytest  # noqa: E402
import torch  # noqa: E402

from rollout.bench.occupancy import SMEM_PER_SM  # noqa: E402  (bytes an SM; each CTA also takes 1 KB)

pytest.importorskip("triton")

SMEM_SM90 = 232448      # bytes of shared memory a CTA may use on an H100 / H200
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

COMPILE = textwrap.dedent("""
    import importlib, json, sys
    from rollout.bench.occupancy import compile_sm90
    module, kernel, ptrs, const = json.loads(sys.argv[1])
    k, regs = compile_sm90(getattr(importlib.import_module(module), kernel), const, const["num_warps"], gluon=True,
                           types=ptrs)
    ptx = k.asm["ptx"]
    ops = ("mma.sync", "ldmatrix", "cp.async.mbarrier.arrive.noinc", "mbarrier.init", "setmaxnreg", "ex2", "sqrt.rn",
           "cp.async.wait_group", "ld.shared", "bar.sync", "griddepcontrol.wait", "griddepcontrol.launch_dependents")
    first = {op: ptx.find(op) for op in ("cp.async.ca", "cp.async.cg", "griddepcontrol.wait")}
    pre = ptx[:first["griddepcontrol.wait"]]
    print(json.dumps(dict(shared=k.metadata.shared, n_regs=regs, first=first,
                          pre_wait_copies=pre.count("cp.async.ca") + pre.count("cp.async.cg"),
                          **{op: ptx.count(op) for op in ops})))
""")


def _compile(module, kernel, ptrs, **const):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", COMPILE, json.dumps([module, kernel, ptrs, const])], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _check(k, slots):
    assert k["shared"] <= SMEM_SM90
    assert k["mma.sync"] and k["ldmatrix"]                   # skinny_gemm's tile, its bits
    assert k["cp.async.mbarrier.arrive.noinc"]               # the producers' slot-full signal
    assert k["mbarrier.init"] >= 4 * slots                   # full and empty, both rings
    assert k["setmaxnreg"]                                   # warp-specialized partitions


@pytest.mark.parametrize("w_slots,x_slots,w_warps,flags", [(6, 4, 2, False), (8, 4, 4, True)])
def test_ws_chain_kernel_compiles_for_sm90(w_slots, x_slots, w_warps, flags):
    from rollout.bench.ws_chain import SPIN_LIMIT
    k = _compile("rollout.bench.ws_chain", "_ws_chain_kernel",
                 {"x_ptr": "*bf16", "w_ptr": "*bf16", "cnt_ptr": "*i32", "err_ptr": "*i32"}, BLOCK_N=32, BLOCK_M=32,
                 BLOCK_K=256, W_SLOTS=w_slots, X_SLOTS=x_slots, SPIN=SPIN_LIMIT, W_WARPS=w_warps, X_WARPS=1,
                 FLAGS=flags, MMA=True, num_warps=4)
    _check(k, min(w_slots, x_slots))


@pytest.mark.parametrize("norms", [0, 1, 2])
def test_ws_mlp_kernel_compiles_for_sm90(norms):
    from rollout.bench.ws_chain import SPIN_LIMIT
    names = ("x_ptr", "h_ptr", "a_ptr", "o_ptr", "d_ptr", "res_ptr", "nin_ptr", "n1_ptr", "n2_ptr", "wo_ptr", "wgu_ptr",
             "wd_ptr")
    ptrs = {n: "*bf16" for n in names} | {"cnt_ptr": "*i32", "err_ptr": "*i32", "ss_ptr": "*fp32", "eps": "fp32"}
    k = _compile("rollout.bench.ws_mlp", "_ws_mlp_kernel", ptrs, H=4096, I=14336, BLOCK_N=32, BLOCK_M=32, BLOCK_K=256,
                 W_SLOTS=6, X_SLOTS=4, SPIN=SPIN_LIMIT, W_WARPS=4, X_WARPS=1, NORMS=norms, num_warps=4)
    _check(k, 4)
    assert k["ex2"]                                          # the SiLU epilogue
    assert bool(k["sqrt.rn"]) == bool(norms)                 # the norms (phases, or folded into the GEMMs)


@pytest.mark.parametrize("fold", [0, 1, 2])
def test_ws_layer_kernel_compiles_for_sm90(fold):
    from rollout.bench.ws_chain import SPIN_LIMIT
    names = ("x_ptr", "qkv_ptr", "attn_ptr", "h_ptr", "a_ptr", "o_ptr", "d_ptr", "res_ptr", "nin_ptr", "n1_ptr",
             "n2_ptr", "wqkv_ptr", "wo_ptr", "wgu_ptr", "wd_ptr", "kv_ptr")
    ptrs = {n: "*bf16" for n in names} | {"cnt_ptr": "*i32", "err_ptr": "*i32", "sink_ptr": "*fp32", "ss_ptr": "*fp32",
                                          "eps": "fp32"}
    k = _compile("rollout.bench.ws_layer", "_ws_layer_kernel", ptrs, H=4096, I=14336, NQKV=6144, BLOCK_N=32,
                 BLOCK_M=32, BLOCK_K=256, W_SLOTS=6, X_SLOTS=4, SPIN=SPIN_LIMIT, W_WARPS=4, FOLD=fold, num_warps=4)
    _check(k, 4)
    assert k["sqrt.rn"] and k["ex2"]                         # the norm phases, the SiLU epilogue




@pytest.mark.parametrize("block_n,stages,splits,warp_scores", [(32, 6, 1, False), (32, 5, 1, False), (64, 3, 1, False),
                                                               (32, 3, 2, False), (32, 6, 1, True), (64, 3, 1, True)])
def test_gluon_decode_compiles_for_sm90_at_the_occupancy_its_grid_needs(block_n, stages, splits, warp_scores):
    """The one-split tiles' premise (kernels/gluon_decode.py): their ring fits exactly two programs
    on an SM, so P1's 256-program grid is one wave that cannot pile onto the SMs freed first; the
    two-split tile fits four (512 programs). Registers allow at least as many."""
    ptrs = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")} | {
        "bt_ptr": "*i32", "lens_ptr": "*i32", "sm_scale_log2": "fp32",
        "po_ptr": "*fp32" if splits > 1 else "*bf16", "plse_ptr": "*fp32" if splits > 1 else "*bf16"}
    k = _compile("rollout.kernels.gluon_decode", "_gluon_decode_split_kernel", ptrs, GROUP=4, HEAD_DIM=128,
                 PAGE_SIZE=16, BLOCK_N=block_n, STAGES=stages, NUM_SPLITS=splits, PDL=2, MATH=True,
                 WARP_SCORES=warp_scores, num_warps=4)
    per_sm = SMEM_PER_SM // (k["shared"] + 1024)
    assert per_sm == (2 if splits == 1 else 4)
    assert 65536 // (k["n_regs"] * 128) >= per_sm
    assert k["mma.sync"] and k["ex2"] and not k["cp.async.mbarrier.arrive.noinc"]   # cp.async groups, no mbarriers
    if warp_scores:     # no exchange between warps in the softmax: only the ring's (and the epilogue's) barriers
        assert k["ld.shared"] == 0 and k["bar.sync"] < 11


@pytest.mark.parametrize("block_n,stages", [(64, 3)])
def test_gluon_decode_keys_form_fits_two_programs_with_half_the_mmas(block_n, stages):
    """Keys as the MMA's rows (_gluon_decode_keys_kernel): the same ring, so the same two programs
    an SM, and half the MMAs of the heads-as-rows kernel at the same key tile (GROUP 4 padded to 8
    columns instead of 16 rows)."""
    ptrs = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")} | {
        "bt_ptr": "*i32", "lens_ptr": "*i32", "sm_scale_log2": "fp32"}
    k = _compile("rollout.kernels.gluon_decode", "_gluon_decode_keys_kernel", ptrs, GROUP=4, HEAD_DIM=128,
                 PAGE_SIZE=16, BLOCK_N=block_n, STAGES=stages, PDL=2, EARLY=False, num_warps=4)
    rows = _compile("rollout.kernels.gluon_decode", "_gluon_decode_split_kernel",
                    ptrs | {"po_ptr": "*bf16", "plse_ptr": "*bf16"}, GROUP=4, HEAD_DIM=128, PAGE_SIZE=16,
                    BLOCK_N=block_n, STAGES=stages, NUM_SPLITS=1, PDL=2, MATH=True, WARP_SCORES=False, num_warps=4)
    assert SMEM_PER_SM // (k["shared"] + 1024) == 2 and 65536 // (k["n_regs"] * 128) >= 2
    assert 2 * k["mma.sync"] == rows["mma.sync"] and k["ex2"] < rows["ex2"]


@pytest.mark.parametrize("warps", [4, 8])
def test_gluon_decode_default_tile_runs_one_program_an_sm(warps):
    """The default (128, 2, keys) tile: its 2-stage ring of 128-key K and V tiles (128 KB) holds
    one program an SM, so P1's 256 programs run in two waves (measured faster anyway:
    bench/results/README.md, twenty-third session); 8 warps fit the registers too."""
    from rollout.kernels.paged_decode import GLUON_EARLY, GLUON_TILE
    ptrs = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")} | {
        "bt_ptr": "*i32", "lens_ptr": "*i32", "sm_scale_log2": "fp32"}
    block_n, stages, form = GLUON_TILE
    assert form == "keys"
    k = _compile("rollout.kernels.gluon_decode", "_gluon_decode_keys_kernel", ptrs, GROUP=4, HEAD_DIM=128,
                 PAGE_SIZE=16, BLOCK_N=block_n, STAGES=stages, PDL=2, EARLY=GLUON_EARLY, num_warps=warps)
    assert k["shared"] >= stages * 2 * block_n * 128 * 2 and SMEM_PER_SM // (k["shared"] + 1024) == 1
    assert k["n_regs"] * 32 * warps <= 65536 and k["mma.sync"]
    assert k["griddepcontrol.wait"] and k["griddepcontrol.launch_dependents"]      # PDL 2: both


def test_gluon_decode_early_issues_copies_on_both_sides_of_the_wait():
    """EARLY (paged_decode.GLUON_EARLY): the ring's first tiles are issued before the PDL wait where
    the context allows, after it where not (two paths); without EARLY every copy follows the wait."""
    ptrs = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")} | {
        "bt_ptr": "*i32", "lens_ptr": "*i32", "sm_scale_log2": "fp32"}
    const = dict(GROUP=4, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_N=128, STAGES=2, PDL=2, num_warps=8)
    on = _compile("rollout.kernels.gluon_decode", "_gluon_decode_keys_kernel", ptrs, EARLY=True, **const)
    off = _compile("rollout.kernels.gluon_decode", "_gluon_decode_keys_kernel", ptrs, EARLY=False, **const)

    def first_copy(k):
        return min(i for op, i in k["first"].items() if op.startswith("cp.async") and i >= 0)
    assert on["griddepcontrol.wait"] == 2 and off["griddepcontrol.wait"] == 1
    assert first_copy(on) < on["first"]["griddepcontrol.wait"]
    assert first_copy(off) > off["first"]["griddepcontrol.wait"]
    assert on["shared"] == off["shared"]          # one ring either way
    assert on["pre_wait_copies"] > 0 == off["pre_wait_copies"]


@pytest.mark.parametrize("kernel", ["_gluon_decode_keys_kernel", "_gluon_decode_split_kernel"])
def test_gluon_decode_no_trigger_mode_waits_and_launches_no_dependents(kernel):
    """PDL mode 5 (pdl.set_no_trigger, step_variants' no_trigger=attn): the Gluon kernels still
    wait for the previous grid but never let the next one launch early."""
    ptrs = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "po_ptr", "plse_ptr")} | {
        "bt_ptr": "*i32", "lens_ptr": "*i32", "sm_scale_log2": "fp32"}
    split = dict(NUM_SPLITS=1, MATH=True, WARP_SCORES=False) if "split" in kernel else dict(EARLY=False)
    k = _compile("rollout.kernels.gluon_decode", kernel, ptrs, GROUP=4, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_N=64,
                 STAGES=2, PDL=5, num_warps=4, **split)
    assert k["griddepcontrol.wait"] and not k["griddepcontrol.launch_dependents"]


def test_gluon_decode_copy_bound_keeps_the_ring_and_drops_the_math():
    """MATH False (bench.attn_ceiling's `gluon=...,nomath`): the same ring, so the same occupancy,
    with no MMA or exp left: what the copy stream alone reads at."""
    ptrs = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "po_ptr", "plse_ptr")} | {
        "bt_ptr": "*i32", "lens_ptr": "*i32", "sm_scale_log2": "fp32"}
    k = _compile("rollout.kernels.gluon_decode", "_gluon_decode_split_kernel", ptrs, GROUP=4, HEAD_DIM=128,
                 PAGE_SIZE=16, BLOCK_N=32, STAGES=6, NUM_SPLITS=1, PDL=2, MATH=False, WARP_SCORES=False,
                 num_warps=4)
    assert SMEM_PER_SM // (k["shared"] + 1024) == 2
    assert not k["mma.sync"] and not k["ex2"] and k["cp.async.wait_group"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
@pytest.mark.parametrize("name", ["ws_chain", "ws_mlp", "ws_layer", "decode_layers"])
def test_main_says_cuda_only_without_a_gpu(name, capsys):
    import importlib
    assert importlib.import_module(f"rollout.bench.{name}").main([]) == 1
    assert "CUDA only" in capsys.readouterr().err


@pytest.mark.parametrize("attn", [1, 2])
def test_decode_megakernel_compiles_for_sm90(attn):
    """kernels.decode_layers at the Llama-3-8B shape: one CTA per SM within the shared memory, both
    rings' barriers, warp-specialized, the attention's exp2 and the MMAs."""
    from rollout.kernels import decode_layers as m
    ptrs = {n: "*bf16" for n in m._decode_layers_kernel.arg_names if n.endswith("_ptr")}
    ptrs.update(ss_ptr="*fp32", bt_ptr="*i32", lens_ptr="*i32", slot_ptr="*i64", cnt_ptr="*i32", err_ptr="*i32",
                eps="fp32", scale_log2="fp32")
    k = _compile("rollout.kernels.decode_layers", "_decode_layers_kernel", ptrs, H=4096, I=14336, HQ=32, HKV=8,
                 PAGE=16, BLOCK_N=32, BLOCK_M=32, BLOCK_K=256, W_SLOTS=m.W_SLOTS, X_SLOTS=m.X_SLOTS,
                 SPIN=m.SPIN_LIMIT, W_WARPS=4, ATTN=attn, KV_PAGED=True, num_warps=4)
    _check(k, min(m.W_SLOTS, m.X_SLOTS))
    assert k["ex2"] and k["n_regs"] <= 255
