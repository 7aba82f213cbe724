"""Tests for rollout.sampler: the logprob contract, sampling correctness, the RNG.

Tolerances: everything is fp32. Where the sampler and the reference evaluate the very same
formula (logprobs vs log_softmax(x / T)) we allow 1e-6, about 2 ulp at |logprob| ~ 7-8
(and expect 0). Where the reference takes a different route to the same number
(transformers' warpers, then log_softmax of the -inf-masked scores, vs the sampler's
log_softmax(penalized / T)[tok] - kept_mass) rounding differs by a few ulp of values up
to ~20 in magnitude, so we allow 1e-5.
"""
from __future__ import annotations


import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from rollout.sampler import SamplingTensors, _to_uniform, counter_uniform, sample

TIGHT = 1e-6  # same formula, fp32
LOOSE = 1e-5  # different but equivalent fp32 computation


def f32(v: float) -> float:
    """Round a Python float to fp32, so the sampler and HF divide by the same T."""
    return torch.tensor(v, dtype=torch.float32).item()


def make_st(rows, num_top_logprobs=0, flags=None, pen_len=None, device="cpu"):
    """rows: list of dicts with t, k, p, minp, pen, ids (list), seed, counter."""
    def col(key, default, dtype):
        return torch.tensor([r.get(key, default) for r in rows], dtype=dtype, device=device)

    any_pen = any(r.get("pen", 1.0) != 1.0 for r in rows)
    L = pen_len if pen_len is not None else max([len(r.get("ids", [])) for r in rows] + [1])
    ids = torch.full((len(rows), L), -1, dtype=torch.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r.get("ids", []))] = torch.tensor(r.get("ids", []), dtype=torch.int64)
    st = SamplingTensors(
        temperature=col("t", 1.0, torch.float32),
        top_k=col("k", 0, torch.int64),
        top_p=col("p", 1.0, torch.float32),
        min_p=col("minp", 0.0, torch.float32),
        repetition_penalty=col("pen", 1.0, torch.float32),
        seeds=col("seed", 0, torch.int64),
        counters=col("counter", 0, torch.int64),
        penalty_token_ids=ids.to(device) if any_pen else None,
        num_top_logprobs=num_top_logprobs,
        all_greedy=all(r.get("t", 1.0) == 0 for r in rows),
        any_truncation=any(
            r.get("k", 0) > 0 or r.get("p", 1.0) < 1.0 or r.get("minp", 0.0) > 0 for r in rows
        ),
        any_penalty=any_pen,
    )
    for name, value in (flags or {}).items():
        setattr(st, name, value)
    return st


def random_rows(n, vocab, gen, seed_base=0):
    pick = lambda xs: xs[torch.randint(len(xs), (1,), generator=gen).item()]  # noqa: E731
    rows = []
    for i in range(n):
        nids = pick([0, 3, 12])
        rows.append(dict(
            t=f32(pick([0.0, 0.3, 0.7, 1.0, 1.6])),
            k=pick([0, 0, 1, 5, 40]),
            p=f32(pick([1.0, 1.0, 0.5, 0.9, 0.97])),
            minp=f32(pick([0.0, 0.0, 0.05, 0.3])),
            pen=f32(pick([1.0, 1.0, 1.3, 0.8])),
            ids=torch.randint(vocab, (nids,), generator=gen).tolist(),
            seed=seed_base + i * 7919,
            counter=pick([0, 5, 123456, 2**33 + 17]),
        ))
    return rows


def random_logits(n, vocab, gen, scale=3.0):
    return torch.randn(n, vocab, generator=gen) * scale


def hf_reference(x_row, r):
    """Warped scores [V] and log_softmax(penalized / T) [V] via transformers' own processors."""
    s = x_row.float()[None].clone()
    if r.get("pen", 1.0) != 1.0 and r.get("ids"):
        s = RepetitionPenaltyLogitsProcessor(r["pen"])(torch.tensor([r["ids"]]), s)
    t = r.get("t", 1.0)
    if t > 0 and t != 1.0:
        s = TemperatureLogitsWarper(t)(None, s)
    lp = torch.log_softmax(s, dim=-1)[0]
    if r.get("k", 0) > 0:
        s = TopKLogitsWarper(r["k"])(None, s)
    if r.get("p", 1.0) < 1.0:
        s = TopPLogitsWarper(r["p"])(None, s)
    if r.get("minp", 0.0) > 0:
        s = MinPLogitsWarper(r["minp"])(None, s)
    return s[0], lp


