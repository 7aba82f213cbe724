"""The OpenAI-compatible routes through the real `openai` client and TRL 1.16's own VLLMClient.generate:
completions (text and token-id prompts, n > 1, logprobs, vLLM's return_token_ids /
return_tokens_as_token_ids), chat (template with tools and chat_template_kwargs), streaming, the
logprobs mode, and equality with the in-process engine (same tokens, same fp32 logprobs: JSON carries
a double exactly, and a request alone in the batch runs the same arithmetic in both)."""
from __future__ import annotations

import openai
import pytest
from serve_utils import ENGINE, MODEL, make_worker, serving

from rollout import RolloutEngine, SamplingParams
from rollout.client import RolloutClient
from rollout.worker import RolloutWorker


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def reference(chat_dir):
    return RolloutEngine.from_pretrained(chat_dir, **ENGINE)


def test_greedy_completion_equals_in_process_engine(oai, reference):
    r = oai.completions.create(model=MODEL, prompt="the small cat", max_tokens=12, temperature=0, logprobs=0,
                               extra_body={"return_token_ids": True})
    ref = reference.generate(["the small cat"], SamplingParams(max_new_tokens=12, temperature=0), use_tqdm=False)[0]
    c, want = r.choices[0], ref.completions[0]
    assert c.prompt_token_ids == ref.prompt_token_ids
    assert c.token_ids == want.token_ids and len(want.token_ids) > 0
    assert c.logprobs.token_logprobs == want.logprobs          # bit-equal (see the module docstring)
    assert c.text == want.text and c.finish_reason == want.finish_reason
    assert c.policy_versions == [0] * len(want.token_ids)
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids) and r.usage.completion_tokens == len(want.token_ids)
    assert c.logprobs.text_offset[0] == 0 and "".join(c.logprobs.tokens).startswith(c.text[:1])


def test_token_prompts_n_logprobs_prompt_major(oai, server, tiny_tokenizer):
    prompts = [tiny_tokenizer("a red sun").input_ids, tiny_tokenizer("my friend reads").input_ids]
    r = oai.completions.create(model=MODEL, prompt=prompts, n=3, max_tokens=6, temperature=1.0, seed=11, logprobs=2,
                               extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True})
    native = RolloutClient(server.url).generate(prompts, SamplingParams(n=3, max_new_tokens=6, seed=11, top_logprobs=2))
    assert len(r.choices) == 6
    for j, ch in enumerate(r.choices):          # the n choices of prompt 0, then prompt 1
        p, i = divmod(j, 3)
        want = native[p].completions[i]
        assert ch.index == j and ch.prompt_token_ids == prompts[p]
        assert ch.token_ids == want.token_ids and ch.logprobs.token_logprobs == want.logprobs
        assert ch.logprobs.tokens == [f"token_id:{t}" for t in want.token_ids]
        for top, sampled, lp in zip(ch.logprobs.top_logprobs, want.token_ids, want.logprobs):
            assert top[f"token_id:{sampled}"] == lp and 2 <= len(top) <= 3     # top 2, plus the sampled one
    assert len({tuple(ch.token_ids) for ch in r.choices[:3]}) > 1               # n samples, not one copied


def test_trl_vllm_client_generate_parses_our_response(server, tiny_tokenizer):
    """TRL's own VLLMClient.generate (its constructor needs vLLM installed, so it is skipped)."""
    requests = pytest.importorskip("requests")
    from trl.generation.vllm_client import VLLMClient
    client = object.__new__(VLLMClient)
    client.session, client.base_url, client.model = requests.Session(), server.url, MODEL
    prompts = [tiny_tokenizer("the old moon").input_ids, tiny_tokenizer("a quiet star").input_ids]
    out = client.generate(prompts, n=2, temperature=1.0, max_tokens=5, logprobs=0, generation_kwargs={"seed": 4})
    native = RolloutClient(server.url).generate(prompts, SamplingParams(n=2, max_new_tokens=5, seed=4))
    assert out["prompt_ids"] == prompts
    assert out["completion_ids"] == [c.token_ids for o in native for c in o.completions]
    assert out["logprobs"] == [[[lp] for lp in c.logprobs] for o in native for c in o.completions]
    assert out["logprob_token_ids"] == [[[t] for t in c.token_ids] for o in native for c in o.completions]


