"""Request schemas (pydantic) and conversions: OpenAI / vLLM fields -> SamplingParams, RequestOutputs ->
OpenAI completion and chat shapes (whole or stream chunks). Unknown fields are a 400, not ignored: a
silently dropped sampling option changes an RL algorithm without a trace.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict

from ..request import RequestOutput, SamplingParams

_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """The sampling fields under vLLM's names, plus our RL policies under SamplingParams' names."""
    model: Optional[str] = None
    n: int = 1
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None  # None (as vLLM takes it): our default, 1.0
    top_p: Optional[float] = None        # 1.0
    top_k: Optional[int] = None          # 0, -1 or None: off
    min_p: Optional[float] = None        # 0.0
    repetition_penalty: Optional[float] = None   # 1.0
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    stale_kv: str = "keep"
    max_staleness: Optional[int] = None
    on_stale: str = "finish"
    presence_penalty: float = 0.0        # OpenAI's; only 0 (the engine has repetition_penalty)
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    request_id: Optional[str] = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    user: Optional[str] = None

    def to_params(self, prompt_len: int, max_model_len: int, max_tokens: Optional[int],
                  top_logprobs: int) -> SamplingParams:
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty / frequency_penalty are not supported; use repetition_penalty")
        given = {k: v for k in ("temperature", "top_p", "min_p", "repetition_penalty", "seed", "ignore_eos",
                                "stale_kv", "max_staleness", "on_stale") if (v := getattr(self, k)) is not None}
        return SamplingParams(
            n=self.n, max_new_tokens=max_tokens if max_tokens is not None else max(1, max_model_len - prompt_len),
            top_k=0 if self.top_k in (None, -1) else self.top_k, top_logprobs=top_logprobs,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []), **given)


class CompletionRequest(_Sampling):
    prompt: Union[list[int], list[list[int]], str, list[str]]
    max_tokens: Optional[int] = 16       # OpenAI's default for completions
    logprobs: Optional[int] = None       # 0: the sampled token's only; k: plus the top k
    echo: bool = False                   # True needs prompt logprobs: refused


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]]
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    # rendered by the template; replies are parsed into tool_calls where the server has a tool_call_parser
    # (never under "none")
    tool_choice: Optional[Union[Literal["none", "auto"], dict]] = None
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class GenerateRequest(_Strict):
    """Native token-in / token-out: one prompt or a batch; SamplingParams fields by name (one dict
    for all prompts, or one per prompt)."""
    input_ids: Union[list[int], list[list[int]]]
    sampling_params: Union[dict[str, Any], list[dict[str, Any]]] = {}
    request_id: Optional[str] = None


class DiskUpdate(_Strict):
    path: str
    version: int


class IPCUpdate(_Strict):
    handles: str                          # base64 of torch's ForkingPickler dump of [(name, cuda tensor)]
    version: int


class GroupInit(_Strict):
    master_address: str
    master_port: int
    world_size: int = 2
    rank_offset: int = 1
    backend: Optional[str] = None         # None: nccl on a CUDA engine, else gloo
    timeout_s: float = 600.0


class GroupUpdate(_Strict):
    version: int
    bucket_bytes: int = 256 << 20


class AbortRequest(_Strict):
    request_ids: list[str] = []
    request_id: Optional[str] = None


def native_params(fields: dict[str, Any]) -> SamplingParams:
    unknown = sorted(set(fields) - _FIELDS)
    if unknown:
        raise ValueError(f"unknown sampling_params field(s) {unknown}; SamplingParams has {sorted(_FIELDS)}")
    return SamplingParams(**fields)


def batch_of_ids(prompt) -> Optional[list[list[int]]]:
    """A token-id prompt (one or a batch) as a batch, or None for text."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return [prompt]
    return None


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0     # JSON has no -inf (vLLM clamps the same way)


_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
TOOL_CALL_PARSERS = ("hermes",)


