"""The Gluon split-KV decode kernel (kernels/gluon_decode.py; the engine's choice where
layers/attention.py's pick_decode says, at its GLUON_TILE), with one split (its own output)
and several (partials for the merge kernel), against the fp32 torch reference on fresh random
inputs with poisoned pages and outputs, and inside a CUDA graph with PDL. Skipped without an
sm_90 GPU."""
import os
import sys

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 in this process: run `python -m pytest tests/gpu` on its own",
                allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))
from paged_cases import make_paged, meta_for, reference  # noqa: E402
from rollout.kernels import paged_decode  # noqa: E402

# bf16 inputs are the same values in kernel and reference; the kernel's own roundings are the
# probabilities cast to bf16 for the PV MMA and the bf16 output (2^-9 relative, |o| <~ 3): 1e-2
# is above both, and a masking or page bug gives O(0.1-1) (tests/gpu/test_kernels_cuda.py).
TOL = dict(rtol=1e-2, atol=1e-2)
LENS = [0, 1, 16, 17, 63, 65, 1000, 3001, 0]


def gluon_tile(tile, warps=4, **kw):
    """paged_decode_attention's keywords for the Gluon kernel at tile (block_n, stages, form) and its
    warps a program (4 unless given: what every tile but the default was measured at)."""
    return dict(gluon=True, block_n=tile[0], num_stages=tile[1], form=tile[2], num_warps=warps, **kw)


@pytest.mark.parametrize("tile", [(32, 3, "heads"), (32, 6, "heads"), (64, 2, "heads"), (64, 3, "heads"),
                                  (128, 2, "heads")])   # the default tile's fallback (GROUP > 8, several splits)
@pytest.mark.parametrize("Hq,Hkv,ps,num_splits", [(32, 8, 16, 1), (32, 8, 16, 2), (32, 8, 64, 3), (28, 4, 16, 8),
                                                  (16, 1, 32, 1)])
def test_matches_reference(tile, Hq, Hkv, ps, num_splits):
    _against_reference(tile, Hq, Hkv, ps, num_splits, seed=Hq + ps + num_splits)


def _against_reference(tile, Hq, Hkv, ps, num_splits, seed, warps=4):
    """The kernel at `tile` and `warps` on poisoned pages into a poisoned output, against the fp32 reference."""
    D = 128
    clean, poisoned, bt = make_paged(LENS, Hkv, D, ps, torch.bfloat16, seed=seed, device="cuda", spare_pages=8)
    q = torch.randn(len(LENS), Hq, D, device="cuda").bfloat16()
    meta = meta_for(LENS, [1] * len(LENS), bt, ps)
    out = torch.full_like(q, float("nan"))
    paged_decode.paged_decode_attention(q, *poisoned, bt, meta.seq_lens, D ** -0.5, None, num_splits, out=out,
                                        **gluon_tile(tile, warps))
    torch.testing.assert_close(out.float(), reference(q, clean, meta, D ** -0.5, None), **TOL)


@pytest.mark.parametrize("tile,num_splits", [((128, 2, "keys"), 1), ((128, 2, "heads"), 2)])
def test_eight_warps_match_reference(tile, num_splits):
    """8 warps (the default tile's, layers/attention.py's GLUON_TILE): both forms at the 128-key
    tile, 16 keys a warp."""
    _against_reference(tile, 32, 8, 16, num_splits, seed=num_splits, warps=8)


@pytest.mark.parametrize("tile", [(64, 3, "keys"), (64, 2, "keys"), (128, 2, "keys")])
@pytest.mark.parametrize("Hq,Hkv,ps", [(32, 8, 16), (28, 4, 16), (16, 2, 64), (8, 8, 16)])
def test_keys_form_matches_reference(tile, Hq, Hkv, ps):
    """Keys as the MMA's rows (one split, GROUP <= 8: 4, 7, 8 and 1 query heads a KV head), with
    lengths that end inside a tile, on a page boundary, and 0."""
    _against_reference(tile, Hq, Hkv, ps, 1, seed=Hq + ps + tile[0])


