"""Qwen3-MoE, Qwen2-MoE and Mixtral on CPU in fp32 against HF transformers on the same weights: greedy tokens,
sampled logprobs, routed experts (R3) at every position under groups, chunked prefill, preemption and
the prefix cache; loading, random weights, weight updates under both HF naming schemes, bad input, the
parquet job column, the native /generate route and TRL's GRPOTrainer with our generator."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from hf_reference import (BOS_ID, EOS_ID, MODEL_VOCAB_SIZE, PAD_ID, _randomize_extra_params, build_tiny_tokenizer,
                          hf_token_logprobs, load_hf_model, random_prompts)
from hf_reference import assert_greedy_matches_hf, cpu_engine
from rollout import RolloutEngine, SamplingParams
from rollout.worker import RolloutWorker

LOGP_TOL = 1e-5       # fp32 both ways, reduction order only (as tests/core/test_engine_vs_hf.py)
TIE_MARGIN = 1e-4     # greedy gaps and router-logit gaps below this are near-ties fp32 order may flip
# Router weights scaled up so routing is peaked (top-1 weight ~0.7 of 7 experts) rather than flat.
ROUTER_SCALE = 4.0
TOP_K = 3


def moe_config(model_type: str = "qwen3_moe", **kw):
    from transformers import AutoConfig
    base = dict(vocab_size=MODEL_VOCAB_SIZE, hidden_size=64, intermediate_size=56, moe_intermediate_size=24,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=7,
                num_experts_per_tok=TOP_K, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.1)
    if model_type == "qwen2_moe":     # a shared expert behind a sigmoid gate, QKV bias, raw top-k weights
        base.update(shared_expert_intermediate_size=40, norm_topk_prob=False)
    if model_type == "mixtral":       # every layer an MoE, experts sized by intermediate_size, always renormalised
        for k in ("moe_intermediate_size", "num_experts", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
            base.pop(k)
        base.update(num_local_experts=7, intermediate_size=24)
    return AutoConfig.for_model(model_type, **{**base, **kw})


def build_moe_dir(out, model_type: str = "qwen3_moe", seed: int = 0):
    """A tiny random HF MoE checkpoint (per-expert tensor names, as save_pretrained writes) + tokenizer."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_config(model_type), dtype=torch.float32)
    _randomize_extra_params(model, torch.Generator().manual_seed(10_000 + seed))
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "experts"):
                layer.mlp.gate.weight.mul_(ROUTER_SCALE)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.save_pretrained(out)
    build_tiny_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    cache = {}

    def get(model_type="qwen3_moe", seed=0):
        if (model_type, seed) not in cache:
            cache[model_type, seed] = build_moe_dir(root / f"{model_type}-{seed}", model_type, seed)
        return cache[model_type, seed]
    return get


def _engine(path, **kw):
    return cpu_engine(path, **{"num_kv_pages": 128, **kw})


@torch.no_grad()
def hf_router_topk(path, ids):
    """HF's router top-k [positions, MoE layers, k] of one sequence, and whether each position is free of a
    near-tie (gaps between the k + 1 largest router logits, in any MoE layer, >= TIE_MARGIN)."""
    logits = load_hf_model(path)(torch.tensor([ids]), output_router_logits=True).router_logits
    top = torch.stack(logits, 1).topk(TOP_K + 1, dim=-1)           # [positions, layers, k + 1]
    clear = (top.values[..., :-1] - top.values[..., 1:]).min(-1).values.min(-1).values >= TIE_MARGIN
    return top.indices[..., :TOP_K].numpy(), clear.numpy()


