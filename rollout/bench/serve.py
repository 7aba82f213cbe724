"""The HTTP server against the engine in-process, and a weight update through the server.

    # 64 prompts x n=8, P=256, G=4096 on Qwen2.5-1.5B random weights: in-process, and as 64 concurrent
    # streaming /v1/completions requests (token ids in, return_token_ids, logprobs=0) to a server process
    python -m rollout.bench.serve throughput --shape qwen2.5-1.5b --out bench/results/<name>.json
    # Llama-3-8B: a trainer process on the same GPU sends new weights by CUDA IPC while the server
    # decodes; staging time and the decode stall (weights/barrier_ms)
    python -m rollout.bench.serve ipc --shape llama3-8b --out ...
    # two GPUs: a trainer on cuda:0 broadcasts 8B weights over NCCL to the server on cuda:1 while it decodes
    NCCL_NVLS_ENABLE=0 python -m rollout.bench.serve group --shape llama3-8b --out ...
    # CPU smoke: throughput --shape tiny --device cpu --dtype float32 --prompts 4 --n 2 --prompt-len 16 --gen-len 16

The server runs in a child process over the same seeded random weights, its engine loop in a process
of its own (`python -m rollout.serve`'s default) and, in throughput mode, also on a thread beside the
event loop (`--engines`). tok/s =
generated tokens / wall of the whole workload; time to first token per HTTP request (p50 / p99).
Target: HTTP >= 90% of in-process.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import statistics
import time
from functools import partial

import torch

from ..weights import free_port
from .__main__ import run_meta, write_json
from .fleet import _prompts, random_engine
from .shapes import SHAPES, make_config


def _pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[int(q) - 1] if len(xs) > 1 else (xs[0] if xs else float("nan"))


def _engine_kwargs(args, seqs: int) -> dict:
    return dict(max_model_len=args.prompt_len + args.gen_len + 8, max_num_seqs=seqs, kv_cache_memory=args.kv_bytes,
                max_num_batched_tokens=args.max_batched_tokens, reserve_memory="weights" if args.mode == "ipc" else 0)


def _random_worker(shape: str, device: str, dtype: str, kw: dict):
    from ..worker import RolloutWorker
    return RolloutWorker(random_engine(shape, 0, device, dtype, kw))


def _serve_child(args, kw: dict, engine_process: bool, port: int) -> None:
    """The server over seeded random weights: its engine loop in a process of its own (the CLI's
    default) or on a thread of the HTTP process."""
    from ..serve import ServeOptions, serve
    from ..serve.remote import EngineProcess
    make = partial(_random_worker, args.shape, args.device, args.dtype, kw)
    # every prompt is one concurrent request on a connection of its own: no queue or connection bound
    serve(EngineProcess(make) if engine_process else make(),
          ServeOptions(served_model_name="bench", stream_interval=args.stream_interval, max_queued_requests=1 << 20,
                       max_connections=None),
          port=port, log_level="warning")


def _on_gpu(gpu, child, *child_args) -> None:
    import os
    if gpu is not None:    # before CUDA starts in this process: that GPU is its cuda:0
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    child(*child_args)


@contextlib.contextmanager
def server_process(child, *child_args, gpu=None):
    """`child(*child_args, port)` serving in a spawned process (no shared GIL), on physical GPU `gpu` if
    given, up and warmed; its URL."""
    import httpx
    from ..client import RolloutClient
    port = free_port("127.0.0.1")
    # not a daemon: the server may start an engine process of its own (terminated below either way)
    proc = mp.get_context("spawn").Process(target=_on_gpu, args=(gpu, child, *child_args, port))
    proc.start()
    url, deadline = f"http://127.0.0.1:{port}", time.time() + 1800     # an 8B draw and graph capture take a while
    while not RolloutClient(url).health():
        if not proc.is_alive() or time.time() > deadline:
            raise RuntimeError("the benchmark server did not come up")
        time.sleep(0.5)
    try:
        httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 8}, timeout=600)   # warm-up
        yield url
    finally:
        proc.terminate()
        proc.join(120)


def _server(args, kw: dict, engine_process: bool = True):
    """The benchmark server over the seeded random weights."""
    return server_process(_serve_child, args, kw, engine_process, gpu=args.server_gpu)


async def _stream_all(url: str, prompts, body: dict) -> dict:
    """Every prompt as one concurrent streaming request; tokens, each request's token versions and
    time to first token."""
    import httpx
    t0 = time.perf_counter()
    ttft, tokens, versions = [], [0], []

    async def one(c, prompt):
        start, first, mine = time.perf_counter(), None, []
        versions.append(mine)
        async with c.stream("POST", "/v1/completions", json={**body, "prompt": prompt, "stream": True}) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:      # the server's error event: say what failed
                    raise RuntimeError(f"the server ended the stream: {event['error']['message']}")
                for ch in event["choices"]:
                    if ch["token_ids"] and first is None:
                        first = time.perf_counter() - start
                    tokens[0] += len(ch["token_ids"])
                    mine.extend(ch["policy_versions"])
        ttft.append(first)
    limits = httpx.Limits(max_connections=len(prompts) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as c:
        await asyncio.gather(*(one(c, p) for p in prompts))
    wall = time.perf_counter() - t0
    return dict(wall_s=wall, tokens=tokens[0], tok_s=tokens[0] / wall, ttft_p50_ms=_pct(ttft, 50) * 1e3,
                ttft_p99_ms=_pct(ttft, 99) * 1e3, versions=versions)


def throughput(args) -> dict:
    from ..request import SamplingParams
    from ..worker import RolloutWorker
    cfg = make_config(args.shape)
    P, G, n = args.prompt_len, args.gen_len, args.n
    kw = _engine_kwargs(args, args.prompts * n)
    prompts = _prompts(args.prompts, P, cfg.vocab_size, seed=0)
    body = {"n": n, "max_tokens": G, "temperature": 1.0, "ignore_eos": True, "logprobs": 0, "return_token_ids": True}
    https = {}
    for engines in args.engines.split(","):   # servers first: their GPU memory is surely free once they are gone
        with _server(args, kw, engine_process=engines == "process") as url:
            https[engines] = asyncio.run(_stream_all(url, prompts, body))
            https[engines].pop("versions")
    worker = RolloutWorker(random_engine(args.shape, 0, args.device, args.dtype, kw))
    worker.generate(prompts[:2], SamplingParams(max_new_tokens=8, ignore_eos=True))      # warm-up
    t0 = time.perf_counter()
    outs = worker.generate(prompts, SamplingParams(n=n, max_new_tokens=G, temperature=1.0, ignore_eos=True))
    wall = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for o in outs for c in o.completions)
    inproc = dict(wall_s=wall, tokens=tokens, tok_s=tokens / wall)
    print(f"in-process {inproc['tok_s']:.0f} tok/s", flush=True)
    out = dict(in_process=inproc, target=0.9)
    for engines, http in https.items():
        key = "http" if engines == "process" else "http_engine_thread"
        ratio = http["tok_s"] / inproc["tok_s"]
        print(f"HTTP, engine loop on a {engines}: {http['tok_s']:.0f} tok/s ({ratio:.1%}; target >= 90%); first token "
              f"p50 {http['ttft_p50_ms']:.0f} ms, p99 {http['ttft_p99_ms']:.0f} ms", flush=True)
        out.update({key: http, f"{key}_over_in_process": ratio})
    out["all_completed"] = all(h["tokens"] == inproc["tokens"] == args.prompts * n * G for h in https.values())
    return out


def ipc(args) -> dict:
    """Staging time and decode stall of a CUDA-IPC update landing while the server decodes."""
    from ..client import RolloutClient
    from .pressure import random_model
    if args.device != "cuda":
        raise SystemExit("the ipc mode needs CUDA (CUDA IPC shares device memory between processes)")
    cfg = make_config(args.shape)
    P, G = args.prompt_len, args.gen_len
    with _server(args, _engine_kwargs(args, args.prompts)) as url:
        new = random_model(cfg, getattr(torch, args.dtype), torch.device("cuda"), seed=1).hf_targets()
        client, result = RolloutClient(url), {}

        async def decode_and_update():
            body = {"max_tokens": G, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            task = asyncio.ensure_future(_stream_all(url, _prompts(args.prompts, P, cfg.vocab_size, 0), body))
            await asyncio.sleep(args.update_after_s)
            t0 = time.perf_counter()
            result["response"] = await asyncio.to_thread(client.update_weights_from_ipc, new.items(), 1)
            result["update_wall_ms"] = (time.perf_counter() - t0) * 1e3
            return await task
        decode = asyncio.run(decode_and_update())
        m = client.metrics()
    versions = decode.pop("versions")
    result.update(staging_ms=m["rollout_weight_staging_ms_total"], barrier_ms=m["rollout_weight_barrier_ms_total"],
                  barrier_launch_ms=m.get("rollout_weight_barrier_launch_ms"),
                  tokens_after_update=sum(v == 1 for vs in versions for v in vs), decode=decode,
                  all_completed=decode["tokens"] == args.prompts * G and m["rollout_policy_version"] == 1)
    print(f"IPC update: {result['update_wall_ms']:.0f} ms end to end, staging {result['staging_ms']:.1f} ms, "
          f"decode stall (barrier) {result['barrier_ms']:.2f} ms; {result['tokens_after_update']} tokens on v1",
          flush=True)
    return result


def _versions_exact(versions: list[list[int]]) -> bool:
    """Each request's tokens: a run of version 0, then only version 1 (no token after the switch on 0)."""
    return all(vs == sorted(vs) and set(vs) <= {0, 1} for vs in versions)


