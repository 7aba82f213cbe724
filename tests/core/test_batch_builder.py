"""The batch builder's decode fast path (`BatchBuilder._build_decode`) against its general
path: on every step of mixed workloads (groups, stops, truncation, top logprobs, a penalty
request that forces the general path, preemption under a small KV cache), a shadow builder
with the fast path off gets the same SchedulerOutput, and every host buffer and flag must be
equal."""
import torch

from hf_reference import random_prompts
from rollout import RolloutEngine, SamplingParams
from rollout.batch import STEP_FIELDS, BatchBuilder, field_lengths


def _shadowed_engine(path, **kw):
    eng = RolloutEngine.from_pretrained(path, device="cpu", dtype="float32", max_model_len=256, page_size=16,
                                        seed=0, max_num_batched_tokens=128, **kw)
    # The engine turns an exception in a step into failed requests, so mismatches are recorded.
    stats = {"fast": 0, "general": 0, "compared": 0, "mismatches": []}
    for slot in eng.pipeline.slots:
        real = slot.builder
        T, S, P = real.dims
        shadow = BatchBuilder(real.kv, max_num_batched_tokens=T, max_num_seqs=S, max_pages_per_seq=P)
        shadow.fast_decode = False
        inner = real.build

        def build(sched, real=real, shadow=shadow, inner=inner):
            want = shadow.build(sched)
            got = inner(sched)
            fast = all(i.num_new == 1 and i.num_samples == 1 for i in sched.items) and not sched.copies \
                and not any(i.seq.request.params.repetition_penalty != 1.0 for i in sched.items)
            stats["fast" if fast else "general"] += 1
            lens = field_lengths(got.num_tokens, len(got.seq_lens_host), got.num_rows)
            bad = [] if (want.num_tokens, want.num_rows) == (got.num_tokens, got.num_rows) else ["sizes"]
            for name, (key, _) in STEP_FIELDS.items():
                n = lens[key] if not name.startswith("copy_") else len(sched.copies)
                if not torch.equal(real.host[name][:n], shadow.host[name][:n]):
                    bad.append(name)
            bad += [f for f in ("seq_lens_host", "query_start_host", "num_top_logprobs", "has_carry", "decode_only")
                    if getattr(got, f) != getattr(want, f)]
            bad += [f"sampling.{f}" for f in ("all_greedy", "any_truncation", "any_penalty", "num_top_logprobs")
                    if getattr(got.sampling, f) != getattr(want.sampling, f)]
            if bad:
                stats["mismatches"].append((sched.batch_id, bad))
            stats["compared"] += 1
            return got
        real.build = build
    return eng, stats


def test_fast_decode_path_writes_what_the_general_path_writes(model_dir, tiny_tokenizer):
    path = model_dir("llama")
    prompts = random_prompts(tiny_tokenizer, 10, 5, 40, seed=31)
    probe = RolloutEngine.from_pretrained(path, device="cpu", dtype="float32", max_model_len=256, seed=0)
    stop = probe.generate(prompts[:1], SamplingParams(max_new_tokens=12, temperature=0),
                          use_tqdm=False)[0].completions[0].token_ids[6]
    params = [SamplingParams(max_new_tokens=40, temperature=0, stop_token_ids=[stop]),
              SamplingParams(n=3, max_new_tokens=50, temperature=1.0, top_p=0.9, seed=7),
              SamplingParams(max_new_tokens=30, temperature=0.7, top_logprobs=3, seed=2),
              SamplingParams(n=2, max_new_tokens=60, temperature=1.0, min_p=0.05, seed=5),
              SamplingParams(max_new_tokens=45, temperature=0, ignore_eos=True)] * 2
    params[7] = SamplingParams(max_new_tokens=20, temperature=0.9, repetition_penalty=1.2, seed=4)
    # 24 usable pages of 16 tokens for ~14 sequences of up to ~100 tokens: preemption happens.
    eng, stats = _shadowed_engine(path, num_kv_pages=25, kv_reserve_fraction=0.0)
    outs = eng.generate(prompts, params, use_tqdm=False)
    assert stats["mismatches"] == []
    assert eng.scheduler.num_preemptions > 0 and eng.metrics["failed_steps"] == 0
    assert stats["fast"] > 20 and stats["general"] > 5 and stats["compared"] == stats["fast"] + stats["general"]
    # And the outputs are those of an engine that never takes the fast path.
    ref = RolloutEngine.from_pretrained(path, device="cpu", dtype="float32", max_model_len=256, page_size=16,
                                        seed=0, max_num_batched_tokens=128, num_kv_pages=25, kv_reserve_fraction=0.0)
    for slot in ref.pipeline.slots:
        slot.builder.fast_decode = False
    want = ref.generate(prompts, params, use_tqdm=False)
    for a, b in zip(outs, want):
        assert [c.token_ids for c in a.completions] == [c.token_ids for c in b.completions]
        assert [c.logprobs for c in a.completions] == [c.logprobs for c in b.completions]


def test_padding_rows_invalidate_cached_sampling_parameters(model_dir, tiny_tokenizer):
    """pad() writes inert parameters into rows past the batch; a later decode step that puts a
    sequence back in such a row must write its parameters again, not trust the row cache."""
    path = model_dir("llama")
    prompts = random_prompts(tiny_tokenizer, 4, 5, 20, seed=32)
    eng = RolloutEngine.from_pretrained(path, device="cpu", dtype="float32", max_model_len=256, seed=0)
    eng.add_requests(prompts, SamplingParams(max_new_tokens=30, temperature=0.5, top_p=0.8, seed=1))
    for _ in range(6):
        eng.step()
    builder = eng.pipeline.slots[0].builder
    sched = eng.scheduler.schedule()
    batch = builder.build(sched)
    assert batch.decode_only and batch.num_rows == 4
    builder.pad(batch, 8)
    assert builder.np["temperature"][4:8].tolist() == [0.0] * 4
    # Rows 0-3 keep their sequences; pretend rows 4-7 get the same sequences next: the cache
    # must not claim them.
    assert builder._param_rows[4:8] == [None] * 4
    assert all(builder._param_rows[i] is sched.items[i].seq for i in range(4))


def test_host_bench_times_every_stage():
    from rollout.bench import host
    r = host.main(["--prompts", "4", "--n", "2", "--prompt-len", "16", "--warmup", "3", "--steps", "5"])
    assert r["sequences"] == 8 and r["fast_decode"]
    assert set(r["median_ms"]) == {"schedule", "build", "rows", "update"}
    assert all(v > 0 for v in r["median_ms"].values())
    assert r["host_ms"] == sum(r["median_ms"].values())
