"""The rollout job: prompts from a dataset -> RolloutWorker(s) -> parquet parts + W&B.

    python scripts/rollout.py +experiment=grpo [key=value ...]
    python scripts/rollout.py +experiment=grpo fleet.num_workers=4     # 4 workers as Ray actors

`run(cfg)` takes the composed config (Hydra, `hydra.compose`, or a plain dict) and returns the
summary. Output: `<output_dir>/rollouts/part-XXXXX.parquet`, one atomically written file per wave,
one row per completion. Rerunning with the same output_dir resumes: prompts whose n samples are in
a committed part are skipped. A seeded prompt's seed comes from (seed, prompt index), so a wave
regenerated after a kill matches an uninterrupted run. fleet.num_workers == 1 runs one worker in
this process (Ray never imported); more run as a rollout.fleet.RolloutFleet of Ray actors, with the
same waves, parts and resume logic. With env.name set (`+experiment=agent`), each sample is a multi-turn
trajectory (rollout.multiturn) against that environment, one worker, one row per trajectory, same parts.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import inspect
import json
import logging
import os
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from rollout.config import EngineConfig
from rollout.request import SamplingParams
from rollout.metrics import MetricsSink

log = logging.getLogger(__name__)

SHIPPED_PROMPTS = Path(__file__).resolve().parent.parent / "data" / "arith_prompts.jsonl"


# ---- config schema: a type for every field, so Hydra rejects bad overrides with a clear error ----
@dataclass
class ModelConfig:
    # MISSING, not None: merging a group's `path: ???` onto a default would silently keep the default.
    path: Optional[str] = MISSING        # local HF folder; null = the embedded arith-tiny model


@dataclass
class DataConfig:
    path: Optional[str] = MISSING        # json/jsonl/parquet file or a save_to_disk folder; null = shipped set
    prompt_field: str = "prompt"         # a string (used as is) or a list of chat messages
    split: str = "train"                 # for a DatasetDict folder
    limit: Optional[int] = None          # first N rows only


@dataclass
class LoggingConfig:                     # keyword arguments of rollout.metrics.MetricsSink
    mode: str = "offline"                # wandb mode: offline | online | disabled
    project: str = "rollout"
    name: Optional[str] = None
    dir: Optional[str] = None            # null = output_dir
    log_every_s: float = 10.0            # a row per committed part, and this often within a wave
    samples_table_size: int = 64


@dataclass
class FleetConfig:                       # several RolloutWorkers as Ray actors (rollout.fleet.RolloutFleet)
    num_workers: int = 1                 # 1 = one worker in this process, Ray never imported
    num_gpus_per_worker: Optional[float] = None   # null = 1 on cuda (or device null on a GPU cluster), else 0
    num_cpus_per_worker: float = 1.0
    restart_dead: bool = False           # a dead actor's slot gets a fresh actor (its prompts go elsewhere anyway)
    ray_address: Optional[str] = None    # null = Ray's default (RAY_ADDRESS, a local `ray start`, a new one)


@dataclass
class EnvConfig:                         # multi-turn rollouts (rollout.multiturn); one worker (fleet.num_workers=1)
    name: Optional[str] = None           # null = one completion per sample | arith_chain | package.module:factory,
                                         # factory(prompt text, tokenizer) -> a rollout.multiturn.Environment
    max_turns: int = 4


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    output_dir: str = "outputs/rollout"
    batch_prompts: int = 64
    reward: Optional[str] = None


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore
    ConfigStore.instance().store(name="job_schema", node=JobConfig)


# ---- inputs --------------------------------------------------------------------------------------
def _load_dataset(path: Path, split: str):
    import datasets
    datasets.disable_progress_bars()
    if path.is_dir():
        ds = datasets.load_from_disk(str(path))
        ds = ds[split] if isinstance(ds, datasets.DatasetDict) else ds
    elif not path.is_file():
        raise FileNotFoundError(f"data.path {str(path)!r} does not exist")
    else:
        kind = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}.get(path.suffix)
        if kind is None:
            raise ValueError(f"data.path {str(path)!r}: expected .json, .jsonl, .parquet or a dataset folder")
        # datasets fails on an empty file with a bare StopIteration or ArrowInvalid: say what it is
        if kind == "parquet":
            import pyarrow.parquet as pq
            empty = pq.read_metadata(path).num_rows == 0
        else:
            empty = path.stat().st_size < 4096 and path.read_bytes().strip() in (b"", b"[]")
        ds = [] if empty else datasets.load_dataset(kind, data_files=str(path), split="train")
    if len(ds) == 0:
        raise ValueError(f"data.path {str(path)!r} has no rows")
    return ds


def load_prompts(data, tokenizer, max_model_len: Optional[int] = None,
                 vocab_size: Optional[int] = None) -> list[tuple[str, list[int]]]:
    """[(prompt text, token ids)] for every row, all checked before any generation. A string is
    tokenized with the tokenizer's special tokens; a message list goes through the chat template
    (which adds its own). A prompt with no room to generate or ids outside the vocabulary is an error."""
    path = Path(data.path) if data.path else SHIPPED_PROMPTS
    ds = _load_dataset(path, data.split)
    if data.prompt_field not in ds.column_names:
        raise ValueError(f"{path}: no column {data.prompt_field!r} (columns: {ds.column_names}); set data.prompt_field")
    if tokenizer is None:
        raise ValueError("the model has no tokenizer files (tokenizer.json / tokenizer_config.json); "
                         "the job needs one to tokenize its prompts")
    if data.limit is not None:
        ds = ds.select(range(min(data.limit, len(ds))))
    texts, templated = [], []
    for i, p in enumerate(ds[data.prompt_field]):
        if isinstance(p, str):
            texts.append(p)
        elif isinstance(p, list) and p and all(isinstance(m, dict) and "role" in m for m in p):
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError(f"{path} row {i}: {data.prompt_field!r} is a message list but the tokenizer "
                                 f"has no chat template")
            texts.append(tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True))
            templated.append(i)
        else:
            raise ValueError(f"{path} row {i}: {data.prompt_field!r} must be a string or a list of chat messages, "
                             f"got {p!r:.80}")
    ids = tokenizer(texts).input_ids
    if templated:
        for i, t in zip(templated, tokenizer([texts[i] for i in templated], add_special_tokens=False).input_ids):
            ids[i] = t
    for i, t in enumerate(ids):
        if not t:
            raise ValueError(f"{path} row {i}: the prompt has no tokens")
        if max_model_len is not None and len(t) >= max_model_len:
            raise ValueError(f"{path} row {i}: the prompt has {len(t)} tokens; engine.max_model_len={max_model_len} "
                             f"leaves no room to generate")
        if vocab_size is not None and not 0 <= min(t) <= max(t) < vocab_size:
            raise ValueError(f"{path} row {i}: the prompt has token ids outside the model's vocabulary "
                             f"[0, {vocab_size})")
    return list(zip(texts, ids))


def _load_fn(setting: str, name: Optional[str], builtin: dict[str, str], args: tuple[str, ...]):
    """A function setting: a builtin's name, `package.module:function`, or null; checked at start-up
    (importable, callable with `args`). `reward` is called as fn(prompt text, completion text) -> float
    per completion before its part is written; `env.name` as fn(prompt text, tokenizer) -> Environment."""
    if not name:
        return None
    target = builtin.get(name, name)
    mod, sep, attr = target.partition(":")
    if not (mod and sep and attr):
        raise ValueError(f"{setting}={name!r}: expected {', '.join(map(repr, builtin))}, 'package.module:function' "
                         f"or null")
    try:
        fn = getattr(importlib.import_module(mod), attr)
    except Exception as exc:  # noqa: BLE001  any import failure: name the setting, keep the cause
        raise ValueError(f"{setting}={name!r}: cannot load {attr!r} from module {mod!r}: {exc!r}") from exc
    if not callable(fn):
        raise ValueError(f"{setting}={name!r}: {target} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind(*args)
    except TypeError as exc:
        raise ValueError(f"{setting}={name!r}: {target} must take ({', '.join(args)}): {exc}") from exc
    except ValueError:
        pass                                 # no introspectable signature (a builtin)
    return fn


def _prompt_seed(seed: int, index: int) -> int:
    # Keyed on the prompt index, not submission order: a resumed run regenerates a wave exactly.
    return int.from_bytes(hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=4).digest(), "little") >> 1


# ---- output: atomic parquet parts ------------------------------------------------------------------
def _schema():
    import pyarrow as pa
    ints, floats = pa.list_(pa.int32()), pa.list_(pa.float32())     # float32: the logprobs are fp32
    return pa.schema([("prompt_index", pa.int64()), ("prompt", pa.string()), ("prompt_ids", ints),
                      ("sample_index", pa.int32()), ("completion_ids", ints), ("text", pa.string()),
                      ("logprobs", floats), ("processed_logprobs", floats),
                      ("policy_versions", pa.list_(pa.int64())), ("finish_reason", pa.string()),
                      ("reward", pa.float64())])


def _trajectory_schema():
    import pyarrow as pa
    ints = pa.list_(pa.int32())
    return pa.schema([("prompt_index", pa.int64()), ("prompt", pa.string()), ("sample_index", pa.int32()),
                      ("token_ids", ints), ("generated", pa.list_(pa.bool_())), ("logprobs", pa.list_(pa.float32())),
                      ("policy_versions", pa.list_(pa.int64())), ("spans", pa.list_(ints)),
                      ("turn_rewards", pa.list_(pa.float64())), ("turn_finish_reasons", pa.list_(pa.string())),
                      ("reward", pa.float64()), ("end", pa.string()), ("text", pa.string())])


def _routed_column(arrays: list):
    """int16 [positions, layers, k] arrays -> a list<layers x <k x int16>> column, built from numpy."""
    import numpy as np
    import pyarrow as pa
    _, L, k = arrays[0].shape
    inner = pa.FixedSizeListArray.from_arrays(np.concatenate([a.reshape(-1) for a in arrays]), k)
    offsets = pa.array(np.cumsum([0] + [len(a) for a in arrays]), pa.int32())
    return pa.ListArray.from_arrays(offsets, pa.FixedSizeListArray.from_arrays(inner, L))


def write_part(parts_dir: Path, k: int, rows: list[dict], schema=None) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq
    final, tmp = parts_dir / f"part-{k:05d}.parquet", parts_dir / f".part-{k:05d}.parquet.tmp"
    plain = [{c: v for c, v in r.items() if c != "routed_experts"} for r in rows]
    table = pa.Table.from_pylist(plain, schema=schema or _schema())
    if rows and "routed_experts" in rows[0]:      # sampling.return_routed_experts
        table = table.append_column("routed_experts", _routed_column([r["routed_experts"] for r in rows]))
    pq.write_table(table, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())             # the data is on disk before the rename makes it visible
    os.replace(tmp, final)
    return final


def scan_parts(parts_dir: Path, n: int, prompts: list[tuple[str, Any]]) -> tuple[set[int], int]:
    """(prompt indices done, next part number); removes tmp files of a wave killed mid-write. Raises
    rather than resume into output it would corrupt (other prompts, partial groups)."""
    import pyarrow.parquet as pq
    for tmp in parts_dir.glob(".part-*.tmp"):
        tmp.unlink()
    groups: dict[int, list[int]] = defaultdict(list)
    nxt = 0
    for p in sorted(parts_dir.glob("part-*.parquet")):
        nxt = max(nxt, int(p.stem.split("-")[1]) + 1)
        # parts written before `sample_index` had the name `group` for it
        sample = "sample_index" if "sample_index" in pq.read_schema(p).names else "group"
        t = pq.read_table(p, columns=["prompt_index", sample, "prompt"]).to_pydict()
        for i, g, text in zip(t["prompt_index"], t[sample], t["prompt"]):
            if i < len(prompts) and text != prompts[i][0]:
                raise ValueError(f"{p}: prompt {i} is {text!r} but the data has {prompts[i][0]!r}; "
                                 f"use a new output_dir")
            groups[i].append(g)
    bad = [i for i, g in groups.items() if sorted(g) != list(range(n))]
    if bad:
        raise ValueError(f"{parts_dir}: prompts {bad[:5]} do not have exactly samples 0..{n - 1}; "
                         f"the output is not from this config, use a new output_dir")
    return set(groups), nxt


def _check_fingerprint(out: Path, cfg) -> None:
    """Refuse to resume into an output of another model, data or sampling config (data.limit and
    engine settings may change)."""
    fp = {"model": cfg.model.path, "data": {k: cfg.data[k] for k in ("path", "prompt_field", "split")},
          "sampling": OmegaConf.to_container(cfg.sampling, resolve=True), "reward": cfg.reward}
    if cfg.env.name:
        fp["env"] = OmegaConf.to_container(cfg.env)
    path = out / "job.json"
    if path.exists():
        old = json.loads(path.read_text())
        if old != fp:
            diff = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in _changed(old, fp))
            raise ValueError(f"{out} holds rollouts of another config ({path}): {diff}; use a new output_dir")
    else:
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(fp, indent=1))


def _changed(old: dict, new: dict, prefix: str = "") -> Iterator[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) for each leaf that differs."""
    for k in sorted(old.keys() | new.keys()):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            yield from _changed(a, b, f"{prefix}{k}.")
        elif a != b:
            yield f"{prefix}{k}", a, b


