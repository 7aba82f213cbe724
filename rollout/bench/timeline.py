"""Timeline of the step loop: host spans (schedule + build + launch, wait + update) and compute-stream
spans (CUDA events on the host clock) of sync and async runs, as a Chrome trace and a PNG
(`python -m rollout.bench --trace PREFIX`).
"""
from __future__ import annotations

import json

LANES = ("CPU", "GPU compute")


def collect(engine, prompts, params) -> dict:
    """Run `generate` with tracing on; return host and device spans (seconds, host clock)."""
    engine.cpu_spans = []
    engine.pipeline.start_trace()
    engine.generate(prompts, params, use_tqdm=False)
    engine.drain()
    spans = {"cpu": engine.cpu_spans, "gpu": engine.pipeline.gpu_spans or []}
    engine.cpu_spans, engine.pipeline.gpu_spans = None, None
    return spans


def busy_fraction(gpu: list) -> float | None:
    if not gpu:
        return None
    wall = gpu[-1][1] - gpu[0][0]
    return sum(e - s for s, e in gpu) / wall if wall > 0 else None


def step_ms_curve(gpu: list, every: int) -> list[tuple[int, float]]:
    """(first step index, mean compute-stream ms) of each `every` steps: where in a run the time goes."""
    ms = [1e3 * (e - s) for s, e in gpu]
    return [(i, sum(ms[i:i + every]) / len(ms[i:i + every])) for i in range(0, len(ms), every)]


def write_chrome_trace(runs: dict, path: str) -> None:
    """runs: {mode: {"cpu": [(name, s, e)], "gpu": [(s, e)]}} -> Chrome trace JSON (µs)."""
    events = []
    for pid, (mode, sp) in enumerate(runs.items()):
        t0 = min([s for _, s, _ in sp["cpu"]] + [s for s, _ in sp["gpu"]])
        events.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": mode}})
        for tid, lane in enumerate(LANES):
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": lane}})
        for name, s, e in sp["cpu"]:
            events.append({"ph": "X", "pid": pid, "tid": 0, "name": name, "ts": (s - t0) * 1e6, "dur": (e - s) * 1e6})
        for i, (s, e) in enumerate(sp["gpu"]):
            events.append({"ph": "X", "pid": pid, "tid": 1, "name": f"batch {i}", "ts": (s - t0) * 1e6,
                           "dur": (e - s) * 1e6})
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def plot(runs: dict, path: str) -> None:
    """One panel per mode; lanes CPU (host work light, waiting dark) and GPU compute."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 1.8 * len(runs)), squeeze=False)
    for ax, (mode, sp) in zip(axes[:, 0], runs.items()):
        t0 = min([s for _, s, _ in sp["cpu"]] + [s for s, _ in sp["gpu"]])
        end = max(e for _, _, e in sp["cpu"]) - t0
        colors = {"schedule+build+launch": "tab:orange", "wait+update": "tab:gray"}
        for name, s, e in sp["cpu"]:
            ax.broken_barh([((s - t0) * 1e3, (e - s) * 1e3)], (10, 8), color=colors.get(name, "tab:blue"))
        for s, e in sp["gpu"]:
            if s - t0 <= end:
                ax.broken_barh([((s - t0) * 1e3, (e - s) * 1e3)], (0, 8), color="tab:green")
        busy = busy_fraction(sp["gpu"])
        ax.set_title(f"{mode}" + (f": GPU busy {100 * busy:.1f}%" if busy is not None else ""), fontsize=9)
        ax.set_yticks([4, 14], ["GPU", "CPU"])
        ax.set_xlim(0, end * 1e3)
        ax.set_xlabel("ms")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
