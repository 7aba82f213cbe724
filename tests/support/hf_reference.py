"""Tiny tokenizer / tiny random models / Hugging Face reference helpers for tests.

Everything here works offline and on CPU, and is importable outside pytest::

    from hf_reference import build_tiny_model_dir, hf_greedy
    path = build_tiny_model_dir("llama", "/tmp/tiny-llama")
    new_ids = hf_greedy(path, [1, 40, 41, 42], max_new_tokens=16)

Conventions
-----------
* Tokenizer: byte-level BPE trained in-process on a small built-in corpus.
  ``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2.  ``tokenizer("text")`` prepends
  ``<bos>`` (TemplateProcessing post-processor); ``decode`` is plain byte-level
  concatenation (``" the"`` tokens carry their leading space).
  ``len(tokenizer) == TOKENIZER_VOCAB_SIZE`` (250).
* Models: ``vocab_size == MODEL_VOCAB_SIZE`` (256) > ``len(tokenizer)``, like real
  checkpoints whose embedding matrix is padded.  The rows of the padded ids
  (250..255) are zero in the input embedding and in ``lm_head`` (so their logit is
  exactly 0.0: greedy never picks them in practice, but sampling at T>=1 can,
  with total probability ~3e-4 per step at T=1).
* The final RMSNorm weight is scaled by ``LOGIT_SCALE`` (2.0) so greedy margins are
  clear (median top-1/top-2 gap ~0.8 logits) while T=1 sampling keeps ~2 nats entropy.
* Weights are fp32, drawn with ``initializer_range=0.1`` (fp32 noise of the HF forward vs fp64 stays ~4e-6, under the 1e-5 logprob tolerance); biases and RMSNorm
  weights are *also* randomized (HF's init sets them to 0 / 1, which would hide
  an engine that forgets a bias or a norm weight).
* Reference numerics: fp32, ``attn_implementation="eager"``, ``model.eval()``,
  ``torch.no_grad()``, one prompt at a time (no padding).
"""

from __future__ import annotations

import functools
import json
import os
import random
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

__all__ = [
    "ALPHABET",
    "BOS_ID",
    "EOS_ID",
    "FAMILIES",
    "LLAMA3_ROPE",
    "LOGIT_SCALE",
    "MISTRAL_SLIDING_WINDOW",
    "MODEL_VOCAB_SIZE",
    "PAD_ID",
    "TOKENIZER_VOCAB_SIZE",
    "build_corpus",
    "build_tiny_model_dir",
    "build_tiny_tokenizer",
    "greedy_tie_free_prefix",
    "greedy_top2_margins",
    "hf_greedy",
    "hf_greedy_nocache",
    "hf_logits",
    "hf_token_logprobs",
    "load_hf_model",
    "make_tiny_config",
    "random_prompts",
]

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<bos>", "<eos>"
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

TOKENIZER_VOCAB_SIZE = 250  # incl. the 3 special tokens
MODEL_VOCAB_SIZE = 256  # padded to a multiple of 8 (> tokenizer size on purpose)

