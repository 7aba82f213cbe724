#!/usr/bin/env python
"""Build and train the tiny Llama arithmetic model (a CLI over ``rollout.tasks.arith_train.train_tiny_model``).

    python scripts/make_tiny_model.py --out rollout/assets/arith-tiny [--minutes 2] [--seed 0]
"""
from __future__ import annotations

import argparse
import os
import pathlib
import shlex
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from rollout.tasks.arith_train import train_tiny_model  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder (Hugging Face checkpoint layout)")
    ap.add_argument("--minutes", type=float, default=2.0, help="wall-clock training budget")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=None, help="a fixed number of steps instead of a time budget")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=7e-4)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (1: robust to a busy machine)")
    args = ap.parse_args(argv)
    cmd = "python scripts/make_tiny_model.py " + " ".join(map(shlex.quote, argv if argv is not None else sys.argv[1:]))
    print(train_tiny_model(args.out, minutes=args.minutes, seed=args.seed, max_steps=args.max_steps,
                           batch_size=args.batch_size, lr=args.lr, num_threads=args.threads, command=cmd))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
