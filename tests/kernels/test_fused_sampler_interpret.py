"""Fused Triton sampler (rollout/kernels/fused_sampler.py) under the CPU interpreter, against
the torch reference `rollout.sampler.sample`: rows without truncation (`fused_sample`), then
top-k / top-p / min-p (`fused_sample_full`; their tolerances are justified above MASS_EPS below).

TRITON_INTERPRET=1 is set at the top, before triton and the kernel module are imported
(triton.jit picks the interpreter at decoration time, and triton's own jit'd helpers such as
the tl.max combine functions are decorated when triton is imported). It stays set for the rest
of the process (same convention as tests/kernels/test_kernels_interpret.py), so tests/gpu runs as its own
pytest invocation: `python -m pytest tests/gpu`.

Tolerances:
* logprobs, max |Δ| <= 1e-5: the kernel's (x_tok / T - max(x) / T) is bit-identical to the
  reference's (division is monotone, so max commutes with it), leaving only log(sum exp) to
  differ, by summation order and exp implementation: a few ulp of a value <= log V ~ 8.5,
  i.e. ~1e-6 (observed <= ~1e-6). 1e-5 is well below any indexing / scaling bug (>= 1e-3).
* tokens: greedy rows exactly equal (first index on ties). Sampled rows use the same u bits
  (checked bit for bit), but the kernel scores with x * (1/T) and its own logs, so the two can
  only disagree where the top-2 perturbed scores are within fp32 rounding (|scores| <~ 60 here,
  ulp <= 4e-6): at every mismatch the two candidates' reference scores must differ by < 1e-5,
  and mismatches must be < 1% of sampled rows (none are expected at these sizes).
"""
import functools
import os
import subprocess
import sys
import textwrap