HIDDEN_SIZE = 64
NUM_LAYERS = 2
INTERMEDIATE_SIZE = 128
MAX_POSITION_EMBEDDINGS = 256
NUM_HEADS = 4
NUM_KV_HEADS = 2
INITIALIZER_RANGE = 0.1
# The final RMSNorm weight is multiplied by this, which scales every logit by it:
# greedy top-1/top-2 gaps double (median ~0.8 instead of ~0.4) and the T=1
# next-token entropy is ~2 nats (instead of ~4.2, close to uniform's 5.5).
LOGIT_SCALE = 2.0
MISTRAL_SLIDING_WINDOW = 24
LLAMA3_ROPE = {
    "rope_type": "llama3",
    # theta=1e4 with head_dim=16 and original_max_position_embeddings=32 puts
    # rotary frequencies in all three llama3 regimes (kept / smoothed / divided by factor).
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

# Characters the tokenizer can encode (every one is in the initial BPE alphabet).
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 \n.,!?;:'\"-()"


# --------------------------------------------------------------------------- corpus


_NOUNS = [
    "cat",
    "dog",
    "bird",
    "fish",
    "tree",
    "house",
    "river",
    "mountain",
    "city",
    "road",
    "car",
    "train",
    "boat",
    "ship",
    "king",
    "queen",
    "child",
    "teacher",
    "student",
    "doctor",
    "farmer",
    "robot",
    "model",
    "engine",
    "token",
    "garden",
    "window",
    "door",
    "table",
    "chair",
    "book",
    "letter",
    "number",
    "answer",
    "question",
    "story",
    "apple",
    "bread",
    "water",
    "coffee",
    "music",
    "song",
    "game",
    "friend",
    "sun",
    "moon",
    "star",
    "cloud",
    "rain",
]
_ADJS = [
    "small",
    "large",
    "quick",
    "slow",
    "red",
    "blue",
    "green",
    "old",
    "new",
    "happy",
    "sad",
    "bright",
    "dark",
    "quiet",
    "loud",
    "strange",
    "simple",
    "clever",
    "tired",
    "warm",
    "cold",
    "heavy",
    "light",
]
_VERBS = [
    "sees",
    "finds",
    "takes",
    "makes",
    "reads",
    "writes",
    "opens",
    "closes",
    "likes",
    "wants",
    "needs",
    "builds",
    "moves",
    "follows",
    "carries",
    "watches",
    "helps",
    "calls",
    "brings",
    "keeps",
]
_ADVS = ["quickly", "slowly", "quietly", "happily", "often", "never", "always", "today", "again"]
_PREPS = ["near", "under", "over", "behind", "beside", "into", "from", "with", "without"]


def build_corpus(n_sentences: int = 400, seed: int = 1234) -> list[str]:
    """A deterministic corpus of English-like sentences over ``ALPHABET``."""
    rng = random.Random(seed)
    out: list[str] = []

    def np_() -> str:
        det = rng.choice(["the", "a", "the", "this", "that", "my", "your", "every"])
        if rng.random() < 0.5:
            return f"{det} {rng.choice(_ADJS)} {rng.choice(_NOUNS)}"
        return f"{det} {rng.choice(_NOUNS)}"

    for _ in range(n_sentences):
        kind = rng.random()
        if kind < 0.45:
            s = f"{np_()} {rng.choice(_VERBS)} {np_()}"
            if rng.random() < 0.4:
                s += f" {rng.choice(_PREPS)} {np_()}"
            s += rng.choice([".", ".", ".", "!", ";"])
        elif kind < 0.6:
            s = f"does {np_()} {rng.choice(_VERBS)[:-1]} {np_()}?"
        elif kind < 0.75:
            n1, n2 = rng.randint(0, 99), rng.randint(0, 99)
            s = f"the answer is {n1 + n2}: {n1} plus {n2}."
        elif kind < 0.85:
            s = f'"{np_()}," said {np_()}, "{rng.choice(_VERBS)} {rng.choice(_ADVS)}!"'
        elif kind < 0.93:
            s = f"{np_()} ({rng.choice(_ADJS)}-{rng.choice(_ADJS)}) {rng.choice(_VERBS)} {rng.choice(_ADVS)}."
        else:
            s = f"step {rng.randint(1, 9)}: {rng.choice(_VERBS)} {np_()}; then {rng.choice(_VERBS)} it.\n"
        out.append(s)
    out.append(ALPHABET)  # make sure every character is seen at least once
    return out


# --------------------------------------------------------------------------- tokenizer


def _bytelevel_char(c: str) -> str:
    """The byte-level (GPT-2) unicode stand-in for an ASCII character."""
    return _bytes_to_unicode()[ord(c)]


@functools.lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


@functools.lru_cache(maxsize=1)
def _tiny_tokenizer_json() -> str:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    # Exactly the Qwen2 pipeline (NFC + Qwen/Llama-3 style split regex + byte-level).
    # transformers 5 loads any folder whose config says model_type "qwen2" or "qwen3"
    # with Qwen2Tokenizer, which *rebuilds* the normalizer / pre-tokenizer / decoder
    # from vocab+merges; using the same pipeline everywhere keeps AutoTokenizer on
    # every family folder identical to ``tokenizers.Tokenizer.from_file(tokenizer.json)``.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[PAD_TOKEN, BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=sorted({_bytelevel_char(c) for c in ALPHABET}),
        show_progress=False,
    )
    tok.train_from_iterator(build_corpus(), trainer=trainer)
    assert tok.token_to_id(PAD_TOKEN) == PAD_ID
    assert tok.token_to_id(BOS_TOKEN) == BOS_ID
    assert tok.token_to_id(EOS_TOKEN) == EOS_ID
    assert tok.get_vocab_size() == TOKENIZER_VOCAB_SIZE, tok.get_vocab_size()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    return tok.to_str()


