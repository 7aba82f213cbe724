"""W&B metrics for a RolloutWorker (or, through `_workers`, a fleet of them): a small sink over `wandb`.

`log()` writes one history row, for every committed part and (through `maybe_log()`) every `log_every_s`
within a wave: rates over the window since the last row, gauges now and running totals:
throughput/gen_tok_s, throughput/prefill_tok_s, gpu/busy_pct (CUDA), batch/running, batch/occupancy,
kv/pages_used, kv/usage, sched/preemptions, sched/recomputed_tokens, weights/updates, weights/staging_ms,
weights/barrier_ms, weights/policy_version, tokens/version_age_<a> (completed tokens sampled <a> versions
behind the live weights), tokens/discarded (sampled but in no output: the token in flight when a sequence
stops, is preempted or aborted), tokens/aborted, tokens/wasted, rollouts/completions, rollouts/mean_reward.
`close()` logs a `samples` table and the summary; `read_offline_run` reads an offline run back.
"""
from __future__ import annotations

import json
import struct
import time
from collections import Counter, deque
from pathlib import Path
from typing import Optional


class MetricsSink:
    def __init__(self, worker, *, cuda: Optional[bool] = None, mode: str = "offline", project: str = "rollout",
                 name: Optional[str] = None, dir: Optional[str] = None, log_every_s: float = 10.0,
                 samples_table_size: int = 64, config: Optional[dict] = None):
        import wandb
        self.wandb, self.worker = wandb, worker
        self.cuda = worker.engine.device.type == "cuda" if cuda is None else cuda
        if dir:
            Path(dir).mkdir(parents=True, exist_ok=True)
        # console="off": wandb would otherwise wrap stdout/stderr under the progress bar.
        self.run = wandb.init(project=project, name=name, mode=mode, dir=dir, config=config,
                              settings=wandb.Settings(console="off"))
        self.log_every_s = float(log_every_s)
        self.samples: deque = deque(maxlen=max(int(samples_table_size), 0))
        self.ages: Counter = Counter()
        self.aborted_tokens = 0
        self.completions = 0
        self._rewards: list[float] = []
        self._last = self._snapshot()
        self._next = time.monotonic() + self.log_every_s

    def _workers(self) -> dict:
        """RolloutWorker.stats() per worker, under a key that changes when a worker's counters restart."""
        return {0: self.worker.stats()}

    def _policy_version(self) -> int:
        return self.worker.policy_version

    def _extra(self, workers: dict, gen_rates: dict) -> dict:
        """Keys that are not sums over the workers."""
        return {k: workers[0][k] for k in ("weights/updates", "weights/staging_ms", "weights/barrier_ms")}

    def _snapshot(self):
        ws = self._workers()
        return (time.perf_counter(), {k: w["generated_tokens"] for k, w in ws.items()},
                {k: w["prefill_tokens"] for k, w in ws.items()}, sum(w.get("gpu_busy_ms", 0.0) for w in ws.values()),
                ws)

    def observe(self, rows: list[dict]) -> None:
        """Rows as the job writes them (prompt, text, reward, finish_reason, completion_ids, policy_versions)."""
        live = self._policy_version()
        for r in rows:
            self.completions += 1
            self.ages.update(live - v for v in r["policy_versions"])
            if r["finish_reason"] == "abort":
                self.aborted_tokens += len(r["completion_ids"])
            if r.get("reward") is not None:
                self._rewards.append(r["reward"])
            if self.samples.maxlen:
                self.samples.append([r["prompt"], r["text"], r.get("reward"), r["finish_reason"]])

    def maybe_log(self) -> Optional[dict]:
        return self.log() if time.monotonic() >= self._next else None

    def log(self, extra: Optional[dict] = None) -> dict:
        now, gen, pre, busy, ws = snap = self._snapshot()
        t0, gen0, pre0, busy0, _ = self._last
        self._last, dt = snap, max(now - t0, 1e-9)
        rates = {k: max(v - gen0.get(k, 0), 0) / dt for k, v in gen.items()}

        def total(key: str) -> float:
            return sum(w.get(key, 0) for w in ws.values())

        discarded = total("discarded_tokens")
        m = {
            "throughput/gen_tok_s": sum(rates.values()),
            "throughput/prefill_tok_s": sum(max(v - pre0.get(k, 0), 0) for k, v in pre.items()) / dt,
            "batch/running": total("running_seqs"),
            "batch/occupancy": total("running_seqs") / max(total("max_num_seqs"), 1),
            "kv/pages_used": total("kv_pages_used"),
            "kv/usage": total("kv_pages_used") / max(total("kv_pages_total"), 1),
            "sched/preemptions": total("preemptions"),
            "sched/recomputed_tokens": total("recomputed_tokens"),
            "weights/policy_version": self._policy_version(),
            "tokens/generated": total("generated_tokens"), "tokens/discarded": discarded,
            "tokens/aborted": self.aborted_tokens, "tokens/wasted": discarded + self.aborted_tokens,
            "rollouts/completions": self.completions,
            **{f"tokens/version_age_{a}": c for a, c in sorted(self.ages.items())},
            **self._extra(ws, rates),
        }
        if self.cuda and ws:
            m["gpu/busy_pct"] = 100.0 * max(busy - busy0, 0) / (dt * 1e3) / len(ws)
        if self._rewards:                 # the mean reward since the last row
            m["rollouts/mean_reward"] = sum(self._rewards) / len(self._rewards)
            self._rewards = []
        self.run.log({**m, **(extra or {})})
        self._next = time.monotonic() + self.log_every_s
        return m

    def close(self, summary: Optional[dict] = None) -> None:
        extra = {}
        if self.samples:
            extra["samples"] = self.wandb.Table(columns=["prompt", "text", "reward", "finish_reason"],
                                                data=list(self.samples))
        if self._snapshot()[1] != self._last[1]:          # generated tokens since the last row
            self.log(extra)
        elif extra:
            self.run.log(extra)
        if summary:
            self.run.summary.update(summary)
        self.run.finish()


def read_offline_run(run_dir) -> tuple[list[dict], dict]:
    """(history rows, final summary) of an offline run folder (`.../offline-run-*`) from its `.wandb` file:
    LevelDB-log framing (32 KiB blocks, 7-byte record headers, a 7-byte `:W&B` header) around protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2 as pb
    (path,) = Path(run_dir).glob("*.wandb")
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B transaction log")
    history, summary, buf, pos, block = [], {}, b"", 7, 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, size, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:                     # the block's trailer, or zero padding to its end
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + size], pos + 7 + size
        buf = chunk if kind in (1, 2) else buf + chunk      # FULL/FIRST start, MIDDLE/LAST append
        if kind not in (1, 4):
            continue
        rec = pb.Record()
        rec.ParseFromString(buf)
        which = rec.WhichOneof("record_type")
        if which == "history":
            history.append({it.key or "/".join(it.nested_key): json.loads(it.value_json) for it in rec.history.item})
        elif which == "summary":
            summary.update({it.key or "/".join(it.nested_key): json.loads(it.value_json) for it in rec.summary.update})
    return history, summary
