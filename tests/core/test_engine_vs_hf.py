"""The engine core against HF transformers on the same weights, every family, fp32 CPU:
greedy tokens, the logprob contract, seeded reproducibility, stops."""
import pytest
import torch
from transformers.generation.logits_process import TopPLogitsWarper

from hf_reference import hf_logits, hf_token_logprobs, random_prompts
from hf_reference import assert_greedy_matches_hf, cpu_engine
from rollout import SamplingParams

# fp32 everywhere; our incremental (paged, decode) forward and HF's full forward differ
# only in reduction order: measured max |Δlogp| ~5e-6 on these models (|logits| up to ~6),
# while HF's own fp32 forward is ~4e-6 away from an fp64 forward of the same weights.
LOGP_TOL = 1e-5
# Greedy steps whose top-2 logit gap is below this are near-ties that fp32 reduction
# order (~1e-6) cannot flip; comparing past the first smaller gap would test noise.
TIE_MARGIN = 1e-4


_engine = cpu_engine


@pytest.mark.parametrize("n", [1, 4])
def test_greedy_equals_hf_generate(family_model_dir, tiny_tokenizer, n):
    family, path = family_model_dir
    prompts = random_prompts(tiny_tokenizer, 5, 3, 70, seed=1)     # mixed lengths in one batch
    M = 40
    outs = _engine(path).generate(prompts, SamplingParams(n=n, max_new_tokens=M, temperature=0, ignore_eos=True),
                                  use_tqdm=False)
    assert_greedy_matches_hf(path, prompts, outs, M, n, TIE_MARGIN)


def _truncated_reference(logits: torch.Tensor, T: float, top_p: float):
    """log-probs of HF's top-p warper over logits / T, and the log kept mass."""
    scaled = logits / T
    warped = TopPLogitsWarper(top_p)(None, scaled.clone())
    full = torch.log_softmax(scaled, -1)
    kept = torch.isfinite(warped)
    return torch.log_softmax(warped, -1), torch.logsumexp(full.masked_fill(~kept, float("-inf")), -1), kept


def test_sampled_logprobs_match_hf_recompute(family_model_dir, tiny_tokenizer):
    family, path = family_model_dir
    prompts = random_prompts(tiny_tokenizer, 4, 5, 60, seed=2)
    T, top_p = 0.7, 0.9
    outs = _engine(path).generate(
        prompts, SamplingParams(n=2, max_new_tokens=30, temperature=T, top_p=top_p, seed=123, ignore_eos=True),
        use_tqdm=False)
    truncated_rows = 0
    for p, o in zip(prompts, outs):
        for c in o.completions:
            ref = hf_token_logprobs(path, p, c.token_ids, temperature=T)
            assert (ref - torch.tensor(c.logprobs)).abs().max().item() <= LOGP_TOL
            logits = hf_logits(path, p + c.token_ids)[len(p) - 1:-1].float()
            proc, kept_mass, kept = _truncated_reference(logits, T, top_p)
            tok = torch.tensor(c.token_ids)
            assert kept[torch.arange(len(tok)), tok].all(), "sampled a token top-p removed"
            got_proc = torch.tensor(c.processed_logprobs)
            assert (proc.gather(1, tok[:, None])[:, 0] - got_proc).abs().max().item() <= LOGP_TOL
            assert (kept_mass - torch.tensor(c.kept_mass)).abs().max().item() <= LOGP_TOL
            truncated_rows += int((kept_mass < -1e-4).sum())
    assert truncated_rows > 0       # top-p really truncated somewhere


