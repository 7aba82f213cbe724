"""The prefix cache on the GPU under batch_invariant=True: a cached prefix is a prefill split at a
page boundary and its KV was written by another sequence's step, and batch-invariant kernels give
the same bits either way, so outputs with the cache equal outputs without it bit for bit: shared
prefixes across requests, whole prompts cached, a GRPO group of 4-turn trajectories
(rollout.multiturn), greedy and seeded sampling. Skipped without CUDA."""
import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class _Observations:
    def __init__(self, i, k):
        self.rng = random.Random(i * 1000 + k)

    def step(self, traj):
        return [self.rng.randrange(10, 4000) for _ in range(40)], 0.0, False


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cache_on_equals_cache_off_bit_for_bit(monkeypatch, temperature):
    import rollout.layers.attention as attention
    from rollout import RolloutEngine, SamplingParams
    from rollout.bench.pressure import random_model
    from rollout.bench.shapes import make_config
    from rollout.multiturn import run_trajectories
    monkeypatch.setattr(attention, "INVARIANT_SPLIT_LEN", 128)     # contexts of up to ~600 fold several splits
    cfg = make_config("tiny")
    model = random_model(cfg, torch.bfloat16, torch.device("cuda"), seed=0)
    g = torch.Generator().manual_seed(1)
    head = torch.randint(10, 4000, (70,), generator=g).tolist()
    prompts = [head + torch.randint(10, 4000, (int(n),), generator=g).tolist()
               for n in torch.randint(5, 100, (12,), generator=g)]
    p = SamplingParams(max_new_tokens=64, temperature=temperature, seed=7, ignore_eos=True)
    group = SamplingParams(n=4, max_new_tokens=64, temperature=temperature, seed=8, ignore_eos=True)
    runs = []
    for caching in (True, False):
        eng = RolloutEngine(model, cfg, max_model_len=1024, max_num_seqs=48, num_kv_pages=2048, seed=0,
                            batch_invariant=True, enable_prefix_caching=caching)
        outs = eng.generate(prompts[:6], p, use_tqdm=False)
        outs += eng.generate(prompts[6:] + prompts[:2], p, use_tqdm=False)     # shared head; whole prompts cached
        trajs = run_trajectories(eng, prompts[:2], _Observations, group, max_turns=4)
        runs.append(([(c.token_ids, c.logprobs) for o in outs for c in o.completions],
                     [(t.token_ids, t.logprobs) for t in trajs], eng.stats()))
        assert eng.kv.alloc.num_used == 0
    (outs_on, trajs_on, st_on), (outs_off, trajs_off, st_off) = runs
    assert st_on["prefix_cache_hit_tokens"] > 0 and st_on["prefill_tokens"] < st_off["prefill_tokens"]
    assert outs_on == outs_off          # tokens and bit-equal float logprobs
    assert trajs_on == trajs_off
