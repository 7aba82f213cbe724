"""Server side of the three weight transports: (hf_name, tensor) pairs the engine loop stages whole
and commits at a batch boundary. They run in a worker thread, so reading a checkpoint or waiting on
a collective does not stall decode."""
from __future__ import annotations

import base64
import pickle
import time
from pathlib import Path

import torch


def read_safetensors(path: str, targets: dict) -> list[tuple[str, torch.Tensor]]:
    """A safetensors folder (one file, or shards with an index), cast to the engine's dtypes. A tied
    head the engine does not hold and rotary buffers are skipped; other unknown names are kept (the
    worker rejects the update whole, naming them)."""
    from safetensors import safe_open
    from ..models.loader import checkpoint_files
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"path {path!r} is not a folder on the server")
    items = []
    for file in checkpoint_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                dst = targets.get(name)
                if dst is None and (name == "lm_head.weight" or name.endswith("rotary_emb.inv_freq")):
                    continue
                t = f.get_tensor(name)
                items.append((name, t if dst is None else t.to(dst.dtype)))
    return items


def load_ipc_handles(handles_b64: str, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """Rebuild CUDA tensors a trainer process on this node shared with torch's ForkingPickler (the
    engine copies them while staging). Unpickling runs the client's code: admin key, trusted host."""
    if device.type != "cuda":
        raise ValueError(f"update_weights_from_ipc shares CUDA memory between processes on one node; this engine "
                         f"runs on {device.type} (use update_weights_from_disk or update_weights_from_group)")
    import torch.multiprocessing  # noqa: F401  (registers the CUDA tensor rebuilders)
    items = pickle.loads(base64.b64decode(handles_b64))
    if not isinstance(items, list) or not all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str)
                                              and isinstance(x[1], torch.Tensor) for x in items):
        raise ValueError("handles must encode a list of (name, CUDA tensor) pairs")
    return items


def release_gradually(items: list, every: int = 16, pause_s: float = 1e-4) -> None:
    """Empty `items` `every` entries at a time, sleeping between (the GIL goes to whichever thread waits).
    Freeing a received CUDA-IPC tensor runs torch's deleter under the GIL (a stream sync, the trainer's
    refcount file, the handle's close; ~60 us on an H200): dropping 8B's 291 at once held it ~17 ms, and the
    engine thread's commit launches (the decode stall) waited behind it. One at a time added ~0.4 s to the
    update's round trip; 16 hold it ~1 ms."""
    while items:
        del items[-every:]
        time.sleep(pause_s)


def join_group(master_address: str, master_port: int, world_size: int, rank: int, backend: str,
               timeout_s: float) -> None:
    """Join the trainer's torch.distributed group (the trainer is rank 0) as this process's default one."""
    from ..weights import join_group as join
    if not 0 < rank < world_size:
        raise ValueError(f"rank_offset must be in [1, world_size), got {rank} with world_size={world_size}")
    join(backend, master_address, master_port, rank, world_size, timeout_s)


def receive_group(device: torch.device, bucket_bytes: int) -> list[tuple[str, torch.Tensor]]:
    import torch.distributed as dist
    from ..weights import receive_weights
    if not dist.is_initialized():
        raise ValueError("no weight group: POST /init_weight_group first")
    if device.type == "cuda":
        torch.cuda.set_device(device)     # NCCL works on this thread's current device
    return list(receive_weights(src=0, device=device if device.type == "cuda" else None, bucket_bytes=bucket_bytes))
