"""Build and train the tiny Llama arithmetic model shipped as the default model.

``train_tiny_model(out_dir, minutes, seed)`` writes a Hugging Face checkpoint folder (config,
generation config, safetensors, tokenizer, README.md) that loads offline with ``AutoTokenizer`` /
``AutoModelForCausalLM``; ``scripts/make_tiny_model.py`` is its CLI.
"""

from __future__ import annotations

import contextlib
import json
import math
import pathlib
import random
import time

import torch

from rollout.tasks.arith import make_problem, reward

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
CHARS = list("0123456789+-= ")
VOCAB = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}

MODEL_KWARGS = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=384, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                    tie_word_embeddings=False, hidden_act="silu", initializer_range=0.02)

SEQ_LEN = 12  # <bos> + "99-99=" + "-99"/"198" + <eos> = 11, padded to 12
WARMUP_STEPS = 50

# The model only knows `<bos>17+25=42<eos>`. A user turn renders as its text, so one user
# message "17+25=" gives exactly the trained prompt (ids of `tokenizer("17+25=")`); an assistant
# turn ends with <eos>; the generation prompt adds nothing (the answer follows the "=").
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
)


def build_tokenizer():
    """Character-level ``PreTrainedTokenizerFast``; adds <bos>, never <eos>."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=dict(VOCAB), unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                       special_tokens=[(BOS, VOCAB[BOS])])
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
                                   padding_side="left",  # for batched generation of prompts
                                   clean_up_tokenization_spaces=False,
                                   model_input_names=["input_ids", "attention_mask"])


def build_model(seed: int = 0, **overrides):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    ids = dict(bos_token_id=VOCAB[BOS], eos_token_id=VOCAB[EOS], pad_token_id=VOCAB[PAD])
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(VOCAB), **ids, **{**MODEL_KWARGS, **overrides}))
    model.generation_config = GenerationConfig(**ids, do_sample=False, max_new_tokens=8)
    return model


def _encode_batch(problems):
    """Right-padded (input_ids, attention_mask, labels); loss on answer + <eos>."""
    n = len(problems)
    ids = torch.full((n, SEQ_LEN), VOCAB[PAD], dtype=torch.long)
    labels = torch.full((n, SEQ_LEN), -100, dtype=torch.long)
    mask = torch.zeros((n, SEQ_LEN), dtype=torch.long)
    for i, (prompt, answer) in enumerate(problems):
        p = [VOCAB[BOS]] + [VOCAB[c] for c in prompt]
        a = [VOCAB[c] for c in answer] + [VOCAB[EOS]]
        seq = p + a
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        labels[i, len(p) : len(seq)] = torch.tensor(a)
    return ids, mask, labels


def eval_problems(seed: int, n_per_class: int = 100):
    """Fixed held-out problems: ``{digits: [(prompt, answer), ...]}``."""
    rng = random.Random(10_000 + seed)
    return {d: [make_problem(rng, digits=d) for _ in range(n_per_class)] for d in (1, 2)}


@torch.no_grad()
def evaluate(model, tokenizer, problems, batch_size: int = 200) -> float:
    """Greedy exact-match accuracy via ``model.generate``."""
    model.eval()
    tokenizer.padding_side = "left"
    correct = 0.0
    for i in range(0, len(problems), batch_size):
        chunk = problems[i : i + batch_size]
        enc = tokenizer([p for p, _ in chunk], return_tensors="pt", padding=True)
        out = model.generate(**enc, do_sample=False, max_new_tokens=6)
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        correct += sum(reward(p, t) for (p, _), t in zip(chunk, texts))
    return correct / len(problems)


@contextlib.contextmanager
def _torch_threads(n: int | None):
    """Set torch's intra-op thread count for the block, then restore it."""
    prev = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def train_tiny_model(out_dir, minutes: float = 2.0, seed: int = 0, *, max_steps: int | None = None,
                     batch_size: int = 128, lr: float = 7e-4, num_threads: int | None = 1, log_every: int = 50,
                     command: str | None = None, model_kwargs: dict | None = None) -> dict:
    """Train for ``minutes`` of wall clock (or ``max_steps``) and save to ``out_dir``.

    Returns a dict of stats (params, steps, train_seconds, acc_1digit, acc_2digit, ...).
    """
    out_dir = pathlib.Path(out_dir)
    # One thread by default: for a model this small, 2 threads are only ~1.3x faster on an idle
    # 2-core box, but ~30x slower when another process holds a core.
    with _torch_threads(num_threads):
        random.seed(seed)
        tokenizer = build_tokenizer()
        model = build_model(seed, **(model_kwargs or {}))
        n_params = sum(p.numel() for p in model.parameters())
        print(f"[arith-tiny] params={n_params:,} threads={torch.get_num_threads()} budget={minutes}min "
              f"max_steps={max_steps}", flush=True)

        held_out = eval_problems(seed)
        # Held-out 2-digit prompts stay out of training (the 1-digit space has only 200 problems:
        # its held-out accuracy is recall).
        held_out_prompts = {p for p, _ in held_out[2]}
        rng = random.Random(seed)

        def sample_batch():
            probs = []
            while len(probs) < batch_size:
                pa = make_problem(rng)
                if pa[0] not in held_out_prompts:
                    probs.append(pa)
            return _encode_batch(probs)

        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
        budget = minutes * 60.0
        model.train()
        t0 = time.perf_counter()
        step, ema = 0, None
        while True:
            elapsed = time.perf_counter() - t0
            if (step >= max_steps) if max_steps is not None else (elapsed >= budget):
                break
            frac = step / max_steps if max_steps is not None else elapsed / budget
            # linear warmup, then cosine decay to 5% of peak over the budget
            scale = min(1.0, (step + 1) / WARMUP_STEPS) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))
            for g in opt.param_groups:
                g["lr"] = lr * scale
            ids, _mask, labels = sample_batch()
            # Right padding + causal attention: pads never influence real tokens, so no mask is needed.
            loss = model(input_ids=ids, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
            if step % log_every == 0:
                print(f"[arith-tiny] step {step:5d}  t={time.perf_counter() - t0:6.1f}s  "
                      f"lr={lr * scale:.2e}  loss(ema)={ema:.4f}", flush=True)
        train_seconds = time.perf_counter() - t0

        acc = {d: evaluate(model, tokenizer, probs) for d, probs in held_out.items()}
        print(f"[arith-tiny] done: steps={step} train={train_seconds:.1f}s  "
              f"held-out exact match: 1-digit={acc[1]:.3f} 2-digit={acc[2]:.3f}", flush=True)
        stats = dict(params=n_params, steps=step, batch_size=batch_size, train_seconds=round(train_seconds, 1),
                     acc_1digit=acc[1], acc_2digit=acc[2], final_loss_ema=round(ema or float("nan"), 4), seed=seed,
                     minutes=minutes, lr=lr, threads=torch.get_num_threads(), torch_version=torch.__version__)
        save(model, tokenizer, out_dir, stats, command)
        return stats


def _compat_fixups(out_dir: pathlib.Path) -> None:
    """Make the folder load in transformers 4.x as well as 5.x, with its chat template: 5 writes
    ``tokenizer_class: TokenizersBackend`` (unknown to 4.x) and only ``rope_parameters`` (4.x reads
    ``rope_theta``); the chat template goes into tokenizer_config.json, where both read it."""
    tc_path = out_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text(encoding="utf-8"))
    tc.update(tokenizer_class="PreTrainedTokenizerFast", model_max_length=MODEL_KWARGS["max_position_embeddings"],
              chat_template=CHAT_TEMPLATE)
    tc_path.write_text(json.dumps(tc, indent=2) + "\n", encoding="utf-8")
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg.setdefault("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", MODEL_KWARGS["rope_theta"]))
    cfg.setdefault("torch_dtype", cfg.get("dtype", "float32"))
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    for f in out_dir.iterdir():
        f.chmod(0o644)