def _rows(outs: dict[int, Any], prompts, reward_fn) -> list[dict]:
    """One row per completion, by prompt index then sample (completions come in sample order)."""
    return [{"prompt_index": i, "prompt": prompts[i][0], "prompt_ids": outs[i].prompt_token_ids, "sample_index": g,
             "completion_ids": c.token_ids, "text": c.text, "logprobs": c.logprobs,
             "processed_logprobs": c.processed_logprobs, "policy_versions": c.policy_versions,
             "finish_reason": c.finish_reason, "reward": reward_fn(prompts[i][0], c.text or "") if reward_fn else None,
             **({"routed_experts": c.routed_experts} if c.routed_experts is not None else {})}
            for i in sorted(outs) for g, c in enumerate(outs[i].completions)]


def _trajectory_rows(trajs: dict[int, list], prompts, tokenizer) -> list[dict]:
    """One row per trajectory, by prompt index then sample: the whole token sequence with its generated-token
    mask, per-token logprobs and versions (0.0 / -1 where not generated), per-turn spans, rewards and finish
    reasons, the total reward and how it ended; text: what follows the prompt, special tokens kept."""
    return [{"prompt_index": i, "prompt": prompts[i][0], "sample_index": t.sample_index, "token_ids": t.token_ids,
             "generated": t.generated, "logprobs": t.logprobs, "policy_versions": t.policy_versions,
             "spans": [list(sp) for sp in t.spans], "turn_rewards": t.rewards, "turn_finish_reasons": t.finish_reasons,
             "reward": sum(t.rewards), "end": t.end, "text": tokenizer.decode(t.token_ids[t.spans[0][0]:])}
            for i in sorted(trajs) for t in trajs[i]]