def build_tiny_tokenizer():
    """A fresh ``PreTrainedTokenizerFast`` (training happens once per process)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tiny_tokenizer_json()),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        padding_side="left",
        model_max_length=MAX_POSITION_EMBEDDINGS,
        clean_up_tokenization_spaces=False,
    )


# --------------------------------------------------------------------------- models


def _rope_kwargs(rope: dict) -> dict:
    """Config kwargs for ``rope`` in this transformers' format (5.x: rope_parameters)."""
    import transformers

    rope = dict(rope)
    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": rope}
    theta = rope.pop("rope_theta")  # transformers 4.x: top-level rope_theta + rope_scaling
    return {"rope_theta": theta, "rope_scaling": None if rope["rope_type"] == "default" else rope}


def make_tiny_config(family: str):
    """The transformers config of a tiny random model of ``family``."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = {
        "vocab_size": MODEL_VOCAB_SIZE,
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "initializer_range": INITIALIZER_RANGE,
        "rms_norm_eps": 1e-6,
        "pad_token_id": PAD_ID,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }
    if family == "llama":
        # transformers 5: rope scaling lives in `rope_parameters` (the old
        # `rope_scaling` kwarg is still accepted and converted).
        return LlamaConfig(**common, tie_word_embeddings=False, **_rope_kwargs(LLAMA3_ROPE))
    if family == "qwen2":
        # Qwen2 attention has q/k/v bias hard-coded (bias=True) in the modeling file.
        return Qwen2Config(
            **common,
            tie_word_embeddings=True,
            **_rope_kwargs({"rope_type": "default", "rope_theta": 1_000_000.0}),
            use_sliding_window=False,
        )
    if family == "qwen3":
        return Qwen3Config(
            **common,
            head_dim=32,  # != hidden_size / num_heads (16)
            tie_word_embeddings=True,
            **_rope_kwargs({"rope_type": "default", "rope_theta": 1_000_000.0}),
            use_sliding_window=False,
            attention_bias=False,
        )
    if family == "mistral":
        return MistralConfig(
            **common,
            tie_word_embeddings=False,
            **_rope_kwargs({"rope_type": "default", "rope_theta": 10000.0}),
            sliding_window=MISTRAL_SLIDING_WINDOW,
        )
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def _randomize_extra_params(model, generator: torch.Generator) -> None:
    """HF init zeroes biases and sets RMSNorm weights to 1; randomize them so bugs show."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
            elif "norm" in name and name.endswith(".weight"):
                p.copy_(1.0 + 0.25 * torch.randn(p.shape, generator=generator))
        model.model.norm.weight.mul_(LOGIT_SCALE)
        # Ids outside the tokenizer ("padded vocab") behave like never-trained rows.
        model.get_input_embeddings().weight[TOKENIZER_VOCAB_SIZE:].zero_()
        out = model.get_output_embeddings()
        if out is not None:
            out.weight[TOKENIZER_VOCAB_SIZE:].zero_()


