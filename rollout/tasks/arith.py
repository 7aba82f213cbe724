"""Integer-arithmetic task: the problems, the reward and the default tiny model.

Problems look like ``"17+25="`` with answer ``"42"``; differences may be negative (``"3-8="`` ->
``"-5"``). Pure Python (no torch), cheap for reward workers; training lives in
``rollout.tasks.arith_train`` (scripts/make_tiny_model.py).
"""
from __future__ import annotations

import json
import pathlib
import random
import re

__all__ = ["OPS", "default_model_path", "ensure_default_model", "make_problem", "reward", "solve", "write_prompts"]

OPS = ("+", "-")
EOS_TOKEN = "<eos>"

# Share of 1-digit problems when max_digits >= 2: their 200 are learned almost perfectly, the
# 20,000 2-digit ones well but not perfectly, which leaves headroom for RL.
_ONE_DIGIT_SHARE = 0.3

# A leading <bos> is allowed: a chat prompt as the model's chat template renders it.
_PROMPT_RE = re.compile(r"^\s*(?:<bos>)?\s*(-?\d+)\s*([+-])\s*(-?\d+)\s*=\s*$")


def make_problem(rng: random.Random, max_digits: int = 2, digits: int | None = None) -> tuple[str, str]:
    """``(prompt, answer)``, e.g. ``("17+25=", "42")``. ``digits`` fixes the size class (operands
    uniform in ``[0, 10**digits)``); None draws it: 1 with probability 0.3, else uniform over
    ``2..max_digits``. ``+`` or ``-`` with equal probability."""
    if max_digits < 1:
        raise ValueError("max_digits must be >= 1")
    if digits is None:
        digits = 1 if max_digits == 1 or rng.random() < _ONE_DIGIT_SHARE else rng.randint(2, max_digits)
    elif digits < 1:
        raise ValueError("digits must be >= 1")
    hi = 10**digits
    a = rng.randrange(hi)
    b = rng.randrange(hi)
    prompt = f"{a}{rng.choice(OPS)}{b}="
    return prompt, solve(prompt)


def solve(prompt: str) -> str:
    """Compute the answer string for a prompt such as ``"17+25="`` (or ``"<bos>17+25="``)."""
    m = _PROMPT_RE.match(prompt)
    if m is None:
        raise ValueError(f"not an arithmetic prompt: {prompt!r}")
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return str(a + b if op == "+" else a - b)


def reward(prompt: str, completion: str) -> float:
    """1.0 if ``completion`` is exactly the answer, else 0.0. A trailing ``<eos>`` (and what follows)
    and surrounding whitespace are stripped first; nothing else is forgiven (no leading zeros, no "+42")."""
    try:
        answer = solve(prompt)
    except ValueError:
        return 0.0
    text = completion.split(EOS_TOKEN, 1)[0].strip()
    return 1.0 if text == answer else 0.0


def write_prompts(path, n: int, seed: int = 0, max_digits: int = 2) -> pathlib.Path:
    """Write ``n`` problems as jsonl rows ``{"prompt": ..., "answer": ...}``."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(n):
            prompt, answer = make_problem(rng, max_digits)
            f.write(json.dumps({"prompt": prompt, "answer": answer}) + "\n")
    return path


def default_model_path() -> pathlib.Path:
    """Folder of the shipped tiny model: ``<package>/assets/arith-tiny``."""
    return pathlib.Path(__file__).resolve().parent.parent / "assets" / "arith-tiny"


def ensure_default_model() -> pathlib.Path:
    """The shipped model's folder; a clear error (how to rebuild it) if it is missing."""
    path = default_model_path()
    if not ((path / "config.json").is_file() and (path / "model.safetensors").is_file()):
        raise FileNotFoundError(f"the embedded model is missing from {path}; rebuild it with "
                                f"python scripts/make_tiny_model.py --out {path} --minutes 3")
    return path
