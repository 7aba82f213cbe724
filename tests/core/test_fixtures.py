"""Checks of the test fixtures (tiny tokenizer / models) and HF reference helpers."""

from __future__ import annotations

import json
import math

import hf_reference as H
import pytest
import torch
from hf_reference import (
    BOS_ID,
    EOS_ID,
    FAMILIES,
    PAD_ID,
    hf_greedy,
    hf_greedy_nocache,
    hf_logits,
    hf_token_logprobs,
    load_hf_model,
    random_prompts,
)

# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_basics(tiny_tokenizer):
    tok = tiny_tokenizer
    assert len(tok) == H.TOKENIZER_VOCAB_SIZE
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<pad>", "<bos>", "<eos>"]

    text = 'the quick cat sees 42 dogs, "said" (ok)!\nstep 3: read it.'
    ids = tok(text)["input_ids"]
    assert ids[0] == BOS_ID and BOS_ID not in ids[1:]
    assert tok(text, add_special_tokens=False)["input_ids"] == ids[1:]
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(ids[1:]) == text

    # real BPE merges: many multi-character tokens, and words split across tokens
    vocab = tok.get_vocab()
    multi = [t for t in vocab if len(t) > 1 and not t.startswith("<")]
    assert len(multi) > 150
    pieces = [tok.decode([i]) for i in ids[1:]]
    assert any(len(p) > 2 for p in pieces) and any(len(p) == 1 for p in pieces)

    # every alphabet character is encodable and round-trips
    assert tok.decode(tok(H.ALPHABET, add_special_tokens=False)["input_ids"]) == H.ALPHABET
    # characters outside ALPHABET (no byte fallback, no unk) are silently dropped
    assert tok.decode(tok("été", add_special_tokens=False)["input_ids"]) == "t"
    # ids of the padded model vocab (>= len(tokenizer)) decode to nothing
    assert tok.decode([H.TOKENIZER_VOCAB_SIZE, H.MODEL_VOCAB_SIZE - 1]) == ""


def test_tokenizer_is_deterministic():
    a = H.build_tiny_tokenizer().backend_tokenizer.to_str()
    H._tiny_tokenizer_json.cache_clear()
    b = H.build_tiny_tokenizer().backend_tokenizer.to_str()
    assert a == b


# --------------------------------------------------------------------------- model folders


def test_family_folder_loads_offline(family_model_dir, tiny_tokenizer):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    family, path = family_model_dir
    files = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files

    cfg = AutoConfig.from_pretrained(path)
    assert cfg.model_type == family
    assert cfg.vocab_size == H.MODEL_VOCAB_SIZE >= len(tiny_tokenizer)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == (64, 2, 128)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert cfg.max_position_embeddings == 256
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)

    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == len(tiny_tokenizer)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    # transformers 5 loads qwen2/qwen3 folders with Qwen2Tokenizer (rebuilt pipeline);
    # it must tokenize exactly like the in-process tokenizer and the raw tokenizer.json.
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    texts = H.build_corpus(60, seed=7) + ["x(ok) it's 1234 -- a\n\nb  c"]
    for text in texts:
        ids = tiny_tokenizer(text)["input_ids"]
        assert tok(text)["input_ids"] == ids, (type(tok).__name__, text)
        assert raw.encode(text).ids == ids
        assert tok.decode(ids, skip_special_tokens=True) == raw.decode(ids) == text

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert next(model.parameters()).dtype == torch.float32
    sd = model.state_dict()
    # biases / norm weights were randomized, not HF's 0 / 1
    for name, p in sd.items():
        if name.endswith(".bias") or "norm.weight" in name:
            assert p.std() > 0.05, name
    assert sd["model.embed_tokens.weight"][H.TOKENIZER_VOCAB_SIZE :].abs().max() == 0
    tied = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert tied == (family in ("qwen2", "qwen3"))


