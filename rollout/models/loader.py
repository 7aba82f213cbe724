"""Build a DecoderLM from a local Hugging Face folder (config.json + single or sharded
safetensors) or from a config with seeded random weights. Nothing is downloaded."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Optional, Union

import torch

from .decoder import rope_inv_freq, DecoderLM, check_supported

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(dtype: Union[str, torch.dtype, None], hf_config, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        cfg_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(cfg_dtype, str):
            cfg_dtype = getattr(torch, cfg_dtype, None)
        if isinstance(cfg_dtype, torch.dtype):
            return cfg_dtype
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    out = getattr(torch, str(dtype), None)
    if not isinstance(out, torch.dtype) or not out.is_floating_point:
        raise ValueError(f"dtype must be 'auto' or a floating torch dtype name, got {dtype!r}")
    return out


def build_model(hf_config, dtype: torch.dtype, device: torch.device,
                adopt: Optional[dict[str, torch.Tensor]] = None) -> DecoderLM:
    """The model with UNINITIALISED weights in `dtype` on `device` (load, init_random or copy into it):
    built on the meta device, then allocated once (an fp32 build first would need 2x the memory).
    adopt: {parameter name: tensor} held as given, never allocated (the bench shares HF's MoE experts:
    Qwen3-30B-A3B's are 57 GiB, and two copies do not fit an 80 GB card even for a moment)."""
    with torch.device("meta"):       # DecoderLM checks the architecture
        model = DecoderLM(hf_config).to(dtype)
    params = dict(model.named_parameters())
    for name, t in (adopt or {}).items():
        want = params.get(name)
        if want is None or tuple(t.shape) != tuple(want.shape) or t.dtype != want.dtype:
            held = "" if want is None else f" ({tuple(want.shape)} {want.dtype})"
            raise ValueError(f"adopt: {name!r} {tuple(t.shape)} {t.dtype} is not a parameter of this model "
                             f"of that shape and dtype{held}")
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, torch.nn.Parameter(t, requires_grad=False))
    allocated: dict[int, torch.Tensor] = {}     # Module.to_empty for what is still on meta; shared stays shared
    for mod in model.modules():
        for name, t in list(mod.named_parameters(recurse=False)):
            if t.is_meta:
                empty = torch.nn.Parameter(torch.empty_like(t, device=device), requires_grad=False)
                setattr(mod, name, allocated.setdefault(id(t), empty))
        for name, t in list(mod.named_buffers(recurse=False)):
            if t.is_meta:
                mod.register_buffer(name, allocated.setdefault(id(t), torch.empty_like(t, device=device)),
                                    persistent=name not in mod._non_persistent_buffers_set)
    model.inv_freq = rope_inv_freq(hf_config, model.head_dim).to(device)    # fp32 as in HF; `.to` rounded it
    return model.eval().requires_grad_(False)


def parameter_bytes(model: torch.nn.Module) -> int:
    """One copy of the model's parameters (tied ones once): what a full staged weight update takes."""
    return sum(t.numel() * t.element_size() for t in model.parameters())


def init_random(model: DecoderLM, seed: int) -> None:
    """Seeded normal(0, initializer_range) weights, zero biases, unit norms (HF's init)."""
    std = float(getattr(model.config, "initializer_range", 0.02))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.data.zero_()
        elif "norm" in name:
            p.data.fill_(1.0)
        else:
            p.data.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=gen))


def _read_json(file: Path) -> dict:
    try:
        out = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file} is not valid JSON: {exc}") from exc
    if not isinstance(out, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(out).__name__}")
    return out


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' object")
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"checkpoint {path}: shard(s) listed in the index are missing: {missing}")
        return files
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def copy_hf_tensors(model: DecoderLM, named_tensors, source: str = "state dict") -> set[str]:
    """Copy (hf_name, tensor) pairs into the fused parameters (names, shapes checked) -> names written."""
    targets = model.hf_targets()
    filled: set[str] = set()
    for name, t in named_tensors:
        if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and model.tie_word_embeddings):
            continue
        if name not in targets:
            raise ValueError(f"{source}: unexpected tensor {name!r} for {model.config.model_type}")
        dst = targets[name]
        if tuple(t.shape) != tuple(dst.shape):
            raise ValueError(f"{source}: {name} has shape {tuple(t.shape)}, expected {tuple(dst.shape)}")
        if not t.dtype.is_floating_point:
            raise ValueError(f"{source}: {name} has non-float dtype {t.dtype}")
        dst.copy_(t)
        filled.add(name)
    return filled


def load_checkpoint(model: DecoderLM, path: Path) -> None:
    from safetensors import SafetensorError, safe_open
    filled: set[str] = set()
    for file in checkpoint_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                filled |= copy_hf_tensors(model, ((n, f.get_tensor(n)) for n in f.keys()), f"checkpoint {file.name}")
        except SafetensorError as exc:       # truncated or not a safetensors file at all
            raise ValueError(f"{file} is not a readable safetensors file: {exc}") from exc
    missing = model.hf_missing(filled)
    if missing:
        raise ValueError(f"checkpoint {path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                         f"({len(missing)} in all)")


def load_model(path: Union[str, Path], dtype, device: torch.device, config_overrides: Optional[dict] = None):
    from transformers import AutoConfig
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a local Hugging Face checkpoint folder (no config.json)")
    raw = _read_json(path / "config.json")
    check_supported(SimpleNamespace(model_type=raw.get("model_type"), architectures=raw.get("architectures")))
    hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    for k, v in (config_overrides or {}).items():
        setattr(hf_config, k, v)
    model = build_model(hf_config, resolve_dtype(dtype, hf_config, device), device)
    load_checkpoint(model, path)
    return model, hf_config