def parse_tool_calls(text: str) -> tuple[Optional[str], list[dict]]:
    """Hermes-style tool calls, the format of Qwen2.5 / Qwen3 and Hermes chat templates (vLLM's
    `--tool-call-parser hermes`): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks become
    OpenAI `tool_calls`, and the text before the first block the content (None if empty). A block that is
    not such JSON, or one left open (cut by max_tokens), leaves the whole text as content and no calls."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls, end = [], start
    for m in _TOOL_CALL.finditer(text, start):
        try:
            obj = json.loads(m.group(1))
            name, args = obj["name"], obj.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            return text, []
        if not isinstance(name, str):
            return text, []
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}})
        end = m.end()
    if not calls or "<tool_call>" in text[end:]:
        return text, []
    return text[:start] or None, calls


def native_completion(c) -> dict:     # every Completion field (JSON object keys are strings, arrays lists)
    return {**vars(c), "top_logprobs": None if c.top_logprobs is None else [{str(k): v for k, v in d.items()}
                                                                            for d in c.top_logprobs],
            "routed_experts": None if c.routed_experts is None else c.routed_experts.tolist()}


class Formatter:
    """Engine outputs of one request -> OpenAI completion or chat shapes (whole, or chunks)."""

    def __init__(self, req: Union[CompletionRequest, ChatRequest], rid: str, model: str, tokenizer,
                 prompts: list[list[int]], logprobs_mode: str, tool_call_parser: Optional[str] = None):
        self.chat = isinstance(req, ChatRequest)
        self.tools = self.chat and tool_call_parser is not None and bool(req.tools) and req.tool_choice != "none"
        self.req, self.rid, self.model, self.tok, self.prompts = req, rid, model, tokenizer, prompts
        self.want_logprobs = req.logprobs if self.chat else req.logprobs is not None
        self.field = "processed_logprobs" if logprobs_mode == "processed" else "logprobs"
        self.as_ids = req.return_tokens_as_token_ids or tokenizer is None
        self.created = int(time.time())
        self.object = "chat.completion" if self.chat else "text_completion"
        self._names: dict[int, str] = {}
        total = len(prompts) * req.n
        self._ids: list[list[int]] = [[] for _ in range(total)]   # streaming: tokens sent per choice
        self._upto = [0] * total          # tokens whose text was decoded
        self._text = [""] * total         # text sent
        self._held = [""] * total         # text decoded, held back: it may begin a stop string
        self._stopped = [False] * total   # a stop string was seen: nothing more until the final chunk
        self._offset = [0] * total
        stop = req.stop
        # Streamed text ends before a stop string (the engine cuts it from the final text) or a tool call
        # (sent parsed, in the final chunk); the last (longest - 1) characters are held back till they can't
        # begin one.
        self._cut_at = ([stop] if isinstance(stop, str) else list(stop or [])) + ["<tool_call>"] * self.tools
        self._hold = max(map(len, self._cut_at), default=1) - 1

    def _name(self, t: int) -> str:
        if self.as_ids:
            return f"token_id:{t}"
        if t not in self._names:
            self._names[t] = self.tok.decode([t], skip_special_tokens=False)
        return self._names[t]

    def _logprobs(self, j: int, ids, lps, tops) -> Optional[dict]:
        if not self.want_logprobs:
            return None
        names = [self._name(t) for t in ids]
        tops = tops or [None] * len(ids)
        if self.chat:
            def entry(s, lp):
                return {"token": s, "logprob": _finite(lp), "bytes": list(s.encode())}
            return {"content": [{**entry(s, lp), "top_logprobs": [entry(self._name(k), v)
                                                                  for k, v in (top or {}).items()]}
                                for s, lp, top in zip(names, lps, tops)]}
        offsets = list(itertools.accumulate(map(len, names), initial=self._offset[j]))
        self._offset[j] = offsets.pop()
        top_dicts = [{**{self._name(k): _finite(v) for k, v in (top or {}).items()}, s: _finite(lp)}
                     for s, lp, top in zip(names, lps, tops)]
        return {"tokens": names, "token_logprobs": [_finite(x) for x in lps], "top_logprobs": top_dicts,
                "text_offset": offsets}

    def _choice(self, j: int, text: Optional[str], ids, lps, tops, finish, stop_reason, versions, prompt_ids=None,
                tool_calls: Optional[list] = None) -> dict:
        if tool_calls:
            finish = "tool_calls"
        ch: dict[str, Any] = {"index": j, "logprobs": self._logprobs(j, ids, lps, tops), "finish_reason": finish}
        if finish is not None:
            ch["stop_reason"] = stop_reason
        if not self.chat:
            ch["text"] = text
        else:
            ch["delta" if self.req.stream else "message"] = msg = {"content": text} if self.req.stream else \
                {"role": "assistant", "content": text}
            if tool_calls:
                msg["tool_calls"] = [{"index": i, **c} for i, c in enumerate(tool_calls)] if self.req.stream \
                    else tool_calls
        if self.req.return_token_ids:
            ch["token_ids"], ch["policy_versions"] = list(ids), list(versions)
            if prompt_ids is not None and not self.chat:
                ch["prompt_token_ids"] = prompt_ids
        return ch

    def _envelope(self, choices: list, usage: Optional[dict] = None, prompt: bool = False) -> dict:
        obj = self.object + (".chunk" if self.chat and self.req.stream else "")
        body = {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        if prompt and self.chat and self.req.return_token_ids:    # vLLM puts a chat's prompt ids here
            body["prompt_token_ids"] = self.prompts[0]
        return body

    def usage(self, completion_tokens: int) -> dict:
        p = sum(len(x) for x in self.prompts)
        return {"prompt_tokens": p, "completion_tokens": completion_tokens, "total_tokens": p + completion_tokens}

    def response(self, outs: list[RequestOutput]) -> dict:
        choices, ntok = [], 0
        for p, out in enumerate(outs):         # prompt-major: the n choices of prompt 0, then prompt 1
            for i, c in enumerate(out.completions):
                j = p * self.req.n + i
                text, calls = parse_tool_calls(c.text or "") if self.tools else (c.text or "", [])
                choices.append(self._choice(j, text, c.token_ids, getattr(c, self.field), c.top_logprobs,
                                            c.finish_reason, c.stop_reason, c.policy_versions, out.prompt_token_ids,
                                            calls))
                ntok += len(c.token_ids)
        return self._envelope(choices, self.usage(ntok), prompt=True)

    def first_chunks(self) -> list[dict]:
        if not self.chat:
            return []
        return [self._envelope([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}], prompt=True) for j in range(len(self._ids))]

    def _text_delta(self, j: int, new_ids: list[int]) -> str:
        ids = self._ids[j]
        ids.extend(new_ids)
        if self.tok is None:
            return ""
        skip, upto = self.req.skip_special_tokens, self._upto[j]
        ctx = max(0, upto - 4)            # decode a short window: byte-level merges need a little context
        before = self.tok.decode(ids[ctx:upto], skip_special_tokens=skip)
        now = self.tok.decode(ids[ctx:], skip_special_tokens=skip)
        if now.endswith("\ufffd"):        # a multi-byte character not complete yet
            return ""
        self._upto[j] = len(ids)
        if self._stopped[j]:
            return ""
        sent, held = self._text[j], self._held[j] + now[len(before):]
        both = sent + held
        cuts = [i for i in (both.find(x, max(0, len(sent) - self._hold)) for x in self._cut_at) if i >= 0]
        if cuts:                          # send the text before the stop string or tool call, then wait
            out, self._stopped[j], self._held[j] = both[len(sent):max(len(sent), min(cuts))], True, ""
        else:
            out = held[:max(0, len(held) - self._hold)]
            self._held[j] = held[len(out):]
        self._text[j] += out
        return out

    def delta_chunk(self, p: int, i: int, d) -> dict:
        j = p * self.req.n + i
        first = not self._ids[j]
        text = self._text_delta(j, d.token_ids)
        return self._envelope([self._choice(j, text, d.token_ids, getattr(d, self.field), d.top_logprobs, None, None,
                                            d.policy_versions, self.prompts[p] if first else None)])

    def final_chunks(self, p: int, out: RequestOutput) -> tuple[list[dict], int]:
        chunks, ntok = [], 0
        for i, c in enumerate(out.completions):
            j = p * self.req.n + i
            k = len(self._ids[j])
            tail, sent = c.token_ids[k:], len(self._text[j])
            text, calls = self._text_delta(j, tail), []
            if c.text is not None:        # the engine's final text (stop strings cut), tool calls parsed out
                content, calls = parse_tool_calls(c.text) if self.tools else (c.text, [])
                text = (content or "")[sent:]
            top = c.top_logprobs[k:] if c.top_logprobs is not None else None
            chunks.append(self._envelope([self._choice(j, text, tail, getattr(c, self.field)[k:], top,
                                                       c.finish_reason, c.stop_reason, c.policy_versions[k:],
                                                       out.prompt_token_ids if k == 0 else None, calls)]))
            ntok += len(c.token_ids)
        return chunks, ntok