def build_tiny_model_dir(
    family: str,
    out_dir: str | os.PathLike,
    seed: int = 0,
    max_shard_size: int | str | None = None,
    legacy_rope_config: bool = False,
) -> Path:
    """Build a tiny random fp32 ``family`` model + tokenizer and save them to ``out_dir``.

    ``max_shard_size`` (e.g. ``"100KB"``) produces several ``model-0000x-of-0000n.safetensors``
    files plus ``model.safetensors.index.json``.  Weights depend only on (family, seed),
    so a sharded and an unsharded save with the same seed are numerically identical.
    ``legacy_rope_config=True`` rewrites config.json with the hub / transformers-4
    ``rope_theta`` + ``rope_scaling`` keys instead of transformers-5 ``rope_parameters``.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = make_tiny_config(family)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(10_000 + seed)
    _randomize_extra_params(model, gen)
    model.eval()
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **kwargs)
    build_tiny_tokenizer().save_pretrained(out)
    # Qwen2Tokenizer (picked by AutoTokenizer for qwen2 folders) would otherwise add a
    # default unk token "<|endoftext|>" as a new id 250.
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["unk_token"] = None
    tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")
    if legacy_rope_config:
        _rewrite_config_legacy_rope(out / "config.json")
    return out


def _rewrite_config_legacy_rope(config_path: Path) -> None:
    """Rewrite a transformers-5 ``config.json`` into the 4.x / hub layout.

    transformers 5 writes ``"rope_parameters": {"rope_type", "rope_theta", ...}``;
    checkpoints on the hub (and transformers 4.x) have a top-level ``"rope_theta"``
    plus ``"rope_scaling"`` (``null`` for plain RoPE).  transformers 5 reads both.
    """
    cfg = json.loads(config_path.read_text())
    rope = dict(cfg.pop("rope_parameters", None) or {})
    cfg["rope_theta"] = rope.pop("rope_theta", 10000.0)
    cfg["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------- HF reference


@functools.lru_cache(maxsize=16)
def _load_hf_model_cached(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    # generate() fills fields left unset in the GenerationConfig we pass from the
    # model's saved generation_config (eos=2); clear it so hf_greedy(eos_token_id=None)
    # really means "no eos".
    model.generation_config.eos_token_id = None
    return model


def load_hf_model(model_dir: str | os.PathLike):
    """HF model for ``model_dir`` (fp32, eager attention, eval), cached per directory."""
    return _load_hf_model_cached(str(Path(model_dir).resolve()))


def _ids_tensor(ids: Sequence[int]) -> torch.Tensor:
    ids = [int(i) for i in ids]
    if not ids:
        raise ValueError("empty prompt")
    return torch.tensor([ids], dtype=torch.long)


@torch.no_grad()
def hf_greedy(
    model_dir: str | os.PathLike,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None = None,
) -> list[int]:
    """Greedy continuation of ONE prompt with HF ``generate`` (KV cache, no padding).

    Returns only the new tokens.  With ``eos_token_id`` given, generation stops at
    the first eos, which is included (like HF); with ``None`` exactly
    ``max_new_tokens`` tokens come back (the eos in generation_config is ignored).
    """
    from transformers import GenerationConfig

    model = load_hf_model(model_dir)
    input_ids = _ids_tensor(prompt_ids)
    if isinstance(eos_token_id, int):
        eos = [eos_token_id]
    else:
        eos = list(eos_token_id) if eos_token_id is not None else None
    gc = GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=int(max_new_tokens),
        min_new_tokens=0,
        eos_token_id=eos,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        use_cache=True,
        temperature=None,
        top_p=None,
        top_k=None,
    )
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        generation_config=gc,
    )
    new = out[0, input_ids.shape[1] :].tolist()
    if eos:
        for i, t in enumerate(new):
            if t in eos:
                new = new[: i + 1]
                break
    else:
        assert len(new) == max_new_tokens, (len(new), max_new_tokens)
    return new


@torch.no_grad()
def hf_greedy_nocache(
    model_dir: str | os.PathLike,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None = None,
) -> list[int]:
    """Greedy decoding by re-running the full forward every step (no KV cache).

    Slow but independent of HF's cache classes; used to cross-check ``hf_greedy``.
    """
    model = load_hf_model(model_dir)
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    ids = [int(i) for i in prompt_ids]
    new: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=_ids_tensor(ids), use_cache=False).logits[0, -1]
        t = int(torch.argmax(logits))
        new.append(t)
        ids.append(t)
        if t in eos:
            break
    return new


@torch.no_grad()
def hf_logits(model_dir: str | os.PathLike, ids: Sequence[int]) -> torch.Tensor:
    """fp32 logits ``[len(ids), vocab]`` of one unpadded sequence (no cache)."""
    model = load_hf_model(model_dir)
    return model(input_ids=_ids_tensor(ids), use_cache=False).logits[0].float()


@torch.no_grad()
def hf_token_logprobs(
    model_dir: str | os.PathLike,
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probs ``[len(completion)]`` of ``completion_ids`` given ``prompt_ids``.

    fp32 forward of prompt+completion; ``log_softmax(logits / temperature)`` over the
    full (model) vocabulary, gathered at the completion tokens (what TRL recomputes).
    """
    prompt_ids = [int(i) for i in prompt_ids]
    completion_ids = [int(i) for i in completion_ids]
    if not completion_ids:
        return torch.zeros(0, dtype=torch.float32)
    if temperature <= 0:
        raise ValueError("temperature must be > 0")
    logits = hf_logits(model_dir, prompt_ids + completion_ids)
    # logits at position i predict token i+1
    pred = logits[len(prompt_ids) - 1 : len(prompt_ids) + len(completion_ids) - 1]
    logp = torch.log_softmax(pred / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(completion_ids).unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def greedy_top2_margins(model_dir: str | os.PathLike, prompt_ids: Sequence[int], max_new_tokens: int) -> list[float]:
    """Top-1 minus top-2 logit at each step of greedy decoding (no cache)."""
    model = load_hf_model(model_dir)
    ids = [int(i) for i in prompt_ids]
    margins = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=_ids_tensor(ids), use_cache=False).logits[0, -1]
        top = torch.topk(logits, 2).values
        margins.append(float(top[0] - top[1]))
        ids.append(int(torch.argmax(logits)))
    return margins


