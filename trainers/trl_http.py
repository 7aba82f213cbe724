"""TRL's GRPOTrainer / RLOOTrainer generating through a rollout server in another process (HTTP).

    server:  python -m rollout.serve --model PATH --dtype float32
    trainer: trainer = GRPOTrainer(model=..., args=GRPOConfig(..., use_vllm=False), ...)
             attach_http_generator(trainer, "http://127.0.0.1:8000")
             trainer.train()

The in-process `TRLGenerationAdapter` runs over `HTTPWorker`, a stand-in RolloutWorker: generation by the native
/generate (exact logprobs and versions), weights over a torch.distributed group (rank 0 here) or by CUDA IPC.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch

from rollout.client import RolloutClient

from .trl_generator import TRLGenerationAdapter, attach_generator

TRANSPORTS = ("group", "ipc")


class _RemoteWeights:
    """What the adapter reads of RolloutWorker.weights: tensor names and dtypes (device None: sent from where they
    are), the staged version and the barrier stat."""

    def __init__(self, client: RolloutClient):
        self.client = client
        self.targets = {n: SimpleNamespace(dtype=getattr(torch, s["dtype"]), device=None, shape=tuple(s["shape"]))
                        for n, s in client.weights_info()["tensors"].items()}

    @property
    def pending(self):
        v = self.client.weights_info()["staged_version"]
        return None if v is None else SimpleNamespace(version=v)

    @property
    def metrics(self) -> dict:
        return {"barrier_ms": self.client.metrics()["rollout_weight_barrier_ms_total"]}


class HTTPWorker:
    """The part of RolloutWorker's interface TRLGenerationAdapter uses, over a RolloutClient."""
    remote = True

    def __init__(self, client: RolloutClient, weight_transport: str = "group", bucket_bytes: int = 256 << 20):
        if weight_transport not in TRANSPORTS:
            raise ValueError(f"weight_transport must be one of {TRANSPORTS}, got {weight_transport!r}")
        self.client, self.transport, self.bucket_bytes = client, weight_transport, bucket_bytes
        info = client.models()
        self.engine = SimpleNamespace(vocab_size=info["vocab_size"], max_model_len=info["max_model_len"])
        self.weights = _RemoteWeights(client)

    @property
    def policy_version(self) -> int:
        return self.client.weights_info()["live_version"]

    def generate(self, prompts, sampling_params):
        return self.client.generate(prompts, list(sampling_params))

    def update_weights(self, named_tensors, version: int) -> None:
        items = list(named_tensors)       # walked whole before anything is sent
        if self.transport == "ipc":
            self.client.update_weights_from_ipc(items, version)
            return
        if self.client._group_backend is None:
            self.client.init_weight_group()
        self.client.update_weights_from_group(items, version, self.bucket_bytes)

    def close(self) -> None:
        self.client.close()


def attach_http_generator(trainer, base_url: str = "http://127.0.0.1:8000", *, api_key: Optional[str] = None,
                          admin_key: Optional[str] = None, weight_transport: str = "group",
                          **kw) -> TRLGenerationAdapter:
    """`attach_generator` with the engine behind `python -m rollout.serve` at `base_url`, from one trainer process.
    Keyword arguments go to TRLGenerationAdapter; close `adapter.worker` after training to leave the weight group."""
    acc = getattr(trainer, "accelerator", None)
    if acc is not None and acc.num_processes > 1:
        raise NotImplementedError("attach_http_generator drives a server from a single trainer process (the weight "
                                  "push and the versions are rank-local); for several ranks use attach_generator")
    worker = HTTPWorker(RolloutClient(base_url, api_key, admin_key), weight_transport)
    return attach_generator(trainer, worker, **kw)