# 1 ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_logprobs_are_full_vocab_log_softmax(dtype):
    gen = torch.Generator().manual_seed(1)
    rows = random_rows(256, 1000, gen)
    logits = random_logits(256, 1000, gen).to(dtype)
    out = sample(logits, make_st(rows))
    t = torch.tensor([r["t"] if r["t"] > 0 else 1.0 for r in rows])[:, None]
    ref = torch.log_softmax(logits.float() / t, dim=-1).gather(1, out.token_ids[:, None])[:, 0]
    assert out.logprobs.dtype == torch.float32
    assert (out.logprobs - ref).abs().max().item() <= TIGHT


# 2 ----------------------------------------------------------------------------------
def test_processed_logprobs_and_kept_mass_match_transformers_warpers():
    gen = torch.Generator().manual_seed(2)
    rows = random_rows(600, 300, gen)
    logits = random_logits(600, 300, gen)
    out = sample(logits, make_st(rows))
    n_truncated = 0
    for i, r in enumerate(rows):
        warped, lp = hf_reference(logits[i], r)
        kept = torch.isfinite(warped)
        tok = out.token_ids[i].item()
        assert kept[tok], f"row {i}: sampled a removed token"
        ref_proc = torch.log_softmax(warped, dim=-1)[tok].item()
        ref_mass = 0.0 if kept.all() else torch.logsumexp(lp[kept], dim=0).item()
        n_truncated += int(not kept.all())
        assert abs(out.processed_logprobs[i].item() - ref_proc) <= LOOSE, i
        assert abs(out.kept_mass[i].item() - ref_mass) <= LOOSE, i
    assert n_truncated > 200  # the test really exercises truncation


# 3 ----------------------------------------------------------------------------------
def test_sampled_token_is_always_in_kept_set():
    gen = torch.Generator().manual_seed(3)
    n, vocab = 3000, 48
    rows = random_rows(n, vocab, gen, seed_base=11)
    for r in rows:  # sharper truncation so the removed set is large
        r["k"] = r["k"] or 4
        r["p"] = min(r["p"], f32(0.6))
    logits = random_logits(n, vocab, gen, scale=1.0)  # flat: removed tokens are likely
    out = sample(logits, make_st(rows))
    for i, r in enumerate(rows):
        warped, _ = hf_reference(logits[i], r)
        assert torch.isfinite(warped[out.token_ids[i]]), i
    assert torch.isfinite(out.processed_logprobs).all()
    assert (out.processed_logprobs <= 1e-6).all()  # a log-probability (fp32 slack)


# 4 ----------------------------------------------------------------------------------
@pytest.mark.parametrize("vary", ["counter", "seed"])
def test_empirical_distribution_matches_processed_distribution(vary):
    # n = 20000 draws over <= 12 kept tokens: the expected total variation is about
    # 0.5 * sum_i sqrt(2 p_i (1 - p_i) / (pi n)) <= ~0.01 with sd ~0.002, so TV < 0.02
    # is a > 5 sigma bound that still catches a wrong distribution (e.g. T or top_p
    # ignored moves TV by >> 0.05 here).
    gen = torch.Generator().manual_seed(4)
    vocab, n = 12, 20000
    row = torch.randn(vocab, generator=gen) * 1.5
    r = dict(t=f32(0.7), p=f32(0.9))
    ids = torch.arange(n)
    seeds = ids * 0 + 1234 if vary == "counter" else ids * 104729 % 2**31
    counters = ids + 100 if vary == "counter" else ids * 0 + 42
    rows = [dict(r, seed=int(s), counter=int(c)) for s, c in zip(seeds, counters)]
    out = sample(row.expand(n, vocab), make_st(rows))
    warped, _ = hf_reference(row, r)
    target = torch.softmax(warped, dim=-1).double()
    emp = torch.bincount(out.token_ids, minlength=vocab).double() / n
    assert (target > 0).sum() < vocab  # top_p really removed something
    assert emp[target == 0].sum() == 0
    assert 0.5 * (emp - target).abs().sum().item() < 0.02


