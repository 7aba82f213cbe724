"""HBM roofline of a decode job (the formula of shared docs/performance.md, section 2).

Per decode step, B sequences at context c:
    t_step = max(W / BW, 2 N B / F)                      linear layers incl. lm_head (N params, W bytes)
           + max(B c K / BW, 4 B c L Hq d / F)           attention over the KV cache (K bytes per token)
           + 4 B V / BW                                  bf16 logits written and read once
A cohort (prompt P, G new tokens) has mean context P + G / 2 and t_step is affine in c, so
tokens/s = B G / (prefill + G t_step(B, P + G / 2)). Prefill is compute-bound: 2 N tokens / F.
MoE: W counts, in each MoE layer, the experts a step touches (the step's own routing where measured,
else E (1 - (1 - k / E)^B) for B tokens routed independently), and N each token's k experts.
"""
from __future__ import annotations

BW_BYTES_S = 4.8e12       # H200 HBM3e peak
H100_BW_BYTES_S = 3.35e12  # H100 SXM HBM3 peak (the device tool lends both cards)
FLOPS = 790e12            # achievable bf16 dense (performance.md section 1; the H100's matrix rate is the same)


def hbm_bandwidth() -> float:
    """The peak HBM bandwidth of this process's GPU: the H100's where that is the card, else the H200's
    (CPU runs too, so their fractions read as the H200's)."""
    import torch
    if torch.cuda.is_available() and "H100" in torch.cuda.get_device_name():
        return H100_BW_BYTES_S
    return BW_BYTES_S


def model_sizes(cfg, dtype_bytes: int = 2) -> dict:
    L, h, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    Hq = cfg.num_attention_heads
    Hkv = cfg.num_key_value_heads or Hq
    d = getattr(cfg, "head_dim", None) or h // Hq
    from ..models.decoder import expert_intermediate_size, is_sparse_layer, num_experts
    sparse = sum(is_sparse_layer(cfg, i) for i in range(L))
    E, k = (num_experts(cfg), cfg.num_experts_per_tok) if sparse else (0, 0)
    expert = 3 * h * expert_intermediate_size(cfg) if sparse else 0        # one expert's gate, up and down
    per_layer = h * (Hq + 2 * Hkv) * d + Hq * d * h + 2 * h
    # non-embedding weights outside the experts (dense MLPs, routers) + lm_head (tied or not: it is read)
    n = L * per_layer + (L - sparse) * 3 * h * cfg.intermediate_size + sparse * h * E + h + V * h
    return {"params_read": n, "weight_bytes": n * dtype_bytes, "kv_bytes_per_token": 2 * L * Hkv * d * dtype_bytes,
            "layers": L, "q_heads": Hq, "head_dim": d, "vocab": V, "moe_layers": sparse, "experts": E, "top_k": k,
            "expert_bytes": expert * dtype_bytes, "active_expert_params": sparse * k * expert}


def experts_touched(s: dict, B: int) -> float:
    """Distinct experts per MoE layer a step of B tokens reads, if each token picks k of E at random."""
    return s["experts"] * (1 - (1 - s["top_k"] / s["experts"]) ** B) if s["moe_layers"] else 0.0


def step_bytes(s: dict, B: int, touched: float | None = None) -> float:
    """Weight bytes a decode step reads; touched: measured distinct experts per MoE layer, else the estimate."""
    return s["weight_bytes"] + s["moe_layers"] * (experts_touched(s, B) if touched is None else touched) * \
        s["expert_bytes"]


def step_time_s(s: dict, B: int, context: float, bw: float | None = None, flops: float = FLOPS,
                touched: float | None = None) -> float:
    bw = bw or hbm_bandwidth()
    linear = max(step_bytes(s, B, touched) / bw, 2 * (s["params_read"] + s["active_expert_params"]) * B / flops)
    attn = max(B * context * s["kv_bytes_per_token"] / bw,
               4 * B * context * s["layers"] * s["q_heads"] * s["head_dim"] / flops)
    return linear + attn + 4 * B * s["vocab"] / bw


def roofline(cfg, B: int, P: int, G: int, prefill_seqs: int | None = None, dtype_bytes: int = 2,
             bw: float | None = None, flops: float = FLOPS, touched: float | None = None) -> dict:
    """B sequences decoding G tokens after a P-token prompt; `prefill_seqs` prompts are
    prefilled (fewer than B when groups share one prefill). touched: MoE, measured distinct experts
    per layer per decode step."""
    s, bw = model_sizes(cfg, dtype_bytes), bw or hbm_bandwidth()
    c = P + G / 2
    t_step = step_time_s(s, B, c, bw, flops, touched)
    prefill = 2 * (s["params_read"] + s["active_expert_params"]) * (prefill_seqs if prefill_seqs is not None else B) \
        * P / flops
    total = prefill + G * t_step
    return {"bytes_per_step": step_bytes(s, B, touched) + B * c * s["kv_bytes_per_token"] + 4 * B * s["vocab"],
            "mean_context": c, "step_ms": 1e3 * t_step, "prefill_s": prefill, "wall_s": total,
            "tok_s": B * G / total, "hbm_bytes_s": bw, "flops": flops}


def schedule_floor_s(steps: list[tuple[int, int]], s: dict, bw: float | None = None) -> dict:
    """HBM floor of the schedule a run made (`steps`: per launched step, the tokens it computed and the summed
    context its sequences attend over): each step reads the weights once (in an MoE layer, the experts its
    tokens touch, estimated as in step_bytes) and the KV of those contexts. Prefill's matrix work is not
    counted, so the floor is the lower for it. For a KV-bound run (a batch whose KV does not all fit) it is
    the floor of the batch sizes the run could hold, where roofline() assumes every sequence resident."""
    bw = bw or hbm_bandwidth()
    weights = sum(step_bytes(s, tokens) for tokens, _ in steps) / bw
    kv = sum(context for _, context in steps) * s["kv_bytes_per_token"] / bw
    return {"floor_s": weights + kv, "floor_weights_s": weights, "floor_kv_s": kv, "hbm_bytes_s": bw}


def record_steps(engine) -> list[tuple[int, int]]:
    """Bench-only: wraps this engine's scheduler.schedule (the instance attribute; the class is untouched)
    to append each launched step's (tokens computed, summed context) to the list returned."""
    sch, steps = engine.scheduler, []
    inner = sch.schedule

    def schedule(*args, **kwargs):
        out = inner(*args, **kwargs)
        if out.items:
            steps.append((sum(i.num_new for i in out.items), sum(i.start + i.num_new for i in out.items)))
        return out

    sch.schedule = schedule
    return steps


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Measured device-to-device copy rate in GB/s, read + write bytes (as HBM bandwidth is quoted)."""
    import torch
    from triton.testing import do_bench
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * nbytes / (ms * 1e-3) / 1e9
