"""The one-step-lag pipeline on CPU: carry-over map and gather, slot alternation, the
finished-in-N case, and equality with a loop that has no lag."""
import torch

from hf_reference import random_prompts
from rollout import RolloutEngine, SamplingParams
from rollout.runner import apply_carry_over, carry_penalty_ids


def _engine(path, **kw):
    kw.setdefault("num_kv_pages", 256)
    kw.setdefault("max_num_batched_tokens", 256)
    return RolloutEngine.from_pretrained(path, device="cpu", dtype="float32", max_model_len=256,
                                         page_size=16, seed=0, **kw)


def test_carry_over_gather_selects_previous_rows_and_spare_zero():
    prev = torch.tensor([11, 22, 33, 0])            # 3 rows + the never-written spare entry
    ids = torch.tensor([5, 0, 7, 0, 0])
    carry = torch.tensor([-1, 2, -1, 0, 1])
    assert apply_carry_over(ids, carry, prev).tolist() == [5, 33, 7, 11, 22]
    # Idempotent: a second application changes nothing.
    once = apply_carry_over(ids, carry, prev)
    assert torch.equal(apply_carry_over(once, carry, prev), once)
    pen = torch.tensor([[4, -2 - 1, -1], [-2 - 2, 9, -1]])
    assert carry_penalty_ids(pen, prev).tolist() == [[4, 22, -1], [33, 9, -1]]


def _no_lag_generate(eng, prompts, params):
    """Reference loop: schedule, run and process each batch before scheduling the next."""
    ids = eng.add_requests(prompts, params)
    done = {}
    while eng.scheduler.has_work():
        sched = eng.scheduler.schedule()
        out = eng.pipeline.wait(eng.pipeline.launch(sched))
        for r in eng.scheduler.update_columns(sched, *eng._columns(out, 0)):
            done[r.request_id] = eng._finish(r)
    return [done[i] for i in ids]


def _mixed_params(stop_id):
    return [SamplingParams(max_new_tokens=24, temperature=0, stop_token_ids=[stop_id]),
            SamplingParams(n=3, max_new_tokens=20, temperature=1.0, top_p=0.9, seed=7),
            SamplingParams(max_new_tokens=9, temperature=0.8, seed=3, repetition_penalty=1.3),
            SamplingParams(n=2, max_new_tokens=30, temperature=0, stop_token_ids=[stop_id])]


def test_lagged_pipeline_equals_no_lag_loop(model_dir, tiny_tokenizer):
    path = model_dir("qwen2")
    prompts = random_prompts(tiny_tokenizer, 4, 5, 50, seed=21)
    # A stop id that greedy decoding of prompt 0 actually emits, so a request finishes
    # in batch N while batch N+1 (already launched) still carries it.
    probe = _engine(path).generate(prompts[:1], SamplingParams(max_new_tokens=24, temperature=0), use_tqdm=False)
    stop_id = probe[0].completions[0].token_ids[5]
    params = _mixed_params(stop_id)
    lagged = _engine(path)
    a = lagged.generate(prompts, params, use_tqdm=False)
    b = _no_lag_generate(_engine(path), prompts, params)
    for x, y in zip(a, b):
        for cx, cy in zip(x.completions, y.completions):
            assert cx.token_ids == cy.token_ids and cx.finish_reason == cy.finish_reason
            # Same tokens through different batch shapes: fp32 noise only.
            assert max(abs(p - q) for p, q in zip(cx.logprobs, cy.logprobs)) < 1e-5
    assert a[0].completions[0].finish_reason == "stop" and a[0].completions[0].token_ids[-1] == stop_id
    # The finished-in-N rows of batch N+1 were computed and thrown away, never output.
    assert lagged.scheduler.num_discarded_tokens > 0
    assert all(len(c.logprobs) == len(c.token_ids) for o in a for c in o.completions)
    assert lagged.kv.alloc.num_used == 0


def test_slots_alternate_and_carry_comes_from_the_other_slot(model_dir, tiny_tokenizer):
    eng = _engine(model_dir("llama"))
    prompts = random_prompts(tiny_tokenizer, 2, 6, 12, seed=2)
    eng.add_requests(prompts, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))
    seen_slots, carries = [], 0
    orig_build = [s.builder.build for s in eng.pipeline.slots]

    def spy(i):
        def build(sched):
            seen_slots.append(i)
            batch = orig_build[i](sched)
            nonlocal carries
            carries += int((batch.carry >= 0).sum())
            return batch
        return build
    for i, s in enumerate(eng.pipeline.slots):
        s.builder.build = spy(i)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert seen_slots == [i % 2 for i in range(len(seen_slots))]
    # Every decode input after the first token came through carry-over.
    assert carries == sum(len(o.completions[0].token_ids) - 1 for o in outs)