def test_seeded_sampling_independent_of_batch(model_dir, tiny_tokenizer):
    path = model_dir("qwen2")
    target = random_prompts(tiny_tokenizer, 1, 20, 20, seed=3)[0]
    others = random_prompts(tiny_tokenizer, 6, 5, 80, seed=4)
    p = SamplingParams(n=3, max_new_tokens=25, temperature=1.0, top_p=0.95, seed=42, ignore_eos=True)
    noisy = SamplingParams(n=2, max_new_tokens=30, temperature=0.8, ignore_eos=True)  # unseeded neighbours
    alone = _engine(path).generate([target], p, use_tqdm=False)[0]
    crowd = _engine(path, max_num_batched_tokens=64).generate(
        others[:3] + [target] + others[3:], [noisy] * 3 + [p] + [noisy] * 3, use_tqdm=False)[3]
    for a, b in zip(alone.completions, crowd.completions):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= LOGP_TOL
    assert len({tuple(c.token_ids) for c in alone.completions}) > 1   # samples of a group differ
    other_seed = _engine(path).generate([target], SamplingParams(**{**p.__dict__, "seed": 43}), use_tqdm=False)[0]
    assert other_seed.completions[0].token_ids != alone.completions[0].token_ids


def test_stop_token_ids_and_length(model_dir, tiny_tokenizer):
    path = model_dir("llama")
    eng = _engine(path)
    prompt = random_prompts(tiny_tokenizer, 1, 12, 12, seed=5)[0]
    base = eng.generate([prompt], SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].completions[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 30
    stop_id = base.token_ids[6]
    first = base.token_ids.index(stop_id)
    c = eng.generate([prompt], SamplingParams(max_new_tokens=30, temperature=0, stop_token_ids=[stop_id]),
                     use_tqdm=False)[0].completions[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop_id
    assert c.token_ids == base.token_ids[:first + 1]      # the stop token is kept, nothing after
    assert eng.kv.alloc.num_used == 0


def test_stop_strings(model_dir, tiny_tokenizer):
    path = model_dir("qwen3")
    eng = _engine(path)
    prompt = random_prompts(tiny_tokenizer, 1, 10, 10, seed=6, from_text=True)[0]
    base = eng.generate([prompt], SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].completions[0]
    text = base.text
    assert len(text) > 12
    stop = text[8:11]                       # may span a token boundary
    cut = text.find(stop)
    c = eng.generate([prompt], SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True, stop=[stop]),
                     use_tqdm=False)[0].completions[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[:cut]            # text ends before the stop string
    assert c.token_ids == base.token_ids[:len(c.token_ids)] and len(c.token_ids) < len(base.token_ids)
    decoded = tiny_tokenizer.decode(c.token_ids, skip_special_tokens=True)
    assert stop in decoded and stop not in tiny_tokenizer.decode(c.token_ids[:-1], skip_special_tokens=True)


def test_sharded_checkpoint_and_top_logprobs(model_dir, sharded_model_dir, tiny_tokenizer):
    prompts = random_prompts(tiny_tokenizer, 2, 8, 30, seed=8)
    p = SamplingParams(max_new_tokens=10, temperature=0, top_logprobs=3, ignore_eos=True)
    a = _engine(model_dir("llama")).generate(prompts, p, use_tqdm=False)
    b = _engine(sharded_model_dir).generate(prompts, p, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.completions[0].token_ids == y.completions[0].token_ids
        assert x.completions[0].logprobs == y.completions[0].logprobs
        tops = x.completions[0].top_logprobs
        assert len(tops) == 10 and all(len(t) == 3 for t in tops)
        for t, tok, lp in zip(tops, x.completions[0].token_ids, x.completions[0].logprobs):
            best = max(t, key=t.get)
            assert best == tok and abs(t[best] - lp) < 1e-6    # greedy = top-1


@pytest.mark.parametrize("shape", ["llama3-8b", "qwen2.5-0.5b"])
def test_bf16_model_keeps_fp32_rope_frequencies(shape):
    """Casting the model to bf16 must not round the RoPE frequencies (a bf16 inv_freq puts
    angles ~1 rad off by position 300)."""
    from rollout.bench.shapes import make_config
    from rollout.models.decoder import rope_inv_freq
    from rollout.models.loader import build_model
    cfg = make_config(shape, num_hidden_layers=1, hidden_size=256, intermediate_size=256, vocab_size=512,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    model = build_model(cfg, torch.bfloat16, torch.device("cpu"))
    want = rope_inv_freq(cfg, 128)
    assert model.inv_freq.dtype == torch.float32 and torch.equal(model.inv_freq, want)
    assert not torch.equal(want.bfloat16().float(), want)     # the check can fail