def test_stream_completion_equals_whole(oai):
    kw = dict(model=MODEL, prompt="the quick dog", n=2, max_tokens=10, temperature=1.0, seed=3, logprobs=0,
              extra_body={"return_token_ids": True})
    whole = oai.completions.create(**kw)
    text, ids, lps, finish = ["", ""], [[], []], [[], []], [None, None]
    chunks = list(oai.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    for ch in chunks[:-1]:
        for c in ch.choices:
            text[c.index] += c.text
            ids[c.index] += c.token_ids
            lps[c.index] += c.logprobs.token_logprobs
            finish[c.index] = c.finish_reason or finish[c.index]
    assert len(chunks) > 4                     # token by token, not one blob
    assert chunks[-1].usage.completion_tokens == sum(len(c.token_ids) for c in whole.choices)
    for j, c in enumerate(whole.choices):
        assert (text[j], ids[j], lps[j], finish[j]) == (c.text, c.token_ids, c.logprobs.token_logprobs,
                                                        c.finish_reason)


def test_stream_holds_back_text_a_stop_string_cuts(oai):
    """A streamed choice never shows text that the final response cuts at a stop string: each chunk holds
    back (longest stop - 1) characters, so the chunks add up to the whole response's text."""
    base = dict(model=MODEL, prompt="the quick dog", max_tokens=24, temperature=1.0, seed=5)    # seeded: repeatable
    free = oai.completions.create(logprobs=0, **base).choices[0]
    # A stop string across a token boundary: the last character of one token and the next two, in the middle.
    offsets = free.logprobs.text_offset
    at = next(o for o in offsets[len(offsets) // 2:] if 0 < o < len(free.text) - 2)
    stop, free = free.text[at - 1:at + 2], free.text
    cut = free.find(stop)
    assert len(stop) == 3 and cut > 0
    stops = [stop, "~never~seen~"]        # the longer one sets the hold-back
    whole = oai.completions.create(stop=stops, **base).choices[0]
    assert (whole.text, whole.finish_reason, whole.stop_reason) == (free[:cut], "stop", stop)
    chunks = [c.choices[0] for c in oai.completions.create(stop=stops, stream=True, **base) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text
    assert chunks[-1].finish_reason == "stop"
    sent = "".join(c.text for c in chunks[:-1])
    assert 0 < len(sent) <= cut and whole.text.startswith(sent)     # some text went out early, none past the cut


def test_chat_template_tools_kwargs_and_stream(oai, chat_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(chat_dir)
    messages = [{"role": "user", "content": "does the cat see a star?"}]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    kw = dict(model=MODEL, messages=messages, tools=tools, tool_choice="none", max_tokens=8, temperature=1.0, seed=9,
              logprobs=True, top_logprobs=2, extra_body={"chat_template_kwargs": {"shout": True},
                                                         "return_token_ids": True})
    r = oai.chat.completions.create(**kw)
    want_prompt = tok.apply_chat_template(messages, tools=tools, shout=True, add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"]
    assert r.prompt_token_ids == list(want_prompt)
    assert "loud" in tok.decode(want_prompt) and "tools: weather" in tok.decode(want_prompt)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == tok.decode(c.token_ids, skip_special_tokens=True)
    assert len(c.logprobs.content) == len(c.token_ids) and all(len(e.top_logprobs) == 2 for e in c.logprobs.content)
    streamed = list(oai.chat.completions.create(stream=True, **kw))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed) == c.message.content
    # The repeat finds the prompt's pages in the prefix cache, so its prefill runs other shapes:
    # fp32 rounding then moves a logprob by ~1e-6 (tokens are the same).
    got = [e.logprob for ch in streamed if ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert got == pytest.approx([e.logprob for e in c.logprobs.content], abs=1e-5)
    assert streamed[-1].choices[0].finish_reason == c.finish_reason


def test_logprobs_mode_processed(chat_dir, tiny_tokenizer):
    prompt = tiny_tokenizer("the red bird").input_ids
    with serving(make_worker(chat_dir), logprobs_mode="processed") as s:
        oai = openai.OpenAI(base_url=s.url + "/v1", api_key="unused")
        r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, top_p=0.5, seed=2,
                                   logprobs=0)
        native = RolloutClient(s.url).generate(prompt, SamplingParams(max_new_tokens=8, top_p=0.5, seed=2))[0]
    c = native.completions[0]
    assert r.choices[0].logprobs.token_logprobs == c.processed_logprobs
    assert c.processed_logprobs != c.logprobs           # top_p < 1 renormalises: the modes differ


def test_default_model_from_cli_options():
    """The CLI's options (generated from EngineConfig / ServeOptions) and the embedded default model."""
    from rollout.serve.__main__ import parser, split_args
    from rollout.tasks.arith import ensure_default_model
    opts, cfg = split_args(parser().parse_args(["--device", "cpu", "--max-num-seqs", "8", "--no-cuda-graphs",
                                                "--max-queued-requests", "5"]))
    assert (cfg.max_num_seqs, cfg.cuda_graphs, cfg.max_num_batched_tokens) == (8, False, 2048)
    assert (opts.max_queued_requests, opts.served_model_name) == (5, "arith-tiny")
    engine = RolloutEngine.from_pretrained(ensure_default_model(), cfg)
    ref = RolloutEngine.from_pretrained(ensure_default_model(), cfg)
    with serving(RolloutWorker(engine)) as s:
        oai = openai.OpenAI(base_url=s.url + "/v1", api_key="unused")
        r = oai.completions.create(model=MODEL, prompt="17+25=", max_tokens=4, temperature=0)
        want = ref.generate(["17+25="], SamplingParams(max_new_tokens=4, temperature=0), use_tqdm=False)[0]
        assert r.choices[0].text == want.completions[0].text
        if getattr(engine.tokenizer, "chat_template", None):
            assert oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "1+2="}],
                                               max_tokens=3).choices[0].message.role == "assistant"
        else:                                  # no template shipped: a clear 400, and the server goes on
            with pytest.raises(openai.BadRequestError, match="chat template"):
                oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "1+2="}])
            assert oai.completions.create(model=MODEL, prompt="1+2=", max_tokens=2).choices[0].text is not None

