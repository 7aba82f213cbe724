"""The Gluon decode kernels (sm_90 only; no interpreter) compile for sm_90a here (with triton's
bundled ptxas), with the parts the design depends on. The compiles run in a subprocess without
TRITON_INTERPRET: under the interpreter (which other test modules switch on for this process)
Gluon's reductions do not compile."""
import json
import os
import subprocess
import sys
import textwrap

os.environ.setdefault("TRITON_INTERPRET", "1")     # as the other bench tests: whichever module imports triton first

import pytest  # noqa: E402

from rollout.bench.occupancy import SMEM_PER_SM  # noqa: E402  (bytes an SM; each CTA also takes 1 KB)

pytest.importorskip("triton")

SMEM_SM90 = 232448      # bytes of shared memory a CTA may use on an H100 / H200
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


@pytest.mark.parametrize("block_n,stages,splits", [(32, 6, 1), (32, 5, 1), (64, 3, 1), (32, 3, 2)])
def test_gluon_decode_compiles_for_sm90_at_the_occupancy_its_grid_needs(block_n, stages, splits):
    """The one-split tiles' premise (kernels/gluon_decode.py): their ring fits exactly two programs
    on an SM, so P1's 256-program grid is one wave that cannot pile onto the SMs freed first; the
    two-split tile fits four (512 programs). Registers allow at least as many."""
    ptrs = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")} | {
        "bt_ptr": "*i32", "lens_ptr": "*i32", "sm_scale_log2": "fp32",
        "po_ptr": "*fp32" if splits > 1 else "*bf16", "plse_ptr": "*fp32" if splits > 1 else "*bf16"}
    k = _compile("rollout.kernels.gluon_decode", "_gluon_decode_split_kernel", ptrs, GROUP=4, HEAD_DIM=128,
                 PAGE_SIZE=16, BLOCK_N=block_n, STAGES=stages, NUM_SPLITS=splits, PDL=1, num_warps=4)
    per_sm = SMEM_PER_SM // (k["shared"] + 1024)
    assert per_sm == (2 if splits == 1 else 4)
    assert 65536 // (k["n_regs"] * 128) >= per_sm
    assert k["mma.sync"] and k["ex2"] and not k["cp.async.mbarrier.arrive.noinc"]   # cp.async groups, no mbarriers


@pytest.mark.parametrize("block_n,stages", [(64, 3)])
def test_gluon_decode_keys_form_fits_two_programs_with_half_the_mmas(block_n, stages):
    """Keys as the MMA's rows (_gluon_decode_keys_kernel): the same ring, so the same two programs
    an SM, and half the MMAs of the heads-as-rows kernel at the same key tile (GROUP 4 padded to 8
    columns instead of 16 rows)."""
    ptrs = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")} | {
        "bt_ptr": "*i32", "lens_ptr": "*i32", "sm_scale_log2": "fp32"}
    k = _compile("rollout.kernels.gluon_decode", "_gluon_decode_keys_kernel", ptrs, GROUP=4, HEAD_DIM=128,
                 PAGE_SIZE=16, BLOCK_N=block_n, STAGES=stages, PDL=1, EARLY=False, num_warps=4)
    rows = _compile("rollout.kernels.gluon_decode", "_gluon_decode_split_kernel",
                    ptrs | {"po_ptr": "*bf16", "plse_ptr": "*bf16"}, GROUP=4, HEAD_DIM=128, PAGE_SIZE=16,
                    BLOCK_N=block_n, STAGES=stages, NUM_SPLITS=1, PDL=1, num_warps=4)
    assert SMEM_PER_SM // (k["shared"] + 1024) == 2 and 65536 // (k["n_regs"] * 128) >= 2
    assert 2 * k["mma.sync"] == rows["mma.sync"] and k["ex2"] < rows["ex2"]


@pytest.mark.parametrize("warps", [4, 8])
def test_gluon_decode_default_tile_runs_one_program_an_sm(warps):
    """The default (128, 2, keys) tile: its 2-stage ring of 128-key K and V tiles (128 KB) holds
    one program an SM, so P1's 256 programs run in two waves (measured faster anyway); 8 warps
    fit the registers too."""
    from rollout.env import KernelSwitches
    from rollout.layers.attention import GLUON_TILE
    ptrs = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")} | {
        "bt_ptr": "*i32", "lens_ptr": "*i32", "sm_scale_log2": "fp32"}
    block_n, stages = GLUON_TILE["block_n"], GLUON_TILE["num_stages"]
    assert GLUON_TILE["form"] == "keys" and GLUON_TILE["num_warps"] in (4, 8)
    k = _compile("rollout.kernels.gluon_decode", "_gluon_decode_keys_kernel", ptrs, GROUP=4, HEAD_DIM=128,
                 PAGE_SIZE=16, BLOCK_N=block_n, STAGES=stages, PDL=1, EARLY=KernelSwitches().gluon_early,
                 num_warps=warps)
    assert k["shared"] >= stages * 2 * block_n * 128 * 2 and SMEM_PER_SM // (k["shared"] + 1024) == 1
    assert k["n_regs"] * 32 * warps <= 65536 and k["mma.sync"]
    assert k["griddepcontrol.wait"] and k["griddepcontrol.launch_dependents"]      # PDL: both


def test_gluon_decode_early_issues_copies_on_both_sides_of_the_wait():
    """EARLY (KernelSwitches.gluon_early): the ring's first tiles are issued before the PDL wait where
    the context allows, after it where not (two paths); without EARLY every copy follows the wait."""
    ptrs = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")} | {
        "bt_ptr": "*i32", "lens_ptr": "*i32", "sm_scale_log2": "fp32"}
    const = dict(GROUP=4, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_N=128, STAGES=2, PDL=1, num_warps=8)
    on = _compile("rollout.kernels.gluon_decode", "_gluon_decode_keys_kernel", ptrs, EARLY=True, **const)
    off = _compile("rollout.kernels.gluon_decode", "_gluon_decode_keys_kernel", ptrs, EARLY=False, **const)

    def first_copy(k):
        return min(i for op, i in k["first"].items() if op.startswith("cp.async") and i >= 0)
    assert on["griddepcontrol.wait"] == 2 and off["griddepcontrol.wait"] == 1
    assert first_copy(on) < on["first"]["griddepcontrol.wait"]
    assert first_copy(off) > off["first"]["griddepcontrol.wait"]
    assert on["shared"] == off["shared"]          # one ring either way
    assert on["pre_wait_copies"] > 0 == off["pre_wait_copies"]