def greedy_tie_free_prefix(
    model_dir: str | os.PathLike,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    min_margin: float = 1e-3,
) -> int:
    """Number ``k`` of leading greedy tokens whose top-1/top-2 logit gap is >= ``min_margin``.

    An fp32 engine can legitimately pick the other token at step ``k`` (a near tie)
    and diverge from there; compare ``engine_tokens[:k] == hf_greedy(...)[:k]``.
    ``k == max_new_tokens`` when no near tie occurs (the common case: ~0.3% of steps
    have a gap < 1e-3).
    """
    margins = greedy_top2_margins(model_dir, prompt_ids, max_new_tokens)
    return next((i for i, m in enumerate(margins) if m < min_margin), len(margins))


# --------------------------------------------------------------------------- prompts


def random_prompts(
    tokenizer,
    n: int,
    min_len: int,
    max_len: int,
    seed: int = 0,
    *,
    add_bos: bool = True,
    from_text: bool = False,
) -> list[list[int]]:
    """``n`` prompts (token-id lists) with lengths uniform in ``[min_len, max_len]``.

    Lengths include the leading ``<bos>`` when ``add_bos``.  By default the ids are
    drawn uniformly from the normal vocabulary (special tokens and the padded model
    rows excluded); with ``from_text=True`` they are canonical encodings of random
    corpus-like text, truncated to length.
    """
    if min_len < 1 or max_len < min_len:
        raise ValueError("need 1 <= min_len <= max_len")
    rng = random.Random(seed)
    special = set(getattr(tokenizer, "all_special_ids", [])) | {PAD_ID, BOS_ID, EOS_ID}
    normal = [i for i in range(len(tokenizer)) if i not in special]
    corpus = build_corpus(n_sentences=200, seed=seed + 99) if from_text else None
    prompts = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        body_len = length - 1 if add_bos else length
        if from_text:
            body: list[int] = []
            while len(body) < body_len:
                text = " ".join(rng.choice(corpus) for _ in range(4))
                body += tokenizer(text, add_special_tokens=False)["input_ids"]
            body = body[:body_len]
        else:
            body = [rng.choice(normal) for _ in range(body_len)]
        prompts.append(([BOS_ID] if add_bos else []) + body)
    return prompts


def cpu_engine(path, **kw):
    """The tests' fp32 CPU engine on a tiny model folder (a small KV cache, 16-token pages)."""
    from rollout import RolloutEngine
    kw = {"num_kv_pages": 256, "max_num_batched_tokens": 256, "max_model_len": 256, "page_size": 16, **kw}
    return RolloutEngine.from_pretrained(path, device="cpu", dtype="float32", seed=0, **kw)


def assert_greedy_matches_hf(path, prompts, outs, max_new: int, n: int, min_margin: float = 1e-4) -> None:
    """Every completion equals HF's greedy generate up to its first near-tie (a top-2 logit gap below
    min_margin, where fp32 summation order may flip the argmax), ran to max_new tokens, and at least
    90% of the tokens were compared (the comparison is not vacuous)."""
    compared = 0
    for p, o in zip(prompts, outs):
        ref = hf_greedy(path, p, max_new)
        k = greedy_tie_free_prefix(path, p, max_new, min_margin=min_margin)
        assert len(o.completions) == n
        for c in o.completions:
            assert c.token_ids[:k] == ref[:k], f"{path}: diverged before a near-tie"
            assert c.finish_reason == "length" and len(c.token_ids) == max_new
        compared += k
    assert compared >= 0.9 * max_new * len(prompts)
