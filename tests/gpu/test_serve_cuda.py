"""Weight update through the HTTP server by CUDA IPC: a trainer process on the same GPU shares its
tensors by handle (torch's ForkingPickler), the server stages them whole and commits at a batch
boundary; the tokens after carry the new version, and a request after equals a fresh engine with
the new weights. The engine loop on a thread of the server's process, then in a process of its own
(the handles are opened there). Skipped without CUDA."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

import httpx  # noqa: E402

from rollout import RolloutEngine, SamplingParams  # noqa: E402
from rollout.client import RolloutClient  # noqa: E402
from rollout.serve import ServeOptions, start_in_thread  # noqa: E402
from rollout.worker import RolloutWorker  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KW = dict(device="cuda", dtype="bfloat16", max_model_len=512, num_kv_pages=256, max_num_batched_tokens=512)
# The trainer: another process on the same GPU; it keeps its tensors alive until the call returns.
TRAINER = """
import json, sys, torch
from rollout.models.loader import build_model, init_random
from rollout.client import RolloutClient
sys.path.insert(0, sys.argv[2])
from test_serve_cuda import _config
model = build_model(_config(), torch.bfloat16, torch.device("cuda"))
init_random(model, 1)
print(json.dumps(RolloutClient(sys.argv[1]).update_weights_from_ipc(model.hf_targets().items(), version=1)))
"""


def _config():
    from transformers import AutoConfig
    return AutoConfig.for_model("qwen2", vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)


def _push_from_trainer_process(url: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", TRAINER, url, str(Path(__file__).parent)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _worker() -> RolloutWorker:
    return RolloutWorker(RolloutEngine.from_config(_config(), seed=0, **KW))


@pytest.mark.parametrize("engine_process", [False, True], ids=["engine-thread", "engine-process"])
def test_update_weights_from_ipc_during_generation(engine_process):
    from rollout.serve.remote import EngineProcess
    prompt = list(range(10, 40))
    greedy = {"model": "m", "prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True,
              "return_token_ids": True, "logprobs": 0}
    server, thread, url = start_in_thread(EngineProcess(_worker) if engine_process else _worker(),
                                          ServeOptions(served_model_name="m"))
    try:
        client, versions, chunks = RolloutClient(url), [], 0
        with httpx.stream("POST", url + "/v1/completions", json={**greedy, "stream": True}, timeout=300) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                versions += json.loads(line[6:])["choices"][0]["policy_versions"]
                chunks += 1
                if chunks == 3:             # paused so the switch lands at a known token
                    client.pause("keep")
                    assert _push_from_trainer_process(url) == {"staged_version": 1, "live_version": 0}
                    client.resume()
        k = versions.index(1)
        assert k >= 3 and versions == [0] * k + [1] * (48 - k)
        after = httpx.post(url + "/v1/completions", json=greedy, timeout=300).json()["choices"][0]
        m = client.metrics()
        assert m["rollout_weight_updates_total"] == 1 and m["rollout_weight_staging_ms_total"] > 0
    finally:
        server.should_exit = True
        thread.join(60)
    fresh = RolloutEngine.from_config(_config(), seed=1, **KW).generate(
        [prompt], SamplingParams(max_new_tokens=48, temperature=0, ignore_eos=True), use_tqdm=False)[0].completions[0]
    assert after["token_ids"] == fresh.token_ids
    # the same kernels at the same batch size on both sides; bf16 logits, fp32 log_softmax
    assert max(abs(a - b) for a, b in zip(after["logprobs"]["token_logprobs"], fresh.logprobs)) <= 1e-3