# ---- where the rollouts run: one worker here, or a Ray fleet -------------------------------------
def _engine_config(cfg, device: str) -> EngineConfig:
    return OmegaConf.to_object(cfg.engine).replace(device=device)


class _LocalRollouts:
    """fleet.num_workers == 1: one RolloutWorker in this process (Ray is never imported)."""

    def __init__(self, cfg, model_path, device: str):
        from rollout import RolloutEngine
        self.engine = RolloutEngine.from_pretrained(model_path, _engine_config(cfg, device))
        self.tokenizer, self.vocab_size = self.engine.tokenizer, self.engine.vocab_size
        self.max_model_len = self.engine.max_model_len

    def start(self) -> None:
        from rollout.worker import RolloutWorker
        self.worker = RolloutWorker(self.engine, expects_updates=False)
        self._busy0 = self.engine.pipeline.busy_ms

    def sink(self, **kw) -> MetricsSink:
        return MetricsSink(self.worker, **kw)

    def results(self, waves, prompts, params, batch: int) -> Iterator[list[tuple[int, int, Any]]]:
        """[(wave, prompt index, RequestOutput)] finished by each worker step. The next wave is queued
        as the current one starts draining (at most two in flight): the batch stays full."""
        owner: dict[int, tuple[int, int]] = {}          # request id -> (wave, prompt index)
        nxt = 0
        while True:
            while nxt < len(waves) and len(owner) < batch:
                idx = waves[nxt]
                ids = self.worker.add_requests([prompts[i][1] for i in idx], [params(i) for i in idx])
                owner.update((r, (nxt, i)) for r, i in zip(ids, idx))
                nxt += 1
            if not owner:
                return
            yield [(*owner.pop(o.request_id), o) for o in self.worker.step()]

    def trajectories(self, waves, prompts, params, make_env, max_turns: int) -> Iterator[list[tuple[int, int, Any]]]:
        """[(wave, prompt index, its n Trajectories)] per wave, a wave's turns batched together."""
        from rollout.multiturn import run_trajectories
        for w, idx in enumerate(waves):
            trajs = run_trajectories(self.worker, [prompts[i][1] for i in idx],
                                     lambda j, k: make_env(prompts[idx[j]][0], self.tokenizer),
                                     [params(i) for i in idx], max_turns)
            n = len(trajs) // len(idx)       # ordered by (prompt, sample), n each
            yield [(w, i, trajs[j * n:(j + 1) * n]) for j, i in enumerate(idx)]

    def generated_tokens(self) -> int:
        return self.engine.metrics["generated_tokens"]

    def summary(self, gen_s: float) -> dict:
        busy = self.engine.pipeline.busy_ms - self._busy0
        cuda = self.engine.device.type == "cuda" and gen_s > 0
        st = self.engine.stats()
        return {"gpu_busy": f"{100 * busy / (gen_s * 1e3):.1f}%" if cuda else "n/a",
                "prefix_cache_hit_tokens": st["prefix_cache_hit_tokens"],
                "prefix_cache_queried_tokens": st["prefix_cache_queries"]}

    def close(self) -> None:
        pass


