"""Fused Triton sampler on CUDA at the real vocab size (151,936), against `rollout.sampler.sample`,
plus CUDA-graph capture and replay.

Run as its own pytest invocation, never with TRITON_INTERPRET set (the CPU interpreter tests set
it for their whole process): `python -m pytest tests/gpu/test_fused_sampler_cuda.py`.
Skipped without CUDA. Same contract and tolerances as tests/kernels/test_fused_sampler_interpret.py
(whose docstring justifies them); here the noise's inner log is libdevice logf (= CUDA logf, as
torch.log), so -log u is bit-equal to the reference and only fp32 score rounding
(x * (1/T), lg2.approx for the outer log) can flip near-ties.
"""
import functools
import os
import types
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
if not torch.cuda.is_available():
    # Skip before importing triton: a triton imported here without the interpreter would make the
    # CPU interpreter tests, collected later in the same process, skip themselves.
    pytest.skip("needs CUDA", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    pytest.skip("TRITON_INTERPRET is set in this process (by the CPU interpreter tests): run "
                "`python -m pytest tests/gpu` as its own invocation", allow_module_level=True)
pytest.importorskip("triton")

from rollout.sampler import SamplingTensors, counter_uniform, sample  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))
from trunc_check import check_trunc as shared_check_trunc  # noqa: E402

V = 151_936
LP_TOL = 1e-5
NEAR_TIE = 1e-5
TEMPS = [0.0, 0.7, 1.0, 1.6, 0.3, 1.0]


@pytest.fixture(scope="module")
def fs():
    from rollout.kernels import fused_sampler, fused_truncation
    if fused_sampler._INTERPRET:
        pytest.skip("kernel module was imported under the interpreter in this process")
    # Both kernel modules under one name: the one-pass sampler and the truncation kernels.
    return types.SimpleNamespace(**{**vars(fused_sampler), **vars(fused_truncation)})


def reference(logits, temp, seeds, counters):
    R = logits.shape[0]
    dev = logits.device
    st = SamplingTensors(
        temperature=temp, top_k=torch.zeros(R, dtype=torch.int64, device=dev),
        top_p=torch.ones(R, device=dev), min_p=torch.zeros(R, device=dev),
        repetition_penalty=torch.ones(R, device=dev), seeds=seeds, counters=counters,
        penalty_token_ids=None, all_greedy=bool((temp <= 0).all()), any_truncation=False,
        any_penalty=False)
    return sample(logits, st)


def make_inputs(R, dtype, seed, scale=3.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(R, V, generator=g, device="cuda") * scale).to(dtype)
    temp = torch.tensor([TEMPS[(r + seed) % len(TEMPS)] for r in range(R)], device="cuda")
    seeds = torch.randint(0, 2**31, (R,), generator=g, device="cuda")
    counters = torch.randint(0, 2**40, (R,), generator=g, device="cuda")
    return logits, temp, seeds, counters


def check(logits, temp, seeds, counters, tok, lp):
    Vv = logits.shape[1]
    ref = reference(logits, temp, seeds, counters)
    assert bool(((tok >= 0) & (tok < Vv)).all())
    greedy = temp <= 0
    xt = logits.float() / torch.where(greedy, 1.0, temp)[:, None]
    lp_at_ours = torch.log_softmax(xt, dim=-1).gather(1, tok[:, None])[:, 0]
    err = (lp - lp_at_ours).abs().max().item()
    assert err <= LP_TOL, err
    same = tok == ref.token_ids
    if same.any():
        assert (lp[same] - ref.logprobs[same]).abs().max().item() <= LP_TOL
    assert torch.equal(tok[greedy], ref.token_ids[greedy])
    mism = ~same
    if mism.any():
        gumbel = -torch.log(-torch.log(counter_uniform(seeds, counters, Vv)))
        score = xt + torch.where(greedy[:, None], 0.0, gumbel)
        gap = (score.gather(1, ref.token_ids[:, None]) - score.gather(1, tok[:, None]))[:, 0][mism]
        assert gap.abs().max().item() < NEAR_TIE, gap
    assert mism.sum().item() <= 0.01 * max(1, int((~greedy).sum()))
    return err


