"""The arithmetic task (problems, reward, prompt files) and the shipped tiny model folder."""

from __future__ import annotations

import json
import random
import re

import pytest

from rollout.tasks import arith
from rollout.tasks.arith import default_model_path, make_problem, reward, solve, write_prompts

PROMPT_RE = re.compile(r"^(\d+)([+-])(\d+)=$")


# ---------------------------------------------------------------- problems


def test_make_problem_format_and_answer():
    rng = random.Random(0)
    ops = set()
    negatives = 0
    for _ in range(2000):
        prompt, answer = make_problem(rng)
        m = PROMPT_RE.match(prompt)
        assert m, prompt
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        assert 0 <= a < 100 and 0 <= b < 100
        assert int(answer) == (a + b if op == "+" else a - b)
        assert answer == str(int(answer))  # canonical: no "+", no leading zeros
        ops.add(op)
        negatives += answer.startswith("-")
    assert ops == {"+", "-"}
    assert negatives > 100  # about a quarter of all problems


def test_make_problem_digit_classes_and_determinism():
    rng = random.Random(1)
    one = [make_problem(rng, digits=1) for _ in range(200)]
    assert all(len(PROMPT_RE.match(p).group(1)) == 1 and len(PROMPT_RE.match(p).group(3)) == 1 for p, _ in one)
    two = [make_problem(rng, digits=2) for _ in range(200)]
    assert max(int(PROMPT_RE.match(p).group(1)) for p, _ in two) >= 10
    assert all(len(PROMPT_RE.match(p).group(1)) == 1 for p, _ in (make_problem(rng, max_digits=1) for _ in range(100)))
    mix = [make_problem(random.Random(7)) for _ in range(5)]
    assert mix == [make_problem(random.Random(7)) for _ in range(5)]
    # default mix: mostly 2-digit, some 1-digit
    rng = random.Random(2)
    n_small = sum(max(map(int, re.findall(r"\d+", make_problem(rng)[0]))) < 10 for _ in range(2000))
    assert 400 < n_small < 900


def test_solve_parses_prompt():
    assert solve("17+25=") == "42"
    assert solve("3-8=") == "-5"
    assert solve("0-0=") == "0"
    assert solve("99+99=") == "198"
    assert solve(" 12 - 40 = ") == "-28"
    with pytest.raises(ValueError):
        solve("17*25=")


# ------------------------------------------------------------------ reward


@pytest.mark.parametrize(
    "prompt, completion, expected",
    [
        ("17+25=", "42", 1.0),
        ("17+25=", "42<eos>", 1.0),
        ("17+25=", "42<eos><pad><pad>", 1.0),
        ("17+25=", "42 \n", 1.0),
        ("17+25=", " 42", 1.0),
        ("17+25=", "43", 0.0),
        ("17+25=", "042", 0.0),
        ("17+25=", "+42", 0.0),
        ("17+25=", "4", 0.0),
        ("17+25=", "421", 0.0),
        ("17+25=", "", 0.0),
        ("17+25=", "<eos>", 0.0),
        ("17+25=", "4 2", 0.0),
        ("3-8=", "-5", 1.0),
        ("3-8=", "-5<eos>", 1.0),
        ("3-8=", "5", 0.0),
        ("3-8=", "- 5", 0.0),
        ("8-3=", "5", 1.0),
        ("8-3=", "-5", 0.0),
        ("50-50=", "0", 1.0),
        ("50-50=", "-0", 0.0),
        ("not a prompt", "42", 0.0),
    ],
)
def test_reward(prompt, completion, expected):
    assert reward(prompt, completion) == expected


def test_reward_matches_make_problem_answers():
    rng = random.Random(3)
    for _ in range(500):
        prompt, answer = make_problem(rng)
        assert reward(prompt, answer) == 1.0
        assert reward(prompt, answer + "<eos>") == 1.0
        assert reward(prompt, str(int(answer) + 1)) == 0.0


def test_write_prompts(tmp_path):
    path = write_prompts(tmp_path / "sub" / "prompts.jsonl", n=50, seed=5)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 50
    assert all(set(r) == {"prompt", "answer"} and reward(r["prompt"], r["answer"]) == 1.0 for r in rows)
    again = write_prompts(tmp_path / "again.jsonl", n=50, seed=5)
    assert again.read_text() == path.read_text()
    assert write_prompts(tmp_path / "other.jsonl", n=50, seed=6).read_text() != path.read_text()


# ----------------------------------------------------------- shipped model


