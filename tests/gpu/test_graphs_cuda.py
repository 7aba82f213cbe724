"""Decode CUDA graphs on the GPU: replay equals eager execution, sync equals async with
graphs, no host sync in a launch, and the second slot's graphs add little memory thanks to
the shared pool. Skipped without CUDA."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from rollout import RolloutEngine, SamplingParams  # noqa: E402
from rollout.graphs import DecodeGraphs  # noqa: E402


def _config():
    from transformers import AutoConfig
    return AutoConfig.for_model("llama", vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)


def _engine(graphs, dtype="bfloat16", async_pipeline=True, **kw):
    return RolloutEngine.from_config(_config(), seed=0, device="cuda", dtype=dtype, max_model_len=512,
                                     num_kv_pages=512, max_num_batched_tokens=1024, max_num_seqs=32,
                                     async_pipeline=async_pipeline, cuda_graphs=graphs, **kw)


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 4000, (int(L),), generator=g).tolist() for L in torch.randint(4, 120, (n,), generator=g)]


@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=1.0, seed=3),
                                    dict(temperature=1.0, top_p=0.9, seed=3)], ids=["greedy", "sample", "truncate"])
def test_graph_replay_equals_eager_bitwise(params):
    # 8 sequences decoding in lockstep: every decode step has exactly 8 rows, a bucket size, so
    # the graph runs the very kernels eager execution runs on the same shapes: equal bits.
    prompts = _prompts(8)
    p = SamplingParams(max_new_tokens=48, ignore_eos=True, **params)
    outs = {}
    for graphs in (False, True):
        eng = _engine(graphs)
        outs[graphs] = eng.generate(prompts, p, use_tqdm=False)
        assert (eng.pipeline.counts["graph_steps"] > 0) == graphs
    for a, b in zip(outs[False], outs[True]):
        assert a.completions[0].token_ids == b.completions[0].token_ids
        assert a.completions[0].logprobs == b.completions[0].logprobs


def test_padded_graph_replay_matches_eager_fp32():
    # Mixed lengths, stops and group sizes: decode batches shrink and get padded to buckets.
    # fp32 (no TF32): padded GEMMs may pick other kernels, so logprobs agree to ~1e-6 and tokens
    # exactly; 1e-4 leaves room for the longest contexts here.
    prompts = _prompts(12, seed=1)
    probe = _engine(False, dtype="float32").generate(prompts[:1], SamplingParams(max_new_tokens=16, temperature=0),
                                                     use_tqdm=False)
    stop = probe[0].completions[0].token_ids[4]
    params = [SamplingParams(n=1 + i % 3, max_new_tokens=8 + 7 * i, stop_token_ids=[stop] if i % 2 else [],
                             temperature=0 if i % 4 else 1.0, seed=i) for i in range(len(prompts))]
    outs, stats = {}, {}
    for graphs in (False, True):
        eng = _engine(graphs, dtype="float32")
        outs[graphs] = eng.generate(prompts, params, use_tqdm=False)
        eng.drain()
        stats[graphs] = dict(eng.pipeline.counts)
        assert eng.kv.alloc.num_used == 0
    assert stats[True]["graph_steps"] > 0 and stats[False]["graph_steps"] == 0
    for a, b in zip(outs[False], outs[True]):
        for ca, cb in zip(a.completions, b.completions):
            assert ca.token_ids == cb.token_ids and ca.finish_reason == cb.finish_reason
            assert max(abs(x - y) for x, y in zip(ca.logprobs, cb.logprobs)) < 1e-4


def test_sync_and_async_identical_with_graphs():
    prompts = _prompts(10, seed=2)
    params = [SamplingParams(n=1 + i % 2, max_new_tokens=10 + 5 * i, temperature=1.0, top_p=0.9, seed=i)
              for i in range(len(prompts))]
    outs = {}
    for mode in (False, True):
        eng = _engine(True, async_pipeline=mode)
        outs[mode] = eng.generate(prompts, params, use_tqdm=False)
        assert eng.pipeline.counts["graph_steps"] > 0
    for a, b in zip(outs[False], outs[True]):
        for ca, cb in zip(a.completions, b.completions):
            assert ca.token_ids == cb.token_ids and ca.logprobs == cb.logprobs


def test_launch_makes_no_host_sync():
    eng = _engine(True)
    ids = eng.add_requests(_prompts(16, seed=3), SamplingParams(max_new_tokens=40, temperature=1.0, seed=1,
                                                               ignore_eos=True))
    launch = eng.pipeline.launch
    checked = 0

    def strict_launch(sched):
        nonlocal checked
        # Steady decode only (prefill uploads a penalty-free batch too, but warm-up compiles).
        if all(i.num_new == 1 for i in sched.items):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return launch(sched)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                checked += 1
        return launch(sched)

    eng.pipeline.launch = strict_launch
    done = set()
    while len(done) < len(ids):
        done |= {o.request_id for o in eng.step()}
    assert checked > 20


def test_second_slot_graphs_cost_little_memory():
    # Graph memory is what the capture reserves for its private pool (allocator stats of
    # tensors inside a capture are not a reliable measure). With one shared pool, the second
    # slot's graphs reuse the first slot's blocks: they run one at a time on one stream.
    eng = _engine(False)       # no graphs yet: capture them by hand, one slot then both
    reserved = {}
    # A first, unmeasured capture: one-time reservations (cuBLAS's workspace on the compute
    # stream, ~32 MiB) would otherwise land in whichever measurement runs first.
    for slots in ((0,), (0,), (0, 1)):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        graphs = DecodeGraphs(eng.pipeline._static_step, eng.pipeline.compute, [1, 8, 16, 32])
        graphs.capture(progress=False, slots=slots)
        torch.cuda.synchronize()
        reserved[slots] = torch.cuda.memory_reserved() - before
        del graphs
    print("graph pool reserved bytes", reserved)
    assert reserved[(0,)] > 0
    assert reserved[(0, 1)] <= 1.1 * reserved[(0,)]