class _FleetRollouts:
    """fleet.num_workers > 1: Ray actors build the engines; this process holds only the tokenizer and
    the model's config.json (prompt validation)."""

    def __init__(self, cfg, model_path):
        import importlib.util
        from transformers import AutoConfig
        from rollout.engine import _load_tokenizer
        if importlib.util.find_spec("ray") is None:
            raise ImportError(f"fleet.num_workers={cfg.fleet.num_workers} runs workers as Ray actors: "
                              f"pip install -e '.[fleet]' in the rollout checkout (or fleet.num_workers=1)")
        path = Path(model_path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is not a local Hugging Face checkpoint folder (no config.json)")
        self.cfg, self.fc, self.model_path = cfg, cfg.fleet, str(path)
        self.tokenizer = _load_tokenizer(path)
        hf = AutoConfig.from_pretrained(str(path), local_files_only=True)
        self.vocab_size = hf.vocab_size
        self.max_model_len = EngineConfig(max_model_len=cfg.engine.max_model_len).model_len(hf)
        self.fleet, self.own_ray, self.cuda, self.tokens = None, False, False, 0

    def _placement(self, cluster_gpus: float) -> tuple[str, float]:
        """(worker device, GPUs per actor) from device and fleet.num_gpus_per_worker."""
        dev, gpus = self.cfg.engine.device, self.fc.num_gpus_per_worker
        if dev is None:
            dev = "cuda" if (cluster_gpus if gpus is None else gpus) > 0 else "cpu"
        dev = "cuda" if dev.startswith("cuda") else dev      # an actor sees its own GPUs from cuda:0
        if gpus is None:
            gpus = 1 if dev == "cuda" else 0
        if (dev == "cuda") != (gpus > 0):
            raise ValueError(f"engine.device={dev} with fleet.num_gpus_per_worker={gpus:g}: CUDA workers need GPUs "
                             f"and CPU workers none (Ray hides the GPUs an actor did not ask for)")
        return dev, float(gpus)

    def start(self) -> None:
        import ray
        from rollout.fleet import EngineSpec, RolloutFleet
        fc = self.fc
        if ray.is_initialized():
            log.info("using the Ray cluster this process is already connected to (fleet.ray_address ignored)")
        else:
            ray.init(address=fc.ray_address, include_dashboard=False)
            self.own_ray = True
        have = ray.cluster_resources()
        dev, gpus = self._placement(have.get("GPU", 0))
        need = {"CPU": fc.num_workers * fc.num_cpus_per_worker, "GPU": fc.num_workers * gpus}
        if any(have.get(k, 0) < v for k, v in need.items()):
            raise ValueError(f"fleet.num_workers={fc.num_workers} needs {need['CPU']:g} CPUs and {need['GPU']:g} GPUs "
                             f"but the Ray cluster has {have.get('CPU', 0):g} and {have.get('GPU', 0):g}; lower "
                             f"fleet.num_workers or fleet.num_cpus_per_worker, or add nodes")
        spec = EngineSpec(self.model_path, _engine_config(self.cfg, dev), worker_kwargs={"expects_updates": False})
        self.fleet = RolloutFleet(fc.num_workers, spec,
                                  num_gpus_per_worker=gpus, num_cpus_per_worker=fc.num_cpus_per_worker,
                                  restart_dead=fc.restart_dead)
        self.cuda = dev == "cuda"
        log.info("fleet: %d workers on %s (%g GPUs, %g CPUs each)", fc.num_workers, dev, gpus, fc.num_cpus_per_worker)

    def sink(self, **kw) -> MetricsSink:
        return _FleetMetricsSink(self.fleet, self.cuda, **kw)

    def results(self, waves, prompts, params, batch: int) -> Iterator[list[tuple[int, int, Any]]]:
        """[(wave, prompt index, RequestOutput)] per prompt, in completion order. At most two waves per
        live worker in flight (as one worker keeps): waves finish roughly in order, batches stay full."""
        order = [(w, i) for w, idx in enumerate(waves) for i in idx]
        stream = self.fleet.stream([prompts[i][1] for _, i in order], [params(i) for _, i in order],
                                   max_inflight=2 * batch * self.fleet.num_live)
        try:
            for o in stream:                 # o.request_id is the position in `order`
                w, i = order[o.request_id]
                self.tokens += sum(len(c.token_ids) for c in o.completions)
                yield [(w, i, o)]
        finally:
            stream.close()                   # interrupted: cancel what is still out

    def generated_tokens(self) -> int:
        return self.tokens                   # returned with finished prompts

    def summary(self, gen_s: float) -> dict:
        try:
            st = self.fleet.stats()
        except Exception as exc:  # noqa: BLE001  the summary must not hide the job's own error
            log.warning("fleet stats: %r", exc)
            return {"gpu_busy": "n/a"}
        ws = st["workers"]
        busy = [w.get("gpu_busy_ms", 0.0) / (gen_s * 1e3) for w in ws.values()] if gen_s > 0 else []
        return {"gpu_busy": f"{100 * sum(busy) / len(busy):.1f}%" if self.cuda and busy else "n/a",
                "workers": st["num_live"], "fleet_tok_s": round(st["tok_s"], 1),
                "worker_tok_s": {str(i): round(w["tok_s"], 1) for i, w in ws.items()},
                "dead_actors": st["dead_actors"], "resubmitted_prompts": st["resubmitted_prompts"]}

    def close(self) -> None:
        if self.fleet is not None:
            self.fleet.shutdown()
            self.fleet = None
        if self.own_ray:
            import ray
            ray.shutdown()
            self.own_ray = False


class _FleetMetricsSink(MetricsSink):
    """MetricsSink over a RolloutFleet: the gauges summed over the workers' stats (fleet.stats()),
    plus each worker's generated tok/s and queue depth, the live actors, version skew and faults."""

    def __init__(self, fleet, cuda: bool, **kw):
        self.fleet, self._stats = fleet, {"workers": {}}
        super().__init__(fleet, cuda=cuda, **kw)

    def _workers(self) -> dict:
        try:
            self._stats = self.fleet.stats()
        except Exception as exc:  # noqa: BLE001  an actor died since the last call: keep the last stats
            log.warning("fleet stats: %r", exc)
        # keyed by (slot, restarts): a restarted actor's counters start again from 0
        return {(i, w["restarts"]): w for i, w in self._stats["workers"].items()}

    def _policy_version(self) -> int:
        return self.fleet.version

    def _extra(self, workers: dict, gen_rates: dict) -> dict:
        st = self._stats
        return {"weights/updates": st.get("weight_updates", 0),
                **{f"fleet/{k}": st.get(k, 0) for k in ("num_live", "version_skew", "dead_actors",
                                                        "restarted_actors", "resubmitted_prompts")},
                **{f"fleet/worker_{i}/gen_tok_s": r for (i, _), r in gen_rates.items()},
                **{f"fleet/worker_{i}/{k}": w[k] for (i, _), w in workers.items()
                   for k in ("outstanding", "load", "kv_demand", "kv_used_frac") if k in w}}


# ---- the job -------------------------------------------------------------------------------------
def run(cfg) -> dict:
    t_start = time.perf_counter()
    cfg = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)
    merged = OmegaConf.merge(OmegaConf.structured(JobConfig), cfg)   # types checked without Hydra too
    missing = sorted(OmegaConf.missing_keys(cfg) | OmegaConf.missing_keys(merged))  # a merge drops '???'
    if missing:
        raise ValueError(f"missing mandatory config values: {missing} (e.g. model.path=/path/to/ckpt, "
                         f"or null for the embedded model)")
    cfg = merged
    import torch
    from rollout.tasks import arith
    # Everything is checked before the output dir is touched: settings, then the model, then every prompt.
    if cfg.fleet.num_workers < 1:
        raise ValueError(f"fleet.num_workers must be >= 1, got {cfg.fleet.num_workers}")
    if cfg.batch_prompts < 1:
        raise ValueError(f"batch_prompts must be >= 1, got {cfg.batch_prompts}")
    if cfg.data.limit is not None and cfg.data.limit < 1:
        raise ValueError(f"data.limit must be >= 1 or null (every row), got {cfg.data.limit}")
    reward_fn = _load_fn("reward", cfg.reward, {"arith": "rollout.tasks.arith:reward"}, ("prompt", "completion"))
    make_env = _load_fn("env.name", cfg.env.name, {"arith_chain": "rollout.tasks.arith_chain:ArithChain"},
                        ("prompt", "tokenizer"))
    if make_env is not None:
        if cfg.env.max_turns < 1:
            raise ValueError(f"env.max_turns must be >= 1, got {cfg.env.max_turns}")
        if cfg.fleet.num_workers != 1:
            raise ValueError(f"env.name={cfg.env.name!r}: multi-turn rollouts run on one worker; "
                             f"set fleet.num_workers=1")
        if reward_fn is not None:
            raise ValueError(f"reward={cfg.reward!r} with env.name={cfg.env.name!r}: the environment rewards each "
                             f"turn; set reward=null")
    device = cfg.engine.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model_path = cfg.model.path or arith.ensure_default_model()
    rollouts = (_LocalRollouts(cfg, model_path, device) if cfg.fleet.num_workers == 1
                else _FleetRollouts(cfg, model_path))
    base = SamplingParams(**OmegaConf.to_container(cfg.sampling, resolve=True))
    base.validate(rollouts.vocab_size)
    prompts = load_prompts(cfg.data, rollouts.tokenizer, rollouts.max_model_len, rollouts.vocab_size)
    try:
        rollouts.start()                     # a fleet's actors build their engines here
        return _generate(cfg, rollouts, base, prompts, reward_fn, make_env, t_start)
    finally:
        rollouts.close()