@pytest.fixture(scope="module")
def shipped():
    path = default_model_path()
    assert (path / "config.json").is_file(), (
        f"{path} is missing; build it with: "
        "python scripts/make_tiny_model.py --out rollout/assets/arith-tiny --minutes 3"
    )
    return path


def test_default_model_path_layout(shipped):
    assert shipped.name == "arith-tiny" and shipped.parent.name == "assets"
    assert arith.ensure_default_model() == shipped  # present: returned without training
    names = {p.name for p in shipped.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
    } <= names
    total = sum(p.stat().st_size for p in shipped.iterdir() if p.is_file())
    assert total < 6 * 1024 * 1024


def test_shipped_tokenizer_roundtrip(shipped):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(shipped)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<bos>", "<eos>", "<pad>")
    ids = tok("17+25=42")["input_ids"]
    assert len(ids) == 1 + len("17+25=42")  # character level
    assert ids[0] == tok.bos_token_id
    assert tok.eos_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == "17+25=42"
    assert tok.decode(ids[1:]) == "17+25=42"
    neg = tok("3-8=")["input_ids"] + tok.convert_tokens_to_ids(["-", "5", "<eos>"])
    assert tok.decode(neg, skip_special_tokens=True) == "3-8=-5"


def test_shipped_config_is_llama(shipped):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.from_pretrained(shipped)
    assert isinstance(cfg, transformers.LlamaConfig)
    tok = transformers.AutoTokenizer.from_pretrained(shipped)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
    )
    assert cfg.vocab_size == len(tok)
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    assert cfg.tie_word_embeddings is False
    gen = transformers.GenerationConfig.from_pretrained(shipped)
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (
        cfg.bos_token_id,
        cfg.eos_token_id,
        cfg.pad_token_id,
    )


def test_shipped_model_solves_one_digit(shipped):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    tok = transformers.AutoTokenizer.from_pretrained(shipped)
    model = transformers.AutoModelForCausalLM.from_pretrained(shipped).eval()
    rng = random.Random(123)
    problems = [make_problem(rng, digits=1) for _ in range(40)] + [("12+34=", "46")]
    tok.padding_side = "left"
    enc = tok([p for p, _ in problems], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=6)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    acc = sum(reward(p, t) for (p, _), t in zip(problems, texts)) / len(problems)
    assert acc >= 0.9, list(zip(problems, texts))


def test_shipped_chat_template_renders_the_trained_prompt(shipped):
    transformers = pytest.importorskip("transformers")
    from rollout.tasks.arith_train import CHAT_TEMPLATE, _encode_batch

    tok = transformers.AutoTokenizer.from_pretrained(shipped)
    assert tok.chat_template == CHAT_TEMPLATE        # a rebuild (arith_train.save) writes the same one
    for prompt, answer in [("12+3=", "15"), ("3-8=", "-5"), ("7+0=", "7")]:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)["input_ids"]
        trained = _encode_batch([(prompt, answer)])[0][0].tolist()   # <bos> prompt answer <eos> <pad>...
        assert ids == trained[: 1 + len(prompt)] == tok(prompt).input_ids
        assert tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True) == f"<bos>{prompt}"
    convo = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"},
             {"role": "user", "content": "2+2="}]
    assert tok.apply_chat_template(convo, tokenize=False) == "<bos>1+1=2<eos>2+2="
    assert reward("<bos>12+3=", "15") == 1.0          # the reward reads a rendered chat prompt too


def test_rebuilt_model_folder_keeps_the_chat_template(tmp_path, shipped):
    transformers = pytest.importorskip("transformers")
    from rollout.tasks.arith_train import train_tiny_model

    small = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
             "intermediate_size": 32}
    train_tiny_model(tmp_path, max_steps=1, batch_size=4, model_kwargs=small, log_every=1000)
    rebuilt = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert rebuilt["chat_template"] == json.loads((shipped / "tokenizer_config.json").read_text())["chat_template"]
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    msgs = [{"role": "user", "content": "12+3="}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"] == tok("12+3=").input_ids


def test_a_missing_embedded_model_says_how_to_rebuild_it(tmp_path, monkeypatch):
    """No silent 3-minute training on first use: the shipped folder is expected, and its absence is named."""
    monkeypatch.setattr(arith, "default_model_path", lambda: tmp_path / "arith-tiny")
    with pytest.raises(FileNotFoundError, match="make_tiny_model.py"):
        arith.ensure_default_model()