def check_routed(path, prompt, c) -> int:
    """c.routed_experts equals HF's router top-k at every tie-free position; returns positions compared."""
    want, clear = hf_router_topk(path, prompt + c.token_ids[:-1])
    got = c.routed_experts
    assert got.dtype == np.int16 and got.shape == (len(prompt) + len(c.token_ids) - 1, want.shape[1], TOP_K)
    assert (got[clear] == want[clear]).all()
    assert clear.mean() > 0.99          # the comparison is not vacuous (all clear on these weights)
    return int(clear.sum())


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe", "mixtral"])
@pytest.mark.parametrize("n", [1, 3])
def test_greedy_equals_hf_generate(moe_dirs, model_type, n):
    path = moe_dirs(model_type)
    prompts = random_prompts(build_tiny_tokenizer(), 4, 3, 70, seed=1)
    M = 30
    outs = _engine(path).generate(prompts, SamplingParams(n=n, max_new_tokens=M, temperature=0, ignore_eos=True),
                                  use_tqdm=False)
    assert_greedy_matches_hf(path, prompts, outs, M, n, TIE_MARGIN)
    assert all(c.routed_experts is None for o in outs for c in o.completions)     # not asked


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_sampled_logprobs_and_routed_experts_match_hf(moe_dirs, model_type):
    path = moe_dirs(model_type)
    prompts = random_prompts(build_tiny_tokenizer(), 3, 5, 60, seed=2)
    outs = _engine(path).generate(prompts, SamplingParams(n=2, max_new_tokens=25, temperature=1.0, seed=7,
                                                          ignore_eos=True, return_routed_experts=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        for c in o.completions:
            ref = hf_token_logprobs(path, p, c.token_ids)
            assert (ref - torch.tensor(c.logprobs)).abs().max().item() <= LOGP_TOL
            check_routed(path, p, c)
    assert len({tuple(c.token_ids) for o in outs for c in o.completions}) == 6


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_routed_experts_under_chunked_prefill_groups_and_preemption(moe_dirs, mode):
    """16-token steps chunk every prompt; 14 pages for 12 sequences force preemption, by recompute (the
    recomputed positions overwrite their rows) or by swap (rows of the kept KV stay, the recomputed last
    token's row is rewritten); each group's samples share their prompt's rows."""
    path = moe_dirs()
    prompts = random_prompts(build_tiny_tokenizer(), 4, 20, 60, seed=3)
    eng = _engine(path, num_kv_pages=14, max_num_batched_tokens=16, kv_reserve_fraction=0.0, max_model_len=112,
                  preemption_mode=mode, swap_space_gb=0.01 if mode == "swap" else 0.0)
    outs = eng.generate(prompts, SamplingParams(n=3, max_new_tokens=40, temperature=1.0, seed=3, ignore_eos=True,
                                                return_routed_experts=True), use_tqdm=False)
    stats = eng.stats()
    assert stats["preemptions"] > 0 and (stats["swap_outs"] > 0 if mode == "swap" else stats["recomputed_tokens"] > 0)
    for p, o in zip(prompts, outs):
        for c in o.completions:
            check_routed(path, p, c)
        first = o.completions[0].routed_experts[:len(p)]
        assert all((c.routed_experts[:len(p)] == first).all() for c in o.completions)
    assert eng.kv.alloc.num_used == 0


def test_prefix_cache_hit_is_skipped_for_routed_requests(moe_dirs):
    """A cached prompt ran no forward here: a request asking for routed experts computes every position
    (no hit, full rows equal to HF); others still hit the cache."""
    path = moe_dirs()
    eng = _engine(path)
    prompt = random_prompts(build_tiny_tokenizer(), 1, 50, 50, seed=4)[0]
    plain = SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)
    eng.generate([prompt], plain, use_tqdm=False)
    hits = eng.stats()["prefix_cache_hit_tokens"]
    out = eng.generate([prompt], SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True,
                                                return_routed_experts=True), use_tqdm=False)[0].completions[0]
    assert eng.stats()["prefix_cache_hit_tokens"] == hits
    check_routed(path, prompt, out)
    eng.generate([prompt], plain, use_tqdm=False)
    assert eng.stats()["prefix_cache_hit_tokens"] >= hits + 48


