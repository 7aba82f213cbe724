"""Shared by the GPU tests that run the engine under two or more kernel settings: a Llama-3-8B
shape model with few layers (random weights), and greedy generation of the same 32 random
prompts once per setting, each engine capturing its decode graphs after its setting is applied.
And for the interpreter tests (CPU): the tiny model's engine on the Triton backend."""
import torch

TINY_PROMPTS = [[5, 9, 200, 31], [7] * 11]


def tiny_triton_engine():
    """The tiny model (fp32, seed 0) on the Triton backend; with TINY_PROMPTS and tiny_params()
    the interpreter engine tests compare kernel settings."""
    from rollout import RolloutEngine
    from rollout.bench.shapes import make_config
    return RolloutEngine.from_config(make_config("tiny"), seed=0, device="cpu", dtype="float32", max_model_len=64,
                                     num_kv_pages=16, attention_backend="triton")


def tiny_params():
    from rollout import SamplingParams
    return SamplingParams(max_new_tokens=3, temperature=0.9, seed=3, ignore_eos=True)


def llama8b_model(layers: int):
    from rollout.bench.shapes import make_config
    from rollout.models.loader import build_model, init_random
    cfg = make_config("llama3-8b", num_hidden_layers=layers, max_position_embeddings=1024)
    model = build_model(cfg, torch.bfloat16, torch.device("cuda"))
    init_random(model, 0)
    return model, cfg


def generate_per_setting(model, cfg, settings: dict, *, prompt_lens=(3, 40), max_new_tokens=24, seed=1,
                         **engine_kw) -> dict:
    """settings: {name: function that applies it, returning engine options or None}. Returns {name:
    RequestOutputs}; every run must have replayed decode graphs."""
    from rollout import RolloutEngine, SamplingParams
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 128000, (int(n),), generator=g).tolist()
               for n in torch.randint(*prompt_lens, (32,), generator=g)]
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)
    kw = dict(max_model_len=512, num_kv_pages=1024, max_num_seqs=32) | engine_kw
    outs = {}
    for name, apply in settings.items():
        eng = RolloutEngine(model, cfg, seed=0, **kw, **(apply() or {}))
        outs[name] = eng.generate(prompts, params, use_tqdm=False)
        assert eng.pipeline.counts["graph_steps"] > 0
        del eng
    return outs


def assert_same_tokens_and_logprobs(a, b):
    for x, y in zip(a, b, strict=True):
        assert x.completions[0].token_ids == y.completions[0].token_ids
        assert x.completions[0].logprobs == y.completions[0].logprobs