def group(args) -> dict:
    """A trainer (this process) broadcasts new weights to the server over a torch.distributed group
    (NCCL between two GPUs, gloo on CPU) while the server decodes; then the server's greedy outputs
    against a fresh engine built on the new weights."""
    from ..client import RolloutClient
    from ..request import SamplingParams
    from .pressure import random_model
    cuda = args.device == "cuda"
    if cuda and torch.cuda.device_count() < 2:
        raise SystemExit("the group mode on CUDA needs two GPUs: the trainer on cuda:0, the server on --server-gpu")
    if cuda and args.server_gpu is None:
        args.server_gpu = 1
    cfg = make_config(args.shape)
    P, G, dtype = args.prompt_len, args.gen_len, getattr(torch, args.dtype)
    trainer = torch.device("cuda:0" if cuda else "cpu")
    check = _prompts(args.check_prompts, P, cfg.vocab_size, seed=7)
    check_params = SamplingParams(max_new_tokens=args.check_len, temperature=0.0, ignore_eos=True)
    with _server(args, _engine_kwargs(args, args.prompts)) as url:
        client, result = RolloutClient(url), {}
        new = random_model(cfg, dtype, trainer, seed=1).hf_targets()
        nbytes = sum(t.numel() * t.element_size() for t in new.values())
        t0 = time.perf_counter()
        client.init_weight_group(backend="nccl" if cuda else "gloo")
        result["group_init_ms"] = (time.perf_counter() - t0) * 1e3

        async def decode_and_update():
            body = {"max_tokens": G, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            task = asyncio.ensure_future(_stream_all(url, _prompts(args.prompts, P, cfg.vocab_size, 0), body))
            await asyncio.sleep(args.update_after_s)
            t0 = time.perf_counter()
            result["response"] = await asyncio.to_thread(client.update_weights_from_group, new.items(), 1,
                                                         args.bucket_mb << 20)
            result["update_wall_ms"] = (time.perf_counter() - t0) * 1e3
            return await task
        decode = asyncio.run(decode_and_update())
        m = client.metrics()
        served = client.generate(check, check_params)
        client.close_weight_group()
    new = None     # the trainer's copy: freed before the fresh engine
    if cuda:
        torch.cuda.empty_cache()
    fresh = random_engine(args.shape, 1, str(trainer), args.dtype, _engine_kwargs(args, args.check_prompts))
    ref = fresh.generate(check, check_params, use_tqdm=False)
    pairs = [(a.completions[0], b.completions[0]) for a, b in zip(served, ref)]
    versions = decode.pop("versions")
    result.update(
        weight_bytes=nbytes, transfer_gb_s=nbytes / (result["update_wall_ms"] / 1e3) / 1e9,
        staging_ms=m["rollout_weight_staging_ms_total"], barrier_ms=m["rollout_weight_barrier_ms_total"],
        barrier_launch_ms=m.get("rollout_weight_barrier_launch_ms"),
        tokens_after_update=sum(v == 1 for vs in versions for v in vs), versions_exact=_versions_exact(versions),
        decode=decode, after_update_equal_fresh=all(a.token_ids == b.token_ids for a, b in pairs),
        after_update_max_abs_dlogp=max(abs(x - y) for a, b in pairs for x, y in zip(a.logprobs, b.logprobs)),
        after_update_versions=sorted({v for a, _ in pairs for v in a.policy_versions}),
        all_completed=decode["tokens"] == args.prompts * G and m["rollout_policy_version"] == 1)
    print(f"group update ({'nccl' if cuda else 'gloo'}): {nbytes / 1e9:.2f} GB in {result['update_wall_ms']:.0f} ms "
          f"({result['transfer_gb_s']:.1f} GB/s), staging {result['staging_ms']:.1f} ms, decode stall (barrier) "
          f"{result['barrier_ms']:.2f} ms; {result['tokens_after_update']} tokens on v1, versions exact "
          f"{result['versions_exact']}; after it equal to a fresh engine {result['after_update_equal_fresh']}",
          flush=True)
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("throughput", "ipc", "group"))
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES), help="qwen2.5-1.5b / llama3-8b by mode")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=None, help="throughput: 64 prompts; ipc: 32 sequences")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=None, help="4096 (throughput) / 1024 (ipc)")
    ap.add_argument("--stream-interval", type=int, default=16, help="tokens per stream chunk (ServeOptions)")
    ap.add_argument("--engines", default="process,thread",
                    help="throughput: where the server's engine loop runs, each measured (process: its own)")
    ap.add_argument("--update-after-s", type=float, default=10.0)
    ap.add_argument("--kv-bytes", type=int, default=None)
    ap.add_argument("--max-batched-tokens", type=int, default=4096)
    ap.add_argument("--server-gpu", type=int, default=None, help="group: the server's GPU (1); the trainer takes 0")
    ap.add_argument("--bucket-mb", type=int, default=256, help="group: broadcast bucket size")
    ap.add_argument("--check-prompts", type=int, default=4, help="group: greedy prompts compared with a fresh engine")
    ap.add_argument("--check-len", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    tput = args.mode == "throughput"
    args.shape = args.shape or ("qwen2.5-1.5b" if tput else "llama3-8b")
    args.prompts = args.prompts or (64 if tput else 32)
    args.gen_len = args.gen_len or (4096 if tput else 1024)
    if not tput:                          # sized: the trainer's copy of the weights shares the GPU
        args.kv_bytes = args.kv_bytes or 16 << 30
    result = throughput(args) if tput else ipc(args) if args.mode == "ipc" else group(args)
    import importlib.util             # uvicorn takes uvloop / httptools where installed (uvicorn[standard])
    fast = {m: importlib.util.find_spec(m) is not None for m in ("uvloop", "httptools")}
    result.update(mode=args.mode, shape=args.shape, dtype=args.dtype, prompts=args.prompts, n=args.n if tput else 1,
                  prompt_len=args.prompt_len, gen_len=args.gen_len, stream_interval=args.stream_interval,
                  server_libs=fast, meta=run_meta("rollout.bench.serve", argv))
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