def test_random_weights_from_config_match_hf_on_the_same_weights():
    """from_config's seeded weights, written into an HF model through transformers 5's stacked names
    (the names hf_targets shares with it): the same greedy tokens and routed experts."""
    from transformers import AutoModelForCausalLM
    cfg = moe_config(decoder_sparse_step=2, mlp_only_layers=[])        # MoE at layer 1 only
    eng = RolloutEngine.from_config(cfg, device="cpu", dtype="float32", max_model_len=128, num_kv_pages=32, seed=5)
    assert eng.model.sparse_layers == [1]
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    targets = eng.model.hf_targets()
    hf.load_state_dict({name: targets[name] for name in hf.state_dict()})
    prompt = [BOS_ID, 17, 90, 4, 33, 201, 8]
    c = eng.generate([prompt], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True,
                                              return_routed_experts=True), use_tqdm=False)[0].completions[0]
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=PAD_ID)
        logits = hf(out[:, :-1], output_router_logits=True).router_logits
    assert c.token_ids == out[0, len(prompt):].tolist()
    assert (c.routed_experts[:, 0] == logits[0].topk(TOP_K, dim=-1).indices.numpy()).all()


def _hf_stacked_weights(path):
    """What a transformers-5 trainer's model holds (TRL walks these): stacked expert names."""
    from transformers import AutoModelForCausalLM
    return [(n, p.detach().clone()) for n, p in AutoModelForCausalLM.from_pretrained(path).named_parameters()]


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("names", ["checkpoint", "stacked"])
def test_weight_update_equals_a_fresh_engine(moe_dirs, names, model_type):
    """Mixtral's checkpoint names are its first ones (block_sparse_moe.experts.{e}.w1 / w3 / w2), which
    transformers 5 still writes; a trainer's model holds the stacked names."""
    from safetensors.torch import load_file
    old, new = moe_dirs(model_type), moe_dirs(model_type, seed=1)
    update = list(load_file(str(new / "model.safetensors")).items()) if names == "checkpoint" \
        else _hf_stacked_weights(new)
    per_expert = ".block_sparse_moe.experts.0.w1." if model_type == "mixtral" else ".experts.0.gate_proj."
    assert any(per_expert in n for n, _ in update) == (names == "checkpoint")
    prompts = random_prompts(build_tiny_tokenizer(), 3, 5, 40, seed=6)
    params = SamplingParams(n=2, max_new_tokens=16, temperature=1.0, seed=2, ignore_eos=True,
                            return_routed_experts=True)
    worker = RolloutWorker(_engine(old), require_full_updates=True)
    with pytest.raises(ValueError, match="missing"):        # validated whole: nothing lands
        worker.update_weights(update[:-3], version=1)
    worker.update_weights(update, version=1)
    got = worker.generate(prompts, params)
    want = _engine(new).generate(prompts, params, use_tqdm=False)
    for a, b in zip(got, want):
        for x, y in zip(a.completions, b.completions):
            assert x.token_ids == y.token_ids and x.logprobs == y.logprobs
            assert (x.routed_experts == y.routed_experts).all() and x.policy_versions == [1] * 16


def test_bad_input(moe_dirs, model_dir):
    with pytest.raises(ValueError, match="return_routed_experts must be True or False"):
        SamplingParams(return_routed_experts=1).validate(100)
    dense = _engine(model_dir("qwen3"))
    with pytest.raises(ValueError, match="return_routed_experts=True needs a mixture-of-experts model"):
        dense.generate([[1, 2, 3]], SamplingParams(return_routed_experts=True), use_tqdm=False)
    assert dense.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2), use_tqdm=False)[0].completions[0].token_ids
    with pytest.raises(ValueError, match="batch_invariant=True does not cover mixture-of-experts"):
        _engine(moe_dirs(), batch_invariant=True)


