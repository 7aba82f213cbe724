"""Weight updates for a live engine, without draining it.

    validate   every name, shape and dtype before anything changes (a bad update is rejected whole)
    stage      copy into standby buffers on a side stream while decoding goes on; fp32-accumulated
               checksums of what was sent (also how NaN / inf are found: one host sync per update)
    commit     at a batch boundary, IN PLACE into the parameters (CUDA graphs keep their pointers);
               batches already enqueued finish on the old weights
    verify     checksum of what landed (on the side stream: decode does not wait for it) == checksum
               of what was sent; parameter pointers unchanged

On CPU staging and commit are ordered copies. Transports: tensors from this process, or a bucketed
torch.distributed broadcast from a trainer rank (`send_weights` / `receive_weights`; gloo or NCCL).
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

import torch

log = logging.getLogger(__name__)


class WeightUpdateError(ValueError):
    pass


@dataclass
class _Staged:
    version: int
    tensors: dict[str, torch.Tensor]
    sums: dict[str, torch.Tensor]           # name -> 0-d fp32 checksum of what was sent, on the device
    event: object = None                    # CUDA event: staging copies and sums done
    staging_ms: float = 0.0

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass
class _Landing:
    version: int
    names: list[str]
    sent_sums: torch.Tensor
    landed_sums: torch.Tensor
    keep_alive: dict = field(default_factory=dict)
    done: object = None                     # CUDA event after the landed checksums
    copy_events: tuple = ()                 # CUDA (start, end) around the in-place copies


def free_bytes(device: torch.device) -> Optional[int]:
    """Device memory a new allocation can use (free plus what torch's caching allocator holds unused);
    None on CPU (no fixed budget)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _sums_of(st: _Staged, names: list[str]) -> torch.Tensor:
    return torch.stack([st.sums[n] for n in names]) if names else torch.zeros(0)


def _checksums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """fp32-accumulated sums, each tensor read once. (An fp64 sum casts its input first: a 4 GiB copy of an
    8B model's embedding and 9x the memory traffic, ~45 ms of an H100 per pass.) The same reduction of an
    exact copy gives the same bits when both run one reduction: same shape and dtype, and (CUDA vectorizes by
    address alignment) staging buffers aligned as their parameters (_standby)."""
    return torch.stack([t.sum(dtype=torch.float32) for t in tensors]) if tensors else torch.zeros(0)


_ALIGN = 64     # bytes: a CUDA reduction's vectorization (so its summation order) follows the address's alignment


def _standby(dst: torch.Tensor) -> torch.Tensor:
    """An empty buffer like dst whose address matches dst's modulo _ALIGN: its checksum then runs the same
    reduction as the parameter's after the copy."""
    es = dst.element_size()
    if dst.device.type != "cuda" or not dst.is_contiguous() or dst.data_ptr() % es:
        return torch.empty_like(dst)
    base = torch.empty(dst.numel() + _ALIGN // es, dtype=dst.dtype, device=dst.device)
    off = ((dst.data_ptr() - base.data_ptr()) % _ALIGN) // es
    return base[off:off + dst.numel()].view(dst.shape)


class WeightSync:
    """Stages and commits updates into one engine's model (the caller serialises stage() and commit())."""

    def __init__(self, engine, *, require_full: bool = False):
        self.engine = engine
        self.require_full = require_full
        self.targets = engine.model.hf_targets()
        self.device = engine.device
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.track_pointers()
        self.pending: Optional[_Staged] = None
        self._landing: Optional[_Landing] = None
        self.metrics = {"updates": 0, "staging_ms": 0.0, "barrier_ms": 0.0, "bytes": 0,
                        "verified": 0, "committed_while_in_flight": 0}

    def track_pointers(self) -> None:
        """The parameters' addresses commits check against (again after a wake moved them; the engine
        re-captured its graphs)."""
        self._ptrs = {n: t.data_ptr() for n, t in self.targets.items()}

    # ---- validate + stage ----------------------------------------------------------------
    def validate(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        try:
            items = [(name, t) for name, t in named_tensors]  # consumed before returning (ranks run in lockstep)
        except (TypeError, ValueError):
            raise WeightUpdateError("weight update rejected: expected (name, tensor) pairs") from None
        seen = set()
        for name, t in items:
            if not isinstance(name, str) or not isinstance(t, torch.Tensor):
                raise WeightUpdateError(f"weight update rejected: expected (name, tensor) pairs, got "
                                        f"({type(name).__name__}, {type(t).__name__}) for {name!r}")
            if name not in self.targets:
                raise WeightUpdateError(f"weight update rejected: unknown tensor {name!r}")
            if name in seen:
                raise WeightUpdateError(f"weight update rejected: {name!r} given twice")
            seen.add(name)
            dst = self.targets[name]
            if tuple(t.shape) != tuple(dst.shape):
                raise WeightUpdateError(f"weight update rejected: {name} has shape {tuple(t.shape)}, "
                                        f"expected {tuple(dst.shape)}")
            if t.dtype != dst.dtype:
                raise WeightUpdateError(f"weight update rejected: {name} has dtype {t.dtype}, expected {dst.dtype}")
        if self.require_full:
            missing = self.engine.model.hf_missing(seen)
            if missing:
                raise WeightUpdateError(f"weight update rejected: missing {len(missing)} tensors, e.g. {missing[:3]}")
        if not items:
            raise WeightUpdateError("weight update rejected: no tensors")
        return items

    def stage(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, adopt: bool = False) -> None:
        """prepare, check_finite and install in one call (RolloutWorker runs the check outside its lock)."""
        self.install(self.check_finite(self.prepare(named_tensors, version, adopt)))

    def _check_version(self, version) -> None:
        if isinstance(version, bool) or not isinstance(version, int):
            raise WeightUpdateError(f"weight update rejected: version must be an integer, got {version!r}")
        if self.pending is not None and version <= self.pending.version:
            raise WeightUpdateError(f"weight update rejected: version {version} is not newer than "
                                    f"staged version {self.pending.version}")
        if version <= self.engine.policy_version:
            raise WeightUpdateError(f"weight update rejected: version {version} is not newer than "
                                    f"live version {self.engine.policy_version}")

    def _adoptable(self, t: torch.Tensor, dst: torch.Tensor) -> bool:
        """A caller's tensor can be the standby buffer itself: on this device, contiguous and (CUDA) aligned
        as its parameter (the checksums of both then run one reduction)."""
        return t.device == self.device and t.is_contiguous() and \
            (not self.cuda or (t.data_ptr() - dst.data_ptr()) % _ALIGN == 0)

    def prepare(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                adopt: bool = False) -> _Staged:
        """Validate, then copy into standby buffers and checksum them (a side stream on CUDA; nothing
        waits here). adopt: tensors already on this device are the standby buffers, not copied (the
        caller hands them over, e.g. received buckets): one extra copy of the weights, not two."""
        self._check_version(version)
        items = self.validate(named_tensors)
        adopted = {name for name, t in items if adopt and self._adoptable(t, self.targets[name])}
        copied = [name for name, _ in items if name not in adopted]
        self._check_room(sum(self.targets[n].numel() * self.targets[n].element_size() for n in copied))
        t0 = time.perf_counter()
        staged = {}
        ctx = torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()
        with ctx:
            if self.cuda:      # adopted tensors were written on the caller's stream
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
            for name, t in items:
                if name in adopted:
                    staged[name] = t
                    continue
                buf = _standby(self.targets[name])
                buf.copy_(t, non_blocking=True)
                staged[name] = buf
            sums = dict(zip(staged, _checksums(list(staged.values()))))
            event = None
            if self.cuda:
                event = torch.cuda.Event()
                event.record()
        return _Staged(version, staged, sums, event, (time.perf_counter() - t0) * 1e3)

    @staticmethod
    def check_finite(st: _Staged) -> _Staged:
        """Refuse the update whole, naming a tensor, if any element is NaN or inf. A NaN or inf element
        makes its tensor's sum non-finite; a non-finite sum of finite elements (fp32 overflow) is told
        apart by checking that tensor's elements."""
        if st.event is not None:
            st.event.synchronize()
        names = list(st.sums)
        ok = _sums_of(st, names).isfinite().tolist()
        bad = [n for n, good in zip(names, ok) if not good and not bool(st.tensors[n].isfinite().all())]
        if bad:
            raise WeightUpdateError(f"weight update rejected: {len(bad)} tensors hold NaN or inf, e.g. {bad[:3]}; "
                                    f"nothing was applied")
        return st

    def install(self, st: _Staged) -> None:
        """Make a checked update the pending one (merged over one staged earlier, not yet live)."""
        self._check_version(st.version)
        if self.pending is not None:
            st = _Staged(st.version, {**self.pending.tensors, **st.tensors}, {**self.pending.sums, **st.sums},
                         st.event, self.pending.staging_ms + st.staging_ms)
        self.pending = st

    def _short_of_room(self, nbytes: int) -> Optional[str]:
        """Why staging `nbytes` would not fit on the device now, or None if it would (or on CPU)."""
        free = free_bytes(self.device)
        if free is None or nbytes <= free:
            return None
        return (f"staging needs {nbytes / 1e9:.2f} GB on {self.device}, {free / 1e9:.2f} GB free; leave room for "
                f"one copy of the weights beside the KV cache (RolloutEngine(..., reserve_memory=\"weights\"), "
                f"or a smaller kv_cache_memory)")

    def _check_room(self, nbytes: int) -> None:
        """Refuse an update whose staging copies would not fit before allocating any (not an OOM halfway)."""
        short = self._short_of_room(nbytes)
        if short:
            raise WeightUpdateError(f"weight update rejected: {short}")

    def warn_if_no_room(self) -> None:
        """At start-up, not at the first update an hour in: warn that a full update cannot be staged now."""
        short = self._short_of_room(sum(t.numel() * t.element_size() for t in self.engine.model.parameters()))
        if short:
            log.warning("a full weight update would be refused: %s", short)

    # ---- commit at a batch boundary ---------------------------------------------------------
    def commit(self) -> Optional[int]:
        """Apply the staged update in place, on the compute stream between the batches already launched
        and the next one. Returns the new version, or None."""
        st, self.pending = self.pending, None
        if st is None:
            return None
        self.verify(block=True)          # at most one landing in flight
        names = list(st.tensors)
        if self.engine._inflight is not None:
            self.metrics["committed_while_in_flight"] += 1
        if self.cuda:
            compute = self.engine.pipeline.compute
            compute.wait_event(st.event)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t_launch = time.perf_counter()
            with torch.cuda.stream(compute):
                start.record()
                for n in names:
                    self.targets[n].copy_(st.tensors[n], non_blocking=True)
                self.engine.model.repack_decode_weights()    # packed copies the decode graphs read, if any
                end.record()
            self.metrics["barrier_launch_ms"] = self.metrics.get("barrier_launch_ms", 0) + (time.perf_counter() - t_launch) * 1e3
            with torch.cuda.stream(self.stream):       # the landed checksums beside decode, not before it
                self.stream.wait_event(end)
                landed = _checksums([self.targets[n] for n in names])
                done = torch.cuda.Event()
                done.record()
            self._landing = _Landing(st.version, names, _sums_of(st, names), landed, st.tensors, done, (start, end))
        else:
            t0 = time.perf_counter()
            for n in names:
                self.targets[n].copy_(st.tensors[n])
            self.metrics["barrier_ms"] += (time.perf_counter() - t0) * 1e3
            self._landing = _Landing(st.version, names, _sums_of(st, names),
                                     _checksums([self.targets[n] for n in names]), st.tensors)
        moved = {n: t.data_ptr() for n, t in self.targets.items() if t.data_ptr() != self._ptrs[n]}
        if moved:
            raise RuntimeError(f"parameter storage moved under the engine (CUDA graphs would read freed "
                               f"memory): {sorted(moved)[:3]}")
        self.engine.policy_version = st.version
        self.metrics["updates"] += 1
        self.metrics["staging_ms"] += st.staging_ms
        self.metrics["bytes"] += st.bytes
        self.verify(block=not self.cuda)
        return st.version

    def verify(self, block: bool = False) -> bool:
        """Compare landed and sent checksums once ready (blocking only if asked); raise on a mismatch."""
        ld = self._landing
        if ld is None:
            return True
        if ld.done is not None and not block and not ld.done.query():
            return False
        if ld.done is not None:
            ld.done.synchronize()
            start, end = ld.copy_events
            self.metrics["barrier_ms"] += start.elapsed_time(end)
        bad = [n for n, a, b in zip(ld.names, ld.sent_sums.tolist(), ld.landed_sums.tolist()) if a != b]
        self._landing = None
        if bad:
            raise RuntimeError(f"weight update v{ld.version} did not land exactly: checksum mismatch in {bad[:3]}")
        self.metrics["verified"] += 1
        return True


# ---- torch.distributed transport ---------------------------------------------------------------
def free_port(host: str = "") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def join_group(backend: str, addr: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
    """(Re)join this process's default torch.distributed group; rank 0 (the sender) hosts the store."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _buckets(specs: list[tuple[str, tuple, torch.dtype]], bucket_bytes: int):
    """Group consecutive tensors of one dtype into buckets of at most bucket_bytes."""
    bucket, size, dtype = [], 0, None
    for spec in specs:
        nbytes = torch.Size(spec[1]).numel() * torch.tensor([], dtype=spec[2]).element_size()
        if bucket and (spec[2] != dtype or size + nbytes > bucket_bytes):
            yield bucket
            bucket, size = [], 0
        bucket.append(spec)
        size, dtype = size + nbytes, spec[2]
    if bucket:
        yield bucket


def _manifest_bytes(manifest) -> int:
    return sum(torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size() for _, shape, dtype in manifest)


def _every_rank_has_room(ok: bool, device, group) -> bool:
    """One vote before the buckets: a receiver out of memory halfway would block every other rank."""
    import torch.distributed as dist
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def send_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], *, src: int = 0, group=None,
                 bucket_bytes: int = 256 << 20, device=None) -> int:
    """Trainer side: broadcast a manifest, then the tensors packed into flat buckets; returns bytes sent.
    Every rank of `group` must call send_weights (src) or receive_weights."""
    import torch.distributed as dist
    items = [(n, t.detach()) for n, t in named_tensors]
    manifest = [(n, tuple(t.shape), t.dtype) for n, t in items]
    dist.broadcast_object_list([manifest], src=src, group=group)
    if not _every_rank_has_room(True, device, group):
        raise WeightUpdateError(f"weight update rejected: a worker has no device room to receive "
                                f"{_manifest_bytes(manifest) / 1e9:.2f} GB; nothing was sent")
    by_name = dict(items)
    sent = 0
    for bucket in _buckets(manifest, bucket_bytes):
        flat = torch.cat([by_name[n].reshape(-1) for n, _, _ in bucket])
        if device is not None:
            flat = flat.to(device)
        dist.broadcast(flat, src=src, group=group)
        sent += flat.numel() * flat.element_size()
    return sent


def receive_weights(*, src: int = 0, group=None, device=None,
                    bucket_bytes: int = 256 << 20) -> Iterator[tuple[str, torch.Tensor]]:
    """Worker side of send_weights: (name, tensor) views of the received buckets. If any rank lacks
    device room for the whole update, all raise WeightUpdateError before any bucket moves."""
    import torch.distributed as dist
    box = [None]
    dist.broadcast_object_list(box, src=src, group=group)
    manifest = box[0]
    need, free = _manifest_bytes(manifest), free_bytes(torch.device(device or "cpu"))
    if not _every_rank_has_room(free is None or need <= free, device, group):
        mine = "" if free is None or need <= free else f"; this worker has {free / 1e9:.2f} GB free"
        raise WeightUpdateError(f"weight update rejected: a worker has no device room to receive "
                                f"{need / 1e9:.2f} GB{mine}; nothing was received")
    out = []
    for bucket in _buckets(manifest, bucket_bytes):
        numel = sum(torch.Size(shape).numel() for _, shape, _ in bucket)
        flat = torch.empty(numel, dtype=bucket[0][2], device=device)
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for name, shape, _ in bucket:
            n = torch.Size(shape).numel()
            out.append((name, flat[offset:offset + n].view(shape)))
            offset += n
    return iter(out)
