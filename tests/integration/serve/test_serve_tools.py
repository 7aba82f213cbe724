"""Tool calls in chat replies (`tool_call_parser="hermes"`, vLLM's `--tool-call-parser hermes`), over a real
socket with the `openai` client. The model is the tiny Qwen2 of the other server tests, its tokenizer given
Qwen's added tokens `<tool_call>` / `</tool_call>` (and the braces its alphabet lacks), trained here for a
few seconds to answer every prompt with one fixed hermes tool call, so greedy decoding emits it."""
from __future__ import annotations

import json
import shutil

import openai
import pytest
import torch
from serve_utils import MODEL, make_worker, serving

from rollout.serve import ServeOptions
from rollout.serve.app import build_app
from rollout.serve.protocol import parse_tool_calls

REPLY = 'ok <tool_call>\n{"name": "weather", "arguments": {"city": "paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tool_dir(chat_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = tmp_path_factory.mktemp("tools") / "qwen2-tools"
    shutil.copytree(chat_dir, out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_tokens(["<tool_call>", "</tool_call>", "{", "}"])     # ids 250-253: inside the model's 256 rows
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    reply = tok(REPLY, add_special_tokens=False).input_ids + [tok.eos_token_id]
    rows = []
    for q in ("what is the weather in paris?", "is it cold?", "hello", "tell me the weather"):
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], tools=TOOLS, add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]
        ids = torch.tensor([list(prompt) + reply])
        labels = ids.clone()
        labels[0, :len(prompt)] = -100
        rows.append((ids, labels))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(150):                  # ~3 s on one core; the loss ends near 1e-3
        opt.zero_grad()
        sum(model(input_ids=i, labels=lab).loss for i, lab in rows).backward()
        opt.step()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tool_server(tool_dir):
    with serving(make_worker(tool_dir), tool_call_parser="hermes") as s:
        yield s


def _ask(oai, **kw):
    return oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a new question"}],
                                       max_tokens=60, temperature=0, **kw)


def test_reply_tool_calls_parsed(tool_server):
    oai = openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused")
    r = _ask(oai, tools=TOOLS, extra_body={"return_token_ids": True})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "ok "     # the text before the call, as is
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "weather" and json.loads(call.function.arguments) == {"city": "paris"}
    assert c.token_ids[-1] == 2           # <eos>: the raw tokens are untouched for the trainer

    chunks = list(_ask(oai, tools=TOOLS, stream=True))
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    deltas = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert content == "ok " and "<tool" not in content          # never a piece of the tool call as text
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == \
        [(0, "weather", {"city": "paris"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_and_no_parser_leave_the_text(tool_server, tool_dir):
    oai = openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused")
    c = _ask(oai, tools=TOOLS, tool_choice="none").choices[0]
    assert c.message.content == REPLY and not c.message.tool_calls and c.finish_reason == "stop"
    with serving(make_worker(tool_dir)) as plain:      # no parser: the text as the model wrote it
        c = _ask(openai.OpenAI(base_url=plain.url + "/v1", api_key="unused"), tools=TOOLS).choices[0]
    assert c.message.content == REPLY and not c.message.tool_calls


@pytest.mark.parametrize("text", [
    'x <tool_call>{"name": "a", "arguments": {}</tool_call>',     # not JSON
    'x <tool_call>{"arguments": {}}</tool_call>',                 # no name
    'x <tool_call>{"name": 3}</tool_call>',                       # name not a string
    'x <tool_call>{"name": "a"}',                                 # left open (cut by max_tokens)
    'x <tool_call>{"name": "a"}</tool_call> <tool_call>{"na',     # the second left open
    "no call at all",
])
def test_text_that_is_not_a_whole_tool_call_stays_content(text):
    assert parse_tool_calls(text) == (text, [])


def test_two_calls_and_string_arguments():
    content, calls = parse_tool_calls('<tool_call>{"name": "a", "arguments": "{\\"k\\": 1}"}</tool_call>\n'
                                      '<tool_call> {"name": "b"} </tool_call>')
    assert content is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("a", '{"k": 1}'), ("b", "{}")]
    assert len({c["id"] for c in calls}) == 2


def test_unknown_parser_refused(chat_dir):
    with pytest.raises(ValueError, match="tool_call_parser"):
        build_app(make_worker(chat_dir), ServeOptions(tool_call_parser="mistral"))