def test_job_writes_a_routed_experts_column(moe_dirs, tmp_path):
    import pyarrow.parquet as pq
    from hydra import compose, initialize_config_dir
    from rollout.job import register_configs, run
    register_configs()
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ("the cat sees", "a red dog", "my old song")))
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[2] / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[
            f"model.path={moe_dirs()}", f"data.path={data}", "sampling.n=2", "sampling.max_new_tokens=6",
            "sampling.return_routed_experts=true", "sampling.ignore_eos=true", "reward=null", "batch_prompts=2",
            f"output_dir={tmp_path / 'out'}", "logging.mode=disabled", "engine.device=cpu", "engine.dtype=float32",
            "engine.num_kv_pages=64", "engine.max_model_len=128"])
    run(cfg)
    rows = pq.read_table(tmp_path / "out" / "rollouts").to_pylist()
    assert len(rows) == 6
    for r in rows:
        got = np.array(r["routed_experts"])
        assert got.shape == (len(r["prompt_ids"]) + len(r["completion_ids"]) - 1, 2, TOP_K)
        want, clear = hf_router_topk(moe_dirs(), r["prompt_ids"] + r["completion_ids"][:-1])
        assert (got[clear] == want[clear]).all()


def test_native_generate_returns_routed_experts(moe_dirs):
    from rollout.serve import ServeOptions, start_in_thread
    worker = RolloutWorker(_engine(moe_dirs()))
    server, thread, url = start_in_thread(worker, ServeOptions(served_model_name="tiny-moe"))
    try:
        body = {"input_ids": [[BOS_ID, 40, 41, 42]], "sampling_params": {"n": 2, "max_new_tokens": 5, "seed": 1,
                                                                         "return_routed_experts": True}}
        out = httpx.post(url + "/generate", json=body, timeout=60).json()
        plain = httpx.post(url + "/generate", json={**body, "sampling_params": {"max_new_tokens": 2}},
                           timeout=60).json()
    finally:
        server.should_exit = True
        thread.join(30)
    for c in out["outputs"][0]["completions"]:
        want, _ = hf_router_topk(moe_dirs(), [BOS_ID, 40, 41, 42] + c["token_ids"][:-1])
        assert np.array_equal(np.array(c["routed_experts"]), want)
    assert plain["outputs"][0]["completions"][0]["routed_experts"] is None


