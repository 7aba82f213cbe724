"""FastAPI routes over one EngineLoop: OpenAI-compatible completions and chat (vLLM's extensions),
native token-in / token-out `/generate`, control (pause / resume / abort), Prometheus metrics and
the three weight transports. Handlers validate, enqueue and await; only the loop touches the engine,
from a thread of this process (a RolloutWorker given) or from a process of its own (an EngineProcess)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import uuid
from dataclasses import dataclass, fields
from typing import Optional

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .loop import LocalLoop
from .protocol import (AbortRequest, ChatRequest, CompletionRequest, DiskUpdate, Formatter, GenerateRequest,
                       GroupInit, GroupUpdate, IPCUpdate, TOOL_CALL_PARSERS, batch_of_ids, native_completion,
                       native_params)


@dataclass
class ServeOptions:
    served_model_name: str = "rollout"
    api_key: Optional[str] = None          # Bearer key on every route but /health
    admin_key: Optional[str] = None        # if set, the weight and control routes take this key instead
    max_body_bytes: int = 64 << 20         # larger bodies: 413
    max_queued_requests: int = 1024        # prompts waiting for a batch slot; past it 429 + Retry-After
    # an idle connection is closed after this; longer than clients' own keep-alive (httpx and openai: 5 s),
    # else a client can reuse a connection just as the server closes it and its POST is reset unanswered
    keep_alive_s: float = 75.0
    # open connections (idle ones included) past which a request gets 503 and the socket is closed, so idle
    # keep-alive connections cannot pile up without bound; None: no cap
    max_connections: Optional[int] = 2048
    logprobs_mode: str = "tempered"        # which logprobs fill OpenAI's field: tempered (ours) | processed
    stream_interval: int = 1               # tokens per stream chunk (the first token is sent at once)
    # chat replies to requests with tools: "hermes" parses <tool_call>{json}</tool_call> blocks (Qwen2.5 / Qwen3,
    # Hermes) into OpenAI tool_calls, as vLLM's --enable-auto-tool-choice --tool-call-parser hermes; None: text
    tool_call_parser: Optional[str] = None
    # `python -m rollout.serve`: the engine loop in a process of its own (no GIL shared with the HTTP
    # side), else on a thread of the server's process
    engine_process: bool = True


def _json(body, status: int = 200, headers=None) -> Response:
    return Response(json.dumps(body, separators=(",", ":")), status, headers, media_type="application/json")


def _error(status: int, message: str, headers=None) -> Response:     # OpenAI's error shape
    kind = "invalid_request_error" if status < 500 else "server_error"
    return _json({"error": {"message": message, "type": kind, "code": status}}, status, headers)


class BodyLimit:
    """ASGI middleware: 413 for a body over max_bytes (by Content-Length, or counted as it arrives)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_big = _error(413, f"request body over {self.max_bytes} bytes")
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await too_big(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            size, more = size + len(chunks[-1]), msg.get("more_body", False)
            if size > self.max_bytes:
                return await too_big(scope, receive, send)
        first = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():               # then the real receive: the disconnect watchers wait on it
            return first.pop() if first else await receive()
        await self.app(scope, replay, send)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Server:
    def __init__(self, side, opts: ServeOptions):
        self.side, self.opts = side, opts          # side: a LocalLoop or an EngineProcess
        self.loop = side.client
        self.info: dict = {}                       # the engine's static facts (EngineLoop.info), at start-up
        self.tokenizer = None
        self.closing = False
        self.rejected = 0

    async def start(self) -> None:
        if hasattr(self.side, "launch"):           # an engine process: built there (weights, graphs)
            await asyncio.to_thread(self.side.launch)
        self.side.start(asyncio.get_running_loop())
        self.info = await self.loop.call("info")
        self.tokenizer = self.info["tokenizer"]

    # ---- generation ----------------------------------------------------------------------------
    async def _watch(self, request: Request, aw, tag: str):
        """Await `aw`; a client that disconnects meanwhile aborts its requests (pages freed)."""
        task, gone = asyncio.ensure_future(aw), asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not task.done():
            task.cancel()
            self.loop.abort(tag)
            raise HTTPException(499, "client disconnected")
        return task.result()

    async def run(self, request: Request, tag: str, prompts: list[list[int]], params: list,
                  fmt: Optional[Formatter] = None):
        if self.closing:
            raise HTTPException(503, "the server is shutting down")
        if len(prompts) > self.opts.max_queued_requests:      # would never fit: retrying cannot help
            raise HTTPException(400, f"prompt: {len(prompts)} prompts in one request, over max_queued_requests="
                                     f"{self.opts.max_queued_requests}")
        if self.loop.waiting_requests() + len(prompts) > self.opts.max_queued_requests:
            self.rejected += 1
            raise HTTPException(429, f"more than max_queued_requests={self.opts.max_queued_requests} prompts "
                                     f"waiting; retry later", {"Retry-After": "1"})
        stream = fmt is not None and fmt.req.stream
        q, streaming = self.loop.open(tag), False
        try:
            self.loop.add(tag, prompts, params, self.opts.stream_interval if stream else 0)
            _check(await self._watch(request, q.get(), tag))
            if stream:                    # from here the stream closes the queue
                streaming = True
                return StreamingResponse(self._sse(fmt, q, tag, len(prompts)), media_type="text/event-stream")

            async def collect():
                outs = [None] * len(prompts)
                for _ in prompts:
                    _, index, out = _check(await q.get())
                    outs[index] = out
                return outs
            outs = await self._watch(request, collect(), tag)
        finally:
            if not streaming:
                self.loop.close(tag)
        return outs if fmt is None else _json(fmt.response(outs))

    async def _sse(self, fmt: Formatter, q: asyncio.Queue, tag: str, num_prompts: int):
        done = False
        try:
            yield "".join(_event(c) for c in fmt.first_chunks())
            left, ntok = num_prompts, 0
            while left:
                items = [await q.get()]
                while not q.empty():      # everything that landed meanwhile goes out in one write
                    items.append(q.get_nowait())
                chunks = []
                for item in items:
                    if item[0] == "error":    # the engine side is gone: an error event ends the stream (as vLLM's)
                        yield _event({"error": {"message": f"generation failed: {item[1]}", "type": "server_error",
                                                "code": 503}}) + "data: [DONE]\n\n"
                        done = True
                        return
                    if item[0] == "delta":
                        chunks.append(fmt.delta_chunk(*item[1:]))
                    elif item[0] == "done":
                        more, k = fmt.final_chunks(item[1], item[2])
                        chunks += more
                        ntok, left = ntok + k, left - 1
                yield "".join(_event(c) for c in chunks)
            opts = fmt.req.stream_options
            if opts is not None and opts.include_usage:
                yield _event(fmt._envelope([], fmt.usage(ntok)))
            yield "data: [DONE]\n\n"
            done = True
        finally:
            self.loop.close(tag)
            if not done:                  # the client went away mid-stream
                self.loop.abort(tag)

    def _check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.opts.served_model_name:
            raise HTTPException(404, f"model {model!r} is not served here; this server serves "
                                     f"{self.opts.served_model_name!r}")

    def _tokenize(self, prompt) -> list[list[int]]:
        ids = batch_of_ids(prompt)
        if ids is not None:
            return ids
        if self.tokenizer is None:
            raise HTTPException(400, "prompt is text but the model has no tokenizer; send token ids")
        return [self.tokenizer(p).input_ids for p in ([prompt] if isinstance(prompt, str) else prompt)]

    def _chat_prompt(self, body: ChatRequest) -> list[int]:
        tok = self.tokenizer
        if tok is None or (body.chat_template is None and not getattr(tok, "chat_template", None)):
            raise HTTPException(400, "the model's tokenizer has no chat template; pass chat_template or use "
                                     "/v1/completions")
        messages = [{**m, "content": _text_of(m["content"])} if isinstance(m.get("content"), list) else m
                    for m in body.messages]
        try:
            out = tok.apply_chat_template(
                messages, tools=body.tools, chat_template=body.chat_template, tokenize=True, return_dict=True,
                add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
                continue_final_message=body.continue_final_message, **(body.chat_template_kwargs or {}))
        except Exception as exc:          # jinja errors, bad roles: the caller's input
            raise HTTPException(400, f"messages: the chat template failed: {exc}") from exc
        return list(out["input_ids"])

    async def _openai(self, request: Request, body, prompts: list[list[int]], max_tokens, top: int, prefix: str):
        self._check_model(body.model)
        params = [body.to_params(len(p), self.info["max_model_len"], max_tokens, top) for p in prompts]
        rid = body.request_id or f"{prefix}-{uuid.uuid4().hex}"
        fmt = Formatter(body, rid, self.opts.served_model_name, self.tokenizer, prompts, self.opts.logprobs_mode,
                        self.opts.tool_call_parser)
        return await self.run(request, rid, prompts, params, fmt)

    async def completions(self, body: CompletionRequest, request: Request):
        if body.logprobs is not None and body.logprobs < 0:
            raise HTTPException(400, f"logprobs must be null or an integer >= 0, got {body.logprobs}")
        if body.echo:
            raise HTTPException(400, "echo=true (the prompt's logprobs) is not supported")
        return await self._openai(request, body, self._tokenize(body.prompt), body.max_tokens, body.logprobs or 0,
                                  "cmpl")

    async def chat(self, body: ChatRequest, request: Request):
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        top = (body.top_logprobs or 0) if body.logprobs else 0
        return await self._openai(request, body, [self._chat_prompt(body)], max_tokens, top, "chatcmpl")

    async def generate(self, body: GenerateRequest, request: Request):
        prompts = batch_of_ids(body.input_ids) or [[]]
        sp = body.sampling_params
        if isinstance(sp, list) and len(sp) != len(prompts):
            raise HTTPException(400, f"sampling_params: {len(sp)} dicts for {len(prompts)} prompts")
        params = [native_params(d) for d in sp] if isinstance(sp, list) else [native_params(sp)] * len(prompts)
        rid = body.request_id or f"gen-{uuid.uuid4().hex}"
        outs = await self.run(request, rid, prompts, params)
        return _json({"id": rid, "outputs": [{"prompt_token_ids": o.prompt_token_ids, "error": o.error,
                                              "completions": [native_completion(c) for c in o.completions]}
                                             for o in outs]})

    # ---- weights: read, staged whole and checked on the engine side while decode goes on -----------
    async def update_from_disk(self, body: DiskUpdate):
        return _json(await self.loop.call("stage_disk", body.path, body.version))

    async def update_from_ipc(self, body: IPCUpdate):
        return _json(await self.loop.call("stage_ipc", body.handles, body.version))

    async def init_group(self, body: GroupInit):
        return _json(await self.loop.call("join_group", body.master_address, body.master_port, body.world_size,
                                          body.rank_offset, body.backend, body.timeout_s))

    async def update_from_group(self, body: GroupUpdate):
        return _json(await self.loop.call("stage_group", body.version, body.bucket_bytes))

    # ---- metrics ----------------------------------------------------------------------------------
    async def metrics(self) -> Response:
        rows = await self.loop.call("metric_rows")     # one consistent view between steps
        rows += [("requests_waiting", self.loop.waiting_requests()), ("requests_rejected_total", self.rejected)]
        return Response("".join(f"# TYPE rollout_{n} {'counter' if n.endswith('_total') else 'gauge'}\n"
                                f"rollout_{n} {float(v)}\n" for n, v in rows), media_type="text/plain; version=0.0.4")


def _check(item: tuple) -> tuple:
    """A request's event, or the HTTP error its engine-side failure maps to."""
    if item[0] == "error":
        raise HTTPException(400 if isinstance(item[1], (ValueError, TypeError)) else 503, str(item[1]))
    return item


def _text_of(content: list) -> str:
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text")


def _event(chunk: dict) -> str:
    return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"


def _key_check(server: Server, admin: bool):
    async def check(request: Request):
        key = server.opts.admin_key if admin and server.opts.admin_key else server.opts.api_key
        got = request.headers.get("authorization", "")
        if key is not None and not secrets.compare_digest(got.encode(), f"Bearer {key}".encode()):
            raise HTTPException(401, "invalid or missing API key" + (" (admin route)" if admin else ""))
    return Depends(check)


def build_app(engine, opts: Optional[ServeOptions] = None) -> FastAPI:
    """The ASGI app over `engine`: a RolloutWorker (its loop runs on a thread of this process) or a
    remote.EngineProcess (the loop in a process of its own). The loop starts and stops with the app."""
    opts = opts or ServeOptions()
    alive = opts.keep_alive_s
    if isinstance(alive, bool) or not isinstance(alive, (int, float)) or not alive > 0:
        raise ValueError(f"keep_alive_s must be a number of seconds > 0, got {alive!r}")
    # every int option is a size, count or interval: a 0 would refuse every request (or, for stream_interval,
    # stream nothing), a mistake, not a setting; an Optional one's None means no bound
    for f in fields(opts):
        value, optional = getattr(opts, f.name), f.type == "Optional[int]"
        if f.type not in ("int", "Optional[int]") or (optional and value is None):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{f.name} must be an int >= 1{' or None' if optional else ''}, got {value!r}")
    if opts.logprobs_mode not in ("tempered", "processed"):
        raise ValueError(f"logprobs_mode must be 'tempered' or 'processed', got {opts.logprobs_mode!r}")
    if opts.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
        raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS} or unset, got {opts.tool_call_parser!r}")
    server = Server(engine if hasattr(engine, "client") else LocalLoop(engine), opts)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await server.start()
        try:
            yield
        finally:
            server.closing = True
            await asyncio.to_thread(server.side.stop)

    app = FastAPI(title="rollout", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(BodyLimit, max_bytes=opts.max_body_bytes)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        return _error(exc.status_code, str(exc.detail), exc.headers)

    @app.exception_handler(ValueError)    # SamplingParams / weight validation: the caller's input
    async def value_error(request, exc: ValueError):
        return _error(400, str(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        def where(e):
            return "body" if e["type"] == "json_invalid" else ".".join(str(x) for x in e["loc"] if x != "body")
        return _error(400, "; ".join(f"{where(e) or 'body'}: {e['msg']}" for e in exc.errors()))

    user, admin = [_key_check(server, False)], [_key_check(server, True)]

    @app.get("/health")
    async def health():
        ok = server.loop.alive() and not server.closing
        return _json({"status": "ok" if ok else "unavailable"}, 200 if ok else 503)

    @app.get("/v1/models", dependencies=user)
    async def models():
        info = server.info
        return _json({"object": "list", "data": [{
            "id": opts.served_model_name, "object": "model", "owned_by": "rollout",
            "max_model_len": info["max_model_len"], "vocab_size": info["vocab_size"],
            "policy_version": server.loop.policy_version}]})

    app.post("/v1/completions", dependencies=user)(server.completions)
    app.post("/v1/chat/completions", dependencies=user)(server.chat)
    app.post("/generate", dependencies=user)(server.generate)
    app.get("/metrics", dependencies=user)(server.metrics)

    @app.get("/weights_info", dependencies=user)
    async def weights_info():
        return _json({**await server.loop.call("weights_info"), "tensors": server.info["tensor_specs"]})

    @app.post("/pause", dependencies=admin)
    async def pause(request: Request, mode: Optional[str] = None):
        body = await request.body()
        mode = mode or (json.loads(body).get("mode") if body else None) or "keep"
        if mode not in ("keep", "abort", "wait"):
            raise HTTPException(400, f"mode must be 'keep', 'abort' or 'wait', got {mode!r}")
        return _json({"paused": await server.loop.call("pause", mode), "mode": mode})

    @app.post("/resume", dependencies=admin)
    async def resume():
        await server.loop.call("resume")
        return _json({"paused": False})

    @app.post("/abort", dependencies=admin)
    async def abort(body: AbortRequest):
        tags = body.request_ids + ([body.request_id] if body.request_id else [])
        found = [t for t in tags if await server.loop.call("abort_tag", t)]
        return _json({"aborted": found})

    # vLLM's sleep-mode routes (levels: RolloutEngine.sleep); generation while asleep answers 503
    @app.post("/sleep", dependencies=admin)
    async def sleep(level: int = 1, discard_weights: bool = False):
        try:
            return _json(await server.loop.call("sleep", level, discard_weights))
        except RuntimeError as exc:       # requests still running
            raise HTTPException(409, str(exc)) from None

    @app.post("/wake_up", dependencies=admin)
    async def wake_up(tags: Optional[list[str]] = Query(None)):
        return _json(await server.loop.call("wake", tags))

    @app.get("/is_sleeping", dependencies=user)
    async def is_sleeping():
        level = await server.loop.call("sleep_level")
        return _json({"is_sleeping": level > 0, "level": level})

    app.post("/update_weights_from_disk", dependencies=admin)(server.update_from_disk)
    app.post("/update_weights_from_ipc", dependencies=admin)(server.update_from_ipc)
    app.post("/init_weight_group", dependencies=admin)(server.init_group)
    app.post("/update_weights_from_group", dependencies=admin)(server.update_from_group)
    return app
