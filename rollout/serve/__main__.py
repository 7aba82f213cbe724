"""python -m rollout.serve [--model PATH] [--host 127.0.0.1] [--port 8000] [--api-key KEY] ...

Engine options are EngineConfig's fields (`--max-num-seqs 64`, `--dtype bfloat16`, ...); server
options are ServeOptions' fields. Kernel switches come from ROLLOUT_* variables (rollout.env).
Without --model it serves the embedded tiny arithmetic model.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
from functools import partial
from typing import Optional

from ..config import EngineConfig
from .app import ServeOptions

def _or_none(kind):
    """An Optional number's flag also takes `none` (None: the field's own meaning, e.g. no cap). Not for str
    options: `--api-key none` must stay a key, not turn the check off."""
    def parse(s: str):
        return None if s.lower() == "none" else kind(s)
    parse.__name__ = kind.__name__                 # argparse names the type in its "invalid int value" error
    return parse


_TYPES = {"int": int, "Optional[int]": _or_none(int), "float": float, "Optional[float]": _or_none(float),
          "str": str, "Optional[str]": str}


def _int_or_str(s: str):
    return int(s) if s.isdigit() else s


def add_dataclass_args(ap: argparse.ArgumentParser, cls, title: str, skip=()) -> None:
    """One --flag per dataclass field (defaults left out of the namespace: only given flags override)."""
    group = ap.add_argument_group(title)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kw = dict(dest=f.name, default=argparse.SUPPRESS, help=f"{cls.__name__}.{f.name} (default {default!r})")
        if f.type in ("bool", "Optional[bool]"):
            kw["action"] = argparse.BooleanOptionalAction
        elif f.type == "list":
            kw["nargs"] = "+"
        else:
            kw["type"] = _TYPES.get(f.type, _int_or_str)
            if f.type in ("Optional[int]", "Optional[float]"):
                kw["help"] += " or none"
        group.add_argument("--" + f.name.replace("_", "-"), **kw)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rollout-serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a local Hugging Face folder (default: the embedded tiny model)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--log-level", default="info")
    add_dataclass_args(ap, ServeOptions, "server")
    # kernels: KernelSwitches, read from the environment (rollout.env), not a command-line option
    add_dataclass_args(ap, EngineConfig, "engine (EngineConfig)", skip=("kernels",))
    return ap


def split_args(args: argparse.Namespace) -> tuple[ServeOptions, EngineConfig]:
    given = vars(args)
    serve_names = {f.name for f in dataclasses.fields(ServeOptions)}
    engine_names = {f.name for f in dataclasses.fields(EngineConfig)}
    opts = ServeOptions(**{k: v for k, v in given.items() if k in serve_names})
    if "served_model_name" not in given:
        opts.served_model_name = args.model or "arith-tiny"
    return opts, EngineConfig().replace(**{k: v for k, v in given.items() if k in engine_names}).validate()


def main(argv: Optional[list[str]] = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    opts, config = split_args(args)
    from ..tasks.arith import ensure_default_model
    from . import serve
    from .remote import EngineProcess, pretrained_worker
    path = args.model or ensure_default_model()
    engine = EngineProcess(partial(pretrained_worker, path, config)) if opts.engine_process \
        else pretrained_worker(path, config)
    serve(engine, opts, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
