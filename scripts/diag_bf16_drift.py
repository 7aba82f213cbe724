"""Where does bf16 drift from fp32 come from? (issue 2: on the Llama-3-8B shape our bf16
logprobs sat further from an fp32 forward than HF's bf16 forward did.)

Same random weights in four models: ours and HF, bf16 and fp32.
  1. Prefill, stage by stage (attention out, MLP out, residual, logits): mean |bf16 - fp32|
     for ours and for HF. Equal columns = same numerics op for op.
  2. Sampled generation with our bf16 engine, then the generated tokens' logprobs from: our
     incremental decode, our full forward (engine.score), HF bf16 full forward, vs HF fp32.
  3. Fused GEMMs (our QKV and gate/up) against separate ones: bitwise equal or not.

    python scripts/diag_bf16_drift.py --layers 32 [--vocab 128256] [--device cuda]
"""
from __future__ import annotations

import argparse
import copy
import json

import torch
import torch.nn.functional as F

from rollout import RolloutEngine, SamplingParams
from rollout.layers.attention import AttentionMetadata
from rollout.bench.shapes import make_config
from rollout.models.loader import build_model, copy_hf_tensors


def stages_ours(m, ids, dtype):
    T, ps = ids.numel(), 16
    pages = -(-T // ps)
    kv = [(torch.zeros(pages + 1, ps, m.num_kv_heads, m.head_dim, dtype=dtype, device=ids.device),) * 2
          for _ in m.layers]
    kv = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in kv]
    meta = AttentionMetadata(slot_mapping=torch.arange(T, device=ids.device) + ps,
                             block_tables=torch.arange(1, pages + 1, dtype=torch.int32, device=ids.device)[None],
                             seq_lens=torch.tensor([T], dtype=torch.int32, device=ids.device),
                             query_start_loc=torch.tensor([0, T], dtype=torch.int32, device=ids.device),
                             seq_lens_host=[T], query_start_host=[0, T], page_size=ps)
    out = []
    x = m.embed_tokens(ids)
    cos, sin = m.rope(torch.arange(T, device=ids.device))
    for layer, c in zip(m.layers, kv):
        a = layer.self_attn(layer.input_layernorm(x), cos, sin, c, meta)
        x = x + a
        f = layer.mlp(layer.post_attention_layernorm(x))
        x = x + f
        out += [("attn", a), ("mlp", f), ("resid", x)]
    return out + [("logits", m.compute_logits(m.norm(x)))]


def stages_hf(m, ids):
    out, hooks = [], []
    for layer in m.model.layers:
        hooks.append(layer.self_attn.register_forward_hook(lambda mod, i, o: out.append(("attn", o[0][0]))))
        hooks.append(layer.mlp.register_forward_hook(lambda mod, i, o: out.append(("mlp", o[0]))))
        hooks.append(layer.register_forward_hook(
            lambda mod, i, o: out.append(("resid", (o[0] if isinstance(o, tuple) else o)[0]))))
    logits = m(ids[None]).logits[0]
    for h in hooks:
        h.remove()
    # HF's hooks fire attn, mlp, layer per layer: same order as ours.
    return out + [("logits", logits)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    over = {"num_hidden_layers": args.layers, **({"vocab_size": args.vocab} if args.vocab else {})}
    cfg = make_config("llama3-8b", **over)
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    with torch.device(dev):
        hf32 = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    hf16 = copy.deepcopy(hf32).bfloat16()

    def ours(dtype):
        m = build_model(cfg, dtype, dev)
        copy_hf_tensors(m, hf32.state_dict().items(), "HF model")
        return m
    o16, o32 = ours(torch.bfloat16), ours(torch.float32)
    res = {"layers": args.layers, "vocab": cfg.vocab_size, "device": str(dev)}

    ids = torch.randint(10, cfg.vocab_size - 10, (64,), generator=torch.Generator().manual_seed(1)).to(dev)
    with torch.no_grad():
        a16, a32 = stages_ours(o16, ids, torch.bfloat16), stages_ours(o32, ids, torch.float32)
        h16, h32 = stages_hf(hf16, ids), stages_hf(hf32, ids)
    res["fp32_ours_vs_hf_max"] = max((x.float() - y.float()).abs().max().item() for (_, x), (_, y) in zip(a32, h32))
    rows = []
    for i, ((name, x16), (_, x32), (_, y16)) in enumerate(zip(a16, a32, h16)):
        ref = x32.float()
        rows.append({"stage": f"{i // 3}.{name}" if name != "logits" else "logits",
                     "ours": (x16.float() - ref).abs().mean().item(), "hf": (y16.float() - ref).abs().mean().item()})
    res["prefill_stages"] = rows

    eng = RolloutEngine(o16, cfg, max_model_len=512, num_kv_pages=128, max_num_seqs=8, cuda_graphs=False)
    prompts = torch.randint(10, cfg.vocab_size - 10, (4, 64), generator=torch.Generator().manual_seed(2)).tolist()
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=32, temperature=1.0, seed=3, ignore_eos=True),
                        use_tqdm=False)
    d = {"ours_incremental": [], "ours_full": [], "hf_full_bf16": []}
    for p, o in zip(prompts, outs):
        c = o.completions[0]
        seq = p + c.token_ids
        tok = torch.tensor(c.token_ids, device=dev)[:, None]
        with torch.no_grad():
            def lp(m):
                lg = m(torch.tensor([seq], device=dev)).logits[0, len(p) - 1:-1].float()
                return torch.log_softmax(lg, -1).gather(1, tok)[:, 0].cpu()
            t32, h = lp(hf32), lp(hf16)
        d["ours_incremental"].append((torch.tensor(c.logprobs) - t32).abs())
        d["ours_full"].append((torch.tensor(eng.score([seq])[0][len(p) - 1:]) - t32).abs())
        d["hf_full_bf16"].append((h - t32).abs())
    res["generated_vs_fp32_mean_abs_dlogp"] = {k: torch.cat(v).mean().item() for k, v in d.items()}

    gemm = {}
    for name, (K, n1, n2) in {"gate_up": (4096, 14336, 14336), "qkv": (4096, 4096, 2048)}.items():
        for M in (4, 32, 64):
            x = torch.randn(M, K, device=dev).bfloat16()
            wa, wb = (torch.randn(n1, K, device=dev) * 0.02).bfloat16(), (torch.randn(n2, K, device=dev) * 0.02).bfloat16()
            ref = F.linear(x.double(), wa.double())
            sep, fused = F.linear(x, wa), F.linear(x, torch.cat([wa, wb]))[:, :n1]
            gemm[f"{name}_M{M}"] = {"bitwise_equal": torch.equal(sep, fused),
                                    "err_separate": (sep.double() - ref).abs().mean().item(),
                                    "err_fused": (fused.double() - ref).abs().mean().item()}
    res["fused_gemm"] = gemm
    print(json.dumps(res, indent=1))
    print("\n| stage | ours bf16-fp32 | HF bf16-fp32 |\n|---|---|---|")
    for r in rows[:3] + rows[-4:]:
        print(f"| {r['stage']} | {r['ours']:.3e} | {r['hf']:.3e} |")
    print(res["generated_vs_fp32_mean_abs_dlogp"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