# 5 ----------------------------------------------------------------------------------
def test_row_result_is_independent_of_batch():
    gen = torch.Generator().manual_seed(5)
    vocab = 500
    mine = dict(t=f32(0.9), k=50, p=f32(0.95), seed=987654, counter=321)
    my_logits = random_logits(1, vocab, gen)
    others_a = random_rows(4, vocab, gen, seed_base=1)
    others_b = random_rows(8, vocab, gen, seed_base=2)
    for r in others_b:
        r["pen"] = f32(1.2)  # batch B takes the penalty path, batch A need not
    la, lb = random_logits(5, vocab, gen), random_logits(9, vocab, gen)
    la[1], lb[6] = my_logits[0], my_logits[0]
    rows_a = others_a[:1] + [mine] + others_a[1:]
    rows_b = others_b[:6] + [mine] + others_b[6:]
    oa, ob = sample(la, make_st(rows_a)), sample(lb, make_st(rows_b, num_top_logprobs=3))
    alone = sample(my_logits, make_st([mine]))
    for field in ("token_ids", "logprobs", "processed_logprobs", "kept_mass"):
        a, b, c = getattr(oa, field)[1], getattr(ob, field)[6], getattr(alone, field)[0]
        assert torch.equal(a, b) and torch.equal(a, c), field
    # Different seeds (same logits and counter) must give different draws.
    flat = torch.zeros(200, vocab)
    out = sample(flat, make_st([dict(seed=s, counter=7) for s in range(200)]))
    assert out.token_ids.unique().numel() > 100  # ~165 distinct expected for 200 of 500


# 6 ----------------------------------------------------------------------------------
def test_greedy_is_argmax_of_penalized_logits():
    gen = torch.Generator().manual_seed(6)
    vocab = 200
    rows = random_rows(128, vocab, gen)
    for r in rows:
        r["t"] = 0.0
    logits = random_logits(128, vocab, gen)
    logits[0, 10] = logits[0, 20] = logits[0].max() + 1  # tie: first index wins
    rows[0].update(pen=1.0, k=2, p=f32(0.1))
    out = sample(logits, make_st(rows))
    pen = torch.stack([
        RepetitionPenaltyLogitsProcessor(r["pen"])(torch.tensor([r["ids"]]), logits[i : i + 1])[0]
        if r["pen"] != 1.0 and r["ids"] else logits[i]
        for i, r in enumerate(rows)
    ])
    assert torch.equal(out.token_ids, pen.argmax(dim=-1))
    assert out.token_ids[0].item() == 10
    ref = torch.log_softmax(logits, dim=-1).gather(1, out.token_ids[:, None])[:, 0]
    assert (out.logprobs - ref).abs().max().item() <= TIGHT  # greedy uses T = 1


def _assert_same(a, b):
    for field in ("token_ids", "logprobs", "processed_logprobs", "kept_mass", "top_ids", "top_logprobs"):
        x, y = getattr(a, field), getattr(b, field)
        assert (x is None and y is None) or torch.equal(x, y), field


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_paths_equal_full_path(dtype):
    gen = torch.Generator().manual_seed(7)
    vocab, n = 300, 64
    logits = random_logits(n, vocab, gen).to(dtype)
    ids = [torch.randint(vocab, (5,), generator=gen).tolist() for _ in range(n)]
    full = dict(all_greedy=False, any_truncation=True, any_penalty=True)
    # Sampled rows, no truncation/penalty active: the full path (with a penalty id tensor
    # whose penalties are all 1.0) must match the fast path bit for bit.
    rows = [dict(t=f32(0.5 + i / n), seed=i, counter=i * 3, ids=ids[i]) for i in range(n)]
    fast_st = make_st(rows, num_top_logprobs=4)
    assert not fast_st.any_truncation and not fast_st.any_penalty
    slow_st = make_st(rows, num_top_logprobs=4, flags=full)
    slow_st.penalty_token_ids = make_st([dict(r, pen=f32(1.5)) for r in rows]).penalty_token_ids
    _assert_same(sample(logits, fast_st), sample(logits, slow_st))
    # All greedy (with penalties and truncation active): all_greedy skips the noise only.
    rows = [dict(t=0.0, k=7, p=f32(0.8), pen=f32(1.4), ids=ids[i], seed=i) for i in range(n)]
    fast_st = make_st(rows)
    assert fast_st.all_greedy
    _assert_same(sample(logits, fast_st), sample(logits, make_st(rows, flags=full)))