def test_keys_form_gives_way_to_the_heads_form_where_it_does_not_apply(monkeypatch):
    """With the keys form set, several splits or GROUP > 8 run the heads form at the same tile (and
    match the reference); one split at GROUP <= 8 runs the keys form."""
    from rollout.kernels import gluon_decode
    forms = []
    real = gluon_decode.decode_split
    monkeypatch.setattr(gluon_decode, "decode_split", lambda *a, **k: forms.append(a[12]) or real(*a, **k))
    D = 128
    for Hq, Hkv, ns in ((32, 8, 2), (16, 1, 1), (32, 8, 1)):
        clean, poisoned, bt = make_paged(LENS, Hkv, D, 16, torch.bfloat16, seed=Hq + ns, device="cuda", spare_pages=8)
        q = torch.randn(len(LENS), Hq, D, device="cuda").bfloat16()
        meta = meta_for(LENS, [1] * len(LENS), bt, 16)
        out = paged_decode.paged_decode_attention(q, *poisoned, bt, meta.seq_lens, D ** -0.5, None, ns,
                                                  **gluon_tile((64, 3, "keys")))
        torch.testing.assert_close(out.float(), reference(q, clean, meta, D ** -0.5, None), **TOL)
    assert forms == ["heads", "heads", "keys"]


def test_engine_takes_it_at_p1s_batch_and_refuses_a_window(monkeypatch):
    """layers.attention.paged_attention (the engine's call) takes the Gluon kernel, one split, at
    B = 32 with 8 KV heads on this GPU, and its output matches the reference; Triton at B = 64, and
    at every batch with gluon_decode off. Asked for a sliding window, the Gluon path raises
    instead of falling back."""
    from rollout.env import KernelSwitches
    from rollout.kernels import gluon_decode
    from rollout.layers import attention
    calls = []
    real = gluon_decode.decode_split
    monkeypatch.setattr(gluon_decode, "decode_split", lambda *a, **k: calls.append(a[9]) or real(*a, **k))
    for B in (32, 64):
        lens = [(97 * i) % 2000 + 1 for i in range(B)]
        clean, poisoned, bt = make_paged(lens, 8, 128, 16, torch.bfloat16, seed=B, device="cuda", spare_pages=4)
        q = torch.randn(B, 32, 128, device="cuda").bfloat16()
        meta = meta_for(lens, [1] * B, bt, 16)
        for switches in (None, KernelSwitches(gluon_decode=False)):
            out = attention.paged_attention(q, *poisoned, meta, 128 ** -0.5, None, switches)
            torch.testing.assert_close(out.float(), reference(q, clean, meta, 128 ** -0.5, None), **TOL)
    n_sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert calls == ([1] if n_sms < 256 <= 2 * n_sms else [])
    with pytest.raises(ValueError, match="no window"):
        paged_decode.paged_decode_attention(q, *clean, bt, meta.seq_lens, 0.1, 50, 1, **gluon_tile((64, 3, "keys")))


@pytest.mark.parametrize("tile,num_splits,warps", [((32, 3, "heads"), 2, 4), ((32, 6, "heads"), 1, 4),
                                                   ((64, 3, "keys"), 1, 4), ((128, 2, "keys"), 1, 8)])
