"""HBM roofline of a decode job (the formula of shared docs/performance.md, section 2).

Per decode step, B sequences at context c:
    t_step = max(W / BW, 2 N B / F)                      linear layers incl. lm_head (N params, W bytes)
           + max(B c K / BW, 4 B c L Hq d / F)           attention over the KV cache (K bytes per token)
           + 4 B V / BW                                  bf16 logits written and read once
A cohort (prompt P, G new tokens) has mean context P + G / 2 and t_step is affine in c, so
tokens/s = B G / (prefill + G t_step(B, P + G / 2)). Prefill is compute-bound: 2 N tokens / F.
"""
from __future__ import annotations

BW_BYTES_S = 4.8e12       # H200 HBM3e peak
FLOPS = 790e12            # achievable bf16 dense (performance.md section 1)


def model_sizes(cfg, dtype_bytes: int = 2) -> dict:
    L, h, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    Hq = cfg.num_attention_heads
    Hkv = cfg.num_key_value_heads or Hq
    d = getattr(cfg, "head_dim", None) or h // Hq
    inter = cfg.intermediate_size
    per_layer = h * (Hq + 2 * Hkv) * d + Hq * d * h + 3 * h * inter + 2 * h
    n = L * per_layer + h + V * h       # non-embedding weights + lm_head (tied or not: it is read)
    return {"params_read": n, "weight_bytes": n * dtype_bytes, "kv_bytes_per_token": 2 * L * Hkv * d * dtype_bytes,
            "layers": L, "q_heads": Hq, "head_dim": d, "vocab": V}


def step_time_s(s: dict, B: int, context: float, bw: float = BW_BYTES_S, flops: float = FLOPS) -> float:
    linear = max(s["weight_bytes"] / bw, 2 * s["params_read"] * B / flops)
    attn = max(B * context * s["kv_bytes_per_token"] / bw,
               4 * B * context * s["layers"] * s["q_heads"] * s["head_dim"] / flops)
    return linear + attn + 4 * B * s["vocab"] / bw


def roofline(cfg, B: int, P: int, G: int, prefill_seqs: int | None = None, dtype_bytes: int = 2,
             bw: float = BW_BYTES_S, flops: float = FLOPS) -> dict:
    """B sequences decoding G tokens after a P-token prompt; `prefill_seqs` prompts are
    prefilled (fewer than B when groups share one prefill)."""
    s = model_sizes(cfg, dtype_bytes)
    c = P + G / 2
    t_step = step_time_s(s, B, c, bw, flops)
    prefill = 2 * s["params_read"] * (prefill_seqs if prefill_seqs is not None else B) * P / flops
    total = prefill + G * t_step
    return {"bytes_per_step": s["weight_bytes"] + B * c * s["kv_bytes_per_token"] + 4 * B * s["vocab"],
            "mean_context": c, "step_ms": 1e3 * t_step, "prefill_s": prefill, "wall_s": total,
            "tok_s": B * G / total, "hbm_bytes_s": bw, "flops": flops}


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Measured device-to-device copy rate in GB/s, read + write bytes (as HBM bandwidth is quoted)."""
    import torch
    from triton.testing import do_bench
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * nbytes / (ms * 1e-3) / 1e9