def test_uniform_bit_identical(fs):
    seeds = torch.tensor([0, 1, 2**31 - 1, 12345], dtype=torch.int64, device="cuda")
    counters = torch.tensor([0, 2**32 - 1, 2**32, 2**40 + 17], dtype=torch.int64, device="cuda")
    assert torch.equal(fs.counter_uniform_triton(seeds, counters, V), counter_uniform(seeds, counters, V))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("R", [1, 64, 256])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_matches_reference(fs, R, dtype, num_splits):
    logits, temp, seeds, counters = make_inputs(R, dtype, seed=R + 1)
    for r in range(R):  # greedy ties far apart (other blocks / splits): first index wins
        if temp[r] <= 0:
            logits[r, [V - 3, 70_001, 5_000]] = (logits[r].float().max() + 1).to(dtype)
    tok = torch.full((R,), -7, dtype=torch.int64, device="cuda")
    lp = torch.full((R,), float("nan"), device="cuda")
    fs.fused_sample(logits, temp, seeds, counters, num_splits=num_splits, out=(tok, lp))
    err = check(logits, temp, seeds, counters, tok, lp)
    assert bool((tok[temp <= 0] == 5_000).all())
    print(f"R={R} {dtype} S={num_splits}: max |dlogp| {err:.2e}")


def test_many_draws_mismatch_rate(fs):
    # 8 steps x 256 sampled rows at T = 1: near-tie flips must stay < 1%.
    logits, _, seeds, counters = make_inputs(256, torch.bfloat16, seed=3)
    temp = torch.ones(256, device="cuda")
    for step in range(8):
        tok, lp = fs.fused_sample(logits, temp, seeds, counters + step)
        check(logits, temp, seeds, counters + step, tok, lp)


def test_greedy_only(fs):
    logits, _, seeds, counters = make_inputs(64, torch.bfloat16, seed=5)
    temp = torch.zeros(64, device="cuda")
    tok, lp = fs.fused_sample(logits, temp, seeds, counters, greedy_only=True)
    check(logits, temp, seeds, counters, tok, lp)
    tok2, _ = fs.fused_sample(logits, temp, seeds, counters)
    assert torch.equal(tok, tok2)


@pytest.mark.parametrize("R", [64, 256])
def test_cuda_graph_replay_matches_eager(fs, R):
    logits, temp, seeds, counters = make_inputs(R, torch.bfloat16, seed=7)
    tok = torch.empty(R, dtype=torch.int64, device="cuda")
    lp = torch.empty(R, device="cuda")
    fs.fused_sample(logits, temp, seeds, counters, out=(tok, lp))  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fs.fused_sample(logits, temp, seeds, counters, out=(tok, lp))
    g = torch.Generator(device="cuda").manual_seed(99)
    for step in range(4):
        counters.add_(1)  # in place: the graph reads the same buffers
        logits.copy_(torch.randn(logits.shape, generator=g, device="cuda") * 3)
        temp.copy_((0.5 + torch.rand(R, generator=g, device="cuda")) * (step % 2))  # even steps: all greedy
        tok.fill_(-7)
        lp.fill_(float("nan"))
        graph.replay()
        e_tok, e_lp = fs.fused_sample(logits, temp, seeds, counters)
        assert torch.equal(tok, e_tok) and torch.equal(lp, e_lp)
        check(logits, temp, seeds, counters, tok, lp)


# ------------------------------------------------------------------ top-k / top-p / min-p
# As tests/kernels/test_fused_sampler_interpret.py (whose comments justify the method): the kernel's kept
# set must lie between float64 reference masks at top_p -/+ MASS_EPS and min_p * (1 +/- MASS_EPS).
# At V = 152K the top-p histogram passes add V / hist_block = ~600 terms per lane before one tree
# reduction: worst case ~600 * 2**-24 = 3.6e-5 relative (typical ~1e-6), so MASS_EPS = 4e-5. The
# kept mass and Z add ~150 terms per lane (block_v 1024): <= 1e-5 relative each, so KM_TOL = 2e-5
# on their log ratio. A rule bug moves far more: bf16 logits at this V repeat each value ~100
# times near the top, so a wrong tie rule moves the cut by ~100 tokens' mass.
MASS_EPS = 4e-5
KM_TOL = 2e-5
TRUNC = [(0.0, 0, 0.9, 0.0), (1.0, 50, 1.0, 0.0), (1.0, 0, 0.9, 0.0), (1.0, 0, 1.0, 0.05), (0.7, 50, 0.9, 0.05),
         (1.0, 1, 1.0, 0.0), (1.0, 0, 1e-6, 0.0), (1.3, 0, 0.99, 0.0), (1.0, 0, 1.0, 0.0), (0.0, 0, 1.0, 0.0),
         (0.6, 20, 0.8, 0.0), (1.0, 1000, 0.95, 0.02), (1.0, "V", 0.5, 0.0), (0.0, 5, 1.0, 0.2)]


