"""One decoder for Llama (llama3 RoPE), Mistral (sliding window), Qwen2 (QKV bias) and Qwen3 (q/k norm),
fused QKV and gate/up weights; its math mirrors transformers' eager code without importing it."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import env
from ..layers.attention import AttentionMetadata, attend, paged_attention, write_kv
from ..layers.linear import Gemms, pick_config, plain_linear, weight_for

SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM"}


def check_supported(hf_config) -> None:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(f"{k} ({v})" for k, v in SUPPORTED_ARCHITECTURES.items())
        raise ValueError(f"unsupported model_type {model_type!r} (architectures "
                         f"{getattr(hf_config, 'architectures', None)}); supported: {supported}")


def rope_parameters(cfg) -> dict:
    """transformers 5 keeps RoPE settings in `rope_parameters`; 4.x in rope_theta/rope_scaling."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    scaling = getattr(cfg, "rope_scaling", None)
    if scaling and not params.get("rope_type"):
        params.update(scaling)
    params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def rope_inv_freq(cfg, head_dim: int) -> torch.Tensor:
    p = rope_parameters(cfg)
    base = float(p["rope_theta"])
    dim = int(head_dim * p.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = p["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(p["factor"])
    if kind == "llama3":
        factor, lo, hi = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
        old_len = float(p["original_max_position_embeddings"])
        lo_wavelen, hi_wavelen = old_len / lo, old_len / hi
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > lo_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < hi_wavelen) & ~(wavelen > lo_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type {kind!r}; supported: default, linear, llama3")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, D] (halves duplicated, like HF's rotate_half form)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        qkv_bias = cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False))
        o_bias = cfg.model_type != "qwen2" and bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=o_bias)
        self.qk_norm = cfg.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm, self.k_norm = (RMSNorm(self.head_dim, cfg.rms_norm_eps) for _ in range(2))
        self.scale = self.head_dim ** -0.5
        self.sliding_window = self._window(cfg, layer_idx)

    @staticmethod
    def _window(cfg, layer_idx: int) -> Optional[int]:
        window = getattr(cfg, "sliding_window", None)
        if not window:
            return None
        if cfg.model_type in ("qwen2", "qwen3"):
            if not getattr(cfg, "use_sliding_window", False):
                return None
            layer_types = getattr(cfg, "layer_types", None)
            if layer_types and layer_types[layer_idx] != "sliding_attention":
                return None
        return int(window)

    def _qkv(self, x, linear=plain_linear):
        qkv = linear(self.qkv_proj, x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        heads = (self.num_heads, self.num_kv_heads, self.num_kv_heads)
        q, k, v = (t.view(x.shape[0], n, self.head_dim) for t, n in zip(qkv, heads))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata, switches: Optional[env.KernelSwitches] = None):
        q, k, v = self._qkv(x)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = kv_cache
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        o = attend(q, k_cache, v_cache, meta, self.scale, self.sliding_window, switches)
        return self.o_proj(o.reshape(x.shape[0], self.q_size))

    def attend_fused(self, x, positions, inv_freq, kv_cache, meta: AttentionMetadata, gemms: Gemms):
        """The Triton path up to o_proj (RoPE + K/V write fused, maybe into the QKV GEMM) -> [T, q_size]."""
        k_cache, v_cache = kv_cache
        q = None if self.qk_norm else gemms.qkv_rope(self.qkv_proj, x, self.num_heads, positions, inv_freq,
                                                     k_cache, v_cache, meta.slot_mapping)
        if q is None:
            from ..kernels.rope_kv import rope_and_write_kv
            q, k, v = self._qkv(x, gemms)
            q = rope_and_write_kv(q, k, v, positions, inv_freq, k_cache, v_cache, meta.slot_mapping)
        o = paged_attention(q, k_cache, v_cache, meta, self.scale, self.sliding_window, gemms.switches)
        return o.reshape(x.shape[0], self.q_size)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=bias)
        self.down_proj = nn.Linear(self.inter, cfg.hidden_size, bias=bias)
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}; supported: silu")

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, kv_cache, meta, switches):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, switches)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        check_supported(cfg)
        self.config = cfg
        self.vocab_size = cfg.vocab_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        attn = self.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.register_buffer("inv_freq", rope_inv_freq(cfg, attn.head_dim), persistent=False)
        self.fused_small_ops = True   # with the Triton backend (the profile bench turns it off)
        self.skinny_gemm = True       # decode GEMMs: the skinny Triton GEMM where it beats cuBLAS
        self.use_kernel_switches(env.SWITCHES)
        self.batch_invariant = False  # set by the engine: every GEMM through batch_invariant_gemm

    def use_kernel_switches(self, switches: env.KernelSwitches) -> None:
        """The kernel forms this model runs (EngineConfig.kernels); graphs captured before keep theirs."""
        self.kernels = switches

    def gemms(self) -> Gemms:
        mode = "invariant" if self.batch_invariant else "skinny" if self.skinny_gemm else "plain"
        return Gemms(mode, self.kernels)

    def rope(self, positions: torch.Tensor):
        freqs = positions.float()[:, None] * self.inv_freq[None, :]    # fp32 angles, like HF
        emb = torch.cat((freqs, freqs), dim=-1)
        dtype = self.embed_tokens.weight.dtype
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata):
        if meta.backend == "triton" and self.fused_small_ops:
            return self._forward_fused(input_ids, positions, kv_caches, meta)
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope(positions)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv, meta, self.kernels)
        return self.norm(x)

    def _forward_fused(self, input_ids, positions, kv_caches, meta: AttentionMetadata):
        """`forward`'s math in ~6 kernels a layer: residual adds fused into the next RMSNorm."""
        from ..kernels.fused_ops import add_rmsnorm
        residual = self.embed_tokens(input_ids)
        gemms = self.gemms()
        norms = [layer.input_layernorm for layer in self.layers] + [self.norm]
        h, _ = add_rmsnorm(residual, norms[0].weight, norms[0].eps)
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            a = layer.self_attn.attend_fused(h, positions, self.inv_freq, kv, meta, gemms)
            h, residual = gemms.add_norm(layer.self_attn.o_proj, a, residual, layer.post_attention_layernorm)
            act = gemms.silu_gate_up(layer.mlp.gate_up_proj, h)
            h, residual = gemms.add_norm(layer.mlp.down_proj, act, residual, norms[i + 1])
        return h

    def _decode_linears(self):
        """(linear, packing order) of each decode GEMM, in the form the fused path calls it."""
        qkv = "rope" if self.kernels.rope_in_qkv and not self.layers[0].self_attn.qk_norm else "rows"
        for layer in self.layers:
            yield layer.self_attn.qkv_proj, qkv
            yield layer.self_attn.o_proj, "rows"
            yield layer.mlp.gate_up_proj, "silu" if self.kernels.silu_in_gate_up else "rows"
            yield layer.mlp.down_proj, "rows"
        yield (self.embed_tokens if self.tie_word_embeddings else self.lm_head), "rows"

    def pack_decode_weights(self, rows: int, on: bool = True) -> int:
        """Beside each decode GEMM weight the skinny GEMM takes at `rows` rows, a copy packed for its
        tile shape (refilled in place if there; repack after weight updates), which decode kernels
        read from then on; on=False drops them. Returns the bytes packed."""
        from ..kernels.skinny_gemm import pack_weight_tiles
        overrides = self.kernels.gemm_overrides()
        total = 0
        for lin, order in self._decode_linears():
            cfg = pick_config(*lin.weight.shape, rows, packed=True, overrides=overrides) if on else None
            if cfg is None or (order == "rope" and (self.head_dim // 2) % (cfg[0] // 2)):
                lin.weight_tiles = lin.weight_tiles_order = None
                continue                 # cuBLAS, or a QKV tile the RoPE epilogue does not take
            old, keep = weight_for(lin, cfg, order)      # a copy already there for this tile shape and order
            with torch.no_grad():
                lin.weight_tiles = pack_weight_tiles(lin.weight, cfg[0], cfg[1], order, self.head_dim,
                                                     out=old if keep else None)
            lin.weight_tiles_order = order
            total += lin.weight_tiles.numel() * lin.weight_tiles.element_size()
        return total

    def repack_decode_weights(self) -> None:
        """Refresh the packed copies from the weights, in place (captured CUDA graphs read them)."""
        from ..kernels.skinny_gemm import pack_weight_tiles
        with torch.no_grad():
            for lin, _ in self._decode_linears():
                t = getattr(lin, "weight_tiles", None)
                if t is not None:
                    pack_weight_tiles(lin.weight, t.shape[2], t.shape[3], lin.weight_tiles_order, self.head_dim, out=t)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.embed_tokens if self.tie_word_embeddings else self.lm_head
        return self.gemms()(head, hidden)

    def hf_param_slices(self):
        """Yield (hf_name, parameter, row_start, row_end) for every HF tensor we hold."""
        for i, layer in enumerate(self.layers):
            a, m = layer.self_attn, layer.mlp
            qs, ks = a.q_size, a.kv_size
            modules = (   # (module, its HF name, or (HF name, rows) of each part of a fused weight)
                (a.qkv_proj, (("self_attn.q_proj", 0, qs), ("self_attn.k_proj", qs, qs + ks),
                              ("self_attn.v_proj", qs + ks, qs + 2 * ks))),
                (a.o_proj, "self_attn.o_proj"),
                *(((a.q_norm, "self_attn.q_norm"), (a.k_norm, "self_attn.k_norm")) if a.qk_norm else ()),
                (m.gate_up_proj, (("mlp.gate_proj", 0, m.inter), ("mlp.up_proj", m.inter, 2 * m.inter))),
                (m.down_proj, "mlp.down_proj"),
                (layer.input_layernorm, "input_layernorm"),
                (layer.post_attention_layernorm, "post_attention_layernorm"))
            for module, parts in modules:
                parts = ((parts, None, None),) if isinstance(parts, str) else parts
                for suffix in ("weight", "bias"):
                    param = getattr(module, suffix, None)
                    if param is not None:
                        for name, lo, hi in parts:
                            yield f"model.layers.{i}.{name}.{suffix}", param, lo, hi
        yield "model.embed_tokens.weight", self.embed_tokens.weight, None, None
        yield "model.norm.weight", self.norm.weight, None, None
        if not self.tie_word_embeddings:
            yield "lm_head.weight", self.lm_head.weight, None, None

    def hf_targets(self) -> dict[str, torch.Tensor]:
        """hf_name -> the view of our parameter that holds it (writes land in place)."""
        return {name: param.data if lo is None else param.data[lo:hi] for name, param, lo, hi in self.hf_param_slices()}
