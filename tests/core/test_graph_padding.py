"""What a decode CUDA graph relies on, checked on CPU: batch-size buckets, the sampling-mode
key, and bucket padding. Padded decode batches (inert rows up to the bucket size, as a graph
replays them) must give exactly the tokens and logprobs of unpadded ones."""
from hf_reference import random_prompts
from rollout import RolloutEngine, SamplingParams
from rollout.graphs import default_buckets, mode_of


def test_default_buckets_cover_every_batch_size():
    for top in (1, 3, 8, 64, 100, 256, 1000):
        b = default_buckets(top)
        assert b == sorted(set(b)) and b[0] == 1 and b[-1] == top
        # every batch size has a bucket; padding adds < 8 rows up to 64, < 1/4 of the bucket beyond
        for rows in range(1, top + 1):
            fit = next(x for x in b if x >= rows)
            assert fit - rows <= max(7, fit // 4)


def test_mode_of():
    assert mode_of(True, False) == "greedy"
    assert mode_of(False, False) == "sample"
    assert mode_of(True, True) == mode_of(False, True) == "truncate"


def _engine(path):
    return RolloutEngine.from_pretrained(path, device="cpu", dtype="float32", max_model_len=256, page_size=16,
                                         num_kv_pages=256, max_num_batched_tokens=256, max_num_seqs=16, seed=0)


def _pad_graph_safe_batches(eng, sizes):
    """Make the CPU pipeline pad decode batches the way the CUDA graph path does."""
    padded = []
    for slot in eng.pipeline.slots:
        builder, build = slot.builder, slot.builder.build

        def padding_build(sched, builder=builder, build=build):
            batch = build(sched)
            if batch.graph_safe:
                size = next(x for x in sizes if x >= batch.num_rows)
                builder.pad(batch, size)
                padded.append((batch.num_rows, size))
            return batch
        builder.build = padding_build
    return padded


def test_padded_decode_batches_equal_unpadded(model_dir, tiny_tokenizer):
    path = model_dir("llama")
    prompts = random_prompts(tiny_tokenizer, 5, 5, 40, seed=4)
    params = [SamplingParams(max_new_tokens=12 + 3 * i, temperature=0) for i in range(3)] + \
             [SamplingParams(n=2, max_new_tokens=15, temperature=1.0, seed=5),
              SamplingParams(max_new_tokens=10, temperature=0.7, top_p=0.8, seed=9)]
    ref = _engine(path).generate(prompts, params, use_tqdm=False)
    eng = _engine(path)
    padded = _pad_graph_safe_batches(eng, [4, 8, 16])
    got = eng.generate(prompts, params, use_tqdm=False)
    assert any(size > rows for rows, size in padded), "no batch was actually padded"
    for x, y in zip(ref, got):
        for cx, cy in zip(x.completions, y.completions):
            assert cx.token_ids == cy.token_ids
            # Padding rows are extra GEMM rows and extra attention rows; the real rows' math is
            # unchanged, so fp32 logprobs agree to rounding (1e-5, as everywhere in fp32).
            assert max(abs(a - b) for a, b in zip(cx.logprobs, cy.logprobs)) < 1e-5
    # Padding writes only to the trash page; every real page is back in the free list.
    assert eng.kv.alloc.num_used == 0