def save(model, tokenizer, out_dir: pathlib.Path, stats: dict, command: str | None = None):
    out_dir.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    _compat_fixups(out_dir)
    cmd = command or (
        f"python scripts/make_tiny_model.py --out {out_dir} --minutes {stats['minutes']} --seed {stats['seed']}"
    )
    cfg = model.config
    readme = f"""# arith-tiny

Tiny Llama-architecture causal LM trained from scratch on CPU on integer
arithmetic (`a+b=` / `a-b=` with 1- and 2-digit operands; differences may be
negative). It is the default model of `rollout` (see `rollout/tasks/arith.py`).

Made with:

```
{cmd}
```

- seed: {stats["seed"]}, steps: {stats["steps"]} (batch {stats["batch_size"]}, AdamW lr {stats["lr"]:g}, warmup + cosine
  over the time budget), training time: {stats["train_seconds"]} s on {stats["threads"]} CPU thread(s), \
torch {stats["torch_version"]}
- parameters: {stats["params"]:,} (float32)
- architecture: LlamaForCausalLM, hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers,
  {cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads, intermediate {cfg.intermediate_size},
  vocab {cfg.vocab_size}, max positions {cfg.max_position_embeddings}, untied embeddings
- tokenizer: character level (`tokenizers` WordLevel); `<pad>`={cfg.pad_token_id}, `<bos>`={cfg.bos_token_id},
  `<eos>`={cfg.eos_token_id}, `<unk>`={VOCAB[UNK]}; encoding adds `<bos>` and never `<eos>`; chat template:
  `<bos>` + each message's text (an assistant turn + `<eos>`), so a user message `12+34=` is the plain prompt
- training data: `<bos>17+25=42<eos>`, loss on answer + `<eos>` only; 30% 1-digit, 70% 2-digit problems
- held-out greedy exact match (100 problems each; 2-digit ones excluded from training,
  the 1-digit space has only 200 problems): 1-digit {stats["acc_1digit"]:.2f}, 2-digit {stats["acc_2digit"]:.2f}

Usage:

```python
from transformers import AutoTokenizer, AutoModelForCausalLM
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path)
enc = tok(["12+34="], return_tensors="pt")
out = model.generate(**enc, do_sample=False, max_new_tokens=6)
print(tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True))  # 46
```
"""
    (out_dir / "README.md").write_text(readme, encoding="utf-8")
    (out_dir / "training_stats.json").write_text(json.dumps(stats, indent=2) + "\n", encoding="utf-8")