def trunc_inputs(R, Vv, seed, dist="flat"):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(R, Vv, generator=g, device="cuda") * (3 if dist == "flat" else 2)
    if dist == "peaked":  # LLM-like: one dominant token, a few runners-up
        x[torch.arange(R, device="cuda"), torch.randint(0, Vv, (R,), generator=g, device="cuda")] += 12
        x[:, :64] += torch.rand(R, 64, generator=g, device="cuda") * 10
    rows = [TRUNC[r % len(TRUNC)] for r in range(R)] if R > 1 else [TRUNC[4]]  # R = 1: the combined row
    col = lambda i: torch.tensor([r[i] for r in rows], dtype=torch.float32, device="cuda")
    temp = col(0)
    st = SamplingTensors(
        temperature=temp, top_k=torch.tensor([Vv if r[1] == "V" else r[1] for r in rows], device="cuda"),
        top_p=col(2), min_p=col(3), repetition_penalty=torch.ones(R, device="cuda"),
        seeds=torch.randint(0, 2**31, (R,), generator=g, device="cuda"),
        counters=torch.randint(0, 2**40, (R,), generator=g, device="cuda"), penalty_token_ids=None,
        all_greedy=False, any_truncation=True, any_penalty=False)
    return x.bfloat16(), st


def check_trunc(logits, st, o, mask):
    """tests/support/trunc_check.py at this file's tolerances, and fp32 near-tie flips in < 1% of the
    sampled rows. Returns (mask mismatches, rows whose kept set differs, kept_mass and logprob errors)."""
    c = shared_check_trunc(logits, st, o, mask, mass_eps=MASS_EPS, km_tol=KM_TOL, lp_tol=LP_TOL, near_tie=NEAR_TIE)
    assert c["flips"] <= 0.01 * max(1, int((st.temperature > 0).sum()))
    return int(c["mask_diff_per_row"].sum()), int((~c["same_mask"]).sum()), c["km_err"], c["lp_err"]


@pytest.mark.parametrize("Vv", [151_936, 128_256])
@pytest.mark.parametrize("R", [1, 64, 256])
@pytest.mark.parametrize("dist", ["flat", "peaked"])
def test_truncation_matches_reference(fs, R, Vv, dist):
    logits, st = trunc_inputs(R, Vv, seed=R + Vv % 97, dist=dist)
    nan = lambda: torch.full((R,), float("nan"), device="cuda")
    from rollout.sampler import SamplerOutput
    out = SamplerOutput(torch.full((R,), -7, dtype=torch.int64, device="cuda"), nan(), nan(), nan(), None, None)
    o = fs.fused_sample_full(logits, st, out=out)
    mask, o2 = fs.fused_kept_mask(logits, st)
    for f in ("token_ids", "logprobs", "processed_logprobs", "kept_mass"):
        assert torch.equal(getattr(o, f), getattr(o2, f)), f
    tok_mism, row_mism, km_err, lp_err = check_trunc(logits, st, o, mask)
    print(f"R={R} V={Vv} {dist}: kept-set token mismatches {tok_mism} in {row_mism} rows, "
          f"max |d kept_mass| {km_err:.1e}, max |d logp| {lp_err:.1e}")


def split_s(fs, R, Vv, S):
    """'default': default_row_splits, at least 2 (the split path)."""
    return max(2, fs.default_row_splits(R, Vv, "cuda")) if S == "default" else S


@pytest.mark.parametrize("S", [None, "default"])
def test_truncation_top_logprobs_and_greedy_only(fs, S):
    from dataclasses import replace
    logits, st = trunc_inputs(64, V, seed=11)
    st = replace(st, num_top_logprobs=8)
    run = functools.partial(fs.fused_sample_full, row_splits=S and split_s(fs, 64, V, S))
    o, ref = run(logits, st), sample(logits, st)
    assert (o.top_logprobs - ref.top_logprobs).abs().max().item() <= LP_TOL
    t = torch.where(st.temperature > 0, st.temperature, 1.0)[:, None]
    lp_full = torch.log_softmax(logits.float() / t, dim=-1)
    assert (lp_full.gather(1, o.top_ids) - o.top_logprobs).abs().max().item() <= LP_TOL
    gst = replace(st, temperature=torch.zeros_like(st.temperature), all_greedy=True, num_top_logprobs=0)
    g = run(logits, gst)
    assert torch.equal(g.token_ids, sample(logits, gst).token_ids)
    assert torch.equal(g.token_ids, run(logits, replace(gst, all_greedy=False)).token_ids)