def test_family_specific_config(model_dir):
    raw = {f: json.loads((model_dir(f) / "config.json").read_text()) for f in FAMILIES}

    rp = raw["llama"]["rope_parameters"]
    assert rp["rope_type"] == "llama3"
    assert rp["factor"] == 8.0 and rp["original_max_position_embeddings"] == 32
    assert raw["llama"]["tie_word_embeddings"] is False

    assert raw["mistral"]["sliding_window"] == H.MISTRAL_SLIDING_WINDOW == 24
    for f in ("llama", "qwen2", "qwen3"):
        assert raw[f].get("sliding_window") is None

    assert raw["qwen3"]["head_dim"] == 32 != raw["qwen3"]["hidden_size"] // raw["qwen3"]["num_attention_heads"]
    assert raw["qwen2"]["tie_word_embeddings"] is True

    m = load_hf_model(model_dir("qwen2"))
    attn = m.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.k_proj.bias is not None and attn.v_proj.bias is not None
    assert attn.o_proj.bias is None
    m = load_hf_model(model_dir("qwen3"))
    attn = m.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (4 * 32, 64) and attn.k_proj.weight.shape == (2 * 32, 64)
    assert hasattr(attn, "q_norm") and hasattr(attn, "k_norm")


def _llama3_inv_freq(head_dim, theta, factor, low, high, old_ctx):
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    out = []
    for f in inv.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old_ctx / high:
            out.append(f)
        elif wavelen > old_ctx / low:
            out.append(f / factor)
        else:
            s = (old_ctx / wavelen - low) / (high - low)
            out.append((1 - s) * f / factor + s * f)
    return torch.tensor(out, dtype=torch.float64)


def test_llama3_rope_is_used(model_dir):
    m = load_hf_model(model_dir("llama"))
    rot = m.model.rotary_emb
    assert rot.rope_type == "llama3"
    r = H.LLAMA3_ROPE
    expected = _llama3_inv_freq(16, r["rope_theta"], r["factor"], r["low_freq_factor"], r["high_freq_factor"], 32)
    torch.testing.assert_close(rot.inv_freq.double(), expected.double(), rtol=1e-6, atol=0)
    default = 1.0 / r["rope_theta"] ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    ratio = (expected / default).tolist()
    # all three llama3 regimes occur: kept (1), smoothed (between), divided by factor (1/8)
    assert ratio[0] == pytest.approx(1.0)
    assert any(1 / 8 + 1e-3 < x < 1 - 1e-3 for x in ratio)
    assert ratio[-1] == pytest.approx(1 / 8)


def test_legacy_rope_config_equivalent(model_dir, tmp_path):
    legacy = H.build_tiny_model_dir("llama", tmp_path / "legacy", seed=0, legacy_rope_config=True)
    raw = json.loads((legacy / "config.json").read_text())
    assert "rope_parameters" not in raw and raw["rope_theta"] == 10000.0
    assert raw["rope_scaling"]["rope_type"] == "llama3"
    ids = [BOS_ID] + list(range(10, 70))
    torch.testing.assert_close(hf_logits(legacy, ids), hf_logits(model_dir("llama"), ids), rtol=0, atol=0)


def test_mistral_sliding_window_in_effect(model_dir):
    path = model_dir("mistral")
    w = H.MISTRAL_SLIDING_WINDOW
    ids = [BOS_ID] + [(7 * i) % 240 + 3 for i in range(59)]
    changed = list(ids)
    changed[1] = 100 if ids[1] != 100 else 101
    a, b = hf_logits(path, ids), hf_logits(path, changed)
    # 2 layers with window w: position q sees tokens >= q - 2*(w-1)
    reach = 1 + 2 * (w - 1)
    assert (a[reach + 1 :] - b[reach + 1 :]).abs().max() == 0
    assert (a[w + 2 : reach] - b[w + 2 : reach]).abs().max() > 1e-3