import pytest

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set (tests/gpu in the same "
                "process?); run `pytest tests/kernels/test_fused_sampler_interpret.py` on its own",
                allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from dataclasses import replace  # noqa: E402

import torch  # noqa: E402

from rollout.kernels import fused_sampler as fs  # noqa: E402
from rollout.kernels import fused_truncation as ft  # noqa: E402
from rollout.sampler import SamplerOutput, SamplingTensors, counter_uniform, sample  # noqa: E402
from trunc_check import check_trunc as shared_check_trunc  # noqa: E402

LP_TOL = 1e-5
NEAR_TIE = 1e-5
TEMPS = [0.0, 0.7, 1.0, 1.6, 0.3, 0.05]  # 0.05: |x / T| ~ 200, where 1 ulp = 1.5e-5


def test_module_is_interpreted():
    assert fs._INTERPRET


def reference(logits, temp, seeds, counters):
    R = logits.shape[0]
    st = SamplingTensors(
        temperature=temp, top_k=torch.zeros(R, dtype=torch.int64), top_p=torch.ones(R),
        min_p=torch.zeros(R), repetition_penalty=torch.ones(R), seeds=seeds, counters=counters,
        penalty_token_ids=None, all_greedy=bool((temp <= 0).all()), any_truncation=False,
        any_penalty=False)
    return sample(logits, st)


def make_inputs(R, V, dtype, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(R, V, generator=g) * scale).to(dtype)
    temp = torch.tensor([TEMPS[(r + seed) % len(TEMPS)] for r in range(R)], dtype=torch.float32)
    seeds = torch.randint(0, 2**31, (R,), generator=g)
    seeds[0] = 2**31 - 1
    counters = torch.randint(0, 2**40, (R,), generator=g)  # > 2**32: exercises the high word
    return logits, temp, seeds, counters


def run_poisoned(logits, temp, seeds, counters, **kw):
    R = logits.shape[0]
    tok = torch.full((R,), -7, dtype=torch.int64)
    lp = torch.full((R,), float("nan"))
    out = fs.fused_sample(logits, temp, seeds, counters, out=(tok, lp), **kw)
    assert out[0] is tok and out[1] is lp
    return tok, lp


def check(logits, temp, seeds, counters, tok, lp):
    """Asserts the contract; returns the number of (near-tie) token mismatches."""
    V = logits.shape[1]
    ref = reference(logits, temp, seeds, counters)
    # The caller fills processed_logprobs = logprobs and kept_mass = 0 for these rows.
    assert torch.equal(ref.processed_logprobs, ref.logprobs) and bool((ref.kept_mass == 0).all())
    assert bool(((tok >= 0) & (tok < V)).all()), tok
    greedy = temp <= 0
    xt = logits.float() / torch.where(greedy, 1.0, temp)[:, None]
    lp_at_ours = torch.log_softmax(xt, dim=-1).gather(1, tok[:, None])[:, 0]
    assert (lp - lp_at_ours).abs().max().item() <= LP_TOL
    same = tok == ref.token_ids
    assert (lp[same] - ref.logprobs[same]).abs().max().item() <= LP_TOL
    assert torch.equal(tok[greedy], ref.token_ids[greedy])
    gumbel = -torch.log(-torch.log(counter_uniform(seeds, counters, V)))
    score = xt + torch.where(greedy[:, None], 0.0, gumbel)
    mism = ~same
    if mism.any():
        gap = (score.gather(1, ref.token_ids[:, None]) - score.gather(1, tok[:, None]))[:, 0][mism]
        assert gap.abs().max().item() < NEAR_TIE, gap
    assert mism.sum().item() <= 0.01 * max(1, int((~greedy).sum()))
    return int(mism.sum())


def test_uniform_bit_identical():
    seeds = torch.tensor([0, 1, 2**31 - 1, 12345, 7], dtype=torch.int64)
    counters = torch.tensor([0, 2**32 - 1, 2**32, 2**40 + 17, 2**62 + 3], dtype=torch.int64)
    u = fs.counter_uniform_triton(seeds, counters, 3001)
    assert torch.equal(u, counter_uniform(seeds, counters, 3001))


@pytest.mark.parametrize("R, V, dtype, num_splits, block_v", [
    (1, 4999, torch.float32, None, 2048),  # default split heuristic (several splits + merge)
    (7, 3001, torch.bfloat16, 3, 512),
    (33, 1000, torch.float16, 1, 256),
    (33, 2500, torch.bfloat16, 2, 1024),
])
def test_matches_reference(R, V, dtype, num_splits, block_v):
    logits, temp, seeds, counters = make_inputs(R, V, dtype, seed=R + V + 1)
    # Greedy ties across lanes, blocks and splits: the first index must win.
    for r in range(R):
        if temp[r] <= 0:
            top = logits[r].float().max() + 1
            logits[r, [V - 3, block_v + 5, V // 2, 2 * block_v + 5]] = top.to(dtype)
    tok, lp = run_poisoned(logits, temp, seeds, counters, num_splits=num_splits, block_v=block_v)
    check(logits, temp, seeds, counters, tok, lp)
    g = temp <= 0
    assert bool((tok[g] == min(V - 3, block_v + 5, V // 2)).all())


def test_pruned_blocks_peaked_logits():
    # A dominant token early in the row makes later blocks unable to win (max x/T + 17 < best):
    # their noise is skipped, which must not change anything.
    R, V = 7, 3000
    logits, temp, seeds, counters = make_inputs(R, V, torch.bfloat16, seed=3, scale=2.0)
    temp = torch.tensor([1.0, 0.7, 1.0, 0.0, 1.3, 1.0, 0.5])
    logits[:, 40] += 28.0
    logits[1::2, 2900] += 26.0  # a late competitor, in a block that is not pruned
    tok, lp = run_poisoned(logits, temp, seeds, counters, num_splits=1, block_v=256)
    check(logits, temp, seeds, counters, tok, lp)


def test_greedy_only():
    R, V = 7, 2000
    logits, _, seeds, counters = make_inputs(R, V, torch.bfloat16, seed=5)
    temp = torch.zeros(R)
    ref_tok = None
    for greedy_only in (True, False):
        tok, lp = run_poisoned(logits, temp, seeds, counters, greedy_only=greedy_only, block_v=512)
        check(logits, temp, seeds, counters, tok, lp)
        assert ref_tok is None or torch.equal(tok, ref_tok)
        ref_tok = tok


def test_tokens_independent_of_splits_and_batch():
    # A row's token depends only on its own (seed, counter, logits, T): not on the split count,
    # the block width, or which rows share the batch.
    R, V = 5, 2100
    logits, temp, seeds, counters = make_inputs(R, V, torch.bfloat16, seed=11)
    base, base_lp = fs.fused_sample(logits, temp, seeds, counters, num_splits=1, block_v=512)
    for S, bv in [(3, 256), (5, 512)]:
        tok, lp = fs.fused_sample(logits, temp, seeds, counters, num_splits=S, block_v=bv)
        assert torch.equal(tok, base)
        assert (lp - base_lp).abs().max().item() <= 2e-6  # summation order only
    for r in (0, 3):
        tok, lp = fs.fused_sample(logits[r:r + 1], temp[r:r + 1], seeds[r:r + 1], counters[r:r + 1],
                                  num_splits=1, block_v=512)
        assert tok.item() == base[r].item() and lp.item() == base_lp[r].item()


def test_strided_rows_never_read_past_v():
    # Rows of a wider buffer (stride > V) whose padding is NaN: any read past V poisons lse.
    R, V = 4, 1500
    logits, temp, seeds, counters = make_inputs(R, V, torch.float32, seed=13)
    wide = torch.full((R, V + 37), float("nan"))
    wide[:, :V] = logits
    tok, lp = run_poisoned(wide[:, :V], temp, seeds, counters, num_splits=2, block_v=512)
    check(logits, temp, seeds, counters, tok, lp)


# ------------------------------------------------------------------ top-k / top-p / min-p
# Kept-set tolerance: the kernel (exp2, per-bin fp32 sums of a radix select) and the reference
# (exp, fp32 softmax + cumsum of the sorted row) compute the same masses in different orders; here
# (V <= 1500, <= 24 sequential adds per lane, then a tree) that is <= ~1.5e-6 worst case in a mass
# normalised to 1 (typically 1e-7), and a few ulp relative in a probability ratio. A token's
# top-p / min-p decision may therefore differ only if its float64 "mass before it" is within
# MASS_EPS of top_p, or its float64 ratio p / p_max within MASS_EPS (relative) of min_p: both sets
# must lie between the float64 masks at the tightened and loosened thresholds. 1e-5 is >= 7x those
# errors; a rule bug (a wrong tie, bin, or off-by-one) moves the cut by whole tokens, whose
# probabilities near these rows' boundaries are ~1e-4..1e-1 (deliberately broken rules fail here).
MASS_EPS = 1e-5
# kept_mass = log(kept / all): both fp32 sums, relative error ~1e-6, so ~1e-6 in the log; the
# reference logsumexps fp32 logprobs. Same 1e-5 as tests/core/test_sampler.py's LOOSE.
KM_TOL = 1e-5
# temperature, top_k (V: = V, V1: > V), top_p, min_p. Ties (grid rows) or not, greedy or not.
TRUNC_ROWS = [
    (0.0, 0, 0.9, 0.0), (1.0, 1, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.0, "V", 1.0, 0.0),
    (1.3, "V1", 1.0, 0.0), (1.0, 0, 1e-6, 0.0), (1.0, 0, 0.999, 0.0), (0.5, 0, 0.5, 0.0),
    (1.0, 0, 1.0, 0.05), (1.6, 0, 1.0, 0.3), (0.8, 40, 0.9, 0.05), (1.0, 0, 1.0, 0.0),
    (0.0, 0, 1.0, 0.0), (0.3, 3, 0.7, 0.0), (1.0, 0, 0.95, 0.01), (0.05, 20, 0.9, 0.0),
    (0.0, 7, 0.6, 0.1), (1.0, 300, 0.8, 0.0), (1.0, 0, 0.99999994, 0.0), (0.9, 0, 0.99999994, 0.0),
]  # 0.99999994: the largest fp32 < 1, where rounding can leave every bin short of top_p * Zk


def trunc_st(rows, V, seed, K=0, any_truncation=True):
    g = torch.Generator().manual_seed(seed)
    R = len(rows)
    col = lambda i, dt: torch.tensor([r[i] for r in rows], dtype=dt)
    k = [V if r[1] == "V" else V + 5 if r[1] == "V1" else r[1] for r in rows]
    temp = col(0, torch.float32)
    return SamplingTensors(
        temperature=temp, top_k=torch.tensor(k), top_p=col(2, torch.float32), min_p=col(3, torch.float32),
        repetition_penalty=torch.ones(R), seeds=torch.randint(0, 2**31, (R,), generator=g),
        counters=torch.randint(0, 2**40, (R,), generator=g), penalty_token_ids=None, num_top_logprobs=K,
        all_greedy=bool((temp <= 0).all()), any_truncation=any_truncation, any_penalty=False)


def trunc_logits(R, V, dtype, seed):
    """Random rows; odd rows on a 0.5 grid (~30 distinct values: many exact ties at every
    boundary); row 0 also has 3 equal maxima (greedy / top-1 ties: the first index wins)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, V, generator=g) * 2.5
    x[1::2] = torch.round(x[1::2] * 2) / 2
    x[0, [V - 2, V // 3, V // 2]] = x[0].max() + 1.0
    return x.to(dtype)


def run_trunc(logits, st, production=True, **kw):
    """The debug variant that also writes the kept mask, and the production variant: they must
    agree bit for bit (MASK only adds the store). Both write into outputs poisoned with NaN / -7
    (the mask with -1). production=False: the mask variant alone (halves interpreter time)."""
    R = logits.shape[0]
    nan = lambda: torch.full((R,), float("nan"))
    poisoned = lambda: SamplerOutput(torch.full((R,), -7, dtype=torch.int64), nan(), nan(), nan(), None, None)
    out = poisoned()
    mask, o2 = ft.fused_kept_mask(logits, st, out=out, **kw)
    assert o2.token_ids is out.token_ids and o2.kept_mass is out.kept_mass
    if production:
        o = ft.fused_sample_full(logits, st, out=poisoned(), **kw)
        for f in ("token_ids", "logprobs", "processed_logprobs", "kept_mass"):
            assert torch.equal(getattr(o, f), getattr(o2, f)), f
    return o2, mask


def check_trunc(logits, st, o, mask):
    """The shared contract check (tests/support/trunc_check.py) plus what holds at these small V: the
    rounding bounds hold the reference's own mask, any cut above fp32 resolution shows in
    kept_mass, and where the kept sets agree kept_mass and processed match the reference's.
    Returns (mask mismatches per row, near-tie token flips)."""
    c = shared_check_trunc(logits, st, o, mask, mass_eps=MASS_EPS, km_tol=KM_TOL, lp_tol=LP_TOL, near_tie=NEAR_TIE)
    ref, same_mask = c["ref"], c["same_mask"]
    assert bool((c["tight"] <= c["ref_mask"]).all() and (c["ref_mask"] <= c["loose"]).all())
    assert bool((o.kept_mass[c["km64"] < -1e-6] < 0).all())
    assert bool(((o.kept_mass - ref.kept_mass)[same_mask].abs() <= KM_TOL).all())
    same = o.token_ids == ref.token_ids
    assert bool(((o.processed_logprobs - ref.processed_logprobs)[same & same_mask].abs() <= KM_TOL).all())
    return c["mask_diff_per_row"], c["flips"]


@functools.cache
def single_case(V, dtype, block_v, hist_block):
    """TRUNC_ROWS through the single-program kernel (cached: the split tests compare with it)."""
    logits = trunc_logits(len(TRUNC_ROWS), V, dtype, seed=V)
    st = trunc_st(TRUNC_ROWS, V, seed=V)
    o, mask = run_trunc(logits, st, block_v=block_v, hist_block=hist_block)
    return logits, st, o, mask


@pytest.mark.parametrize("V, dtype, block_v, hist_block", [
    (1500, torch.bfloat16, 512, None), (1500, torch.float32, 512, 128), (777, torch.float16, 256, 64),
    (300, torch.bfloat16, 1024, 512),
])
def test_truncation_matches_reference(V, dtype, block_v, hist_block):
    logits, st, o, mask = single_case(V, dtype, block_v, hist_block)
    check_trunc_rows(logits, st, o, mask)


def check_trunc_rows(logits, st, o, mask):
    mism, flips = check_trunc(logits, st, o, mask)
    # Beyond the bounds above: sets differ only at rare boundary roundings (none seen at these
    # sizes), except where top_p is 1 - 2**-24: there every tail token's mass-before is within
    # rounding of top_p, and both sides cut a rounding-dependent part of the tail.
    assert mism[st.top_p < 0.9999].sum() <= 2 and flips == 0
    # Every truncating row cuts (not k = V, V + 5, the 2 rows without truncation, and the two
    # top_p = 1 - 2**-24 rows, whose cut tail may round to nothing).
    assert (~mask.all(1)).sum() >= len(TRUNC_ROWS) - 6


# Split rows (row_splits S > 1) against the single-program kernel: counts are exact integers and
# every element's e(x), key and perturbed score are the same expressions of the same bits, so the
# kept sets and tokens must be identical, except where top-p masses (fp32 sums in another order)
# decide: the top_p = 1 - 2**-24 rows above (skipped). logprob and kept_mass differ by summation
# order only: Z (and the kept mass) are ~V terms <= 1 summed as <= 6 sequential (rescaled) steps
# per lane, a <= 10-level lane tree, and <= 3 levels over chunks: <= ~26 roundings, 1.6e-6
# relative per side worst case; logprob has one such sum per side (<= 3.2e-6 apart), kept_mass two
# (<= 6.4e-6). A lost or doubled chunk moves them by >= 1e-3.
SPLIT_LP_TOL = 4e-6
SPLIT_KM_TOL = 7e-6


def check_split_vs_single(st, o, mask, o1, mask1):
    exact = st.top_p < 0.9999
    assert torch.equal(mask[exact], mask1[exact])
    same = (mask == mask1).all(1)
    assert torch.equal(o.token_ids[same], o1.token_ids[same])
    assert (o.logprobs - o1.logprobs).abs().max().item() <= SPLIT_LP_TOL
    assert (o.kept_mass - o1.kept_mass).abs().max().item() <= SPLIT_KM_TOL


@pytest.mark.parametrize("V, dtype, S, block_v, hist_block, single", [
    (1500, torch.bfloat16, 3, 256, 256, (512, None)),  # chunks 512, 512, 476
    (1500, torch.float32, 2, 512, 128, (512, 128)),    # 1024, 476: 8 digits, 16 radix launches
    (777, torch.float16, 5, 64, 64, (256, 64)),        # 4 x 192, 9: a last chunk of one partial block
])
def test_split_rows_match_reference_and_single(V, dtype, S, block_v, hist_block, single):
    logits, st, o1, mask1 = single_case(V, dtype, *single)
    assert ft._row_chunks(V, S, max(block_v, hist_block))[0] == S
    o, mask = run_trunc(logits, st, production=dtype == torch.bfloat16, block_v=block_v, hist_block=hist_block,
                        row_splits=S)
    check_trunc_rows(logits, st, o, mask)
    check_split_vs_single(st, o, mask, o1, mask1)


def test_row_chunks_and_default_splits():
    for V in (1, 255, 256, 777, 1500, 151_936, 128_256):
        for S in (1, 2, 3, 5, 7, 64):
            n, chunk = ft._row_chunks(V, S, 256)
            # Whole blocks, none empty, covering V, never more than asked (or than the cap).
            assert chunk % 256 == 0 and (n - 1) * chunk < V <= n * chunk and 1 <= n <= min(S, ft._MAX_ROW_SPLITS)
    for R in (1, 2, 3, 64, 256, 4096):
        d = ft.default_row_splits(R, 151_936, "cpu")  # 4 "SMs" on CPU: 12 programs
        # At least 8 (the H200 sweep's best at R = 64 and 256); about 12 programs where that is
        # more, rounded down to a power of two (each chunk width is a compiled kernel); within the cap.
        want = min(max(8, -(-12 // R)), ft._MAX_ROW_SPLITS)
        assert 8 <= d <= ft._MAX_ROW_SPLITS and d & (d - 1) == 0 and d <= want < 2 * d
    assert ft.default_row_splits(64, 3000, "cpu") == 3      # never more chunks than 1024-wide blocks


def test_default_splits_leave_few_compiled_variants(monkeypatch):
    """SPLITS / CHUNK are constexprs: every (splits, chunk) pair the engine can ask for is a
    kernel compiled on first use (~0.4 s each on the H200, inside a step). Over every row count
    up to 4096 at Qwen's and Llama's vocab on 132 SMs, powers of two leave at most 8 pairs per
    kernel (the unrounded counts: 17), and the row count itself is not specialized on (nor the
    RoPE kernel's token count)."""
    import rollout.kernels.fused_sampler as fs
    monkeypatch.setattr(fs, "sm_count", lambda device: 132)      # the H200's SMs
    monkeypatch.setattr(ft, "sm_count", lambda device: 132)
    for V in (151_936, 128_256):
        pairs = {fs.split_chunks(V, fs.default_num_splits(R, V, "cpu"), 2048) for R in range(1, 4097)}
        assert len(pairs) <= 8, sorted(pairs)
        rows = {ft._row_chunks(V, ft.default_row_splits(R, V, "cpu"), 1024) for R in range(1, 4097)}
        assert len(rows) <= 3, sorted(rows)
    def unspecialized(k):    # the decorator's list (an InterpretedFunction keeps it in kwargs)
        return list(k.kwargs.get("do_not_specialize") if hasattr(k, "kwargs") else k.do_not_specialize)
    for k in (fs._sample_kernel, fs._merge_kernel, ft._trunc_kernel, ft._split_step_kernel,
              ft._split_final_kernel, ft._split_merge_kernel):
        assert unspecialized(k) == ["R"], k.fn.__name__
    # The eager path's RoPE + KV write takes the step's token count too (P5's first run on a fresh
    # H200 compiled it inside its last prefill step: 508 ms).
    from rollout.kernels import rope_kv
    assert unspecialized(rope_kv._rope_kv_kernel) == ["n_slots"]


@functools.cache
def tie_case(S):
    """test_truncation_tie_runs' rows through row_splits S (S > 1: chunks of 128)."""
    R, V = 18, 640
    g = torch.Generator().manual_seed(21)
    vals = torch.tensor([4.0, 3.0, 2.5, 2.0, 1.0, 0.0, -0.0, -1.0, -3.0])
    logits = vals[torch.randint(0, 9, (R, V), generator=g)].bfloat16()
    x16 = logits[16:].double()
    z = torch.exp(x16).sum(1)
    # top_p half a token's mass past the middle zero: no boundary within rounding of a tie.
    p_mid = ((torch.exp(x16) * (x16 > 0)).sum(1) + (x16 == 0).sum(1) // 2 + 0.5) / z
    rows = [(t, k, p, 0.0) for t, k, p in [
        (1.0, 0, 0.3), (1.0, 0, 0.5), (0.0, 0, 0.7), (1.0, 10, 0.9), (0.7, 0, 0.05), (1.0, 100, 1.0),
        (1.0, 1, 1.0), (1.3, 0, 0.95), (0.0, 200, 0.99), (1.0, 0, 0.15), (0.5, 50, 0.6), (1.0, 0, 0.999),
        (1.0, 81, 0.4), (2.0, 0, 0.8), (0.0, 0, 0.01), (1.0, 639, 1.0),
        (1.0, int((x16[0] > 0).sum()) + 1, 1.0), (1.0, 0, float(p_mid[1]))]]
    st = trunc_st(rows, V, seed=5)
    o, mask = run_trunc(logits, st, production=S == 1, block_v=128, hist_block=128 if S > 1 else None,
                        row_splits=S)
    return logits, st, o, mask


@pytest.mark.parametrize("S", [1, 3, 5])
def test_truncation_tie_runs(S):
    # Every row: a handful of distinct values, each repeated many times, in shuffled positions:
    # the top-k boundary (all ties kept) and the top-p boundary (first c ties by index) fall
    # inside long runs of equal values. top_p spans fractions of a tie run's mass. Zeros come as
    # +0.0 and -0.0, equal for the reference: the last two rows put the top-k / top-p boundary
    # inside the zero run. Split rows (S = 3: chunks 256, 256, 128; S = 5: 5 x 128): the boundary
    # value's ties lie in every chunk, so each chunk's rank offset (the ties before it) decides.
    logits, st, o, mask = tie_case(S)
    R, V = logits.shape
    mism, flips = check_trunc(logits, st, o, mask)
    assert mism.sum() == 0 and flips == 0
    # Rank rule: each row keeps a prefix (by index) of its boundary value's ties, and the cut
    # really lands inside a run in most top-p rows.
    inside = spans = 0
    for r in range(R):
        x = logits[r].float()
        v = x[mask[r]].min()
        pos = (x == v).nonzero()[:, 0]
        kept = mask[r][pos]
        assert bool(kept[:int(kept.sum())].all()), r
        inside += bool(0 < kept.sum() < len(pos))
        if S > 1 and 0 < kept.sum() < len(pos):  # the cut falls past the first chunk's ties
            chunk = ft._row_chunks(V, S, 128)[1]
            spans += bool(pos[int(kept.sum()) - 1] >= chunk)
    assert inside >= 8 and bool(mask[16][logits[16] == 0].all())
    if S > 1:
        assert spans >= 4, spans
        _, _, o1, mask1 = tie_case(1)
        check_split_vs_single(st, o, mask, o1, mask1)


@pytest.mark.parametrize("S", [1, 3])
def test_truncation_rows_without_truncation_and_top_logprobs(S):
    # A truncating batch whose other rows cut nothing: kept_mass exactly 0 and processed ==
    # logprobs exactly for them. Top logprobs on both paths (S = 3: the split path's stats).
    V = 900
    rows = [(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 0, 0.9, 0.0), (1.6, 0, 1.0, 0.0), (0.3, "V", 1.0, 0.0)]
    logits = trunc_logits(len(rows), V, torch.bfloat16, seed=2)
    kw = {"block_v": 512} if S == 1 else {"block_v": 128, "hist_block": 128}
    assert ft._row_chunks(V, S, 128 if S > 1 else 512)[0] == S  # 384, 384, 132
    for any_trunc in (True, False) if S == 1 else (True,):
        rs = rows if any_trunc else [r[:1] + (0, 1.0, 0.0) for r in rows]
        st = trunc_st(rs, V, seed=3, K=6, any_truncation=any_trunc)
        o = ft.fused_sample_full(logits, st, row_splits=S, **kw)
        ref = sample(logits, st)
        assert torch.equal(o.token_ids[st.temperature <= 0], ref.token_ids[st.temperature <= 0])
        none = torch.tensor([r[1] in (0, "V") and r[2] >= 1 and r[3] == 0 for r in rs])
        assert bool((o.kept_mass[none] == 0).all()) and torch.equal(o.processed_logprobs[none], o.logprobs[none])
        assert (o.logprobs - ref.logprobs).abs().max().item() <= LP_TOL
        # Values as the reference's topk; ids carry those values (row 0's tied maxima may come in
        # another index order than topk of the fp32 logprobs: same values, see fused_sample_full).
        assert (o.top_logprobs - ref.top_logprobs).abs().max().item() <= LP_TOL
        t = torch.where(st.temperature > 0, st.temperature, 1.0)[:, None]
        lp_full = torch.log_softmax(logits.float() / t, dim=-1)
        assert (lp_full.gather(1, o.top_ids) - o.top_logprobs).abs().max().item() <= LP_TOL
        assert torch.equal(o.top_ids[1:], ref.top_ids[1:])


@pytest.mark.parametrize("S", [1, 3])
def test_truncation_row_independent_of_batch(S):
    # A row's programs read only that row (and its own partials): its outputs are bit-identical
    # alone or in any batch, for a fixed row_splits.
    V = 700
    rows = TRUNC_ROWS[:6]
    logits = trunc_logits(len(rows), V, torch.bfloat16, seed=4)
    st = trunc_st(rows, V, seed=9)
    full = ft.fused_sample_full(logits, st, block_v=256, row_splits=S)  # S = 3: chunks 256, 256, 188
    assert ft._row_chunks(V, S, 256)[0] == S
    for r in (1, 5):
        one = ft.fused_sample_full(logits[r:r + 1], replace(st, **{f: getattr(st, f)[r:r + 1] for f in (
            "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seeds", "counters")}), block_v=256,
            row_splits=S)
        for f in ("token_ids", "logprobs", "processed_logprobs", "kept_mass"):
            assert getattr(one, f).item() == getattr(full, f)[r].item(), (r, f)


@pytest.mark.parametrize("S", [1, 4])
def test_truncation_masked_vocab_and_penalty_refused(S):
    # -inf logits (a masked vocabulary) are never kept by top-p / min-p and count as ties of
    # each other at the top-k boundary. S = 4 (chunks 3 x 128, 116): chunk 2 is all -inf (its max
    # partial is the finite -1e30 stand-in, its sum 0, its best score -inf). Penalty rows are the
    # torch path's.
    V = 500
    rows = [(1.0, 0, 0.999, 0.0), (1.0, 480, 1.0, 0.0), (0.0, 0, 1.0, 0.01), (0.8, 450, 0.95, 0.0)]
    logits = trunc_logits(len(rows), V, torch.bfloat16, seed=8)
    logits[:, 100:150] = float("-inf")
    logits[:, 256:384] = float("-inf")
    st = trunc_st(rows, V, seed=1)
    o, mask = run_trunc(logits, st, block_v=128, hist_block=128 if S > 1 else None, row_splits=S)
    assert ft._row_chunks(V, S, 128)[0] == S
    check_trunc(logits, st, o, mask)
    assert bool(mask[1, 100:150].all()) and not bool(mask[[0, 2], 100:150].any())
    assert bool(mask[1, 256:384].all()) and not bool(mask[[0, 2], 256:384].any())
    with pytest.raises(ValueError, match="penalty"):
        ft.fused_sample_full(logits, replace(st, any_penalty=True))


def test_compiles_for_sm90(tmp_path):
    """The interpreter runs kernels as Python and misses compile-time errors: compile the
    truncation kernels ahead of time for sm_90 with triton's bundled ptxas, in a subprocess without
    the interpreter (as tests/kernels/test_kernels_interpret.py). No GPU needed. Every radix step of bf16
    (4 top-k + 4 top-p digits), the first / last steps of fp32, both final-pass and merge variants."""
    code = textwrap.dedent("""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from rollout.kernels import fused_sampler as fs, fused_truncation as ft
        PTR = {"temp_ptr": "*fp32", "topk_ptr": "*i64", "topp_ptr": "*fp32", "minp_ptr": "*fp32", "seed_ptr": "*i64",
               "ctr_ptr": "*i64", "tok_ptr": "*i64", "lp_ptr": "*fp32", "plp_ptr": "*fp32", "km_ptr": "*fp32",
               "stats_ptr": "*fp32", "pf_ptr": "*fp32", "pi_ptr": "*i32", "cnt_ptr": "*i32", "mass_ptr": "*fp32",
               "state_ptr": "*i32", "fo_ptr": "*fp32", "io_ptr": "*i32", "mask_ptr": "*i8"}
        def compile_(fn, dtype="bf16", num_warps=8, **const):
            ptr = dict(PTR, logits_ptr="*" + dtype)
            sig = {n: "constexpr" if n in const else ptr.get(n, "i32") for n in fn.arg_names}
            attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in ptr}
            triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
        V = 151936
        split = dict(V=V, SPLITS=7, CHUNK=22528, BLOCK_S=8)
        compile_(fs._sample_kernel, SAMPLE=False, STATS=False, SPLITS=7, CHUNK=22528, BLOCK_V=1024)
        for dtype, ndig, shift, steps in (("bf16", 4, 16, range(8)), ("fp32", 8, 0, (0, 7, 8, 15))):
            for j in steps:
                compile_(ft._split_step_kernel, dtype, J=j, NDIG=ndig, SHIFT=shift, HBLOCK=256, **split)
        compile_(ft._split_final_kernel, SAMPLE=True, MASK=False, NDIG=4, SHIFT=16, BLOCK_V=1024, **split)
        compile_(ft._split_final_kernel, "fp32", SAMPLE=False, MASK=True, NDIG=8, SHIFT=0, BLOCK_V=1024, **split)
        for stats in (False, True):
            compile_(ft._split_merge_kernel, num_warps=1, V=V, STATS=stats, SPLITS=7, BLOCK_S=8)
            compile_(fs._merge_kernel, num_warps=1, STATS=stats, SPLITS=7, BLOCK_S=8)   # shares _merged_z
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from a cache hit
    r = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True,
                       timeout=300)
    if r.returncode != 0 and ("ptxas" in r.stderr and "not found" in r.stderr.lower()):
        pytest.skip("no ptxas in this triton install")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
