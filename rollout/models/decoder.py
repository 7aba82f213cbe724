"""One decoder for Llama (llama3 RoPE), Mistral (sliding window), Qwen2 (QKV bias), Qwen3 (q/k norm) and
their mixture-of-experts forms Mixtral, Qwen2-MoE (a shared expert) and Qwen3-MoE, fused QKV and gate/up weights,
experts stacked; its math mirrors transformers' eager code without importing it."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import env
from ..layers.attention import AttentionMetadata, attend, paged_attention, write_kv
from ..layers.linear import Gemms, pick_config, plain_linear, weight_for
from ..layers.moe import experts, route

SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                           "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}


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
        qkv_bias = bool(getattr(cfg, "qkv_bias", cfg.model_type == "qwen2") or getattr(cfg, "attention_bias", False))
        o_bias = cfg.model_type != "qwen2" and bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=o_bias)
        self.qk_norm = cfg.model_type in ("qwen3", "qwen3_moe")
        if self.qk_norm:
            self.q_norm, self.k_norm = (RMSNorm(self.head_dim, cfg.rms_norm_eps) for _ in range(2))
        self.scale = self.head_dim ** -0.5
        self.sliding_window = self._window(cfg, layer_idx)

    @staticmethod
    def _window(cfg, layer_idx: int) -> Optional[int]:
        window = getattr(cfg, "sliding_window", None)
        if not window:
            return None
        if cfg.model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
            if not getattr(cfg, "use_sliding_window", False):
                return None
            layer_types = getattr(cfg, "layer_types", None)
            if layer_types and layer_types[layer_idx] != "sliding_attention":
                return None
        return int(window)

    def _qkv(self, x, linear=plain_linear, norm: bool = True):
        qkv = linear(self.qkv_proj, x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        heads = (self.num_heads, self.num_kv_heads, self.num_kv_heads)
        q, k, v = (t.view(x.shape[0], n, self.head_dim) for t, n in zip(qkv, heads))
        if self.qk_norm and norm:
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
        if q is None:      # QK-norm (Qwen3): in the RoPE kernel, before the rotation
            from ..kernels.rope_kv import rope_and_write_kv
            q, k, v = self._qkv(x, gemms, norm=False)
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else None
            q = rope_and_write_kv(q, k, v, positions, inv_freq, k_cache, v_cache, meta.slot_mapping, qk_norm=norms)
        o = paged_attention(q, k_cache, v_cache, meta, self.scale, self.sliding_window, gemms.switches)
        return o.reshape(x.shape[0], self.q_size)


class MLP(nn.Module):
    def __init__(self, cfg, inter: Optional[int] = None):
        super().__init__()
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.inter = inter or cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=bias)
        self.down_proj = nn.Linear(self.inter, cfg.hidden_size, bias=bias)
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}; supported: silu")

    def forward(self, x, gemms: Optional[Gemms] = None):
        if gemms is not None:
            return gemms(self.down_proj, gemms.silu_gate_up(self.gate_up_proj, x))
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoE(nn.Module):
    """A linear router over the experts and SiLU-gated experts stacked for the grouped GEMM
    (gate_up [E, 2I, H], down [E, H, I]: transformers 5's layout); Qwen2-MoE adds a shared expert
    scaled by a sigmoid gate."""

    def __init__(self, cfg):
        super().__init__()
        E, inter, H = num_experts(cfg), expert_intermediate_size(cfg), cfg.hidden_size
        self.num_experts, self.inter, self.top_k = E, inter, cfg.num_experts_per_tok
        # Mixtral always renormalises the top-k weights; the Qwen MoEs when norm_topk_prob says so
        self.renormalize = cfg.model_type == "mixtral" or bool(getattr(cfg, "norm_topk_prob", False))
        self.gate = nn.Linear(H, E, bias=False)
        self.gate_up = nn.Parameter(torch.empty(E, 2 * inter, H))
        self.down = nn.Parameter(torch.empty(E, H, inter))
        shared = getattr(cfg, "shared_expert_intermediate_size", 0)
        self.shared_expert = MLP(cfg, shared) if shared else None
        if shared:
            self.shared_expert_gate = nn.Linear(H, 1, bias=False)

    def forward(self, x, routed: Optional[torch.Tensor] = None, gemms: Optional[Gemms] = None, fused: bool = False,
                partials: bool = False):
        """routed: [T, k] int64 where the router's expert ids go (the step's capture buffer), or None;
        fused: the Triton MoE kernels (the Triton backend), else the torch reference. partials (fused, no
        shared expert): the k weighted expert outputs [k, T, H] uncombined, for add_rmsnorm to sum."""
        linear = gemms or plain_linear
        weights, ids = route(linear(self.gate, x), self.top_k, self.renormalize, routed, fused)
        out = experts(x, weights, ids, self.gate_up, self.down, fused,
                      combine=not (partials and fused and self.shared_expert is None))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(linear(self.shared_expert_gate, x)) * self.shared_expert(x, gemms)
        return out


def num_experts(cfg) -> int:
    return getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or 0   # Qwen / Mixtral


def expert_intermediate_size(cfg) -> int:
    return getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size               # Qwen / Mixtral


def is_sparse_layer(cfg, i: int) -> bool:
    """transformers' rule: an MoE MLP every decoder_sparse_step layers, except mlp_only_layers."""
    return num_experts(cfg) > 0 and i not in (getattr(cfg, "mlp_only_layers", None) or []) \
        and (i + 1) % getattr(cfg, "decoder_sparse_step", 1) == 0


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.sparse = is_sparse_layer(cfg, layer_idx)
        self.mlp = SparseMoE(cfg) if self.sparse else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, kv_cache, meta, switches, routed=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, switches)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, routed, fused=meta.backend == "triton") if self.sparse else self.mlp(h))