# 7 ----------------------------------------------------------------------------------
def test_top_logprobs_are_topk_of_full_log_softmax():
    gen = torch.Generator().manual_seed(8)
    rows = random_rows(64, 400, gen)
    logits = random_logits(64, 400, gen).bfloat16()
    out = sample(logits, make_st(rows, num_top_logprobs=5))
    t = torch.tensor([r["t"] if r["t"] > 0 else 1.0 for r in rows])[:, None]
    ref_vals, ref_ids = torch.topk(torch.log_softmax(logits.float() / t, dim=-1), 5, dim=-1)
    assert out.top_ids.shape == (64, 5) and out.top_ids.dtype == torch.int64
    assert (out.top_logprobs - ref_vals).abs().max().item() <= TIGHT
    assert torch.equal(out.top_ids, ref_ids)
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    assert sample(logits, make_st(rows)).top_ids is None


# 8 ----------------------------------------------------------------------------------
def test_counter_uniform():
    seeds = torch.arange(1000, dtype=torch.int64) * 7 + 3
    counters = torch.arange(1000, dtype=torch.int64) % 17
    u = counter_uniform(seeds, counters, 1000, "cpu")
    assert u.shape == (1000, 1000) and u.dtype == torch.float32
    assert (u > 0).all() and (u < 1).all()
    # 1e6 draws: sd(mean) = 0.289 / 1000, so +-0.002 is ~7 sigma; each of 20 bins holds
    # 50000 +- 218, allow 5 sigma.
    assert abs(u.double().mean().item() - 0.5) < 0.002
    hist = torch.histc(u, bins=20, min=0, max=1)
    assert (hist - 50000).abs().max().item() < 5 * 218
    # Adjacent vocab entries and adjacent counters are uncorrelated (sd of r ~ 1e-3).
    c = lambda a, b: torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].abs()  # noqa: E731
    assert c(u[:, :-1], u[:, 1:]) < 0.01
    v = counter_uniform(seeds, counters + 1, 1000, "cpu")
    assert c(u, v) < 0.01
    assert torch.equal(u, counter_uniform(seeds, counters, 1000, "cpu"))  # deterministic
    assert torch.equal(u[500:510], counter_uniform(seeds[500:510], counters[500:510], 1000))
    # The extremes of the 32-bit hash map strictly inside (0, 1).
    ext = _to_uniform(torch.tensor([0, 255, 256, 0xFFFFFFFF], dtype=torch.int64))
    assert (ext > 0).all() and (ext < 1).all()
    assert torch.isfinite(-torch.log(-torch.log(ext))).all()


# 9 ----------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
def test_cuda_matches_cpu():
    gen = torch.Generator().manual_seed(9)
    rows = random_rows(256, 2000, gen)
    logits = random_logits(256, 2000, gen)
    cpu = sample(logits, make_st(rows, num_top_logprobs=3))
    gpu = sample(logits.cuda(), make_st(rows, num_top_logprobs=3, device="cuda"))
    assert torch.equal(cpu.token_ids, gpu.token_ids.cpu())
    seeds, counters = torch.arange(64) * 31, torch.arange(64) + 2**32
    assert torch.equal(counter_uniform(seeds, counters, 2000),
                       counter_uniform(seeds.cuda(), counters.cuda(), 2000).cpu())
    for field in ("logprobs", "processed_logprobs", "kept_mass"):
        diff = (getattr(cpu, field) - getattr(gpu, field).cpu()).abs().max().item()
        assert diff <= LOOSE, field
