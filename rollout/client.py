"""RolloutClient: a small synchronous httpx client for `python -m rollout.serve`.

    client = RolloutClient("http://127.0.0.1:8000")
    outs = client.generate([[1, 2, 3]], SamplingParams(n=4, max_new_tokens=32))   # RequestOutputs
    client.update_weights_from_group(model.named_parameters(), version=1)         # after init_weight_group()

Weights go as a safetensors folder the server can read, CUDA IPC handles (same node), or over a
torch.distributed group where this process is rank 0 (rollout.weights.send_weights).
"""
from __future__ import annotations

import base64
import contextlib
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Optional, Union

import httpx

from .request import Completion, RequestOutput, SamplingParams


class ServerError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message


def _output(index: int, o: dict) -> RequestOutput:
    comps = [Completion(**{**c, "top_logprobs": None if c["top_logprobs"] is None else
                           [{int(k): v for k, v in d.items()} for d in c["top_logprobs"]]}) for c in o["completions"]]
    return RequestOutput(index, o["prompt_token_ids"], comps, error=o.get("error"))


def _fields(p: Union[SamplingParams, dict, None]) -> dict:
    return dataclasses.asdict(p) if isinstance(p, SamplingParams) else dict(p or {})


class RolloutClient:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: Optional[str] = None,
                 admin_key: Optional[str] = None, timeout: float = 600.0):
        self.http = httpx.Client(base_url=base_url, timeout=timeout)
        self._user = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        key = admin_key or api_key
        self._admin = {"Authorization": f"Bearer {key}"} if key else {}
        self._group_backend: Optional[str] = None     # set while this client owns a weight group

    def _call(self, method: str, path: str, admin: bool = False, **kw):
        r = self.http.request(method, path, headers=self._admin if admin else self._user, **kw)
        if r.status_code != 200:
            try:
                msg = r.json()["error"]["message"]
            except Exception:
                msg = r.text
            raise ServerError(r.status_code, msg)
        return r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text

    # ---- generation -------------------------------------------------------------------------
    def generate(self, input_ids, sampling_params=None, request_id: Optional[str] = None) -> list[RequestOutput]:
        """Native /generate: one prompt (ids) or a batch; SamplingParams (or a dict, or one per prompt)."""
        sp = [_fields(p) for p in sampling_params] if isinstance(sampling_params, list) else _fields(sampling_params)
        body = {"input_ids": input_ids, "sampling_params": sp, **({"request_id": request_id} if request_id else {})}
        return [_output(i, o) for i, o in enumerate(self._call("POST", "/generate", json=body)["outputs"])]

    def completions(self, prompt, **fields) -> dict:
        return self._call("POST", "/v1/completions", json={"prompt": prompt, **fields})

    def chat(self, messages: list[dict], **fields) -> dict:
        return self._call("POST", "/v1/chat/completions", json={"messages": messages, **fields})

    # ---- control ------------------------------------------------------------------------------
    def health(self) -> bool:
        try:
            return self.http.get("/health").status_code == 200
        except httpx.TransportError:
            return False

    def models(self) -> dict:
        return self._call("GET", "/v1/models")["data"][0]

    def weights_info(self) -> dict:
        return self._call("GET", "/weights_info")

    def pause(self, mode: str = "keep") -> dict:
        return self._call("POST", "/pause", admin=True, params={"mode": mode})

    def resume(self) -> dict:
        return self._call("POST", "/resume", admin=True)

    def abort(self, request_ids: list[str]) -> list[str]:
        return self._call("POST", "/abort", admin=True, json={"request_ids": list(request_ids)})["aborted"]

    def sleep(self, level: int = 1, discard_weights: bool = False) -> dict:
        """Free the server's GPU memory (RolloutEngine.sleep); 409 while requests run."""
        return self._call("POST", "/sleep", admin=True, params={"level": level, "discard_weights": discard_weights})

    def wake_up(self, tags: Optional[list[str]] = None) -> dict:
        return self._call("POST", "/wake_up", admin=True, params={"tags": list(tags)} if tags else None)

    def is_sleeping(self) -> bool:
        return self._call("GET", "/is_sleeping")["is_sleeping"]

    def metrics(self) -> dict[str, float]:
        lines = self._call("GET", "/metrics").splitlines()
        return {k: float(v) for k, v in (ln.split() for ln in lines if ln and not ln.startswith("#"))}

    # ---- weights --------------------------------------------------------------------------------
    def update_weights_from_disk(self, path: str, version: int) -> dict:
        return self._call("POST", "/update_weights_from_disk", admin=True, json={"path": str(path), "version": version})

    def update_weights_from_ipc(self, named_tensors: Iterable, version: int) -> dict:
        """CUDA tensors of this process, shared by handle with a server on the same node."""
        from multiprocessing.reduction import ForkingPickler
        import torch.multiprocessing  # noqa: F401  (registers torch's CUDA tensor reductions)
        items = [(n, t.detach()) for n, t in named_tensors]
        if not all(t.is_cuda for _, t in items):
            raise ValueError("update_weights_from_ipc shares CUDA tensors; got tensors on the CPU "
                             "(use update_weights_from_disk or update_weights_from_group)")
        handles = base64.b64encode(bytes(ForkingPickler.dumps(items))).decode()
        return self._call("POST", "/update_weights_from_ipc", admin=True, json={"handles": handles, "version": version})

    def init_weight_group(self, master_address: str = "127.0.0.1", master_port: Optional[int] = None,
                          backend: Optional[str] = None, timeout_s: float = 600.0) -> dict:
        """Make this process rank 0 and the server rank 1 of a new default torch.distributed group."""
        import torch
        import torch.distributed as dist
        from .weights import free_port, join_group
        if dist.is_initialized() and self._group_backend is None:
            raise RuntimeError("this process already has a default torch.distributed group; the weight group needs "
                               "its own (push from a process without one, or use update_weights_from_disk / _ipc)")
        self.close_weight_group()
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if master_port is None:
            master_port = free_port(master_address)
        body = {"master_address": master_address, "master_port": master_port, "world_size": 2, "rank_offset": 1,
                "backend": backend, "timeout_s": timeout_s}
        with ThreadPoolExecutor(1) as ex:
            fut = ex.submit(self._call, "POST", "/init_weight_group", True, json=body)
            join_group(backend, master_address, master_port, 0, 2, timeout_s)
            self._group_backend = backend
            return fut.result()

    def update_weights_from_group(self, named_tensors: Iterable, version: int, bucket_bytes: int = 256 << 20) -> dict:
        from .weights import send_weights
        if self._group_backend is None:
            raise RuntimeError("no weight group: call init_weight_group() first")
        device = "cuda" if self._group_backend == "nccl" else None
        with ThreadPoolExecutor(1) as ex:
            fut = ex.submit(self._call, "POST", "/update_weights_from_group", True,
                            json={"version": version, "bucket_bytes": bucket_bytes})
            try:
                send_weights(named_tensors, src=0, bucket_bytes=bucket_bytes, device=device)
            except BaseException:         # the server's side fails too; report ours
                with contextlib.suppress(Exception):
                    fut.result()
                raise
            return fut.result()

    def close_weight_group(self) -> None:
        if self._group_backend is not None:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
            self._group_backend = None

    def close(self) -> None:
        self.close_weight_group()
        self.http.close()