def refresh_graph_inputs(logits, st, g, step, outputs):
    """New inputs in place for a graph replay (next counters, fresh logits, top-p on at odd
    steps, new top-k), and the outputs poisoned so a replay that skips a write shows."""
    R = logits.shape[0]
    st.counters.add_(1)
    logits.copy_(torch.randn(logits.shape, generator=g, device="cuda") * 3)
    st.top_p.copy_(torch.rand(R, generator=g, device="cuda") * (step % 2) + (1 - step % 2))  # odd: top-p on
    st.top_k.copy_(torch.randint(0, 200, (R,), generator=g, device="cuda"))
    for t in outputs:
        t.fill_(-7)


@pytest.mark.parametrize("R", [64, 256])
def test_truncation_cuda_graph_replay_matches_eager(fs, R):
    logits, st = trunc_inputs(R, V, seed=7)
    o = fs.fused_sample_full(logits, st)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fs.fused_sample_full(logits, st, out=o)
    g = torch.Generator(device="cuda").manual_seed(99)
    for step in range(4):
        refresh_graph_inputs(logits, st, g, step, (o.token_ids, o.logprobs, o.processed_logprobs, o.kept_mass))
        graph.replay()
        e = fs.fused_sample_full(logits, st)
        for f in ("token_ids", "logprobs", "processed_logprobs", "kept_mass"):
            assert torch.equal(getattr(o, f), getattr(e, f)), f
        mask, _ = fs.fused_kept_mask(logits, st)
        check_trunc(logits, st, o, mask)


# ------------------------------------------------------------------ split rows (row_splits > 1)
# Against the reference as above, and against the single-program kernel: top-k counts are exact
# and min-p compares the same e(x) bits, so rows without top-p keep exactly the same set; top-p
# rows may differ at the boundary (the masses are fp32 sums in another order; at this V one
# rounding of the cumulative mass spans many tail tokens), within the bounds checked above. Where
# the kept sets agree the tokens must too (same scores, first index on ties). Logprobs each lie
# within LP_TOL of the fp32 reference, so within 2 * LP_TOL of each other (summation order only).
def run_split_and_single(fs, logits, st, S):
    R = logits.shape[0]
    nan = lambda: torch.full((R,), float("nan"), device="cuda")
    from rollout.sampler import SamplerOutput
    out = SamplerOutput(torch.full((R,), -7, dtype=torch.int64, device="cuda"), nan(), nan(), nan(), None, None)
    o = fs.fused_sample_full(logits, st, out=out, row_splits=S)
    mask, o2 = fs.fused_kept_mask(logits, st, row_splits=S)
    for f in ("token_ids", "logprobs", "processed_logprobs", "kept_mass"):
        assert torch.equal(getattr(o, f), getattr(o2, f)), f
    mask1, o1 = fs.fused_kept_mask(logits, st)
    no_p = st.top_p >= 1
    assert torch.equal(mask[no_p], mask1[no_p])
    same = (mask == mask1).all(1)
    assert torch.equal(o.token_ids[same], o1.token_ids[same])
    dlp = (o.logprobs - o1.logprobs).abs().max().item()
    assert dlp <= 2 * LP_TOL, dlp
    return o, mask, int((mask != mask1).sum()), dlp


@pytest.mark.parametrize("S", ["default", 5])
@pytest.mark.parametrize("Vv", [151_936, 128_256])
@pytest.mark.parametrize("R", [1, 64, 256])
@pytest.mark.parametrize("dist", ["flat", "peaked"])
def test_truncation_split_matches_reference_and_single(fs, R, Vv, dist, S):
    logits, st = trunc_inputs(R, Vv, seed=R + Vv % 97, dist=dist)
    S = split_s(fs, R, Vv, S)
    o, mask, vs_single, dlp = run_split_and_single(fs, logits, st, S)
    tok_mism, row_mism, km_err, lp_err = check_trunc(logits, st, o, mask)
    print(f"R={R} V={Vv} {dist} S={S}: kept-set token mismatches {tok_mism} in {row_mism} rows (vs single "
          f"{vs_single}), max |d kept_mass| {km_err:.1e}, max |d logp| {lp_err:.1e} (vs single {dlp:.1e})")


