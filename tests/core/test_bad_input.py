"""Bad input gets a ValueError naming the problem before anything is scheduled, and the
engine keeps serving. Also: unsupported architectures and broken checkpoint folders."""
import json
import shutil

import pytest

from hf_reference import random_prompts
from rollout import RolloutEngine, SamplingParams


@pytest.fixture(scope="module")
def engine(model_dir):
    return RolloutEngine.from_pretrained(model_dir("llama"), device="cpu", dtype="float32", max_model_len=128,
                                         num_kv_pages=64, page_size=16, seed=0)


GOOD = SamplingParams(max_new_tokens=4, temperature=0)

BAD_CASES = [
    ("empty prompt", [[]], GOOD, "prompt 0 is empty"),
    ("prompt too long", [[5] * 128], GOOD, "max_model_len=128"),
    ("id >= vocab", [[5, 256]], GOOD, "outside the vocabulary"),
    ("negative id", [[5, -1]], GOOD, "outside the vocabulary"),
    ("temperature < 0", [[5, 6]], SamplingParams(temperature=-0.1), "temperature"),
    ("temperature NaN", [[5, 6]], SamplingParams(temperature=float("nan")), "temperature"),
    ("top_p = 0", [[5, 6]], SamplingParams(top_p=0.0), "top_p"),
    ("top_p > 1", [[5, 6]], SamplingParams(top_p=1.5), "top_p"),
    ("n = 0", [[5, 6]], SamplingParams(n=0), "n must be"),
    ("max_new_tokens = 0", [[5, 6]], SamplingParams(max_new_tokens=0), "max_new_tokens"),
    ("top_k < 0", [[5, 6]], SamplingParams(top_k=-1), "top_k"),
    ("min_p > 1", [[5, 6]], SamplingParams(min_p=1.5), "min_p"),
    ("repetition_penalty 0", [[5, 6]], SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
    ("stop as a bare string", [[5, 6]], SamplingParams(stop="ab"), "stop"),
    ("stop token out of vocab", [[5, 6]], SamplingParams(stop_token_ids=[999]), "stop_token_ids"),
    ("wrong params count", [[5, 6], [7, 8]], [GOOD], "SamplingParams for 2 prompts"),
    ("second prompt bad", [[5, 6], []], GOOD, "prompt 1 is empty"),
]


@pytest.mark.parametrize("name,prompts,params,msg", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_input_rejected_before_scheduling(engine, tiny_tokenizer, name, prompts, params, msg):
    with pytest.raises(ValueError, match=msg):
        engine.generate(prompts, params, use_tqdm=False)
    # Nothing was queued, nothing holds pages, and the next valid request works.
    assert not engine.scheduler.waiting and not engine.scheduler.running and not engine.requests
    assert engine.kv.alloc.num_used == 0
    ok = engine.generate(random_prompts(tiny_tokenizer, 2, 3, 9, seed=1), GOOD, use_tqdm=False)
    assert [len(o.completions[0].token_ids) for o in ok] == [4, 4]


def test_text_prompt_without_tokenizer(model_dir):
    eng = RolloutEngine.from_pretrained(model_dir("llama"), device="cpu", dtype="float32", max_model_len=64,
                                        num_kv_pages=16, tokenizer=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        eng.generate(["hello"], GOOD, use_tqdm=False)
    assert eng.generate([[1, 5, 6]], GOOD, use_tqdm=False)[0].completions[0].text is None


def test_text_prompts_with_tokenizer(engine, tiny_tokenizer):
    out = engine.generate(["the dog"], GOOD, use_tqdm=False)[0]
    assert out.prompt == "the dog" and out.prompt_token_ids == tiny_tokenizer("the dog").input_ids
    assert out.completions[0].text == tiny_tokenizer.decode(out.completions[0].token_ids, skip_special_tokens=True)


def test_score_rejects_bad_sequences(engine):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.score([[1, 2, 300]])
    with pytest.raises(ValueError, match="at least 2 tokens"):
        engine.score([[1]])
    with pytest.raises(ValueError, match="temperature"):
        engine.score([[1, 2]], temperature=0)


def test_unsupported_architecture(tmp_path, model_dir):
    d = tmp_path / "gpt2ish"
    shutil.copytree(model_dir("llama"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "gpt2", ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unsupported model_type 'gpt2'.*llama.*mistral.*qwen2.*qwen3"):
        RolloutEngine.from_pretrained(d, device="cpu")


def test_broken_checkpoints(tmp_path, sharded_model_dir, model_dir):
    missing_shard = tmp_path / "missing_shard"
    shutil.copytree(sharded_model_dir, missing_shard)
    next(missing_shard.glob("model-0000*-of-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="missing"):
        RolloutEngine.from_pretrained(missing_shard, device="cpu")
    no_weights = tmp_path / "no_weights"
    shutil.copytree(model_dir("llama"), no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        RolloutEngine.from_pretrained(no_weights, device="cpu")
    with pytest.raises(FileNotFoundError, match="config.json"):
        RolloutEngine.from_pretrained(tmp_path, device="cpu")


def test_wrong_shape_in_checkpoint(tmp_path, model_dir):
    import torch
    from safetensors.torch import load_file, save_file
    d = tmp_path / "wrong_shape"
    shutil.copytree(model_dir("llama"), d)
    sd = load_file(str(d / "model.safetensors"))
    sd["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"q_proj.weight has shape \(3, 3\)"):
        RolloutEngine.from_pretrained(d, device="cpu")


def test_non_float_tensor_in_checkpoint(tmp_path, model_dir):
    import torch
    from safetensors.torch import load_file, save_file
    d = tmp_path / "int_weights"
    shutil.copytree(model_dir("llama"), d)
    sd = load_file(str(d / "model.safetensors"))
    sd["model.norm.weight"] = sd["model.norm.weight"].to(torch.int32)
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.norm.weight has non-float dtype torch.int32"):
        RolloutEngine.from_pretrained(d, device="cpu")