def _mlp_parts(name: str, mlp: MLP):
    return ((mlp.gate_up_proj, ((f"{name}.gate_proj", 0, mlp.inter), (f"{name}.up_proj", mlp.inter, 2 * mlp.inter))),
            (mlp.down_proj, f"{name}.down_proj"))


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
        self.sparse_layers = [i for i, layer in enumerate(self.layers) if layer.sparse]
        self.top_k = getattr(cfg, "num_experts_per_tok", 0) if self.sparse_layers else 0
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

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata, routed: Optional[torch.Tensor] = None):
        """routed: [sparse layers, >= T, k] int64 that receives each MoE layer's expert ids, or None."""
        T = input_ids.shape[0]
        per_layer = iter(routed[:, :T] if routed is not None else [None] * len(self.sparse_layers))
        if meta.backend == "triton" and self.fused_small_ops:
            return self._forward_fused(input_ids, positions, kv_caches, meta, per_layer)
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope(positions)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv, meta, self.kernels, next(per_layer) if layer.sparse else None)
        return self.norm(x)

    def _forward_fused(self, input_ids, positions, kv_caches, meta: AttentionMetadata, routed):
        """`forward`'s math in ~6 kernels a (dense) layer: residual adds fused into the next RMSNorm."""
        from ..kernels.fused_ops import add_rmsnorm
        residual = self.embed_tokens(input_ids)
        gemms = self.gemms()
        norms = [layer.input_layernorm for layer in self.layers] + [self.norm]
        h, _ = add_rmsnorm(residual, norms[0].weight, norms[0].eps)
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            a = layer.self_attn.attend_fused(h, positions, self.inv_freq, kv, meta, gemms)
            h, residual = gemms.add_norm(layer.self_attn.o_proj, a, residual, layer.post_attention_layernorm)
            if layer.sparse:
                norm = norms[i + 1]
                delta = layer.mlp(h, next(routed), gemms, fused=True, partials=True)   # [T, H] or [k, T, H]
                h, residual = add_rmsnorm(residual, norm.weight, norm.eps, delta=delta)
                continue
            act = gemms.silu_gate_up(layer.mlp.gate_up_proj, h)
            h, residual = gemms.add_norm(layer.mlp.down_proj, act, residual, norms[i + 1])
        return h

    def _decode_linears(self):
        """(linear, packing order) of each decode GEMM, in the form the fused path calls it."""
        qkv = "rope" if self.kernels.rope_in_qkv and not self.layers[0].self_attn.qk_norm else "rows"
        for layer in self.layers:
            yield layer.self_attn.qkv_proj, qkv
            yield layer.self_attn.o_proj, "rows"
            if not layer.sparse:
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
        """Yield (hf_name, parameter, index) for every HF tensor we hold: index None (the whole parameter)
        or what selects its part. Stacked experts answer to the checkpoints' per-expert names and to
        transformers 5's stacked names (`mlp.experts.gate_up_proj`, what a trainer's model holds). Mixtral's
        checkpoints keep their first names (`block_sparse_moe.experts.{e}.w1` gate, `w3` up, `w2` down, and
        `block_sparse_moe.gate`), which transformers 5 still writes; its router answers to both."""
        mixtral = self.config.model_type == "mixtral"
        for i, layer in enumerate(self.layers):
            a, m = layer.self_attn, layer.mlp
            qs, ks = a.q_size, a.kv_size
            modules = [   # (module, its HF name, or (HF name, rows) of each part of a fused weight)
                (a.qkv_proj, (("self_attn.q_proj", 0, qs), ("self_attn.k_proj", qs, qs + ks),
                              ("self_attn.v_proj", qs + ks, qs + 2 * ks))),
                (a.o_proj, "self_attn.o_proj"),
                *(((a.q_norm, "self_attn.q_norm"), (a.k_norm, "self_attn.k_norm")) if a.qk_norm else ()),
                (layer.input_layernorm, "input_layernorm"),
                (layer.post_attention_layernorm, "post_attention_layernorm")]
            if layer.sparse:
                experts = f"model.layers.{i}.mlp.experts"
                per_expert = f"model.layers.{i}.block_sparse_moe.experts" if mixtral else experts
                gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
                for e in range(m.num_experts):
                    yield f"{per_expert}.{e}.{gate}.weight", m.gate_up, (e, slice(0, m.inter))
                    yield f"{per_expert}.{e}.{up}.weight", m.gate_up, (e, slice(m.inter, 2 * m.inter))
                    yield f"{per_expert}.{e}.{down}.weight", m.down, (e,)
                yield f"{experts}.gate_up_proj", m.gate_up, None
                yield f"{experts}.down_proj", m.down, None
                modules.append((m.gate, "mlp.gate"))
                if mixtral:
                    modules.append((m.gate, "block_sparse_moe.gate"))
                if m.shared_expert is not None:
                    modules += [(m.shared_expert_gate, "mlp.shared_expert_gate"),
                                *_mlp_parts("mlp.shared_expert", m.shared_expert)]
            else:
                modules += _mlp_parts("mlp", m)
            for module, parts in modules:
                parts = ((parts, None, None),) if isinstance(parts, str) else parts
                for suffix in ("weight", "bias"):
                    param = getattr(module, suffix, None)
                    if param is not None:
                        for name, lo, hi in parts:
                            yield f"model.layers.{i}.{name}.{suffix}", param, None if lo is None else slice(lo, hi)
        yield "model.embed_tokens.weight", self.embed_tokens.weight, None
        yield "model.norm.weight", self.norm.weight, None
        if not self.tie_word_embeddings:
            yield "lm_head.weight", self.lm_head.weight, None

    def hf_targets(self) -> dict[str, torch.Tensor]:
        """hf_name -> the view of our parameter that holds it (writes land in place)."""
        return {name: p.data if idx is None else p.data[idx] for name, p, idx in self.hf_param_slices()}

    def hf_missing(self, given) -> list[str]:
        """The HF names a complete set of tensors needs that `given` lacks. A parameter given whole
        covers the names of its parts; a whole name of a parameter that also has part names (the
        stacked experts) is never required."""
        slices = list(self.hf_param_slices())
        parted = {id(p) for _, p, idx in slices if idx is not None}
        whole = {id(p) for name, p, idx in slices if idx is None and name in given}
        return sorted(name for name, p, idx in slices
                      if name not in given and id(p) not in whole and (idx is not None or id(p) not in parted))
