"""The contract check of the fused truncating sampler (`fused_sample_full`) against the torch
reference `rollout.sampler.sample`, shared by the CPU-interpreter and GPU tests (each justifies
its own tolerances). Imports no triton, so the interpreter test can set TRITON_INTERPRET first."""
from dataclasses import replace

import torch

from rollout.sampler import _truncation_mask, counter_uniform, sample


def bounded_masks(logits, st, mass_eps):
    """float64 reference masks at top_p -/+ mass_eps and min_p * (1 +/- mass_eps): a kept set
    between them differs from the reference only by rounding at the boundary."""
    x64 = logits.double() / torch.where(st.temperature > 0, st.temperature, 1.0).double()[:, None]
    p, mp = st.top_p.double(), st.min_p.double()
    on_p, on_m = p < 1, mp > 0
    tight = replace(st, top_p=torch.where(on_p, p - mass_eps, p), min_p=torch.where(on_m, mp * (1 + mass_eps), mp))
    loose = replace(st, top_p=torch.where(on_p, p + mass_eps, p), min_p=torch.where(on_m, mp * (1 - mass_eps), mp))
    return _truncation_mask(x64, tight), _truncation_mask(x64, loose), x64


def check_trunc(logits, st, o, mask, *, mass_eps, km_tol, lp_tol, near_tie):
    """Asserts the contract for truncating rows: the kernel's kept set `mask` within the rounding
    bounds (top-k alone exactly the reference's), kept_mass and processed logprobs against
    float64 over that kept set (exactly 0 / equal to logprobs when nothing is cut), the full
    logprob, greedy tokens exact, sampled tokens = Gumbel-max over the kept set up to fp32
    near-ties. Returns the reference output, its mask, the per-row mask mismatches, the rows whose
    kept set equals the reference's, the near-tie flips, and the kept_mass / logprob errors."""
    V = logits.shape[1]
    ref = sample(logits, st)
    greedy = st.temperature <= 0
    xt = logits.float() / torch.where(greedy, 1.0, st.temperature)[:, None]
    ref_mask = _truncation_mask(xt, st)
    tight, loose, x64 = bounded_masks(logits, st, mass_eps)
    assert bool((tight <= mask).all()), "kernel cut a token no rounding can cut"
    assert bool((mask <= loose).all()), "kernel kept a token no rounding can keep"
    only_k = (st.top_p >= 1) & (st.min_p <= 0)  # top-k alone is an integer rule: exact
    assert torch.equal(mask[only_k], ref_mask[only_k])
    lp64 = torch.log_softmax(x64, dim=-1)
    whole = mask.all(1)
    km64 = torch.where(whole, 0.0, torch.logsumexp(lp64.masked_fill(~mask, float("-inf")), 1))
    assert bool((o.kept_mass[whole] == 0).all()) and torch.equal(o.processed_logprobs[whole], o.logprobs[whole])
    km_err = (o.kept_mass.double() - km64).abs().max().item()
    assert km_err <= km_tol, km_err
    tok = o.token_ids
    assert bool(((tok >= 0) & (tok < V)).all()) and bool(mask.gather(1, tok[:, None]).all())
    lp_err = (o.logprobs - torch.log_softmax(xt, dim=-1).gather(1, tok[:, None])[:, 0]).abs().max().item()
    assert lp_err <= lp_tol, lp_err
    proc64 = lp64.gather(1, tok[:, None])[:, 0] - km64  # processed = logprob - kept_mass: both errors add
    assert (o.processed_logprobs.double() - proc64).abs().max().item() <= lp_tol + km_tol
    assert torch.equal(tok[greedy], ref.token_ids[greedy])
    gumbel = -torch.log(-torch.log(counter_uniform(st.seeds, st.counters, V)))
    score = (xt + torch.where(greedy[:, None], 0.0, gumbel)).masked_fill(~mask, float("-inf"))
    want = score.argmax(1)
    flip = tok != want
    if flip.any():
        gap = (score.gather(1, want[:, None]) - score.gather(1, tok[:, None]))[:, 0][flip]
        assert gap.abs().max().item() < near_tie, gap
    same_mask = (mask == ref_mask).all(1)
    assert torch.equal(want[same_mask], ref.token_ids[same_mask])
    return dict(ref=ref, ref_mask=ref_mask, tight=tight, loose=loose, km64=km64, same_mask=same_mask,
                mask_diff_per_row=(mask != ref_mask).sum(1), flips=int(flip.sum()), km_err=km_err, lp_err=lp_err)
