"""W&B metrics for a RolloutWorker: a small sink over `wandb` (no framework of our own).

Each `log()` writes one history row: rates over the window since the last row, gauges of
the engine now, and running totals. The job calls it for every committed parquet part and,
through `maybe_log()` between worker steps, every `log_every_s` within a long wave:

    throughput/gen_tok_s, throughput/prefill_tok_s   engine.metrics deltas / window
    gpu/busy_pct                                     compute-stream busy time / window (CUDA only)
    batch/running, batch/occupancy                   running sequences, / max_num_seqs
    kv/pages_used, kv/usage                          pages held, / usable pages
    sched/preemptions, sched/recomputed_tokens
    weights/updates, weights/staging_ms, weights/barrier_ms, weights/policy_version
    tokens/version_age_<a>                           completed tokens sampled <a> versions behind
                                                     the live weights (when the completion finished)
    tokens/discarded                                 sampled but in no output: the pipeline launches
                                                     step k+1 before it reads step k's tokens, so a
                                                     sequence that stops on EOS or a stop string in
                                                     step k has one more token in flight, dropped (a
                                                     length limit is known ahead and costs none); also
                                                     the tokens in flight of a preempted or aborted
                                                     sequence. About one per completion: 24% of the
                                                     sampled tokens for ~3-token arithmetic answers,
                                                     ~1/(L+1) for L-token completions
    tokens/aborted                                   tokens of completions with finish_reason "abort"
    tokens/wasted                                    discarded + aborted
    rollouts/completions, rollouts/mean_reward       totals; reward over the window

`close()` logs a `samples` wandb.Table (prompt, text, reward, finish_reason) of the latest
completions, in a last metrics row if tokens were generated since the previous one (else in a
row of its own, not a row of zero rates), and the summary. `read_offline_run` reads an
offline run back without the network.
"""
from __future__ import annotations

import json
import struct
import time
from collections import Counter, deque
from pathlib import Path
from typing import Optional


class MetricsSink:
    def __init__(self, worker, *, mode: str = "offline", project: str = "rollout", name: Optional[str] = None,
                 dir: Optional[str] = None, log_every_s: float = 10.0, samples_table_size: int = 64,
                 config: Optional[dict] = None):
        import wandb
        self.wandb = wandb
        self.worker, self.engine = worker, worker.engine
        self.cuda = self.engine.device.type == "cuda"
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

    def _snapshot(self):
        m = self.engine.metrics
        return time.perf_counter(), m["generated_tokens"], m["prefill_tokens"], self.engine.pipeline.busy_ms

    def observe(self, rows: list[dict]) -> None:
        """Rows as the job writes them (prompt, text, reward, finish_reason, completion_ids,
        policy_versions)."""
        live = self.engine.policy_version
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
        now, gen, pre, busy = snap = self._snapshot()
        t0, gen0, pre0, busy0 = self._last
        self._last, dt = snap, max(now - t0, 1e-9)
        eng, sched, w = self.engine, self.engine.scheduler, self.worker.weights.metrics
        discarded = sched.num_discarded_tokens
        m = {
            "throughput/gen_tok_s": (gen - gen0) / dt,
            "throughput/prefill_tok_s": (pre - pre0) / dt,
            "batch/running": len(sched.running),
            "batch/occupancy": len(sched.running) / sched.max_num_seqs,
            "kv/pages_used": eng.kv.alloc.num_used,
            "kv/usage": eng.kv.alloc.num_used / max(eng.kv.alloc.num_usable, 1),
            "sched/preemptions": sched.num_preemptions,
            "sched/recomputed_tokens": sched.num_recomputed_tokens,
            "weights/updates": w["updates"], "weights/staging_ms": w["staging_ms"],
            "weights/barrier_ms": w["barrier_ms"], "weights/policy_version": eng.policy_version,
            "tokens/generated": gen, "tokens/discarded": discarded, "tokens/aborted": self.aborted_tokens,
            "tokens/wasted": discarded + self.aborted_tokens,
            "rollouts/completions": self.completions,
            **{f"tokens/version_age_{a}": c for a, c in sorted(self.ages.items())},
        }
        if self.cuda:
            m["gpu/busy_pct"] = 100.0 * (busy - busy0) / (dt * 1e3)
        return self._emit(m, extra)

    def _emit(self, m: dict, extra: Optional[dict]) -> dict:
        """Add the mean reward since the last log, write the row, schedule the next one."""
        if self._rewards:
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
    """(history rows, final summary) of an offline run folder (`.../offline-run-*`), read
    from its `.wandb` file: the LevelDB-log framing (32 KiB blocks, 7-byte record headers
    after a 7-byte `:W&B` file header) around wandb's protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = Path(run_dir).glob("*.wandb")
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B transaction log")
    history, summary, buf, pos, block = [], {}, b"", 7, 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:                      # block trailer padding
            pos += left
            continue
        _crc, size, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:                     # zero padding to the block end
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