def test_trl_grpo_trains_a_few_steps_with_our_generator(moe_dirs, tmp_path):
    """GRPOTrainer on the tiny Qwen3-MoE with our generator: TRL walks its model's stacked expert
    parameters into the worker each step; its recompute matches our logprobs (IS ratio 1 +- 1e-4)."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trainers import attach_generator
    path = moe_dirs()
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=8, learning_rate=1e-3, max_steps=3, logging_steps=1, bf16=False,
                          use_cpu=True, beta=0.0, report_to="none", save_strategy="no", seed=0, disable_tqdm=True,
                          dataloader_num_workers=0, lr_scheduler_type="constant")
    trainer = trl.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        reward_funcs=lambda prompts, completions, **kw: [sum(ch in "aeiou" for ch in c) / max(len(c), 1)
                                                         for c in completions],
        args=args, processing_class=AutoTokenizer.from_pretrained(path),
        train_dataset=datasets.Dataset.from_list([{"prompt": t} for t in ("the cat", "a dog", "my song", "the sun")]))
    worker = RolloutWorker(_engine(path, max_model_len=128, num_kv_pages=64))
    adapter = attach_generator(trainer, worker)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert [h["step"] for h in logs] == [1, 2, 3] and adapter.sync_history == [0, 1, 2]
    # 2, as on the dense model: step 0's weights are the ones live already (the stacked expert names count
    # as the whole set), so only steps 1 and 2 push
    assert worker.weights.metrics["updates"] == 2 and worker.weights.metrics["verified"] == 2
    for h in logs:
        assert h["sampling/sampling_logp_difference/max"] <= LOGP_TOL, h
        for k in ("min", "mean", "max"):
            assert abs(h[f"sampling/importance_sampling_ratio/{k}"] - 1.0) <= 1e-4, h


def test_bench_runs_an_moe_shape_with_the_routed_mode(tmp_path):
    """The H200 bench's MoE path on CPU at a tiny shape: HF baseline from the same config, the routed mode,
    the experts-touched roofline."""
    from rollout.bench.__main__ import main
    out = tmp_path / "bench.json"
    main(["--shape", "tiny-moe", "--batch", "3", "--prompt-len", "12", "--gen-len", "10", "--modes", "async,routed",
          "--hf", "generate", "--hf-gen-len", "4", "--dtype", "float32", "--check-seqs", "2", "--check-gen-len", "6",
          "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["check_greedy"]["max_abs_dlogp"] < LOGP_TOL and r["hf_generate"]["tok_s"] > 0
    touched = r["ours_routed"]["experts_touched_per_layer_step"]
    assert 2 <= touched <= 6          # 3 sequences x top-2 of 8 experts: between k and min(E, 3 k)
    # measured (a mean of whole counts over 18 layer-steps) vs estimated 8 (1 - (3/4)^3) = 4.625
    assert r["roofline_routed"]["bytes_per_step"] != r["roofline"]["bytes_per_step"]
    assert "routed_experts_cost" in r and "partial" not in r
    # The floor of the schedule each run made: 3 prompts prefilled, then a decode step per token (10 tokens,
    # one lagging launch at most); each step reads the weights and, per MoE layer, between top-k and all
    # 8 experts.
    from rollout.bench.roofline import hbm_bandwidth, model_sizes
    from rollout.bench.shapes import make_config
    s = model_sizes(make_config("tiny-moe"), 4)
    for mode in ("async", "routed"):
        run, f = r[f"ours_{mode}"], r[f"ours_{mode}"]["schedule_floor"]
        assert 10 <= f["steps"] <= 3 + 11 and 1 <= f["mean_tokens_per_step"] <= 3 * 12
        one_step = [(s["weight_bytes"] + s["moe_layers"] * e * s["expert_bytes"]) / hbm_bandwidth() for e in (2, 8)]
        assert f["steps"] * one_step[0] <= f["floor_weights_s"] <= f["steps"] * one_step[1]
        assert run["fraction_of_schedule_floor"] == pytest.approx(f["floor_s"] / run["wall_s"])
    assert r["speedup_vs_hf"] == r["speedup_vs_hf_generate"] > 0
    # like for like: ours also at HF's 4 new tokens, on the same prompts
    same = r["ours_at_hf_gen_len"]
    assert same["gen_len"] == 4 and len(same["runs_wall_s"]) == 3
    assert same["tok_s"] == pytest.approx(3 * 4 / same["wall_s"])
    assert r["speedup_vs_hf_generate_same_gen_len"] == pytest.approx(same["tok_s"] / r["hf_generate"]["tok_s"])
    # HF's baseline runs its grouped GEMM experts (its batched_mm default gathers weights per token)
    assert r["hf_experts_implementation"] == "grouped_mm"
    # our KV cache was released before the baselines ran (they need its memory at a 30B MoE on 80 GB)
    assert r["engine_sleep_before_hf"]["level"] == 1 and r["engine_sleep_before_hf"]["released_bytes"] > 0


def test_bench_keeps_the_modes_it_measured_when_a_later_one_fails(tmp_path, monkeypatch):
    """The JSON is written after each timed mode: a run cut off (here: the routed mode raises) keeps the
    async mode's numbers, marked partial. A bad --hf is refused before anything is built."""
    import rollout.bench.__main__ as bench

    def broken(*_a, **_k):
        raise RuntimeError("cut off")
    monkeypatch.setattr(bench, "experts_touched", broken)
    out = tmp_path / "bench.json"
    args = ["--shape", "tiny-moe", "--batch", "2", "--prompt-len", "8", "--gen-len", "6", "--modes", "async,routed",
            "--hf", "none", "--dtype", "float32", "--check-seqs", "1", "--check-gen-len", "4", "--out", str(out)]
    with pytest.raises(RuntimeError, match="cut off"):
        bench.main(args)
    r = json.loads(out.read_text())
    assert r["partial"] is True and r["ours_async"]["tok_s"] > 0 and "ours_routed" not in r
    assert r["meta"]["command"].startswith("python -m rollout.bench")
    with pytest.raises(SystemExit):
        bench.main(["--hf", "generate,bogus", "--out", str(tmp_path / "never.json")])
    assert not (tmp_path / "never.json").exists()