def test_truncation_split_tie_runs(fs):
    # Each row: ~200 ties each of 6, 5 and 4.5 at random positions (so in every one of the 7
    # chunks), the rest at -20 (mass ~1e-6 of one tie in all). top_p puts the cut half a tie's
    # mass past the middle of one value's run (top-k rows: k inside the 4.5 run, top_p over the
    # top-k mass): no rounding (<< 1e-3 of the mass here) can move it, so the kept sets must be
    # the reference's and the single kernel's exactly, and the cut must split a run of ties that
    # spans chunks: each chunk's tie offset decides.
    R, Vv, S = 64, V, 7
    g = torch.Generator(device="cuda").manual_seed(5)
    vals = torch.tensor([6.0, 5.0, 4.5], device="cuda")
    logits = torch.full((R, Vv), -20.0, device="cuda")
    for r in range(R):
        pos = torch.randperm(Vv, generator=g, device="cuda")[:600]
        logits[r, pos] = vals[torch.randint(0, 3, (600,), generator=g, device="cuda")]
    logits = logits.bfloat16()
    _, st = trunc_inputs(R, Vv, seed=6)
    st.temperature.copy_(torch.tensor([1.0, 0.7, 0.0, 1.3], device="cuda").repeat(R // 4))
    st.min_p.zero_()
    x = logits.double() / torch.where(st.temperature > 0, st.temperature, 1.0).double()[:, None]
    e = torch.exp(x - x.max(1, keepdim=True).values)
    x = logits.double()
    n = torch.stack([(x == v).sum(1) for v in vals.tolist()], 1)
    ev = torch.stack([e[r][x[r] == v][0] for r in range(R) for v in vals.tolist()]).view(R, 3)
    use_k = torch.arange(R, device="cuda") % 2 == 1
    st.top_k.copy_(torch.where(use_k, n.sum(1) - 3, 0))  # the k-th largest is a 4.5: all 4.5s kept
    zk = torch.where(use_k, (n * ev).sum(1), e.sum(1))
    b = torch.arange(R, device="cuda") % 3  # boundary value: 6, 5 or 4.5
    above = ((n * ev) * (torch.arange(3, device="cuda")[None, :] < b[:, None])).sum(1)
    nb, eb = n.gather(1, b[:, None])[:, 0], ev.gather(1, b[:, None])[:, 0]
    st.top_p.copy_(((above + (nb // 2 + 0.5) * eb) / zk).float())
    o, mask, vs_single, _ = run_split_and_single(fs, logits, st, S)
    tok_mism, _, _, _ = check_trunc(logits, st, o, mask)
    assert tok_mism == 0 and vs_single == 0
    chunk = fs._row_chunks(Vv, S, 1024)[1]
    for r in range(R):  # the kept prefix of the boundary run ends past chunk 0, ties are cut after it
        v = vals[b[r]].item()
        pos = (x[r] == v).nonzero()[:, 0]
        kept = mask[r][pos]
        assert int(kept.sum()) == nb[r].item() // 2 + 1 and bool(kept[:nb[r].item() // 2 + 1].all()), r
        assert pos[nb[r].item() // 2].item() >= chunk, r


@pytest.mark.parametrize("R", [1, 64, 256])
def test_truncation_split_cuda_graph_replay_matches_eager(fs, R):
    logits, st = trunc_inputs(R, V, seed=7)
    S = split_s(fs, R, V, "default")
    from dataclasses import replace
    st = replace(st, num_top_logprobs=4)
    o = fs.fused_sample_full(logits, st, row_splits=S)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        og = fs.fused_sample_full(logits, st, out=o, row_splits=S)
    g = torch.Generator(device="cuda").manual_seed(99)
    for step in range(4):
        refresh_graph_inputs(logits, st, g, step, (o.token_ids, o.logprobs, o.processed_logprobs, o.kept_mass,
                                                   og.top_ids, og.top_logprobs))
        graph.replay()
        e = fs.fused_sample_full(logits, st, row_splits=S)
        for f in ("token_ids", "logprobs", "processed_logprobs", "kept_mass", "top_ids", "top_logprobs"):
            assert torch.equal(getattr(og, f), getattr(e, f)), f
        e2 = fs.fused_sample_full(logits, st, row_splits=S)  # deterministic run to run
        assert all(torch.equal(getattr(e, f), getattr(e2, f)) for f in ("token_ids", "logprobs", "kept_mass"))
        mask, _ = fs.fused_kept_mask(logits, st, row_splits=S)
        check_trunc(logits, st, og, mask)