def test_graph_replay_with_pdl_equals_eager(tile, num_splits, warps):
    """Captured once (PDL launches, as the engine's decode graphs), replayed after seq_lens and
    block tables change in place: the eager call's bits, and the reference."""
    Hq, Hkv, D, ps, B = 32, 8, 128, 16, 6
    lens0, lens1 = [1, 17, 300, 64, 0, 5], [2000, 0, 301, 1, 777, 4096]
    clean, _, bt_big = make_paged(lens1, Hkv, D, ps, torch.bfloat16, seed=11, device="cuda", spare_pages=8)
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens0, dtype=torch.int32, device="cuda")
    bt = bt_big.flip(0).clone()
    out = torch.empty_like(q)
    kw = gluon_tile(tile, warps)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        paged_decode.paged_decode_attention(q, *clean, bt, seq_lens, D ** -0.5, None, num_splits, out=out,
                                            **kw)   # compile
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            paged_decode.paged_decode_attention(q, *clean, bt, seq_lens, D ** -0.5, None, num_splits, out=out, **kw)
    torch.cuda.synchronize()
    for lens, table in ((lens0, bt_big.flip(0)), (lens1, bt_big)):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        bt.copy_(table)
        q.normal_()
        out.fill_(float("nan"))
        graph.replay()
        eager = paged_decode.paged_decode_attention(q, *clean, bt, seq_lens, D ** -0.5, None, num_splits, **kw)
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        ref = reference(q, clean, meta_for(lens, [1] * B, bt, ps), D ** -0.5, None)
        torch.testing.assert_close(out.float(), ref, **TOL)


def test_early_tiles_in_a_graph_behind_the_qkv_kernel_that_writes_the_step_key():
    """KernelSwitches.gluon_early (paged_decode_attention's early): in a CUDA graph behind the QKV +
    RoPE GEMM at the 8B shape (96 programs, so attention programs launch early under PDL on the
    idle SMs and issue their first tiles while the GEMM still runs), with the step's K / V slots
    poisoned before every replay: the GEMM's writes are what the attention reads (a tile holding
    the step's key issued before the wait would read NaN), and the bits equal the kernel without
    EARLY. Lengths around the 128-key tile's edge (128: the step's key is the first tile's last;
    129: the next tile's first)."""
    from rollout.kernels.rope_kv import qkv_rope_and_write_kv
    from rollout.layers.linear import pick_config
    Hq, Hkv, D, ps, K = 32, 8, 128, 16, 4096
    lens = [1, 2, 127, 128, 129, 130, 255, 256, 257, 1000, 3001, 4352] * 2 + [4096, 17, 64, 65, 300, 700, 2048, 8]
    B = len(lens)
    clean, _, bt = make_paged(lens, Hkv, D, ps, torch.bfloat16, seed=21, device="cuda", spare_pages=4)
    pos = torch.tensor([n - 1 for n in lens], device="cuda")
    slots = bt[torch.arange(B, device="cuda"), pos // ps].long() * ps + pos % ps
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(B, K, device="cuda", generator=g).bfloat16()
    w = (torch.randn((Hq + 2 * Hkv) * D, K, device="cuda", generator=g) * K ** -0.5).bfloat16()
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device="cuda").float() / D))
    cfg = pick_config(w.shape[0], K, B)
    assert cfg is not None and w.shape[0] // cfg[0] * (cfg[4] if len(cfg) > 4 else 1) < 132   # SMs left idle
    outs = {}
    for early in (False, True):
        kw = gluon_tile((128, 2, "keys"), 8, early=early)
        kc, vc = clean[0].clone(), clean[1].clone()
        out = torch.empty(B, Hq, D, device="cuda", dtype=torch.bfloat16)

        def step():
            q = qkv_rope_and_write_kv(x, w, Hq, pos, inv_freq, kc, vc, slots, *cfg)
            paged_decode.paged_decode_attention(q, kc, vc, bt, seq_lens, D ** -0.5, None, 1, out=out, **kw)
            return q
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            step()                                       # compile, split counters
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=s):
                q = step()
        torch.cuda.synchronize()
        for _ in range(20):
            kc.view(-1, Hkv, D)[slots] = float("nan")
            vc.view(-1, Hkv, D)[slots] = float("nan")
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert not out.isnan().any(), f"early={early}: a poisoned slot was read"
            if early in outs:
                assert torch.equal(out, outs[early])
            outs[early] = out.clone()
        ref = reference(q, [kc, vc], meta_for(lens, [1] * B, bt, ps), D ** -0.5, None)
        torch.testing.assert_close(out.float(), ref, **TOL)
    assert torch.equal(outs[True], outs[False])