def test_bench_keeps_the_like_for_like_run_and_a_baseline_when_cut_off_in_the_next(tmp_path, monkeypatch):
    """A run killed during an HF baseline (a time limit's signal: not an Exception, so not recorded as the
    baseline's error) keeps ours at HF's G and the baselines before it, marked partial."""
    import rollout.bench.__main__ as bench

    def killed(*_a, **_k):
        raise KeyboardInterrupt
    monkeypatch.setattr(bench, "hf_generate_batch", killed)
    out = tmp_path / "bench.json"
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--shape", "tiny-moe", "--batch", "2", "--prompt-len", "8", "--gen-len", "6", "--modes", "async",
                    "--hf", "generate,generate_batch", "--hf-gen-len", "3", "--dtype", "float32", "--check-seqs", "1",
                    "--check-gen-len", "4", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["partial"] is True and r["ours_at_hf_gen_len"]["gen_len"] == 3 and r["hf_generate"]["tok_s"] > 0
    assert r["speedup_vs_hf_generate_same_gen_len"] > 0 and "hf_generate_batch" not in r


def test_bench_reports_a_failed_hf_baseline_and_keeps_the_run(tmp_path, monkeypatch):
    """An HF baseline that fails (out of memory at a 30B MoE's prefill, say) is named in the JSON with its
    error; ours and the other baselines stay."""
    import rollout.bench.__main__ as bench

    def oom(*_a, **_k):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
    monkeypatch.setattr(bench, "hf_generate_batch", oom)
    out = tmp_path / "bench.json"
    bench.main(["--shape", "tiny-moe", "--batch", "2", "--prompt-len", "8", "--gen-len", "6", "--modes", "async",
                "--hf", "generate_batch,generate", "--hf-gen-len", "3", "--dtype", "float32", "--check-seqs", "1",
                "--check-gen-len", "4", "--out", str(out)])
    r = json.loads(out.read_text())
    assert "out of memory" in r["hf_generate_batch"]["error"] and "speedup_vs_hf_generate_batch" not in r
    assert r["hf_generate"]["tok_s"] > 0 and r["speedup_vs_hf_generate"] > 0 and r["ours_async"]["tok_s"] > 0


def test_build_model_adopts_given_expert_tensors_without_a_copy():
    """build_model(adopt=...) holds the given tensors themselves (the bench shares HF's 57 GiB of experts)
    and allocates the rest on the device; the model then equals one built and copied the usual way."""
    from transformers import AutoModelForCausalLM

    from rollout.bench.__main__ import hf_experts
    from rollout.models.loader import build_model, copy_hf_tensors
    cfg = moe_config()
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    adopt = hf_experts(hf, cfg)
    assert sorted(adopt) == ["layers.0.mlp.down", "layers.0.mlp.gate_up", "layers.2.mlp.down", "layers.2.mlp.gate_up"]
    shared = build_model(cfg, torch.float32, torch.device("cpu"), adopt=adopt)
    assert shared.layers[0].mlp.gate_up.data_ptr() == hf.model.layers[0].mlp.experts.gate_up_proj.data_ptr()
    assert not any(t.is_meta for t in [*shared.parameters(), *shared.buffers()])
    copy_hf_tensors(shared, hf.state_dict().items())
    plain = build_model(cfg, torch.float32, torch.device("cpu"))
    copy_hf_tensors(plain, hf.state_dict().items())
    assert plain.layers[0].mlp.gate_up.data_ptr() != hf.model.layers[0].mlp.experts.gate_up_proj.data_ptr()
    for (name, a), (_, b) in zip(shared.state_dict().items(), plain.state_dict().items()):
        assert torch.equal(a, b), name
    for bad in ({"layers.0.mlp.nope": adopt["layers.0.mlp.down"]}, {"layers.0.mlp.down": adopt["layers.0.mlp.gate_up"]},
                {"layers.0.mlp.down": adopt["layers.0.mlp.down"].double()}):
        with pytest.raises(ValueError, match="adopt: .* is not a parameter of this model of that shape and dtype"):
            build_model(cfg, torch.float32, torch.device("cpu"), adopt=bad)