def test_sharded_folder(sharded_model_dir, model_dir):
    index = json.loads((sharded_model_dir / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    for s in shards:
        assert (sharded_model_dir / s).is_file()
    assert not (sharded_model_dir / "model.safetensors").exists()
    sharded = load_hf_model(sharded_model_dir).state_dict()
    single = load_hf_model(model_dir("llama")).state_dict()
    assert sharded.keys() == single.keys()
    for k in single:
        assert torch.equal(sharded[k], single[k]), k


# --------------------------------------------------------------------------- references


def test_random_prompts(tiny_tokenizer):
    ps = random_prompts(tiny_tokenizer, 20, 3, 30, seed=5)
    assert len(ps) == 20 and len({len(p) for p in ps}) > 5
    assert all(3 <= len(p) <= 30 and p[0] == BOS_ID for p in ps)
    assert all(3 <= t < H.TOKENIZER_VOCAB_SIZE for p in ps for t in p[1:])
    assert ps == random_prompts(tiny_tokenizer, 20, 3, 30, seed=5)
    assert ps != random_prompts(tiny_tokenizer, 20, 3, 30, seed=6)
    pt = random_prompts(tiny_tokenizer, 5, 8, 12, seed=1, from_text=True, add_bos=False)
    assert all(8 <= len(p) <= 12 and BOS_ID not in p for p in pt)


def test_hf_greedy_deterministic(family_model_dir, tiny_tokenizer):
    _family, path = family_model_dir
    prompts = random_prompts(tiny_tokenizer, 2, 5, 20, seed=3)
    # 20 + 40 tokens > mistral's window of 24: exercises HF's sliding-window cache
    for p in prompts:
        out = hf_greedy(path, p, 40)
        assert len(out) == 40
        assert out == hf_greedy(path, p, 40)
        assert out == hf_greedy_nocache(path, p, 40)
    margins = H.greedy_top2_margins(path, prompts[0], 40)
    assert sorted(margins)[len(margins) // 2] > 0.3
    k = H.greedy_tie_free_prefix(path, prompts[0], 40, min_margin=1e-3)
    assert all(m >= 1e-3 for m in margins[:k]) and (k == 40 or margins[k] < 1e-3)


def test_hf_greedy_respects_eos(model_dir, tiny_tokenizer):
    path = model_dir("qwen3")
    p = random_prompts(tiny_tokenizer, 1, 10, 10, seed=11)[0]
    full = hf_greedy(path, p, 30)
    k = 5
    stop = full[k]
    first = full.index(stop)
    out = hf_greedy(path, p, 30, eos_token_id=stop)
    assert out == full[: first + 1]
    out2 = hf_greedy(path, p, 30, eos_token_id=[12345, stop])
    assert out2 == out
    # an eos that is never produced: full length, no padding
    never = next(t for t in range(3, 250) if t not in full)
    assert hf_greedy(path, p, 30, eos_token_id=never) == full


def test_hf_token_logprobs_matches_manual(model_dir):
    path = model_dir("llama")
    model = load_hf_model(path)
    prompt = [BOS_ID, 40, 50, 60, 70]
    completion = [80, 90, 2, 100, 249]
    for temperature in (1.0, 0.7, 1.5):
        got = hf_token_logprobs(path, prompt, completion, temperature)
        assert got.shape == (len(completion),) and got.dtype == torch.float32
        manual = []
        with torch.no_grad():
            for i, t in enumerate(completion):
                ctx = torch.tensor([prompt + completion[:i]])
                logits = model(input_ids=ctx).logits[0, -1].double()
                manual.append(torch.log_softmax(logits / temperature, -1)[t].item())
        torch.testing.assert_close(got.double(), torch.tensor(manual, dtype=torch.float64), rtol=1e-5, atol=1e-5)
        assert (got < 0).all()
    assert hf_token_logprobs(path, prompt, [], 1.0).shape == (0,)
