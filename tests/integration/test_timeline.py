"""The timeline tool on CPU: host spans are recorded per step and written as a Chrome
trace and a PNG (the GPU lane fills only on CUDA)."""
import json

from hf_reference import random_prompts
from rollout import RolloutEngine, SamplingParams
from rollout.bench import timeline


def test_trace_has_one_host_span_pair_per_step(model_dir, tiny_tokenizer, tmp_path):
    eng = RolloutEngine.from_pretrained(model_dir("llama"), device="cpu", dtype="float32", max_model_len=128,
                                        num_kv_pages=64)
    prompts = random_prompts(tiny_tokenizer, 3, 5, 20, seed=1)
    runs = {m: timeline.collect(eng, prompts, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))
            for m in ("sync", "async")}
    for sp in runs.values():
        names = [n for n, _, _ in sp["cpu"]]
        assert names[0::2] == ["schedule+build+launch"] * (len(names) // 2)
        assert all(e >= s for _, s, e in sp["cpu"]) and sp["gpu"] == []
        starts = [s for _, s, _ in sp["cpu"]]
        assert starts == sorted(starts)
    assert eng.cpu_spans is None and eng.pipeline.gpu_spans is None   # tracing is off again
    timeline.write_chrome_trace(runs, str(tmp_path / "t.json"))
    timeline.plot(runs, str(tmp_path / "t.png"))
    events = json.load(open(tmp_path / "t.json"))["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == sum(len(r["cpu"]) for r in runs.values()) and all(e["dur"] >= 0 for e in spans)
    assert (tmp_path / "t.png").stat().st_size > 1000
