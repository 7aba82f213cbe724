"""W&B metrics for a RolloutWorker (or, through `_workers`, a fleet of them): a small sink over `wandb`.

`log()` writes one history row, for every committed part and (through `maybe_log()`) every `log_every_s`
within a wave: rates over the window since the last row, gauges now and running totals:
throughput/gen_tok_s, throughput/prefill_tok_s, gpu/busy_pct (CUDA), batch/running, batch/occupancy,
kv/pages_used, kv/usage, sched/preemptions, sched/recomputed_tokens, weights/updates, weights/staging_ms,
weights/barrier_ms, weights/policy_version, tokens/version_age_<a> (completed tokens sampled <a> versions
behind the live weights), tokens/discarded (sampled but in no output: the token in flight when a sequence
stops, is preempted or aborted), tokens/aborted, tokens/wasted, rollouts/completions, rollouts/mean_reward,
prefix_cache/hit_tokens and prefix_cache/queried_tokens (prompt tokens of admitted sequences; of them, served
from cached KV), prefix_cache/hit_rate (their ratio over the window, when it queried any), prefix_cache/pages.
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

    def _snapshot(self) -> tuple[float, dict]:
        return time.perf_counter(), self._workers()

    def observe(self, rows: list[dict]) -> None:
        """Rows as the job writes them: prompt, text, reward, policy_versions (-1: a token not generated, an
        observation of a trajectory) and finish_reason (a trajectory's: end)."""
        live = self._policy_version()
        for r in rows:
            self.completions += 1
            versions = [v for v in r["policy_versions"] if v >= 0]
            self.ages.update(live - v for v in versions)
            end = r.get("end", r.get("finish_reason"))
            if end == "abort":
                self.aborted_tokens += len(versions)
            if r.get("reward") is not None:
                self._rewards.append(r["reward"])
            if self.samples.maxlen:
                self.samples.append([r["prompt"], r["text"], r.get("reward"), end])

    def maybe_log(self) -> Optional[dict]:
        return self.log() if time.monotonic() >= self._next else None

    def log(self, extra: Optional[dict] = None) -> dict:
        snap = self._snapshot()
        (now, ws), (t0, ws0) = snap, self._last
        self._last, dt = snap, max(now - t0, 1e-9)

        def grown(key: str, k) -> float:    # since the last row; a restarted worker's counters start at 0
            return max(ws[k].get(key, 0) - ws0.get(k, {}).get(key, 0), 0)

        def growth(key: str) -> float:
            return sum(grown(key, k) for k in ws)

        def total(key: str) -> float:
            return sum(w.get(key, 0) for w in ws.values())

        rates = {k: grown("generated_tokens", k) / dt for k in ws}
        discarded = total("discarded_tokens")
        m = {
            "throughput/gen_tok_s": sum(rates.values()),
            "throughput/prefill_tok_s": growth("prefill_tokens") / dt,
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
            "prefix_cache/hit_tokens": total("prefix_cache_hit_tokens"),
            "prefix_cache/queried_tokens": total("prefix_cache_queries"),
            "prefix_cache/pages": total("prefix_cache_pages"),
            **{f"tokens/version_age_{a}": c for a, c in sorted(self.ages.items())},
            **self._extra(ws, rates),
        }
        if growth("prefix_cache_queries"):
            m["prefix_cache/hit_rate"] = growth("prefix_cache_hit_tokens") / growth("prefix_cache_queries")
        if self.cuda and ws:
            m["gpu/busy_pct"] = 100.0 * growth("gpu_busy_ms") / (dt * 1e3) / len(ws)
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
        last = self._last[1]       # a row only if tokens were generated since the last one
        if any(w["generated_tokens"] != last.get(k, {}).get("generated_tokens") for k, w in self._workers().items()):
            self.log(extra)
        elif extra:
            self.run.log(extra)
        if summary:
            self.run.summary.update(summary)
        self.run.finish()


def read_offline_run(run_dir, timeout_s: float = 30.0) -> tuple[list[dict], dict]:
    """(history rows, final summary) of an offline run folder (`.../offline-run-*`) from its `.wandb` file:
    LevelDB-log framing (32 KiB blocks, 7-byte record headers, a 7-byte `:W&B` header) around protobuf `Record`s.
    wandb's writer may still be flushing when run.finish() returns: rereads until the run's exit record is
    there, for up to timeout_s (then returns what there is: a killed run has none)."""
    from wandb.proto import wandb_internal_pb2 as pb
    (path,) = Path(run_dir).glob("*.wandb")
    deadline = time.monotonic() + timeout_s
    while True:
        data = path.read_bytes()
        if data[:4] != b":W&B":
            raise ValueError(f"{path} is not a W&B transaction log")
        history, summary, buf, pos, block, ended = [], {}, b"", 7, 32768, False
        while pos + 7 <= len(data):
            left = block - pos % block
            _crc, size, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
            if kind == 0:                     # the block's trailer, or zero padding to its end
                pos += left
                continue
            if pos + 7 + size > len(data):    # a record still being written
                break
            chunk, pos = data[pos + 7:pos + 7 + size], pos + 7 + size
            buf = chunk if kind in (1, 2) else buf + chunk      # FULL/FIRST start, MIDDLE/LAST append
            if kind not in (1, 4):
                continue
            rec = pb.Record()
            rec.ParseFromString(buf)
            which = rec.WhichOneof("record_type")
            if which == "history":
                history.append(_items(rec.history.item))
            elif which == "summary":
                summary.update(_items(rec.summary.update))
            ended |= which == "exit"
        if ended or time.monotonic() > deadline:
            return history, summary
        time.sleep(0.05)


def _items(items) -> dict:
    return {it.key or "/".join(it.nested_key): json.loads(it.value_json) for it in items}