def _generate(cfg, rollouts, base, prompts, reward_fn, make_env, t_start: float) -> dict:
    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm
    n, B = base.n, cfg.batch_prompts
    out = Path(cfg.output_dir)
    parts_dir = out / "rollouts"
    _check_fingerprint(out, cfg)
    parts_dir.mkdir(parents=True, exist_ok=True)
    done, next_part = scan_parts(parts_dir, n, prompts)

    def params(i: int):
        return base if base.seed is None else dataclasses.replace(base, seed=_prompt_seed(base.seed, i))

    pending = [i for i in range(len(prompts)) if i not in done]
    waves = [pending[k:k + B] for k in range(0, len(pending), B)]
    log.info("%d prompts x %d samples: %d already in %s, %d to generate in %d waves",
             len(prompts), n, len(prompts) - len(pending), parts_dir, len(pending), len(waves))
    if make_env is None:
        source, schema = rollouts.results(waves, prompts, params, B), None
        to_rows = functools.partial(_rows, prompts=prompts, reward_fn=reward_fn)
    else:
        source = rollouts.trajectories(waves, prompts, params, make_env, cfg.env.max_turns)
        schema = _trajectory_schema()
        to_rows = functools.partial(_trajectory_rows, prompts=prompts, tokenizer=rollouts.tokenizer)

    sink = rollouts.sink(config=OmegaConf.to_container(cfg, resolve=True),
                         **{**OmegaConf.to_container(cfg.logging, resolve=True), "dir": cfg.logging.dir or str(out)})
    got: list[dict] = [{} for _ in waves]
    tot = {"prompts": 0, "completions": 0, "tokens": 0, "reward_sum": 0.0, "rewards": 0}
    turn_rewards = defaultdict(list)             # trajectories: turn -> its rewards
    t0, gen0 = time.perf_counter(), rollouts.generated_tokens()
    bar = tqdm(total=len(pending), desc="rollout", unit="prompt")
    ok = False
    try:
        with logging_redirect_tqdm():
            for finished in source:
                for w, i, o in finished:
                    got[w][i] = o
                    bar.update(1)
                    if len(got[w]) < len(waves[w]):
                        continue
                    rows = to_rows(got[w])
                    got[w] = {}
                    path = write_part(parts_dir, next_part, rows, schema)
                    next_part += 1
                    sink.observe(rows)
                    sink.log()           # a row per part: a run of a few seconds still shows its rates
                    rw = [r["reward"] for r in rows if r["reward"] is not None]
                    tot["prompts"] += len(waves[w])
                    tot["completions"] += len(rows)
                    tot["tokens"] += sum(v >= 0 for r in rows for v in r["policy_versions"])   # generated
                    tot["reward_sum"] += sum(rw)
                    tot["rewards"] += len(rw)
                    for r in rows:
                        for j, x in enumerate(r.get("turn_rewards", ())):
                            turn_rewards[j].append(x)
                    log.info("%s: %d prompts, %d completions; total %d tokens, %.0f tok/s", path.name,
                             len(waves[w]), len(rows), tot["tokens"], tot["tokens"] / (time.perf_counter() - t0))
                sink.maybe_log()
                rate = (rollouts.generated_tokens() - gen0) / max(time.perf_counter() - t0, 1e-9)
                bar.set_postfix(tok_s=f"{rate:.0f}", refresh=False)
        ok = True
    except KeyboardInterrupt:
        log.warning("interrupted: %d parts committed in %s; rerun the same command to resume", next_part, parts_dir)
        raise
    finally:
        bar.close()
        gen_s = time.perf_counter() - t0
        summary = {
            "prompts": tot["prompts"], "completions": tot["completions"], "tokens": tot["tokens"],
            "skipped_prompts": len(prompts) - len(pending), "parts": next_part,
            "wall_s": round(time.perf_counter() - t_start, 2), "generate_s": round(gen_s, 2),
            "tok_s": round(tot["tokens"] / gen_s, 1) if gen_s > 0 else 0.0,
            "mean_reward": tot["reward_sum"] / tot["rewards"] if tot["rewards"] else None,
            **rollouts.summary(gen_s), "output": str(parts_dir)}
        if turn_rewards:
            summary["turn_mean_rewards"] = [round(sum(v) / len(v), 4) for _, v in sorted(turn_rewards.items())]
        sink.close(summary if ok else None)
    mr = summary["mean_reward"]
    print(f"rollout: {summary['prompts']} prompts ({summary['skipped_prompts']} already done), "
          f"{summary['completions']} completions, {summary['tokens']} tokens in {summary['generate_s']:.2f} s "
          f"({summary['tok_s']:.0f} tok/s), wall {summary['wall_s']:.1f} s, "
          f"mean reward {'n/a' if mr is None else f'{mr:.3f}'}, GPU busy {summary['gpu_busy']}; "
          f"{summary['parts']} parts in {summary['output']}")
    if "turn_mean_rewards" in summary:
        print(f"trajectories: mean reward per turn {summary['turn_mean_rewards']}; prefix cache served "
              f"{summary['prefix_cache_hit_tokens']} of {summary['prefix_cache_queried_tokens']} prompt tokens")
    if "workers" in summary:
        per = ", ".join(f"worker {i} {r:.0f}" for i, r in summary["worker_tok_s"].items())
        print(f"fleet: {summary['workers']} workers, {summary['fleet_tok_s']:.0f} tok/s ({per}); "
              f"{summary['dead_actors']} dead actors, {summary['resubmitted_prompts']} prompts resubmitted")
    return summary
